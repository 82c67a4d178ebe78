"""Save and load drafters in the official `amd/Gumiho-*` layout.

A Gumiho checkpoint is `model.safetensors` or `pytorch_model.bin` with 80 keys for a
2-layer / 5-head drafter (SPEC §2): `embed_tokens.weight`, `fc.{weight,bias}`,
`layers.{i}.…` (stock Llama decoder-layer names, no `layers.0.input_layernorm`), and
`mlp.{i}.{j}.linear.{weight,bias}` for the MLP heads, plus a `config.json`. Official files
come without a Gumiho config: the shape is then derived from the target and the keys.
`embed_tokens.weight` may be left out (it is a frozen copy of the target's).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from gumiho.config import DrafterConfig
from gumiho.embedded import EMBEDDED
from gumiho.errors import GumihoError
from gumiho.methods import MethodSpec, method_spec, spec_from_keys
from gumiho.modeling import DraftHead, build_draft_model, set_draft_vocabulary
from gumiho.modeling.vocab import vocab_buffers
from gumiho.paths import same_place, write_atomically

log = logging.getLogger("gumiho")

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Unused by every drafter here (layer 0 has no input norm), present in some EAGLE files.
IGNORED_KEYS = ("layers.0.input_layernorm.weight",)
LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def lm_key(spec: MethodSpec) -> re.Pattern:
    """The original Medusa layout: head i's own vocab projection after its R residual
    blocks, `{prefix}.{i}.{R}.weight`."""
    return re.compile(rf"^{re.escape(spec.head_keys)}\.(\d+)\.(\d+)\.weight$")


def to_official(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights under the official key names, on the host (what a checkpoint
    file holds, wherever the model runs)."""
    return {k: v.detach().cpu() for k, v in _official_keys(model).items()}


def _official_keys(model: nn.Module) -> dict[str, Tensor]:
    state = dict(model.state_dict())
    spec = method_spec(model.config.method)
    prefix = spec.head_keys
    if not spec.serial:  # Medusa heads: R residual blocks per head
        out = {}
        for i in range(model.w.shape[0]):
            for j in range(model.w.shape[1]):
                out[f"{prefix}.{i}.{j}.linear.weight"] = model.w[i, j]
                out[f"{prefix}.{i}.{j}.linear.bias"] = model.b[i, j]
            if model.lm_heads is not None:
                out[f"{prefix}.{i}.{model.w.shape[1]}.weight"] = model.lm_heads[i]
        if model.d2t is not None:
            out["d2t"], out["t2d"] = model.d2t, model.t2d
        return out
    for name in ("mlp.w_in", "mlp.b_in", "mlp.w_res", "mlp.b_res"):
        state.pop(name, None)
    if model.mlp is not None:  # Gumiho's heads: the 2H -> H block 0, then residual blocks
        heads = model.mlp
        for i in range(heads.w_in.shape[0]):
            state[f"{prefix}.{i}.0.linear.weight"] = heads.w_in[i]
            state[f"{prefix}.{i}.0.linear.bias"] = heads.b_in[i]
            for j in range(heads.w_res.shape[1]):
                state[f"{prefix}.{i}.{j + 1}.linear.weight"] = heads.w_res[i, j]
                state[f"{prefix}.{i}.{j + 1}.linear.bias"] = heads.b_res[i, j]
    return state


