"""The host's own work per greedy cycle: wall time less the time inside recorded steps.

On a GPU the recorded steps (a cycle's drafting, its verify with greedy acceptance) replay
as CUDA graphs, one launch each; everything else in a cycle (the loop's Python, the
kernels launched outside recorded steps, building the emitted token list, the stop test)
is host work that the device may wait on. On a CPU everything runs in turn, so that host
work can be measured there (this loads on the CPU on any machine): this runs the loop on
the `static` engine's data flow (inputs
copied into the step's own buffers, outputs cloned, as a replay does) without its
host-state check, times every step's body, and prints per cycle the wall time, the time
inside recorded steps and the rest. A cycle's first propose also catches the drafter up
over the prompt, eagerly, once a generation: it is reported apart.

    python scripts/host_time.py --method gumiho [--draft gumiho/assets/smollm2/gumiho]
    python scripts/host_time.py --method ar --profile 20    # the rest's Python, by function

Measured figures: docs/status.md, "Reached, and not yet".
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho import graphs
from gumiho.demo import shipped_drafter
from gumiho.engine import GenerateConfig, generate
from gumiho.errors import cli_errors
from gumiho.generate import SpeculativeGenerator
from gumiho.methods import method_spec

PROMPT = "Write a short story about a robot who learns to paint."


class StepClock:
    """While active: `static` steps replay without the host-state check, and the time
    inside them (and the number of replays) is added up; a profiler given is paused
    inside them, so it sees only the host's own work."""

    def __init__(self):
        self.inside, self.replays, self.profiler = 0.0, 0, None

    def __enter__(self) -> StepClock:
        self._call, self._capture = graphs._Replay.__call__, graphs.StaticStep._capture
        clock, call, capture = self, self._call, self._capture

        def timed(replay):
            if clock.profiler:
                clock.profiler.disable()
            start = time.perf_counter()
            outputs = call(replay)
            clock.inside += time.perf_counter() - start
            clock.replays += 1
            if clock.profiler:
                clock.profiler.enable()
            return outputs

        def unchecked(step, inputs):
            if step.engine == "static":
                return graphs._Replay(step.fn, inputs, check=False)
            return capture(step, inputs)

        graphs._Replay.__call__, graphs.StaticStep._capture = timed, unchecked
        return self

    def __exit__(self, *exc) -> None:
        graphs._Replay.__call__, graphs.StaticStep._capture = self._call, self._capture

    def reset(self) -> None:
        self.inside, self.replays = 0.0, 0


def one_run(gen, ids, config, clock: StepClock, profiler: cProfile.Profile | None = None
            ) -> tuple[int, int, float, float, int, float]:
    """One generation: the cycles after the first, their tokens, wall time, time inside
    recorded steps and replays, and the first cycle's host work (`profiler`, if given,
    sees the cycles after the first)."""
    steps = generate(gen.target, gen.drafter, ids, config)
    next(steps)  # the prefill's token (eager)
    clock.reset()
    start = time.perf_counter()
    next(steps)  # the first cycle: its propose catches up over the prompt
    first_host = time.perf_counter() - start - clock.inside
    clock.reset()
    clock.profiler = profiler
    if profiler is not None:
        profiler.enable()
    cycles, tokens, start = 0, 0, time.perf_counter()
    for new in steps:
        cycles, tokens = cycles + 1, tokens + len(new)
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
    clock.profiler = None
    return cycles, tokens, wall, clock.inside, clock.replays, first_host


@cli_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="gumiho")
    parser.add_argument("--draft", default=None,
                        help="default: the shipped drafter of a method with a network")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0,
                        help="also list the N functions with the most host time")
    args = parser.parse_args(argv)
    draft = args.draft
    if draft is None and method_spec(args.method).drafter:
        draft = str(shipped_drafter(args.method))
    torch.set_num_threads(args.threads)
    # on the CPU on any machine: there each step's body runs as it is timed (a GPU's
    # would be its launches alone)
    gen = SpeculativeGenerator.load("smollm2", method=args.method, draft=draft,
                                    device="cpu", dtype=args.dtype, engine="static")
    ids = gen.prompt_ids(PROMPT)
    config = GenerateConfig(max_new_tokens=args.max_new_tokens, engine="static")
    with StepClock() as clock:
        one_run(gen, ids, config, clock)  # warm-up: records every step shape
        cycles, tokens, wall, inside, replays, first_host = one_run(gen, ids, config, clock)
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:  # a run of its own: cProfile's cost inflates what it sees
            one_run(gen, ids, config, clock, profiler)
    ms = 1e3 / max(cycles, 1)
    print(f"{args.method}: {cycles} cycles after the first, {tokens / max(cycles, 1):.2f} "
          f"tokens a cycle; per cycle: wall {wall * ms:.2f} ms, inside recorded steps "
          f"{inside * ms:.2f} ms ({replays / max(cycles, 1):.1f} replays), "
          f"host work {(wall - inside) * ms:.3f} ms; the first cycle: host work "
          f"{first_host * 1e3:.1f} ms (the prompt's catch-up)")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
