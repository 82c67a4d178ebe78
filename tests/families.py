"""Tiny random-weight targets of eight model families, saved as local Hugging Face dirs.

Each has 2-3 layers of width 64 and SmolLM2's real tokenizer (vocabulary 49,152), so the
whole package path (load_target, templates, data generation) runs on it. The sliding-window
families use a 16-token window, shorter than the tests' contexts; the Gemma-style targets
get a Gemma-layout chat template with `<start_of_turn>` / `<end_of_turn>` and an
`eos_token_id` list, as their releases have.
"""

import copy

import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

WINDOW = 16
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024)
# Written from the published Gemma instruction format (roles user/model, <end_of_turn>).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
    "else m['role'] %}{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<start_of_turn>model\n' }}{% endif %}")


def family_configs(vocab: int) -> dict:
    """Configs by family name: (config, chat template or None for the tokenizer's own)."""
    return {
        "llama": (LlamaConfig(vocab_size=vocab, num_hidden_layers=2, tie_word_embeddings=True,
                              **COMMON), None),
        # Sliding window on layer 1 only (max_window_layers=1): mixed full/sliding layers.
        "qwen2": (Qwen2Config(vocab_size=vocab, num_hidden_layers=2, use_sliding_window=True,
                              sliding_window=WINDOW, max_window_layers=1,
                              tie_word_embeddings=False, **COMMON), None),
        # q/k norms, and head_dim 32 != hidden / heads.
        "qwen3": (Qwen3Config(vocab_size=vocab, num_hidden_layers=2, head_dim=32,
                              tie_word_embeddings=True, **COMMON), None),
        "mistral": (MistralConfig(vocab_size=vocab, num_hidden_layers=2, sliding_window=WINDOW,
                                  tie_word_embeddings=False, **COMMON), None),
        # Final logit and attention softcapping, alternating sliding/full, scaled embeddings.
        "gemma2": (Gemma2Config(vocab_size=vocab, num_hidden_layers=2, head_dim=32,
                                query_pre_attn_scalar=32, sliding_window=WINDOW,
                                final_logit_softcapping=5.0, attn_logit_softcapping=20.0,
                                **COMMON), GEMMA_TEMPLATE),
        # Five sliding layers to one full in the release; here 2:1. head_dim 48 != 64 / 4.
        "gemma3": (Gemma3TextConfig(
            vocab_size=vocab, num_hidden_layers=3, head_dim=48, query_pre_attn_scalar=48,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1e4}},
            **COMMON), GEMMA_TEMPLATE),
        # Logits divided by `logits_scaling` after the lm_head, scaled embeddings, residuals
        # and attention scores.
        "granite": (GraniteConfig(vocab_size=vocab, num_hidden_layers=2, logits_scaling=4.0,
                                  embedding_multiplier=6.0, residual_multiplier=0.5,
                                  attention_multiplier=0.2, tie_word_embeddings=True,
                                  **COMMON), None),
        # Logits multiplied by `logit_scale`, LayerNorm, attention and MLP side by side.
        "cohere": (CohereConfig(vocab_size=vocab, num_hidden_layers=2, logit_scale=0.25,
                                bos_token_id=1, eos_token_id=2, **COMMON), None),
    }


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "granite", "cohere")


def save_family(path, family: str, tokenizer, seed: int = 0) -> str:
    """Write a tiny random `family` target with `tokenizer` to `path`; returns the path."""
    tok = copy.deepcopy(tokenizer)
    config, template = family_configs(len(tok))[family]
    if template is not None:
        tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>",
                                                              "<end_of_turn>"]})
        tok.chat_template = template
    config.vocab_size = len(tok)
    ends = [tok.eos_token_id] + ([tok.convert_tokens_to_ids("<end_of_turn>")] if template else [])
    config.eos_token_id = ends if len(ends) > 1 else ends[0]
    config.bos_token_id = tok.bos_token_id if tok.bos_token_id is not None else ends[0]
    config.pad_token_id = ends[0]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start constant (Gemma's at 0, scale 1 + w): vary them
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
