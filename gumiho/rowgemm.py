"""Float32 products of a few rows on an x86 CPU: as fast for a tree verify's rows as for
one, and the same bits for a row whatever rows come with it.

A tree verify multiplies 4 to 80 rows by every weight of the target, a plain step one. On
the 2-core AVX2 dev machine (AMD EPYC, 2026-11-26) torch's float32 products (MKL, packed or
not) cost 2 to 3 times as much for 4 rows as for 1, which made every verify ~1.8 plain
steps there and speculation a loss. `rowgemm.c` keeps each group of up to four weight rows
in L1 while all input rows pass over it and prefetches the next group, so the weights are
read once. Cold weights, `python scripts/linear_rows.py --outputs 1536 --inputs 576` (one
of SmolLM2's layers), ms for 1 / 4 / 16 rows: rowgemm 0.29 / 0.37 / 0.56, torch 0.46 /
0.80 / 1.12, MKL packed 0.36 / 0.84 / 1.04; its 49,152-token head: 6.1 / 5.3 / 8.8, torch
8.8 / 22.5 / 25.8, MKL packed 4.8 / 19.4 / 25.0 (one row: within this machine's noise). At
64 rows oneDNN is as fast; past MAX_ROWS, prefills and training batches keep torch's
product.

Each output is summed in one fixed order (rowgemm.c), so a row gets bit for bit what it
gets alone, whatever the row count, tile or thread count: `linear.rows_independent` holds
in float32 where it runs. It differs from torch's product only in the order of float
additions (about 1e-6 relative), as torch's own does between two batch shapes.

A weight may be stored in 16 bits and widened to float32 in registers (F16C for float16, a
shift for bfloat16). `narrowed` does so only where every value of a float32 weight is
exactly a 16-bit one, so the product is bit for bit the float32 one: the shipped drafters
are saved in float16, so their layers (`linear.PackedLinear`) read half the bytes. A Gumiho
drafting pass is memory-bound, so drafting cost ~25% less (`python -m
gumiho.evaluation.timing --methods gumiho --draft gumiho/assets/smollm2/gumiho
--total-tokens 6 --depth 2 --widths 1`, 16 bits vs float32 alternated twice, 2026-11-27:
8.2-9.3 against 11.4-11.5 ms per cycle). SmolLM2's own float32 weights are not 16-bit
values (they stay as they are); a target released in bfloat16 and loaded in float32 would
be.

Where torch finds AVX-512 (an Intel Xeon since Skylake, AMD since Zen 4), rowgemm.c runs
3 to 80 rows in pairs, sixteen lanes at a time: each lane adds what the AVX2 blocks' lane
adds, in the same order, so the products are the AVX2 blocks' bits (checked here once
before they are used) and a machine with AVX-512 computes what one without it does. On a
2-core AMX Xeon, whose AVX-512 runs as many flops a cycle as its AVX2 (one 512-bit FMA a
cycle against two 256-bit ones), they need fewer loads per FMA: 1.2x-1.35x as fast at 13-80
rows, the same at 1-8 (`scripts/cpu_ab.py --switch wide`). $GUMIHO_ROWGEMM512=0 keeps the
AVX2 blocks.

`rowattention.c`, built into the same library, is the attention counterpart
(`attention`, used by attention.py's `sdpa_invariant`): each (row, head) from its own query
and visible keys in slot order, so a tree node gets what its token gets decoded alone over
the same keys. A bfloat16 or float16 cache is read in place and widened like a 16-bit
weight, the attention computed in float32 and rounded once to the cache's dtype. Where
rowamx.c runs (an AMX CPU), a bfloat16 cache's attention (head sizes a multiple of 32) runs
on its tiles instead: the scores q . k of every key against every row's queries at once,
each score from its own key and query alone, and each row's values over its visible keys
in slot order, 32 keys a block, each softmax weight as two bf16 parts (16 bits of its 24,
where torch's bf16 attention keeps 8) and their float32 sum dividing at the end, each row
from its own weights and keys alone (`_tiled_attention` checks that once, before any
attention runs, and a process keeps one way). A tree verify of 4-64 rows over 800 cached
tokens runs 1.1-1.4x as fast, a narrow one over a short context as fast as before
(docs/cpu_costs.md); the sums run in the tiles' order, so the text can part from the
FMAs' at a near-tie, plain and speculative decoding alike. $GUMIHO_ROWATTN_AMX=0 keeps the
FMAs.

The C sources are compiled once per machine and loaded with ctypes (kernels.py); its
threads are torch's OpenMP runtime (one pool, sized by torch.set_num_threads). Without a
compiler, AVX2 and FMA, or on another architecture, nothing changes: torch's products run.
$GUMIHO_ROWGEMM=0 turns it off (to compare, or when chasing a problem).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from gumiho import kernels

log = logging.getLogger("gumiho")

SOURCES = [Path(__file__).with_name(name) for name in ("rowgemm.c", "rowattention.c")]
MAX_ROWS = 80  # a 64-token verify plus an 11-token lookup chain; torch is as fast past 64
# how a weight is stored (rowgemm.c's enum): 16-bit ones are widened as they are read
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _works(function, attend) -> bool:
    """The built kernels compute torch's product and attention (to float rounding), each
    row as alone."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(5, 37, generator=g), torch.randn(11, 37, generator=g),
               torch.randn(11, generator=g))
    y = torch.empty(5, 11)
    function(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), 5, 37, 11, 0)
    alone = torch.empty(1, 11)
    function(x[3:].data_ptr(), w.data_ptr(), b.data_ptr(), alone.data_ptr(), 1, 37, 11, 0)
    if not (torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
            and torch.equal(alone[0], y[3])):
        return False
    for dtype, kind in KINDS.items():  # a 16-bit weight: the float32 product of its values
        short = w.to(dtype)
        values, wide, narrow = short.float(), torch.empty(5, 11), torch.empty(5, 11)
        function(x.data_ptr(), values.data_ptr(), None, wide.data_ptr(), 5, 37, 11, 0)
        function(x.data_ptr(), short.data_ptr(), None, narrow.data_ptr(), 5, 37, 11, kind)
        if not torch.equal(wide, narrow):
            return False
    q, k, v = (torch.randn(1, heads, n, 16, generator=g) for heads, n in ((4, 3), (2, 7), (2, 7)))
    mask = torch.rand(1, 1, 3, 7, generator=g) < 0.7
    mask[..., 0] = True
    got = _attend(attend, q, k, v, mask, 0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True).transpose(1, 2)
    if got is None or not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
        return False
    for dtype in (torch.float16, torch.bfloat16):  # a 16-bit cache: its values' attention
        short = [t.to(dtype) for t in (q, k, v)]
        wide = _attend(attend, *(t.float() for t in short), mask, 0.25)
        if not torch.equal(_attend(attend, *short, mask, 0.25), wide.to(dtype)):
            return False
    return True


