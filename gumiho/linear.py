"""Vocabulary-sized projections (hidden -> logits) and a model's layers at the speed the CPU
allows.

Where rowgemm.c builds (rowgemm.py: an x86 CPU with AVX2 and FMA, and a C compiler), every
float32 inference product of 1 to rowgemm.MAX_ROWS rows, layers and heads alike, runs it:
a verify's rows cost little more than one row's and each row gets exactly what it gets
alone. The float32 paths below (MKL, oneDNN) are what runs where it does not.

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

`pack_linears` is the bfloat16 counterpart for a model's layers on the CPU. On a CPU with
AMX (Sapphire Rapids and later), oneDNN multiplies bf16 matrices in tiles of 16 rows, so a
projection costs about the same for 1 to 16 input rows, where float32 MKL costs much more
(a whole SmolLM2 step on the 2026-11-26 dev machine: fp32 41 ms for 1 token, 77 for 16;
bf16 39 and 44). oneDNN reorders a plain weight into its blocked layout on every call;
reordering once at load (`PackedLinear`) makes a bf16 step about 20% faster (39 against
50 ms for one token; docs/cpu_costs.md, bfloat16 on a CPU) and gives bit-identical results (the same
kernel runs). torch.compile cannot lower the packed product: its engine unpacks
(`unpack_linears`). Where rowamx.c runs (rowamx.py: AMX tiles and a compiler that knows
them), a packed bf16 layer or vocabulary head also keeps its weight in that kernel's tile
order and sends it 1 to rowamx.MAX_ROWS rows (decode steps, verifies, drafting): a product
costs 0.35-0.7x oneDNN's there, and each row's bits are its own up to 80 rows; prefills
and longer inputs keep oneDNN's.

float32 layers are packed too, for MKL's packed GEMM (`cblas_sgemm_pack`/`_compute`, the
op torch's CPU compiler emits for frozen float32 weights), which skips repacking the
weight on each call: whole SmolLM2 verify steps of 4, 8 and 16 tokens cost 8-13% less, a
plain step the same (scripts/pack_ab.py, 2026-11-26 dev machine). For many rows the
packed product is slower (a SmolLM2 forward over 4 x 512 tokens took 1.08x as long,
`scripts/pack_ab.py --forward 4x512 --max-rows 100000`).
So a packed float32 layer uses MKL's product for `MIN_ROWS` to `MKL_MAX_ROWS` rows (tree
verifies) and the plain weight it keeps otherwise (a plain decode step, a prefill and a
training batch are bit for bit unchanged, at the cost of a second copy of the weights in
memory); the packed product differs from torch's only in the order of float additions,
as between any two batch shapes.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional

from gumiho import rowamx, rowgemm

log = logging.getLogger("gumiho")

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
PACKED_DTYPES = (torch.bfloat16,)  # vocabulary heads packed for oneDNN (float32: uses_onednn)
PACK_ROWS = 16  # the row count oneDNN lays a packed weight out for (a tree verify's width)
# float32: MKL's packed GEMM pays for a tree verify's rows and is slower for many (a
# SmolLM2 forward over 4 x 512 tokens 1.08x as long); past this, the plain weight runs
MKL_MAX_ROWS = 80  # a 64-token verify plus an 11-token lookup chain


def _reorder():
    """oneDNN's bf16 weight reorder where this CPU runs it: oneDNN's bf16 kernels need
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and on an AVX2-only CPU the reorder raises
    (probed once on a tiny weight); None there and without oneDNN."""
    try:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        reorder(torch.zeros(PACK_ROWS, PACK_ROWS, dtype=torch.bfloat16), PACK_ROWS)
    except (AttributeError, RuntimeError):
        return None
    return reorder


ONEDNN_REORDER = _reorder() if ONEDNN_LINEAR is not None else None


def _mkl_ops():
    """MKL's packed float32 GEMM (reorder, product), the ops torch's CPU compiler emits for
    frozen float32 weights (registered with oneDNN's, whose tensor holds the packed weight);
    (None, None) without MKL or oneDNN."""
    if not torch.backends.mkl.is_available() or ONEDNN_LINEAR is None:
        return None, None
    try:
        return torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear
    except (AttributeError, RuntimeError):
        return None, None


MKL_REORDER, MKL_LINEAR = _mkl_ops()


def uses_onednn(hidden: Tensor, weight: Tensor) -> bool:
    """Whether `vocab_linear` sends this product to oneDNN."""
    return (ONEDNN_LINEAR is not None and not torch.compiler.is_compiling()
            and hidden.device.type == "cpu"
            and hidden.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.shape[0] >= MIN_OUTPUTS and hidden.numel() >= MIN_ROWS * hidden.shape[-1]
            and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)))


@dataclass(frozen=True)
class LogitForm:
    """What a family's forward does to its lm_head's output, read from its config: a scale
    (Granite divides by `logits_scaling`, Cohere multiplies by `logit_scale`), then a final
    softcap cap * tanh(x / cap) (Gemma 2 and 3: `final_logit_softcapping`). Every logit we
    compute, the target's, the drafters' and the training targets', goes through it, so
    probabilities, greedy picks and losses are the model's own."""

    scale: float = 1.0
    cap: float | None = None

    @classmethod
    def of(cls, config) -> LogitForm:
        text = config.get_text_config()
        scale = float(getattr(text, "logit_scale", None) or 1.0) \
            / float(getattr(text, "logits_scaling", None) or 1.0)
        return cls(scale, getattr(text, "final_logit_softcapping", None) or None)

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and not self.cap

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        return torch.tanh(logits / self.cap) * self.cap if self.cap else logits

    def slope(self, formed: Tensor) -> Tensor | float:
        """d(formed)/d(lm_head's output), from the formed logits: scale (1 - (z / cap)^2)."""
        return self.scale * (1 - (formed / self.cap) ** 2) if self.cap else self.scale


def vocab_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None = None,
                 packed: PackedHead | None = None) -> Tensor:
    """hidden (..., H) @ weight (V, H).T (+ bias): `functional.linear`, faster where MKL is
    slow (see the module doc; float32 rows up to rowgemm.MAX_ROWS run rowgemm.c). `packed`:
    the weight as `pack_weight` returned it, used where no gradient has to flow (the same
    product; its tiles for the rows rowamx.c takes)."""
    if packed is not None and hidden.device.type == "cpu" and not (
            torch.compiler.is_compiling() or (torch.is_grad_enabled() and hidden.requires_grad)):
        hidden = hidden.to(packed.onednn.dtype)
        if bias is None and packed.tiles is not None and packed.tiles.takes(hidden):
            return packed.tiles(hidden)
        return ONEDNN_LINEAR(hidden, packed.onednn, bias, "none", [], "")
    if rowgemm.takes(hidden, weight):
        return rowgemm.linear(hidden, weight, bias)
    if uses_onednn(hidden, weight):
        return ONEDNN_LINEAR(hidden, weight, bias, "none", [], "")
    return functional.linear(hidden, weight, bias)


