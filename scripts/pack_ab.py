"""Target steps with the layers packed for the CPU's GEMM library against the same target
unpacked, in one process, the two alternating (gumiho/linear.py).

    python scripts/pack_ab.py [--target smollm2] [--dtype float32] [--widths 1,4,8,16]
                              [--rounds 6] [--repeats 5] [--context 128]
                              [--forward 4x512] [--max-rows N]

Loads the target twice (packed as `load_target` leaves it, and unpacked with
`Target.unpack`), then per round times a verify step of each width (a balanced
binary tree; width 1 is a plain decode step) on each copy in turn. Prints the median over
the rounds of each copy's median step, and their ratio. Alternating in one process keeps
the machine's drift off the ratio; both copies are in memory throughout. `--forward BxL`
adds a whole forward over B sequences of L tokens (a training batch, a long prefill);
`--max-rows N` overrides `linear.MKL_MAX_ROWS` (the most rows a packed float32 layer sends
to MKL's packed product) to see what the bound buys.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gumiho import linear
from gumiho.budget import verify_step_seconds
from gumiho.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--widths", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--forward", default=None, help="BxL: also a forward over B x L tokens")
    parser.add_argument("--max-rows", type=int, default=None)
    args = parser.parse_args()
    if args.max_rows is not None:
        linear.MKL_MAX_ROWS = args.max_rows
    widths = [int(w) for w in args.widths.split(",")]
    batch = tuple(int(n) for n in args.forward.split("x")) if args.forward else None
    packed = load_target(args.target, device="cpu", dtype=args.dtype)
    plain = load_target(args.target, device="cpu", dtype=args.dtype)
    count = plain.unpack()
    print(f"{args.target} {args.dtype}: {count} layers packed in one copy, none in the other")
    ms: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for width in widths:
            for name, target in (("packed", packed), ("unpacked", plain)):
                seconds = verify_step_seconds(target, width, args.context, args.repeats)
                ms.setdefault((width, name), []).append(seconds * 1e3)
        if batch:
            ids = torch.randint(100, 1000, batch)
            for name, target in (("packed", packed), ("unpacked", plain)):
                with torch.no_grad():
                    start = time.perf_counter()
                    target.model.model(input_ids=ids)
                ms.setdefault((args.forward, name), []).append(
                    (time.perf_counter() - start) * 1e3)
    print("| tree tokens | packed ms | unpacked ms | packed / unpacked |")
    print("|---|---|---|---|")
    for width in widths + ([args.forward] if batch else []):
        a = statistics.median(ms[(width, "packed")])
        b = statistics.median(ms[(width, "unpacked")])
        print(f"| {width} | {a:.1f} | {b:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