def from_official(state: dict[str, Tensor], config: DrafterConfig) -> dict[str, Tensor]:
    """Official keys -> the model's own (stacked MLP heads); other keys pass through."""
    out, mlp = {}, {}
    spec = method_spec(config.method)
    pattern, own_lm = spec.head_key, None if spec.serial else lm_key(spec)
    for key, value in state.items():
        match = pattern.match(key) if pattern else None
        lm = own_lm.match(key) if own_lm else None
        if match:
            mlp[(int(match[1]), int(match[2]), match[3])] = value
        elif lm:
            mlp[(int(lm[1]), "lm_head", "weight")] = value
        elif key in IGNORED_KEYS:
            continue
        else:
            out[key] = value
    if not mlp:
        return out
    heads, layers = config.num_mlp_heads, config.num_mlp_layers
    if heads == 0:
        raise GumihoError(f"unexpected key {_mlp_name(config, next(iter(mlp)))} in checkpoint "
                          "(its config.json says num_mlp_heads 0)")

    def stack(j, kind):
        try:
            parts = [mlp.pop((i, j, kind)) for i in range(heads)]
        except KeyError as missing:
            raise GumihoError(f"checkpoint lacks key {_mlp_name(config, missing.args[0])}") \
                from None
        for i, part in enumerate(parts):
            if part.shape != parts[0].shape:
                raise GumihoError(f"checkpoint key {_mlp_name(config, (i, j, kind))} has shape "
                                  f"{list(part.shape)}, but head 0's has "
                                  f"{list(parts[0].shape)}")
        return torch.stack(parts)

    if not spec.serial:
        out["w"] = torch.stack([stack(j, "weight") for j in range(layers)], 1)
        out["b"] = torch.stack([stack(j, "bias") for j in range(layers)], 1)
        if config.medusa_own_lm_head:
            out["lm_heads"] = stack("lm_head", "weight")
    else:
        out["mlp.w_in"], out["mlp.b_in"] = stack(0, "weight"), stack(0, "bias")
        out["mlp.w_res"] = torch.stack([stack(j, "weight") for j in range(1, layers + 1)], 1)
        out["mlp.b_res"] = torch.stack([stack(j, "bias") for j in range(1, layers + 1)], 1)
    if mlp:
        raise GumihoError(f"unexpected key {_mlp_name(config, next(iter(mlp)))} in checkpoint")
    return out


def _mlp_name(config: DrafterConfig, key: tuple) -> str:
    i, j, kind = key
    prefix = method_spec(config.method).head_keys
    if j == "lm_head":  # the original Medusa's own projection, after its blocks
        return f"{prefix}.{i}.{config.num_mlp_layers}.weight"
    return f"{prefix}.{i}.{j}.linear.{kind}"


def save_drafter(model: nn.Module, out_dir: str | Path, include_embed: bool = False,
                 dtype: torch.dtype | None = None, extra_config: dict | None = None) -> Path:
    """Write model.safetensors + config.json; by default without the frozen embedding."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = to_official(model)
    if not include_embed:
        state.pop("embed_tokens.weight", None)
    state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach()
             .contiguous().cpu() for k, v in state.items()}
    write_atomically(out / "model.safetensors",
                     lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    text = json.dumps({**model.config.to_json(), **(extra_config or {})}, indent=2) + "\n"
    write_atomically(out / "config.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out


def saved_config(path: Path) -> dict | None:
    """A drafter dir's config.json (None without one), or one line saying it is broken."""
    if not (path / "config.json").exists():
        return None
    try:
        saved = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GumihoError(f"drafter config {path / 'config.json'} is not valid JSON "
                          f"({type(exc).__name__}): fix it, or delete it to derive the "
                          "shape from the target") from None
    if not isinstance(saved, dict):
        raise GumihoError(f"drafter config {path / 'config.json'} is not a JSON object: "
                          "fix it, or delete it to derive the shape from the target")
    return saved


def check_drafter_files(path: str | Path, method: str | None = None) -> Path:
    """What can be told of a drafter dir without reading its weights (a dry run): a dir,
    a weights file (a safetensors one whose header covers the file: not cut short), and
    config.json's method, where it names one, `method`."""
    path = check_drafter_dir(path)
    saved = saved_config(path)
    check_method(saved, method)
    file = weights_file(path)
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), "pt") as weights:
                keys = list(weights.keys())
        else:
            keys = list(bin_keys(file))
    except Exception as exc:  # noqa: BLE001 - any header failure means a broken file
        raise GumihoError(f"cannot read {file}: {type(exc).__name__} (is it complete?)") \
            from None
    if not (saved and saved.get("method")):
        check_keys_method(keys, method)
    return path


