"""A training run's resumable state, saved atomically.

`OUT/state` holds accelerate's state (model, optimizer, RNG), the LR scheduler, the
progress (`step`, `epoch`, global micro-batches done in the epoch) and the run's settings.
A save writes `OUT/state.tmp` completely, then swaps it in with two renames; a kill at any
moment leaves either the new state or the previous one (`state.old`, between the renames),
never a mix. A resume compares the saved settings with the command's and refuses a
difference, naming it, and cuts `OUT/train_log.jsonl` back to the saved step: the rows
written after the last save are written again by the resumed run, so the log reads as one
uninterrupted run (no step twice, no half-written line).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gumiho.errors import GumihoError
from gumiho.paths import same_place, write_atomically

PROGRESS = "progress.json"
LOG = "train_log.jsonl"  # written by the training loop, one JSON row per line


@dataclass
class RunState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_done: int = 0  # global micro-batches of the current epoch already trained


def _complete(path: Path) -> bool:
    return (path / PROGRESS).is_file()


def state_dir(out: Path) -> Path | None:
    """The newest complete saved state of a run, if any."""
    for name in ("state", "state.old"):
        if _complete(out / name):
            return out / name
    return None


def check_run_settings(out: Path, settings: dict, defaults: dict | None = None) -> dict:
    """One line if OUT's saved run was made with other `settings` (the dry run checks all
    but the process count, which only the launch knows); returns the saved progress."""
    found = state_dir(out)
    if found is None:
        return {}
    try:
        saved = json.loads((found / PROGRESS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise damaged(found, PROGRESS, exc) from None
    old = saved.get("settings", {})
    defaults = defaults or {}
    for key, value in settings.items():
        if key not in old and key not in defaults:
            continue  # recorded since the run began (data_digests): nothing to compare
        was = old.get(key, defaults.get(key))
        if key == "target" and isinstance(was, str) and same_place(was, value):
            continue  # the same model dir, named relatively or not
        if key == "data_digests" and was != value:
            raise GumihoError(f"{out} holds a run on other data: a --data dir's "
                              "manifest.json changed since it began (made again?): resume "
                              "with the data it began on, or give another --output-dir")
        if json.dumps(was) != json.dumps(value):
            raise GumihoError(
                f"{out} holds a run made with {key}={was!r}, not {value!r}: rerun "
                "with the same settings to resume it, or give another --output-dir")
    return saved


def load_run_state(accelerator, out: Path, settings: dict, scheduler,
                   defaults: dict | None = None) -> RunState:
    """Resume from OUT's saved state (checking its settings), or start at step 0. A setting
    the saved run does not record (it predates the flag) counts as its `defaults` value."""
    found = state_dir(out)
    if found is None:  # steps logged before a first save are done again
        if accelerator.is_main_process:
            trim_log(out / LOG, 0)
        return RunState()
    saved = check_run_settings(out, settings, defaults)
    try:
        accelerator.load_state(str(found))
    except Exception as exc:  # noqa: BLE001 - a truncated file, in accelerate's words
        raise damaged(found, "its model, optimizer or RNG files", exc) from None
    try:
        scheduler.load_state_dict(torch.load(found / "scheduler.pt", weights_only=True))
        state = RunState(**saved["progress"])
    except Exception as exc:  # noqa: BLE001
        raise damaged(found, "scheduler.pt or progress.json", exc) from None
    if accelerator.is_main_process:
        trim_log(out / LOG, state.step)
    accelerator.print(f"resuming from step {state.step} (epoch {state.epoch})")
    return state


def damaged(found: Path, what: str, exc: BaseException) -> GumihoError:
    """One line for a saved state that cannot be read back (a disk's fault: saves are
    atomic)."""
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return GumihoError(f"{found} is damaged ({what}: {type(exc).__name__}"
                       f"{': ' + detail if detail else ''}): move it away to start the run "
                       "again from step 0, or give another --output-dir")


def trim_log(path: Path, step: int) -> None:
    """Keep the log's rows up to `step` (training and eval rows alike); drop later ones and
    a last line cut off mid-write. Rewritten beside the log, then swapped in."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # killed while writing it
        if row.get("step", 0) <= step:
            kept.append(line)
    write_atomically(path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept),
                                                      encoding="utf-8"))


def wait_for_everyone(accelerator) -> None:
    """accelerator.wait_for_everyone(), except in a group of CPU processes: accelerate's
    barrier names each process's local GPU (`device_ids=[local rank]`) even then, which
    fails on a machine with fewer GPUs than processes (invalid device ordinal) and wakes
    a GPU for every CPU process otherwise; a gloo group's barrier needs no device."""
    if accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        torch.distributed.barrier()
    else:
        accelerator.wait_for_everyone()


def save_run_state(accelerator, out: Path, state: RunState, settings: dict, scheduler) -> None:
    """Write the state beside the old one, then swap it in (see the module docstring)."""
    tmp, final, old = out / "state.tmp", out / "state", out / "state.old"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    wait_for_everyone(accelerator)
    accelerator.save_state(str(tmp))
    # every process has written its part (its RNG state; DeepSpeed's shards) before the main
    # one marks the state complete and renames it: accelerate's save_state ends without a
    # barrier, and a process still writing found state.tmp renamed away (and the state was
    # complete without its file)
    wait_for_everyone(accelerator)
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / PROGRESS).write_text(json.dumps({"progress": asdict(state),
                                                "settings": settings}), encoding="utf-8")
        if _complete(final):
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        else:
            shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    wait_for_everyone(accelerator)
