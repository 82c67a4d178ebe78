"""How prompt-lookup chains would fare on plain decoding's answers, offline.

Replays each answer cycle by cycle with gumiho.lookup's n-gram index (no model runs: the
answer text is re-tokenised, the prompt rebuilt with the chat template) and reports, per
benchmark and matched n-gram size, how often a chain's first token would be accepted and
how long the accepted runs are. With --time it also measures this device's verify cost by
tree width and prints the speedup each chain policy would give over plain decoding if the
lookup itself were free (prompt lookup alone; what LookupDrafter's `short` is chosen by).

    python scripts/lookup_chains.py runs/eval/T0/*_ar.jsonl [--time]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from gumiho.evaluation.gen_answers import pick_questions  # noqa: E402
from gumiho.lookup import NgramIndex  # noqa: E402

POLICIES = {"chain 10": (10, 10), "chain 10, 2-gram 2": (10, 2), "chain 6, 2-gram 2": (6, 2),
            "chain 4": (4, 4), "chain 2": (2, 2)}  # (3-gram chain, 2-gram chain)


def answers(paths: list[str], target):
    """(bench, prompt ids, answer ids) per turn of every record."""
    questions: dict[str, dict] = {}  # bench -> {question_id: question}
    for path in paths:
        for line in open(path):
            record = json.loads(line)
            bench = record["settings"]["bench"]
            if bench not in questions:
                questions[bench] = {q["question_id"]: q for q in pick_questions(bench, 0, None)}
            question = questions[bench][record["question_id"]]
            messages = []
            for turn, answer in zip(question["turns"], record["turns"], strict=True):
                messages.append({"role": "user", "content": turn})
                text = target.tokenizer(answer["text"], add_special_tokens=False)["input_ids"]
                yield bench, target.chat_ids(messages), text
                messages.append({"role": "assistant", "content": answer["text"]})


def replay(prompt: list[int], answer: list[int], chains: tuple[int, int]):
    """Cycles of prompt lookup alone: (matched n, chain proposed, tokens accepted)."""
    index = NgramIndex(max_n=3, min_n=2)
    index.extend(prompt + answer[:1])  # prefill gives the first token
    done = 1
    while done < len(answer):
        n, found = index.chain(*chains)
        accepted = 0
        while (accepted < len(found) and done + accepted < len(answer)
               and found[accepted] == answer[done + accepted]):
            accepted += 1
        yield n, len(found), accepted
        index.extend(answer[done : done + accepted + 1])
        done += accepted + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("answers", nargs="+", help="plain decoding's answer files (method ar)")
    p.add_argument("--time", action="store_true", help="measure verify cost by width on "
                   "this device (loads SmolLM2) and estimate each policy's speedup")
    args = p.parse_args()
    from gumiho.target import load_target

    target = load_target("smollm2")
    data = list(answers(args.answers, target))
    stats = defaultdict(lambda: [0, 0, 0])  # (bench, n) -> cycles, first accepted, tokens
    for bench, prompt, answer in data:
        for n, _, accepted in replay(prompt, answer, (10, 10)):
            row = stats[(bench, n)]
            row[0] += 1
            row[1] += accepted > 0
            row[2] += accepted
    print("| benchmark | matched n-gram | cycles | first token accepted | mean run |")
    print("|---|---|---|---|---|")
    for (bench, n), (cycles, first, tokens) in sorted(stats.items()):
        print(f"| {bench} | {n or 'none'} | {cycles} | {first / cycles:.2f} | "
              f"{tokens / cycles:.2f} |")
    if not args.time:
        return
    from gumiho.budget import verify_step_seconds

    widths = range(1, 12)
    cost = {w: min(verify_step_seconds(target, w, 256, 7) for _ in range(2)) for w in widths}
    print("\nverify cost / plain step: " + ", ".join(f"{w}: {cost[w] / cost[1]:.2f}"
                                                      for w in widths))
    print("\n| policy | " + " | ".join(sorted({b for b, _, _ in data})) + " | mean |")
    for name, chains in POLICIES.items():
        per_bench = defaultdict(lambda: [0, 0.0])
        for bench, prompt, answer in data:
            for _, proposed, accepted in replay(prompt, answer, chains):
                per_bench[bench][0] += accepted + 1
                per_bench[bench][1] += cost[1 + proposed] / cost[1]
        speed = {b: tokens / steps for b, (tokens, steps) in sorted(per_bench.items())}
        print(f"| {name} | " + " | ".join(f"{v:.2f}x" for v in speed.values())
              + f" | {sum(speed.values()) / len(speed):.2f}x |")


if __name__ == "__main__":
    main()
