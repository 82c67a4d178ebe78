"""rowgemm.c: torch's product to float rounding, each row bit for bit what it gets alone
(whatever rows, tiles and threads come with it), only where it is asked for, and nothing
changed where it cannot be built."""

import pytest
import torch

from gumiho import linear, rowgemm
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run

from conftest import DEVICE

needs_rowgemm = pytest.mark.skipif(rowgemm.kernel() is None,
                                   reason="rowgemm.c does not build or run here")


@needs_rowgemm
@pytest.mark.host
@pytest.mark.parametrize("shape", [(96, 64), (1536, 576), (13, 37), (1, 8), (4099, 20)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_same_product_as_torch(shape, bias):
    """Odd sizes too: columns not a whole tile, a k % 8 tail, one output."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for rows in (1, 2, 3, 4, 5, 7, 8, 12, 16, 33, rowgemm.MAX_ROWS):
        x = torch.randn(rows, k, generator=g)
        assert rowgemm.takes(x, weight)
        got = rowgemm.linear(x, weight, b)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b),
                                   rtol=1e-5, atol=1e-4)  # sums of ~k unit terms


@needs_rowgemm
@pytest.mark.host
def test_each_row_gets_what_it_gets_alone_whatever_comes_with_it():
    """A tree verify's rows equal one-token steps' bit for bit: for every row count, at
    every position, and on one thread as on several."""
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(1536, 576, generator=g), torch.randn(1536, generator=g)
    x = torch.randn(rowgemm.MAX_ROWS, 576, generator=g)
    alone = torch.cat([rowgemm.linear(x[r:r + 1], weight, bias) for r in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in {1, 2, threads}:
            torch.set_num_threads(count)
            for rows in (2, 3, 4, 5, 9, 16, 31, rowgemm.MAX_ROWS):
                assert torch.equal(rowgemm.linear(x[:rows], weight, bias), alone[:rows])
            assert torch.equal(rowgemm.linear(x[3:10].view(1, 7, 576), weight, bias)[0],
                               alone[3:10])  # leading dims, an offset view
    finally:
        torch.set_num_threads(threads)
    assert linear.rows_independent(torch.float32, rowgemm.MAX_ROWS)


@needs_rowgemm
@pytest.mark.host
def test_only_small_no_grad_float32_cpu_products_are_taken():
    weight = torch.randn(64, 16)
    assert rowgemm.takes(torch.randn(2, 3, 16), weight)
    assert not rowgemm.takes(torch.randn(rowgemm.MAX_ROWS + 1, 16), weight)  # torch's
    assert not rowgemm.takes(torch.randn(4, 16).bfloat16(), weight.bfloat16())
    assert not rowgemm.takes(torch.randn(4, 16).double(), weight.double())
    assert not rowgemm.takes(torch.randn(4, 16), weight.t().contiguous().t()[:, :16])
    assert not rowgemm.takes(torch.randn(4, 16, requires_grad=True), weight)
    assert not rowgemm.takes(torch.randn(4, 16), weight.clone().requires_grad_(True))
    with torch.no_grad():
        assert rowgemm.takes(torch.randn(4, 16, requires_grad=True), weight)
    if torch.cuda.is_available():
        assert not rowgemm.takes(torch.randn(4, 16, device="cuda"), weight.cuda())


@pytest.mark.host
def test_nothing_changes_where_it_cannot_be_built(monkeypatch, tmp_path):
    """No compiler, a failing build, or $GUMIHO_ROWGEMM=0: no kernel, torch's products run
    (a packed float32 layer falls back to MKL's path), and nothing is left half-written."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    try:
        rowgemm.kernel.cache_clear()
        monkeypatch.setenv("GUMIHO_ROWGEMM", "0")
        assert rowgemm.kernel() is None
        assert not rowgemm.takes(torch.randn(2, 8), torch.randn(4, 8))
        rowgemm.kernel.cache_clear()
        monkeypatch.delenv("GUMIHO_ROWGEMM")
        monkeypatch.setenv("CC", "false")  # a "compiler" that fails
        monkeypatch.setattr(rowgemm.shutil, "which",
                            lambda name: "/bin/false" if name == "false" else None)
        assert rowgemm.kernel() is None
        assert not list(tmp_path.rglob("*.so"))
        layer = linear.PackedLinear(torch.nn.Linear(16, 8).requires_grad_(False))
        assert not layer.rows and (layer.packed is not None or linear.MKL_REORDER is None)
    finally:
        rowgemm.kernel.cache_clear()


@needs_rowgemm
@pytest.mark.host
def test_a_built_kernel_is_reused_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    try:
        rowgemm.kernel.cache_clear()
        assert rowgemm.kernel() is not None
        built = list(tmp_path.rglob("rowgemm-*.so"))
        assert len(built) == 1 and not list(tmp_path.rglob("tmp*"))
        stamp = built[0].stat().st_mtime_ns
        rowgemm.kernel.cache_clear()
        monkeypatch.setattr(rowgemm, "_build", lambda *a: pytest.fail("built twice"))
        assert rowgemm.kernel() is not None and built[0].stat().st_mtime_ns == stamp
    finally:
        rowgemm.kernel.cache_clear()


@needs_rowgemm
@pytest.mark.skipif(DEVICE.type != "cpu", reason="rowgemm is the CPU's")
def test_verifies_run_rowgemm_and_equal_plain(smollm2, monkeypatch):
    """SmolLM2 in float32 on the CPU: every layer product and the logits of plain steps and
    of a prompt-lookup chain's verifies (up to 11 rows) run rowgemm, and the tokens are
    plain decoding's."""
    calls = []
    product = rowgemm.linear

    def counting(x, *args):
        calls.append(x.numel() // x.shape[-1])
        return product(x, *args)

    monkeypatch.setattr(rowgemm, "linear", counting)
    ids = smollm2.chat_ids("Repeat this sentence exactly three times: the quick brown fox "
                           "jumps over the lazy dog near the river bank.")
    config = GenerateConfig(max_new_tokens=32)
    plain = run(smollm2, PlainDrafter(), ids, config)
    assert calls and set(calls[-10:]) == {1}  # one-token steps
    calls.clear()
    out = run(smollm2, load_drafter("lookup", smollm2, tree=None), ids, config)
    assert out.token_ids == plain.token_ids
    assert max(out.accept_lengths) >= 4 and any(4 <= rows <= 11 for rows in calls), calls
