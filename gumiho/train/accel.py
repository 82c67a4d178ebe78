"""The accelerator a training run trains on, decided once: its precision (bf16 autocast
on a GPU, fp32 on a CPU, bf16 refused where this CPU's bf16 products are slow), a fresh
accelerate state where a process trains twice, the process group and DeepSpeed's settings
checked, and logged terms averaged over every process.
"""

from __future__ import annotations

import os

import torch

from gumiho.config import TrainConfig
from gumiho.errors import GumihoError
from gumiho.profiling import fastest_interleaved
from gumiho.target import choose_device_dtype

# --precision bf16 on a CPU is refused where bf16 products are this many times slower.
SLOW_BF16 = 2.0


def precision(config: TrainConfig) -> tuple[str, str]:
    """Decided once: accelerate's mixed precision and the target's dtype. bf16 is autocast
    over fp32 weights (optimizer and master weights stay fp32) with the target in bf16; by
    default on a GPU only: on the device training runs on, so GUMIHO_DEVICE=cpu on a GPU
    machine trains in fp32."""
    on_cpu = choose_device_dtype()[0].type == "cpu"
    chosen = config.precision or ("fp32" if on_cpu else "bf16")
    if chosen == "bf16" and on_cpu:
        slowdown = bf16_slowdown()
        if slowdown > SLOW_BF16:
            raise GumihoError(f"--precision bf16: bfloat16 matrix products run {slowdown:.0f}x "
                              "slower than float32 on this CPU (no fast bf16 kernels for it): "
                              "train with --precision fp32")
    return ("bf16", "bfloat16") if chosen == "bf16" else ("no", "float32")


def bf16_slowdown(rows: int = 512, width: int = 576, out: int = 1536) -> float:
    """How many times longer bfloat16 matrix products take than float32 ones here, over the
    three layouts of a training step (x W^T forward, g W and g^T x backward), at SmolLM2's
    width. CPUs differ by an order of magnitude: one AVX2 machine here ran bf16 about 2x as
    fast as fp32, another (AMD EPYC, AVX2) fell back to a scalar loop, 7x slower for x W^T
    and 76x for g W (at 512 rows, as measured here, this returns about 9 there). Takes a few
    milliseconds, or a few seconds on such a CPU. One warm-up pass was not enough on an AMX
    CPU: the first timed bf16 pass there read 2-3x slower than fp32 (oneDNN compiles its kernels
    and the process starts AMX on first use), later ones 0.2x."""
    gen = torch.Generator().manual_seed(0)
    x, g, w = (torch.randn(shape, generator=gen, device="cpu")
               for shape in ((rows, width), (rows, out), (out, width)))

    def products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        return lambda: (a @ c.t(), b @ c, b.t() @ a)

    calls = {dtype: products(x.to(dtype), g.to(dtype), w.to(dtype))
             for dtype in (torch.bfloat16, torch.float32)}
    # two untimed passes each (kernel JIT, AMX start-up), then three rounds in turns
    best = fastest_interleaved(calls, torch.device("cpu"), repeats=3, warmup=2)
    return best[torch.bfloat16] / best[torch.float32]


def fresh_accelerator_state(mixed: str, on_cpu: bool) -> None:
    """accelerate keeps one process-wide state and refuses an Accelerator with another
    mixed precision than the first one's, or cpu=True once a GPU state exists (and keeps a
    CPU state's device when the GPU is wanted): a notebook training twice, the test suite
    on a GPU with its CPU-only tests. Another precision drops the precision part; another
    device, in a single process, the whole state (a launched group cannot move)."""
    from accelerate.state import AcceleratorState, PartialState

    if PartialState._shared_state:
        partial = PartialState()
        if (partial.device.type == "cpu") != on_cpu:
            if partial.num_processes > 1:
                raise GumihoError(f"this process is one of {partial.num_processes} launched "
                                  f"on {partial.device.type}: it cannot train on "
                                  f"{'the CPU' if on_cpu else 'a GPU'} as well")
            AcceleratorState._reset_state(reset_partial_state=True)
            return
    if AcceleratorState._shared_state and AcceleratorState().mixed_precision != mixed:
        AcceleratorState._reset_state()


def check_process_group(accelerator) -> None:
    """Refuse launched processes that did not join one group (each would train alone)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise GumihoError(f"{launched} processes were launched but each trains alone "
                          f"(accelerate sees {accelerator.num_processes}): launch with "
                          "`accelerate launch --multi_gpu --num_processes N` or torchrun")


def configure_deepspeed(accelerator, config: TrainConfig) -> None:
    """Under DeepSpeed this run's flags decide its micro-batch, accumulation and clipping
    (no dataloader is prepared, so accelerate would have no micro-batch size)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    if accelerator.gradient_accumulation_steps != config.grad_accum:
        raise GumihoError(f"the accelerate config sets gradient_accumulation_steps="
                          f"{accelerator.gradient_accumulation_steps}: remove it there, "
                          "--grad-accum decides")
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=config.batch_size,
                                   gradient_accumulation_steps=config.grad_accum,
                                   gradient_clipping=config.grad_clip)


def global_mean(accelerator, logs: list[dict[str, float]]) -> dict[str, float]:
    """Each logged term averaged over the optimizer step's micro-batches on every process
    that logged it (a micro-batch with no position for a head logs no accuracy for it):
    what one process with the whole global batch logs."""
    keys = sorted({k for log in logs for k in log})
    if accelerator.num_processes > 1:  # every process reduces the same terms
        from accelerate.utils import gather_object

        keys = sorted({k for found in gather_object([keys]) for k in found})
    sums = [sum(log[k] for log in logs if k in log) for k in keys]
    counts = [sum(k in log for log in logs) for k in keys]
    local = torch.tensor(sums + counts, dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local
    n = len(keys)
    return {k: float(total[i] / total[n + i]) for i, k in enumerate(keys) if total[n + i] > 0}
