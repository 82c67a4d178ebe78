"""Vocabulary-sized projections (hidden -> logits) at the speed the CPU allows.

On the CPU, torch's float32 GEMM (MKL) handles a vocabulary-sized weight (tens of
thousands of rows) well for one to three input rows and for sixteen or more, but from four
to fifteen rows it is up to 2.3 times slower than for sixteen: SmolLM2's lm_head (49,152 x
576, out of cache) takes 4.3 ms for 1 row, 8.1 for 4, 12.9 for 9, 20.3 for 15 and 8.9 for
16 on the 2-core dev machine (scripts/linear_rows.py). oneDNN's GEMM takes 6.3, 7.1, 8.2
and 8.6 ms for 4, 9, 15 and 16 rows. A tree verify has that many rows (a prompt-lookup chain is
up to 11), so there the head alone cost as much as half a plain step more than it needs to.

`vocab_linear` sends 4 or more rows of a large float32 CPU projection to oneDNN and
everything else to `torch.nn.functional.linear`. Both compute the same product; only the
order of the float additions differs (about 1e-6 relative), as it does between any two
batch shapes, so verification stays exactly as lossless as before (the greedy-equality
tests run such verifies). Smaller weights (a drafter's 8,192-token head, the layers) and
other devices keep torch's default, which is as fast or faster there. Under torch.compile
the product is left to inductor (which picks its own kernel; it cannot lower this op).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional

MIN_ROWS = 4  # from here on MKL is slower than oneDNN for a vocabulary-sized weight
MIN_OUTPUTS = 16384  # below this MKL is as fast at every row count (scripts/linear_rows.py)


def _onednn_linear():
    """oneDNN's linear (the op torch's own CPU compiler emits), or None without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


ONEDNN_LINEAR = _onednn_linear()


def uses_onednn(hidden: Tensor, weight: Tensor) -> bool:
    """Whether `vocab_linear` sends this product to oneDNN."""
    return (ONEDNN_LINEAR is not None and not torch.compiler.is_compiling()
            and hidden.device.type == "cpu"
            and hidden.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.shape[0] >= MIN_OUTPUTS and hidden.numel() >= MIN_ROWS * hidden.shape[-1]
            and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)))


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """A final logit softcap, cap * tanh(logits / cap), as some families apply it (Gemma 2);
    the logits unchanged without one."""
    return torch.tanh(logits / cap) * cap if cap else logits


def vocab_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """hidden (..., H) @ weight (V, H).T (+ bias): `functional.linear`, faster where MKL is
    slow (see the module doc)."""
    if uses_onednn(hidden, weight):
        return ONEDNN_LINEAR(hidden, weight, bias, "none", [], "")
    return functional.linear(hidden, weight, bias)
