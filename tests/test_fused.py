"""fused.py: a Llama target's decoder on the CPU in fewer operations gives transformers'
decoder's outputs bit for bit (prompts, decode steps, tree verifies; float32, bf16 and
float16; each attention implementation; q/k/v joined or apart, with biases), and is used
only where that was shown: Llama decoders on the CPU, not after `unpack`, not with
GUMIHO_FUSED=0. Its steps here are its torch calls (rowlayer.c's, which run steps of up
to 80 rows where they build, round in two places on their own: tests/test_rowlayer.py)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from gumiho import fused
from gumiho.engine import prefill, verify_tree
from gumiho.fused import FusedDecoder
from gumiho.kv_cache import KVCache
from gumiho.linear import pack_linears
from gumiho.target import load_target, wrap_target

from conftest import DEVICE
from drafters_for_tests import random_tree

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the fused decoder is CPU-only")


@pytest.fixture(autouse=True)
def _torch_calls(monkeypatch):
    """fused.py's own calls, not rowlayer.c's steps (tests/test_rowlayer.py), in every
    target these tests load."""
    monkeypatch.setenv("GUMIHO_ROWLAYER", "0")


def outputs(target, prompt: list[int], trees) -> list[torch.Tensor]:
    """Features and logits of a prompt, a decode step and each tree on one cache."""
    cache = KVCache.for_model(target.model, 256)
    got = list(prefill(target, cache, torch.tensor([prompt])))
    for tree in trees:
        got += verify_tree(target, cache, tree)
        cache.commit(1)  # the root: the next tree sits one position further
    return got


def assert_fused_is_transformers(target, prompt, trees) -> None:
    assert target._fused is not None
    with_fused = outputs(target, prompt, trees)
    target.__dict__["_fused"] = None  # transformers' decoder
    try:
        without = outputs(target, prompt, trees)
    finally:
        del target.__dict__["_fused"]
    for a, b in zip(with_fused, without, strict=True):
        assert torch.equal(a, b)


def trees_for(vocab: int, seed: int = 0):
    """A decode step (a tree of its root alone) and trees of 5, 12 and 30 nodes."""
    g = torch.Generator().manual_seed(seed)
    return [random_tree(torch.tensor(7), n, vocab, g) for n in (1, 5, 12, 30)]


@pytest.mark.parametrize("dtype,attention", [("float32", "sdpa"), ("float32", "sdpa_invariant"),
                                             ("bfloat16", "sdpa_invariant"),
                                             ("bfloat16", "sdpa"), ("bfloat16", "eager"),
                                             ("float16", "sdpa_invariant")])
def test_smollm2_decoder_bit_for_bit(dtype, attention):
    """A prompt of ~130 tokens too: past the row kernels' 80 rows, the libraries' products."""
    target = load_target("smollm2", device="cpu", dtype=dtype, attn_implementation=attention)
    short = target.chat_ids("Name the planets of the solar system in order.")
    long = target.chat_ids("Summarise: " + "the river rises in the hills and runs " * 12)
    assert len(short) < 80 < len(long) <= 160
    for prompt in (short, long):
        assert_fused_is_transformers(target, prompt, trees_for(target.config.vocab_size))


def tiny(join: bool, monkeypatch, **config) -> object:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        **config)).eval()
    pack_linears(model)
    if not join:
        monkeypatch.setattr(fused, "JOIN_LIMIT_BYTES", 0)
    return wrap_target(model, name="tiny")


@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize("config", [{"attn_implementation": "eager"},
                                    {"attn_implementation": "sdpa", "attention_bias": True,
                                     "mlp_bias": True}])
def test_tiny_llama_bit_for_bit(join, config, monkeypatch):
    """A target too large to join calls its projections apart: the same bits either way."""
    target = tiny(join, monkeypatch, **config)
    assert (target._fused.layers.qkv is not None) == join
    assert_fused_is_transformers(target, list(range(3, 40)), trees_for(97, seed=1))


def test_used_only_where_shown(monkeypatch):
    target = tiny(True, monkeypatch, attn_implementation="sdpa")
    assert isinstance(target._fused, FusedDecoder)
    target.unpack()  # torch.compile's path: transformers' decoder over plain layers
    assert target._fused is None
    monkeypatch.setenv("GUMIHO_FUSED", "0")
    assert FusedDecoder.of(tiny(True, monkeypatch).model) is None
    monkeypatch.delenv("GUMIHO_FUSED")
    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    assert FusedDecoder.of(mistral) is None  # not transformers' Llama layers
    with torch.device("meta"):  # off the CPU
        meta = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64,
                                            intermediate_size=96, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2))
    assert FusedDecoder.of(meta) is None
