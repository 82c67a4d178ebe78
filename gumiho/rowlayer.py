"""A Llama decoder's steps of 1 to MAX_ROWS tokens in one C call (rowlayer.c), for a
target's decoder (fused.py's `FusedDecoder`) and a drafter's serial layers (`FusedSerial`)
on the CPU: the layers' products and attention by the row kernels (rowamx.c for bf16 on AMX
tiles, rowgemm.c for float32, rowattention.c), everything between them (RMSNorm, the rotary
turn, the KV cache's writes, SiLU and the gate, the residual additions) in plain loops.

fused.py's `LlamaLayers` makes the same calls from Python: about 1,000 torch operations a
SmolLM2 step, each ~5-10 us of dispatch, where the step's products take ~10 ms on a 2-core
CPU, so a plain step spent about half its time between its kernels (scripts/
step_anatomy.py). Here that part costs tens of microseconds: plain decoding runs about
twice as fast (docs/cpu_costs.md, "A decoder step in one C call").

The bits: every operation is transformers' LlamaDecoderLayer's, rounded where torch rounds,
except the order of RMSNorm's sum of squares and SiLU's exp (rowlayer.c), which differ from
torch's by about an ulp before rounding. So the features are not bit for bit fused.py's
(float32: ~1e-6 relative; bf16: a value now and then on the neighbouring bf16, carried
on), but every row is its own: a tree verify gives each token bit for bit what one-token
steps give it, so speculative decoding stays exactly plain decoding (both run these
steps). The attention is rowattention.c's for every sdpa flavour (`SDPA`: torch's sdpa to
float rounding); eager attention keeps fused.py's calls. It also needs a bf16 model with
rowamx.c or a float32 one with rowgemm.c (16-bit weights too), q/k/v and gate/up joined
(fused.py), the rotary embedding tabulated and our KV cache; prompts longer than MAX_ROWS
tokens keep fused.py's calls (as their products keep the libraries').

Compiled once per machine beside the other kernels (kernels.py); $GUMIHO_ROWLAYER=0 keeps
fused.py's torch calls (to compare, or when chasing a problem).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from gumiho import kernels, rowamx, rowgemm
from gumiho.attention import SDPA_GQA, SDPA_INVARIANT

SOURCE = Path(__file__).with_name("rowlayer.c")
MAX_ROWS = rowgemm.MAX_ROWS
KINDS = {torch.float32: 0, torch.bfloat16: 2}  # rowkernels.h's F32, BF16
# the attention implementations rowattention.c stands in for (each computes softmax(q k^T
# scale) v over the visible keys; rowattention.c to float rounding, each row its own)
SDPA = ("sdpa", SDPA_GQA, SDPA_INVARIANT)
FAILED = {-1: "a row sees no key", -2: "a position past the rotary table or the cache",
          -3: "out of memory"}


class Product(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("b", ctypes.c_void_p), ("kind", ctypes.c_int),
                ("pad", ctypes.c_int)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Product), ("o", Product), ("gate_up", Product), ("down", Product),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p)]


class Stack(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int) for name in (
                    "layers", "hidden", "heads", "kv_heads", "dim", "inter", "kind",
                    "capacity", "table")],
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("cache", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("amx", ctypes.c_void_p),
                ("gemm", ctypes.c_void_p), ("attend", ctypes.c_void_p),
                ("layer", ctypes.POINTER(Layer))]


def _library():
    return kernels.library("rowlayer", [SOURCE]) if rowgemm.kernel() is not None else None


def enabled() -> bool:
    """Whether decoder steps made from now on run here ($GUMIHO_ROWLAYER not "0", built)."""
    return os.environ.get("GUMIHO_ROWLAYER", "1") != "0" and kernel() is not None


def identity() -> str | None:
    """Which build runs here, or None (part of what measured costs are cached under)."""
    return _library()[2].stem if enabled() else None


@functools.cache
def kernel():
    """The compiled step (a ctypes function), or None where it cannot be built here (no
    rowgemm.c kernels, no compiler)."""
    lib = kernels.built(_library(), [SOURCE], "decoder steps stay fused.py's")
    if lib is None:
        return None
    function = lib.rowlayer
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.POINTER(Stack), ctypes.c_void_p, ctypes.c_int,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return function


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


class RowLayers:
    """fused.py's `LlamaLayers` (and the decoder's final norm) as one rowlayer.c call a step,
    for the steps it takes (`__call__` answers None for the rest). Made by `of`, which says
    where it applies."""

    def __init__(self, layers, final_norm, dtype: torch.dtype):
        self.layers, self.dtype, self.kind = layers, dtype, KINDS[dtype]
        first = layers.layers[0]
        config = first.self_attn.config
        self.hidden, self.inter = config.hidden_size, first.mlp.gate_proj.out_features
        amx = rowamx.kernel() if dtype == torch.bfloat16 else None
        gemm = rowgemm.kernel()
        self._keep = [amx, gemm]  # what the structures point into
        table = (Layer * len(layers.layers))()
        for i, layer in enumerate(layers.layers):
            products = (layers.qkv[i], layer.self_attn.o_proj, layers.gate_up[i],
                        layer.mlp.down_proj)
            for name, linear in zip(("qkv", "o", "gate_up", "down"), products, strict=True):
                setattr(table[i], name, self._product(linear))
            if not isinstance(layer.input_layernorm, nn.Identity):
                table[i].norm1 = self._pointer(layer.input_layernorm.weight)
            table[i].norm2 = self._pointer(layer.post_attention_layernorm.weight)
        self.table = table
        self.stack = Stack(
            layers=len(layers.layers), hidden=self.hidden, heads=layers.heads,
            kv_heads=layers.kv_heads, dim=layers.head_dim, inter=self.inter, kind=self.kind,
            eps=first.post_attention_layernorm.variance_epsilon, scale=first.self_attn.scaling,
            final_norm=None if final_norm is None else self._pointer(final_norm.weight),
            amx=_address(amx) if amx is not None else None, gemm=_address(gemm),
            attend=_address(gemm.attention), layer=table)
        self._tables = None  # the rotary table the stack points at

    def _pointer(self, tensor: Tensor) -> int:
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _product(self, linear) -> Product:
        """A packed layer's prepared weight (rowamx.c's tiles in bf16, rowgemm.c's weight in
        float32, stored as its `kind`) and float32 bias, as rowlayer.c's `struct product`."""
        if self.kind == KINDS[torch.bfloat16]:
            prepared = linear.tiles
            weight, kind = prepared.tiles, 0
        else:
            prepared = linear.rows
            weight, kind = prepared.weight, prepared.kind
        bias = None if prepared.bias is None else prepared.bias.data_ptr()
        return Product(weight.data_ptr(), bias, kind, 0)

    @classmethod
    def of(cls, layers, final_norm, dtype: torch.dtype, sdpa: bool) -> RowLayers | None:
        """The C steps for fused.py's `layers` (q/k/v and gate/up joined) with the decoder's
        `final_norm` (or None), or None where they do not apply here (module doc). sdpa:
        whether the layers' attention is one of the sdpa kind (`SDPA`), which
        rowattention.c computes."""
        if not sdpa or dtype not in KINDS or layers.qkv is None or \
                layers.layers[0].post_attention_layernorm.weight.device.type != "cpu" or \
                not enabled():
            return None
        if dtype == torch.bfloat16 and rowamx.kernel() is None:
            return None
        first = layers.layers[0]
        sizes = (first.self_attn.config.hidden_size, layers.head_dim,
                 first.mlp.gate_proj.out_features)
        if any(n % 16 for n in sizes):
            return None
        norms = [m for layer in layers.layers
                 for m in (layer.input_layernorm, layer.post_attention_layernorm)
                 if not isinstance(m, nn.Identity)] + ([final_norm] if final_norm else [])
        eps = first.post_attention_layernorm.variance_epsilon
        if any(getattr(m, "weight", None) is None or m.weight.dtype != dtype
               or m.weight.device.type != "cpu" or getattr(m, "variance_epsilon", None) != eps
               for m in norms):
            return None
        if len({layer.self_attn.scaling for layer in layers.layers}) != 1:
            return None
        linears = [linear for i, layer in enumerate(layers.layers)
                   for linear in (layers.qkv[i], layer.self_attn.o_proj, layers.gate_up[i],
                                  layer.mlp.down_proj)]
        ready = (lambda m: getattr(m, "tiles", None) is not None) if dtype == torch.bfloat16 \
            else (lambda m: getattr(m, "rows", None) is not None)
        if not all(ready(linear) for linear in linears):
            return None
        return cls(layers, final_norm, dtype)

    def storage_shape(self, capacity: int) -> tuple[int, ...]:
        """The KV cache storage rowlayer.c writes (kv_cache.py): (layers, keys and values,
        1, kv heads, capacity, head dim)."""
        s = self.stack
        return (s.layers, 2, 1, s.kv_heads, capacity, s.dim)

    def __call__(self, h: Tensor, position_ids: Tensor, cache, attention_mask) -> Tensor | None:
        """The layers and the final norm on h (1, T, H) at position_ids (1, T) over `cache`
        (our KVCache's HF cache) under a (1, 1, T|1, visible) bool mask: (1, T, H), or None
        where this step is not one rowlayer.c takes (fused.py runs it instead)."""
        rows = h.shape[1]
        kv = getattr(getattr(cache, "layers", [None])[0], "cache", None)
        if (not 1 <= rows <= MAX_ROWS or h.shape[0] != 1 or h.dtype != self.dtype
                or h.shape[-1] != self.hidden or h.device.type != "cpu"
                or position_ids.dtype != torch.long or position_ids.numel() != rows
                or kv is None or kv.window is not None or kv.storage.dtype != self.dtype
                or kv.storage.shape != self.storage_shape(kv.capacity)
                or not kv.storage.is_contiguous()
                or not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool
                or attention_mask.dim() != 4 or attention_mask.shape[:2] != (1, 1)
                or attention_mask.shape[2] not in (1, rows)
                or self.layers.cos is None or not self.layers.cos.is_contiguous()
                or not self.layers.sin.is_contiguous() or torch.compiler.is_compiling()
                or torch.is_grad_enabled() and h.requires_grad):
            return None
        visible = attention_mask.shape[-1]
        stack = self.stack
        if self._tables is not self.layers.cos:
            self._tables = self.layers.cos
            stack.cos, stack.sin = self.layers.cos.data_ptr(), self.layers.sin.data_ptr()
            stack.table = self.layers.cos.shape[0]
        stack.cache, stack.capacity = kv.storage.data_ptr(), kv.capacity
        mask = rowgemm.visible_rows(attention_mask, rows)
        positions = position_ids.reshape(-1).contiguous()
        # row-major, as rowlayer.c reads it (a plain clone keeps a permuted view's strides)
        out = h.reshape(rows, -1).clone(memory_format=torch.contiguous_format)
        status = kernel()(ctypes.byref(stack), out.data_ptr(), rows, positions.data_ptr(),
                          kv.position.data_ptr(), visible, mask.data_ptr())
        if status:
            raise ValueError(f"rowlayer: {FAILED.get(status, status)}")
        return out.view(1, rows, -1)
