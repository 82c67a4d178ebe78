"""rowgemm.c: torch's product to float rounding, each row bit for bit what it gets alone
(whatever rows, tiles and threads come with it), only where it is asked for, and nothing
changed where it cannot be built."""

import os

import pytest
import torch

from gumiho import kernels, linear, rowamx, rowgemm
from gumiho.demo import shipped_drafter
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run

from conftest import DEVICE, REPEAT_PROMPT, rows_through

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
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_weight_gives_the_float32_product_of_its_values(dtype):
    """Widened in registers: bit for bit the product with the float32 copy, a k % 8 tail
    and a bias too, each row as alone."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(1003, 581, generator=g).to(dtype)
    bias, x = torch.randn(1003, generator=g), torch.randn(9, 581, generator=g)
    assert rowgemm.takes(x, weight)
    got = rowgemm.linear(x, weight, bias)
    assert torch.equal(got, rowgemm.linear(x, weight.float(), bias))
    assert torch.equal(got[4:5], rowgemm.linear(x[4:5], weight, bias))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight.float(), bias),
                               rtol=1e-5, atol=1e-4)


# where torch finds AVX-512 the blocks must run: a build whose blocks fail rowgemm.py's
# own check (and so stay off) fails these tests rather than skip them
needs_wide = pytest.mark.skipif(rowgemm.kernel() is None
                                or torch.backends.cpu.get_cpu_capability() != "AVX512"
                                or os.environ.get("GUMIHO_ROWGEMM512") == "0",
                                reason="no AVX-512 here (or rowgemm.c does not build, or "
                                "GUMIHO_ROWGEMM512=0)")


@needs_wide
@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_avx512_blocks_give_the_avx2_blocks_bits(dtype):
    """Rows in pairs, 16 lanes at a time, add what the AVX2 blocks' 8 lanes add in the
    same order: bit for bit their products for every row count (odd ones leave half a pair
    empty), column tile, k % 8 tail, bias or none, on one thread and on several, so a
    machine with AVX-512 decodes what one without it does."""
    g = torch.Generator().manual_seed(7)
    threads = torch.get_num_threads()
    try:
        for n, k in ((1536, 576), (13, 37), (7, 8), (100, 1001)):
            weight = torch.randn(n, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g)
            x = torch.randn(rowgemm.MAX_ROWS, k, generator=g)
            for count in {1, threads}:
                torch.set_num_threads(count)
                for rows in (3, 4, 5, 8, 9, 13, 16, 17, 33, 64, rowgemm.MAX_ROWS):
                    for b in (bias, None):
                        assert rowgemm.set_wide(False) is False
                        narrow = rowgemm.linear(x[:rows], weight, b)
                        assert rowgemm.set_wide(True) is True
                        assert torch.equal(rowgemm.linear(x[:rows], weight, b), narrow)
    finally:
        torch.set_num_threads(threads)
        rowgemm.set_wide(True)


@needs_wide
@pytest.mark.host
def test_gumiho_rowgemm512_0_keeps_the_avx2_blocks(monkeypatch):
    """$GUMIHO_ROWGEMM512=0 (to compare, or when chasing a problem): the AVX2 blocks only,
    and measured costs are cached apart (the kernels' identity says which ran)."""
    wide = rowgemm.identity()
    assert wide.endswith("-avx512")
    monkeypatch.setenv("GUMIHO_ROWGEMM512", "0")
    try:
        rowgemm.kernel.cache_clear()
        assert rowgemm.kernel() is not None and not rowgemm.kernel().wide
        assert rowgemm.set_wide(True) is False
        assert rowgemm.identity() == wide.removesuffix("-avx512")
    finally:
        monkeypatch.delenv("GUMIHO_ROWGEMM512")
        rowgemm.kernel.cache_clear()
    assert rowgemm.kernel().wide and rowgemm.identity() == wide


@needs_rowgemm
@pytest.mark.host
def test_only_exactly_16_bit_weights_are_narrowed():
    """float16 where every value is one (a drafter saved in float16), else bfloat16 where
    every value is one, else the float32 weight stays as it is."""
    g = torch.Generator().manual_seed(4)
    half = torch.randn(64, 16, generator=g).half().float()
    assert rowgemm.narrowed(half).dtype == torch.float16
    brain = half.bfloat16().float() * 2.0 ** 40  # past float16's range
    assert rowgemm.narrowed(brain).dtype == torch.bfloat16
    assert torch.equal(rowgemm.narrowed(brain).float(), brain)
    assert rowgemm.narrowed(torch.randn(64, 16, generator=g)) is None  # float32 values
    assert rowgemm.narrowed(half.double()) is None
    nan = half.clone()
    nan[0, 0] = float("nan")
    assert rowgemm.narrowed(nan) is None  # torch.equal: NaN is never "the same"
    late = torch.randn(64, 80, generator=g).half().float()
    late[-1, -1] = 0.1  # neither a float16 nor a bfloat16 value, past the first 4096
    assert rowgemm.narrowed(late) is None


@needs_rowgemm
@pytest.mark.host
def test_a_packed_float16_layer_reads_16_bits_and_computes_the_same():
    """What a drafter saved in float16 gets: half the bytes, the same products at every
    row count (past MAX_ROWS torch's, from the widened weight), the weight as it was."""
    g = torch.Generator().manual_seed(5)
    dense = torch.nn.Linear(576, 1536)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(1536, 576, generator=g).half().float())
    dense.requires_grad_(False)
    layer = linear.PackedLinear(dense)
    assert layer.narrow is not None and layer.narrow.dtype == torch.float16
    assert layer.plain is None and "stored as torch.float16" in repr(layer)
    assert torch.equal(layer.weight, dense.weight)
    with torch.no_grad():
        for rows in (1, 6, rowgemm.MAX_ROWS):
            x = torch.randn(rows, 576, generator=g)
            assert torch.equal(layer(x), rowgemm.linear(x, dense.weight, dense.bias))
        x = torch.randn(rowgemm.MAX_ROWS + 3, 576, generator=g)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, dense.weight, dense.bias))


