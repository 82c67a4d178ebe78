"""Convert a GGUF model file into a plain Hugging Face directory, once.

transformers dequantises GGUF weights into a stock model, but two things need care:

* A GGUF-loaded model refuses `save_pretrained` (it carries quantizer state), so we copy its
  weights into a fresh model built from the same config and save that.
* For SentencePiece-style vocabularies (`tokenizer.ggml.model == "llama"`: pieces with
  scores, no merge list) whose pieces are BPE merges, transformers may build the wrong
  tokenizer (a Unigram model over the scores, which splits words into short pieces).
  `spm_bpe_tokenizer` rebuilds it from the file's own vocabulary as SentencePiece's BPE does:
  a merge is ranked by the score of the piece it makes; user-defined pieces are matched
  whole; control pieces are special tokens; unknown characters fall back to bytes.

Output is written to a temporary folder and renamed, so a half-written conversion is never
mistaken for a finished one.
"""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

import torch

from gumiho.errors import GumihoError

log = logging.getLogger("gumiho")

# SentencePiece piece types, as GGUF's tokenizer.ggml.token_type stores them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


def read_gguf_vocab(path: Path) -> dict:
    """The tokenizer fields of a GGUF file: tokens, scores, types, special ids, flags."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def get(name, default=None):
        return fields[name].contents() if name in fields else default

    return {"model": get("tokenizer.ggml.model"), "tokens": get("tokenizer.ggml.tokens"),
            "scores": get("tokenizer.ggml.scores"), "types": get("tokenizer.ggml.token_type"),
            "merges": get("tokenizer.ggml.merges"),
            "bos_id": get("tokenizer.ggml.bos_token_id"),
            "eos_id": get("tokenizer.ggml.eos_token_id"),
            "unk_id": get("tokenizer.ggml.unknown_token_id"),
            "pad_id": get("tokenizer.ggml.padding_token_id"),
            "add_bos": bool(get("tokenizer.ggml.add_bos_token", True)),
            "add_space_prefix": bool(get("tokenizer.ggml.add_space_prefix", True)),
            "chat_template": get("tokenizer.chat_template")}


def spm_pieces(vocab: dict) -> list[str]:
    """The pieces as SentencePiece spells them (GGUF stores whitespace-only user-defined
    pieces with plain spaces)."""
    return [SPACE * len(t) if t and not t.strip(" ") else t for t in vocab["tokens"]]


def bpe_merges(pieces: list[str], scores: list[float], types: list[int]) -> list[tuple]:
    """Every (left, right) pair whose concatenation is a normal piece, best first.

    SentencePiece's BPE repeatedly joins the adjacent pair whose joined piece scores highest;
    ranking each merge by its result's score gives a BPE model that makes the same choices."""
    mergeable = {p: i for i, p in enumerate(pieces) if types[i] in (NORMAL, USER_DEFINED)}
    merges = []
    for i, piece in enumerate(pieces):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-scores[i], i, -scores[mergeable[left]], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def spm_bpe_tokenizer(vocab: dict):
    """A fast tokenizer equal to SentencePiece's BPE over a GGUF vocabulary (see module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    pieces, scores, types = spm_pieces(vocab), vocab["scores"], vocab["types"]
    model = BPE(vocab={p: i for i, p in enumerate(pieces)},
                merges=bpe_merges(pieces, scores, types),
                unk_token=pieces[vocab["unk_id"]], byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    steps = [normalizers.Replace(" ", SPACE)]
    if vocab["add_space_prefix"]:
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)]
                                       if vocab["add_space_prefix"] else []))
    # Control pieces are special tokens (never produced from plain text by SentencePiece,
    # but chat templates spell them out); user-defined pieces are always matched whole.
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, t in zip(pieces, types, strict=True) if t == CONTROL])
    tok.add_tokens([AddedToken(p, special=False, normalized=True)
                    for p, t in zip(pieces, types, strict=True) if t == USER_DEFINED])
    bos = pieces[vocab["bos_id"]] if vocab["bos_id"] is not None else None
    if vocab["add_bos"] and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab["bos_id"])])
    names = {"bos_token": "bos_id", "eos_token": "eos_id", "unk_token": "unk_id",
             "pad_token": "pad_id"}
    specials = {name: pieces[vocab[key]] for name, key in names.items()
                if vocab[key] is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   **specials)
    if vocab["chat_template"]:
        fast.chat_template = vocab["chat_template"]
    return fast


def no_space(exc: BaseException) -> bool:
    """Whether `exc` says the disk is full (safetensors' error carries no errno)."""
    return getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or \
        "No space left" in str(exc)


def no_space_error(folder: Path, what: str) -> GumihoError:
    return GumihoError(f"no space left on the disk of {folder} for {what}: free some, or "
                       "point GUMIHO_CACHE at a folder with room")


def convert_gguf(gguf_path: Path, out: Path, storage_dtype: torch.dtype = torch.float32,
                 rebuild_spm_tokenizer: bool = False, eos_token: str | None = None,
                 stop_tokens: tuple[str, ...] = ()) -> None:
    """Dequantise a GGUF model into a plain HF directory `out`, written atomically.

    storage_dtype: the dtype of the saved weights (loading casts them to the compute dtype).
    rebuild_spm_tokenizer: build the tokenizer with `spm_bpe_tokenizer` instead of
    transformers' GGUF converter. eos_token: the token that ends a turn, if the file's
    metadata names another one. stop_tokens: written as generation_config's eos_token_id
    list (every one of them stops generation)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = gguf_path.parent, gguf_path.name
    if rebuild_spm_tokenizer:
        tokenizer = spm_bpe_tokenizer(read_gguf_vocab(gguf_path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file,
                                                      dtype=torch.float32)
    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(**cfg)
    # A plain model with the same weights: GGUF-loaded models refuse save_pretrained.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model.to(storage_dtype)
    if eos_token is not None and eos_token in tokenizer.get_vocab():
        tokenizer.eos_token = eos_token
        tokenizer.pad_token = eos_token
    if stop_tokens:
        vocab = tokenizer.get_vocab()
        model.generation_config.eos_token_id = [vocab[t] for t in stop_tokens]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written copy only takes room
        if no_space(exc):
            size = sum(p.numel() * p.element_size() for p in model.parameters()) >> 20
            raise no_space_error(out.parent, f"the converted model (about {size} MB)") \
                from None
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
