"""Time a projection against the number of input rows: torch's default (MKL on x86 CPUs),
oneDNN, MKL's packed GEMM, rowgemm.c (where it builds here; where
its AVX-512 blocks run, also its AVX2 ones alone) and `gumiho.linear.vocab_linear` (which
picks among them).

Each call reads a weight that a 256 MB sweep has just pushed out of the caches, as in the
loop, where the target's other weights pass through between two uses of its head. The
median of `--repeats` calls is printed in milliseconds. The figures behind linear.py:

    python scripts/linear_rows.py --outputs 49152 --inputs 576   # SmolLM2's lm_head
    python scripts/linear_rows.py --outputs 8192 --inputs 576    # a reduced draft head
    python scripts/linear_rows.py --outputs 1536 --inputs 576    # a layer (rowgemm.py)

With --dtype bfloat16 the last column is the weight reordered once (`linear.pack_weight`,
what a bf16 CPU target's layers and heads use) instead of `vocab_linear`, and rowgemm's the
float32 product of the bf16 weight's values rounded once to bf16:

    python scripts/linear_rows.py --dtype bfloat16 --outputs 1536 --inputs 576  # a layer

The last column says, per product, whether the first row's result is bit for bit what it is
when that row is multiplied alone (batch invariance, on which a tree verify's exactness
rests).
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

    from gumiho import rowgemm
    from gumiho.linear import MKL_LINEAR, MKL_REORDER, ONEDNN_LINEAR, pack_weight, vocab_linear

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--outputs", type=int, default=49152)
    p.add_argument("--inputs", type=int, default=576)
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weight = (torch.randn(args.outputs, args.inputs) * 0.05).to(dtype)
    packed = pack_weight(weight) if dtype == torch.bfloat16 else None
    sweep = torch.zeros(256 * 2**20 // 4)

    def narrow(product, *args):
        """`product(*args)` with rowgemm.c's AVX2 blocks only"""
        rowgemm.set_wide(False)
        try:
            return product(*args)
        finally:
            rowgemm.set_wide(True)

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            sweep.add_(1.0)  # evict the weight
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e3

    print(f"weight {args.outputs} x {args.inputs} {args.dtype}, {torch.get_num_threads()} "
          "threads; ms per call")
    float32 = dtype == torch.float32
    mkl = MKL_REORDER(weight, 16) if float32 and MKL_REORDER is not None else None
    products = {
        "default": lambda x: torch.nn.functional.linear(x, weight),
        "onednn": (lambda x: ONEDNN_LINEAR(x, weight, None, "none", [], ""))
        if ONEDNN_LINEAR is not None else None,
        "mkl-packed": (lambda x: MKL_LINEAR(x, mkl, weight, None, x.shape[0]))
        if mkl is not None else None,
        # bf16: the float32 product of the bf16 values, rounded once (rowlayer.c's bf16
        # products where rowamx.c does not run)
        "rowgemm": (lambda x: rowgemm.linear(x.float(), weight).to(dtype))
        if rowgemm.kernel() is not None else None,
        # its AVX2 blocks alone, where the AVX-512 ones run by default (the same bits)
        "rowgemm-avx2": (lambda x: narrow(rowgemm.linear, x, weight))
        if float32 and rowgemm.kernel() is not None and rowgemm.kernel().can_widen else None,
        "packed" if packed is not None else "vocab_linear":
            lambda x: vocab_linear(x, weight, None, packed),
    }
    print("rows" + "".join(f"{k:>13s}" for k in products) + "  row 0 as alone")
    first = torch.randn(1, args.inputs).to(dtype)
    with torch.no_grad():
        alone = {k: f(first) for k, f in products.items() if f is not None}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.cat([first, torch.randn(rows - 1, args.inputs).to(dtype)])
            ms, same = {}, {}
            for k, f in products.items():
                ms[k] = median_ms(lambda f=f, x=x: f(x)) if f is not None else float("nan")
                # batch invariance: is row 0 bit for bit what it is when multiplied alone?
                same[k] = "-" if f is None else \
                    "yes" if torch.equal(f(x)[0], alone[k][0]) else "no"
            print(f"{rows:4d}" + "".join(f"{ms[k]:13.2f}" for k in products)
                  + "  " + " / ".join(same.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
