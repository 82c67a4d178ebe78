"""Llama decoder layers in fewer operations, for inference: the drafter's serial layers
(`FusedSerial`, modeling/drafter.py) and a Llama target's decoder on the CPU
(`FusedDecoder`, target.py).

transformers' `LlamaDecoderLayer` spends a step's time on the host where the products are
cheap: each of its ~40 operations a layer costs ~5-10 us of Python and dispatch, so a
SmolLM2 decode step on a 2-core CPU (30 layers) paid more for them than for its products
(profiled 2026-11-29: 120 products ~11 ms of a ~40 ms bf16 step). `LlamaLayers` computes
the same arithmetic with fewer calls: q, k and v as one product and gate and up as another
(weights concatenated once), RMSNorm as one torch call, the rotary embedding looked up in a
table and applied to q and k together, no module calls. Every value is computed by the same
operation on the same operands as in transformers' layer, so the outputs are the same bits
(`tests/test_fused.py`: SmolLM2 in float32 and bf16, decode steps, trees and prompts): a
product of concatenated weights gives each output what the separate product gives it
where products sum each output alone (rowgemm.c, rowamx.c; checked there too), and the
rotary turn `x cos + (-x2, x1) sin` becomes `x cos + (x2, x1) (-sin1, sin2)`, the same
products up to an exact sign.

`GUMIHO_FUSED=0` runs the target through transformers' decoder instead (to compare).

This is not a vendored copy of the model (STYLE.md 8): the stock `AutoModelForCausalLM`
is loaded and keeps its modules and weights, which these steps read; only the order of
calls around them is ours, for one layer type, on one device. Everything else (other
families, GPUs, training's features, `torch.compile`) runs transformers' own forward, and
the tests hold this path to that forward's bits under the pinned transformers, so a change
there fails a test instead of drifting.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaModel,
    eager_attention_forward,
)

from gumiho.linear import PackedLinear
from gumiho.rowlayer import SDPA, RowLayers

# The concatenated q/k/v and gate/up weights are copies: a target joins them only while the
# copies stay small (SmolLM2: ~140 MB in bf16), a larger one calls its projections apart.
JOIN_LIMIT_BYTES = 1 << 30


class LlamaLayers:
    """A frozen stack of transformers' `LlamaDecoderLayer`s computed in fewer operations
    (module doc). attention_for(attention module): the attention function to call, with
    transformers' signature (asked once a call, so a model switched to another
    implementation follows). join: concatenate q/k/v and gate/up (copies)."""

    def __init__(self, layers, rotary: nn.Module, attention_for: Callable, join: bool = True):
        self.layers, self.rotary, self.attention_for = list(layers), rotary, attention_for
        config = self.layers[0].self_attn.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.qkv = [_joined([layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj]) for layer in self.layers] if join else None
        self.gate_up = [_joined([layer.mlp.gate_proj, layer.mlp.up_proj])
                        for layer in self.layers] if join else None
        self.cos = self.sin = None  # the rotary embedding by position, once `reserve`d

    @staticmethod
    def supports(layers) -> bool:
        """Whether `layers` are plain Llama layers this class computes exactly."""
        config = layers[0].self_attn.config
        return (config.hidden_act == "silu" and getattr(config, "pretraining_tp", 1) == 1
                and all(type(layer) is LlamaDecoderLayer for layer in layers))

    @staticmethod
    def join_bytes(layers) -> int:
        """What concatenating q/k/v and gate/up would copy, in bytes."""
        return sum(linear.weight.numel() * linear.weight.element_size() for layer in layers
                   for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                  layer.self_attn.v_proj, layer.mlp.gate_proj,
                                  layer.mlp.up_proj))

    def reserve(self, positions: int, like: Tensor) -> None:
        """Tabulate the rotary embedding for positions 0..positions-1 in `like`'s dtype and
        device (what the layers' inputs are), so a step looks its positions up instead of
        computing them: the rotary module itself over all of them at once, the same values
        (each is one product and a cos or sin of it). Rotations that change with the length
        (dynamic, longrope) are computed each step instead."""
        rotary = self.rotary
        if (self.cos is not None and self.cos.shape[0] >= positions) or \
                "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
            return
        probe = torch.zeros((), dtype=like.dtype, device=like.device)
        cos, sin = rotary(probe, torch.arange(positions, device=like.device)[None])
        self.cos, self.sin = cos[0], _signed(sin[0])  # (positions, D)

    def __call__(self, h: Tensor, position_ids: Tensor, attention_mask: Tensor | None,
                 cache=None) -> Tensor:
        """The layers on h (B, T, H) at position_ids (B, T) under attention_mask (what the
        attention function takes) with an HF cache or None; returns (B, T, H)."""
        if self.cos is not None:  # positions past the table would fail to index
            cos, sin = self.cos[position_ids], self.sin[position_ids]
        else:
            cos, sin = self.rotary(h, position_ids)
            sin = _signed(sin)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (B, T, 1, D): over q's and k's heads
        batch, length = h.shape[:2]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        attend = self.attention_for(self.layers[0].self_attn)  # the layers share a config
        for i, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = h if isinstance(layer.input_layernorm, nn.Identity) else \
                rms_norm(layer.input_layernorm, h)
            if self.qkv is not None:
                qkv = self.qkv[i](x).view(batch, length, heads + 2 * kv_heads, dim)
                qk, v = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads :]
            else:
                qk = torch.cat([attention.q_proj(x), attention.k_proj(x)], -1).view(
                    batch, length, heads + kv_heads, dim)
                v = attention.v_proj(x).view(batch, length, kv_heads, dim)
            # transformers' apply_rotary_pos_emb for q and k at once: x cos + (-x2, x1) sin,
            # the halves swapped by one flip and the sign kept in the sin table
            qk = qk * cos + qk.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2) * sin
            q, k, v = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), \
                v.transpose(1, 2)
            if cache is not None:
                k, v = cache.update(k, v, i)
            out = attend(attention, q, k, v, attention_mask, dropout=0.0,
                         scaling=attention.scaling)[0]  # (B, T, heads, D)
            h = h + attention.o_proj(out.reshape(batch, length, heads * dim))
            x = rms_norm(layer.post_attention_layernorm, h)
            if self.gate_up is not None:
                gate, up = self.gate_up[i](x).chunk(2, -1)
            else:
                gate, up = layer.mlp.gate_proj(x), layer.mlp.up_proj(x)
            h = h + layer.mlp.down_proj(F.silu(gate) * up)
        return h


def configured_attention(module: nn.Module):
    """The attention function transformers' layer would call for `module`'s config."""
    return ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                 eager_attention_forward)


class FusedDecoder:
    """A Llama target's decoder (`LlamaModel`) on the CPU computed by `LlamaLayers`: the
    embedding, the layers, the final norm, with the target's own attention implementation
    and our KV cache. `Target.forward` runs it where `of` gives one; the outputs are
    transformers' decoder's bit for bit (module doc)."""

    def __init__(self, decoder: LlamaModel):
        self.decoder = decoder
        layers = decoder.layers[: decoder.config.num_hidden_layers]
        self.layers = LlamaLayers(layers, decoder.rotary_emb, configured_attention,
                                  join=LlamaLayers.join_bytes(layers) <= JOIN_LIMIT_BYTES)
        # steps of up to 80 tokens in one C call where the row kernels run (rowlayer.py)
        self.rows = RowLayers.of(self.layers, decoder.norm, decoder.embed_tokens.weight.dtype,
                                 sdpa=decoder.config._attn_implementation in SDPA)

    @classmethod
    def of(cls, model: nn.Module) -> FusedDecoder | None:
        """The fused decoder of a loaded causal LM, or None: off the CPU (a GPU's captured
        steps record their kernels anyway; untested there), for decoders other than
        transformers' `LlamaModel` of plain Llama layers, and with $GUMIHO_FUSED = "0"."""
        decoder = model.get_decoder()
        if (os.environ.get("GUMIHO_FUSED", "1") == "0" or type(decoder) is not LlamaModel
                or decoder.embed_tokens.weight.device.type != "cpu"
                or not LlamaLayers.supports(decoder.layers)):
            return None
        return cls(decoder)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, cache, mask: Tensor,
                 decoder_masks: Callable[[Tensor], object]) -> Tensor:
        """`LlamaModel(...).last_hidden_state` for input_ids, position_ids (1, K) on top of
        `cache` (our KVCache's HF cache: its capacity sizes the rotary table) under our
        (M, 1, K, visible) bool mask (`KVCache.attention_mask`), which `decoder_masks`
        (`Target._decoder_masks`) turns into what the decoder's attention takes: (1, K, H).
        Steps rowlayer.c takes run there (`rows`), the rest here."""
        h = self.decoder.embed_tokens(input_ids)
        keys = getattr(cache.layers[0], "keys", None) if hasattr(cache, "layers") else None
        if keys is not None:
            self.layers.reserve(keys.shape[-2], h)
        if self.rows is not None:  # (it takes one kind of layer's mask: M = 1)
            out = self.rows(h, position_ids, cache, mask)
            if out is not None:
                return out
        return rms_norm(self.decoder.norm,
                        self.layers(h, position_ids, decoder_masks(mask), cache))


