"""Drafter networks: the serial transformer head, Gumiho's parallel MLP heads, Medusa heads.

Plain `nn.Module`s built from a `DrafterConfig`: no file I/O, no tokenizer, no dtype
forcing. Logits always come from the target's frozen lm_head, passed in by the caller as a
`DraftHead` (modeling/vocab.py): the lm_head rows of the drafter's draft vocabulary, whose
`d2t`/`t2d` buffers a drafter with a reduced vocabulary carries.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from gumiho.attention import grouped_sdpa_forward
from gumiho.config import DrafterConfig
from gumiho.fused import LlamaLayers
from gumiho.methods import method_spec
from gumiho.modeling.vocab import add_vocab_buffers
from gumiho.rowlayer import RowLayers


def _linear_init(weight: Tensor, bias: Tensor, fan_in: int) -> None:
    """nn.Linear's default initialisation, for stacked weights."""
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)
    nn.init.uniform_(bias, -bound, bound)


class ParallelHeads(nn.Module):
    """Gumiho's N MLP heads, run together as batched matmuls.

    Head i: SiLU(Linear(2H -> H)) then R residual blocks x + SiLU(Linear(H -> H)), the
    residual weights zero-initialised. Weights are stacked over heads; the checkpoint code
    maps them to and from the official `mlp.{i}.{j}.linear.*` keys.
    """

    def __init__(self, hidden: int, num_heads: int, num_layers: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(num_heads, hidden, 2 * hidden))
        self.b_in = nn.Parameter(torch.empty(num_heads, hidden))
        self.w_res = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, hidden))
        self.b_res = nn.Parameter(torch.zeros(num_heads, num_layers, hidden))
        _linear_init(self.w_in.data, self.b_in.data, 2 * hidden)

    def forward(self, x: Tensor, heads: int | None = None, first: int = 0) -> Tensor:
        """x (..., 2H) -> (..., n, H): each head's output for every input row, heads
        `first` .. `first + heads - 1` (default: all; a tree that drafts some levels
        otherwise needs fewer)."""
        stop = first + heads if heads else self.w_in.shape[0]
        n, hidden = stop - first, self.w_in.shape[1]
        # all heads' first layers as one product (the weight's heads are a contiguous view)
        h = F.silu(F.linear(x, self.w_in[first:stop].reshape(n * hidden, -1))
                   .unflatten(-1, (n, hidden)) + self.b_in[first:stop])
        for r in range(self.w_res.shape[1]):
            h = h + F.silu(self._per_head(h, self.w_res[first:stop, r])
                           + self.b_res[first:stop, r])
        return h

    @staticmethod
    def _per_head(h: Tensor, weight: Tensor) -> Tensor:
        """h (..., n, H) by each head's own weight (n, H, H): out[..., i, :] = h[..., i, :]
        @ weight[i].T. Never copies the weight (a strided slice of the stacked one): einsum
        copied it on every call (3.3-6.6 MB a layer, 5 layers a drafting pass). For inference
        on the CPU one product per head (its bf16 batched products copy the weight too);
        elsewhere one batched product (strided batches need no copy on a GPU, one launch,
        and in training one gradient for the stack)."""
        if h.device.type == "cpu" and not torch.is_grad_enabled():
            return torch.stack([F.linear(h[..., i, :], weight[i])
                                for i in range(weight.shape[0])], -2)
        lead = h.shape[:-2]
        rows = h.reshape(-1, *h.shape[-2:]).transpose(0, 1)  # (n, M, H)
        return torch.matmul(rows, weight.transpose(1, 2)).transpose(0, 1).reshape(
            *lead, *h.shape[-2:])