def bin_keys(file: Path) -> dict:
    """A pytorch_model.bin's state mapped, not read, where its format allows (torch's
    zip format, since 1.6): the keys are what is wanted; an older file is read whole."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(file, map_location="cpu", weights_only=True)


def check_keys_method(keys, method: str | None) -> None:
    """One line if a checkpoint without a method in its config.json (an official one) holds
    another method's keys than the one asked for: Medusa's heads, Gumiho's MLP heads, or
    a serial layer alone (EAGLE-2)."""
    if method:
        check_method({"method": spec_from_keys(keys).name}, method)


def training_record(saved: dict | None) -> dict:
    """What a drafter's config.json records of its training (gumiho.train's settings,
    TrainConfig's fields), {} for a drafter trained elsewhere (an official checkpoint)."""
    return (saved or {}).get("training") or {}


def recorded_training(path: str | Path) -> dict:
    """`training_record` of drafter dir `path`, {} where it is no dir."""
    return training_record(saved_config(Path(path)) if Path(path).is_dir() else None)


def trained_target(path: str | Path, given: str | None) -> str:
    """The target a tool reading drafter `path` uses: `given` (--target), else the one its
    config.json says it was trained for, else the embedded SmolLM2. A target of another
    shape is refused at the load; one of the same shape would pass unnoticed (an export
    would take its embedding)."""
    if given is not None:
        return given
    trained = recorded_training(path).get("target")
    return trained if isinstance(trained, str) and trained else "smollm2"


def check_method(saved: dict | None, method: str | None) -> None:
    """One line if config.json names another method than the one asked for."""
    if method and saved and saved.get("method") and saved["method"] != method:
        raise GumihoError(f"checkpoint is a {saved['method']} drafter, not {method}")


def weights_file(path: Path) -> Path:
    """A drafter dir's weights: the first of WEIGHT_FILES there, or one line."""
    for name in WEIGHT_FILES:
        if (path / name).exists():
            return path / name
    raise GumihoError(f"{path}: no {' or '.join(WEIGHT_FILES)} found")


def read_state(path: Path) -> dict[str, Tensor]:
    file = weights_file(path)
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any decode failure means a broken file
        raise GumihoError(f"cannot read {file}: {type(exc).__name__} (is it complete?)") \
            from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise GumihoError(f"{file} is not a state dict (names -> tensors): save "
                          "model.state_dict() itself, not a dict or list around it")
    return state


def infer_config(state: dict[str, Tensor], target_config, method: str | None,
                 saved: dict | None) -> DrafterConfig:
    """The drafter config: config.json's Gumiho fields if present, else derived from the
    target config and the checkpoint's keys (official checkpoints)."""
    if saved and saved.get("method"):
        check_method(saved, method)
        try:
            return DrafterConfig.from_json(saved)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise GumihoError(f"drafter config.json does not describe a drafter "
                              f"({type(exc).__name__}: {exc}): fix it, or delete it to "
                              "derive the shape from the target") from None
    check_keys_method(state, method)
    spec = method_spec(method) if method else spec_from_keys(state)
    # a key that is no layer's (`layers.x.…`) is named as unexpected by the strict load
    layers = {int(m[1]) for k in state if (m := LAYER_KEY.match(k))}
    matches = [m for k in state if spec.head_key and (m := spec.head_key.match(k))]
    heads = {int(m[1]) for m in matches}
    blocks = {int(m[2]) for m in matches}
    overrides = {}
    if spec.serial:
        overrides["num_hidden_layers"] = len(layers) or 1
    if heads:  # Gumiho's heads start with the 2H -> H block, Medusa's are all residual
        overrides["num_mlp_heads"] = len(heads)
        overrides["num_mlp_layers"] = len(blocks) - (1 if spec.serial else 0)
    if not spec.serial:
        overrides["medusa_own_lm_head"] = any(lm_key(spec).match(k) for k in state)
    d2t = state.get("d2t")
    if d2t is not None and d2t.dim() == 1:  # a reduced draft vocabulary (EAGLE-3 convention;
        overrides["draft_vocab_size"] = d2t.shape[0]  # another shape: check_draft_vocabulary)
    try:
        return DrafterConfig.for_target(target_config, spec.name, **overrides)
    except (TypeError, ValueError) as exc:  # e.g. a d2t longer than the target's vocabulary
        raise GumihoError(f"the checkpoint's keys (no Gumiho config.json) make no "
                          f"{spec.name} drafter for this target: {exc}") from None


