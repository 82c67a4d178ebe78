"""Plan and run training-data generation: `python -m gumiho.ge_data.allocation --outdir DIR`.

Splits the conversation range [--start, --end) into fixed-size shards, writes a manifest,
prints the disk it will need, and runs one worker per GPU group (`--gpus 0,1 2,3`) or
`--workers K` CPU processes (one CPU worker: this process). Rerunning the same command
resumes: only missing or half-written shards are made again, and a finished shard that
does not read back (truncated, corrupted) is made again too; a rerun with settings that
change the shards (the data file by its content), or into a folder that is not a data dir,
is refused. Ctrl-C or a kill loses at most the shards being made; the worker processes
end with this one.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gumiho.embedded import EMBEDDED
from gumiho.errors import (
    ERROR_FILE_ENV,
    ArgumentParser,
    GumihoError,
    cli_errors,
    how_it_ended,
    left_line,
    nonnegative_int,
    positive_int,
    shell_status,
)
from gumiho.ge_data.conversations import data_identity, load_conversations, split
from gumiho.ge_data.shards import (
    MANIFEST,
    check_same_plan,
    count_samples,
    missing_shards,
    read_manifest,
    shard_path,
    shard_problem,
    sweep_temp_files,
    write_manifest,
)
from gumiho.paths import check_writable_dir
from gumiho.target import choose_device_dtype, resolve_target_path, target_config
from gumiho.templates import check_template_writes_messages, tokenize_conversation
from gumiho.version import code_version

CHARS_PER_TOKEN = 3.5  # rough, for the disk estimate only
MIN_MAX_LEN = 16  # below this no chat template leaves room for a reply


def planned_range(args: argparse.Namespace, notes: list[str]) -> list[dict]:
    """The conversations [--start, --end) of the split; refuses a range outside the data."""
    train, held_out = split(load_conversations(args.data, notes))
    chosen = held_out if args.split == "held_out" else train
    if not chosen:
        raise GumihoError(f"the {args.split} split of {args.data} has no conversations "
                          "(each goes to a split by a hash of its id, so a small file can "
                          "put them all in the other): give more data, or the other --split")
    if args.start >= len(chosen):
        raise GumihoError(f"--start {args.start} is beyond the data: the {args.split} split "
                          f"of {args.data} has {len(chosen)} conversations "
                          f"(0..{len(chosen) - 1})")
    if args.end is not None and args.end > len(chosen):
        notes.append(f"--end {args.end} is beyond the data: using conversations "
                     f"{args.start}..{len(chosen) - 1}")
    return chosen[args.start : args.end]


def plan(args: argparse.Namespace, notes: list[str] | None = None) -> dict:
    notes = [] if notes is None else notes
    config = target_config(args.target)
    manifest = {"target": args.target, "data": args.data, "split": args.split,
                "start": args.start, "end": args.end, "shard_size": args.shard_size,
                "max_len": args.max_len, "template": args.template,
                "regenerate": args.regenerate, "regen_max_tokens": args.regen_max_tokens,
                "regen_batch_size": args.regen_batch_size,
                "dtype": args.dtype, "target_dtype": args.target_dtype,
                "compute_dtype": compute_dtype(args),
                "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "code_version": code_version(short=True)}
    conversations = planned_range(args, notes)
    manifest.update(data_identity(args.data))
    if args.target not in EMBEDDED:  # a model dir: where it is (a resume from elsewhere)
        manifest["target_path"] = str(resolve_target_path(args.target).resolve())
    check_template(args, conversations[0])
    manifest["end"] = manifest["start"] + len(conversations)
    manifest["num_shards"] = math.ceil(len(conversations) / args.shard_size)
    per_token = config.hidden_size * (4 if args.dtype == "float32" else 2) + 5
    tokens = sum(min(args.max_len, sum(len(m["content"]) for m in c["messages"])
                     / CHARS_PER_TOKEN) for c in conversations)
    manifest["estimated_bytes"] = int(tokens * per_token)
    return manifest


def compute_dtype(args: argparse.Namespace) -> str:
    """The dtype the workers run the target in (--target-dtype, else $GUMIHO_DTYPE, else
    their device's default): it changes the features, so a resume must use the same."""
    device = "cuda" if args.gpus else "cpu"  # check_gpus found them
    return str(choose_device_dtype(device, args.target_dtype)[1]).removeprefix("torch.")


def check_template(args: argparse.Namespace, conversation: dict) -> None:
    """The tokenizer loads and the chat template renders, before any worker starts."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(args.target))
    except Exception as exc:  # noqa: BLE001 - missing or garbage tokenizer files
        raise GumihoError(f"target {args.target!r} has no usable tokenizer "
                          f"({type(exc).__name__}): copy the model's tokenizer files into "
                          "its directory") from None
    if args.template is not None:
        check_template_writes_messages(tokenizer, args.template)
    tokenize_conversation(tokenizer, conversation["messages"], args.max_len, frozenset(),
                          args.template)


# What a run killed before its manifest was written can leave (paths.write_atomically's
# temp names): such a folder is still resumed
LEFTOVERS = (f"{MANIFEST}.tmp*", "shard_*.pt.tmp*")


def check_outdir(outdir: Path) -> dict | None:
    """The output folder can hold the data; returns its manifest if it has one. A folder
    holding anything else but no manifest (shards of unknown settings, a model, a
    drafter) is not ours to write into."""
    check_writable_dir(outdir, "--outdir")
    manifest = read_manifest(outdir) if outdir.is_dir() else None
    if manifest is not None or not outdir.is_dir():
        return manifest
    if any(outdir.glob("shard_*.pt")):
        raise GumihoError(f"--outdir {outdir} holds shard files but no {MANIFEST}: use an "
                          "empty or new folder")
    foreign = sorted(p.name for p in outdir.iterdir()
                     if not any(p.match(pattern) for pattern in LEFTOVERS))
    if foreign:
        raise GumihoError(f"--outdir {outdir} is not a data folder (it holds {foreign[0]}"
                          f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
                          f"no {MANIFEST}): use an empty or new folder")
    return None


def check_gpus(groups: list[str]) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for group in groups:
        ids = group.split(",")
        if not all(i.isdigit() for i in ids):
            raise GumihoError(f"--gpus {group!r}: give GPU indices, e.g. --gpus 0 1 or "
                              "--gpus 0,1 2,3")
        if count == 0:
            raise GumihoError("--gpus: no CUDA/ROCm GPU is visible here: use --workers K")
        if max(map(int, ids)) >= count:
            raise GumihoError(f"--gpus {group}: only {count} GPU(s) here (0..{count - 1})")


def remake_damaged(outdir: Path, count: int) -> None:
    """A shard that does not read back (truncated, corrupted) is deleted to be made again."""
    for i in range(count):
        path = shard_path(outdir, i)
        problem = path.exists() and shard_problem(path)
        if problem:
            print(f"{path} is damaged ({problem}): making it again", file=sys.stderr)
            path.unlink()


STOP_GRACE_S = 5.0  # how long interrupted workers get to stop on their own signal


def launch(outdir: Path, todo: list[int], slots: list[dict], manifest: dict) -> int:
    """One worker process per slot (env overrides, e.g. CUDA_VISIBLE_DEVICES). A worker
    reports its error in a file, so the user sees one line for the whole run; returns the
    exit status (a failed worker's). One CPU slot runs in this process: a second
    interpreter would only add its start (~10 s of imports on 2 cores) and a hop for
    Ctrl-C and errors."""
    if todo and len(slots) == 1 and slots[0]["GUMIHO_DEVICE"] == "cpu":
        from gumiho.ge_data.worker import make_shards  # torch and transformers: load late

        make_shards(outdir, manifest, todo, "cpu")
        return 0
    procs = []
    with tempfile.TemporaryDirectory(prefix="gumiho-workers-") as errors:
        try:
            for rank, env in enumerate(slots):
                mine = todo[rank :: len(slots)]
                if mine:
                    cmd = [sys.executable, "-m", "gumiho.ge_data.worker", "--outdir",
                           str(outdir), "--shards", ",".join(map(str, mine)), "--rank",
                           str(rank), "--parent-pid", str(os.getpid())]
                    error_file = Path(errors) / f"worker{rank}.txt"
                    procs.append((rank, error_file, subprocess.Popen(
                        cmd, env={**os.environ, **env, ERROR_FILE_ENV: str(error_file)})))
            failed = [(rank, file, p.wait()) for rank, file, p in procs]
        except KeyboardInterrupt:
            stop_workers([p for _, _, p in procs])
            raise
        failed = [failure for failure in failed if failure[2] != 0]
        return report_failure(failed) if failed else 0


def report_failure(failed: list[tuple[int, Path, int]]) -> int:
    """Print the first failed worker's reason in one line; return the exit status a shell
    would show for it: the worker's own (2 for bad input, 1 for a bug), or 128 + the signal
    that killed it."""
    rank, file, code = failed[0]
    print(f"error: {len(failed)} worker(s) failed, {failure_reason(rank, code, file)}; "
          "finished shards are kept: rerun the same command to resume", file=sys.stderr,
          flush=True)
    return shell_status(code)


def failure_reason(rank: int, code: int, error_file: Path) -> str:
    """The line a failed worker left in its file, or what ended it (gumiho.train.launch's
    wording for the trainer's processes)."""
    line = left_line(error_file)
    if line:
        return f"worker {rank}: {line.removeprefix('error: ')}"
    return f"worker {rank} {how_it_ended(code)}"


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """Ctrl-C: a terminal's reaches the workers too (same process group), so they get a
    moment to stop on it; any still running then gets it forwarded (allocation alone was
    interrupted), and each is made to end."""
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m gumiho.ge_data.allocation",
                            description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", required=True)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", default="sharegpt", help="'sharegpt' or a JSON/JSONL file")
    parser.add_argument("--split", default="train", choices=("train", "held_out"))
    parser.add_argument("--start", type=nonnegative_int, default=0)
    parser.add_argument("--end", type=positive_int, default=None, help="default: all")
    parser.add_argument("--shard-size", type=positive_int, default=100)
    parser.add_argument("--max-len", type=max_len_arg, default=2048)
    parser.add_argument("--template", default=None,
                        help="chat template for tokenizers without one: 'vicuna' or Jinja")
    parser.add_argument("--regenerate", action="store_true",
                        help="replace the first assistant turn with the target's own greedy "
                        "reply (self-distillation) and drop later turns")
    parser.add_argument("--regen-max-tokens", type=positive_int, default=512)
    parser.add_argument("--regen-batch-size", type=positive_int, default=32,
                        help="conversations generated together (larger: faster on a CPU)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16",
                                                              "float32"),
                        help="how features are stored")
    parser.add_argument("--target-dtype", default=None, help="target compute dtype")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--gpus", nargs="+", default=None,
                       help="GPU groups, one worker each, e.g. --gpus 0 1 or --gpus 0,1 2,3")
    group.add_argument("--workers", type=positive_int, default=1, help="CPU worker processes")
    return parser


