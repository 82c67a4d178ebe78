"""Fixed-shape steps, run eagerly or captured: `--engine eager|graphs|compile`.

On a GPU an eager Hugging Face step is host-bound: launching a small model's ~300 kernels
costs more than running them. A captured step replays all of them with one launch. Every
step the engine captures (the target's plain and verify steps, with greedy acceptance; a
serial drafter's whole drafting, catch-up to tree; Medusa's heads; a lookup chain's
attachment) is written as a function of tensors only, with no host reads, so it can be
recorded once per input shape and replayed:

* `eager`: call the function (the CPU default).
* `graphs`: record it into a `torch.cuda.CUDAGraph` (CUDA and ROCm; the GPU default).
* `compile`: `torch.compile` it (inductor: elementwise chains fused into fewer kernels),
  and on a GPU record the compiled step into a CUDA graph of our own, as `graphs` does.
  Not inductor's own graphs (`mode="reduce-overhead"`): it declines them for a step that
  writes an input in place ("skipping cudagraphs due to mutated inputs", the fourth GPU
  lease's log: every step that writes a KV cache), so the steps ran launch by launch; and
  its graphs share one memory pool across steps, so one step's replay could overwrite
  another's outputs.
* `static`: no capture, but every call goes through the static buffers as a replay would,
  and is checked against what a capture would have frozen (`HostStateCheck`): the first
  call of each shape records its operators, their Python arguments and the addresses of
  the tensors they read that the step did not make itself; a later call that differs in
  any of them would have replayed stale values on a GPU, and raises. So a CPU test finds
  a step that reads host state (a Python int that changes, a tensor replaced rather than
  refilled) before a GPU run gives wrong tokens with it.

Captured inputs live in static buffers: a call copies its inputs into the buffers of its
shape, replays, and returns copies of the outputs (so a later replay cannot overwrite a
result still in use). A step that writes a KV cache takes the write position as a device
tensor input (`KVCache.seek`), never as a Python int, so a replay writes where the call
says and not where the capture happened to write.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from gumiho.errors import GumihoError
from gumiho.hostsync import REPLAYING, HostSyncCounter

ENGINES = ("eager", "graphs", "compile", "static")


def default_engine(device: torch.device) -> str:
    """CUDA graphs on an accelerator, eager on a CPU."""
    return "graphs" if device.type == "cuda" else "eager"


def resolve_engine(engine: str | None, device: torch.device) -> str:
    engine = engine or default_engine(device)
    if engine not in ENGINES:
        raise GumihoError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "graphs" and device.type != "cuda":
        raise GumihoError(f"--engine graphs needs a CUDA or ROCm device (this run is on "
                          f"{device.type}): use --engine eager or compile")
    return engine


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of a GPU that every step on it is warmed up and captured on
    (one, not one a capture: cuBLAS keeps a workspace for each stream it has run on)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


class _Graph:
    """One CUDA graph of fn over static input buffers."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...],
                 pool, device: torch.device):
        # Everything on the inputs' GPU: a kernel runs on the current stream of its
        # tensors' device, so a stream (or a capture) on another GPU would miss it
        # (a target on cuda:1 while cuda:0 is current).
        with torch.cuda.device(device):
            self._record(fn, inputs, pool, capture_stream(device))

    def _record(self, fn, inputs: tuple[Tensor, ...], pool, stream: torch.cuda.Stream):
        self.inputs = tuple(x.clone() for x in inputs)
        # One call on the current stream first: without it, capturing the draft tree step
        # failed on an H200 (capture invalidated, cause not pinned down); with it, it held.
        fn(*self.inputs)
        stream.wait_stream(torch.cuda.current_stream())
        # Side-stream warm-up before capture, as PyTorch's CUDA graphs notes prescribe.
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, autotuning
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # Captured on the stream the warm-up ran on, not torch's own capture stream: cuBLAS
        # keeps a workspace per stream and allocates it at the stream's first product, which
        # on a fresh capture stream falls inside the capture. Both unexplained failures of
        # the suite on a GPU (an H200 shared with a training, 2026-11-28 and 11-30) were
        # CUBLAS_STATUS_INTERNAL_ERROR at a process's first capture, which fits that
        # allocation failing there (docs/gpu.md, "The cuBLAS capture error"); a failed
        # capture also leaves torch's CUDA generator marked as capturing, so every later
        # sampling step in that process failed ("Offset increment outside graph capture").
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.outputs = fn(*self.inputs)

    def __call__(self) -> tuple[Tensor, ...]:
        self.graph.replay()
        return self.outputs


