"""One data-generation worker: `python -m gumiho.ge_data.worker --outdir DIR --shards 0,2`.

Started by `gumiho.ge_data.allocation` (one per GPU group or CPU slot). Reads its settings
from the manifest, skips finished shards, writes each shard atomically.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from gumiho.errors import ArgumentParser, GumihoError, cli_errors, nonnegative_int, one_line
from gumiho.ge_data.conversations import load_conversations, split
from gumiho.ge_data.shards import read_manifest, shard_path, write_shard
from gumiho.target import Target, choose_device_dtype, load_target
from gumiho.templates import render, tokenize_conversation

STORE_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def planned_conversations(manifest: dict) -> list[dict]:
    """The conversations the manifest's range covers, in order, from the file it was made
    from (its resolved path; a manifest made before it was recorded: the name as given)."""
    train, held_out = split(load_conversations(manifest.get("data_path") or manifest["data"]))
    chosen = held_out if manifest["split"] == "held_out" else train
    return chosen[manifest["start"] : manifest["end"]]


@torch.inference_mode()
def regenerate(target: Target, conversations: list[dict], template: str | None,
               max_new_tokens: int, max_len: int, batch_size: int = 8,
               advance: Callable[[int], object] = lambda n: None) -> list[dict]:
    """Replace each conversation's first assistant turn with the target's own greedy reply
    (self-distillation) and drop later turns. Prompts that leave no room for a reply within
    max_len are skipped before generating; batches group similar lengths (less padding).
    `advance(n)` as n more conversations are done or skipped (progress: generating is most
    of a shard's time)."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(target.stop_token_ids)
    prompts = {}
    for i, c in enumerate(conversations):
        try:
            prompts[i] = render(tok, c["messages"][: first_user(c) + 1], True, template)
        except GumihoError as exc:
            skip_refused(c, exc)
    keep = sorted((i for i, p in prompts.items() if len(p) <= max_len - 32),
                  key=lambda i: len(prompts[i]))
    advance(len(conversations) - len(keep))
    out = []
    for start in range(0, len(keep), batch_size):
        rows = keep[start : start + batch_size]
        batch = [conversations[i] for i in rows]
        prompts_now = [prompts[i] for i in rows]
        width = max(map(len, prompts_now))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts_now])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_now])
        gen = target.model.generate(ids.to(target.device), attention_mask=mask.to(target.device),
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=sorted(target.stop_token_ids), pad_token_id=pad)
        for conv, row in zip(batch, gen[:, width:].tolist(), strict=True):
            reply = tok.decode(row, skip_special_tokens=True).strip()
            history = conv["messages"][: first_user(conv) + 1]
            out.append({**conv, "messages": history + [{"role": "assistant", "content": reply}]})
        advance(len(rows))
    return out


def first_user(conversation: dict) -> int:
    return next(i for i, m in enumerate(conversation["messages"]) if m["role"] == "user")


def make_samples(target: Target, conversations: list[dict], manifest: dict,
                 advance: Callable[[int], object] = lambda n: None) -> list[dict]:
    """The shard's samples; `advance(n)` as n more conversations are done (progress)."""
    if manifest["regenerate"]:  # progress counts the generating, the slow part
        conversations = regenerate(target, conversations, manifest["template"],
                                   manifest["regen_max_tokens"], manifest["max_len"],
                                   manifest.get("regen_batch_size", 8), advance)
        advance = lambda n: None  # noqa: E731 - each conversation is counted once
    samples = []
    for conv in conversations:
        sample = make_sample(target, conv, manifest)
        samples += [sample] if sample else []
        advance(1)
    return samples


