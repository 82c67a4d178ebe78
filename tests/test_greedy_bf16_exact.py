"""bf16 on a CPU with row-independent products: with `sdpa_invariant` attention a tree
verify computes every node as one-token decoding would, so greedy speculative output is
bit for bit plain bf16 decoding's (with torch's own sdpa it parts at near-ties)."""

import pytest
import torch

from gumiho import linear
from gumiho.attention import invariant_here
from gumiho.config import TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.target import load_target

from conftest import DEVICE

PROMPTS = ("List three uses of a paperclip.", "Write a haiku about autumn rain.")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the invariant attention is the CPU's")
def test_bf16_greedy_output_is_plain_decodings_with_invariant_attention():
    if not (linear.rows_independent(torch.bfloat16) and invariant_here(torch.bfloat16)):
        pytest.skip("this CPU's bf16 products or attention depend on the batch shape")
    target = load_target("smollm2", device="cpu", dtype="bfloat16",
                         attn_implementation="sdpa_invariant")
    config = GenerateConfig(max_new_tokens=48)
    drafters = [load_drafter(m, target, f"gumiho/assets/smollm2/{m}",
                             tree=TreeConfig.for_method(m, total_tokens=8, lookup=10))
                for m in ("gumiho", "eagle2")]
    for prompt in PROMPTS:
        ids = target.chat_ids(prompt)
        plain = run(target, PlainDrafter(), ids, config)
        for drafter in drafters:
            out = run(target, drafter, ids, config)
            assert out.token_ids == plain.token_ids
            assert max(out.accept_lengths) > 1  # drafts were accepted, not just plain steps
