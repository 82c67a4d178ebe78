"""Fixed-shape steps, run eagerly or captured: `--engine eager|graphs|compile`.

On a GPU an eager Hugging Face step is host-bound: launching a small model's ~300 kernels
costs more than running them. A captured step replays all of them with one launch. Every
step the engine captures (the target's plain and verify steps, the drafter's serial level
and its MLP heads) is written as a function of tensors only, with no host reads, so it can
be recorded once per input shape and replayed:

* `eager`: call the function (the CPU default).
* `graphs`: record it into a `torch.cuda.CUDAGraph` (CUDA and ROCm; the GPU default).
* `compile`: `torch.compile` it (`mode="reduce-overhead"`, i.e. compiled kernels inside
  CUDA graphs, on a GPU; plain inductor on a CPU).
* `static`: no capture, but every call goes through the static buffers as a replay would:
  a check of the buffer handling on any device (tests, debugging). If `static` matches
  `eager` and `graphs` does not, a step reads host state that capture froze.

Captured inputs live in static buffers: a call copies its inputs into the buffers of its
shape, replays, and returns copies of the outputs (so a later replay cannot overwrite a
result still in use). A step that writes a KV cache takes the write position as a device
tensor input (`KVCache.seek`), never as a Python int, so a replay writes where the call
says and not where the capture happened to write.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gumiho.errors import GumihoError
from gumiho.hostsync import REPLAYING

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


class _Graph:
    """One CUDA graph of fn over static input buffers."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...],
                 pool):
        self.inputs = tuple(x.clone() for x in inputs)
        # One call on the current stream first: without it, capturing the draft tree step
        # failed on an H200 (capture invalidated, cause not pinned down); with it, it held.
        fn(*self.inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Side-stream warm-up before capture, as PyTorch's CUDA graphs notes prescribe.
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, autotuning
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def __call__(self) -> tuple[Tensor, ...]:
        self.graph.replay()
        return self.outputs


class _Replay:
    """fn re-run on static input buffers: the data flow of a replay without capture
    (`static`), or a compiled fn kept on stable input addresses (`compile`, whose CUDA
    graphs need them)."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...]):
        self.fn, self.inputs = fn, tuple(x.clone() for x in inputs)

    def __call__(self) -> tuple[Tensor, ...]:
        return self.fn(*self.inputs)


class StaticStep:
    """fn(*tensors) -> tuple of tensors, recorded once per input shape and replayed.
    Callers keep the shapes few (verify and catch-up steps are padded to one width)."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], engine: str):
        self.fn, self.engine = fn, engine
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
        return tuple(out.clone() for out in outputs)

    def _capture(self, inputs: tuple[Tensor, ...]) -> _Graph | _Replay:
        if self.engine == "static":
            return _Replay(self.fn, inputs)
        if self.engine == "graphs":
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            return _Graph(self.fn, inputs, self._pool)
        if self._compiled is None:
            # Each step function is compiled once per shape and per cache it closes over;
            # the default limit of 8 would silently fall back to eager in long sessions.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            mode = "reduce-overhead" if inputs[0].device.type == "cuda" else None
            self._compiled = torch.compile(self.fn, mode=mode, dynamic=False)
        return _Replay(self._compiled, inputs)
