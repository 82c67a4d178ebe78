"""How steady is `--total-tokens auto` here? Runs its choice several times afresh (nothing
read from or written to the cache) and prints each pick, its break-even, the plain step
it measured, and its finalists' expected (the model's) and measured (whole cycles)
tokens/s.

    python scripts/auto_picks.py [--runs 3] [--dtype bfloat16] [--method gumiho]
                                 [--draft DIR] [--preset demo]

Figures: docs/engine.md ("Tree size for the device").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho import budget  # noqa: E402
from gumiho.demo import shipped_drafter  # noqa: E402
from gumiho.generate import SpeculativeGenerator  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="sdpa_invariant")
    parser.add_argument("--method", default="gumiho")
    parser.add_argument("--draft", default=None, help="default: the shipped drafter")
    parser.add_argument("--preset", default="demo")
    args = parser.parse_args(argv)
    budget._cache_file = lambda *_: None  # measure afresh every time, keep the cache as it is
    draft = args.draft or str(shipped_drafter(args.method))
    print("| run | seconds | chosen | break-even | plain step ms | finalists: expected / measured "
          "tokens/s |\n|---|---|---|---|---|---|")
    for n in range(1, args.runs + 1):
        start = time.perf_counter()
        gen = SpeculativeGenerator.load(target="smollm2", method=args.method, draft=draft,
                                        preset=args.preset, total_tokens="auto",
                                        dtype=args.dtype, attention=args.attention)
        report, tree = gen.auto_report, gen.auto_report["tree"]
        finalists = ", ".join(f"{name} {row['tokens_per_s']:.1f} / "
                              f"{row['measured_tokens_per_s']:.1f}"
                              for name, row in report["shapes"].items()
                              if "measured_tokens_per_s" in row)
        print(f"| {n} | {time.perf_counter() - start:.0f} | {tree['total_tokens']} tokens, depth "
              f"{tree['depth']} | {report['break_even']:.2f} | "
              f"{report['plain_step_s'] * 1e3:.1f} | {finalists} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
