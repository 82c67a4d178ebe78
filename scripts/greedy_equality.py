"""Does tree verification give the same greedy text as plain decoding, in this dtype, on
real prompts? And where it does not, was it a near-tie?

    python scripts/greedy_equality.py [--dtype bfloat16] [--questions 10] [--new-tokens 128]

For each question (MT-Bench, first turn) it decodes plainly (one token per step, our loop)
and with each method (the shipped drafters). Where a method's output first differs, it
recomputes the target's logits at that position from scratch (one causal pass over the
common prefix, no cache) and prints the top-2 margin: in a 16-bit dtype a margin within the
dtype's rounding of the logits is a near-tie that batch-shape numerics (a 64-token verify
vs a 1-token step) may break either way. fp32 is expected to give identical output, and
so is bf16 with `--attention sdpa_invariant` on a CPU whose bf16 products are
row-independent (`gumiho.linear.rows_independent`; trees of up to 32 tokens there):

    python scripts/greedy_equality.py --dtype bfloat16 --total-tokens 8 --attention sdpa_invariant
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.config import TreeConfig  # noqa: E402
from gumiho.drafters import PlainDrafter, load_drafter  # noqa: E402
from gumiho.engine import GenerateConfig, run  # noqa: E402
from gumiho.evaluation.benchmarks import load_questions  # noqa: E402
from gumiho.target import ATTENTION_CHOICES, load_target  # noqa: E402

DRAFTS = {"gumiho": "gumiho/assets/smollm2/gumiho", "eagle2": "gumiho/assets/smollm2/eagle2",
          "medusa": "gumiho/assets/smollm2/medusa"}


def margin_at(target, ids: list[int]) -> float:
    """Top-1 minus top-2 logit of the next token after `ids`, from one uncached pass."""
    with torch.inference_mode():
        hidden = target.features(torch.tensor([ids], device=target.device))[0, -1]
        top = target.lm_head(hidden).float().topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--methods", default="gumiho,eagle2,medusa")
    p.add_argument("--total-tokens", type=int, default=None,
                   help="tree size (default: each method's reference tree)")
    p.add_argument("--attention", default=None, choices=ATTENTION_CHOICES,
                   help="the target's attention implementation (default: load_target's); "
                        "sdpa_invariant computes each row of a verify as alone")
    args = p.parse_args()
    unknown = [m for m in args.methods.split(",") if m not in DRAFTS]
    if unknown:  # before the target loads
        p.error(f"--methods: {', '.join(unknown)} not among {', '.join(DRAFTS)}")
    target = load_target("smollm2", device=args.device, dtype=args.dtype,
                         attn_implementation=args.attention)
    config = GenerateConfig(max_new_tokens=args.new_tokens)
    trees = {m: TreeConfig.for_method(m, total_tokens=args.total_tokens)
             for m in args.methods.split(",")}
    drafters = {m: load_drafter(m, target, DRAFTS[m], tree=tree) for m, tree in trees.items()}
    rows = []
    for q in load_questions("mt_bench")[: args.questions]:
        prompt = target.chat_ids(q["turns"][0])
        plain = run(target, PlainDrafter(), prompt, config).token_ids
        for method, drafter in drafters.items():
            out = run(target, drafter, prompt, config).token_ids
            row = {"question_id": q["question_id"], "method": method, "identical": out == plain}
            if out != plain:
                at = next((i for i, (a, b) in enumerate(zip(out, plain, strict=False))
                           if a != b),
                          min(len(out), len(plain)))
                row.update(first_difference=at, margin=round(margin_at(target,
                                                                         prompt + plain[:at]), 4))
            rows.append(row)
            print(json.dumps(row), flush=True)
    same = sum(r["identical"] for r in rows)
    print(json.dumps({"dtype": args.dtype, "device": str(target.device),
                      "attention": target.config._attn_implementation,
                      "new_tokens": args.new_tokens, "questions": args.questions,
                      "trees": {m: {"total_tokens": t.total_tokens, "depth": t.depth}
                                for m, t in trees.items()},
                      "runs": len(rows), "identical": same,
                      "margins_where_different": sorted(r["margin"] for r in rows
                                                        if not r["identical"])}))


if __name__ == "__main__":
    main()