def _library() -> tuple[str, list[str], Path] | None:
    """(compiler, flags, the built library's path) where the kernel can run here."""
    if os.environ.get("GUMIHO_ROWGEMM", "1") == "0":
        return None
    if not kernels.avx2_cpu():
        return None
    found = kernels.library("rowgemm", SOURCES)
    if found is None:
        log.info("no C compiler: float32 CPU products stay torch's (rowgemm.py)")
    return found


def identity() -> str | None:
    """Which kernels run here (their build's name, which changes with the sources), or None:
    part of what measured costs are cached under (budget.py)."""
    function = kernel()
    if function is None:
        return None
    return function.build + ("-amxattention" if function.tiled else "") + \
        ("-avx512" if function.wide else "")


def _bind(library: ctypes.CDLL):
    """The built library's product and attention, as ctypes functions with their
    signatures."""
    function, attend = library.rowgemm, library.rowattention
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    attend.restype = ctypes.c_int
    attend.argtypes = [ctypes.c_void_p, *[ctypes.c_long] * 2] + \
        [ctypes.c_void_p, *[ctypes.c_long] * 2] * 2 + [ctypes.c_void_p] * 2 + \
        [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int]
    return function, attend


@functools.cache
def kernel():
    """The compiled product (a ctypes function; `.attention` the attention), or None where
    the kernels cannot run here."""
    with torch.device("cpu"):  # the probes' tensors, whatever default the first caller set
        return _load()


