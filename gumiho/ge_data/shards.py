"""The on-disk training data: fixed-name shards plus a manifest, written atomically.

A shard `shard_{i:05d}.pt` holds, per conversation, its `id`, `input_ids` [L] (int32),
`hidden_state` [L, H] (the target's post-norm last-layer features, 16-bit) and `loss_mask`
[L] (uint8).
A shard exists only once complete: it is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import torch

from gumiho.errors import GumihoError
from gumiho.paths import same_place, write_atomically

MANIFEST = "manifest.json"
# Settings that must agree between a manifest and a run that resumes it: all that change a
# shard's bytes beyond rounding (how many workers or threads, or which device, change only
# the order of float sums, as resuming on another machine would). A key that a manifest
# made by older code lacks is not compared; the data file is compared by its content.
PLAN_KEYS = ("split", "start", "end", "shard_size", "max_len", "template",
             "regenerate", "dtype", "compute_dtype")
REGEN_KEYS = ("regen_max_tokens", "regen_batch_size")  # with --regenerate only
DATA_KEYS = ("data_bytes", "data_sha256")  # the data file's content, wherever it lies now


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
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GumihoError(f"{path} is not a readable data manifest ({type(exc).__name__}): "
                          "this folder does not hold data made by gumiho.ge_data.allocation "
                          "(it was left untouched)") from None
    if not isinstance(manifest, dict) or not is_count(manifest.get("num_shards")):
        raise GumihoError(f"{path} is not a data manifest (no num_shards): this folder does "
                          "not hold data made by gumiho.ge_data.allocation (it was left "
                          "untouched)")
    problem = manifest_problem(outdir, manifest)
    if problem:
        raise GumihoError(f"{path} is inconsistent ({problem}): it was edited or damaged; "
                          "restore it or make the data again in another --outdir")
    return manifest


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def manifest_problem(outdir: Path, manifest: dict) -> str | None:
    """Why a manifest's numbers disagree with each other or with the shards beside it, or
    None. A hand-made manifest with num_shards alone is checked against its shards only."""
    count = manifest["num_shards"]
    if count < 1:
        return f"num_shards {count}"
    if all(k in manifest for k in ("start", "end", "shard_size")):
        start, end, size = manifest["start"], manifest["end"], manifest["shard_size"]
        if not all(map(is_count, (start, end, size))) or not 0 <= start < end or size < 1:
            return f"start {start!r}, end {end!r}, shard_size {size!r}"
        if count != math.ceil((end - start) / size):
            return (f"num_shards {count}, but conversations {start}..{end - 1} in shards of "
                    f"{size} make {math.ceil((end - start) / size)}")
    beyond = sorted(p.name for p in outdir.glob("shard_*.pt") if shard_index(p) >= count)
    return f"num_shards {count}, but {beyond[0]} is there" if beyond else None


def shard_index(path: Path) -> int:
    digits = path.name.removeprefix("shard_").removesuffix(".pt")
    return int(digits) if digits.isdigit() else -1


def write_manifest(outdir: Path, manifest: dict) -> None:
    write_atomically(outdir / MANIFEST,
                     lambda tmp: tmp.write_text(json.dumps(manifest, indent=2) + "\n",
                                                encoding="utf-8"))


def check_same_plan(old: dict, new: dict, outdir: Path) -> None:
    """A resume's settings are the manifest's: each key both record, the data file by its
    content (by its name where the manifest predates that)."""
    keys = [k for k in PLAN_KEYS if k in old and k in new]
    if "compute_dtype" not in keys:  # made before it was recorded: the flag as given
        keys.append("target_dtype")
    if old.get("regenerate") and new.get("regenerate"):
        keys += [k for k in REGEN_KEYS if k in old and k in new]
    differs = [(key, repr(old.get(key)), repr(new.get(key))) for key in keys
               if old.get(key) != new.get(key)]
    if not same_target(old, new):
        differs.append(("target", describe_target(old), describe_target(new)))
    if not same_data(old, new):
        differs.append(("data", describe_data(old), describe_data(new)))
    if differs:
        key, was, now = differs[0]
        raise GumihoError(f"{outdir} holds data made with {key}={was}, not {now}: use another "
                          "--outdir or the same settings")


def same_target(old: dict, new: dict) -> bool:
    """The same model dir (by where it is: one name from two folders is two models), or,
    where the manifest predates the path or the dir has moved since, the same name."""
    a, b = old.get("target_path"), new.get("target_path")
    if a and b and Path(a).exists():
        return same_place(a, b)
    return old.get("target") == new.get("target")


def describe_target(manifest: dict) -> str:
    where = manifest.get("target_path")
    return f"{manifest.get('target')!r}" + (f" ({where})" if where else "")


def same_data(old: dict, new: dict) -> bool:
    if "data_sha256" in old and "data_sha256" in new:
        return [old.get(k) for k in DATA_KEYS] == [new.get(k) for k in DATA_KEYS]
    a, b = old.get("data"), new.get("data")
    return a == b or (isinstance(a, str) and isinstance(b, str) and same_place(a, b))


def describe_data(manifest: dict) -> str:
    digest = manifest.get("data_sha256")
    return f"{manifest.get('data')!r}" + (f" (sha256 {digest[:12]}...)" if digest else "")


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
    """The shards not finished yet (a reader's question: it touches nothing)."""
    return [i for i in range(count) if not shard_path(outdir, i).exists()]


def sweep_temp_files(outdir: Path) -> None:
    """Remove shards half-written by an interrupted allocation: the allocation's own
    step before it writes them again (a reader, such as training, must not: another
    process may be writing one now)."""
    for tmp in outdir.glob("shard_*.pt.tmp"):
        tmp.unlink(missing_ok=True)


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
