"""Training batches: stored features (from `gumiho.ge_data`) or computed online, grouped
by length so that padding wastes little compute."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from gumiho.errors import GumihoError, one_line
from gumiho.ge_data.conversations import conversations_path, load_conversations, split
from gumiho.ge_data.shards import load_samples
from gumiho.paths import cache_dir, same_place, write_atomically
from gumiho.templates import check_template_writes_messages, tokenize_conversation

LENGTH_WINDOW = 16  # batches whose samples are sorted by length together (then shuffled)
TOKENIZE_THREADS = 8  # the encoder runs without the GIL; the chat template's rendering not


def stored_samples(data_dirs: tuple[str, ...] | list[str], hidden_size: int) -> list[dict]:
    """Every sample of one or more data dirs (features memory-mapped from disk)."""
    samples: list[dict] = []
    for data_dir in data_dirs:
        manifest, part = load_samples(data_dir, mmap=True)
        check_width(manifest, data_dir, hidden_size)
        samples += part
    return samples


def check_width(manifest: dict, data_dir: str, hidden_size: int) -> None:
    """One line if a data dir's features are not the target's width (another target's)."""
    if manifest.get("hidden_size") not in (None, hidden_size):
        raise GumihoError(f"{data_dir} holds features of width {manifest['hidden_size']}, "
                          f"but the target has {hidden_size}: make data for this target")


def check_data_target(manifest: dict, data_dir: str, target: str, config) -> str | None:
    """Data made for another target: one line where its vocabulary differs (recorded since
    2026-11-30; its ids would fall outside this target's), else a note (None if none)
    where the target it names is not this one: a copy of the same model elsewhere is fine,
    another model of the same shape would train the drafter on the wrong features."""
    made_for = manifest.get("target")
    if manifest.get("vocab_size") not in (None, config.vocab_size):
        raise GumihoError(f"{data_dir} was made with target {made_for!r} (vocabulary "
                          f"{manifest['vocab_size']}), but {target!r} has {config.vocab_size}: "
                          "make data for this target")
    if made_for is None or same_place(made_for, target):
        return None
    return (f"{data_dir} was made with target {made_for!r}, not {target!r}: the shapes "
            "agree, so training goes on (make data for this target if it is another model)")


def online_samples(target, source: str, count: int, max_len: int,
                   template: str | None = None, skip: int = 0, progress: bool = False,
                   cache: bool = True, threads: int | None = None) -> list[dict]:
    """Tokenised conversations `skip` .. `skip + count` of the training split, without
    features; the loop adds them with the target. `progress` shows a bar (the whole split
    takes a minute or more, before the first step), `threads` tokenise at once (default:
    the CPUs, at most TOKENIZE_THREADS). With `cache`, the result is kept under the cache
    dir (`samples/`) and read back by a run that asks for the same samples of the same file
    with the same tokenizer and code: a resumed or repeated run starts at once."""
    if template is not None:
        check_template_writes_messages(target.tokenizer, template)
    path = conversations_path(source)
    file = samples_cache_file(target, path, count, max_len, template, skip) \
        if cache and path.is_file() else None
    if file is not None and (cached := read_cached_samples(file)) is not None:
        return cached
    train, _ = split(load_conversations(source))
    if skip >= len(train):
        raise GumihoError(f"--skip-conversations {skip}: the training split of {source!r} "
                          f"has {len(train)} conversations")
    chosen = train[skip : skip + count]
    if progress and skip + count > len(train):  # the main process says it, once
        print(f"note: the training split of {source!r} has {len(train)} conversations: "
              f"using {skip}..{len(train) - 1} ({len(chosen)}, not --num-conversations "
              f"{count})", file=sys.stderr)
    if threads is None:
        threads = min(TOKENIZE_THREADS, os.cpu_count() or 1)
    out, refused = [], []
    for conv, made in zip(chosen, tqdm(tokenized(target, chosen, max_len, template, threads),
                                       total=len(chosen), desc="tokenize", unit="conv",
                                       disable=not progress), strict=True):
        if isinstance(made, GumihoError):
            refused.append((conv["id"], made))
        elif int(made[1].sum()):
            ids, mask = made
            out.append({"input_ids": ids.to(torch.int32), "loss_mask": mask.to(torch.uint8)})
    if refused and progress:  # the main process says it, once
        print(f"note: the chat template refuses {len(refused)} of {len(chosen)} conversations "
              f"(skipped; the first, {refused[0][0]!r}: {one_line(refused[0][1])})",
              file=sys.stderr)
    if len(refused) == len(chosen):  # the template itself, not a few conversations
        raise refused[0][1]
    if file is not None:
        write_cached_samples(file, out)
    return out


def tokenized(target, conversations: list[dict], max_len: int, template: str | None,
              threads: int) -> Iterator[tuple[Tensor, Tensor] | GumihoError]:
    """`tokenize_conversation` of each conversation, in order, on `threads` threads, each
    with its own copy of the tokenizer (its Python side changes state while it encodes),
    or its error where the chat template refuses that conversation (e.g. Gemma-2's and
    Mistral's templates raise on a system turn). The same samples as one thread: the
    tokenizer is deterministic. On 2 cores 2 threads are 1.8-2.2x one (the whole split
    126 s -> 58 s)."""
    def with_tokenizer(tokenizer, conv: dict) -> tuple[Tensor, Tensor] | GumihoError:
        try:
            return tokenize_conversation(tokenizer, conv["messages"], max_len,
                                         target.stop_token_ids, template)
        except GumihoError as exc:
            return exc

    if threads <= 1:
        for conv in conversations:
            yield with_tokenizer(target.tokenizer, conv)
        return
    local = threading.local()

    def one(conv: dict) -> tuple[Tensor, Tensor] | GumihoError:
        if not hasattr(local, "tokenizer"):
            local.tokenizer = copy.deepcopy(target.tokenizer)
        return with_tokenizer(local.tokenizer, conv)

    pool = ThreadPoolExecutor(threads)
    try:
        yield from pool.map(one, conversations)
    finally:  # an error or ctrl-C: the conversations not yet begun are dropped, not waited for
        pool.shutdown(cancel_futures=True)


# The code that turns a conversation into a sample: a change to it makes cached samples stale.
SAMPLE_CODE = ("templates.py", "ge_data/conversations.py", "train/dataset.py")


def samples_cache_file(target, path: Path, count: int, max_len: int, template: str | None,
                       skip: int) -> Path:
    """Where `online_samples` keeps these samples: named by a digest of everything that
    decides them (the file's identity, the tokenizer, the arguments, the code)."""
    tokenizer = target.tokenizer
    stat = path.stat()
    digest = hashlib.sha256(json.dumps({
        "file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "count": count, "max_len": max_len, "template": template, "skip": skip,
        "stop_token_ids": sorted(target.stop_token_ids),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }, sort_keys=True).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None
                  else json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    package = Path(__file__).resolve().parent.parent
    for name in SAMPLE_CODE:
        digest.update((package / name).read_bytes())
    return cache_dir() / "samples" / f"{digest.hexdigest()[:32]}.pt"


def read_cached_samples(file: Path) -> list[dict] | None:
    """Samples `write_cached_samples` kept, or None (none kept, or unreadable: made again)."""
    try:
        kept = torch.load(file, weights_only=True)
        lengths = kept["lengths"].tolist()
        ids = kept["input_ids"].split(lengths)
        masks = kept["loss_mask"].split(lengths)
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError,
            pickle.UnpicklingError):
        return None
    # each its own tensor (a view would take the whole flat storage wherever it is pickled)
    return [{"input_ids": i.clone(), "loss_mask": m.clone()}
            for i, m in zip(ids, masks, strict=True)]


def write_cached_samples(file: Path, samples: list[dict]) -> None:
    """Keep samples as three flat tensors (written whole, then renamed into place); a cache
    dir that cannot be written costs only the next run's tokenising."""
    if not samples:
        return
    flat = {"lengths": torch.tensor([s["input_ids"].shape[0] for s in samples]),
            "input_ids": torch.cat([s["input_ids"] for s in samples]),
            "loss_mask": torch.cat([s["loss_mask"] for s in samples])}
    try:  # several processes (a distributed run) may write the same file at once
        file.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(file, lambda tmp: torch.save(flat, tmp), unique=True)
    except OSError:
        pass


def token_counts(samples: list[dict], vocab_size: int) -> Tensor:
    """(V,) how often each token is an assistant token (what the drafter must predict), on
    the host whatever the default device (training samples live there)."""
    counts = torch.zeros(vocab_size, dtype=torch.long, device="cpu")
    for s in samples:
        ids = s["input_ids"].long().cpu()[s["loss_mask"].bool().cpu()]
        counts += torch.bincount(ids.clamp(max=vocab_size - 1), minlength=vocab_size)
    return counts


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int
                  ) -> list[list[int]]:
    """The epoch's batches of sample indices: a seeded shuffle, then within windows of
    LENGTH_WINDOW batches the samples sorted by length (little padding), then the batches
    shuffled. The same for every process layout, so any split of them repeats a run."""
    generator = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = torch.randperm(len(lengths), generator=generator, device="cpu").tolist()
    window = batch_size * LENGTH_WINDOW
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    shuffle = torch.randperm(len(batches), generator=generator, device="cpu").tolist()
    return [batches[i] for i in shuffle]


