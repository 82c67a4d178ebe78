"""What a training run starts from: a fresh drafter or a checkpoint's (`--init-from`), over
the draft vocabulary it asks for (`--draft-vocab N`: the N most frequent assistant tokens
of the training samples). Also used by the tools that read or export a trained drafter
over another vocabulary (`gumiho.train.accuracy`, `gumiho.export`).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from torch import Tensor

from gumiho.checkpoint import drafter_network, load_drafter_model, recorded_training
from gumiho.config import TrainConfig
from gumiho.drafters import random_drafter_model
from gumiho.errors import GumihoError, nonnegative_int, positive_int
from gumiho.modeling import draft_vocabulary
from gumiho.modeling.vocab import vocab_buffers
from gumiho.train.dataset import online_samples, token_counts


def trainable(model):
    """fp32 master weights in training mode, the frozen embedding copy excepted."""
    model = model.float().train().requires_grad_(True)
    if hasattr(model, "embed_tokens"):
        model.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
    return model


def new_model(target, config: TrainConfig, samples: list[dict] | None = None,
              seed: int | None = None):
    """A fresh trainable drafter (fp32 master weights); a reduced draft vocabulary is
    chosen from the samples' assistant-token counts (stop tokens always included). With
    `heads_only`, only the MLP heads' weights train."""
    if config.init_from:
        model = start_from(target, config, samples)
    else:
        model = trainable(random_drafter_model(
            config.method, target, config.seed if seed is None else seed,
            chosen_vocabulary(target, config.draft_vocab, samples), dtype=torch.float32))
    if config.heads_only:
        model.requires_grad_(False)
        model.mlp.requires_grad_(True)
    return model


def check_draft_vocab(target, size: int) -> int:
    """The target's vocabulary size, once `size` is known to fit in it."""
    return check_draft_vocab_size(size, target.lm_head.weight.shape[0])


def check_draft_vocab_size(size: int, vocab: int, flag: str = "--draft-vocab") -> int:
    """`vocab`, once a draft vocabulary of `size` (given by `flag`) is known to fit in it
    (before loading)."""
    if size > vocab:
        raise GumihoError(f"{flag} {size} is larger than the target's "
                          f"vocabulary ({vocab} tokens): give at most {vocab} (or 0 for all)")
    return vocab


def chosen_vocabulary(target, size: int, samples: list[dict] | None) -> Tensor | None:
    """The target ids (size,) of a draft vocabulary of `size` tokens, the samples' most
    frequent assistant tokens (stop tokens always included); None for the whole vocabulary
    (0, or the target's size)."""
    vocab = check_draft_vocab(target, size)
    if not size or size == vocab:
        return None
    if not samples:
        raise GumihoError("--draft-vocab needs training samples to count tokens in")
    stops = kept_stop_ids(target, vocab, [size], "--draft-vocab")
    return draft_vocabulary(token_counts(samples, vocab), size, stops)


def kept_stop_ids(target, vocab: int, sizes: list[int], flag: str) -> list[int]:
    """The target's stop ids in its vocabulary of `vocab` tokens, which every draft
    vocabulary holds; one line naming `flag` where one of `sizes` (0: the whole
    vocabulary) is too small to hold them."""
    stops = sorted({t for t in target.stop_token_ids if t < vocab})
    if too_small := [s for s in sizes if 0 < s < len(stops)]:
        raise GumihoError(f"{flag} {too_small[0]} cannot hold the target's {len(stops)} stop "
                          f"tokens: give at least {len(stops)} (or 0 for the whole vocabulary)")
    return stops


def start_from(target, config: TrainConfig, samples: list[dict] | None = None):
    """The trainable drafter of checkpoint `config.init_from` (a warm start): its weights,
    and its draft vocabulary unless --draft-vocab names another size (`over_vocabulary`)."""
    # float32 whatever the target's dtype: a bf16 target would round a float16 checkpoint
    model = load_drafter_model(config.init_from, target, config.method, dtype=torch.float32)
    return trainable(over_vocabulary(model, target, config.draft_vocab, samples,
                                     config.init_from))


def over_vocabulary(model, target, size: int, samples: list[dict] | None, source: str):
    """Drafter network `model` (loaded from `source`) over a draft vocabulary of `size`
    tokens (0 or its own size: `model` itself). The serial layers and MLP heads do not
    depend on the vocabulary (their logits are rows of the target's frozen lm_head), so
    another size is chosen from the samples like a fresh drafter's; over the same data a
    larger vocabulary holds every token of the smaller one. Medusa heads with their own
    lm_head rows keep their size."""
    vocab = target.lm_head.weight.shape[0]
    have = model.config.draft_vocab_size or vocab
    if not size or size == have:
        return model
    if model.config.medusa_own_lm_head:
        raise GumihoError(f"--draft-vocab {size}: the drafter {source} has its own lm_head "
                          f"rows for {have} tokens; give --draft-vocab {have} or leave it out")
    draft_ids = chosen_vocabulary(target, size, samples)
    new = replace(model.config, draft_vocab_size=0 if draft_ids is None else draft_ids.shape[0])
    state = {k: v for k, v in model.state_dict().items() if k not in ("d2t", "t2d")}
    if draft_ids is not None:
        state["d2t"], state["t2d"] = vocab_buffers(draft_ids, vocab)
    return drafter_network(new, target, state, draft_ids, dtype=next(model.parameters()).dtype)


def add_vocabulary_args(p: argparse.ArgumentParser, what: str) -> None:
    """--draft-vocab N and the training conversations its tokens are counted in, for the
    tools that put a trained drafter over another vocabulary (`over_vocabulary`)."""
    p.add_argument("--draft-vocab", type=nonnegative_int, default=None, metavar="N",
                   help=f"{what} over a draft vocabulary of N tokens, the training split's "
                   "most frequent (0: the whole vocabulary); default: its own")
    p.add_argument("--conversations", default=None,
                   help="--draft-vocab: the conversations to count tokens in, as training's "
                   "flag (default: the drafter's own training's, else sharegpt)")
    p.add_argument("--template", default=None,
                   help="--draft-vocab: a chat template for a tokenizer without one, as "
                   "training's flag (default: the drafter's own training's)")
    p.add_argument("--num-conversations", type=positive_int, default=None,
                   help="--draft-vocab: training conversations to count tokens in (default: "
                   "the drafter's own online training's, else 17671)")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="--draft-vocab: tokens per counted conversation (default: as "
                   "--num-conversations, else 512)")


def vocabulary_samples(target, args: argparse.Namespace) -> list[dict]:
    """The training samples whose tokens `add_vocabulary_args`' --draft-vocab counts, once
    the size is known to fit (before minutes of tokenizing); none for the whole vocabulary,
    which needs no counting. Unset flags take what the drafter's config.json records of an
    online training, so a larger vocabulary holds every token it trained over."""
    if args.draft_vocab in (0, check_draft_vocab(target, args.draft_vocab)):
        return []
    record = recorded_training(args.draft)
    online = bool(record.get("online"))

    def value(name: str, default):  # the flag, else the online training's, else `default`
        for source in (vars(args), record if online else {}):
            if source.get(name) is not None:
                return source[name]
        return default
    return online_samples(target, value("conversations", TrainConfig.conversations),
                          value("num_conversations", 17671), value("max_len", 512),
                          value("template", None),
                          skip=record.get("skip_conversations", 0) if online else 0,
                          progress=True)  # (the whole split: a minute or more)