@needs_rowgemm
@pytest.mark.skipif(DEVICE.type != "cpu", reason="rowgemm is the CPU's")
@pytest.mark.parametrize("method", ["gumiho", "eagle2"])  # Medusa: einsums, no layers
def test_a_shipped_float16_drafter_runs_from_16_bits(smollm2, method):
    """The shipped drafters are saved in float16: every layer they load into float32 is
    kept in 16 bits (the target's lm_head rows of the draft head are not theirs)."""
    drafter = load_drafter(method, smollm2, str(shipped_drafter(method)), tree=None)
    layers = [m for m in drafter.model.modules() if isinstance(m, linear.PackedLinear)]
    assert layers and all(m.narrow is not None and m.narrow.dtype == torch.float16
                          for m in layers)


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


@needs_rowgemm
@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 49152), (3, 49152), (5, 7), (2, 1), (4, 33), (1, 8)])
def test_argmax_is_torchs_argmax(dtype, shape):
    """rowargmax picks what torch.argmax picks: the first of equal maxima (ties, -0.0 and
    0.0), the first NaN, infinities, a row of -inf, lengths off the eight lanes."""
    g = torch.Generator().manual_seed(shape[1] + shape[0])
    x = torch.randn(*shape, generator=g).to(dtype)
    m, n = shape
    nan, zeros, ties, inf = x.clone(), torch.zeros_like(x), (x * 2).round(), x.clone()
    nan[:, n // 2], nan[:, -1] = float("nan"), float("nan")
    zeros[:, n // 3] = -0.0
    inf[:, 0], inf[:, -1] = float("inf"), float("inf")
    minus_inf = torch.full_like(x, float("-inf"))
    for case in (x, nan, zeros, ties, inf, minus_inf):
        got = rowgemm.argmax(case)
        assert got.dtype == torch.long and torch.equal(got, case.argmax(-1))
    strided = torch.randn(n, m, generator=g).to(dtype).T  # not contiguous: torch's own
    assert torch.equal(rowgemm.argmax(strided), strided.argmax(-1))


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
        logits = torch.randn(2, 9)
        assert torch.equal(rowgemm.argmax(logits), logits.argmax(-1))
        rowgemm.kernel.cache_clear()
        monkeypatch.delenv("GUMIHO_ROWGEMM")
        monkeypatch.setenv("CC", "false")  # a "compiler" that fails
        monkeypatch.setattr(kernels.shutil, "which",
                            lambda name: "/bin/false" if name == "false" else None)
        assert rowgemm.kernel() is None
        assert not list(tmp_path.rglob("*.so"))
        layer = linear.PackedLinear(torch.nn.Linear(16, 8).requires_grad_(False))
        assert not layer.row_kernel and (layer.packed is not None or linear.MKL_REORDER is None)
    finally:
        rowgemm.kernel.cache_clear()


@needs_rowgemm
@pytest.mark.host
@pytest.mark.parametrize("module", [rowgemm, rowamx], ids=["rowgemm", "rowamx"])
def test_a_built_kernel_is_reused_from_the_cache(monkeypatch, tmp_path, module):
    """Both kernel libraries are built and loaded by `kernels.built`."""
    if module.kernel() is None:
        pytest.skip(f"{module.__name__} does not run here")
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    name = module.__name__.rsplit(".", 1)[-1]
    try:
        module.kernel.cache_clear()
        assert module.kernel() is not None
        built = list(tmp_path.rglob(f"{name}-*.so"))
        assert len(built) == 1 and not list(tmp_path.rglob("tmp*"))
        stamp = built[0].stat().st_mtime_ns
        module.kernel.cache_clear()
        monkeypatch.setattr(kernels, "build", lambda *a: pytest.fail("built twice"))
        assert module.kernel() is not None and built[0].stat().st_mtime_ns == stamp
    finally:
        module.kernel.cache_clear()


@needs_rowgemm
@pytest.mark.host
@pytest.mark.parametrize("dim, prefix", [(64, 44), (128, 44), (80, 44), (20, 44), (64, 150)])
def test_rowattention_is_torchs_attention_and_each_row_its_own(dim, prefix):
    """Against torch's sdpa (grouped heads, a tree-like mask, strided cache views), and
    each row bit for bit what it gets as a one-row call over a cache holding only the keys
    it sees, in order (a one-token step's view). 150 cached keys: the values weighed in
    blocks of 64 keys, their sums carried between blocks."""
    g = torch.Generator().manual_seed(dim + prefix)
    n = prefix + 6
    cache_k, cache_v = (torch.randn(1, 3, n + 14, dim, generator=g) for _ in range(2))
    k, v = cache_k[:, :, :n], cache_v[:, :, :n]  # a view of a longer cache
    q = torch.randn(1, 9, 6, dim, generator=g)
    mask = torch.zeros(1, 1, 6, n, dtype=torch.bool)
    mask[..., :prefix] = True
    parents = [-1, 0, 0, 1, 3, 2]
    for node, parent in enumerate(parents):
        mask[0, 0, node, prefix + node] = True
        mask[0, 0, node, prefix:n] |= mask[0, 0, parent, prefix:n] if parent >= 0 else False
    assert rowgemm.attends(q, k, v, mask)
    got = rowgemm.attention(q, k, v, mask, 0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for node in range(6):
        seen = mask[0, 0, node].nonzero().flatten()
        alone = rowgemm.attention(q[:, :, node:node + 1], k[:, :, seen], v[:, :, seen],
                                  torch.ones(1, 1, 1, len(seen), dtype=torch.bool), 0.125)
        assert torch.equal(alone[0, 0], got[0, node])
    with pytest.raises(ValueError, match="sees no key"):
        rowgemm.attention(q, k, v, torch.zeros_like(mask), 0.125)
    assert not rowgemm.attends(q, k.bfloat16(), v.bfloat16(), mask)  # one dtype for all
    assert not rowgemm.attends(q.double(), k.double(), v.double(), mask)
    assert not rowgemm.attends(q, k, v, mask.float())
    assert not rowgemm.attends(q, k, v, None)
    assert not rowgemm.attends(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, mask)


@needs_rowgemm
@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rowattention_reads_a_16_bit_cache_as_its_float32_values(dtype):
    """A bfloat16 or float16 cache (a strided view, read in place): the float32 attention
    of the values it holds, rounded once to its dtype, and each row of a tree bit for bit
    what it gets as a one-row call over the keys it sees (a decode step's view). With a
    bf16 cache's attention on AMX tiles (sums in the tiles' order, the weights in bf16) the
    same to rounding, and each row still bit for bit as alone."""
    tiled = dtype == torch.bfloat16 and rowgemm.kernel().tiled
    try:
        _reads_a_16_bit_cache(dtype, tiled)
        if tiled:  # and the FMAs, which the tiles stand in for
            rowgemm.set_tiled_attention(False)
            _reads_a_16_bit_cache(dtype, False)
    finally:
        if tiled:
            assert rowgemm.set_tiled_attention(True)


def _reads_a_16_bit_cache(dtype, tiled: bool):
    g = torch.Generator().manual_seed(7)
    cache_k, cache_v = (torch.randn(1, 3, 80, 64, generator=g).to(dtype) for _ in range(2))
    k, v = cache_k[:, :, :70], cache_v[:, :, :70]
    q = torch.randn(1, 9, 5, 64, generator=g).to(dtype)
    mask = torch.zeros(1, 1, 5, 70, dtype=torch.bool)
    mask[..., :65] = True
    for node, parent in enumerate([-1, 0, 1, 0, 3]):
        mask[0, 0, node, 65 + node] = True
        mask[0, 0, node, 65:70] |= mask[0, 0, parent, 65:70] if parent >= 0 else False
    assert rowgemm.attends(q, k, v, mask)
    got = rowgemm.attention(q, k, v, mask, 0.125)
    assert got.dtype == dtype
    wide = rowgemm.attention(q.float(), k.float(), v.float(), mask, 0.125)
    if tiled:
        torch.testing.assert_close(got.float(), wide, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(got, wide.to(dtype))
    for node in range(5):
        seen = mask[0, 0, node].nonzero().flatten()
        alone = rowgemm.attention(q[:, :, node:node + 1], k[:, :, seen], v[:, :, seen],
                                  torch.ones(1, 1, 1, len(seen), dtype=torch.bool), 0.125)
        assert torch.equal(alone[0, 0], got[0, node])


@needs_rowgemm
@pytest.mark.host
def test_rowattention_on_amx_tiles_wherever_rowamx_runs():
    """rowamx.c running here means its attention passes rowgemm.py's check and runs (a
    check that failed would leave the FMAs and the test below skipped, so this one says
    so)."""
    from gumiho import rowamx

    if rowamx.kernel() is None or os.environ.get("GUMIHO_ROWATTN_AMX") == "0":
        pytest.skip("no rowamx.c here (or GUMIHO_ROWATTN_AMX=0)")
    assert rowgemm.kernel().tiled and "-amxattention" in rowgemm.identity()


@pytest.mark.skipif(rowgemm.kernel() is None or not rowgemm.kernel().tiled,
                    reason="no AMX tiles for rowattention.c here")
@pytest.mark.host
@pytest.mark.parametrize("heads,groups,dim,rows,length", [
    (9, 3, 64, 8, 277),   # SmolLM2's heads; 3 chunks of keys, the last tile 5 keys short
    (9, 3, 64, 1, 16),    # a decode step over one tile of keys
    (8, 2, 128, 11, 140),  # 44 columns a group: three passes of at most 16
    (4, 4, 32, 3, 33),    # one head a group, one block of d
])
def test_rowattention_on_amx_tiles_keeps_each_row_as_alone(heads, groups, dim, rows, length):
    """A bf16 cache's attention on AMX tiles (rowamx_scores, rowamx_values): torch's
    attention to bf16 rounding, the FMAs' to rounding, and every row of a tree bit for bit
    what it gets as a one-row call over the keys it sees, in a cache with room to spare (a
    strided view) and as a decode step's cache of exactly those keys."""
    g = torch.Generator().manual_seed(dim + rows)
    cache_k, cache_v = (torch.randn(1, groups, length + 9, dim, generator=g).bfloat16()
                        for _ in range(2))
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]
    q = torch.randn(1, heads, rows, dim, generator=g).bfloat16()
    prefix = length - rows
    mask = torch.zeros(1, 1, rows, length, dtype=torch.bool)
    mask[..., :prefix] = True
    parents = [-1] + [int(p) for p in torch.randint(0, max(rows - 1, 1), (rows - 1,),
                                                    generator=g)]
    for node, parent in enumerate(parents):
        parent = min(parent, node - 1)
        mask[0, 0, node, prefix + node] = True
        if parent >= 0:
            mask[0, 0, node, prefix:] |= mask[0, 0, parent, prefix:]
    got = rowgemm.attention(q, k, v, mask, dim ** -0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=dim ** -0.5,
        enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    try:
        rowgemm.set_tiled_attention(False)
        fmas = rowgemm.attention(q, k, v, mask, dim ** -0.5)
    finally:
        assert rowgemm.set_tiled_attention(True)
    torch.testing.assert_close(got.float(), fmas.float(), rtol=2e-2, atol=2e-2)
    for node in range(rows):
        seen = mask[0, 0, node].nonzero().flatten()
        step_k, step_v = (cache_k.clone(), cache_v.clone())
        step_k[:, :, :len(seen)], step_v[:, :, :len(seen)] = k[:, :, seen], v[:, :, seen]
        alone = rowgemm.attention(q[:, :, node:node + 1], step_k, step_v,
                                  torch.arange(length + 9).view(1, 1, 1, -1) < len(seen),
                                  dim ** -0.5)
        assert torch.equal(alone[0, 0], got[0, node]), node
        step = rowgemm.attention(q[:, :, node:node + 1], k[:, :, seen], v[:, :, seen],
                                 torch.ones(1, 1, 1, len(seen), dtype=torch.bool), dim ** -0.5)
        assert torch.equal(step[0, 0], got[0, node]), node


@needs_rowgemm
@pytest.mark.host
@pytest.mark.parametrize("heads,groups", [(32, 8), (10, 2), (6, 1), (4, 4)])
def test_rowattention_blocks_of_heads_are_each_head_alone(heads, groups):
    """Several rows take up to three heads of a KV group at once (4 per group: a block of
    three and one alone): torch's attention to rounding, each row as alone bit for bit."""
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(1, heads, 7, 64, generator=g)
    k, v = (torch.randn(1, groups, 50, 64, generator=g) for _ in range(2))
    mask = torch.rand(1, 1, 7, 50, generator=g) < 0.7
    mask[..., 0] = True
    got = rowgemm.attention(q, k, v, mask, 0.1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.1, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for row in range(7):
        alone = rowgemm.attention(q[:, :, row:row + 1], k, v, mask[:, :, row:row + 1], 0.1)
        assert torch.equal(alone[0, 0], got[0, row])


@needs_rowgemm
@pytest.mark.skipif(DEVICE.type != "cpu", reason="rowgemm is the CPU's")
def test_verifies_run_rowgemm_and_equal_plain(smollm2, monkeypatch):
    """SmolLM2 in float32 on the CPU: every layer product and the logits of plain steps and
    of a prompt-lookup chain's verifies (up to 11 rows) run rowgemm, and the tokens are
    plain decoding's."""
    calls = rows_through(monkeypatch, rowgemm, "linear")
    ids = smollm2.chat_ids(REPEAT_PROMPT)
    config = GenerateConfig(max_new_tokens=32)
    plain = run(smollm2, PlainDrafter(), ids, config)
    assert calls and set(calls[-10:]) == {1}  # one-token steps
    calls.clear()
    out = run(smollm2, load_drafter("lookup", smollm2, tree=None), ids, config)
    assert out.token_ids == plain.token_ids
    assert max(out.accept_lengths) >= 4 and any(4 <= rows <= 11 for rows in calls), calls


@needs_rowgemm
@pytest.mark.skipif(DEVICE.type != "cpu", reason="rowgemm is the CPU's")
def test_float32_tree_rows_are_one_token_steps_bit_for_bit():
    """With rowgemm's products and `sdpa_invariant` (rowattention.c in float32), a verify's
    every node gets the features and logits its token gets decoded alone after its
    ancestors: exact float32 losslessness, not only equal tokens."""
    from gumiho.engine import TargetRunner, prefill, verify_tree
    from gumiho.target import load_target
    from gumiho.tree import DraftTree

    target = load_target("smollm2", device="cpu", dtype="float32",
                         attn_implementation="sdpa_invariant")
    prompt = torch.tensor([target.chat_ids("Name three colours.")])
    tokens = torch.tensor([504, 1205, 4312, 28, 905, 3060, 11])
    parents = torch.tensor([-1, 0, 0, 1, 3, 2, 4])  # two branches, depth 5

    def fresh():
        cache = TargetRunner(target, "eager").cache_for(prompt.shape[1] + 16)
        prefill(target, cache, prompt)
        return cache

    with torch.no_grad():
        features, logits = verify_tree(target, fresh(), DraftTree.from_parents(tokens, parents))
        for node in range(len(tokens)):
            path = [node]
            while parents[path[0]] >= 0:
                path.insert(0, int(parents[path[0]]))
            cache = fresh()
            for n in path:  # one-token steps down the node's path
                one = DraftTree.from_parents(tokens[n:n + 1], torch.tensor([-1]))
                step_features, step_logits = verify_tree(target, cache, one)
                cache.commit(1)
            assert torch.equal(features[node], step_features[0]), node
            assert torch.equal(logits[node], step_logits[0]), node


@needs_rowgemm
@pytest.mark.host
def test_rowattention_ab_builds_a_revision_beside_the_working_tree(capsys):
    """scripts/rowattention_ab.py (how a kernel change is timed and checked for its bits)
    runs: HEAD's kernel against the working tree's, the same bits where the sources agree."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode:
        pytest.skip("needs a git checkout")
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "gumiho/rowgemm.c",
                              "gumiho/rowattention.c", "gumiho/rowkernels.h"], cwd=root)
    sys.path.insert(0, str(root / "scripts"))
    try:
        import rowattention_ab
    finally:
        sys.path.pop(0)
    assert rowattention_ab.main(["--base", "HEAD", "--shapes", "20x3", "--rounds", "1",
                                 "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("20 cached x   3 rows" in line for line in lines)
    if changed.returncode == 0:  # the kernel sources are HEAD's: the same bits
        assert all(line.endswith("same bits: True") for line in lines)
