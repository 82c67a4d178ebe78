"""Exports for other consumers, checked against each consumer's loading rules: the released
code's `pytorch_model.bin`, vLLM's and SGLang's EAGLE drafters (their forward rebuilt from
stock HF layers), EAGLE-3's vocabulary buffers, and the EAGLE-3 refusal."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from gumiho.checkpoint import load_drafter_model, save_drafter
from gumiho.drafters import random_drafter_model
from gumiho.export import export, main


def perturbed_drafter(target, method, seed=0, draft_ids=None, embed_scale=1.0):
    """A random drafter with every weight non-trivial (norms, biases, residual blocks)."""
    model = random_drafter_model(method, target, seed, draft_ids).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed_tokens.weight":
                p.add_(torch.randn(p.shape, generator=g, device="cpu").to(p.device) * 0.05)
        model.embed_tokens.weight.mul_(embed_scale)
    return model


def saved(tmp_path, target, method="gumiho", **kw):
    model = perturbed_drafter(target, method, **kw)
    save_drafter(model, tmp_path / "draft", include_embed=True)
    return model, tmp_path / "draft"


def released_expectation(config: dict, mlp_heads: int) -> dict[str, list[int]]:
    """The released `Model`'s parameters as it builds them from config.json (head_dim =
    hidden_size // heads, layer 0 without input norm, fc with a bias, each MLP head one
    2H -> H block and five H -> H blocks), under the names its loader gives them."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = h // heads
    keys = {"embed_tokens.weight": [v, h], "fc.weight": [h, 2 * h], "fc.bias": [h]}
    for i in range(config["num_hidden_layers"]):
        pre = f"layers.{i}."
        keys.update({pre + "self_attn.q_proj.weight": [heads * hd, h],
                     pre + "self_attn.k_proj.weight": [kv * hd, h],
                     pre + "self_attn.v_proj.weight": [kv * hd, h],
                     pre + "self_attn.o_proj.weight": [h, heads * hd],
                     pre + "mlp.gate_proj.weight": [inter, h],
                     pre + "mlp.up_proj.weight": [inter, h],
                     pre + "mlp.down_proj.weight": [h, inter],
                     pre + "post_attention_layernorm.weight": [h]})
        if i:
            keys[pre + "input_layernorm.weight"] = [h]
    for i in range(mlp_heads):
        keys[f"mlp.mlp.{i}.0.linear.weight"] = [h, 2 * h]
        keys[f"mlp.mlp.{i}.0.linear.bias"] = [h]
        for j in range(1, 6):
            keys[f"mlp.mlp.{i}.{j}.linear.weight"] = [h, h]
            keys[f"mlp.mlp.{i}.{j}.linear.bias"] = [h]
    return keys


@pytest.mark.parametrize("method", ["gumiho", "eagle2"])
def test_released_export_is_what_the_released_loader_reads(tiny_target, tmp_path, method):
    model, draft = saved(tmp_path, tiny_target, method)
    out = tmp_path / "released"
    assert export(draft, tiny_target, out, "released", dtype=torch.float16) == []
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "pytorch_model.bin"]
    config = json.loads((out / "config.json").read_text())
    # the loader: torch.load of pytorch_model.bin, `mlp.` renamed to `mlp.mlp.`, strict
    state = torch.load(out / "pytorch_model.bin", map_location="cpu", weights_only=True)
    renamed = {("mlp." + k if k.startswith("mlp.") else k): v for k, v in state.items()}
    heads = config["num_mlp_heads"] if method == "gumiho" else 0
    assert {k: list(v.shape) for k, v in renamed.items()} == released_expectation(config,
                                                                                   heads)
    assert {v.dtype for v in state.values()} == {torch.float16}
    # fields the released Llama layers and vLLM's Gumiho model read; no `bias` key (vLLM
    # would take it for attention biases; the released fc defaults to a bias without it)
    assert config["pretraining_tp"] == 1 and config["rope_scaling"] is None
    assert config["rope_theta"] == tiny_target.config.rope_parameters["rope_theta"]
    assert "bias" not in config and not config.get("attention_bias")
    if method == "gumiho":
        assert config["model_type"] == "gumiho" and config["gumiho_fc_bias"] is True
        assert config["architectures"] == ["GumihoLlamaForCausalLM"]
    assert config["draft_vocab_size"] == config["vocab_size"]
    # and it computes what the drafter computes (gumiho reads the same file back)
    back = load_drafter_model(out, tiny_target).float()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, atol=2e-3, rtol=2e-3)


