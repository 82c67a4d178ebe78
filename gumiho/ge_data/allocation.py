"""Plan and run training-data generation: `python -m gumiho.ge_data.allocation --outdir DIR`.

Splits the conversation range [--start, --end) into fixed-size shards, writes a manifest,
prints the disk it will need, and runs one worker per GPU group (`--gpus 0,1 2,3`) or
`--workers K` CPU processes. Rerunning the same command resumes: only missing or
half-written shards are made again.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from gumiho.errors import GumihoError, cli_errors
from gumiho.ge_data.shards import (
    check_same_plan,
    missing_shards,
    read_manifest,
    write_manifest,
)
from gumiho.ge_data.worker import planned_conversations
from gumiho.target import resolve_target_path
from gumiho.version import code_version

CHARS_PER_TOKEN = 3.5  # rough, for the disk estimate only


def plan(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_target_path(args.target)).get_text_config()
    manifest = {"target": args.target, "data": args.data, "split": args.split,
                "start": args.start, "end": args.end, "shard_size": args.shard_size,
                "max_len": args.max_len, "template": args.template,
                "regenerate": args.regenerate, "regen_max_tokens": args.regen_max_tokens,
                "regen_batch_size": args.regen_batch_size,
                "dtype": args.dtype, "target_dtype": args.target_dtype,
                "hidden_size": config.hidden_size, "code_version": code_version(short=True)}
    conversations = planned_conversations(manifest)
    manifest["end"] = manifest["start"] + len(conversations)
    manifest["num_shards"] = math.ceil(len(conversations) / args.shard_size)
    per_token = config.hidden_size * (4 if args.dtype == "float32" else 2) + 5
    tokens = sum(min(args.max_len, sum(len(m["content"]) for m in c["messages"])
                     / CHARS_PER_TOKEN) for c in conversations)
    manifest["estimated_bytes"] = int(tokens * per_token)
    return manifest


def launch(outdir: Path, todo: list[int], slots: list[dict]) -> None:
    """One worker process per slot (env overrides, e.g. CUDA_VISIBLE_DEVICES)."""
    procs = []
    for rank, env in enumerate(slots):
        mine = todo[rank :: len(slots)]
        if mine:
            cmd = [sys.executable, "-m", "gumiho.ge_data.worker", "--outdir", str(outdir),
                   "--shards", ",".join(map(str, mine)), "--rank", str(rank)]
            procs.append(subprocess.Popen(cmd, env={**os.environ, **env}))
    failed = [p.args for p in procs if p.wait() != 0]
    if failed:
        raise GumihoError(f"{len(failed)} worker(s) failed; rerun the same command to resume")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gumiho.ge_data.allocation",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", required=True)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", default="sharegpt", help="'sharegpt' or a JSON/JSONL file")
    parser.add_argument("--split", default="train", choices=("train", "held_out"))
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--end", type=int, default=None, help="default: all")
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--template", default=None,
                        help="chat template for tokenizers without one: 'vicuna' or Jinja")
    parser.add_argument("--regenerate", action="store_true",
                        help="replace the first assistant turn with the target's own greedy "
                        "reply (self-distillation) and drop later turns")
    parser.add_argument("--regen-max-tokens", type=int, default=512)
    parser.add_argument("--regen-batch-size", type=int, default=32,
                        help="conversations generated together (larger: faster on a CPU)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16",
                                                              "float32"),
                        help="how features are stored")
    parser.add_argument("--target-dtype", default=None, help="target compute dtype")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--gpus", nargs="+", default=None,
                       help="GPU groups, one worker each, e.g. --gpus 0 1 or --gpus 0,1 2,3")
    group.add_argument("--workers", type=int, default=1, help="CPU worker processes")
    return parser


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    outdir = Path(args.outdir)
    manifest = plan(args)
    old = read_manifest(outdir)
    if old is not None:
        check_same_plan(old, manifest, outdir)
        manifest = old
    outdir.mkdir(parents=True, exist_ok=True)
    write_manifest(outdir, manifest)
    todo = missing_shards(outdir, manifest["num_shards"])
    print(f"{manifest['end'] - manifest['start']} conversations in "
          f"{manifest['num_shards']} shards ({len(todo)} to make); needs about "
          f"{manifest['estimated_bytes'] / 2**30:.2f} GiB in {outdir}", flush=True)
    if args.gpus:
        slots = [{"CUDA_VISIBLE_DEVICES": g} for g in args.gpus]
    else:
        threads = str(max(1, (os.cpu_count() or 1) // args.workers))
        slots = [{"OMP_NUM_THREADS": threads, "CUDA_VISIBLE_DEVICES": ""}] * args.workers
    start = time.perf_counter()
    launch(outdir, todo, slots)
    print(f"done in {time.perf_counter() - start:.0f} s: {outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
