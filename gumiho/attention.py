"""sdpa that keeps grouped KV heads grouped under a mask, for CPU targets.

transformers' sdpa attention repeats each KV head `num_key_value_groups` times before
calling torch (a copy of the whole cache per layer per step) unless the mask is None, and
every step of ours passes a mask (the tree mask, or the committed prefix of a preallocated
cache). torch's CPU kernel takes `enable_gqa=True` together with a mask, so on the CPU we
pass the grouped keys as they are: same values (tests/test_attention.py), no copy. On CUDA
the fused kernels that take a mask do not take grouped heads, so there we keep the repeat.

`use_grouped_sdpa(model)` switches a loaded sdpa model to this function by name
(`SDPA_GQA`); masks are built as for sdpa.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

SDPA_GQA = "sdpa_gqa"


def grouped_sdpa_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """query (B, heads, Q, D), key/value (B, kv_heads, K, D), attention_mask (B|1, 1, Q, K)
    bool or additive -> (B, Q, heads, D), as transformers' attention functions return."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups == 1 or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SDPA_GQA, grouped_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)


def use_grouped_sdpa(model: torch.nn.Module) -> None:
    """Switch an sdpa model with grouped KV heads to `grouped_sdpa_forward` (in place)."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    if (model.config._attn_implementation == "sdpa"
            and (getattr(config, "num_key_value_heads", None) or heads) < heads):
        model.set_attn_implementation(SDPA_GQA)
