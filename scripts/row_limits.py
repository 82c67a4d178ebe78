"""What bounds a float32 verify's products on this CPU: memory or arithmetic.

Three measurements, each the median of `--repeats`:
- the memory ceiling: torch's sum over a 600 MB float32 tensor, on one thread and on all;
- the target's products alone (every projection of SmolLM2's decoder and its 49,152-token
  head, 538 MB in float32, too large for any cache) through rowgemm.c at 1 to 8 rows, as a
  verify of that many tokens multiplies them;
- the arithmetic rate: one 768 x 576 weight (a thread's share of a layer, held in cache)
  multiplied again and again, multiply-adds a second, for the same row counts.

Each row count runs on rowgemm.c's AVX2 blocks and, from 3 rows where the CPU has AVX-512,
on its AVX-512 blocks too (the same bits; 1 and 2 rows take the AVX2 blocks either way).
Where the arithmetic of a row count takes as long as the weights' reading, the cold
products cost their sum: a verify's extra rows are then paid in arithmetic, not in memory.

    python scripts/row_limits.py [--rows 1,2,3,4,5,6,8] [--repeats 9]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,6,8")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    import torch

    from gumiho import rowgemm
    from gumiho.linear import PackedLinear
    from gumiho.profiling import timed
    from gumiho.target import load_target

    if rowgemm.kernel() is None:
        raise SystemExit("error: rowgemm.c does not build or run here (rowgemm.py)")
    cpu = torch.device("cpu")

    def median_s(call) -> float:  # the median of --repeats calls, none untimed
        return timed(call, cpu, args.repeats, warmup=0)

    threads = torch.get_num_threads()
    big = torch.randn(150_000_000)
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        seconds = median_s(big.sum)
        print(f"memory: a 600 MB sum on {n} thread{'s' if n > 1 else ''}: "
              f"{big.numel() * 4 / seconds / 1e9:.1f} GB/s")
    torch.set_num_threads(threads)
    del big
    model = load_target("smollm2", dtype=torch.float32).model
    products = [m.rows for m in model.modules()
                if isinstance(m, PackedLinear) and getattr(m, "rows", None) is not None]
    products.append(rowgemm.Prepared(model.get_output_embeddings().weight))
    size = sum(p.weight.numel() * p.weight.element_size() for p in products)
    hot = rowgemm.Prepared(torch.randn(768, 576))
    blocks = ["AVX2"] + (["AVX-512"] if rowgemm.set_wide(True) else [])
    print(f"{len(products)} products, {size / 1e6:.0f} MB; {threads} threads")
    print("rows | blocks | all products, cold: ms (GB/s) | one weight, hot: G multiply-adds/s")
    for rows in (int(r) for r in args.rows.split(",")):
        for name in blocks if rows >= 3 else blocks[:1]:  # AVX-512 runs 3 rows and more
            rowgemm.set_wide(name == "AVX-512")
            inputs = [torch.randn(rows, p.inputs) for p in products]
            cold = median_s(lambda inputs=inputs: [p(x) for p, x in zip(
                products, inputs, strict=True)])
            x = torch.randn(rows, 576)
            warm = median_s(lambda x=x: [hot(x) for _ in range(20)]) / 20
            print(f"{rows:4d} | {name:7s} | {cold * 1e3:6.2f} ({size / cold / 1e9:4.1f}) | "
                  f"{rows * 768 * 576 / warm / 1e9:5.1f}")
    rowgemm.set_wide(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