def make_sample(target: Target, conversation: dict, manifest: dict) -> dict | None:
    """One conversation's ids, features and loss mask; None if nothing is left to learn
    from (the reply was cut by max_len) or the chat template refuses the conversation."""
    try:
        ids, mask = tokenize_conversation(target.tokenizer, conversation["messages"],
                                          manifest["max_len"], target.stop_token_ids,
                                          manifest["template"])
    except GumihoError as exc:
        skip_refused(conversation, exc)
        return None
    if int(mask.sum()) == 0:
        return None
    hidden = target.features(ids[None].to(target.device))[0]
    return {"id": conversation["id"], "input_ids": ids.to(torch.int32),
            "hidden_state": hidden.to(STORE_DTYPE[manifest["dtype"]]).cpu(),
            "loss_mask": mask.to(torch.uint8)}


def skip_refused(conversation: dict, exc: GumihoError) -> None:
    """A conversation the chat template refuses (e.g. Gemma-2's and Mistral's templates
    raise on a system turn, which 25 of ShareGPT's have) is skipped with a note: failing
    would stop every rerun at the same conversation. (allocation tried the template on the
    range's first conversation, so a template that fails on all is refused before.)"""
    tqdm.write(f"note: conversation {conversation['id']!r} skipped: {one_line(exc)}",
               file=sys.stderr)


def shards_arg(value: str) -> list[int]:
    parts = [p for p in value.split(",") if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected shard indices like 0,2,4, got {value!r}")
    return [int(p) for p in parts]


@cli_errors(resume="finished shards are kept; rerun the allocation command to resume")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m gumiho.ge_data.worker")
    parser.add_argument("--outdir", required=True)
    parser.add_argument("--shards", required=True, type=shards_arg,
                        help="comma-separated shard indices")
    parser.add_argument("--rank", type=nonnegative_int, default=0, help="progress-bar row")
    parser.add_argument("--parent-pid", type=nonnegative_int, default=None,
                        help="the allocation process: this worker ends when it does")
    args = parser.parse_args(argv)
    if args.parent_pid is not None and not die_with_parent(args.parent_pid):
        return 1  # allocation died before this worker started: nobody wants its shards
    outdir = Path(args.outdir)
    manifest = read_manifest(outdir) if outdir.is_dir() else None
    if manifest is None:
        raise GumihoError(f"{outdir}: no manifest (start with gumiho.ge_data.allocation)")
    if any(i >= manifest["num_shards"] for i in args.shards):
        raise GumihoError(f"--shards: {outdir} has shards 0..{manifest['num_shards'] - 1}")
    device, _ = choose_device_dtype(None, None)
    make_shards(outdir, manifest, args.shards, str(device), args.rank)
    return 0


def die_with_parent(parent_pid: int) -> bool:
    """On Linux the kernel kills this worker when its parent dies (even by kill -9), so no
    orphan goes on writing shards that a rerun makes too; elsewhere nothing. False if the
    parent is already gone (it can die before this runs)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL),
                                                     0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc
            pass
    return os.getppid() == parent_pid


def make_shards(outdir: Path, manifest: dict, shards: list[int], device: str,
                rank: int = 0) -> None:
    """Make the shards of `shards` that are not there yet, each written atomically, with
    the target on `device` (a worker process's work; allocation's own for one CPU
    worker). Progress counts conversations (a shard of 100 takes minutes on a CPU)."""
    dtype = manifest.get("compute_dtype") or manifest.get("target_dtype")
    # with the manifest's template: its end-of-turn token is a stop token, where a
    # regenerated reply must end (the tokenizer's own template may end turns otherwise)
    target = load_target(manifest.get("target_path") or manifest["target"], device=device,
                         dtype=dtype, chat_template=manifest["template"])
    conversations = planned_conversations(manifest)
    size = manifest["shard_size"]
    chunks = {i: conversations[i * size : (i + 1) * size] for i in shards}
    with tqdm(total=sum(map(len, chunks.values())), desc=f"worker {rank}", position=rank,
              unit="conv") as bar:
        for index, chunk in chunks.items():
            if shard_path(outdir, index).exists():
                bar.update(len(chunk))
                continue
            write_shard(outdir, index, make_samples(target, chunk, manifest, bar.update))


if __name__ == "__main__":
    code = main()
    # Exiting: a second Ctrl-C (allocation forwards one to a worker it still sees running)
    # must not break into the interpreter's shutdown with a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)