def rms_norm(norm: nn.Module, h: Tensor) -> Tensor:
    """transformers' LlamaRMSNorm in one call of torch's (normalised in float32, then the
    weight): the same operations, the same bits."""
    if h.dtype == torch.float32 == norm.weight.dtype:
        return F.rms_norm(h, h.shape[-1:], norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(h.float(), h.shape[-1:], eps=norm.variance_epsilon
                                    ).to(h.dtype)


def _signed(sin: Tensor) -> Tensor:
    """The rotary sin (..., D) with its first half negated: (x2, x1) * this is HF's
    rotate_half(x) * sin, where rotate_half(x) = (-x2, x1)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def _joined(linears: list[nn.Module]) -> nn.Module:
    """One linear layer computing `linears` side by side (an inference copy), packed for the
    CPU like them (linear.PackedLinear) where they were."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biased = any(linear.bias is not None for linear in linears)
    joined = nn.Linear(weight.shape[1], weight.shape[0], bias=biased, device="meta")
    joined.weight = nn.Parameter(weight, requires_grad=False)
    if biased:
        joined.bias = nn.Parameter(torch.cat([
            linear.bias.detach().to(weight.dtype) if linear.bias is not None else
            torch.zeros(linear.out_features, dtype=weight.dtype, device=weight.device)
            for linear in linears]), requires_grad=False)
    return PackedLinear(joined) if isinstance(linears[0], PackedLinear) else joined
