"""rowgemm.c's products at a git revision against the working tree's, in one process: a
decode step's float32 products of a Llama shape (SmolLM2's by default: 30 layers' q/k/v,
o, gate/up and down weights and the 49,152-token head, 538 MB, read from memory as a
step reads them) over 1 to a few rows, the two builds in turns, and whether every output
is bit for bit the same.

    python scripts/rowgemm_ab.py --base HEAD~1
    python scripts/rowgemm_ab.py --base HEAD~1 --rows 1,4,8 --rounds 25 --stored bfloat16

Prints per row count each build's median time for the step's products, the median of the
per-round ratios (base / working tree: above 1, the working tree is faster), and each
build's cost of its rows against its own one-row step (what a verify adds to a plain
step). On a shared machine the per-round ratio is the number to read: both builds see the
same bursts of load. A change that keeps every output's order of operations (a prefetch,
a tile's size) keeps the bits; one that changes the order must say so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from operator import truediv
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rowattention_ab beside it

from rowattention_ab import HERE, checkout, library  # noqa: E402

from gumiho import rowgemm  # noqa: E402


def product(sources: Path, wide: bool):
    """The product function of the C sources in `sources`, its AVX-512 blocks on or off as
    the package's own kernel has them (`wide`)."""
    built = library(sources)
    function = rowgemm._bind(built)[0]
    built.rowgemm_wide(int(wide))
    return function


def weights(args, dtype: torch.dtype) -> list[torch.Tensor]:
    """A step's weights: each layer's joined q/k/v, o, joined gate/up and down, then the
    vocabulary head."""
    qkv = args.hidden + 2 * args.kv
    layer = [(qkv, args.hidden), (args.hidden, args.hidden), (2 * args.inter, args.hidden),
             (args.hidden, args.inter)]
    shapes = layer * args.layers + [(args.vocab, args.hidden)]
    return [torch.randn(n, k).to(dtype) for n, k in shapes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare against")
    parser.add_argument("--rows", default="1,4,8", help="row counts, the first the reference")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--stored", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="the weights' storage")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--kv", type=int, default=192, help="k's (and v's) outputs")
    parser.add_argument("--inter", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    package = rowgemm.kernel()
    if package is None:
        raise SystemExit("error: rowgemm's kernels do not run here (rowgemm.py)")
    rows = [int(r) for r in args.rows.split(",")]
    ws = weights(args, getattr(torch, args.stored))
    kind = rowgemm.KINDS[ws[0].dtype]
    xs = {(m, k): torch.randn(m, k) for m in rows for k in {w.shape[1] for w in ws}}
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": product(checkout(args.base, Path(tmp)), package.wide),
                  "tree": product(HERE, package.wide)}
        outs = {(name, m): [torch.empty(m, w.shape[0]) for w in ws] for name in builds
                for m in rows}

        def step(name: str, m: int) -> float:
            function = builds[name]
            start = time.perf_counter()
            for w, y in zip(ws, outs[name, m], strict=True):
                function(xs[m, w.shape[1]].data_ptr(), w.data_ptr(), None, y.data_ptr(), m,
                         w.shape[1], w.shape[0], kind)
            return time.perf_counter() - start

        for name in builds:  # warm: page the outputs in, load both libraries' code
            for m in rows:
                step(name, m)
        times = {(name, m): [] for name in builds for m in rows}
        for _ in range(args.rounds):
            for m in rows:
                for name in builds:
                    times[name, m].append(step(name, m))
    print(f"products of a {args.layers}-layer step ({args.stored} weights, "
          f"{sum(w.numel() * w.element_size() for w in ws) / 1e6:.0f} MB), "
          f"{args.threads} threads, AVX-512 blocks {'on' if package.wide else 'off'}, "
          f"{args.rounds} rounds in turns:")
    one = rows[0]
    for m in rows:
        same = all(map(torch.equal, outs["base", m], outs["tree", m]))
        ratio = statistics.median(map(truediv, times["base", m], times["tree", m]))
        line = (f"  {m:2d} rows: {args.base} {statistics.median(times['base', m]) * 1e3:6.2f} ms,"
                f" working tree {statistics.median(times['tree', m]) * 1e3:6.2f} ms, "
                f"base / tree {ratio:.3f} (per round), same bits: {same}")
        if m != one:
            against = (statistics.median(map(truediv, times[name, m], times[name, one]))
                       for name in builds)
            line += f"; against {one} row(s): " + ", ".join(
                f"{name} {value:.3f}" for name, value in zip(builds, against, strict=True))
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
