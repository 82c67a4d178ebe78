"""sdpa with grouped KV heads under a mask (attention.py) equals transformers' sdpa."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gumiho.attention import SDPA_GQA, grouped_sdpa_forward

from conftest import tiny_llama


class Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.host
@pytest.mark.parametrize("additive", [False, True])
def test_grouped_sdpa_equals_repeated_heads(additive):
    """(1, 6 heads, 5 queries) over (1, 2 kv heads, 40 keys) with a ragged mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in
               ((1, 6, 5, 16), (1, 2, 40, 16), (1, 2, 40, 16)))
    mask = torch.rand(1, 1, 5, 40, generator=g) < 0.6
    mask[..., 0] = True  # every query sees something
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.25)
    got, _ = grouped_sdpa_forward(Module(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (1, 5, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_grouped_kv_sdpa_targets_switch_and_others_do_not():
    """A grouped-KV sdpa target runs the grouped function; eager targets keep theirs."""
    assert tiny_llama().config._attn_implementation == SDPA_GQA  # 4 heads, 2 KV heads
    from transformers import LlamaConfig, LlamaForCausalLM

    from gumiho.target import wrap_target

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="eager")
    assert wrap_target(LlamaForCausalLM(config)).config._attn_implementation == "eager"
