"""rowamx.c: bf16 products to bf16 rounding, rounded as torch rounds, each row bit for bit
what it gets alone (whatever rows and threads come with it), used by packed bf16 layers and
heads for 1 to MAX_ROWS rows only, nothing changed where it cannot run (its build reused
from the cache: tests/test_rowgemm.py); and on SmolLM2 a
bf16 verify as wide as the reference tree is one-token decoding, bit for bit."""

import pytest
import torch

from gumiho import kernels, linear, rowamx
from gumiho.config import TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run

from conftest import DEVICE

needs_rowamx = pytest.mark.skipif(rowamx.kernel() is None,
                                  reason="no AMX tiles here, or rowamx.c does not build")


def product(x, weight, bias=None):
    return rowamx.Prepared(weight, bias)(x)


@needs_rowamx
@pytest.mark.host
@pytest.mark.parametrize("shape", [(1536, 576), (37, 50), (16, 32), (1, 8), (4099, 20)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_to_bf16_rounding(shape, bias):
    """Odd sizes too: outputs not a whole tile, k not a whole block, one output."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    for rows in (1, 2, 15, 16, 17, 33, rowamx.MAX_ROWS):
        x = torch.randn(rows, k, generator=g).bfloat16()
        expected = x.double() @ weight.double().T + (0 if b is None else b.double())
        got = product(x, weight, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), expected, rtol=2 ** -8, atol=1e-4)


@needs_rowamx
@pytest.mark.host
def test_each_row_gets_what_it_gets_alone_whatever_comes_with_it():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 576, generator=g).bfloat16()
    x = torch.randn(rowamx.MAX_ROWS, 576, generator=g).bfloat16()
    every = product(x, weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(product(x, weight), every)
    finally:
        torch.set_num_threads(threads)
    for start, stop in ((0, 1), (5, 6), (0, 16), (3, 20), (40, 80), (79, 80)):
        assert torch.equal(product(x[start:stop], weight), every[start:stop]), (start, stop)


@needs_rowamx
@pytest.mark.host
def test_sums_are_rounded_as_torch_rounds():
    """One product a row (k = 1: exact in float32, then the bias added in float32), so the
    output is torch's float32 -> bf16 conversion of it: to nearest even, overflow to inf,
    NaN kept."""
    x = torch.tensor([[1.0], [3.0], [-7.0], [1e30], [float("inf")], [float("nan")],
                      [0.3], [255.0]]).bfloat16()
    weight = torch.tensor([[1.0], [1.00390625], [3e38], [-0.5]]).bfloat16()
    bias = torch.tensor([0.0, 2.0 ** -9, 1.0, -3.0])
    expected = (x.float() @ weight.float().T + bias).bfloat16()
    got = product(x, weight, bias)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])


@needs_rowamx
@pytest.mark.host
def test_packed_bf16_layers_and_heads_use_it_for_a_verifys_rows_only():
    g = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(64, 96, bias=True).bfloat16().requires_grad_(False)
    packed = linear.PackedLinear(layer)
    head = linear.pack_weight(torch.randn(4096, 64, generator=g).bfloat16())
    assert packed.tiles is not None and head.tiles is not None
    assert "rowamx" in repr(packed)
    with torch.no_grad():
        for rows in (1, 16, rowamx.MAX_ROWS, rowamx.MAX_ROWS + 1):
            x = torch.randn(1, rows, 64, generator=g).bfloat16()
            takes = rows <= rowamx.MAX_ROWS
            assert packed.tiles.takes(x) == takes and head.tiles.takes(x) == takes
            onednn = linear.ONEDNN_LINEAR(x, packed.packed, packed.bias, "none", [], "")
            assert torch.equal(packed(x), product(x, layer.weight, layer.bias) if takes
                               else onednn)
            assert torch.equal(linear.vocab_linear(x, None, None, head),
                               head.tiles(x) if takes else linear.ONEDNN_LINEAR(
                                   x, head.onednn, None, "none", [], ""))
        x = torch.randn(3, 64, generator=g)  # float32 rows, cast as oneDNN's product casts them
        assert torch.equal(packed(x), product(x.bfloat16(), layer.weight, layer.bias))
    assert not packed.tiles.takes(torch.randn(2, 64, requires_grad=True).bfloat16())
    assert not packed.tiles.takes(torch.randn(2, 64))  # float32 rows are rowgemm's
    assert linear.rows_independent(torch.bfloat16, rowamx.MAX_ROWS)


@pytest.mark.host
def test_nothing_changes_where_it_cannot_run(monkeypatch, tmp_path):
    """$GUMIHO_ROWAMX=0, no AMX, or a compiler that fails: no kernel, oneDNN's products
    run, nothing is left half-written."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    try:
        rowamx.kernel.cache_clear()
        monkeypatch.setenv("GUMIHO_ROWAMX", "0")
        assert rowamx.kernel() is None
        rowamx.kernel.cache_clear()
        monkeypatch.delenv("GUMIHO_ROWAMX")
        monkeypatch.setattr(rowamx, "amx_cpu", lambda: False)
        assert rowamx.kernel() is None
        rowamx.kernel.cache_clear()
        monkeypatch.setattr(rowamx, "amx_cpu", lambda: True)
        monkeypatch.setenv("CC", "false")
        monkeypatch.setattr(kernels.shutil, "which",
                            lambda name: "/bin/false" if name == "false" else None)
        assert rowamx.kernel() is None
        assert not list(tmp_path.rglob("*.so"))
        layer = torch.nn.Linear(16, 8).bfloat16().requires_grad_(False)
        if linear.ONEDNN_REORDER is not None:
            assert linear.PackedLinear(layer).tiles is None
    finally:
        rowamx.kernel.cache_clear()


@pytest.mark.host
def test_amx_cpu_is_false_where_torch_cannot_tell(monkeypatch):
    assert isinstance(rowamx.amx_cpu(), bool)

    def broken():
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", broken, raising=False)
    assert rowamx.amx_cpu() is False
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert rowamx.amx_cpu() is False


@needs_rowamx
@pytest.mark.skipif(DEVICE.type != "cpu", reason="rowamx is the CPU's")
def test_a_reference_width_bf16_verify_is_one_token_steps_bit_for_bit():
    """SmolLM2 in bf16 with `sdpa_invariant`: a 75-node verify (the reference tree's 64 and
    a lookup chain's 11; oneDNN's own kernels keep a row's bits up to 32) gives each node
    the features and logits of one-token steps down its path, and the shipped Gumiho at the
    reference tree decodes plain bf16 decoding's tokens."""
    from gumiho.engine import TargetRunner, prefill, verify_tree
    from gumiho.target import load_target
    from gumiho.tree import DraftTree

    target = load_target("smollm2", device="cpu", dtype="bfloat16",
                         attn_implementation="sdpa_invariant")
    prompt = torch.tensor([target.chat_ids("Name three colours.")])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, 20000, (75,), generator=g)
    parents = torch.cat([torch.tensor([-1]), torch.arange(74) // 3])  # a ternary tree

    def fresh():
        cache = TargetRunner(target, "eager").cache_for(prompt.shape[1] + 80)
        prefill(target, cache, prompt)
        return cache

    with torch.no_grad():
        features, logits = verify_tree(target, fresh(), DraftTree.from_parents(tokens, parents))
        for node in (0, 1, 9, 40, 74):
            path = [node]
            while parents[path[0]] >= 0:
                path.insert(0, int(parents[path[0]]))
            cache = fresh()
            for n in path:
                one = DraftTree.from_parents(tokens[n:n + 1], torch.tensor([-1]))
                step_features, step_logits = verify_tree(target, cache, one)
                cache.commit(1)
            assert torch.equal(features[node], step_features[0]), node
            assert torch.equal(logits[node], step_logits[0]), node
    ids = target.chat_ids("List three uses of a paperclip.")
    config = GenerateConfig(max_new_tokens=40)
    drafter = load_drafter("gumiho", target, "gumiho/assets/smollm2/gumiho",
                           tree=TreeConfig.for_method("gumiho"))
    assert drafter.tree.total_tokens >= 64
    out = run(target, drafter, ids, config)
    assert out.token_ids == run(target, PlainDrafter(), ids, config).token_ids
    assert max(out.accept_lengths) > 2
