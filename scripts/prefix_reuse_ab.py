"""A conversation with and without prefix reuse (gumiho/prefix.py), in turns: what a chat
user waits for the first token of each answer, and for the whole conversation.

    python scripts/prefix_reuse_ab.py [--method gumiho] [--rounds 3] [--dtype float32]

Each round runs the whole conversation (the turns below, each answer fed back as history)
once with `reuse_prefix` and once without, which goes first alternating by round; each
conversation starts with no sequence kept from an earlier one, as a new chat. Prints,
per turn, the prompt's length, the tokens reused, and the prefill's time (the first token's
wait) both ways, the medians over the rounds; then the conversation's total time both ways
and whether the answers were the same (at T = 0 they can differ only at a near tie: the
reused entries were computed in other shapes). Defaults as `gumiho chat`'s: the shipped
Gumiho drafter at the demo preset, on an AMX CPU the demo's exact bf16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from gumiho.chat import chat_defaults
from gumiho.demo import exact_bf16_default
from gumiho.flags import add_generator_args
from gumiho.generate import load_from_args

TURNS = [
    "Explain in a few sentences why the sky is blue.",
    "Now explain it to a five-year-old.",
    "Why are sunsets red and orange, then?",
    "Is the sky blue on Mars too?",
    "Write a short poem about what we discussed.",
    "Summarise our conversation in three bullet points.",
]


def forget_prefixes(gen) -> None:
    """No sequence kept from an earlier generation: a conversation then starts as a new
    chat's does (an eager runner keeps the last four sequences, so the reuse run of a
    later round would otherwise find the whole of an earlier round's conversation and
    skip almost all of every turn's prefill, its first turn's too)."""
    for runner in gen.target.runners.values():
        runner.prefixes.clear()


def conversation(gen, reuse: bool, max_new_tokens: int) -> tuple[list, float]:
    """Each turn's (prompt tokens, reused tokens, prefill seconds, answer ids), and the
    whole conversation's seconds; nothing reused from before it (`forget_prefixes`)."""
    forget_prefixes(gen)
    messages, turns = [], []
    start = time.perf_counter()
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        result = gen.generate(messages, max_new_tokens, reuse_prefix=reuse)
        turns.append((len(gen.prompt_ids(messages)), result.reused_tokens,
                      result.cycle_s[0], result.token_ids))
        messages.append({"role": "assistant", "content": result.text})
    return turns, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_generator_args(parser)
    parser.set_defaults(method="gumiho")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    chat_defaults(args)
    exact_bf16_default(args)
    gen = load_from_args(args)
    gen.generate("Hi", 4)  # warm-up
    runs = {True: [], False: []}
    for r in range(args.rounds):
        for reuse in ((True, False) if r % 2 == 0 else (False, True)):
            runs[reuse].append(conversation(gen, reuse, args.max_new_tokens))
            print(f"round {r + 1}, reuse {reuse}: {runs[reuse][-1][1]:.2f} s", flush=True)
    print(f"\n{gen.target.name} {gen.target.dtype}, --method {args.method}, "
          f"{args.max_new_tokens} new tokens a turn, medians of {args.rounds} rounds")
    print("turn | prompt tokens | reused | prefill s, reuse | prefill s, fresh | "
          "same answer")
    for t in range(len(TURNS)):
        prompt, reused = runs[True][0][0][t][:2]
        with_ = statistics.median(run[0][t][2] for run in runs[True])
        fresh = statistics.median(run[0][t][2] for run in runs[False])
        same = runs[True][0][0][t][3] == runs[False][0][0][t][3]
        print(f"{t + 1} | {prompt} | {reused} | {with_:.3f} | {fresh:.3f} | "
              f"{'yes' if same else 'no'}")
    total = {k: statistics.median(run[1] for run in v) for k, v in runs.items()}
    tokens = {k: sum(len(turn[3]) for turn in v[0][0]) for k, v in runs.items()}
    print(f"conversation: {total[True]:.2f} s for {tokens[True]} tokens with reuse, "
          f"{total[False]:.2f} s for {tokens[False]} fresh; per token "
          f"{total[False] / tokens[False] / (total[True] / tokens[True]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