def another_target(a: str, b: str) -> bool:
    """Whether two target names surely differ: two aliases, or two paths, that are not one
    (an alias against a path would need the alias's model converted to tell: not known)."""
    if (a in EMBEDDED) != (b in EMBEDDED):
        return False
    return not same_place(a, b)


def check_drafter_dir(path: str | Path) -> Path:
    """The drafter checkpoint dir, or one line saying it is not one (before slow loads)."""
    path = Path(path)
    if str(path) == "random" and not path.exists():  # generate's --draft random, not here
        raise GumihoError("drafter 'random': a random drafter is for generate and "
                          "gen_answers only; this reads a checkpoint dir (model.safetensors "
                          "or pytorch_model.bin)")
    if not path.is_dir():
        raise GumihoError(f"drafter {str(path)!r}: not a directory (give a checkpoint dir "
                          "with model.safetensors or pytorch_model.bin, or 'random')")
    return path


def load_drafter_model(path: str | Path, target, method: str | None = None,
                       dtype: torch.dtype | None = None) -> nn.Module:
    """Load a drafter checkpoint dir for `target`; strict about keys and shapes. dtype:
    its weights' (default the target's; training, export and the accuracy tool ask for
    float32, so a 16-bit checkpoint is read exactly whatever the target's dtype)."""
    path = check_drafter_dir(path)
    state = read_state(path)
    saved = saved_config(path)
    fc = state.get("fc.weight", state.get("medusa_head.0.0.linear.weight"))
    if fc is not None and fc.dim() != 2:
        raise GumihoError(f"drafter {path}: its first projection has shape {list(fc.shape)}, "
                          "not a matrix's")
    if fc is not None and fc.shape[0] != target.hidden_size:
        raise GumihoError(f"drafter {path} is for hidden size {fc.shape[0]}, but target "
                          f"{target.name} has {target.hidden_size}: use a drafter trained "
                          "for this target")
    config = infer_config(state, target.config, method, saved)
    check_layer_config(config, path)
    trained = training_record(saved).get("target")
    if isinstance(trained, str) and another_target(trained, target.name):
        log.warning("drafter %s was trained for target %r, not %r: the shapes agree, so it "
                    "drafts, and the output stays the target's own, but fewer drafts may be "
                    "accepted", path, trained, target.name)
    vocab = target.lm_head.weight.shape[0]
    if config.hidden_size != target.hidden_size or config.vocab_size != vocab:
        raise GumihoError(
            f"drafter {path} is for hidden size {config.hidden_size} / vocab "
            f"{config.vocab_size}, but target {target.name} has {target.hidden_size} / "
            f"{vocab}: use a drafter trained for this target")
    check_draft_vocabulary(state, vocab, path)
    try:
        return drafter_network(config, target, from_official(state, config), dtype=dtype)
    except KeyError as exc:  # a config field the layers' constructors look up, e.g. RoPE's
        raise GumihoError(f"drafter {path}: its config.json does not describe its layers "
                          f"({exc.args[0] if exc.args else exc})") from None


def check_layer_config(config: DrafterConfig, path) -> None:
    """One line where transformers refuses the serial layers' LlamaConfig of a hand-edited
    config.json (e.g. a hidden size its heads do not divide), before any layer is built."""
    if not method_spec(config.method).serial:
        return
    try:
        config.llama_config()
    except Exception as exc:  # noqa: BLE001 - its validators raise their own error types
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        lines = [line.strip() for line in str(text).splitlines() if line.strip()]
        raise GumihoError(f"drafter {path}: its config.json does not describe its layers "
                          f"({lines[-1] if lines else type(exc).__name__})") from None


