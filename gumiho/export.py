"""Export a drafter for other consumers: `python -m gumiho.export --draft DIR --out OUT
--format F [--target T] [--dtype D]` (README "Checkpoints" lists what each one reads).

* `gumiho` (default): `model.safetensors` + `config.json` in the official key layout,
  without the frozen embedding; a reduced vocabulary as EAGLE-3's `d2t`/`t2d` buffers.
  Read by gumiho itself and by vLLM's Gumiho model (`GumihoLlamaForCausalLM`).
* `released`: what the released Gumiho code (and its EAGLE-2 ancestor, for one-layer
  drafters) loads as is: `pytorch_model.bin` only, embedding included, exactly the key set
  of its strict `load_state_dict`, no vocabulary buffers; the same `config.json`.
* `vllm-eagle`: the serial part as vLLM's EAGLE drafter (`--speculative-config` method
  "eagle", `EagleLlamaForCausalLM`). vLLM builds its `fc` without a bias, so the bias is
  folded exactly into layer 0's attention biases (`attention_bias: true`).
* `sglang-eagle`: the serial part as SGLang's EAGLE drafter (`LlamaForCausalLMEagle`, whose
  `fc` has a bias; config.json names that class, which SGLang builds); a reduced
  vocabulary becomes `hot_token_map.pt` for `--speculative-token-map`.
* `vllm-eagle3`, `sglang-eagle3`: refused. EAGLE-3's first layer normalises the token
  embedding and the feature separately and attends over both (2H -> q, k, v) with the
  feature alone on the residual; ours fuses them with `fc` first. No weight mapping
  computes our network there.

Both EAGLE exports leave out the embedding and the lm_head (the engines share the
target's, so a scaled embedding, e.g. Gemma's sqrt(H), is folded into `fc`) and the MLP
heads (the engines run the serial head as a chain).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from gumiho.checkpoint import (
    load_drafter_model,
    read_state,
    save_drafter,
    to_official,
    trained_target,
)
from gumiho.config import DrafterConfig
from gumiho.errors import ArgumentParser, GumihoError, cli_errors
from gumiho.methods import DRAFTER_METHODS, method_spec

FORMATS = ("gumiho", "released", "vllm-eagle", "sglang-eagle", "vllm-eagle3",
           "sglang-eagle3")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TRAINING_RECORD = ("training", "trained_steps")  # config.json keys gumiho.train adds
RELEASED_MLP_BLOCKS = 5  # the released ParallelMLPs: one 2H -> H block, then 5 residual
EAGLE3_REFUSAL = (
    "{fmt}: our drafters are not EAGLE-3 networks (EAGLE-3's first layer normalises the "
    "token embedding and the feature separately and attends over both, ours fuses them "
    "with fc first), so no EAGLE-3 checkpoint computes them: use --format vllm-eagle "
    "(vLLM method 'eagle') or --format sglang-eagle")


def export(draft: str | Path, target, out: str | Path, fmt: str = "gumiho",
           method: str | None = None, dtype: torch.dtype | None = None,
           draft_vocab: int | None = None, samples: list[dict] | None = None) -> list[str]:
    """Write drafter checkpoint `draft` (for `target`) to `out` as `fmt`; returns notes on
    what the consumer will do differently from gumiho (empty when nothing). `draft_vocab`
    (0: the whole vocabulary) re-chooses the draft vocabulary from `samples`' assistant
    tokens, keeping the network: its logits are rows of the target's lm_head."""
    from gumiho.train.start import over_vocabulary

    if fmt not in FORMATS:
        raise GumihoError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    if fmt.endswith("eagle3"):
        raise GumihoError(EAGLE3_REFUSAL.format(fmt=fmt))
    dtype = dtype or stored_dtype(Path(draft))
    model = load_drafter_model(draft, target, method, dtype=torch.float32)
    if draft_vocab is not None:
        model = over_vocabulary(model, target, draft_vocab or target.lm_head.weight.shape[0],
                                samples, str(draft))
    out = Path(out)
    if fmt == "gumiho":
        save_drafter(model, out, dtype=dtype)
        notes = []
    elif not method_spec(model.config.method).serial:
        raise GumihoError(f"--format {fmt} takes gumiho or eagle2 drafters: Medusa heads have "
                          "no serial part for these loaders")
    elif fmt == "released":
        notes = write_released(model, out, dtype)
    else:
        notes = write_eagle(model, target, out, dtype, engine=fmt.split("-")[0])
    keep_training_record(Path(draft), out)
    return notes


