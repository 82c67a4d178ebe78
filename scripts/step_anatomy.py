"""Where a CPU step's time goes: the target's verify step by width as it runs (rowlayer.c's
one call a step where it builds) and through fused.py's torch calls, the latter split into
our C kernels' products, their attention and the rest (Python, torch's own operations), and
a drafter's proposal counted in torch calls.

    python scripts/step_anatomy.py [--dtype bfloat16|float32] [--widths 1,6,16,64]
                                   [--context 128] [--repeats 10] [--total-tokens 12]

SmolLM2 with the row-invariant attention and the shipped Gumiho drafter (its tree fixed at
--total-tokens to depth 2, with a lookup chain of 10, as the demo runs it). The C kernels
(rowamx.c's products in bf16 on an AMX CPU, rowgemm.c's otherwise, rowattention.c) are
timed by wrapping the functions the layers call, so their time is the C code's plus the
ctypes call; "the rest" is the step's wall time less both. The drafter part answers one
96-token prompt and counts every torch operation its proposals dispatch (views included).
Figures from one run on a shared machine move by 10-20%: compare widths within a run.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho import rowamx, rowgemm  # noqa: E402
from gumiho.budget import verify_step  # noqa: E402
from gumiho.config import TreeConfig  # noqa: E402
from gumiho.demo import PROMPT, shipped_drafter  # noqa: E402
from gumiho.drafters import load_drafter  # noqa: E402
from gumiho.engine import GenerateConfig, run  # noqa: E402
from gumiho.serial_drafter import SerialDrafter  # noqa: E402
from gumiho.target import load_target  # noqa: E402


class Timed:
    """A ctypes kernel whose calls add their seconds to `seconds[name]`; other attributes
    (`.attention`, `.wide`, ...) are the kernel's."""

    def __init__(self, function, name: str, seconds: dict):
        self.function, self.name, self.seconds = function, name, seconds

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.function(*args)
        self.seconds[self.name] += time.perf_counter() - start
        return out

    def __getattr__(self, attribute):
        return getattr(self.function, attribute)


@contextmanager
def kernels_timed(seconds: dict):
    """Inside it rowgemm's and rowamx's kernels (those built here) time themselves."""
    kernels = rowgemm.kernel, rowamx.kernel
    gemm, amx = rowgemm.kernel(), rowamx.kernel()
    if gemm is not None:
        timed = Timed(gemm, "products", seconds)
        timed.attention = Timed(gemm.attention, "attention", seconds)
        rowgemm.kernel = lambda: timed
    if amx is not None:
        timed_amx = Timed(amx, "products", seconds)
        rowamx.kernel = lambda: timed_amx
    try:
        yield
    finally:
        rowgemm.kernel, rowamx.kernel = kernels


class Count(TorchDispatchMode):
    """Counts the torch operations dispatched inside it, by name."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--widths", default="1,6,16,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--total-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    target = load_target("smollm2", device="cpu", dtype=args.dtype,
                         attn_implementation="sdpa_invariant")
    seconds = collections.defaultdict(float)
    assert target._fused is not None  # made now: rowlayer.c takes the kernels' own addresses
    with kernels_timed(seconds):
        steps(target, args, seconds)
    proposals(target, args.total_tokens)
    return 0


def steps(target, args: argparse.Namespace, seconds: dict) -> None:
    """The verify steps' table: the step as it runs (rowlayer.c's one call where it builds),
    then fused.py's torch calls split into the C kernels and the rest."""
    fused = target._fused
    rows = None if fused is None else fused.rows
    print(f"SmolLM2 {args.dtype}, sdpa_invariant, context {args.context}, "
          f"{args.repeats} steps a width (ms a step)")
    print("| tree tokens | step (rowlayer.c) | step (fused.py) | products (C) | attention (C) "
          "| the rest |\n|---|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        step = verify_step(target, width, args.context)
        whole = mean_ms(step, args.repeats) if rows is not None else None
        if rows is not None:
            fused.rows = None  # fused.py's calls, which the kernels' timers see
        try:
            wall, median = mean_ms(step, args.repeats, median=True, before=seconds.clear)
        finally:
            if rows is not None:
                fused.rows = rows
        products, attention = (seconds[k] / args.repeats * 1e3 for k in ("products", "attention"))
        shown = "-" if whole is None else f"{whole:.1f}"
        print(f"| {width} | {shown} | {wall:.1f} (median {median:.1f}) | {products:.1f} | "
              f"{attention:.1f} | {wall - products - attention:.1f} |")


def mean_ms(step, repeats: int, median: bool = False, before=lambda: None):
    """The mean ms of `repeats` calls of step after three warm-ups and `before()` (and the
    median)."""
    for _ in range(3):
        step()
    before()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    mean = sum(walls) / repeats * 1e3
    return (mean, statistics.median(walls) * 1e3) if median else mean


def proposals(target, total_tokens: int) -> None:
    """The drafter's proposals: their time and torch operations."""
    tree = TreeConfig.for_method("gumiho", total_tokens=total_tokens, depth=2, lookup=10,
                                 lookup_first=True)
    drafter = load_drafter("gumiho", target, str(shipped_drafter("gumiho")), tree=tree)
    inner = drafter
    while not isinstance(inner, SerialDrafter):  # under the lookup wrapper
        inner = inner.inner
    counts, times = collections.Counter(), []
    plain_propose = inner.propose

    def counted():
        start = time.perf_counter()
        with Count(counts):
            tree = plain_propose()
        times.append(time.perf_counter() - start)
        return tree

    ids = target.chat_ids(PROMPT)
    run(target, drafter, ids, GenerateConfig(max_new_tokens=16))  # warm-up
    inner.propose = counted
    result = run(target, drafter, ids, GenerateConfig(max_new_tokens=96))
    n = len(times)
    print(f"\nthe drafter's proposals ({total_tokens} tokens to depth 2, lookup 10, the "
          f"demo's prompt, 96 tokens): {n} of {result.cycles} cycles, median "
          f"{statistics.median(times) * 1e3:.1f} ms (counted: slower than uncounted), "
          f"{sum(counts.values()) / n:.0f} torch operations each; the most frequent:")
    print(", ".join(f"{name} {count / n:.0f}" for name, count in counts.most_common(12)))


if __name__ == "__main__":
    raise SystemExit(main())
