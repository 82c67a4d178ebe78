"""Two training runs on the same batches, compared step by step:
`python scripts/compare_train_logs.py RUN_A RUN_B [--span 30]`.

Runs started with the same seed, data and batch shape see the same batches in the same order
(the epoch's batches are fixed by the seed), so the per-step training top-1 that each
`train_log.jsonl` logs is a paired comparison even though every single batch is noisy. For
each draft position this prints B - A averaged over spans of steps, then the held-out
evaluations both runs made at the same step. Used for the learning-rate comparison of
heads-only training in docs/training_recipe.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from gumiho.errors import ArgumentParser, positive_int

POSITIONS = ("acc_serial1", "acc_serial2", "acc_mlp1", "acc_mlp2", "acc_mlp3", "acc_mlp4",
             "acc_mlp5")


def read_log(run: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """The run's logged training rows and held-out evaluations, each by step."""
    train, held = {}, {}
    for number, line in enumerate((run / "train_log.jsonl").read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            print(f"error: {run}/train_log.jsonl line {number} is not JSON (a log cut off "
                  "mid-line: delete that line)", file=sys.stderr)
            sys.exit(2)
        if "eval" in row:
            held[row["step"]] = row["eval"]
        elif "acc_mlp1" in row or "acc_serial1" in row:
            train[row["step"]] = row
    return train, held


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--span", type=positive_int, default=30, help="steps per averaged span")
    args = parser.parse_args(argv)
    for run in (args.run_a, args.run_b):
        if not (run / "train_log.jsonl").is_file():
            parser.error(f"{run} has no train_log.jsonl (a gumiho.train output dir)")
    (train_a, held_a), (train_b, held_b) = read_log(args.run_a), read_log(args.run_b)
    steps = sorted(set(train_a) & set(train_b))
    names = [p for p in POSITIONS if steps and p in train_a[steps[0]]]
    print(f"B - A, training top-1 on the same batches (A {args.run_a}, B {args.run_b})")
    print("steps      logs " + " ".join(f"{p[4:]:>8}" for p in names))
    for start in range(0, steps[-1] if steps else 0, args.span):
        span = [s for s in steps if start < s <= start + args.span]
        if span:
            diffs = [statistics.mean(train_b[s][p] - train_a[s][p] for s in span)
                     for p in names]
            print(f"{start + 1:>4}-{start + args.span:<5} {len(span):>4} "
                  + " ".join(f"{d:+8.4f}" for d in diffs))
    for step in sorted(set(held_a) & set(held_b)):
        print(f"held-out at step {step}: " + ", ".join(
            f"{p[4:]} {held_b[step][p] - held_a[step][p]:+.4f}" for p in POSITIONS
            if p in held_a[step]))


if __name__ == "__main__":
    main()
