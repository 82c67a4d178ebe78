"""Lookup-first with and without trust, side by side in one process: whether a prompt-lookup
chain whose last guess was wrong should still be verified alone (`trust=False`, as before
2026-12-01) or go beside the drafter's tree (`LookupDrafter(..., trust=True)`, the default).

Loads SmolLM2 and the shipped Gumiho drafter once at the demo's settings (`--preset demo`:
a lookup chain of 10 verified first, in float32 the confidence floors), the tree fixed at
--total-tokens/--depth (the EPYC demo's calibration: 6 tokens to depth 2) so both sides draft
the same tree; then per round, for the demo's prompt and the first --questions of each of
the six benchmarks, plain decoding and the drafter with trust on and off, in turns (the
order reversed every other round). Prints each benchmark's speedup over plain decoding (its
tokens over its seconds, summed over the rounds) and tau for both, their mean over the
benchmarks, and whether every answer equalled plain decoding's.

    python scripts/lookup_trust_ab.py [--rounds 3] [--questions 3] [--new-tokens 128]
                                      [--total-tokens 6] [--depth 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.demo import PROMPT, shipped_drafter  # noqa: E402
from gumiho.drafters import PlainDrafter  # noqa: E402
from gumiho.engine import GenerateConfig, run  # noqa: E402
from gumiho.evaluation.benchmarks import BENCHMARKS  # noqa: E402
from gumiho.evaluation.gen_answers import pick_questions  # noqa: E402
from gumiho.generate import SpeculativeGenerator  # noqa: E402
from gumiho.lookup import LookupDrafter  # noqa: E402

SIDES = ("always alone", "trusted")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=3,
                        help="per benchmark (0: the demo's prompt alone)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--total-tokens", type=int, default=6)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    gen = SpeculativeGenerator.load("smollm2", "gumiho", str(shipped_drafter("gumiho")),
                                    preset="demo", total_tokens=args.total_tokens,
                                    depth=args.depth, dtype=args.dtype)
    drafter = lookup = gen.drafter
    while not isinstance(lookup, LookupDrafter):  # a gate may sit around it
        lookup = lookup.inner
    prompts = [("demo", PROMPT)] + [(bench, q["turns"][0]) for bench in BENCHMARKS
                                    if args.questions
                                    for q in pick_questions(bench, 0, args.questions)]
    config = GenerateConfig(max_new_tokens=args.new_tokens, engine=gen.engine)
    run(gen.target, drafter, gen.prompt_ids(PROMPT), GenerateConfig(max_new_tokens=8))
    totals: dict[tuple[str, str], list[float]] = {}  # (bench, side) -> [tokens, s, tau sum, n]
    identical = True
    for turn in range(args.rounds):
        for bench, prompt in prompts:
            ids = gen.prompt_ids(prompt)
            order = ("plain", *SIDES) if turn % 2 == 0 else (*reversed(SIDES), "plain")
            outputs = {}
            for side in order:
                if side == "plain":
                    out = run(gen.target, PlainDrafter(), ids, config)
                else:
                    lookup.trust = side == "trusted"
                    out = run(gen.target, drafter, ids, config)
                outputs[side] = out.token_ids
                row = totals.setdefault((bench, side), [0, 0.0, 0.0, 0])
                row[0] += out.new_tokens
                row[1] += out.wall_s
                row[2] += out.tau
                row[3] += 1
            identical &= all(o == outputs["plain"] for o in outputs.values())
        print(f"round {turn + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print("| benchmark | " + " | ".join(f"{s}: speedup, tau" for s in SIDES) + " |")
    print("|---|" + "---|" * len(SIDES))
    speedups: dict[str, list[float]] = {s: [] for s in SIDES}
    for bench in dict.fromkeys(bench for bench, _ in prompts):
        plain = totals[bench, "plain"][0] / totals[bench, "plain"][1]
        cells = []
        for side in SIDES:
            tokens, seconds, tau, n = totals[bench, side]
            speedups[side].append(tokens / seconds / plain)
            cells.append(f"{speedups[side][-1]:.3f}x, {tau / n:.2f}")
        print(f"| {bench} | " + " | ".join(cells) + " |")
    if args.questions:
        print("| **mean of the six benchmarks** | " + " | ".join(
            f"{statistics.mean(speedups[s][1:]):.3f}x" for s in SIDES) + " |")
    print(f"every answer plain decoding's: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
