"""The official checkpoint layout: key names, shapes, loading, and clear errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from gumiho.checkpoint import check_drafter_files, load_drafter_model, save_drafter, to_official
from gumiho.config import DrafterConfig
from gumiho.drafters import random_drafter_model
from gumiho.errors import GumihoError


def official_keys(h, v, inter, kv_dim):
    """SPEC §2's 80 keys and shapes for a 2-layer / 5-head Gumiho drafter, written out."""
    keys = {"embed_tokens.weight": [v, h], "fc.weight": [h, 2 * h], "fc.bias": [h],
            "layers.1.input_layernorm.weight": [h]}
    for i in (0, 1):
        keys |= {f"layers.{i}.self_attn.q_proj.weight": [h, h],
                 f"layers.{i}.self_attn.k_proj.weight": [kv_dim, h],
                 f"layers.{i}.self_attn.v_proj.weight": [kv_dim, h],
                 f"layers.{i}.self_attn.o_proj.weight": [h, h],
                 f"layers.{i}.mlp.gate_proj.weight": [inter, h],
                 f"layers.{i}.mlp.up_proj.weight": [inter, h],
                 f"layers.{i}.mlp.down_proj.weight": [h, inter],
                 f"layers.{i}.post_attention_layernorm.weight": [h]}
    for i in range(5):
        keys |= {f"mlp.{i}.0.linear.weight": [h, 2 * h], f"mlp.{i}.0.linear.bias": [h]}
        for j in range(1, 6):
            keys |= {f"mlp.{i}.{j}.linear.weight": [h, h], f"mlp.{i}.{j}.linear.bias": [h]}
    return keys


SMOL = official_keys(576, 49152, 1536, 192)  # SmolLM2: H 576, 3 kv heads x 64


def test_official_key_list_has_80_keys():
    assert len(SMOL) == 80


def test_model_keys_and_shapes_match_spec(smollm2):
    model = random_drafter_model("gumiho", smollm2)
    got = {k: list(v.shape) for k, v in to_official(model).items()}
    assert got == SMOL


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_save_load_round_trip(tmp_path, smollm2, method):
    model = random_drafter_model(method, smollm2, seed=3)
    with torch.no_grad():  # make the zero-initialised residual blocks non-trivial
        for p in model.parameters():
            if p.requires_grad or p.dim() > 0:
                p.add_(torch.randn_like(p) * 0.01)
    save_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["method"] == method
    if method == "gumiho":
        assert config["model_type"] == "gumiho"
        assert config["architectures"] == ["GumihoLlamaForCausalLM"]
        assert config["gumiho_fc_bias"] is True and config["num_hidden_layers"] == 2
    loaded = load_drafter_model(tmp_path, smollm2, method)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                              strict=True):
        if k == "embed_tokens.weight":  # left out of the file, taken from the target
            torch.testing.assert_close(b, smollm2.embed_tokens.weight)
        else:
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def write_official(path, keys, seed=0, fmt="safetensors", drop=(), reshape=None):
    """An official-format checkpoint with random weights and no config.json."""
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(*shape, generator=g, device="cpu") * 0.02 for k, shape in keys.items()
             if k not in drop}
    if reshape:
        state[reshape] = torch.zeros(3)
    path.mkdir(exist_ok=True)
    if fmt == "safetensors":
        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return state


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_official_checkpoint_without_config_loads_strictly(tmp_path, smollm2, fmt):
    state = write_official(tmp_path, SMOL, fmt=fmt)
    model = load_drafter_model(tmp_path, smollm2)  # method and shape from keys + target
    assert model.config == DrafterConfig.for_target(smollm2.config, "gumiho")
    back = to_official(model)
    for key, value in state.items():
        torch.testing.assert_close(back[key], value, atol=0, rtol=0)


def test_checkpoint_without_embedding_takes_the_targets(tmp_path, smollm2):
    write_official(tmp_path, SMOL, drop=("embed_tokens.weight",))
    model = load_drafter_model(tmp_path, smollm2)
    torch.testing.assert_close(model.embed_tokens.weight, smollm2.embed_tokens.weight)


@pytest.mark.parametrize("case, message", [
    ({"drop": ("mlp.3.4.linear.bias",)}, "lacks key mlp.3.4.linear.bias"),
    ({"drop": ("layers.1.self_attn.k_proj.weight",)}, "lacks key layers.1.self_attn.k_proj"),
    ({"reshape": "fc.bias"}, "fc.bias has shape [3]"),
])
def test_bad_checkpoint_names_the_first_offending_key(tmp_path, smollm2, case, message):
    write_official(tmp_path, SMOL, **case)
    with pytest.raises(GumihoError, match=message.replace("[", r"\[").replace("]", r"\]")) \
            as err:
        load_drafter_model(tmp_path, smollm2)
    assert "\n" not in str(err.value)


