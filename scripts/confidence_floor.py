"""What `--min-confidence` would keep, replayed: run a drafter with a deep chain (its top-1
token at every level, prompt lookup first) on the first turns of the benchmarks, log each
drafter cycle's path probabilities and the tokens it emitted, then replay floors on the log.

A chain accepts a prefix, so a chain cut at depth d emits min(accepted, d) + 1 tokens: the
replay is exact per cycle (the cycles themselves would fall elsewhere in the text). It
counts tokens and verified drafts, not time; the speed of a floor is the evaluation's
(`GUMIHO_ARGS="... --min-confidence P" bash scripts/eval_smollm2.sh`).

    python scripts/confidence_floor.py --draft gumiho/assets/smollm2/gumiho --log runs/floor.json
    python scripts/confidence_floor.py --replay runs/floor.json

`--costs CATCHUP,LEVEL,VERIFY2,VERIFY3` (in plain steps) adds a second table for a chain of
2 with `--extend-confidence`: tokens per plain step's worth of time over the drafter cycles,
for pairs of (first-draft floor, extend floor), against 1.00 for a plain step there. Each
drafter cycle pays its catch-up (even one that becomes a plain step: the next cycle catches
up again), a serial level 2 when the first draft reaches the extend floor, and its verify
width beyond one token. The costs measured on the 2-core dev CPU (docs/methods.md):
`--costs 0.13,0.10,0.035,0.10`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

FLOORS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4)


def collect(draft: str, method: str, depth: int, questions: int, max_new_tokens: int,
            benches: list[str]) -> list[dict]:
    from gumiho.engine import GenerateConfig, run
    from gumiho.evaluation.gen_answers import pick_questions
    from gumiho.generate import SpeculativeGenerator

    chain = {"total_tokens": depth + 1, "top_k": 1, "depth": depth}
    if method == "gumiho":
        chain.update(mlp_topk=1, pruning=1)
    gen = SpeculativeGenerator.load("smollm2", method, draft, lookup=10, lookup_first=True,
                                    **chain)
    rows = []
    for bench in benches:
        for question in pick_questions(bench, 0, questions):
            def log(tree, emitted, bench=bench):
                if tree.priority is not None:  # a drafter cycle (lookup chains have none)
                    rows.append({"bench": bench, "emitted": len(emitted),
                                 "logp": tree.priority[1:].tolist()})
            run(gen.target, gen.drafter, gen.prompt_ids(question["turns"][0]),
                GenerateConfig(max_new_tokens=max_new_tokens), on_cycle=log)
        print(f"{bench}: {sum(r['bench'] == bench for r in rows)} drafter cycles", flush=True)
    return rows


def replay(rows: list[dict], floor: float, depth: int) -> dict:
    """Tokens per drafter cycle, verified drafts per cycle, and the share of cycles that
    become plain steps, with chains cut at `depth` and at path probability `floor`."""
    tokens = drafts = plain = 0
    for row in rows:
        keep = 0
        for logp in row["logp"][:depth]:
            if floor > 0 and logp < math.log(floor):
                break
            keep += 1
        tokens += min(row["emitted"] - 1, keep) + 1
        drafts += keep
        plain += keep == 0
    n = max(len(rows), 1)
    return {"tokens": tokens / n, "drafts": drafts / n, "plain": plain / n}


PAIRS = ((0.1, 0.1), (0.05, 0.05), (0.05, 0.2), (0.05, 0.3), (0.05, 0.4), (0.1, 0.3),
         (0.1, 0.4), (0.05, 1.0), (0.0, 0.0))  # (--min-confidence, --extend-confidence)


def replay_costs(rows: list[dict], floor: float, extend: float,
                 costs: tuple[float, float, float, float]) -> float:
    """Tokens per plain step's worth of time over the drafter cycles of a chain of 2, with
    the first draft verified at `floor` and level 2 drafted at `extend` (1.0: never)."""
    catch_up, level, verify2, verify3 = costs
    tokens = time = 0.0
    for row in rows:
        p1, p12 = (math.exp(lp) for lp in row["logp"][:2])
        keep, cost = 0, 1 + catch_up
        if p1 >= floor:
            keep, cost = 1, cost + verify2
            if p1 >= max(extend, floor):
                cost += level
                if p12 >= floor:
                    keep, cost = 2, cost - verify2 + verify3
        tokens += min(row["emitted"] - 1, keep) + 1
        time += cost
    return tokens / max(time, 1e-9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", help="drafter dir (collect a log)")
    p.add_argument("--method", default="gumiho", choices=("gumiho", "eagle2"))
    p.add_argument("--log", help="where to write the per-cycle log (with --draft)")
    p.add_argument("--replay", help="a log to replay floors on")
    p.add_argument("--depth", type=int, default=7, help="chain depth to collect")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--benches", default="mt_bench,humaneval,gsm8k_like,alpaca_like,"
                   "cnndm_like,nq_like")
    p.add_argument("--costs", help="CATCHUP,LEVEL,VERIFY2,VERIFY3 in plain steps: also "
                   "replay (floor, extend) pairs against time")
    args = p.parse_args(argv)
    if args.draft:
        rows = collect(args.draft, args.method, args.depth, args.questions,
                       args.max_new_tokens, args.benches.split(","))
        if args.log:
            Path(args.log).write_text(json.dumps(rows))
    elif args.replay:
        rows = json.loads(Path(args.replay).read_text())
    else:
        p.error("give --draft (collect) or --replay LOG")
    benches = list(dict.fromkeys(r["bench"] for r in rows)) + ["all"]
    print("| benchmark | cycles | depth | " + " | ".join(f"floor {f:g}" for f in FLOORS) + " |")
    print("|---|---|---|" + "---|" * len(FLOORS))
    for bench in benches:
        sub = [r for r in rows if bench in ("all", r["bench"])]
        for depth in (2, 3):
            cells = [replay(sub, f, depth) for f in FLOORS]
            print(f"| {bench} | {len(sub)} | {depth} | " + " | ".join(
                f"{c['tokens']:.2f} / {c['drafts']:.2f} / {c['plain']:.0%}" for c in cells) + " |")
    print("\ncells: tokens per drafter cycle / drafts verified per cycle / cycles that are "
          "plain steps")
    if args.costs:
        costs = tuple(float(c) for c in args.costs.split(","))
        print("\n| benchmark | " + " | ".join(f"{f:g} / {e:g}" for f, e in PAIRS) + " |")
        print("|---|" + "---|" * len(PAIRS))
        for bench in benches:
            sub = [r for r in rows if bench in ("all", r["bench"])]
            print(f"| {bench} | " + " | ".join(
                f"{replay_costs(sub, f, e, costs):.3f}" for f, e in PAIRS) + " |")
        print("\ncells: tokens per plain step's time over the drafter cycles (a plain step: "
              "1.000), chain of 2, by --min-confidence / --extend-confidence")
    return 0


if __name__ == "__main__":
    sys.exit(main())
