"""Decoding with and without a top-k / top-p cut (or penalties), plain and
speculative, side by side in one process: does speculation pay under the settings a chat
front end sets?

    python scripts/sampling_cut_speed.py [--temperature 0.7] [--top-p 0.9] [--top-k 0]
                                         [--prompts 4] [--bench mt_bench] [--rounds 2]
                                         [--new-tokens 96] [--dtype float32]
    python scripts/sampling_cut_speed.py --repetition-penalty 1.3 [--temperature 0] ...
    python scripts/sampling_cut_speed.py --presence-penalty 0.5 --frequency-penalty 0.5 ...
    python scripts/sampling_cut_speed.py --no-repeat-ngram-size 3 [--temperature 0] ...

Loads SmolLM2 once, plain decoding and the shipped Gumiho drafter at the demo's preset
(`--total-tokens auto` sized for the temperature), then per round answers each prompt
plainly and with the drafter, without the cut and with it (with --repetition-penalty,
--presence-penalty or --no-repeat-ngram-size: without the penalties and with them, no
cut), in turns (a fresh seed per answer, the same for both sides). Prints each setting's
tokens/s, tau and speedup over plain decoding with the same setting, and at T = 0 whether
the drafter's answers equal plain decoding's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho import SpeculativeGenerator  # noqa: E402
from gumiho.demo import PROMPT, shipped_drafter  # noqa: E402
from gumiho.evaluation.benchmarks import load_questions  # noqa: E402
from gumiho.target import load_target  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0, help="the sampling cut's k (0: none)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="compare this penalty with none (instead of the cut)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="compare presence and frequency penalties with none")
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--no-repeat-ngram-size", type=int, default=None,
                   help="compare transformers' no_repeat_ngram_size with none")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    target = load_target("smollm2", dtype=a.dtype)
    plain = SpeculativeGenerator.load(target, "ar")
    spec = SpeculativeGenerator.load(target, "gumiho", str(shipped_drafter()), preset="demo",
                                     temperature=a.temperature)
    prompts = [PROMPT] + [q["turns"][0] for q in load_questions(a.bench)[: a.prompts - 1]]
    if a.no_repeat_ngram_size is not None:
        cuts = {"no penalty": {}, f"no repeated {a.no_repeat_ngram_size}-grams":
                {"no_repeat_ngram_size": a.no_repeat_ngram_size}}
    elif a.presence_penalty is not None:
        cuts = {"no penalty": {}, f"presence {a.presence_penalty}, frequency "
                f"{a.frequency_penalty}": {"presence_penalty": a.presence_penalty,
                                           "frequency_penalty": a.frequency_penalty}}
    elif a.repetition_penalty is None:
        cuts = {"no cut": {}, f"top-k {a.top_k}, top-p {a.top_p}": {"top_k": a.top_k,
                                                                     "top_p": a.top_p}}
    else:
        cuts = {"no penalty": {}, f"repetition penalty {a.repetition_penalty}":
                {"repetition_penalty": a.repetition_penalty}}
    totals = {(name, side): [0, 0, 0.0] for name in cuts for side in ("plain", "gumiho")}
    same = dict.fromkeys(cuts, 0)
    seed = 0
    for _ in range(a.rounds):
        for prompt in prompts:
            seed += 1
            for name, cut in cuts.items():
                answers = []
                for side, gen in (("plain", plain), ("gumiho", spec)):
                    out = gen.generate(prompt, a.new_tokens, a.temperature, seed, **cut)
                    answers.append(out.token_ids)
                    t = totals[name, side]
                    t[0] += out.new_tokens
                    t[1] += out.cycles
                    t[2] += out.wall_s
                same[name] += answers[0] == answers[1]
    print(f"T = {a.temperature}, {len(prompts)} prompts x {a.rounds} rounds, "
          f"{a.new_tokens} new tokens, {a.dtype}; gumiho's tree: "
          f"{spec.drafter_for(a.temperature).tree.total_tokens} tokens to depth "
          f"{spec.drafter_for(a.temperature).tree.depth}")
    for name in cuts:
        base = totals[name, "plain"]
        for side in ("plain", "gumiho"):
            tokens, cycles, wall = totals[name, side]
            print(f"  {name:24s} {side:7s} {tokens / wall:6.1f} tokens/s  tau "
                  f"{tokens / cycles:4.2f}  {tokens / wall / (base[0] / base[2]):5.2f}x"
                  + (f"  identical {same[name]}/{len(prompts) * a.rounds}"
                     if side == "gumiho" and a.temperature == 0 else ""))


if __name__ == "__main__":
    main()
