"""What a top-k / top-p cut adds to drawing the target's tokens: `sample_tokens` on real
target logits (a prompt's last positions) with and without the cut, in turns.

    python scripts/sampling_cut_cost.py [--target smollm2] [--rows 1,8] [--rounds 200]

Prints ms per call (median) for each row count and cut, and the nucleus's size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gumiho.sampling import sample_tokens, truncated
from gumiho.target import load_target

CUTS = {"none": (0, 1.0), "top_p 0.9": (0, 0.9), "top_p 0.95": (0, 0.95),
        "top_k 50 + top_p 0.9": (50, 0.9)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.7)
    a = p.parse_args(argv)
    target = load_target(a.target)
    ids = target.chat_ids("Write a short story about a lighthouse keeper and a storm.")
    with torch.no_grad():
        logits = target.model(torch.tensor([ids], device=target.device)).logits[0].float()
    g = torch.Generator(device=target.device).manual_seed(0)
    for rows in map(int, a.rows.split(",")):
        block = logits[-rows:]
        probs = torch.softmax(block / a.temperature, -1)
        times = {name: [] for name in CUTS}
        for _ in range(a.rounds):
            for name, (k, top_p) in CUTS.items():
                start = time.perf_counter()
                sample_tokens(block, a.temperature, g, k, top_p)
                times[name].append(time.perf_counter() - start)
        for name, (k, top_p) in CUTS.items():
            kept = (truncated(probs, k, top_p) > 0).sum(-1).tolist()
            print(f"{rows} rows, {name:22s} {statistics.median(times[name]) * 1e3:7.3f} ms"
                  f"   tokens kept per row: {kept}")


if __name__ == "__main__":
    main()