def keep_training_record(draft: Path, out: Path) -> None:
    """The export's config.json keeps what `draft`'s says of its training (the run's
    settings and steps, written by gumiho.train), so an exported drafter still tells how
    it was made; loaders ignore these keys. Its `draft_vocab_size` is the export's own,
    the record's `draft_vocab` the one it trained over."""
    try:
        saved = json.loads((draft / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # an official checkpoint without one: nothing to keep
    record = {k: saved[k] for k in TRAINING_RECORD if isinstance(saved, dict) and k in saved}
    if record:
        config = out / "config.json"
        written = json.loads(config.read_text(encoding="utf-8"))
        config.write_text(json.dumps({**written, **record}, indent=2) + "\n",
                          encoding="utf-8")


def stored_dtype(path: Path) -> torch.dtype:
    """The floating dtype the checkpoint was saved in (float32 where it holds no floating
    tensor: the load then names what it lacks)."""
    return next((v.dtype for v in read_state(path).values() if v.is_floating_point()),
                torch.float32)


def full_vocabulary_notes(config: DrafterConfig, how: str) -> list[str]:
    if not config.draft_vocab_size or config.draft_vocab_size >= config.vocab_size:
        return []
    return [f"this drafter scores a {config.draft_vocab_size}-token draft vocabulary; {how}"]


# ---- the released code --------------------------------------------------------------

def released_state(model: nn.Module) -> dict[str, Tensor]:
    """Exactly the released `Model`'s state-dict keys (its loader renames `mlp.` to
    `mlp.mlp.` and loads strictly): the official keys with the embedding, nothing else."""
    config = model.config
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        raise GumihoError(f"--format released: the released code takes head_dim = "
                          f"hidden_size / heads, this target has {config.head_dim} x "
                          f"{config.num_attention_heads} heads for {config.hidden_size}")
    if model.mlp is not None and config.num_mlp_layers != RELEASED_MLP_BLOCKS:
        raise GumihoError(f"--format released: the released code builds "
                          f"{RELEASED_MLP_BLOCKS} residual blocks per MLP head, this drafter "
                          f"has {config.num_mlp_layers}")
    state = to_official(model)
    for buffer in ("d2t", "t2d"):  # no vocabulary buffers in the released model
        state.pop(buffer, None)
    return state


def released_config(config: DrafterConfig, dtype: torch.dtype) -> dict:
    """config.json for the released loaders and vLLM's Gumiho model. The released code
    builds its Llama layers from these fields (rope_scaling by its old `type` key) and its
    fc with a bias unless a `bias` key says otherwise; vLLM would read `bias` as attention
    biases, so there is none."""
    full = DrafterConfig.from_json({**config.to_json(), "draft_vocab_size": 0})
    data = full.to_json()
    if data["rope_scaling"]:
        data["rope_scaling"] = {"type": data["rope_scaling"].get("rope_type"),
                                **data["rope_scaling"]}
    data.update(pretraining_tp=1, tie_word_embeddings=False, use_cache=True,
                torch_dtype=str(dtype).removeprefix("torch."))
    return data


def write_released(model: nn.Module, out: Path, dtype: torch.dtype) -> list[str]:
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in
             released_state(model).items()}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(
        json.dumps(released_config(model.config, dtype), indent=2) + "\n", encoding="utf-8")
    return full_vocabulary_notes(model.config, "the released code has no draft vocabulary "
                                 "and scores the target's whole vocabulary")


# ---- EAGLE drafters of vLLM and SGLang ----------------------------------------------

def embedding_scale(model: nn.Module, target) -> float:
    """s with drafter embedding = s x the target's stored embedding rows (1 for Llama; the
    engines share the stored rows, so s is folded into fc)."""
    ours = model.embed_tokens.weight.detach().double()
    raw = target.embed_tokens.weight.detach().double().to(ours.device)
    if raw.shape != ours.shape:
        raise GumihoError(f"the drafter's embedding is {list(ours.shape)}, the target's "
                          f"{list(raw.shape)}: export for the target it was trained on")
    scale = float((ours * raw).sum() / (raw * raw).sum())
    error = float((ours - scale * raw).norm() / ours.norm().clamp(min=1e-12))
    if error > 1e-3:
        raise GumihoError("the drafter's embedding is not a scaled copy of the target's: "
                          "an EAGLE engine would feed it the target's own; export for the "
                          "target it was trained on")
    return 1.0 if abs(scale - 1) < 1e-6 else scale


def eagle_state(model: nn.Module, scale: float, fold_fc_bias: bool) -> dict[str, Tensor]:
    """The serial layers and fc in the EAGLE Llama layout, float64 for the folding.
    fold_fc_bias: x = W cat(e, f) + b feeds layer 0's attention and the residual, so
    q/k/v get W_{q,k,v} b as biases and o_proj gets b (on the residual after attention);
    the later layers get zero biases. Exact, since layer 0 has no input norm."""
    hidden = model.config.hidden_size
    state = {k: v.detach().double() for k, v in to_official(model).items()
             if k.startswith("layers.")}
    weight = model.fc.weight.detach().double().clone()
    weight[:, :hidden] *= scale  # the engines embed with the target's stored rows
    bias = model.fc.bias.detach().double()
    state["fc.weight"] = weight
    if not fold_fc_bias:
        state["fc.bias"] = bias
        return state
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(attn, name).weight.detach().double()
            state[f"layers.{i}.self_attn.{name}.bias"] = proj @ bias if i == 0 else \
                proj.new_zeros(proj.shape[0])
        state[f"layers.{i}.self_attn.o_proj.bias"] = bias if i == 0 else \
            bias.new_zeros(hidden)
    return state


def eagle_config(config: DrafterConfig, dtype: torch.dtype, engine: str) -> dict:
    """A Llama config of the serial layers. vLLM wraps a plain one as its EAGLE drafter
    (method "eagle": LlamaForCausalLM -> EagleLlamaForCausalLM, its fc without a bias, so
    the fold's attention biases); SGLang builds the class the config names and maps no
    LlamaForCausalLM to its EAGLE one, so that one is named (`LlamaForCausalLMEagle`, as
    its own EAGLE checkpoints do; a plain Llama would load as a whole language model)."""
    attention_bias = engine == "vllm"
    data = config.to_json()
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
            "max_position_embeddings", "hidden_act", "rope_theta", "rope_scaling",
            "rope_parameters")
    architecture = "LlamaForCausalLM" if engine == "vllm" else "LlamaForCausalLMEagle"
    out = {"architectures": [architecture], "model_type": "llama",
           **{k: data[k] for k in keep}, "attention_bias": attention_bias,
           "mlp_bias": False, "tie_word_embeddings": False,
           "torch_dtype": str(dtype).removeprefix("torch.")}
    out["gumiho_export"] = {"method": config.method, "serial_layers": config.num_hidden_layers,
                            "mlp_heads_left_out": config.num_mlp_heads
                            if method_spec(config.method).parallel_heads else 0}
    return out


