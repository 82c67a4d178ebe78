"""A drafter's tau at several draft-tree shapes over the six benchmarks (greedy, no timing).

tau depends on the drafter, the target and the tree, not on the device's speed, so it can
be measured here for shapes that would only pay on another device (trees past the
reference, which a GPU verifies for about the cost of a plain step: budget.py, 5.). Each
shape is a comma-separated list of tree settings (`gumiho generate`'s tree flags without
the dashes, `_` for `-`, `key=value` or a flag alone: `lookup_first`), read by that
command's own parser; every shape answers the same first turns.

    python scripts/tau_by_shape.py --draft DIR --questions 3 total_tokens=64 \\
        total_tokens=192,top_k=32,pruning=48

Measured figures: docs/gpu.md, "Trees past the reference".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.errors import GumihoError
from gumiho.evaluation.benchmarks import BENCHMARKS, load_questions
from gumiho.flags import add_tree_args, tree_options
from gumiho.generate import SpeculativeGenerator
from gumiho.target import load_target


def parse_shape(shape: str) -> dict:
    """'total_tokens=128,top_k=32' -> the tree options that `gumiho generate`'s
    `--total-tokens 128 --top-k 32` give, through its own parser (types, bounds, 'auto'); a
    part without '=' is a flag alone (`lookup_first`)."""
    argv = []
    for part in filter(None, shape.split(",")):
        key, sep, value = part.partition("=")
        argv += [f"--{key.replace('_', '-')}", *([value] if sep else [])]
    parser = argparse.ArgumentParser(prog=f"shape {shape!r}:", exit_on_error=False)
    add_tree_args(parser)
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise GumihoError(f"shape {shape!r}: {exc}") from None
    if unknown:
        raise GumihoError(f"shape {shape!r}: not a tree setting: {' '.join(unknown)}")
    return {k: v for k, v in tree_options(args).items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", help="e.g. total_tokens=128,top_k=32,lookup=10")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--method", default="gumiho")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--benches", default=",".join(BENCHMARKS))
    parser.add_argument("--questions", type=int, default=3, help="the first N of each")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", help="also write {shape: {bench: tau}} here")
    args = parser.parse_args(argv)
    try:
        target = load_target(args.target, dtype=args.dtype)
        gens = {shape: SpeculativeGenerator.load(target, method=args.method, draft=args.draft,
                                                 **parse_shape(shape))
                for shape in args.shapes}
        benches = args.benches.split(",")
        questions = {bench: load_questions(bench)[: args.questions] for bench in benches}
    except GumihoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    taus: dict[str, dict[str, float]] = {shape: {} for shape in args.shapes}
    for bench in benches:
        for shape, gen in gens.items():  # the shapes in turns, question by question
            start, tokens, cycles = time.perf_counter(), 0, 0
            for question in questions[bench]:
                result = gen.generate(question["turns"][0], args.max_new_tokens)
                tokens, cycles = tokens + result.new_tokens, cycles + result.cycles
            taus[shape][bench] = tokens / max(cycles, 1)
            print(f"{bench:12s} {shape:44s} tau {taus[shape][bench]:.3f} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    print(f"| shape | mean tau | {' | '.join(benches)} |")
    print(f"|---|---|{'---|' * len(benches)}")
    for shape, row in taus.items():
        mean = sum(row.values()) / len(row)
        print(f"| {shape} | **{mean:.3f}** | {' | '.join(f'{row[b]:.2f}' for b in benches)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(taus, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