def max_len_arg(value: str) -> int:
    number = positive_int(value)
    if number < MIN_MAX_LEN:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_MAX_LEN} tokens, got "
                                         f"{value!r}")
    return number


@cli_errors(resume="finished shards are kept; rerun the same command to resume")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.end is not None and args.end <= args.start:
        raise GumihoError(f"--end {args.end} must be greater than --start {args.start}")
    if args.gpus:
        check_gpus(args.gpus)
    choose_device_dtype("cpu", args.target_dtype)  # an unknown --target-dtype fails now
    outdir = Path(args.outdir)
    old = check_outdir(outdir)
    notes: list[str] = []
    manifest = plan(args, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if old is not None:
        check_same_plan(old, manifest, outdir)
        # the same data and target, found from here
        manifest = {**old, **{k: manifest[k] for k in ("data_path", "target_path")
                              if k in manifest}}
    outdir.mkdir(parents=True, exist_ok=True)
    write_manifest(outdir, manifest)
    remake_damaged(outdir, manifest["num_shards"])
    sweep_temp_files(outdir)
    todo = missing_shards(outdir, manifest["num_shards"])
    print(f"{manifest['end'] - manifest['start']} conversations in "
          f"{manifest['num_shards']} shards ({len(todo)} to make); needs about "
          f"{manifest['estimated_bytes'] / 2**30:.2f} GiB in {outdir}", flush=True)
    free = shutil.disk_usage(outdir).free
    need = manifest["estimated_bytes"] * len(todo) / max(manifest["num_shards"], 1)
    if need > free:
        print(f"note: {outdir} has {free / 2**30:.2f} GiB free, less than the estimate",
              file=sys.stderr)
    # Each worker's device is its slot's, whatever GUMIHO_DEVICE says here (a CPU worker
    # told to use "cuda" with no GPU visible would fail).
    if args.gpus:
        slots = [{"CUDA_VISIBLE_DEVICES": g, "GUMIHO_DEVICE": "cuda"} for g in args.gpus]
    else:
        threads = str(max(1, (os.cpu_count() or 1) // args.workers))
        slots = [{"OMP_NUM_THREADS": threads, "CUDA_VISIBLE_DEVICES": "",
                  "GUMIHO_DEVICE": "cpu"}] * args.workers
    start = time.perf_counter()
    status = launch(outdir, todo, slots, manifest)
    if status:
        return status
    samples = count_samples(outdir, manifest["num_shards"])
    conversations = manifest["end"] - manifest["start"]
    if samples == 0:
        raise GumihoError(f"no conversation gave a training sample (every reply was cut by "
                          f"--max-len {manifest['max_len']}): use a larger --max-len")
    print(f"done in {time.perf_counter() - start:.0f} s: {samples} samples from "
          f"{conversations} conversations ({conversations - samples} skipped: no reply "
          f"within --max-len, no room to regenerate one, or refused by the chat template) "
          f"in {outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
