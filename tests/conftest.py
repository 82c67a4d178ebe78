"""Shared fixtures: a tiny random Llama (fast unit tests) and the real SmolLM2 target."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gumiho.target import load_target, wrap_target


def tiny_llama(vocab_size: int = 97, seed: int = 0, logit_scale: float = 1.0):
    """A 2-layer random Llama; logit_scale sharpens its next-token distributions."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    target = wrap_target(model, name="tiny")
    target.stop_token_ids = frozenset()
    return target


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    return load_target("smollm2")