class _Replay:
    """fn re-run on static input buffers: the data flow of a replay without capture
    (`static`, checked against the first call by `HostStateCheck`), or a compiled fn kept
    on stable input addresses (`compile`, whose CUDA graphs need them)."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...],
                 check: bool = False):
        self.fn, self.inputs = fn, tuple(x.clone() for x in inputs)
        self.recorded: HostStateCheck | None = None
        self.check = check

    def __call__(self) -> tuple[Tensor, ...]:
        if not self.check:
            return self.fn(*self.inputs)
        step = getattr(self.fn, "__qualname__", repr(self.fn))
        if self.recorded is not None:
            with HostStateCheck() as stream:
                outputs = self.fn(*self.inputs)
            self.recorded.compare(stream, step)
            return outputs
        # Recording: a CUDA capture refuses any wait for the device (and a copy from
        # pageable memory) inside the step; so does `static`, so a CPU run finds them too.
        with HostStateCheck(sites=True) as stream, HostSyncCounter() as syncs:
            outputs = self.fn(*self.inputs)
        if syncs.total:
            raise GumihoError(f"internal: the recorded step {step} makes the host wait on the "
                              f"device, which a CUDA graph cannot record: "
                              f"{', '.join(sorted(syncs.sites))}")
        self.recorded = stream
        return outputs


class HostStateCheck(TorchDispatchMode):
    """The operator stream of one call of a step, as a CUDA graph would record it: each
    operator with its Python arguments (ints, floats, shapes, dtypes), the shape and dtype
    of every tensor it takes, and the storage address of each tensor it reads that the
    call did not make (the step's inputs, weights, caches and other state it closes over).
    A graph replays the recorded stream; a later call whose stream differs reads host
    state that the graph froze (`compare` raises, naming the line that recorded it)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.ops: list[tuple] = []
        self.sites: list[str] | None = [] if sites else None
        self._made: set[int] = set()  # storages this call allocated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry: list = [func]  # (named by _show; str() on every operator cost 6% of the check)
        for arg in _leaves((args, kwargs), []):
            if isinstance(arg, Tensor) and func in _FROM_PYTHON:  # a value, not an address
                entry.append(("value", arg.tolist()))
            elif isinstance(arg, Tensor):
                ptr = arg.untyped_storage().data_ptr()
                entry.append((tuple(arg.shape), arg.dtype,
                              None if ptr in self._made else ("address", ptr)))
            else:
                entry.append(arg)
        out = func(*args, **kwargs)
        if func in _FROM_PYTHON or not (func.is_view or func._schema.is_mutable):
            self._made.update(o.untyped_storage().data_ptr() for o in _leaves(out, [])
                              if isinstance(o, Tensor))
        self.ops.append(tuple(entry))
        if self.sites is not None:
            self.sites.append(_site())
        return out

    def compare(self, later: HostStateCheck, step: str) -> None:
        for i, (was, now) in enumerate(zip(self.ops, later.ops, strict=False)):
            if was != now:
                raise GumihoError(
                    f"internal: the recorded step {step} reads host state that a CUDA graph "
                    f"would freeze: its operator {i} at {self.sites[i]} was {_show(was)} when "
                    f"recorded and is {_show(now)} now")
        if len(self.ops) != len(later.ops):
            raise GumihoError(f"internal: the recorded step {step} ran {len(self.ops)} "
                              f"operators when recorded and {len(later.ops)} now: it "
                              f"branches on host state that a CUDA graph would freeze")


def _leaves(tree, out: list) -> list:
    """The leaves of an operator's arguments or outputs (tuples, lists and dicts of
    tensors and Python values) appended to `out`, in order. torch's pytree gives the same
    for these at several times the cost, which the check paid on every operator."""
    if isinstance(tree, tuple | list):  # torch.Size and structseqs too
        for item in tree:
            _leaves(item, out)
    elif isinstance(tree, dict):
        for item in tree.values():
            _leaves(item, out)
    else:
        out.append(tree)
    return out


# Tensors made from Python data (`torch.tensor(...)`, a scalar in `t[i] = 3.0`) enter the
# operator stream here: a graph records their values
_FROM_PYTHON = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _show(entry: tuple) -> str:
    return f"{entry[0]}({', '.join(map(str, entry[1:]))})"


def _site() -> str:
    """The innermost line outside torch that called an operator."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith(("graphs.py", "hostsync.py")):
            return f"{name.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


class StaticStep:
    """fn(*tensors) -> tuple of tensors, recorded once per input shape and replayed.
    Callers keep the shapes few (verify and catch-up steps are padded to one width).

    Outputs are copies, so a later replay cannot overwrite a result still in use; with
    `fresh=n` only the first n are, and the rest are the step's own output buffers, valid
    until its next call (each copy is a kernel launch on the host's critical path)."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], engine: str,
                 fresh: int | None = None):
        self.fn, self.engine, self.fresh = fn, engine, fresh
        self.entries: dict[tuple, _Graph | _Replay] = {}
        self._pool = None
        self._compiled = None

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if self.engine == "eager":
            return self.fn(*inputs)
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._capture(inputs)
        for buffer, x in zip(entry.inputs, inputs, strict=True):
            buffer.copy_(x)
        REPLAYING.active = True  # a recorded step: no per-kernel host work on a GPU
        try:
            outputs = entry()
        finally:
            REPLAYING.active = False
        fresh = len(outputs) if self.fresh is None else self.fresh
        return tuple(out.clone() if i < fresh else out for i, out in enumerate(outputs))

    def _capture(self, inputs: tuple[Tensor, ...]) -> _Graph | _Replay:
        if self.engine == "static":
            return _Replay(self.fn, inputs, check=True)
        fn = self.fn
        if self.engine == "compile":
            if self._compiled is None:
                # Each step function is compiled once per shape and per cache it closes
                # over; the default limit of 8 would silently fall back to eager in long
                # sessions.
                torch._dynamo.config.recompile_limit = max(
                    torch._dynamo.config.recompile_limit, 64)
                self._compiled = torch.compile(self.fn, dynamic=False)
            fn = self._compiled
            if inputs[0].device.type != "cuda":
                return _Replay(fn, inputs)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # `_Graph` calls fn three times before it records: a compiled fn compiles and
        # autotunes there, never inside the capture
        device = next((x.device for x in inputs if x.device.type == "cuda"),
                      torch.device("cuda"))  # (a bare "cuda": the current GPU)
        return _Graph(fn, inputs, self._pool, device)