class MedusaHeads(nn.Module):
    """Medusa heads (Cai et al. 2024): head i reads only the target feature f_t and predicts
    x_{t+2+i}; R residual blocks x + SiLU(Linear(H -> H)), zero-initialised. By default they
    share the target's frozen lm_head; `own_lm_head` gives each head its own projection
    (initialise it from the target's with `init_lm_heads`)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hidden, num_heads, num_layers = (config.hidden_size, config.num_mlp_heads,
                                         config.num_mlp_layers)
        vocab = config.draft_vocab_size or config.vocab_size
        self.w = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, hidden))
        self.b = nn.Parameter(torch.zeros(num_heads, num_layers, hidden))
        self.lm_heads = nn.Parameter(torch.zeros(num_heads, vocab, hidden)) \
            if config.medusa_own_lm_head else None
        add_vocab_buffers(self, config.vocab_size, config.draft_vocab_size)

    def init_lm_heads(self, head) -> None:
        """Start each own projection from the target's (draft-vocabulary) lm_head rows."""
        if self.lm_heads is not None:
            self.lm_heads.data.copy_(head.weight.expand_as(self.lm_heads))

    def forward(self, features: Tensor) -> Tensor:
        """features (..., H) -> (..., N, H)."""
        h = features.unsqueeze(-2).expand(*features.shape[:-1], self.w.shape[0], -1)
        for r in range(self.w.shape[1]):
            h = h + F.silu(torch.einsum("...ni,noi->...no", h, self.w[:, r]) + self.b[:, r])
        return h

    def logits(self, hidden: Tensor, head) -> Tensor:
        """hidden (..., N, H) -> (..., N, D) over the draft vocabulary (`head`: DraftHead)."""
        if self.lm_heads is None:
            return head(hidden)
        return torch.einsum("...nh,nvh->...nv", hidden, self.lm_heads)


