"""The on-disk training data: fixed-name shards plus a manifest, written atomically.

A shard `shard_{i:05d}.pt` holds, per conversation, its `id`, `input_ids` [L] (int32),
`hidden_state` [L, H] (the target's post-norm last-layer features, 16-bit) and `loss_mask`
[L] (uint8).
A shard exists only once complete: it is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch

from gumiho.errors import GumihoError
from gumiho.paths import write_atomically

MANIFEST = "manifest.json"
# Settings that must agree between a manifest and a run that resumes it.
PLAN_KEYS = ("target", "data", "split", "start", "end", "shard_size", "max_len", "template",
             "regenerate", "dtype")


def shard_path(outdir: Path, index: int) -> Path:
    return outdir / f"shard_{index:05d}.pt"


def write_shard(outdir: Path, index: int, samples: list[dict]) -> None:
    final = shard_path(outdir, index)
    write_atomically(final, lambda tmp: torch.save(samples, tmp))


def read_shard(path: Path, mmap: bool = False) -> list[dict]:
    """A shard's samples; with mmap the tensors are read from disk as they are used (the
    page cache, not the process, holds the features of a large data set)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any decode failure means a broken shard
        raise GumihoError(f"cannot read shard {path} ({type(exc).__name__}): delete it and "
                          "rerun the same allocation command to regenerate it") from None


def read_manifest(outdir: Path) -> dict | None:
    path = outdir / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GumihoError(f"{path} is not a readable data manifest ({type(exc).__name__}): "
                          "this folder does not hold data made by gumiho.ge_data.allocation "
                          "(it was left untouched)") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("num_shards"), int):
        raise GumihoError(f"{path} is not a data manifest (no num_shards): this folder does "
                          "not hold data made by gumiho.ge_data.allocation (it was left "
                          "untouched)")
    return manifest


def write_manifest(outdir: Path, manifest: dict) -> None:
    write_atomically(outdir / MANIFEST,
                     lambda tmp: tmp.write_text(json.dumps(manifest, indent=2) + "\n"))


def check_same_plan(old: dict, new: dict, outdir: Path) -> None:
    for key in PLAN_KEYS:
        if old.get(key) != new.get(key):
            raise GumihoError(f"{outdir} holds data made with {key}={old.get(key)!r}, not "
                              f"{new.get(key)!r}: use another --outdir or the same settings")


def shard_problem(path: Path) -> str | None:
    """Why a finished shard file is unusable (truncated, corrupted), or None. Checks the
    CRC of every member of torch's zip archive: reads the file once, loads nothing."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"corrupted member {bad}" if bad else None


def count_samples(outdir: Path, count: int) -> int:
    """Samples in the finished shards, without reading their tensors (memory-mapped)."""
    total = 0
    for i in range(count):
        path = shard_path(outdir, i)
        if path.exists():
            total += len(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    return total


def missing_shards(outdir: Path, count: int) -> list[int]:
    for tmp in outdir.glob("shard_*.pt.tmp"):  # half-written by an interrupted run
        tmp.unlink()
    return [i for i in range(count) if not shard_path(outdir, i).exists()]


def load_samples(data_dir: str | Path, mmap: bool = False) -> tuple[dict, list[dict]]:
    """The manifest and every sample of a finished data dir."""
    outdir = Path(data_dir)
    manifest = read_manifest(outdir)
    if manifest is None:
        raise GumihoError(f"{outdir}: no {MANIFEST}; make data with "
                          "python -m gumiho.ge_data.allocation --outdir DIR")
    missing = missing_shards(outdir, manifest["num_shards"])
    if missing:
        raise GumihoError(f"{outdir}: {len(missing)} shards missing (first: {missing[0]}); "
                          "rerun the allocation command to finish them")
    samples = []
    for i in range(manifest["num_shards"]):
        samples += read_shard(shard_path(outdir, i), mmap)
    return manifest, samples
