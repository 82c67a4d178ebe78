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

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.errors import ArgumentParser, cli_errors, positive_int
from gumiho.train.plot import evaluations, log_rows


def by_step(run: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """The run's logged training rows with accuracies, and its held-out evaluations, each
    by step (the last one logged at a step: a resumed run may log a step twice)."""
    rows = log_rows(run)
    train = {r["step"]: r for r in rows if "eval" not in r and any(k.startswith("acc_")
                                                                   for k in r)}
    return train, {r["step"]: r["eval"] for r in evaluations(rows)}


@cli_errors
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="scripts/compare_train_logs.py",
                            description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--span", type=positive_int, default=30, help="steps per averaged span")
    args = parser.parse_args(argv)
    (train_a, held_a), (train_b, held_b) = by_step(args.run_a), by_step(args.run_b)
    steps = sorted(set(train_a) & set(train_b))
    # every position both runs logged at some step (a step logs none for a head that its
    # batch held no position for; one run may have fewer heads), each averaged over the
    # span's steps that logged it in both
    names = list(dict.fromkeys(k for s in steps for k in train_a[s]
                               if k.startswith("acc_") and k in train_b[s]))
    print(f"B - A, training top-1 on the same batches (A {args.run_a}, B {args.run_b})")
    print("steps      logs " + " ".join(f"{p[4:]:>8}" for p in names))
    for start in range(0, steps[-1] if steps else 0, args.span):
        span = [s for s in steps if start < s <= start + args.span]
        if span:
            diffs = [[train_b[s][p] - train_a[s][p] for s in span
                      if p in train_a[s] and p in train_b[s]] for p in names]
            print(f"{start + 1:>4}-{start + args.span:<5} {len(span):>4} "
                  + " ".join(f"{statistics.mean(d):+8.4f}" if d else f"{'-':>8}"
                             for d in diffs))
    for step in sorted(set(held_a) & set(held_b)):
        print(f"held-out at step {step}: " + ", ".join(
            f"{p[4:]} {held_b[step][p] - held_a[step][p]:+.4f}" for p in held_a[step]
            if p in held_b[step]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
