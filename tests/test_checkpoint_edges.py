"""Review of the checkpoint paths (session 66): round trips of every method, dtype and
vocabulary; an official checkpoint (no config.json) or a hand-edited config.json that does
not make a drafter is one line; export --overwrite replaces an earlier export only, and
only once the new one is whole; SGLang's export names the EAGLE class SGLang builds."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gumiho.checkpoint import load_drafter_model, save_drafter, to_official
from gumiho.drafters import random_drafter_model
from gumiho.errors import GumihoError
from gumiho.export import export, main
from gumiho.modeling import DraftHead


def perturbed(target, method, draft_ids=None, **overrides):
    """A random drafter whose every weight is non-trivial (the residual blocks too)."""
    model = random_drafter_model(method, target, 1, draft_ids, **overrides)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed_tokens.weight":
                p.add_(torch.randn(p.shape, generator=g, device="cpu").to(p.device) * 0.05)
    return model


def drafts(model, target):
    """Every draft position's logits of `model` on fixed inputs (teacher-forced)."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden = target.lm_head.weight.shape
    head = DraftHead.for_model(target, model)
    features = torch.randn(1, 8, hidden, generator=g, device="cpu").to(target.device)
    with torch.no_grad():
        if model.config.method == "medusa":
            return {"heads": model.logits(model(features), head)}
        ids = torch.randint(vocab, (1, 8), generator=g, device="cpu").to(target.device)
        out = model(ids, features, torch.ones(1, 8, dtype=torch.bool, device=target.device))
        return {k: head(v) for k, v in out.items()}


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [None, 40])
def test_round_trip_gives_the_same_drafts(tiny_target, tmp_path, method, dtype, vocab):
    ids = None if vocab is None else torch.arange(0, 2 * vocab, 2)
    model = perturbed(tiny_target, method, ids).to(dtype)
    save_drafter(model, tmp_path)
    loaded = load_drafter_model(tmp_path, tiny_target, method, dtype=dtype)
    assert loaded.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    want, got = drafts(model.float(), tiny_target), drafts(loaded.float(), tiny_target)
    assert all(torch.equal(want[k], got[k]) for k in want)


def official(tmp_path, state):
    """An official-layout checkpoint dir (no config.json) holding `state`."""
    tmp_path.mkdir(exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in state.items()},
              str(tmp_path / "model.safetensors"))
    return tmp_path


def test_an_official_checkpoints_bad_d2t_is_one_line(tiny_target, tmp_path):
    """Without config.json the draft vocabulary's size is read off d2t: one longer than the
    target's vocabulary was a ValueError from the config, a 0-d one an IndexError."""
    state = to_official(random_drafter_model("gumiho", tiny_target))
    vocab = tiny_target.lm_head.weight.shape[0]
    t2d = torch.ones(vocab, dtype=torch.bool)
    long = official(tmp_path / "long", {**state, "d2t": torch.zeros(vocab + 3,
                                                                     dtype=torch.long),
                                        "t2d": t2d})
    with pytest.raises(GumihoError, match=f"vocab_size \\({vocab}\\), got {vocab + 3}"):
        load_drafter_model(long, tiny_target)
    scalar = official(tmp_path / "scalar", {**state, "d2t": torch.tensor(3), "t2d": t2d})
    with pytest.raises(GumihoError, match="d2t must be 1-D integer offsets"):
        load_drafter_model(scalar, tiny_target)


def test_an_official_checkpoints_odd_keys_are_one_line(tiny_target, tmp_path):
    """A head of one block (no residual block: num_mlp_layers 0) was a ValueError, a
    `layers.` key without a layer number a ValueError from int()."""
    state = to_official(random_drafter_model("gumiho", tiny_target))
    first_only = {k: v for k, v in state.items()
                  if not k.startswith("mlp.") or ".0.linear." in k}
    with pytest.raises(GumihoError, match="num_mlp_layers must be positive"):
        load_drafter_model(official(tmp_path / "a", first_only), tiny_target)
    odd = {**state, "layers.x.weight": torch.zeros(3)}
    with pytest.raises(GumihoError, match="unexpected key layers.x.weight"):
        load_drafter_model(official(tmp_path / "b", odd), tiny_target)


def test_a_config_whose_heads_do_not_divide_the_width_is_one_line(tiny_target, tmp_path):
    """transformers' own check of the layers' LlamaConfig (a StrictDataclass error, no
    ValueError) was an internal error."""
    save_drafter(random_drafter_model("gumiho", tiny_target), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))
    with pytest.raises(GumihoError, match="not a multiple of the number of attention heads"):
        load_drafter_model(tmp_path, tiny_target)