class DraftModel(nn.Module):
    """Serial transformer head (Gumiho: 2 layers; EAGLE-2: 1) plus optional parallel heads.

    The input at position t is fc(cat(embed(x_{t+1}), f_t)); layer 0 has no input norm and
    there is no final norm; the output out_t approximates f_{t+1}. The embedding is a frozen
    copy of the target's.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        llama = config.llama_config()
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(llama, i) for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(llama)
        self.mlp = ParallelHeads(h, config.num_mlp_heads, config.num_mlp_layers) \
            if method_spec(config.method).parallel_heads and config.num_mlp_heads else None
        add_vocab_buffers(self, config.vocab_size, config.draft_vocab_size)

    def fuse(self, tokens: Tensor, features: Tensor) -> Tensor:
        """fc(cat(embed(tokens), features)): tokens (...,), features (..., H) -> (..., H)."""
        embedded = self.embed_tokens(tokens)  # its dtype is fc's (fc may be packed)
        return self.fc(torch.cat([embedded, features.to(embedded.dtype)], -1))

    def serial_step(self, tokens: Tensor, features: Tensor, position_ids: Tensor,
                    attention_mask: Tensor, cache=None) -> Tensor:
        """One pass of the serial layers. tokens (B, T), features (B, T, H), position_ids
        (B, T), attention_mask (B, 1, T, kv) bool; cache: an HF cache of the drafter's own
        keys/values or None. Returns out (B, T, H)."""
        h = self.fuse(tokens, features)
        rope = self.rotary(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=cache, use_cache=cache is not None,
                      position_embeddings=rope)
        return h

    def forward(self, input_ids: Tensor, features: Tensor, valid: Tensor,
                detach_heads: bool = False) -> dict[str, Tensor]:
        """Teacher-forced training pass. input_ids (B, L), features (B, L, H) (noised by the
        caller), valid (B, L) bool (False on padding).

        Returns out1 (B, L-1, H): serial step 1 on the true pairs (f_t, x_{t+1}), each
        approximating f_{t+1}; and, for Gumiho, out2 (B, L-2, H): serial step 2 on
        (out1_t, x_{t+2}) at position t+1, seeing the true pairs 0..t and itself as at
        inference; mlp (B, L-3, N, H): the heads on (x_{t+2}, out1_t, x_{t+3}, out2_t),
        head i approximating f_{t+3+i}. detach_heads (`--mlp-detach`): the heads' losses
        reach the heads alone, not the serial layers and fc that make their inputs.
        """
        from transformers import DynamicCache

        n = input_ids.shape[1] - 1
        device = input_ids.device
        keys = valid[:, 1:]  # pair t is real iff x_{t+1} is
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        mask1 = (causal[None] & keys[:, None, :])[:, None]  # (B, 1, n, n)
        positions = torch.arange(n, device=device).expand(input_ids.shape[0], -1)
        cache = DynamicCache() if self.mlp is not None else None
        out1 = self.serial_step(input_ids[:, 1:], features[:, :-1], positions, mask1, cache)
        result = {"out1": out1}
        if self.mlp is None:
            return result
        m = n - 1
        seen = torch.ones(m, n, dtype=torch.bool, device=device).tril()  # true pairs 0..t
        own = torch.eye(m, dtype=torch.bool, device=device)
        mask2 = torch.cat([seen[None] & keys[:, None, :], own[None].expand(len(keys), -1, -1)],
                          -1)[:, None]  # (B, 1, m, n + m)
        out2 = self.serial_step(input_ids[:, 2:], out1[:, :-1], positions[:, 1:] , mask2, cache)
        result["out2"] = out2
        result["mlp"] = self.parallel_heads(input_ids[:, 2:-1], out1[:, :-2],
                                            input_ids[:, 3:], out2[:, :-1],
                                            detached=detach_heads)
        return result

    def parallel_heads(self, d1: Tensor, out1: Tensor, d2: Tensor, out2: Tensor,
                       heads: int | None = None, first: int = 0,
                       detached: bool = False) -> Tensor:
        """All MLP heads at once (or `heads` of them from head `first`, 0-based). d1, d2
        (...,) the serial levels' tokens; out1, out2 (..., H) the serial outputs they were
        drawn from. Returns (..., n, H): head i approximates f_{t+3+i} (its logits give
        x_{t+4+i}). detached (training, `--mlp-detach`): their inputs are computed without
        autograd, so their losses reach the heads only."""
        with torch.no_grad() if detached else nullcontext():
            fused = torch.cat([self.fuse(d1, out1), self.fuse(d2, out2)], -1)
        return self.mlp(fused, heads, first)


class FusedSerial:
    """The serial layers of a frozen `DraftModel` for drafting: `serial_step`'s arithmetic
    in fewer, larger operations (`gumiho.fused.LlamaLayers`: q/k/v one product, gate/up
    another, RMSNorm one call, the rotary embedding from a table). A drafting step on a CPU
    pays ~10 us of Python and dispatch per operation (2.7 ms for a warm two-layer step of 2
    tokens, of which 0.65 ms are its products, on the 2-core dev machine), and on a GPU each
    operation is a kernel of its own, even inside a captured step; the values are
    `serial_step`'s.

    For a training model (weights that change) call `DraftModel.serial_step` instead."""

    def __init__(self, model: DraftModel):
        self.model = model
        # attention: grouped KV heads kept grouped on the CPU, folded where CUDA needs them
        self.layers = LlamaLayers(model.layers, model.rotary, lambda _: grouped_sdpa_forward)
        # on a CPU, steps of up to 80 tokens in one C call (gumiho/rowlayer.py)
        self.rows = RowLayers.of(self.layers, None, model.embed_tokens.weight.dtype, sdpa=True)

    def reserve(self, positions: int) -> None:
        """Tabulate the rotary embedding for positions 0..positions-1 (a drafter cache's
        capacity) in the steps' dtype (fuse's)."""
        self.layers.reserve(positions, self.model.embed_tokens.weight)

    @classmethod
    def of(cls, model: nn.Module) -> FusedSerial | None:
        """The fused view of `model`, or None where its layers are not the plain Llama ones
        this computes (then `model.serial_step` runs)."""
        if not isinstance(model, DraftModel) or not LlamaLayers.supports(model.layers):
            return None
        return cls(model)

    def __call__(self, tokens: Tensor, features: Tensor, position_ids: Tensor,
                 attention_mask: Tensor, cache=None) -> Tensor:
        """`DraftModel.serial_step`, the same arguments and result."""
        h = self.model.fuse(tokens, features)
        if self.rows is not None:
            out = self.rows(h, position_ids, cache, attention_mask)
            if out is not None:
                return out
        return self.layers(h, position_ids, attention_mask, cache)


def build_draft_model(config: DrafterConfig) -> nn.Module:
    """The network of the config's method: a serial head (with Gumiho's parallel heads), or
    Medusa heads."""
    return DraftModel(config) if method_spec(config.method).serial else MedusaHeads(config)
