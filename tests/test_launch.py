"""gumiho.train.launch (scripts/train.sh's multi-process path): a process that stops on bad
input is reported as the trainer reports it, one line and its exit status, with no launcher
traceback; the process count comes from NUM_PROCESSES, the config, or the GPUs (every
machine's, for a multi-machine config, which keeps one port); a count that is no positive
number is one line."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gumiho.errors import ERROR_FILE_ENV, RANK_FIELD, GumihoError, cli_errors
from gumiho.train.launch import (
    failure_line,
    free_port,
    process_count,
    read_config,
    report_failure,
    root_failure,
)

from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
MULTI = ROOT / "configs" / "multi_gpu.yaml"


def test_process_count_comes_from_the_environment_the_config_or_the_gpus(tmp_path):
    shipped = read_config(MULTI)
    assert "num_processes" not in shipped  # one per GPU, not a fixed 8
    assert process_count(shipped, MULTI, {}, gpus=4) == 4
    assert process_count(shipped, MULTI, {"NUM_PROCESSES": "2"}, gpus=0) == 2
    assert process_count(shipped, MULTI, {"NUM_PROCESSES": "3"}, gpus=8) == 3
    assert process_count({**shipped, "num_processes": 6}, MULTI, {}, gpus=8) == 6
    with pytest.raises(GumihoError, match="starts one process per GPU and this machine has "
                                          "none: set NUM_PROCESSES=N"):
        process_count(shipped, MULTI, {}, gpus=0)
    for bad in ["0", "two", "-1"]:
        with pytest.raises(GumihoError, match=f"NUM_PROCESSES={bad}: expected a positive"):
            process_count(shipped, MULTI, {"NUM_PROCESSES": bad}, gpus=1)
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: [MULTI_GPU\n")
    with pytest.raises(GumihoError, match="accelerate config .*broken.yaml"):
        read_config(broken)


def test_a_failed_process_is_its_own_line_or_its_signal(tmp_path, capsys):
    errors = str(tmp_path / f"error-{RANK_FIELD}")
    (tmp_path / "error-1").write_text("error: --lr must be positive\n")
    assert failure_line(1, 2, errors) == "error: --lr must be positive"
    assert failure_line(0, -signal.SIGKILL, errors) == \
        "error: training process 0 was killed by SIGKILL (out of memory?)"
    assert failure_line(0, -signal.SIGSEGV, errors) == \
        "error: training process 0 was killed by SIGSEGV"
    assert failure_line(2, 3, errors).startswith("error: training process 2 exited with "
                                                 "status 3; rerun with GUMIHO_DEBUG=1")
    assert report_failure(1, 2, errors) == 2
    assert report_failure(0, -signal.SIGKILL, errors) == 137
    assert capsys.readouterr().err.splitlines() == [
        "error: --lr must be positive",
        "error: training process 0 was killed by SIGKILL (out of memory?)"]


def test_each_process_writes_its_line_to_its_own_file(tmp_path, monkeypatch, capsys):
    """GUMIHO_ERROR_FILE with {rank}: a process under torchrun (RANK set) writes there, not
    to stderr, so the launcher can print one line for all of them."""
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / f"error-{RANK_FIELD}"))
    monkeypatch.setenv("RANK", "3")

    @cli_errors
    def fails(argv=None):
        raise GumihoError("bad flag")

    assert fails([]) == 2
    assert (tmp_path / "error-3").read_text() == "error: bad flag\n"
    assert capsys.readouterr().err == ""


def test_free_port_is_free():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_two_processes_stopping_on_bad_input_print_one_line(tmp_path):
    """scripts/train.sh with the shipped multi-GPU config on 2 CPU processes: too few samples
    for the global batch is found in each process after the launch; it used to print the
    line twice and then torchrun's ChildFailedError traceback (exit 1). Besides the line only
    progress bars (tokenizing, where the cache lacks the samples: the GPU suite's first run
    on 2026-11-30); NCCL also warned there once per process that the group was never
    destroyed."""
    env = child_env(NUM_PROCESSES="2", OMP_NUM_THREADS="1",
                    ACCELERATE_CONFIG="configs/multi_gpu.yaml",
                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "train.sh"), "--online",
                           "--num-conversations", "2", "--batch-size", "4",
                           "--output-dir", "run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line for line in lines if not PROGRESS.match(line)] == [
        "error: 2 training samples do not fill one global batch of 64: lower --batch-size "
        "or --grad-accum, or add data"], proc.stderr


PROGRESS = re.compile(r"^[^:]+: +\d+%\|")  # a tqdm bar's line


@pytest.mark.parametrize("ending", ["returns", "bad input", "fails"])
def test_a_launched_process_ends_its_group_unless_it_failed(ending, monkeypatch, tmp_path):
    """A training process tears its process group down after a run or on bad input (found
    alike by every process); after an unexpected failure it leaves it, since another process
    may still wait in a collective and the teardown could wait with it."""
    import torch.distributed as dist

    from gumiho.train import __main__ as trainer

    def train(*args):
        if ending == "bad input":
            raise GumihoError("too few samples")
        if ending == "fails":
            raise RuntimeError("a bug")
        return 0

    monkeypatch.setattr(trainer, "train", train)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        argv = ["--online", "--num-conversations", "2", "--output-dir", str(tmp_path / "r")]
        if ending == "returns":
            assert trainer.main(argv) == 0
        else:
            assert trainer.main(argv) == (2 if ending == "bad input" else 1)
        assert dist.is_initialized() == (ending == "fails")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_failure_reported_is_the_one_that_left_its_line(tmp_path):
    """torchrun orders failures by whole seconds, so a process it stopped (SIGTERM) because
    another failed can come first; the report names the one that left its line."""
    errors = str(tmp_path / f"error-{RANK_FIELD}")
    (tmp_path / "error-1").write_text("error: too few samples\n")
    assert root_failure({0: -signal.SIGTERM, 1: 2}, errors) == (1, 2)
    (tmp_path / "error-1").unlink()
    assert root_failure({0: -signal.SIGTERM, 1: 3}, errors) == (1, 3)  # ended on its own
    assert root_failure({0: -signal.SIGTERM, 1: -signal.SIGKILL}, errors) == \
        (0, -signal.SIGTERM)
    # both left the line, and rank 0 was stopped before it could exit: rank 1's status
    for rank in (0, 1):
        (tmp_path / f"error-{rank}").write_text("error: too few samples\n")
    assert root_failure({0: -signal.SIGTERM, 1: 2}, errors) == (1, 2)
    assert root_failure({0: -signal.SIGTERM, 1: -signal.SIGTERM}, errors) == \
        (0, -signal.SIGTERM)


def launched(monkeypatch, tmp_path, config: str, gpus: int = 0, argv=()) -> list:
    """The accelerate launch arguments gumiho.train.launch makes for this config."""
    import accelerate.commands.launch as accelerate_launch
    import torch

    from gumiho.train import launch

    seen = []
    monkeypatch.setattr(accelerate_launch, "launch_command", seen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("NUM_PROCESSES", raising=False)
    path = tmp_path / "config.yaml"
    path.write_text(config)
    status = launch.main(["--config-file", str(path), "--online", *argv])
    return [status, *seen]


MULTI_NODE = ("distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 1\n"
              "main_process_ip: 10.0.0.1\n")


def test_a_multi_machine_launch_keeps_one_port_and_counts_every_machine(monkeypatch,
                                                                        tmp_path):
    """Each machine runs its own launch: a free port picked on each differed, so the others
    never reached the first; and accelerate's num_processes is all machines' (4 local GPUs
    on 2 machines started 2 a machine)."""
    runs = [launched(monkeypatch, tmp_path, MULTI_NODE, gpus=4) for _ in range(2)]
    for status, args in runs:
        assert status == 0
        assert args.main_process_port is None  # accelerate's default, the same everywhere
        assert args.num_processes == 8
    status, args = launched(monkeypatch, tmp_path, MULTI_NODE + "num_processes: 16\n", gpus=4)
    assert (status, args.num_processes, args.main_process_port) == (0, 16, None)
    # one machine: still a free port of its own, also where the config's port is null
    for config in ("distributed_type: MULTI_GPU\n",
                   "distributed_type: MULTI_GPU\nmain_process_port: null\n"):
        status, args = launched(monkeypatch, tmp_path, config, gpus=2)
        assert status == 0 and args.num_processes == 2
        assert isinstance(args.main_process_port, int) and args.main_process_port > 0


@pytest.mark.parametrize("setting", ["num_processes: auto", "num_processes: 0",
                                     "num_processes: true", "num_machines: two"])
def test_a_config_count_that_is_no_positive_number_is_one_line(monkeypatch, tmp_path,
                                                                capsys, setting):
    """`auto` was an internal error (int('auto')), 0 was passed on to accelerate."""
    status, *started = launched(monkeypatch, tmp_path,
                                f"distributed_type: MULTI_GPU\n{setting}\n", gpus=2)
    assert (status, started) == (2, [])
    key, value = setting.split(": ")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: accelerate config ")
    assert f"{key} " in lines[0] and "is not a positive integer" in lines[0]


def test_a_quoted_process_count_is_taken(monkeypatch, tmp_path):
    status, args = launched(monkeypatch, tmp_path,
                            "distributed_type: MULTI_GPU\nnum_processes: '3'\n")
    assert (status, args.num_processes) == (0, 3)