def _load():
    found = _library()
    library = kernels.built(found, SOURCES, "float32 CPU products stay torch's")
    if library is None:
        return None
    function, attend = _bind(library)
    function.build = found[2].stem  # the loaded build's name (the sources may change since)
    if not _works(function, attend):
        log.warning("rowgemm gave wrong products here; torch's run instead")
        return None
    function.attention = attend
    function.argmax = library.rowargmax
    function.argmax.restype = None
    function.argmax.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_int]
    function.setter = library.rowgemm_wide
    function.setter.restype, function.setter.argtypes = ctypes.c_int, [ctypes.c_int]
    function.can_widen = _widen(function)
    function.wide = function.can_widen
    function.install = library.rowattention_tiles
    function.install.restype, function.install.argtypes = ctypes.c_int, [ctypes.c_void_p] * 2
    function.can_tile = _tiled_attention(function)
    function.tiled = function.can_tile
    return function


def _tiled_attention(function) -> bool:
    """Hand rowattention.c rowamx.c's scores and values on AMX tiles (a bf16 cache, head
    sizes a multiple of 32), where rowamx.c runs (unless $GUMIHO_ROWATTN_AMX is 0), once
    they are seen to compute each row as alone and to agree with the float32 kernel to
    bf16 rounding; whether they run. Done once, before any attention: a process keeps one
    way."""
    if os.environ.get("GUMIHO_ROWATTN_AMX", "1") == "0":
        return False
    from gumiho import rowamx  # (it imports this module)

    product = rowamx.kernel()
    if product is None:
        return False
    g = torch.Generator().manual_seed(2)
    # 4 heads a kv group x 5 rows: a pass of 16 columns and one of 4, blocks of 3 heads and
    # of 1, as a row alone has; 4 blocks of d (two sum alike either way); 40-60 visible
    # keys of 70, so a row's values run over two blocks of keys
    q, k, v = (torch.randn(1, heads, n, 128, generator=g).bfloat16()
               for heads, n in ((8, 5), (2, 70), (2, 70)))
    mask = torch.rand(1, 1, 5, 70, generator=g) < 0.8
    mask[..., 0] = True
    before = _attend(function.attention, q, k, v, mask, 0.09)
    function.install(*product.tiles)
    rows = _attend(function.attention, q, k, v, mask, 0.09)
    alone = [_attend(function.attention, q[:, :, r:r + 1], k, v, mask[:, :, r:r + 1], 0.09)
             for r in range(5)]
    if rows is not None and all(torch.equal(rows[0, r], alone[r][0, 0]) for r in range(5)) \
            and torch.allclose(rows.float(), before.float(), rtol=2e-2, atol=2e-2):
        return True
    log.warning("rowattention's AMX tiles did not compute each row as alone here; its FMAs "
                "run")
    function.install(None, None)
    return False


def _widen(function) -> bool:
    """Turn on rowgemm.c's AVX-512 blocks where torch finds AVX-512 here (unless
    $GUMIHO_ROWGEMM512 is 0), once they are seen to give the AVX2 blocks' bits on this
    machine; whether they are on."""
    if os.environ.get("GUMIHO_ROWGEMM512", "1") == "0" or \
            torch.backends.cpu.get_cpu_capability() != "AVX512":
        return bool(function.setter(0))
    g = torch.Generator().manual_seed(1)
    cases = [(m, k, torch.randn(m, k, generator=g), torch.randn(13, k, generator=g).to(dtype))
             for m, k in ((3, 37), (11, 24), (16, 45)) for dtype in KINDS]
    bias = torch.randn(13, generator=g)
    got = {}
    for on in (0, 1):
        if function.setter(on) != on:
            return False
        for i, (m, k, x, w) in enumerate(cases):
            y = got.setdefault((i, on), torch.empty(m, 13))
            function(x.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), m, k, 13,
                     KINDS[w.dtype])
    if all(torch.equal(got[(i, 0)], got[(i, 1)]) for i in range(len(cases))):
        return True
    log.warning("rowgemm's AVX-512 blocks differ from its AVX2 ones here; AVX2 runs")
    return bool(function.setter(0))