class PackedLinear(nn.Module):
    """An inference-only `nn.Linear` whose weight was reordered once for the CPU's GEMM
    library (see the module doc): bf16 for oneDNN (`weight` unpacks a copy on demand),
    float32 for rowgemm.c where it built here (1 to rowgemm.MAX_ROWS rows; nothing to pack,
    but a weight whose values are all exactly 16-bit ones, e.g. a drafter saved in float16,
    is kept in 16 bits: the same products from half the bytes), else for MKL's packed GEMM,
    which runs for `MIN_ROWS` to `MKL_MAX_ROWS` rows (other row counts, and `weight`, read
    the plain weight it keeps). Same outputs as the `nn.Linear` it replaces (float32: up to
    the order of float additions)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.mkl = weight.dtype == torch.float32
        row_kernel = self.mkl and rowgemm.kernel() is not None
        # rowgemm.c reads the plain weight (in 16 bits where that is exact): nothing to pack
        self.narrow = rowgemm.narrowed(weight) if row_kernel else None
        self.plain = weight.contiguous() if self.mkl and self.narrow is None else None
        reorder = MKL_REORDER if self.mkl else ONEDNN_REORDER
        self.packed = None if row_kernel else reorder(weight, PACK_ROWS)
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.rows = rowgemm.Prepared(self.plain if self.narrow is None else self.narrow,
                                     self.bias) if row_kernel else None
        # bf16 on an AMX CPU: rowamx.c's tiles for 1 to rowamx.MAX_ROWS rows, oneDNN beyond
        self.tiles = rowamx.Prepared(weight, self.bias) \
            if weight.dtype == torch.bfloat16 and rowamx.kernel() is not None else None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The state of the nn.Linear it replaces (weight, bias): a packed model's
        `state_dict`, and a checkpoint saved from it (save_drafter), are the plain one's."""
        destination[prefix + "weight"] = self.weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    @property
    def row_kernel(self) -> bool:
        """Whether rowgemm.c runs this layer's products (1 to rowgemm.MAX_ROWS rows)."""
        return self.rows is not None

    @property
    def weight(self) -> Tensor:
        if self.narrow is not None:
            return self.narrow.float()
        return self.plain if self.mkl else self.packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        if self.rows is not None:
            if self.rows.takes(x):
                return self.rows(x)
            return functional.linear(x, self.weight, self.bias)
        if self.tiles is not None:
            x = x.to(torch.bfloat16)  # as oneDNN's product below casts it: the same rows
            if self.tiles.takes(x):  # take the same kernel whatever dtype they came in
                return self.tiles(x)
        if self.mkl:
            rows = x.numel() // self.in_features
            if not MIN_ROWS <= rows <= MKL_MAX_ROWS:
                return functional.linear(x, self.plain, self.bias)
            # the packed product runs when the row count passed equals the input's
            return MKL_LINEAR(x.contiguous(), self.packed, self.plain, self.bias, rows)
        return ONEDNN_LINEAR(x.to(self.packed.dtype), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        kind = "rowgemm" if self.row_kernel else "MKL" if self.mkl else \
            "rowamx and oneDNN" if self.tiles is not None else "oneDNN"
        stored = f", stored as {self.narrow.dtype}" if self.narrow is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"packed for {kind}{stored}"


@functools.cache
def rows_independent(dtype: torch.dtype = torch.bfloat16, rows: int = 32) -> bool:
    """Whether this CPU's products of layer shape in `dtype` (packed where `pack_linears`
    packs) give each of up to `rows` input rows bit for bit what it gets alone. oneDNN's
    AMX bf16 kernels do, for up to 32 rows on the 2026-11-26 dev machine (not for 40), and
    rowamx.c's, which run a packed bf16 layer's 1 to rowamx.MAX_ROWS rows where they build;
    float32 MKL's do not, rowgemm.c's do (up to rowgemm.MAX_ROWS rows). oneDNN's bf16
    kernels without AMX (AVX512-BF16, the 2026-12-01 machine) do for inputs of up to 1,024
    features and not past them (a 1,536 or 2,048-wide input splits its sum by the row
    count), so the probe takes a wide input as well as a narrow one, and several row counts:
    whether a split shows depends on the values. With it and a row-invariant attention
    (attention.py), a verify's tokens get exactly the hidden states of one-token steps."""
    with torch.device("cpu"):  # a probe of this CPU, whatever default the caller set
        return _rows_independent(dtype, rows)


PROBE_SHAPES = ((576, 1536), (1536, 576), (2048, 640))  # (in, out): SmolLM2's MLP, Gemma's


def _rows_independent(dtype: torch.dtype, rows: int) -> bool:
    g = torch.Generator().manual_seed(0)  # the caller's random state stays as it was
    counts = sorted({n for n in (2, 3, 5, 8, rows) if 2 <= n <= rows})
    for features, out_features in PROBE_SHAPES:
        layer = nn.Linear(features, out_features, bias=False, device="meta")
        weight = torch.randn(out_features, features, generator=g) * 0.05
        layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        if can_pack(layer.weight):
            layer = PackedLinear(layer)
        for count in counts:
            x = torch.randn(1, count, features, generator=g).to(dtype)
            with torch.no_grad():
                out = layer(x)
                if not all(torch.equal(out[0, r], layer(x[:, r:r + 1])[0, 0])
                           for r in range(count)):
                    return False
    return True


def can_pack(weight: Tensor) -> bool:
    """Whether `pack_linears` packs a weight like this one: a CPU bfloat16 weight with oneDNN
    or a float32 one with MKL, not inside torch.compile, and $GUMIHO_PACK not "0" (to
    compare, or to rule packing out when chasing a problem)."""
    reorder = {torch.bfloat16: ONEDNN_REORDER, torch.float32: MKL_REORDER}.get(weight.dtype)
    return (reorder is not None and os.environ.get("GUMIHO_PACK", "1") != "0"
            and weight.device.type == "cpu" and not torch.compiler.is_compiling())


@dataclass(frozen=True)
class PackedHead:
    """A frozen bf16 vocabulary weight prepared once for the CPU (`pack_weight`): oneDNN's
    reordered copy, and rowamx.c's tiles where they run (1 to rowamx.MAX_ROWS rows)."""
    onednn: Tensor
    tiles: rowamx.Prepared | None


def pack_weight(weight: Tensor) -> PackedHead | None:
    """A frozen bf16 weight prepared once for `vocab_linear(..., packed=)`, or None where
    `can_pack` says no (float32 vocabulary heads have their own path, `uses_onednn`)."""
    if weight.requires_grad or weight.dtype not in PACKED_DTYPES or not can_pack(weight):
        return None
    weight = weight.detach()
    return PackedHead(ONEDNN_REORDER(weight, PACK_ROWS),
                      rowamx.Prepared(weight) if rowamx.kernel() is not None else None)


def pack_linears(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Replace, in place, every frozen `nn.Linear` of an inference model whose weight
    `can_pack` by a `PackedLinear` (modules in `skip`, e.g. an lm_head read elsewhere, stay).
    Returns how many were packed. Never for a model being trained: the packed copy does not
    follow its weight. float32 layers keep their plain weight beside the packed one, so
    they are packed only while that second copy takes at most half the memory available."""
    def packable(child: nn.Module) -> bool:
        return (type(child) is nn.Linear and not any(child is s for s in skip)
                and not child.weight.requires_grad and can_pack(child.weight))

    if not any(packable(m) for m in model.modules()):
        return 0  # (e.g. a model on a GPU: no CPU kernels to build for it)
    extra = 0 if rowgemm.kernel() is not None else sum(  # rowgemm packs nothing
        m.weight.numel() * 4 for m in model.modules()
        if packable(m) and m.weight.dtype == torch.float32)
    room = available_memory()
    fp32 = room is None or extra <= room // 2
    if not fp32:
        log.warning("float32 layers not packed for MKL: their second copy (%.1f GB) would "
                    "take more than half the memory available (%.1f GB)", extra / 1e9,
                    room / 1e9)
    return _swap_children(model, lambda child: PackedLinear(child) if packable(child) and (
        fp32 or child.weight.dtype != torch.float32) else None)


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable, else what
    sysconf says), or None where neither tells."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears` in place (for torch.compile, whose inductor cannot lower the packed
    product); returns how many layers went back to `nn.Linear`."""
    def unpacked(child: nn.Module) -> nn.Linear | None:
        if type(child) is not PackedLinear:
            return None
        layer = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                          device="meta")
        layer.weight = nn.Parameter(child.weight, requires_grad=False)
        if child.bias is not None:
            layer.bias = child.bias
        return layer

    return _swap_children(model, unpacked)


def _swap_children(model: nn.Module, swap) -> int:
    """Replace in place every submodule for which `swap(child)` returns a module; returns
    how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = swap(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count
