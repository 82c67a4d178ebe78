"""Time a projection against the number of input rows: torch's default (MKL on x86 CPUs),
oneDNN, and `gumiho.linear.vocab_linear` (which picks between them).

Each call reads a weight that a 256 MB sweep has just pushed out of the caches, as in the
loop, where the target's other weights pass through between two uses of its head. The
median of `--repeats` calls is printed in milliseconds. The figures behind linear.py:

    python scripts/linear_rows.py --outputs 49152 --inputs 576   # SmolLM2's lm_head
    python scripts/linear_rows.py --outputs 8192 --inputs 576    # a reduced draft head
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

ROWS = "1,2,3,4,5,7,9,12,15,16,20,24,32,64"


def main() -> int:
    import torch

    from gumiho.linear import ONEDNN_LINEAR, vocab_linear

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--outputs", type=int, default=49152)
    p.add_argument("--inputs", type=int, default=576)
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(args.outputs, args.inputs) * 0.05
    sweep = torch.zeros(256 * 2**20 // 4)

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            sweep.add_(1.0)  # evict the weight
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e3

    print(f"weight {args.outputs} x {args.inputs} float32, {torch.get_num_threads()} threads; "
          "ms per call")
    print("rows  default  onednn  vocab_linear")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.inputs)
            default = median_ms(lambda x=x: torch.nn.functional.linear(x, weight))
            onednn = median_ms(lambda x=x: ONEDNN_LINEAR(x, weight, None, "none", [], "")) \
                if ONEDNN_LINEAR is not None else float("nan")
            ours = median_ms(lambda x=x: vocab_linear(x, weight))
            print(f"{rows:4d}  {default:7.2f}  {onednn:6.2f}  {ours:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