def write_eagle(model: nn.Module, target, out: Path, dtype: torch.dtype, engine: str
                ) -> list[str]:
    from safetensors.torch import save_file

    from gumiho.modeling.vocab import draft_ids_of

    config = model.config
    fold = engine == "vllm"
    state = {k: v.to(dtype).contiguous().cpu()
             for k, v in eagle_state(model, embedding_scale(model, target), fold).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(eagle_config(config, dtype, engine), indent=2)
                                     + "\n", encoding="utf-8")
    notes = []
    if method_spec(config.method).parallel_heads:
        notes.append(f"the {config.num_mlp_heads} MLP heads are left out: the engine runs the "
                     "serial head for every draft position (it was trained for 2)")
    ids = draft_ids_of(model)
    if engine == "sglang" and ids is not None:
        torch.save(ids.cpu().tolist(), out / "hot_token_map.pt")
        notes.append(f"pass --speculative-token-map {out / 'hot_token_map.pt'}")
    elif engine == "vllm":
        notes += full_vocabulary_notes(config, "vLLM's EAGLE drafter scores the target's "
                                       "whole vocabulary")
    return notes


# every file an export may write: --overwrite replaces them all
EXPORTED_FILES = ("model.safetensors", "pytorch_model.bin", "config.json", "hot_token_map.pt")
STAGE = ".export-"  # the folder an export is written into before it replaces --out's files


