"""Distributed training: `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo)
trains the same drafter as one process at the same global batch (same data order, seeds
and schedule): weights within float tolerance after N steps and the same loss log."""

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from gumiho.config import TrainConfig
from gumiho.errors import GumihoError
from gumiho.train.__main__ import main
from gumiho.train.accel import check_process_group, configure_deepspeed
from gumiho.train.state import wait_for_everyone

from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(args: list[str]) -> subprocess.CompletedProcess:
    """Two CPU processes in one gloo group (the trainer asks accelerate for cpu=True)."""
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m",
           "gumiho.train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def log_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("tokens_per_s")  # wall-clock
    return rows


@pytest.mark.host  # a CPU gloo group, also on a GPU machine (GUMIHO_DEVICE=cpu)
@pytest.mark.parametrize("method", ["gumiho", pytest.param("eagle2", marks=pytest.mark.slow)])
def test_two_processes_train_like_one(tiny_target_dir, tmp_path, method):
    common = ["--target", tiny_target_dir, "--online", "--num-conversations", "8",
              "--max-len", "96", "--method", method, "--lr", "1e-3", "--warmup-steps", "0",
              "--export-dtype", "float32", "--max-steps", "3", "--batch-size", "1",
              "--log-every", "1", "--ploss-fraction", "0.5"]
    assert main([*common, "--grad-accum", "4", "--output-dir", str(tmp_path / "one")]) == 0
    done = launch_two([*common, "--grad-accum", "2", "--output-dir", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-3000:]
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model.safetensors"))
    start = load_file(str(tmp_path / "one" / "checkpoint-epoch1" / "model.safetensors"))
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=1e-5)
    # it trained: the last steps still moved the weights
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-4
    rows_one, rows_two = log_rows(tmp_path / "one"), log_rows(tmp_path / "two")
    assert [r["step"] for r in rows_one] == [1, 2, 3] and len(rows_two) == 3
    for a, b in zip(rows_one, rows_two, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    summary = json.loads((tmp_path / "two" / "train_summary.json").read_text())
    assert summary["steps"] == 3


def test_processes_that_train_alone_are_refused(monkeypatch):
    """Launched processes that did not form one group would each train on their own."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(GumihoError, match="2 processes were launched"):
        check_process_group(SimpleNamespace(num_processes=1))
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_process_group(SimpleNamespace(num_processes=1))


def test_a_cpu_group_waits_without_naming_a_gpu(monkeypatch):
    """accelerate's barrier passes device_ids=[local rank] even for a gloo group of CPU
    processes, so on a machine with one GPU the second process failed (invalid device
    ordinal; found on an H100). A CPU group waits with a plain gloo barrier."""
    barriers, waits = [], []
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: barriers.append((a, k)))

    def accelerator(processes, device):
        return SimpleNamespace(num_processes=processes, device=torch.device(device),
                               wait_for_everyone=lambda: waits.append(device))
    wait_for_everyone(accelerator(2, "cpu"))
    assert barriers == [((), {})] and waits == []
    wait_for_everyone(accelerator(2, "cuda"))  # GPU groups: accelerate's own (NCCL)
    wait_for_everyone(accelerator(1, "cpu"))
    assert waits == ["cuda", "cpu"] and len(barriers) == 1


def test_deepspeed_zero2_config_leaves_batch_and_clipping_to_the_trainer():
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "deepspeed_zero2.yaml").read_text())
    assert config["distributed_type"] == "DEEPSPEED"
    deepspeed = config["deepspeed_config"]
    assert deepspeed["zero_stage"] == 2
    # accelerate would pass these over the trainer's --grad-accum / --grad-clip
    assert not {"gradient_accumulation_steps", "gradient_clipping",
                "train_micro_batch_size_per_gpu"} & deepspeed.keys()


def test_deepspeed_takes_batch_accumulation_and_clipping_from_the_flags():
    plugin = SimpleNamespace(deepspeed_config={
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 2}})
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin),
                                  gradient_accumulation_steps=4)
    config = TrainConfig(online=True, batch_size=2, grad_accum=4, grad_clip=0.5)
    configure_deepspeed(accelerator, config)
    assert plugin.deepspeed_config == {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5, "zero_optimization": {"stage": 2}}
    accelerator.gradient_accumulation_steps = 8  # set by an accelerate config
    with pytest.raises(GumihoError, match="gradient_accumulation_steps=8"):
        configure_deepspeed(accelerator, config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed trains on a GPU")
def test_deepspeed_zero2_trains_like_plain_data_parallel(tiny_target_dir, tmp_path):
    """The README's ZeRO-2 launch, on one GPU: it runs and starts where a plain run does
    (both bf16, so the weights agree only roughly)."""
    pytest.importorskip("deepspeed")
    from gumiho.checkpoint import load_drafter_model
    from gumiho.target import load_target

    common = ["--target", tiny_target_dir, "--online", "--num-conversations", "8",
              "--max-len", "96", "--method", "gumiho", "--max-steps", "3", "--batch-size",
              "2", "--grad-accum", "2", "--warmup-steps", "0", "--log-every", "1"]
    assert main([*common, "--output-dir", str(tmp_path / "plain")]) == 0
    env = child_env()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "deepspeed_zero2.yaml"), "--num_processes", "1",
           "--main_process_port", str(free_port()), "-m", "gumiho.train", *common,
           "--output-dir", str(tmp_path / "zero2")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    plain, zero2 = log_rows(tmp_path / "plain"), log_rows(tmp_path / "zero2")
    assert len(plain) == len(zero2) == 3
    assert zero2[0]["vloss"] == pytest.approx(plain[0]["vloss"], rel=2e-2)
    load_drafter_model(tmp_path / "zero2", load_target(tiny_target_dir))
