"""Every method's greedy output equals plain decoding on the real target, whether the
drafter is random (little is accepted) or an oracle (almost everything is)."""

import json
import subprocess
import sys

import pytest

from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import GenerateConfig, run

from conftest import REFERENCE_PROMPT as PROMPT
from conftest import REFERENCE_TOKENS as N
from drafters_for_tests import oracle_drafter


@pytest.mark.parametrize("method, fta", [("gumiho", "off"), ("gumiho", "exact"),
                                         ("eagle2", "off"), ("medusa", "off")])
def test_random_drafter_equals_plain(smollm2, reference, method, fta):
    ids, plain = reference
    tree = TreeConfig.for_method(method, fta=fta, total_tokens=24)
    out = run(smollm2, load_drafter(method, smollm2, "random", tree=tree), ids,
              GenerateConfig(max_new_tokens=N))
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("method, fta", [("gumiho", "off"), ("gumiho", "exact"),
                                         ("eagle2", "off")])
def test_oracle_drafter_equals_plain_and_accepts_a_lot(smollm2, reference, method, fta):
    ids, plain = reference
    full = ids + plain.token_ids
    tree = TreeConfig.for_method(method, fta=fta)
    out = run(smollm2, oracle_drafter(method, smollm2, full, tree), ids,
              GenerateConfig(max_new_tokens=N))
    assert out.token_ids == plain.token_ids
    per_cycle = 8 if method == "gumiho" else 7  # all drafts + the bonus token
    assert max(out.accept_lengths) == per_cycle and out.tau > 4


def test_cli_gumiho_random_json(smollm2, reference):
    ids, plain = reference
    out = subprocess.run(
        [sys.executable, "-m", "gumiho.generate", "--method", "gumiho", "--draft", "random",
         "--prompt", PROMPT, "--max-new-tokens", str(N), "--total-tokens", "16", "--json"],
        capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["token_ids"] == plain.token_ids


@pytest.mark.host
def test_tree_flags_each_method_reads_are_accepted():
    """--depth for Gumiho (fewer MLP levels) and --lookup for every drafting method are
    honoured, so they must pass the flag check; flags a method ignores are refused."""
    from gumiho.config import check_tree_options
    from gumiho.errors import GumihoError

    for method in ("gumiho", "eagle2", "medusa"):
        check_tree_options(method, {"depth": 4, "lookup": 6})
    check_tree_options("lookup", {"lookup": 6})
    with pytest.raises(GumihoError, match="does not apply"):
        check_tree_options("ar", {"lookup": 6})
    with pytest.raises(GumihoError, match="does not apply"):
        check_tree_options("medusa", {"top_k": 4})
