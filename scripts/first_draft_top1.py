"""How often a serial drafter's first draft is right on the target's own greedy answer to a
prompt: teacher forced (every position of the answer, the drafter fed the target's
features as a catch-up would), beside the tau a depth-1 chain reaches on the same answer
in the real loop (whose accepted drafts per cycle are that rate at the positions the cycles
happen to draft from).

    python scripts/first_draft_top1.py [--draft DIR] [--dtype float32|bfloat16]
                                       [--max-new-tokens 160] [PROMPT ...]

Without prompts: the demo's, the calibration's code prompt and two short ones. Row t of
the drafter (the pair f_t, x_{t+1}) drafts x_{t+2}; the rate counts the answer's
positions. Figures: docs/engine.md ("Tree size for the device") and the README's "Where it
stands".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.budget import CALIBRATION_PROMPTS  # noqa: E402
from gumiho.config import TreeConfig  # noqa: E402
from gumiho.demo import PROMPT, shipped_drafter  # noqa: E402
from gumiho.drafters import PlainDrafter, load_drafter  # noqa: E402
from gumiho.engine import GenerateConfig, TargetRunner, prefill, run  # noqa: E402
from gumiho.target import load_target  # noqa: E402

PROMPTS = (PROMPT, CALIBRATION_PROMPTS[1], "List three facts about the Moon.",
           "How do I make a cup of tea?")


@torch.no_grad()
def teacher_forced(target, drafter, ids: list[int]) -> list[int]:
    """The drafter's first draft (a target id) at every row of `ids`, fed the target's
    features of `ids` in one causal catch-up."""
    cache = TargetRunner(target, "eager").cache_for(len(ids) + 8)
    features, _ = prefill(target, cache, torch.tensor([ids]))
    drafter.begin(target, len(ids) + 64)
    tokens, n = torch.tensor(ids[1:], device=target.device), len(ids) - 1
    at = torch.arange(n, device=target.device)
    start = torch.zeros(1, dtype=torch.long, device=target.device)
    drafter.cache.reserve(n)
    drafter.cache.seek(start)
    out = drafter.serial_step(tokens[None], features[:-1][None], at[None],
                              drafter.cache.mask_at(at[None, :] <= at[:, None], start),
                              drafter.cache.hf)[0]
    return drafter.head.to_target(drafter.head(out).argmax(-1)).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", nargs="*")
    parser.add_argument("--draft", default=None, help="default: the shipped Gumiho drafter")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args(argv)
    target = load_target("smollm2", device="cpu", dtype=args.dtype,
                         attn_implementation="sdpa_invariant")
    tree = TreeConfig.for_method("gumiho", total_tokens=2, depth=1, top_k=1, mlp_topk=1,
                                 pruning=1, lookup=0)
    drafter = load_drafter("gumiho", target, args.draft or str(shipped_drafter("gumiho")),
                           tree=tree)
    config = GenerateConfig(max_new_tokens=args.max_new_tokens)
    print("| prompt | answer tokens | first draft right (teacher forced) | depth-1 chain's tau |")
    print("|---|---|---|---|")
    for prompt in args.prompts or PROMPTS:
        ids = target.chat_ids(prompt)
        plain = run(target, PlainDrafter(), ids, config)
        chain = run(target, drafter, ids, config)
        assert chain.token_ids == plain.token_ids  # lossless, as every test checks
        full = ids + plain.token_ids
        drafts = teacher_forced(target, drafter, full)
        # row t drafts x_{t+2}: the answer's tokens from its second on
        hits = [drafts[t] == full[t + 2] for t in range(len(ids) - 1, len(full) - 2)]
        print(f"| {prompt[:48]} | {len(plain.token_ids)} | {sum(hits) / len(hits):.3f} | "
              f"{chain.tau:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
