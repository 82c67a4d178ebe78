"""rowattention.c at a git revision against the working tree's, in one process: the same
calls alternated (the fastest of several rounds each), and whether every output is bit for
bit the same, for the shapes a SmolLM2 verify makes (9 query heads over 3 KV heads, head
size 64; a committed prefix and a tree of `R` rows, each seeing its ancestors).

    python scripts/rowattention_ab.py --base HEAD~1 --threads 1
    python scripts/rowattention_ab.py --layers 30   # each call a layer of its own: cold

With --layers L, each of the 50 calls a round times takes the next of L layers' caches
(30 at 1,024 keys: 47 MB in float32, past a 32 MB L3), as a verify's layers do, so the
cache is read from memory; with 1 (the default) the same cache stays hot.

A change to the kernel that keeps every score's and every output's order of operations
keeps the bits, so decode steps and verifies still agree wherever either build runs; one
that changes the order must say so (both builds stay row-invariant on their own).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gumiho import kernels, rowgemm

HERE = Path(__file__).resolve().parent.parent / "gumiho"
FILES = ("rowgemm.c", "rowattention.c", "rowkernels.h")


def library(sources: Path):
    """rowgemm's library (product and attention) of the C sources in `sources`, compiled as
    kernels.py does, into its cache: sources that equal a build's there (the working
    tree's, once the package has run; HEAD's where the kernels are unchanged) are not
    compiled again."""
    if rowgemm._library() is None:
        raise SystemExit("error: rowgemm's kernels do not build here (rowgemm.py)")
    files = [sources / name for name in FILES[:2]]
    built = kernels.built(kernels.library("rowgemm", files, header=sources / FILES[2]),
                          files, "no comparison")
    if built is None:
        raise SystemExit(f"error: rowgemm's kernels from {sources} did not build (run with "
                         "logging at info for the compiler's message)")
    return built


def build(sources: Path):
    """The attention function of the C sources in `sources` (`library`)."""
    return rowgemm._bind(library(sources))[1]


def checkout(base: str, folder: Path) -> Path:
    """The kernels' sources (FILES) at git revision `base`, written into `folder`."""
    for name in FILES:
        text = subprocess.run(["git", "show", f"{base}:gumiho/{name}"], cwd=HERE,
                              check=True, capture_output=True, text=True).stdout
        (folder / name).write_text(text)
    return folder


def inputs(dtype: torch.dtype, context: int, rows: int):
    """Queries, a cache and a tree mask: the prefix for every row, row r its ancestors (a
    chain here: row r sees tree slots 0..r)."""
    q = torch.randn(1, 9, rows, 64).to(dtype)
    k, v = (torch.randn(1, 3, context + rows, 64).to(dtype) for _ in range(2))
    mask = torch.zeros(1, 1, rows, context + rows, dtype=torch.bool)
    mask[..., :context] = True
    for r in range(rows):
        mask[0, 0, r, context:context + r + 1] = True
    return q, k, v, mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare against")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--shapes", default="448x1,448x16,1024x16,128x24",
                        help="CONTEXTxROWS,... (cached tokens x tree rows)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=1,
                        help="caches to cycle through (30: SmolLM2's layers, cold)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        attends = {"base": build(checkout(args.base, Path(tmp))), "tree": build(HERE)}
        for dtype in (torch.bfloat16, torch.float32):
            for shape in args.shapes.split(","):
                context, rows = map(int, shape.split("x"))
                layers = [inputs(dtype, context, rows) for _ in range(args.layers)]
                best, outs = dict.fromkeys(attends, float("inf")), {}
                for _ in range(args.rounds):
                    for name, attend in attends.items():
                        start = time.perf_counter()
                        for call in range(50):
                            q, k, v, mask = layers[call % args.layers]
                            out = rowgemm._attend(attend, q, k, v, mask, 0.125)
                            outs.setdefault(name, {})[call % args.layers] = out
                        best[name] = min(best[name], (time.perf_counter() - start) / 50)
                same = all(torch.equal(outs["base"][i], outs["tree"][i]) for i in outs["base"])
                print(f"{str(dtype).removeprefix('torch.'):9s} {context:5d} cached x {rows:3d} "
                      f"rows: {args.base} {best['base'] * 1e6:7.0f} us, working tree "
                      f"{best['tree'] * 1e6:7.0f} us ({best['base'] / best['tree']:.2f}x), "
                      f"same bits: {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