def shipped_copy(tmp_path, method="gumiho"):
    """A copy of a shipped drafter dir, to damage: (dir, its state)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(f"gumiho/assets/smollm2/{method}", tmp_path / method)
    return tmp_path / method, load_file(str(tmp_path / method / "model.safetensors"))


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.__setitem__("mlp.3.1.linear.weight", torch.zeros(3)),
     "mlp.3.1.linear.weight has shape [3], but head 0's has [576, 576]"),
    (lambda s: s["d2t"].__setitem__(-1, 10**6), "d2t's target ids"),
    (lambda s: s.__setitem__("d2t", s["d2t"].float() + 0.7), "d2t must be 1-D integer"),
    (lambda s: s.__setitem__("t2d", s["t2d"].float()), "t2d must be a bool mask"),
    (lambda s: s["t2d"].__setitem__(1, not bool(s["t2d"][1])), "t2d is not True exactly"),
    (lambda s: s.pop("t2d"), "has d2t without t2d"),
    (lambda s: s.__setitem__("fc.weight", torch.tensor(1.0)), "not a matrix"),
])
def test_a_damaged_head_or_vocabulary_is_one_line(tmp_path, smollm2, damage, message):
    """Unequal heads, draft-vocabulary buffers that do not map into the vocabulary (a bad
    id failed deep inside generation): one line naming what is wrong."""
    path, state = shipped_copy(tmp_path)
    damage(state)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(GumihoError) as err:
        load_drafter_model(path, smollm2)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("field, value, message", [
    ("draft_vocab_size", "8192", "draft_vocab_size must be an int"),
    ("draft_vocab_size", -1, "draft_vocab_size must be an int"),
    ("num_hidden_layers", 0, "num_hidden_layers must be at least 1"),
    ("hidden_act", "foo", "hidden_act 'foo'"),
    ("num_mlp_heads", 0, "num_mlp_heads 0"),
])
def test_a_hand_edited_config_is_one_line(tmp_path, smollm2, field, value, message):
    path, _ = shipped_copy(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(GumihoError) as err:
        load_drafter_model(path, smollm2)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_file_that_is_not_a_state_dict_is_one_line(tmp_path, smollm2):
    path, state = shipped_copy(tmp_path)
    (path / "model.safetensors").unlink()
    for wrapped in ({"state_dict": state}, [1, 2], {"fc.weight": 3}):
        torch.save(wrapped, path / "pytorch_model.bin")
        with pytest.raises(GumihoError, match="is not a state dict"):
            load_drafter_model(path, smollm2)


def test_a_missing_medusa_lm_head_is_named_by_its_key(tmp_path, smollm2):
    path, _ = shipped_copy(tmp_path, "medusa")
    config = json.loads((path / "config.json").read_text())
    config["medusa_own_lm_head"] = True
    (path / "config.json").write_text(json.dumps(config))
    layers = config["num_mlp_layers"]
    with pytest.raises(GumihoError, match=rf"lacks key medusa_head\.0\.{layers}\.weight$"):
        load_drafter_model(path, smollm2)


def test_drafter_for_another_target_is_refused(tmp_path, smollm2):
    write_official(tmp_path, official_keys(64, 97, 128, 32))
    with pytest.raises(GumihoError, match="hidden size 64"):
        load_drafter_model(tmp_path, smollm2)


def test_truncated_file_is_a_clear_error(tmp_path, smollm2):
    write_official(tmp_path, SMOL)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(GumihoError, match="cannot read .*model.safetensors"):
        load_drafter_model(tmp_path, smollm2)
    with pytest.raises(GumihoError, match="not a directory"):
        load_drafter_model(tmp_path / "missing", smollm2)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_official_checkpoint_of_another_method_is_named_from_its_keys(tmp_path, smollm2, fmt):
    """Without a config.json the keys say the method: Gumiho's MLP heads, or a serial layer
    alone (EAGLE-2). Asked for another, the dry run's check (keys only: the safetensors
    header, a mapped .bin) and the load refuse in the same one line."""
    write_official(tmp_path / "gumiho", SMOL, fmt=fmt)
    write_official(tmp_path / "eagle2", {k: v for k, v in SMOL.items()
                                          if not k.startswith("mlp.")}, fmt=fmt)
    for folder, asked in (("gumiho", "eagle2"), ("gumiho", "medusa"), ("eagle2", "gumiho")):
        line = f"checkpoint is a {folder} drafter, not {asked}"
        with pytest.raises(GumihoError, match=f"^{line}$"):
            check_drafter_files(tmp_path / folder, asked)
        with pytest.raises(GumihoError, match=f"^{line}$"):
            load_drafter_model(tmp_path / folder, smollm2, asked)
    for folder in ("gumiho", "eagle2"):
        assert check_drafter_files(tmp_path / folder, folder) == tmp_path / folder
        assert load_drafter_model(tmp_path / folder, smollm2, folder).config.method == folder


def test_dry_run_check_reads_an_old_format_bin_whole(tmp_path):
    """torch's pre-1.6 format cannot be mapped: its keys are read from the whole file."""
    torch.save({k: torch.zeros(1) for k in SMOL}, tmp_path / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    assert check_drafter_files(tmp_path, "gumiho") == tmp_path
    with pytest.raises(GumihoError, match="^checkpoint is a gumiho drafter, not eagle2$"):
        check_drafter_files(tmp_path, "eagle2")


def test_dry_run_check_refuses_a_cut_bin(tmp_path):
    write_official(tmp_path, SMOL, fmt="bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(GumihoError, match="cannot read .*pytorch_model.bin: .* complete"):
        check_drafter_files(tmp_path, "gumiho")


def test_a_drafter_trained_for_another_target_of_its_shape_is_noted(tmp_path, smollm2,
                                                                    caplog):
    """It loads (the output stays the target's own) with a warning; a drafter trained for
    this target, or with no record, loads without one. (Gemma-3-270M has another width: the
    record alone is what differs here.)"""
    import logging

    model = random_drafter_model("eagle2", smollm2)
    for name, trained in (("other", "gemma3-270m"), ("same", "smollm2"),
                          ("unrecorded", None)):
        record = {"training": {"method": "eagle2", "target": trained}} if trained else None
        save_drafter(model, tmp_path / name, extra_config=record)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gumiho"):
            load_drafter_model(tmp_path / name, smollm2, "eagle2")
        noted = "was trained for target 'gemma3-270m', not 'smollm2'" in caplog.text
        assert noted == (name == "other"), caplog.text
