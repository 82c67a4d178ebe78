"""bfloat16 products of a few rows on a CPU with AMX tiles: as fast for a tree verify's
rows as for one, and the same bits for a row whatever rows come with it.

On an AMX CPU (Intel Sapphire Rapids and later) oneDNN multiplies bf16 matrices in tiles
of 16 rows, so a verify of up to 16 rows costs what one row does (linear.py), but each of
its calls carries ~100 us of dispatch, and its kernels keep a row's bits only up to 32 rows
(`linear.rows_independent`; not for 40). `rowamx.c` calls the tile instructions itself:
the weight laid out once in the tiles' order (`tiles`), each row's sum taken over the same
blocks of k in the same order whatever the row count, so every row of 1 to `MAX_ROWS`
(a 64-token verify with an 11-token lookup chain) gets bit for bit what it gets alone. On
the 2-vCPU AMX Xeon of 2026-11-29 (a weight per call cycled over 30 copies, ms for 1 / 16
/ 64 rows): SmolLM2's 1536 x 576 layer 0.06 / 0.06 / 0.19 against oneDNN's 0.17 / 0.16 /
0.24, its 49,152-token head 2.9 / 3.0 / 6.5 against 4.2 / 4.3 / 5.7 (64 rows and more
are bound by the tiles' arithmetic). The sums are float32, rounded once to bf16 as torch
rounds, like oneDNN's; the two differ only in the order of additions (on random inputs
1 output in 10,000 lands on the neighbouring bf16 value).

The source is compiled once per machine into the cache folder beside rowgemm.c's and loaded
with ctypes; its threads are torch's OpenMP runtime. Without AMX (and Linux's permission to
use it), a compiler that knows it, or with $GUMIHO_ROWAMX=0, nothing changes: oneDNN's
products run.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from gumiho import kernels, rowgemm

log = logging.getLogger("gumiho")

SOURCE = Path(__file__).with_name("rowamx.c")
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mamx-tile", "-mamx-bf16")
MAX_ROWS = rowgemm.MAX_ROWS  # a 64-token verify plus an 11-token lookup chain
OUTPUTS, DEPTH = 16, 32  # a tile: 16 outputs x 32 values of k, as 16 rows of 16 pairs


def amx_cpu() -> bool:
    """Whether this CPU has AMX tiles (torch's own check; False where torch cannot tell)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def _library() -> tuple[str, list[str], Path] | None:
    """(compiler, flags, the built library's path) where the kernel can run here."""
    if os.environ.get("GUMIHO_ROWAMX", "1") == "0" or not amx_cpu():
        return None
    return kernels.library("rowamx", [SOURCE], FLAGS)


def identity() -> str | None:
    """Which build runs here (its name changes with the source), or None: part of what
    measured costs are cached under (budget.py)."""
    function = kernel()
    return function.build if function is not None else None


@functools.cache
def kernel():
    """The compiled product (a ctypes function), or None where it cannot run here."""
    with torch.device("cpu"):  # its probe's tensors, whatever default the first caller set
        return _load()


def _load():
    found = _library()
    lib = kernels.built(found, [SOURCE], "bf16 CPU products stay oneDNN's")
    if lib is None:
        return None
    if lib.rowamx_init() != 0:  # Linux withholds the tile state (an old kernel)
        log.info("rowamx: no permission for AMX tiles; bf16 CPU products stay oneDNN's")
        return None
    function = lib.rowamx
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    if not _works(function):
        log.warning("rowamx gave wrong products here; oneDNN's run instead")
        return None
    function.build = found[2].stem  # the loaded build's name (the source may change since)
    # rowattention.c's scores and values on the tiles (rowgemm.py hands them over)
    function.tiles = [ctypes.cast(f, ctypes.c_void_p) for f in (lib.rowamx_scores,
                                                                 lib.rowamx_values)]
    return function


def _works(function) -> bool:
    """The built kernel computes the product (to bf16 rounding), each row as alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 45, generator=g).bfloat16()
    w = torch.randn(21, 45, generator=g).bfloat16()
    b = torch.randn(21, generator=g)
    y, alone = (torch.empty(rows, 21, dtype=torch.bfloat16) for rows in (19, 1))
    packed = tiles(w)
    function(x.data_ptr(), packed.data_ptr(), b.data_ptr(), y.data_ptr(), 19, 45, 21)
    function(x[17:].data_ptr(), packed.data_ptr(), b.data_ptr(), alone.data_ptr(), 1, 45, 21)
    expected = x.double() @ w.double().T + b.double()
    return (torch.allclose(y.double(), expected, rtol=1e-2, atol=1e-2)
            and torch.equal(alone[0], y[17]))


def tiles(weight: Tensor) -> Tensor:
    """A bf16 weight (N, K) laid out for rowamx.c: zero-padded to whole tiles, then per
    block of 16 outputs and 32 values of k (blocks by output, then k) 16 rows of 16 pairs,
    row r holding k = 2r, 2r + 1 of each output. (N/16, K/32, 16, 16, 2), rounded up."""
    n, k = weight.shape
    blocks, depth = -(-n // OUTPUTS), -(-k // DEPTH)
    padded = weight.new_zeros(blocks * OUTPUTS, depth * DEPTH)
    padded[:n, :k] = weight
    return padded.view(blocks, OUTPUTS, depth, DEPTH // 2, 2).permute(0, 2, 3, 1, 4).contiguous()


class Prepared:
    """A frozen CPU bf16 weight (and bias) laid out once for rowamx.c, for a layer or a
    vocabulary head that multiplies it every step (linear.py). A call checks only its
    input (`takes`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.outputs, self.inputs = weight.shape
        self.tiles = tiles(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        # what every call passes, looked up once (a layer's products are ~10 us each)
        self._fixed = (self.tiles.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def takes(self, x: Tensor) -> bool:
        """bf16 rows of this weight's width on the CPU, 1 to MAX_ROWS of them, no gradient
        wanted, not under torch.compile, the kernel built here."""
        return (x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and x.shape[-1] == self.inputs and 1 <= x.numel() // self.inputs <= MAX_ROWS
                and not (torch.is_grad_enabled() and x.requires_grad)
                and not torch.compiler.is_compiling() and kernel() is not None)

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., K) @ weight.T (+ bias), bf16, for an input `takes` accepts."""
        x = x.contiguous()
        y = x.new_empty((*x.shape[:-1], self.outputs))
        kernel()(x.data_ptr(), *self._fixed, y.data_ptr(), x.numel() // self.inputs,
                 self.inputs, self.outputs)
        return y
