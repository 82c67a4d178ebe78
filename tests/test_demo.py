"""`gumiho demo` runs the embedded default with the shipped drafter, losslessly."""

import pytest

from gumiho import demo


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_shipped_drafters_load_and_decode_like_plain(smollm2, method, capsys):
    code = demo.main(["--method", method, "--max-new-tokens", "24", "--total-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "outputs identical" in out and "speedup" in out
