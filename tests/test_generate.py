"""Greedy speculative output equals greedy plain decoding, whatever the drafter proposes."""

import pytest
import torch

from gumiho.drafters import PlainDrafter
from gumiho.engine import GenerateConfig, run

from drafters_for_tests import RandomDrafter, ReplayDrafter


def hf_greedy(target, prompt, n):
    """Reference: transformers' own generate, greedy, no stop token."""
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_all_drafters_agree(target, prompt, n, vocab):
    config = GenerateConfig(max_new_tokens=n)
    plain = run(target, PlainDrafter(), prompt, config)
    assert plain.tau == 1.0 and plain.cycles == plain.new_tokens
    full = prompt + plain.token_ids
    replay = run(target, ReplayDrafter(full, depth=5, vocab_size=vocab), prompt, config)
    randomly = run(target, RandomDrafter(vocab, size=12), prompt, config)
    assert replay.token_ids == plain.token_ids
    assert randomly.token_ids == plain.token_ids
    # The replay drafter's main path is always right: 5 drafts + bonus per full cycle.
    assert max(replay.accept_lengths) == 6 and replay.tau > 3
    assert sum(replay.accept_lengths) == replay.new_tokens
    return plain


def test_plain_decoding_equals_hf_generate_tiny(tiny_target):
    prompt = [5, 17, 3, 42, 8]
    plain = run(tiny_target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=20))
    assert plain.token_ids == hf_greedy(tiny_target, prompt, 20)


def test_speculative_equals_plain_tiny(tiny_target):
    plain = check_all_drafters_agree(tiny_target, [5, 17, 3, 42, 8], 40, 97)
    assert plain.stopped_by == "max_new_tokens" and plain.new_tokens == 40


def test_speculative_equals_plain_smollm2(smollm2):
    prompt = smollm2.chat_ids("Give me three tips for learning to cook.")
    plain = check_all_drafters_agree(smollm2, prompt, 24, 49152)
    assert plain.token_ids == hf_greedy(smollm2, prompt, 24)


def test_smollm2_stops_at_end_of_turn(smollm2):
    prompt = smollm2.chat_ids("What is 2+2?")
    plain = run(smollm2, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=64))
    assert plain.stopped_by == "stop_token"
    assert plain.token_ids[-1] == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "4" in plain.text and "<|im_end|>" not in plain.text
    full = prompt + plain.token_ids
    replay = run(smollm2, ReplayDrafter(full, depth=5, vocab_size=49152), prompt,
                 GenerateConfig(max_new_tokens=64))
    assert replay.token_ids == plain.token_ids and replay.stopped_by == "stop_token"


@pytest.mark.parametrize("stop_at", [0, 3, 7])
def test_stop_token_inside_an_accepted_run(tiny_target, stop_at):
    """A stop token in the middle of a cycle's accepted tokens ends the output right there."""
    prompt = [5, 17, 3, 42, 8]
    reference = run(tiny_target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=30))
    stop = reference.token_ids[stop_at]
    first = reference.token_ids.index(stop)
    tiny_target.stop_token_ids = frozenset({stop})
    try:
        for drafter in (PlainDrafter(), ReplayDrafter(prompt + reference.token_ids, 5),
                        RandomDrafter(97)):
            out = run(tiny_target, drafter, prompt, GenerateConfig(max_new_tokens=30))
            assert out.token_ids == reference.token_ids[: first + 1], drafter.name
            assert out.stopped_by == "stop_token"
    finally:
        tiny_target.stop_token_ids = frozenset()


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_is_exact(tiny_target, n):
    prompt = [5, 17, 3, 42, 8]
    reference = run(tiny_target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=n))
    replay = run(tiny_target, ReplayDrafter(prompt + reference.token_ids + [1] * 10, 5), prompt,
                 GenerateConfig(max_new_tokens=n))
    assert len(replay.token_ids) == n and replay.token_ids == reference.token_ids
    assert replay.accept_lengths[0] == 1 and sum(replay.accept_lengths) == n


def test_fixed_verify_width_keeps_output(tiny_target):
    prompt = [5, 17, 3, 42, 8]
    plain = run(tiny_target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=16))
    drafter = ReplayDrafter(prompt + plain.token_ids, depth=4)
    out = run(tiny_target, drafter, prompt, GenerateConfig(max_new_tokens=16, verify_width=12))
    assert out.token_ids == plain.token_ids and out.tau > 2
