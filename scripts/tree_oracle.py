"""How much tau does tree selection leave on the table? Greedy Gumiho, scored exactly.

Every cycle verifies the drafter's whole candidate pool (both serial levels and every MLP
level, `--top-k` / `--mlp-topk` wide), so the target's greedy token after every node's path
is known. Greedy acceptance is a function of the path, so the tau of any ancestor-closed
subset of the pool follows exactly, offline:

* drafter scores: the `budget` nodes of highest cumulative draft log-prob (what
  `select_tree` does);
* calibrated: the same, with each node's conditional probability replaced by the accuracy
  measured at its depth and probability decile (fitted on the other half of the cycles);
* oracle: the best the pool allows at that budget (the deepest correct path, if it fits).

The output text is plain decoding's whatever the selection (greedy), so the cycles follow
one trajectory; their cut points are those of the whole-pool verify.

    python scripts/tree_oracle.py --questions 4   # six benchmarks, ~8 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

import gumiho.engine as engine
from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.evaluation.benchmarks import BENCHMARKS, load_questions
from gumiho.target import load_target

DECILES = np.linspace(0, 1, 11)


def record_pools(draft: str, questions: int, max_new: int, top_k: int, mlp_topk: int
                 ) -> list[dict]:
    """One row per cycle: parents, depths, cumulative draft scores, correct-after-parent."""
    target = load_target("smollm2")
    tree = TreeConfig(total_tokens=1 + 2 * top_k + 5 * mlp_topk, top_k=top_k,
                      mlp_topk=mlp_topk, pruning=mlp_topk, depth=7, fta="off")
    drafter = load_drafter("gumiho", target, draft, tree=tree, engine="eager")
    # the verify forward's logits (inside the greedy verify step, which keeps them), paired
    # with the cycle's tree by the loop's on_cycle hook
    rows, forward, last = [], engine.tree_forward, {}

    def recording_forward(*args, **kwargs):
        features, logits = forward(*args, **kwargs)
        last["logits"] = logits
        return features, logits

    def record(tree, emitted):
        if tree.size > 1:
            greedy = last["logits"].argmax(-1)
            score = tree.priority.double().numpy().copy()
            score[0] = 0.0  # the root's priority is +inf
            rows.append({"parents": tree.parents.numpy(), "depths": tree.depths.numpy(),
                         "score": score, "bench": bench,
                         "correct": (tree.tokens == greedy[tree.parents.clamp(min=0)]).numpy()})

    engine.tree_forward = recording_forward
    try:
        for bench in BENCHMARKS:
            for q in load_questions(bench)[:questions]:
                result = run(target, drafter, target.chat_ids(q["turns"][0]),
                             GenerateConfig(max_new_tokens=max_new), on_cycle=record)
                print(f"{bench} {q['question_id']}: {result.new_tokens} tokens, tau "
                      f"{result.tau:.2f} with the whole pool", flush=True)
    finally:
        engine.tree_forward = forward
    for row in rows:  # on the accepted path: correct and every ancestor correct
        ok = row["correct"].copy()
        ok[0] = True
        for n in range(1, len(ok)):
            ok[n] = ok[n] and ok[row["parents"][n]]
        row["ok"] = ok
        row["conditional"] = row["score"] - row["score"][np.maximum(row["parents"], 0)]
    return rows


def tau(row: dict, key: np.ndarray, budget: int) -> float:
    key = key.copy()
    key[0] = np.inf
    chosen = np.argsort(-key, kind="stable")[: budget + 1]
    return 1.0 + float((row["depths"][chosen] * row["ok"][chosen]).max())


def fit_calibration(rows: list[dict]) -> dict[int, np.ndarray]:
    """Accuracy per depth and decile of the drafter's conditional probability (add-one
    smoothed, made monotone in the probability)."""
    table = {}
    for depth in range(1, 8):
        p = np.concatenate([np.exp(r["conditional"][r["depths"] == depth]) for r in rows])
        y = np.concatenate([r["correct"][r["depths"] == depth] for r in rows])
        if p.size == 0:
            continue
        bins = np.clip(np.digitize(p, DECILES) - 1, 0, 9)
        rate = np.array([(y[bins == b].sum() + 1) / ((bins == b).sum() + 2) for b in range(10)])
        table[depth] = np.maximum.accumulate(rate)
        print(f"  depth {depth}: {p.size} nodes, mean draft probability {p.mean():.3f}, "
              f"accuracy {y.mean():.3f}")
    return table


def calibrated_key(row: dict, table: dict[int, np.ndarray]) -> np.ndarray:
    p = np.exp(row["conditional"])
    bins = np.clip(np.digitize(p, DECILES) - 1, 0, 9)
    cal = np.array([table[d][b] if d in table else q
                    for d, b, q in zip(row["depths"], bins, p, strict=True)])
    key = np.zeros(len(cal))
    for n in range(1, len(cal)):
        key[n] = key[row["parents"][n]] + np.log(max(cal[n], 1e-9))
    return key - 1e-6 * row["depths"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="gumiho/assets/smollm2/gumiho")
    p.add_argument("--questions", type=int, default=4, help="first N of each benchmark")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--top-k", type=int, default=14, help="serial beam (reference: 14)")
    p.add_argument("--mlp-topk", type=int, default=35, help="MLP levels (reference: 35)")
    p.add_argument("--budgets", default="15,31,63,127", help="draft nodes (the root aside)")
    args = p.parse_args()
    rows = record_pools(args.draft, args.questions, args.max_new_tokens, args.top_k,
                        args.mlp_topk)
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"{len(rows)} cycles; pool of {len(rows[0]['depths']) - 1} nodes")
    results = {b: {"drafter scores": [], "calibrated": [], "oracle": []} for b in budgets}
    for half in (0, 1):  # calibration fitted on one half, scored on the other
        scored = rows[half::2]
        print(f"calibration from cycles {1 - half}::2")
        table = fit_calibration(rows[1 - half :: 2])
        for b in budgets:
            results[b]["drafter scores"] += [tau(r, r["score"], b)  # select_tree's keys
                                             for r in scored]
            results[b]["calibrated"] += [tau(r, calibrated_key(r, table), b) for r in scored]
            results[b]["oracle"] += [tau(r, r["ok"] * 10.0 - 1e-3 * r["depths"], b)
                                     for r in scored]
    print("| draft nodes | drafter scores | calibrated | oracle |\n|---|---|---|---|")
    for b in budgets:
        print(f"| {b} | " + " | ".join(f"{np.mean(v):.3f}" for v in results[b].values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
