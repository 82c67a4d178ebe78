"""The training losses' soft cross-entropy in one C pass per row, on a CPU (softce.c).

`gumiho.train.loss.soft_cross_entropy` in torch takes a few rows at a time and still makes
a float32 copy of each bf16 piece, its max, its exps, their sum, the weighted gradient and
a bf16 copy of it: several passes of torch operators over every logit. softce.c reads a
row's logits where they are (float32, bfloat16 or float16), keeps the row, its
distribution and its exps in the core's cache, and writes the loss and the gradient
(rounded once to the logits' dtype) in three passes over the row. The same value and
gradient to float rounding (its exp is rowkernels.h's, ~1 ulp).

Compiled once per machine into the cache folder beside the other kernels, loaded with
ctypes; its threads are torch's OpenMP runtime. Without a C compiler, AVX2 and FMA, on
another architecture, or with $GUMIHO_SOFTCE=0, the torch form runs.
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
from gumiho.rowgemm import KINDS

log = logging.getLogger("gumiho")

SOURCE = Path(__file__).with_name("softce.c")


def _library() -> tuple[str, list[str], Path] | None:
    """(compiler, flags, the built library's path) where the kernel can run here."""
    if os.environ.get("GUMIHO_SOFTCE", "1") == "0" or not kernels.avx2_cpu():
        return None
    return kernels.library("softce", [SOURCE])


@functools.cache
def kernel():
    """The compiled library (its ctypes function `softce`), or None where it cannot run
    here."""
    lib = kernels.built(_library(), [SOURCE], "the soft cross-entropy stays torch's")
    if lib is None:
        return None
    lib.softce.restype = ctypes.c_int
    lib.softce.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4 + \
        [ctypes.c_int] * 2
    with torch.device("cpu"):  # its probe's tensors, whatever default the caller set
        if not _works(lib):
            log.warning("softce gave wrong losses here; the torch form runs instead")
            return None
    return lib


def _works(lib) -> bool:
    """The built kernel gives torch's loss and gradient (to float rounding), on a small
    case with an odd width (a row's tail), and rounds a bf16 gradient as torch does."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 37, generator=g) * 3
    p = torch.softmax(torch.randn(5, 37, generator=g), -1)
    index = torch.tensor([4, 0, 2])
    losses, grad = torch.empty(3), torch.empty(3, 37)
    if lib.softce(z.data_ptr(), KINDS[torch.float32], p.data_ptr(), index.data_ptr(),
                  grad.data_ptr(), losses.data_ptr(), 3, 37):
        return False
    chosen = p[index]
    expected = -(chosen * torch.log_softmax(z, -1)).sum(-1)
    want = torch.softmax(z, -1) * chosen.sum(-1, keepdim=True) - chosen
    # bf16 logits: the gradient their float32 values get, rounded once to bf16
    wide = z.bfloat16()
    short, again, exact = torch.empty(3, 37, dtype=torch.bfloat16), torch.empty(3), \
        torch.empty(3, 37)
    values = wide.float()
    lib.softce(wide.data_ptr(), KINDS[torch.bfloat16], p.data_ptr(), index.data_ptr(),
               short.data_ptr(), again.data_ptr(), 3, 37)
    lib.softce(values.data_ptr(), KINDS[torch.float32], p.data_ptr(), index.data_ptr(),
               exact.data_ptr(), again.data_ptr(), 3, 37)
    return (torch.allclose(losses, expected, rtol=1e-5, atol=1e-6)
            and torch.allclose(grad, want, rtol=1e-5, atol=1e-7)
            and torch.equal(short, exact.bfloat16()))


def takes(logits: Tensor, probs: Tensor, index: Tensor | None) -> bool:
    """Whether softce.c computes this loss: CPU tensors, 2-D logits in a dtype it reads,
    float32 distributions as wide, the kernel built here."""
    return (logits.device.type == "cpu" and probs.device.type == "cpu"
            and logits.dim() == 2 and probs.dim() == 2 and logits.dtype in KINDS
            and probs.dtype == torch.float32 and probs.shape[1] == logits.shape[1]
            and (index is None or index.device.type == "cpu")
            and 0 < logits.shape[0] and logits.shape[1] > 0
            and not torch.compiler.is_compiling() and kernel() is not None)


def loss_and_grad(logits: Tensor, probs: Tensor, index: Tensor | None, grad: Tensor | None
                  ) -> Tensor:
    """Per-row -sum_v p log_softmax(z) (M,) float32 for inputs `takes` accepts, writing
    softmax(z) sum_v p - p into `grad` (M, D, the logits' dtype, contiguous) when given."""
    logits, probs = logits.contiguous(), probs.contiguous()
    if index is not None:  # checked here: the C code would read past either tensor
        index = index.to(torch.int64).contiguous()
        if index.shape != logits.shape[:1]:
            raise ValueError(f"soft_cross_entropy: {logits.shape[0]} rows of logits, an index "
                             f"of shape {tuple(index.shape)}")
        if not (0 <= int(index.min()) and int(index.max()) < probs.shape[0]):
            raise IndexError(f"soft_cross_entropy: an index outside 0..{probs.shape[0] - 1}")
    elif probs.shape[0] < logits.shape[0]:  # row m's distribution is probs[m]
        raise ValueError(f"soft_cross_entropy: {logits.shape[0]} rows of logits, "
                         f"{probs.shape[0]} distributions and no index")
    if grad is not None and (grad.shape != logits.shape or grad.dtype != logits.dtype
                             or grad.device.type != "cpu" or not grad.is_contiguous()):
        raise ValueError("softce: the gradient must be a contiguous CPU tensor of the "
                         "logits' shape and dtype")
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device="cpu")  # whatever the default
    failed = kernel().softce(logits.data_ptr(), KINDS[logits.dtype], probs.data_ptr(),
                             None if index is None else index.data_ptr(),
                             None if grad is None else grad.data_ptr(), losses.data_ptr(),
                             rows, vocab)
    if failed:
        raise MemoryError("softce: no memory for a row's scratch")
    return losses
