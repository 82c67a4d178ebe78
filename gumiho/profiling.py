"""Per-phase wall time of the loop, on request (`GenerateConfig(profile=True)`, the
timing tool). Off by default: timing a phase honestly needs a device synchronisation on
each side, which the fast path avoids."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per phase, summed over calls; a no-op unless enabled. Phases may nest
    (the drafter times its serial steps and MLP heads inside the loop's `draft`)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op on the CPU), so a timer reads the work done:
    CUDA and ROCm, and Apple's MPS, which queues its work as CUDA does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one fn() call, the device synchronised on both sides."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() over `repeats` calls, after `warmup` untimed calls, with a
    device synchronisation around each timed call."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn, device) for _ in range(repeats))


def fastest_interleaved(calls: dict, device: torch.device, repeats: int, warmup: int = 2
                        ) -> dict:
    """Seconds of each of several calls {key: fn} on this device, taken in turns (each round
    times every call once), the fastest of `repeats` rounds each: load on a shared machine
    only ever adds time, and a burst then lands on one round of every call rather than on
    all of one call's (`--total-tokens auto` compares verify widths this way)."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for key, fn in calls.items():
            best[key] = min(best[key], seconds(fn, device))
    return best