def collate(samples: list[dict]) -> dict[str, Tensor]:
    """Right-pad to the longest sample: input_ids (B, L), loss_mask (B, L), valid (B, L),
    and hidden_state (B, L, H) when stored."""
    length = max(s["input_ids"].shape[0] for s in samples)
    batch = len(samples)
    cpu = torch.device("cpu")  # a batch is assembled on the host whatever the default device
    ids = torch.zeros(batch, length, dtype=torch.long, device=cpu)
    mask = torch.zeros(batch, length, dtype=torch.long, device=cpu)
    valid = torch.zeros(batch, length, dtype=torch.bool, device=cpu)
    hidden = None
    if "hidden_state" in samples[0]:
        h = samples[0]["hidden_state"].shape[-1]
        hidden = torch.zeros(batch, length, h, dtype=samples[0]["hidden_state"].dtype,
                             device=cpu)
    for i, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        ids[i, :n] = s["input_ids"].long()
        mask[i, :n] = s["loss_mask"].long()
        valid[i, :n] = True
        if hidden is not None:
            hidden[i, :n] = s["hidden_state"]
    out = {"input_ids": ids, "loss_mask": mask, "valid": valid}
    if hidden is not None:
        out["hidden_state"] = hidden
    return out


def add_noise(features: Tensor, valid: Tensor, scale: float,
              generator: torch.Generator | None = None) -> Tensor:
    """The released recipe's input noise: (U - 0.5) * scale * 512 / L on real positions,
    L each sample's own length (the released code adds it to one sample at a time; the
    padded batch's length gave a short sample beside a long one less), drawn by
    `generator` on its device (None: the CPU's default generator). A CPU generator
    gives the same noise on every device, but on a GPU its draw is host work (9.4M numbers
    for a batch of 32 x 512 at SmolLM2's width, tens of ms, then a copy); one on the
    features' device draws it there (`--noise-on`)."""
    lengths = valid.sum(1).clamp(min=1).to(features.dtype)  # (B,)
    device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.rand(features.shape, generator=generator, device=device)
    noise = noise.to(features.device) - 0.5
    return features + noise.to(features.dtype) * (scale * 512 / lengths)[:, None, None] \
        * valid[..., None]
