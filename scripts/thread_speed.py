"""The same work on the main thread and on another thread, in turns: why `gumiho serve`
runs its generations on the main thread (worker.Worker).

    python scripts/thread_speed.py [--dtype bfloat16] [--rounds 3]

Times a small product (1 x 576 by 576 x 1536, SmolLM2's up-projection for one token) and
plain decoding of 64 tokens on the main thread, then on a fresh thread, each round in
turns; prints each figure and the ratio. On a 2-core AMX Xeon, 2026-12-02 (torch
2.13.0, OpenMP): the product 39.7 us on the main thread against 205.5 on another, plain
decoding 54.5 against 26.0 tokens/s in bf16, 28.7 against 18.8 in float32. (Why is not
established: the OpenMP team torch made for the first thread stays ready for it; a thread
that calls `torch.set_num_threads(1)` then `(2)` got 44 us again.)
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def product_us(calls: int = 3000) -> float:
    w, x = torch.randn(1536, 576), torch.randn(1, 576)
    for _ in range(50):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) / calls * 1e6


def on_a_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    from gumiho import SpeculativeGenerator

    extra = {"attention": "sdpa_invariant"} if a.dtype == "bfloat16" else {}
    gen = SpeculativeGenerator.load("smollm2", "ar", dtype=a.dtype, **extra)
    prompt = "Explain in a few sentences why the sky is blue."

    def decode() -> float:
        return gen.generate(prompt, 64).tokens_per_s

    decode()  # warm
    rows = {"product (us)": ([], []), "plain decoding (tokens/s)": ([], [])}
    for _ in range(a.rounds):
        for (main, other), fn in zip(rows.values(), (product_us, decode), strict=True):
            main.append(fn())
            other.append(on_a_thread(fn))
    for name, (main, other) in rows.items():
        m, o = statistics.median(main), statistics.median(other)
        print(f"{name}: main thread {m:.1f}, another thread {o:.1f} "
              f"({o / m:.2f}x; medians of {a.rounds}, {a.dtype})")


if __name__ == "__main__":
    main()
