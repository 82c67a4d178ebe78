"""Several training processes from an accelerate config, reported as one command:
`python -m gumiho.train.launch --config-file YAML [gumiho.train flags]` (what
`scripts/train.sh` runs for a multi-process config).

`accelerate launch` starts the processes with torchrun; when one of them stops on bad input,
each prints its `error: ...` line and torchrun then raises its ChildFailedError with a page of
traceback. Here each process writes its line to its own file instead (`GUMIHO_ERROR_FILE`
with `{rank}`, see `gumiho.errors`), the launcher's own logging is quiet, and the first
failure is reported as the trainer reports it: its one line, its exit status. A process
that died without a line (killed, out of memory) is named with its signal.

The process count (accelerate's: all machines' together): `NUM_PROCESSES` if set, else the
config's `num_processes`, else one per local GPU on each of its `num_machines` (the shipped
multi-GPU configs name none); a config without a count on a machine without a GPU is
refused, since it would otherwise start one process per core. A one-machine config that
names no `main_process_port` gets a free one, so several launches can share a machine; a
multi-machine one keeps accelerate's default (every machine must use the same port).
`GUMIHO_DEBUG=1` launches plainly, tracebacks and all.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from gumiho.errors import (
    ERROR_FILE_ENV,
    RANK_FIELD,
    ArgumentParser,
    GumihoError,
    cli_errors,
    debug,
    error_file,
    how_it_ended,
    left_line,
    one_line,
    shell_status,
)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m gumiho.train.launch",
                       description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config-file", required=True,
                   help="an accelerate config (configs/multi_gpu.yaml, "
                   "configs/deepspeed_zero2.yaml or your own)")
    return p


def read_config(config: Path) -> dict:
    import yaml

    try:
        values = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise GumihoError(f"accelerate config {config}: {one_line(exc)}") from None
    if not isinstance(values, dict):
        raise GumihoError(f"accelerate config {config}: not a mapping of settings")
    return values


def free_port() -> int:
    """A port no one listens on now: two launches on one machine (several trainings
    sharing a GPU) would otherwise both take torchrun's 29500, and the second fail."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_count(config: dict, name: Path, env: dict[str, str], gpus: int) -> int:
    """How many processes to start (see the module docstring)."""
    if env.get("NUM_PROCESSES"):
        try:
            count = int(env["NUM_PROCESSES"])
        except ValueError:
            count = 0
        if count < 1:
            raise GumihoError(f"NUM_PROCESSES={env['NUM_PROCESSES']}: expected a positive "
                              "integer")
        return count
    count = config.get("num_processes")
    if count not in (None, -1):
        return config_count(config, "num_processes", name)
    if gpus == 0:
        raise GumihoError(f"accelerate config {name} starts one process per GPU and this "
                          "machine has none: set NUM_PROCESSES=N for N CPU processes, or "
                          "use configs/accelerate_single.yaml")
    return gpus * machines(config, name)


def config_count(config: dict, key: str, name: Path) -> int:
    """The config's positive integer `key` (a quoted one too), or one line that names it
    (`auto`, 0 or `true` once reached accelerate, or ended in a traceback)."""
    value = config[key]
    count = value if isinstance(value, int) and not isinstance(value, bool) else \
        int(value) if isinstance(value, str) and value.strip().isdigit() else 0
    if count < 1:
        raise GumihoError(f"accelerate config {name}: {key} {value!r} is not a positive "
                          "integer")
    return count


def machines(config: dict, name: Path) -> int:
    """The config's `num_machines` (1 where it names none)."""
    return 1 if config.get("num_machines") is None else \
        config_count(config, "num_machines", name)


def port_args(config: dict, name: Path) -> list[str]:
    """A free port for a one-machine launch that names none; a multi-machine launch keeps
    the config's or accelerate's default: each machine runs its own launch, and a port
    picked on each would differ, so the others could not reach the first."""
    if config.get("main_process_port") is not None or machines(config, name) > 1:
        return []
    return ["--main_process_port", str(free_port())]


def failure_line(rank: int, exitcode: int, errors: str) -> str:
    """The line a failed process left in its file (`errors` with its rank), or what ended
    it."""
    line = left_line(error_file(errors, rank))
    if line:
        return line
    hint = "" if exitcode < 0 else "; rerun with GUMIHO_DEBUG=1 for the launcher's report"
    return f"error: training process {rank} {how_it_ended(exitcode)}{hint}"


def quiet_launcher_logs() -> None:
    """torchrun's agent logs each stop (a worker's exit, the SIGTERM sent to the others, a
    Ctrl-C) at WARNING and ERROR; the processes' own lines say what happened. Its loggers
    carry their own levels, so each is set once its module has been imported."""
    import torch.distributed.run  # noqa: F401 - imports the agent's modules and loggers

    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def root_failure(failures: dict[int, int], errors: str) -> tuple[int, int]:
    """The failure to report, (rank, exit status): the first process that left its line and
    ended on its own, else one that left its line, else one that ended on its own, else
    the first. Not torchrun's first by time: its clock counts whole seconds, so a process it
    stopped because another failed can look first (seen once: `training process 0 was
    killed by SIGTERM`), and a process can leave its line and be stopped before it exits
    (seen once: the line, with exit status 143)."""
    ranks = sorted(failures)
    spoke = [r for r in ranks if left_line(error_file(errors, r))]
    own = [r for r in ranks if failures[r] > 0]
    rank = next((r for r in spoke if r in own), None)
    rank = rank if rank is not None else (spoke or own or ranks)[0]
    return rank, failures[rank]


def report_failure(rank: int, exitcode: int, errors: str) -> int:
    """Print the failure's one line; return the exit status a shell would show for it."""
    print(failure_line(rank, exitcode, errors), file=sys.stderr, flush=True)
    return shell_status(exitcode) or 1


@cli_errors(resume="the run keeps its last save (each epoch's end, or every --save-every "
            "steps); rerun the same command to resume from it")
def main(argv: list[str] | None = None) -> int:
    import torch
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args, trainer_args = build_parser().parse_known_args(argv)
    config = Path(args.config_file)
    if not config.is_file():
        raise GumihoError(f"accelerate config {config} not found")
    values = read_config(config)
    count = process_count(values, config, dict(os.environ), torch.cuda.device_count())
    launch = launch_command_parser().parse_args(
        ["--config_file", str(config), "--num_processes", str(count),
         *port_args(values, config),
         "-m", "gumiho.train", *trainer_args])
    if debug():
        launch_command(launch)
        return 0
    quiet_launcher_logs()
    with tempfile.TemporaryDirectory(prefix="gumiho-launch-") as tmp:
        errors = str(Path(tmp) / f"error-{RANK_FIELD}")
        os.environ[ERROR_FILE_ENV] = errors
        try:
            launch_command(launch)
        except ChildFailedError as exc:
            rank, exitcode = root_failure(
                {rank: f.exitcode for rank, f in exc.failures.items()}, errors)
            return report_failure(rank, exitcode, errors)
        except subprocess.CalledProcessError as exc:  # one process, started without torchrun
            return report_failure(0, exc.returncode, errors)
        except SignalException:  # Ctrl-C or a kill reached the launcher: the processes stop
            raise KeyboardInterrupt from None
        finally:
            os.environ.pop(ERROR_FILE_ENV, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
