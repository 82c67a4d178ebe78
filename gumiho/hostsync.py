"""Count the host synchronisations a piece of code would make on a GPU, on any device.

On CUDA the host blocks whenever it needs a device value (`.item()`, `int(t)`, `bool(t)`,
`.tolist()`, `torch.equal`, `allclose`; shapes that depend on data: `nonzero`,
boolean-mask indexing, `repeat_interleave` without `output_size`, `unique`, `bincount`) and
whenever Python data is copied to the device from pageable memory (`torch.tensor(...,
device=...)` of a list or a single number, `t.new_tensor(...)`, and
`t[index_tensor] = python_scalar`, whose scalar goes to the device first). CUDA's own sync
debug mode (`torch.cuda.set_sync_debug_mode`) reports these only on a GPU; `HostSyncCounter`
finds the same operations from the operator stream, so a CPU test can hold the speculative
loop to its budget (one sync a greedy cycle) and name the line that breaks it.

Zero-dimensional Python scalars in arithmetic (`t + 1`, `torch.where(m, t, 0)`) and basic
slice assignment (`t[:n] = True`) are passed as kernel arguments and do not sync, nor does
`upload` (host data through pinned memory, copied non-blocking): the one way the loop
sends host-made data to the device.
"""

from __future__ import annotations

import threading
import traceback
import weakref
from collections import Counter

import numpy as np
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Operators whose output shape or value the host must read back.
_READS = {aten._local_scalar_dense.default: "item()/int()/bool()",
          aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
          aten.unique_consecutive.default: "unique", aten._unique2.default: "unique",
          aten._unique.default: "unique", aten.unique_dim.default: "unique",
          aten.unique_dim_consecutive.default: "unique", aten.bincount.default: "bincount",
          # a Python bool: one kernel on a CPU, a read of the device's answer on CUDA
          aten.equal.default: "equal/allclose", aten.allclose.default: "equal/allclose"}
_HOST_METHODS = {torch.Tensor.tolist: "tolist()", torch.Tensor.numpy: "numpy()"}
# Python data made into a tensor on a device: a copy from pageable memory, 0-dim too (a
# Python scalar in arithmetic, or a CPU scalar tensor, goes as a kernel argument instead)
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}


_UPLOADING = threading.local()
_TO_DEVICE = threading.local()  # .active: inside a `_FROM_DATA` call that names a device
_COUNTING = threading.local()  # .launches: the LaunchCounters entered in this thread


def upload(values: np.ndarray, device: torch.device) -> Tensor:
    """Host data on the device without blocking the host: a pinned copy, sent
    non-blocking (on a CPU device, the array itself)."""
    _UPLOADING.active = True
    try:
        host = torch.from_numpy(values)
        if device.type == "cpu":
            return host
        return host.pin_memory().to(device, non_blocking=True)
    finally:
        _UPLOADING.active = False
        for counter in getattr(_COUNTING, "launches", ()):  # one copy, whatever the device
            if counter.active:
                counter.count()


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncCounter):
        super().__init__()
        self.owner = owner
        self.python_scalars: weakref.WeakSet = weakref.WeakSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _READS:
            self.owner.record(_READS[func])
        elif func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
            if getattr(_UPLOADING, "active", False):
                pass  # pinned and non-blocking: no sync
            elif out.dim() > 0 or getattr(_TO_DEVICE, "active", False):
                self.owner.record("tensor from Python data")  # an H2D copy on a GPU
            else:
                self.python_scalars.add(out)
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            indices = args[1]
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self.owner.record("boolean-mask indexing")
            elif func is not aten.index.Tensor and args[2] in self.python_scalars:
                self.owner.record("t[index] = Python scalar")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.owner.record("repeat_interleave without output_size")
        return out


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_METHODS:
            self.owner.record(_HOST_METHODS[func])
        elif func in _FROM_DATA and _names_device(func, kwargs):
            before, _TO_DEVICE.active = getattr(_TO_DEVICE, "active", False), True
            try:
                return func(*args, **kwargs)
            finally:
                _TO_DEVICE.active = before
        return func(*args, **kwargs)


def _names_device(func, kwargs) -> bool:
    """Whether a `_FROM_DATA` call puts its tensor on a device it names (new_tensor: its
    tensor's; a device is a keyword argument of the others)."""
    return func is torch.Tensor.new_tensor or kwargs.get("device") is not None


class HostSyncCounter:
    """with HostSyncCounter() as syncs: ...; then syncs.total, syncs.by_kind, syncs.sites
    (kind and the line that asked for it)."""

    def __init__(self, keep_sites: bool = True):
        self.by_kind: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.keep_sites = keep_sites

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def record(self, kind: str) -> None:
        self.by_kind[kind] += 1
        if self.keep_sites:
            self.sites[f"{kind} at {_caller()}"] += 1

    def __enter__(self) -> HostSyncCounter:
        self._modes = (_Function(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _caller() -> str:
    """The innermost frame outside torch and this module: the line that asked for it."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")  # (Windows paths)
        if "/torch/" not in name and not name.endswith("hostsync.py"):
            # its folder and file; `<stdin>`, `<string>` (a REPL, python -c) as they are
            return f"{'/'.join(name.rsplit('/', 2)[-2:])}:{frame.lineno}"
    return "?"


REPLAYING = threading.local()  # set by graphs.StaticStep while a recorded step replays


class _Launches(TorchDispatchMode):
    def __init__(self, owner: LaunchCounter):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.owner.active and not func.is_view and func not in _NO_KERNEL \
                and not getattr(_UPLOADING, "active", False):  # `upload` counts itself
            self.owner.count()
        return out


_NO_KERNEL = {aten._local_scalar_dense.default, aten.lift_fresh.default, aten.detach.default,
              aten.alias.default, aten._to_copy.default}


class LaunchCounter:
    """Device kernels the host launches outside recorded steps, by the gumiho module that
    asked for them (`with LaunchCounter() as launches: ...; launches.by_module`).

    On a GPU each launch costs the host a few microseconds, so this is what the cycle's
    eager part (tree building, acceptance, cache compaction) costs beyond its syncs. Steps
    a captured engine records (`static` replays them in Python) are not counted there but
    in `inside`: one replay launches them all, but each is still a kernel the device runs,
    and a small model's recorded step costs about what its kernels number. Views launch
    nothing and are not counted. An `upload` counts one launch on every device (on CUDA its
    pinning is host work and its copy one asynchronous transfer; on a CPU it runs no
    operator at all), so a CPU test sees the count a GPU run has."""

    def __init__(self, active: bool = True):
        self.by_module: Counter[str] = Counter()
        self.inside = 0  # kernels run inside recorded steps
        self.active = active  # switch on later, e.g. after a prefill

    @property
    def total(self) -> int:
        return sum(self.by_module.values())

    def count(self) -> None:
        """One kernel: inside the recorded step replaying, else by the module asking."""
        if getattr(REPLAYING, "active", False):
            self.inside += 1
        else:
            self.by_module[_gumiho_module()] += 1

    def __enter__(self) -> LaunchCounter:
        self._mode = _Launches(self)
        self._mode.__enter__()
        _COUNTING.launches = [*getattr(_COUNTING, "launches", ()), self]
        return self

    def __exit__(self, *exc) -> None:
        _COUNTING.launches.remove(self)
        self._mode.__exit__(*exc)


def _gumiho_module() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/gumiho/" in path and not path.endswith("hostsync.py"):
            return path.rsplit("/gumiho/", 1)[1]
    return "?"