def test_released_export_drops_the_draft_vocabulary(tiny_target, tmp_path):
    ids = torch.arange(0, 97, 3)
    _, draft = saved(tmp_path, tiny_target, draft_ids=ids)
    notes = export(draft, tiny_target, tmp_path / "out", "released")
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert "d2t" not in state and "t2d" not in state
    assert notes and "whole vocabulary" in notes[0]
    assert load_drafter_model(tmp_path / "out", tiny_target).d2t is None


def test_released_export_refuses_what_the_released_code_cannot_build(tmp_path):
    from transformers import LlamaForCausalLM

    from gumiho.errors import GumihoError
    from gumiho.target import wrap_target

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, head_dim=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    target = wrap_target(LlamaForCausalLM(config).eval(), name="wide-heads")
    _, draft = saved(tmp_path, target)
    with pytest.raises(GumihoError, match="head_dim = hidden_size / heads"):
        export(draft, target, tmp_path / "out", "released")
    export(draft, target, tmp_path / "vllm", "vllm-eagle")  # vLLM's Llama layers take it


def test_default_export_keeps_eagle3_vocabulary_buffers(tiny_target, tmp_path):
    ids = torch.tensor([0, 2, 3, 10, 50, 96])
    _, draft = saved(tmp_path, tiny_target, draft_ids=ids)
    export(draft, tiny_target, tmp_path / "out")
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    d2t, t2d = state["d2t"], state["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (6,)
    assert t2d.dtype == torch.bool and t2d.shape == (97,) and int(t2d.sum()) == 6
    ids = ids.cpu()  # the file's buffers are on the host
    assert torch.equal(torch.arange(6, device="cpu") + d2t, ids) and bool(t2d[ids].all())
    assert config["draft_vocab_size"] == 6 and "embed_tokens.weight" not in state


def engine_forward(out, target, tokens, features):
    """The EAGLE drafter forward of vLLM and SGLang (llama_eagle.py) rebuilt from stock HF
    layers: fc over cat(the target's stored embedding rows, features), the config's
    layers (attention biases if it says so) with layer 0's input norm skipped, no final
    norm. Loads strictly, so the key set must be exactly what these layers hold."""
    config = LlamaConfig.from_pretrained(out, attn_implementation="sdpa")
    state = load_file(str(out / "model.safetensors"))
    layers = [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    layers[0].input_layernorm = nn.Identity()
    for i, layer in enumerate(layers):
        prefix = f"layers.{i}."
        layer.load_state_dict({k[len(prefix):]: v.float() for k, v in state.items()
                               if k.startswith(prefix)}, strict=True)
    h = config.hidden_size
    fc = nn.Linear(2 * h, h, bias="fc.bias" in state)
    fc.load_state_dict({k[3:]: v.float() for k, v in state.items() if k.startswith("fc.")})
    assert not [k for k in state if not k.startswith(("layers.", "fc."))]
    n = tokens.shape[1]
    positions = torch.arange(n)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    x = fc(torch.cat([target.embed_tokens.weight[tokens], features], -1))
    rope = LlamaRotaryEmbedding(config)(x, positions)
    for layer in layers:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    return x


@pytest.mark.parametrize("engine,method,scale", [("vllm", "gumiho", 1.0),
                                                 ("vllm", "eagle2", 2.0),
                                                 ("sglang", "gumiho", 2.0)])
def test_eagle_exports_compute_our_serial_head(tiny_target, tmp_path, engine, method, scale):
    """vLLM: no fc bias (it is folded into layer 0's attention biases); SGLang: fc with its
    bias. A scaled drafter embedding (Gemma's sqrt(H)) is folded into fc, since both
    engines embed with the target's stored rows."""
    model, draft = saved(tmp_path, tiny_target, method, embed_scale=scale)
    out = tmp_path / engine
    notes = export(draft, tiny_target, out, f"{engine}-eagle", dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == (["LlamaForCausalLM"] if engine == "vllm" else
                                       ["LlamaForCausalLMEagle"])  # what SGLang builds
    assert config["model_type"] == "llama"
    assert config["attention_bias"] is (engine == "vllm")
    assert config["num_hidden_layers"] == (2 if method == "gumiho" else 1)
    state = load_file(str(out / "model.safetensors"))
    assert ("fc.bias" in state) is (engine == "sglang")
    assert (method == "gumiho") == any("MLP heads" in n for n in notes)
    g = torch.Generator().manual_seed(1)
    device = tiny_target.device
    tokens = torch.randint(97, (1, 7), generator=g, device="cpu").to(device)
    features = torch.randn(1, 7, 32, generator=g, device="cpu").to(device)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        ours = model.serial_step(tokens, features, torch.arange(7)[None], mask)
        theirs = engine_forward(out, tiny_target, tokens, features)
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)


def test_sglang_export_writes_the_draft_vocabulary_as_a_token_map(tiny_target, tmp_path):
    ids = torch.arange(1, 97, 2)
    _, draft = saved(tmp_path, tiny_target, draft_ids=ids)
    notes = export(draft, tiny_target, tmp_path / "sg", "sglang-eagle")
    assert torch.load(tmp_path / "sg" / "hot_token_map.pt") == ids.tolist()
    assert any("--speculative-token-map" in n for n in notes)
    notes = export(draft, tiny_target, tmp_path / "vl", "vllm-eagle")
    assert not (tmp_path / "vl" / "hot_token_map.pt").exists()
    assert any("whole vocabulary" in n for n in notes)


@pytest.mark.parametrize("fmt", ["vllm-eagle3", "sglang-eagle3"])
def test_eagle3_export_is_refused_in_one_line(tmp_path, capsys, fmt):
    assert main(["--draft", str(tmp_path), "--out", str(tmp_path / "o"), "--format",
                 fmt]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {fmt}: ") and "\n" not in err
    assert "--format vllm-eagle" in err and not (tmp_path / "o").exists()


def test_export_cli(tiny_target_dir, tmp_path, capsys):
    from gumiho.target import load_target

    target = load_target(tiny_target_dir)
    model = perturbed_drafter(target, "gumiho")
    save_drafter(model, tmp_path / "draft", dtype=torch.bfloat16)
    assert main(["--draft", str(tmp_path / "draft"), "--out", str(tmp_path / "bin"),
                 "--format", "released", "--target", tiny_target_dir]) == 0
    assert "pytorch_model.bin" in capsys.readouterr().out
    state = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert state["embed_tokens.weight"].dtype == torch.bfloat16  # the stored dtype
    torch.testing.assert_close(state["embed_tokens.weight"].float(),
                               target.embed_tokens.weight.bfloat16().float().cpu())
    # Without --target: the one the drafter's config.json says it was trained for (here
    # the tiny target; the embedded SmolLM2, of another width, would be refused).
    save_drafter(model, tmp_path / "trained", dtype=torch.bfloat16,
                 extra_config={"training": {"method": "gumiho", "target": tiny_target_dir}})
    assert main(["--draft", str(tmp_path / "trained"), "--out", str(tmp_path / "bin2"),
                 "--format", "released"]) == 0, capsys.readouterr().err
    again = torch.load(tmp_path / "bin2" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(again["embed_tokens.weight"], state["embed_tokens.weight"])


def test_export_over_another_draft_vocabulary(tiny_target_dir, tmp_path, capsys, monkeypatch):
    """--draft-vocab N: the same network over N tokens chosen from the training split, as
    a warm start with another --draft-vocab chooses them (0: the whole vocabulary); one
    trained drafter, a vocabulary sized for each device."""
    from gumiho.target import load_target

    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    target = load_target(tiny_target_dir)
    vocab = target.lm_head.weight.shape[0]
    model = perturbed_drafter(target, "gumiho", draft_ids=torch.tensor([0, 2, 3, 10, 50, 96]))
    save_drafter(model, tmp_path / "draft")
    counting = ["--num-conversations", "12", "--max-len", "96"]
    for size, want in (("20", 20), ("0", None)):
        out = tmp_path / f"v{size}"
        assert main(["--draft", str(tmp_path / "draft"), "--out", str(out), "--target",
                     tiny_target_dir, "--draft-vocab", size, *counting]) == 0
        assert f"over {want or vocab} draft tokens" in capsys.readouterr().out
        state = load_file(str(out / "model.safetensors"))
        config = json.loads((out / "config.json").read_text())
        if want is None:
            # written out in full for vLLM; read back as 0, "the whole vocabulary"
            assert "d2t" not in state and config["draft_vocab_size"] == vocab
        else:
            assert state["d2t"].shape == (want,) and config["draft_vocab_size"] == want
        for key, value in load_file(str(tmp_path / "draft" / "model.safetensors")).items():
            if key not in ("d2t", "t2d"):  # the network itself is unchanged
                assert torch.equal(state[key], value)
        assert load_drafter_model(out, target).config.draft_vocab_size == (want or 0)
    assert main(["--draft", str(tmp_path / "draft"), "--out", str(tmp_path / "bad"),
                 "--target", tiny_target_dir, "--draft-vocab", str(vocab + 1), *counting]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --draft-vocab")
    # Medusa heads with their own lm_head rows are tied to their vocabulary
    from gumiho.drafters import random_drafter_model

    medusa = random_drafter_model("medusa", target, medusa_own_lm_head=True)
    save_drafter(medusa, tmp_path / "medusa")
    assert main(["--draft", str(tmp_path / "medusa"), "--out", str(tmp_path / "m"),
                 "--target", tiny_target_dir, "--draft-vocab", "20", *counting]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has its own lm_head rows" in err[0]


@pytest.mark.parametrize("fmt", ["gumiho", "released", "vllm-eagle"])
def test_export_keeps_the_training_record(tiny_target, tmp_path, fmt):
    """An exported drafter still says how it was trained (gumiho.train's `training` and
    `trained_steps` in config.json), over whatever vocabulary it is exported."""
    record = {"training": {"method": "gumiho", "lr": 5e-4, "draft_vocab": 0},
              "trained_steps": 800}
    model = perturbed_drafter(tiny_target, "gumiho")
    save_drafter(model, tmp_path / "draft", extra_config=record)
    export(tmp_path / "draft", tiny_target, tmp_path / "out", fmt)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: config[k] for k in record} == record
    # an official checkpoint has no record, and its export adds none
    save_drafter(model, tmp_path / "plain")
    export(tmp_path / "plain", tiny_target, tmp_path / "out2", fmt)
    assert "training" not in json.loads((tmp_path / "out2" / "config.json").read_text())


def test_a_new_draft_vocabulary_is_counted_over_the_drafters_own_training(tiny_target,
                                                                          tmp_path,
                                                                          monkeypatch):
    """--draft-vocab in export and the accuracy tool: unset, the conversations, template,
    count, length and skip are the drafter's own online training's (so a larger vocabulary
    holds every token it trained over); given, the flags win; without a record, ShareGPT."""
    import argparse

    from gumiho.train import start

    seen = []
    monkeypatch.setattr(start, "online_samples",
                        lambda *a, **k: seen.append((a[1:], k)) or [])
    monkeypatch.setattr(start, "check_draft_vocab", lambda target, size: 10 ** 6)  # its vocab
    record = {"training": {"method": "gumiho", "online": True, "conversations": "mine.jsonl",
                           "template": "vicuna", "num_conversations": 8, "max_len": 128,
                           "skip_conversations": 4}}
    model = perturbed_drafter(tiny_target, "gumiho")
    save_drafter(model, tmp_path / "trained", extra_config=record)
    save_drafter(model, tmp_path / "plain")

    def args(draft, **given):
        flags = {"draft_vocab": 64, "conversations": None, "template": None,
                 "num_conversations": None, "max_len": None}
        return argparse.Namespace(draft=str(tmp_path / draft), **{**flags, **given})
    start.vocabulary_samples(tiny_target, args("trained"))
    start.vocabulary_samples(tiny_target, args("trained", num_conversations=20,
                                               template="chatml"))
    start.vocabulary_samples(tiny_target, args("plain"))
    shown = {"progress": True}  # (tokenizing the split takes a minute or more)
    assert seen == [(("mine.jsonl", 8, 128, "vicuna"), {"skip": 4, **shown}),
                    (("mine.jsonl", 20, 128, "chatml"), {"skip": 4, **shown}),
                    (("sharegpt", 17671, 512, None), {"skip": 0, **shown})]


def test_overwrite_removes_an_earlier_exports_files(tiny_target_dir, tmp_path):
    """Re-exporting a reduced-vocabulary drafter as `released` over a default export (the
    README's advice for vLLM's Gumiho model): the old model.safetensors, which loaders read
    first, goes, so the folder loads as what was written last."""
    from gumiho.target import load_target

    target = load_target(tiny_target_dir, device="cpu", dtype="float32")
    model = perturbed_drafter(target, "gumiho", draft_ids=torch.arange(0, 900, 3))
    save_drafter(model, tmp_path / "draft")
    out = tmp_path / "out"
    common = ["--draft", str(tmp_path / "draft"), "--out", str(out), "--target",
              tiny_target_dir]
    assert main(common) == 0 and (out / "model.safetensors").is_file()
    assert main([*common, "--format", "released", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert load_drafter_model(out, target).d2t is None