def set_wide(on: bool) -> bool:
    """Run rowgemm.c's AVX-512 blocks (on) or its AVX2 ones only, to compare the two
    (scripts/cpu_ab.py, the tests): the same bits either way. Whether the AVX-512 ones now
    run; False where the kernel or AVX-512 is not here."""
    function = kernel()
    if function is None:
        return False
    function.wide = bool(function.setter(int(on and function.can_widen)))
    return function.wide


def set_tiled_attention(on: bool) -> bool:
    """Run a bf16 cache's attention on AMX tiles (on, where they passed the check at load)
    or on AVX2's FMAs, to compare the two (scripts/cpu_ab.py, the tests): they round
    differently, so a process that switches no longer decodes one way; whether the tiles
    now run."""
    function = kernel()
    if function is None:
        return False
    function.tiled = bool(on and function.can_tile)  # (rowamx.c runs where it can)
    from gumiho import rowamx

    function.install(*(rowamx.kernel().tiles if function.tiled else (None, None)))
    return function.tiled


def argmax(x: Tensor) -> Tensor:
    """`x.argmax(-1)` for 2-D logits, rowgemm.c's `rowargmax` on a contiguous float32,
    float16 or bfloat16 CPU tensor (10-16x torch's own over a 49,152-token vocabulary, 1 to
    64 rows: every greedy step's pick), torch's elsewhere. The same indices
    (tests/test_rowgemm.py)."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype not in KINDS
            or not x.is_contiguous() or x.shape[1] == 0 or torch.compiler.is_compiling()):
        return x.argmax(-1)
    function = kernel()
    if function is None:
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.long, device="cpu")
    function.argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], KINDS[x.dtype])
    return out


def takes(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear` runs this product: float32 rows on the CPU (1 to MAX_ROWS), a
    contiguous float32, float16 or bfloat16 weight, no gradient wanted, not under
    torch.compile, the kernel built here."""
    return (weight.device.type == "cpu" and weight.dtype in KINDS and weight.dim() == 2
            and weight.is_contiguous() and _takes_input(x, weight.shape[1], weight.requires_grad))


def _takes_input(x: Tensor, inputs: int, weight_grad: bool = False) -> bool:
    """The input's part of `takes` (and all of `Prepared.takes`): float32 rows of `inputs`
    features on the CPU, 1 to MAX_ROWS of them, no gradient wanted, not under
    torch.compile, the kernel built here."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and inputs > 0
            and x.shape[-1] == inputs and 1 <= x.numel() // inputs <= MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight_grad))
            and not torch.compiler.is_compiling() and kernel() is not None)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ weight (N, K).T (+ bias) in float32, for a product `takes` accepts (a
    16-bit weight: exactly the product with its float32 values)."""
    return Prepared(weight, bias)(x)


class Prepared:
    """A frozen CPU weight (and bias) whose own checks `takes` made once, for a layer that
    multiplies it every step (`linear.PackedLinear`): a call checks only its input, which
    takes ~5 us of Python off each of a cycle's ~240 products. `weight` float32, float16 or
    bfloat16, 2-D; `bias` any float dtype or None."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.outputs, self.inputs = self.weight.shape
        self.kind = KINDS[self.weight.dtype]
        self._fixed = (self.weight.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def takes(self, x: Tensor) -> bool:
        """`takes(x, weight)`, the weight's part known to hold."""
        return _takes_input(x, self.inputs)

    def __call__(self, x: Tensor) -> Tensor:
        """`linear(x, weight, bias)` for an input `takes` accepts."""
        x = x.contiguous()
        y = x.new_empty((*x.shape[:-1], self.outputs))  # float32 on x's device (a keyword
        # dtype and device cost ~4 us a call in argument parsing, of ~240 products a cycle)
        kernel()(x.data_ptr(), *self._fixed, y.data_ptr(), x.numel() // self.inputs,
                 self.inputs, self.outputs, self.kind)
        return y