def check_replaceable(out: Path) -> None:
    """--overwrite replaces an earlier export, nothing else: one line where `out` holds a
    file no export writes (a model's folder, a training run's output) or a config.json
    that is no drafter's, so a mistyped --out is left as it was."""
    others = sorted(p.name for p in out.iterdir()
                    if p.name not in EXPORTED_FILES and not p.name.startswith(STAGE))
    if others:
        raise GumihoError(f"--out {out} holds {others[0]}, which no export writes: "
                          "--overwrite replaces an earlier export only; give a new directory")
    if (out / "config.json").exists():
        try:
            config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = None
        if not (isinstance(config, dict) and (config.get("method") in DRAFTER_METHODS
                                              or "gumiho_export" in config)):
            raise GumihoError(f"--out {out}: its config.json is no exported drafter's: "
                              "--overwrite replaces an earlier export only; give a new "
                              "directory")


@contextmanager
def staged(out: Path):
    """A fresh folder to export into; once the export is whole its files become `out`'s
    (a new `out` is the folder itself, renamed; in an existing one they replace an earlier
    export's, whose other files go), so an export that fails, is refused late or is
    interrupted leaves `out` as it was."""
    created = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    new = bool(created)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGE}" if new else STAGE,
                                  dir=out.parent if new else out))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in created[1:]:  # the parents made for it, while empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    if new:
        os.replace(stage, out)
        return
    written = {p.name for p in stage.iterdir()}
    for name in EXPORTED_FILES:  # an earlier export's other files would be read first
        if name not in written:
            (out / name).unlink(missing_ok=True)
    for name in written:
        os.replace(stage / name, out / name)
    for leftover in out.iterdir():  # this one's, and any an interrupted export left
        if leftover.name.startswith(STAGE) and leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    from gumiho.train.start import add_vocabulary_args

    p = ArgumentParser(prog="python -m gumiho.export",
                                description=__doc__.split("\n")[0])
    p.add_argument("--draft", required=True, help="a drafter checkpoint dir")
    p.add_argument("--out", required=True, help="the dir to write")
    p.add_argument("--format", default="gumiho", choices=FORMATS)
    p.add_argument("--target", default=None, help="the drafter's target, a dir or an alias "
                   "(default: the one its config.json names, else smollm2)")
    p.add_argument("--method", choices=DRAFTER_METHODS, default=None)
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default: the dtype the checkpoint was saved in")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (its files are replaced once "
                   "the new export is whole; a folder holding anything else is refused)")
    add_vocabulary_args(p, "the network")
    return p


@cli_errors
def main(argv: list[str] | None = None) -> int:
    from gumiho.target import load_target

    args = build_parser().parse_args(argv)
    if args.format.endswith("eagle3"):  # refused before loading anything
        raise GumihoError(EAGLE3_REFUSAL.format(fmt=args.format))
    from gumiho.paths import check_writable_dir

    out = Path(args.out)
    if out.resolve() == Path(args.draft).resolve():
        raise GumihoError("--out is the --draft dir: give another directory")
    check_writable_dir(out, "--out")
    if out.is_dir() and any(out.iterdir()):
        if not args.overwrite:
            raise GumihoError(f"--out {out} is not empty: give a new directory (or "
                              "--overwrite to replace an earlier export there)")
        check_replaceable(out)
    from gumiho.checkpoint import check_drafter_dir, weights_file
    from gumiho.train.start import vocabulary_samples

    weights_file(check_drafter_dir(args.draft))  # before the target's load
    target = load_target(trained_target(args.draft, args.target), device="cpu",
                         dtype="float32")
    samples = None if args.draft_vocab is None else vocabulary_samples(target, args)
    with staged(out) as stage:
        notes = export(args.draft, target, stage, args.format, args.method,
                       DTYPES.get(args.dtype), args.draft_vocab, samples)
    notes = [note.replace(str(stage), str(out)) for note in notes]  # files named where they are
    files = ", ".join(sorted(p.name for p in Path(args.out).iterdir()))
    over = ("" if args.draft_vocab is None else
            f", over {args.draft_vocab or target.lm_head.weight.shape[0]} draft tokens")
    print(f"wrote {args.out} ({args.format}{over}): {files}")
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
