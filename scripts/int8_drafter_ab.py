"""Would an int8 drafter pay on this CPU? An interleaved A/B, kept as a record of a path we
tried and left out (docs/cpu_costs.md).

A drafter probe (catch-up over the accepted tokens, first serial level, the draft head) reads
~50 MB of fp32 weights that the target's 540 MB sweep has just pushed out of the caches, so
it is bound by memory traffic. Here the drafter's layer and head products run on fbgemm's
int8 weights (per output channel, activations quantized per call; `fc`, whose input holds
the target's large-outlier features, stays fp32). Plain decoding, prompt lookup and the
fp32 and int8 drafters answer each question in turn, the first rotating; every answer must
equal plain decoding's (verification is unchanged).

    python scripts/int8_drafter_ab.py --questions 8   # four benchmarks, ~9 min here
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.evaluation.benchmarks import load_questions
from gumiho.generate import SpeculativeGenerator

DRAFT = "gumiho/assets/smollm2/gumiho"
DEMO = {"total_tokens": "auto", "lookup": 10, "lookup_first": True, "min_confidence": 0.1,
        "extend_confidence": 0.4}


class Int8Linear(nn.Module):
    """y = x W^T + b on int8 weights for up to 16 rows, the fp32 product above that."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = weight.detach().float()
        self.bias = None if bias is None else bias.detach().float()
        scale = (self.weight.abs().amax(1) / 127).clamp(min=1e-12).double()
        q = torch.quantize_per_channel(self.weight, scale, torch.zeros_like(scale).long(), 0,
                                       torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > 16:  # a prompt's catch-up: fp32
            return nn.functional.linear(x, self.weight, self.bias)
        y = torch.ops.quantized.linear_dynamic(x.reshape(rows, x.shape[-1]), self.packed, True)
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def quantize(drafter) -> None:
    """The SerialDrafter's linear layers (fc excepted) and its draft head, in place."""
    for module in list(drafter.model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name != "fc":
                setattr(module, name, Int8Linear(child.weight, child.bias))
    begin = drafter.begin

    def begin_int8(target, capacity):
        begin(target, capacity)  # builds the head once per target
        head = drafter.head
        if not hasattr(head, "int8"):
            head.int8 = Int8Linear(head.weight, head.bias)
            head.__class__ = type("Int8Head", (type(head),),
                                  {"__call__": lambda self, h: self.int8(h.float())})
    drafter.begin = begin_int8


def rate(answers: dict, keys: list) -> float:
    return sum(answers[k][0] for k in keys) / sum(answers[k][1] for k in keys)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--benches", default="cnndm_like,humaneval,alpaca_like,nq_like")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args()
    fp32 = SpeculativeGenerator.load("smollm2", "gumiho", DRAFT, **DEMO)
    int8 = SpeculativeGenerator.load(fp32.target, "gumiho", DRAFT, **DEMO)
    quantize(int8.drafter.inner)
    gens = {"ar": SpeculativeGenerator.load(fp32.target, "ar"),
            "lookup": SpeculativeGenerator.load(fp32.target, "lookup", lookup=10),
            "fp32": fp32, "int8": int8}
    for gen in gens.values():
        gen.generate("Hello there, how are you?", 16)  # warm-up
    done: dict[str, dict] = {name: {} for name in gens}
    names = list(gens)
    for bench in args.benches.split(","):
        questions = load_questions(bench)[:args.questions]
        for i, q in enumerate(questions):
            for name in names[i % 4:] + names[:i % 4]:
                r = gens[name].generate(q["turns"][0], args.new_tokens)
                done[name][bench, i] = (r.new_tokens, r.wall_s, r.cycles, r.token_ids)
            if any(done[n][bench, i][3] != done["ar"][bench, i][3] for n in gens):
                print(f"error: {bench} question {i}: an answer differs from plain decoding")
                return 1
        keys = [(bench, i) for i in range(len(questions))]
        wins = sum(rate(done["int8"], [k]) > rate(done["fp32"], [k]) for k in keys)
        print(bench, {n: round(rate(done[n], keys) / rate(done["ar"], keys), 3) for n in gens},
              "tau", {n: round(sum(done[n][k][0] for k in keys) /
                               sum(done[n][k][2] for k in keys), 2) for n in gens},
              f"int8 faster than fp32 on {wins}/{len(keys)}", flush=True)
    keys = list(done["ar"])
    print("all", {n: round(rate(done[n], keys) / rate(done["ar"], keys), 3) for n in gens})
    return 0


if __name__ == "__main__":
    sys.exit(main())