def check_draft_vocabulary(state: dict[str, Tensor], vocab: int, path) -> None:
    """A reduced draft vocabulary's buffers (EAGLE-3's convention): d2t integer offsets
    whose target ids, draft id + offset, are distinct ids of the vocabulary, and t2d the
    bool mask that is True exactly at those ids. One line otherwise (a bad id would fail
    deep inside generation)."""
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is None and t2d is None:
        return
    if d2t is None or t2d is None:
        raise GumihoError(f"drafter {path}: has {'t2d' if d2t is None else 'd2t'} without "
                          f"{'d2t' if d2t is None else 't2d'} (a draft vocabulary needs both)")
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise GumihoError(f"drafter {path}: d2t must be 1-D integer offsets, got "
                          f"{d2t.dtype} of shape {list(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab,):
        raise GumihoError(f"drafter {path}: t2d must be a bool mask over the target's "
                          f"{vocab} tokens, got {t2d.dtype} of shape {list(t2d.shape)}")
    ids = torch.arange(d2t.shape[0]) + d2t.long().cpu()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab
                     or ids.unique().shape[0] != ids.shape[0]):
        raise GumihoError(f"drafter {path}: d2t's target ids (draft id + offset) must be "
                          f"distinct ids inside 0..{vocab - 1}")
    if not torch.equal(vocab_buffers(ids, vocab)[1], t2d.cpu()):
        raise GumihoError(f"drafter {path}: t2d is not True exactly at d2t's target ids")


def drafter_network(config: DrafterConfig, target, state: dict[str, Tensor] | None = None,
                    draft_ids: Tensor | None = None, dtype: torch.dtype | None = None
                    ) -> nn.Module:
    """The drafter network of `config` for `target`, frozen, on the target's device and
    `dtype` (default the target's: a bf16 target would round a float16 checkpoint's
    weights, so training asks for float32): the weights of `state` (the model's own key
    names, checked strictly), else the fresh ones the current seed gives, with the draft
    vocabulary `draft_ids` (target ids, modeling/vocab.py). The frozen parts a state leaves
    out come from the target: the embedding (any scale included) and the start of Medusa's
    own lm heads."""
    with torch.device(target.device):  # not whatever default device the caller has set
        model = build_draft_model(config)
    if draft_ids is not None:
        set_draft_vocabulary(model, draft_ids)
    own = dict(state or {})
    if "embed_tokens.weight" in model.state_dict() and "embed_tokens.weight" not in own:
        model.embed_tokens.weight.data.copy_(target.input_embeddings())
        own["embed_tokens.weight"] = model.embed_tokens.weight
    if state is not None:
        check_keys(model.state_dict(), own, config)
        model.load_state_dict(own, strict=True)
    if not method_spec(config.method).serial and "lm_heads" not in own:
        model.init_lm_heads(DraftHead.for_model(target, model))  # no-op without own heads
    return model.to(device=target.device, dtype=dtype or target.dtype).eval() \
        .requires_grad_(False)


def check_keys(expected: dict[str, Tensor], got: dict[str, Tensor], config) -> None:
    """One line naming the first missing, unexpected or mis-shaped key."""
    to_name = {"mlp.w_in": "mlp.{i}.0.linear.weight", "mlp.b_in": "mlp.{i}.0.linear.bias",
               "mlp.w_res": "mlp.{i}.{j}.linear.weight", "mlp.b_res": "mlp.{i}.{j}.linear.bias",
               "w": "medusa_head.{i}.{j}.linear.weight", "b": "medusa_head.{i}.{j}.linear.bias"}
    for key, tensor in expected.items():
        if key not in got:
            raise GumihoError(f"checkpoint lacks key {to_name.get(key, key)}")
        if tuple(got[key].shape) != tuple(tensor.shape):
            raise GumihoError(f"checkpoint key {to_name.get(key, key)} has shape "
                              f"{list(got[key].shape)}, expected {list(tensor.shape)} "
                              f"for this target")
    for key in got:
        if key not in expected:
            raise GumihoError(f"unexpected key {key} in checkpoint (not a {config.method} "
                              "drafter for this target?)")