def test_random_is_no_checkpoint_where_a_tool_reads_one(tmp_path, capsys):
    """export (and the accuracy tool, --init-from) take no random drafter: the line said
    "not a directory (give a checkpoint dir ..., or 'random')"."""
    assert main(["--draft", "random", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: drafter 'random': a random drafter is for generate")
    assert "or 'random'" not in err and not (tmp_path / "o").exists()


def test_a_weights_file_without_floating_tensors_is_one_line(tiny_target_dir, tmp_path,
                                                            capsys):
    """export's default dtype (the stored one) raised StopIteration on such a file."""
    (tmp_path / "d").mkdir()
    save_file({"layers.0.step": torch.zeros(3, dtype=torch.long)},
              str(tmp_path / "d" / "model.safetensors"))
    assert main(["--draft", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                 "--target", tiny_target_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint lacks key") and "internal" not in err
    assert not (tmp_path / "o").exists()


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_keeps_the_earlier_export_when_the_new_one_is_refused(
        tiny_target_dir, tmp_path, capsys):
    """A Medusa drafter has no serial part for --format released: that refusal came after
    --overwrite had removed the earlier export's files, leaving --out empty."""
    from gumiho.target import load_target

    target = load_target(tiny_target_dir, device="cpu", dtype="float32")
    save_drafter(perturbed(target, "medusa"), tmp_path / "medusa")
    out = tmp_path / "out"
    common = ["--draft", str(tmp_path / "medusa"), "--out", str(out), "--target",
              tiny_target_dir]
    assert main(common) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main([*common, "--format", "released", "--overwrite"]) == 2
    assert "Medusa heads have no serial part" in capsys.readouterr().err
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == \
        ["config.json", "model.safetensors"]
    # refused into a new folder: nothing is made, its parents neither
    assert main([*common[:2], "--out", str(tmp_path / "a" / "b"), *common[4:],
                 "--format", "released"]) == 2
    assert not (tmp_path / "a").exists()


def test_overwrite_refuses_a_folder_that_is_no_export(tiny_target_dir, tmp_path, capsys):
    """--out pointed at a model's folder with --overwrite replaced its model.safetensors
    and config.json with the drafter's; a folder holding only a model's config.json and
    weights is refused too."""
    from gumiho.target import load_target

    target = load_target(tiny_target_dir, device="cpu", dtype="float32")
    save_drafter(perturbed(target, "gumiho"), tmp_path / "draft")
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model_dir)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    for folder, words in ((model_dir, "which no export writes"),
                          (bare, "config.json is no exported drafter's")):
        before = snapshot(folder)
        assert main(["--draft", str(tmp_path / "draft"), "--out", str(folder), "--target",
                     tiny_target_dir, "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err and "\n" not in err
        assert snapshot(folder) == before


@pytest.mark.parametrize("first,second", [("gumiho", "released"), ("sglang-eagle", "gumiho"),
                                          ("released", "vllm-eagle")])
def test_overwrite_replaces_an_earlier_export(tiny_target_dir, tmp_path, first, second):
    """Each format over another: what the folder holds is the new export alone (a stale
    model.safetensors or token map would be read), a leftover of an interrupted export
    goes too, and it loads as what was written last."""
    from gumiho.target import load_target

    target = load_target(tiny_target_dir, device="cpu", dtype="float32")
    model = perturbed(target, "gumiho", torch.arange(0, 900, 3))
    save_drafter(model, tmp_path / "draft")
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    common = ["--draft", str(tmp_path / "draft"), "--target", tiny_target_dir]
    assert main([*common, "--out", str(out), "--format", first]) == 0
    (out / ".export-interrupted").mkdir()
    (out / ".export-interrupted" / "model.safetensors").write_bytes(b"half")
    assert main([*common, "--out", str(out), "--format", second, "--overwrite"]) == 0
    assert main([*common, "--out", str(fresh), "--format", second]) == 0
    assert snapshot(out) == snapshot(fresh)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    if second == "gumiho":
        assert load_drafter_model(out, target).config.draft_vocab_size == 300


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle_exports_name_the_class_each_engine_builds(tiny_target, tmp_path, engine):
    """SGLang builds the class config.json names and maps no LlamaForCausalLM to its EAGLE
    drafter (its own EAGLE checkpoints name LlamaForCausalLMEagle): the export named a
    plain Llama, which SGLang would load as a whole language model. vLLM wraps a plain
    Llama config itself (method "eagle")."""
    save_drafter(perturbed(tiny_target, "gumiho"), tmp_path / "draft")
    export(tmp_path / "draft", tiny_target, tmp_path / "out", f"{engine}-eagle")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    want = "LlamaForCausalLM" if engine == "vllm" else "LlamaForCausalLMEagle"
    assert config["architectures"] == [want] and config["model_type"] == "llama"


def test_the_token_map_note_names_the_file_where_it_lies(tiny_target_dir, tmp_path, capsys):
    """The export is written into a staging folder first: its notes name --out's file."""
    from gumiho.target import load_target

    target = load_target(tiny_target_dir, device="cpu", dtype="float32")
    save_drafter(perturbed(target, "gumiho", torch.arange(0, 900, 3)), tmp_path / "draft")
    out = tmp_path / "sg"
    assert main(["--draft", str(tmp_path / "draft"), "--out", str(out), "--target",
                 tiny_target_dir, "--format", "sglang-eagle"]) == 0
    printed = capsys.readouterr().out
    assert f"note: pass --speculative-token-map {out / 'hot_token_map.pt'}\n" in printed
    assert (out / "hot_token_map.pt").is_file()
