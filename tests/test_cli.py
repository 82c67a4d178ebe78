"""The command line and bad input: one-line errors that say what to do."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import BertConfig

from gumiho.engine import GenerateConfig
from gumiho.errors import GumihoError
from gumiho.generate import main
from gumiho.target import load_target

JSON_KEYS = {"token_ids", "text", "new_tokens", "cycles", "tau", "accept_lengths", "wall_s",
             "tokens_per_s"}


def test_missing_target_dir():
    with pytest.raises(GumihoError, match="not a local model directory") as err:
        load_target("/no/such/model")
    assert "\n" not in str(err.value)


def test_unsupported_model(tmp_path):
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(GumihoError, match="not a supported causal LM") as err:
        load_target(str(tmp_path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"temperature": -1.0}])
def test_bad_generate_config(kwargs):
    with pytest.raises(GumihoError):
        GenerateConfig(**kwargs)


def test_cli_errors_are_one_line(capsys, smollm2):
    assert main(["--prompt", "   "]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: empty prompt: give some text to answer"
    assert main(["--target", "/no/such/model", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: target")
    assert main(["--method", "ar", "--draft", "random", "--prompt", "hi"]) == 2


def test_cli_json_end_to_end(smollm2):
    """`python -m gumiho.generate --json` on the embedded target, as a user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "gumiho.generate", "--target", "smollm2", "--method", "ar",
         "--prompt", "Name a primary colour.", "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert JSON_KEYS <= set(result)
    assert result["new_tokens"] == len(result["token_ids"]) == sum(result["accept_lengths"])
    assert result["tau"] == 1.0 and result["text"]
    ids = smollm2.chat_ids("Name a primary colour.")
    with torch.inference_mode():
        ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert result["token_ids"] == ref[0, len(ids):].tolist()[: result["new_tokens"]]


@pytest.mark.host
def test_every_subcommand_runs_its_module(capsys):
    """`gumiho SUBCOMMAND --help` reaches each module's own `main` (a package name, as
    `gumiho.train` once was, has none: `gumiho train` raised AttributeError)."""
    from gumiho.cli import SUBCOMMANDS
    from gumiho.cli import main as cli

    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as done:
            cli([name, "--help"])
        assert done.value.code == 0, name
        assert capsys.readouterr().out.startswith("usage:"), name


def test_env_says_which_paths_run_here(capsys, monkeypatch):
    """`gumiho env`: versions, the kernels as rowgemm.py and rowamx.py find them, the demo's
    default here, the switches set; a bad switch is reported, not raised."""
    from gumiho import env, rowamx, rowgemm, softce
    from gumiho.cli import main as cli
    from gumiho.demo import exact_bf16_here

    monkeypatch.setenv("GUMIHO_FUSED", "0")
    monkeypatch.setenv("GUMIHO_ROWLAYER", "0")
    assert cli(["env", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["torch"] == torch.__version__
    kernels = facts["kernels"]
    assert kernels["rowgemm"] == (rowgemm.kernel() is not None)
    assert kernels["rowgemm_avx512_blocks"] == bool(rowgemm.kernel() and rowgemm.kernel().wide)
    assert kernels["rowamx"] == (rowamx.kernel() is not None)
    assert kernels["rowattention_amx_tiles"] == bool(rowgemm.kernel()
                                                      and rowgemm.kernel().tiled)
    assert kernels["fused_decoder"] is False and facts["switches"]["GUMIHO_FUSED"] == "0"
    assert kernels["rowlayer"] is False
    assert kernels["softce"] == (softce.kernel() is not None)
    assert facts["switches"] == {k: os.environ[k] for k in env.SWITCHES if k in os.environ}
    assert facts["default"]["demo_on_cpu"].startswith(os.environ.get("GUMIHO_DTYPE") or (
        "bfloat16" if exact_bf16_here(torch.device("cpu")) else "float32"))
    assert (facts["cuda"] is None) == (not torch.cuda.is_available())

    monkeypatch.setenv("GUMIHO_DEVICE", "tpu")
    assert env.main([]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert "default device and dtype: error: unknown device 'tpu'" in out
    assert "GUMIHO_DEVICE=tpu" in out and "GUMIHO_FUSED=0" in out