def narrowed(weight: Tensor) -> Tensor | None:
    """A float32 weight stored in 16 bits where every value is exactly a float16 (else
    bfloat16) one, e.g. a drafter saved in float16: `linear` gives bit for bit the float32
    product and reads half the bytes. None where neither holds or the kernel is not here."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or kernel() is None:
        return None
    head = weight.detach().reshape(-1)[:4096]  # most float32 weights fail here, cheaply
    for dtype in (torch.float16, torch.bfloat16):
        if not torch.equal(head.to(dtype).float(), head):
            continue
        short = weight.detach().to(dtype)
        if torch.equal(short.float(), weight):
            return short.contiguous()
    return None


def drafting_copy(weight: Tensor, bias: Tensor | None = None) -> Prepared | None:
    """A float32 CPU weight prepared from 16 bits, for products that propose rather than
    decide (a drafter's vocabulary head, whose tokens the target verifies): its exact 16-bit
    form where `narrowed` finds one, else its values rounded to float16 where they all lie
    in float16's range (11 significant bits), else to bfloat16. Half the bytes to read, so
    about half the time of a product that memory bounds; the results differ from the
    float32 product's in the last bits (a drafter's top-k at a near-tie may differ, never
    the output). None where `linear` cannot take the weight."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu" \
            or kernel() is None:
        return None
    weight = weight.detach()
    short = narrowed(weight)
    if short is None:
        fits = weight.numel() == 0 or float(weight.abs().amax()) < 65504  # (NaN: False)
        short = weight.to(torch.float16 if fits else torch.bfloat16)
    return Prepared(short, bias)


def attends(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> bool:
    """Whether `attention` runs this call: one dtype (float32, bfloat16 or float16) on the
    CPU, one sequence, a bool mask of one column per key (rowattention.c reads it as
    (rows, keys) bytes), one head size for queries, keys and values, every tensor's last
    dim contiguous, no gradient wanted, the kernels built here."""
    tensors = (query, key, value)
    return (mask is not None and mask.dtype == torch.bool and mask.device.type == "cpu"
            and query.dtype in KINDS
            and all(t.device.type == "cpu" and t.dtype == query.dtype and t.dim() == 4
                    and t.shape[0] == 1 and t.stride(-1) == 1 for t in tensors)
            and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0
            and value.shape == key.shape and key.shape[-1] == query.shape[-1]
            and mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1
            and mask.shape[2] in (1, query.shape[2]) and mask.shape[3] == key.shape[2]
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and kernel() is not None)


def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float
              ) -> Tensor:
    """query (1, heads, Q, D), key/value (1, kv heads, K, D), mask (1, 1, Q|1, K) bool ->
    (1, Q, heads, D), every row as it would be alone (rowattention.c), for a call `attends`
    accepts; a row that sees no key raises. In 16 bits: the float32 attention of the
    values they hold (a 16-bit cache is read as it is, never copied), rounded once to
    their dtype at the end."""
    out = _attend(kernel().attention, query, key, value, mask, scale)
    if out is None:
        raise ValueError("rowattention: a row sees no key")
    return out


def visible_rows(mask: Tensor, rows: int) -> Tensor:
    """A (1, 1, rows|1, K) bool mask as rowattention.c reads it: (rows, K) bytes, nonzero =
    visible (rowlayer.py passes the same)."""
    return mask[0, 0].expand(rows, mask.shape[-1]).contiguous().view(torch.uint8)


def _attend(function, query: Tensor, key: Tensor, value: Tensor, mask: Tensor,
            scale: float) -> Tensor | None:
    _, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    visible = visible_rows(mask, rows)
    wide = query.float()  # (a few rows) the kernel's queries are float32; strides kept
    out = torch.empty(1, rows, heads, dim, device=query.device)
    status = function(wide.data_ptr(), wide.stride(1), wide.stride(2),
                      key.data_ptr(), key.stride(1), key.stride(2),
                      value.data_ptr(), value.stride(1), value.stride(2),
                      visible.data_ptr(), out.data_ptr(), rows, heads, kv_heads, length, dim,
                      scale, KINDS[key.dtype])
    return None if status else out.to(query.dtype)
