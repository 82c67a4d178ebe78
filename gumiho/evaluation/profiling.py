"""What a speculative cycle is made of, beyond its phase times: the host's syncs and
kernel launches per cycle, and (torch.profiler) the kernels that take its device time.
The timing tool reports them per method; each counts over the cycles past the first."""

from __future__ import annotations

from dataclasses import replace

import torch

from gumiho.engine import GenerateConfig, run
from gumiho.hostsync import LaunchCounter
from gumiho.target import Target


def host_syncs_per_cycle(target: Target, drafter, ids: list[int], engine: str,
                         max_new_tokens: int) -> float | None:
    """Implicit device synchronisations per verify cycle of an unprofiled run, counted by
    CUDA's sync debug mode from the end of the first verify cycle on, as
    `launches_per_cycle` counts (the prefill's are not a cycle's); None off CUDA, where
    there is no device queue to stall."""
    import warnings

    if target.device.type != "cuda":
        return None
    counted = []

    def start_counting(tree, emitted):
        if not counted:
            torch.cuda.set_sync_debug_mode("warn")
        counted.append(1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run(target, drafter, ids, GenerateConfig(max_new_tokens=max_new_tokens,
                                                     engine=engine), on_cycle=start_counting)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs / max(len(counted) - 1, 1)  # the last on_cycle ends the counted region


def launches_per_cycle(target: Target, drafter, ids: list[int], engine: str,
                       max_new_tokens: int) -> tuple[dict[str, float], float]:
    """Kernels launched outside recorded steps per verify cycle, by module, and kernels
    run inside them per cycle (hostsync.LaunchCounter); with the eager engine every step's
    kernels count as launched outside, and none inside."""
    counted = []

    def start_counting(tree, emitted):  # from the end of the first verify cycle on
        launches.active = True
        counted.append(1)

    with LaunchCounter(active=False) as launches:
        run(target, drafter, ids, GenerateConfig(max_new_tokens=max_new_tokens, engine=engine),
            on_cycle=start_counting)
    cycles = max(len(counted) - 1, 1)  # the last on_cycle ends the counted region
    return ({module: n / cycles for module, n in launches.by_module.most_common()},
            launches.inside / cycles)


def tree_build_s(target: Target, drafter, ids: list[int], engine: str, repeats: int = 20
                 ) -> float | None:
    """Seconds of building one tree alone (the MLP levels, the selection, the ancestor
    mask: `SerialDrafter._tree_fn`; at depth 1 `_draft_fn`, i.e. `tree.Star.tree`) as a
    step of `engine`, on the inputs of a real cycle: inside the one recorded drafting step
    it is not a phase the profile can time. The inputs come from an eager run of the same
    network and tree; a recorded step's replay is timed without its input copies. None for
    drafters without one (Medusa's tree is fixed) and for the FTA modes and floors, which
    build their trees on the host."""
    from gumiho.graphs import StaticStep
    from gumiho.profiling import timed
    from gumiho.serial_drafter import SerialDrafter

    while hasattr(drafter, "inner"):  # a lookup chain or a gate around it
        drafter = drafter.inner
    if not isinstance(drafter, SerialDrafter) or not drafter.one_step:
        return None
    # captured engines ignore the floors (they change a tree's size): so does the stand-in
    tree = replace(drafter.tree, min_confidence=0.0, extend_confidence=0.0)
    eager = SerialDrafter(drafter.model, tree, engine="eager")
    # a depth-1 tree is its level's tokens under fixed fields (`_draft_fn` goes straight to
    # tree.Star), deeper ones a selection from the pool
    name = "_draft_fn" if eager.draft_depth == 1 else "_tree_fn"
    calls, build = [], getattr(eager, name)
    setattr(eager, name, lambda *inputs: calls.append(inputs) or build(*inputs))
    run(target, eager, ids, GenerateConfig(max_new_tokens=8))
    if not calls:  # the answer ended at its first token: no tree was built
        return None
    step = StaticStep(build, engine)
    step(*calls[-1])  # records it
    replay = next(iter(step.entries.values()), None)
    return timed(replay or (lambda: build(*calls[-1])), target.device, repeats)


def kernel_table(target: Target, drafter, ids: list[int], engine: str, max_new_tokens: int,
                 top: int) -> dict:
    """Where a cycle's device time goes: `kernel_summary` per cycle, from torch.profiler
    over the cycles past the first."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = target.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    prof = profile(activities=activities)
    counted = []

    def start_profiling(tree, emitted):  # from the end of the first verify cycle on
        if not counted:
            prof.start()
        counted.append(1)

    try:
        run(target, drafter, ids, GenerateConfig(max_new_tokens=max_new_tokens, engine=engine),
            on_cycle=start_profiling)
        if on_gpu:
            torch.cuda.synchronize(target.device)
    finally:
        if counted:
            prof.stop()
    cycles = max(len(counted) - 1, 1)
    if not counted:
        return {"cycles": 0, "busy_s": 0.0, "what": kernel_kind(on_gpu), "top": []}
    return {"cycles": cycles, **kernel_summary(prof, on_gpu, cycles, top)}


def kernel_kind(on_gpu: bool) -> str:
    return "device kernels" if on_gpu else "torch operators' self time"


def kernel_summary(prof, on_gpu: bool, units: int, top: int) -> dict:
    """A finished torch.profiler's `top` kernels (on a CPU: operators, by self time) by
    time per unit (a cycle, a training step), with calls per unit, and the device's busy
    time per unit (the union of the kernels' intervals on a GPU, where a unit busy for
    less than its wall time waits on the host)."""
    from torch.autograd import DeviceType

    events = prof.events()
    if on_gpu:
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA]
    else:
        kernels = [(e.name, e.time_range.start, e.time_range.start + e.self_cpu_time_total)
                   for e in events if e.device_type == DeviceType.CPU]
    totals: dict[str, list[float]] = {}
    for name, start, end in kernels:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += (end - start) * 1e-6
    if on_gpu:  # the union of the kernels' intervals, in us
        busy, reach = 0.0, float("-inf")
        for _, start, end in sorted(kernels, key=lambda k: k[1]):
            busy += max(end - max(start, reach), 0)
            reach = max(reach, end)
    else:  # the host's operators: their self times do not overlap
        busy = sum(end - start for _, start, end in kernels)
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return {"busy_s": busy * 1e-6 / units, "what": kernel_kind(on_gpu),
            "top": [{"name": name, "calls": n / units, "s": t / units}
                    for name, (n, t) in ranked]}
