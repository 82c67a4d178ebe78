"""What a new user meets first: `gumiho` itself, its error lines, `gumiho env`'s version,
the server's worker at Ctrl-C, and the timers' device synchronisation (review, session 66)."""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import child_env

ROOT = Path(__file__).parents[1]


def _piped_to_a_reader_that_left(code: str) -> subprocess.CompletedProcess:
    """Run `code` with its stdout a pipe whose read end is closed before the child writes
    (what `gumiho demo | head -3` becomes once head has its lines). Its stdout buffered,
    as a pipe's is by default, so a short write fails only at a flush."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=child_env(PYTHONUNBUFFERED=""))
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=120), "", err)


WRAPPED = ("import sys, time\nfrom gumiho.errors import cli_errors, GumihoError\n"
           "@cli_errors\ndef main(argv=None):\n    time.sleep(0.5)\n{body}\n"
           "sys.exit(main())\n")


@pytest.mark.host
def test_output_piped_to_a_reader_that_left_stops_quietly():
    """`gumiho demo | head -3` once ended `error: internal error BrokenPipeError ... (a bug
    in gumiho ...)`, exit 1; now it stops as `yes | head` does: nothing on stderr, 141."""
    for body in ('    print("x" * 200000)\n    return 0',  # a write past the pipe's buffer
                 '    print("a line")\n    return 0'):  # one the exit's flush would write
        done = _piped_to_a_reader_that_left(WRAPPED.format(body=body))
        assert (done.returncode, done.stderr) == (141, ""), done.stderr


@pytest.mark.host
def test_an_error_after_output_to_a_reader_that_left_is_still_one_line():
    done = _piped_to_a_reader_that_left(WRAPPED.format(
        body='    sys.stdout.write("partial")\n    raise GumihoError("bad input")'))
    assert (done.returncode, done.stderr) == (2, "error: bad input\n"), done.stderr


@pytest.mark.host
def test_an_error_with_no_stdout_is_still_one_line():
    """A command run with its stdout closed (`>&-`, a daemon): the report once raised
    AttributeError from `sys.stdout.flush()` inside the handler, a double traceback."""
    code = WRAPPED.format(body='    raise GumihoError("bad input")')
    done = subprocess.run(f"{sys.executable} -c '{code}' >&-", shell=True, text=True,
                          capture_output=True, env=child_env(), cwd=ROOT, timeout=120)
    assert (done.returncode, done.stderr) == (2, "error: bad input\n"), done.stderr
    ok = subprocess.run(f"{sys.executable} -c '{WRAPPED.format(body='    return 0')}' >&-",
                        shell=True, text=True, capture_output=True, env=child_env(),
                        cwd=ROOT, timeout=120)
    assert (ok.returncode, ok.stderr) == (0, ""), ok.stderr


@pytest.mark.host
def test_a_broken_pipe_elsewhere_is_still_a_bug(capsys):
    from gumiho.errors import cli_errors

    @cli_errors
    def main(argv=None):
        raise BrokenPipeError("a pipe to some other process")

    assert main() == 1
    assert "internal error BrokenPipeError" in capsys.readouterr().err


@pytest.mark.host
def test_a_workers_argparse_error_goes_to_its_parents_file(tmp_path, monkeypatch, capsys):
    """`python -m gumiho.train.launch --config-file ... --lr abc` on 2 processes printed the
    argparse line once per process and then `error: training process 0 exited with status
    2; rerun with GUMIHO_DEBUG=1 ...`: the trainer's processes write their errors to the
    launcher's file (GUMIHO_ERROR_FILE), but argparse's went to stderr."""
    from gumiho.errors import ERROR_FILE_ENV, ArgumentParser, left_line

    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "error-{rank}"))
    monkeypatch.setenv("RANK", "1")
    parser = ArgumentParser(prog="python -m gumiho.train")
    parser.add_argument("--lr", type=float)
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--lr", "abc"])
    assert done.value.code == 2 and capsys.readouterr().err == ""
    assert left_line(tmp_path / "error-1") == ("error: python -m gumiho.train: argument --lr: "
                                               "invalid float value: 'abc' (see python -m "
                                               "gumiho.train --help)")
    # a parent gone with its folder: the line is not lost, stderr has it
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "gone" / "error-{rank}"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--lr", "abc"])
    assert capsys.readouterr().err.startswith("error: python -m gumiho.train: argument --lr")


@pytest.mark.host
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_code_version_inside_another_repository_is_the_version(tmp_path):
    """gumiho installed in a virtual environment inside the user's own git project (ignored
    there, as .venv is): `gumiho env`, gen_answers' records and the data manifest named that
    project's commit as gumiho's code."""
    project = tmp_path / "project"
    package = project / ".venv" / "site" / "gumiho"
    package.mkdir(parents=True)
    (project / ".gitignore").write_text(".venv/\n")
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a", "-C", str(project)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", ".gitignore"], check=True)
    subprocess.run([*git, "commit", "-qm", "theirs"], check=True)
    shutil.copy(ROOT / "gumiho" / "version.py", package / "version.py")
    (package / "__init__.py").write_text("")
    out = subprocess.run([sys.executable, "-c", "from gumiho.version import code_version; "
                          "print(code_version(), code_version(short=True))"],
                         cwd=package.parent, capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]})
    from gumiho.version import __version__
    assert out.stdout.split() == ["gumiho", __version__, "gumiho", __version__]


@pytest.mark.host
def test_timers_wait_for_an_mps_device(monkeypatch):
    """`--total-tokens auto` times verifies whose results it never reads on the host: on
    Apple's MPS, which queues work as CUDA does, the timers read how long the launches took."""
    from gumiho import profiling

    waits = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: waits.append("mps"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append("cuda"))
    profiling.seconds(lambda: None, torch.device("mps"))
    assert waits == ["mps", "mps"]
    profiling.seconds(lambda: None, torch.device("cpu"))
    assert waits == ["mps", "mps"]


@pytest.mark.host
def test_gumiho_version_and_help(capsys):
    from gumiho.cli import main as cli
    from gumiho.version import __version__

    assert cli(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"gumiho {__version__}")
    with pytest.raises(SystemExit) as done:
        cli(["help", "env"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: gumiho env")
    assert cli(["help"]) == 0 and capsys.readouterr().out.startswith("usage: gumiho {")
    assert cli(["help", "nosuch"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'nosuch'")


@pytest.mark.host
def test_requests_waiting_their_turn_hear_the_worker_stopped():
    """Ctrl-C on `gumiho serve` during one generation: the requests queued behind it (and
    any arriving after) waited forever, their clients dropped without an answer, instead of
    hearing that the server stopped (a 503)."""
    from gumiho.worker import Stopped, Worker

    worker, heard, started = Worker(), [], threading.Event()

    def interrupted():
        started.set()
        time.sleep(0.2)  # the others queue behind it
        raise KeyboardInterrupt

    def client(ask):
        try:
            heard.append(ask())
        except BaseException as exc:  # noqa: BLE001
            heard.append(exc)

    asks = [lambda: worker.call(interrupted), lambda: worker.call(lambda: 1),
            lambda: list(worker.iterate(lambda: iter([1, 2])))]
    threads = [threading.Thread(target=client, args=(asks[0],), daemon=True)]
    threads[0].start()
    runner = threading.Thread(target=lambda: client(worker.run_forever), daemon=True)
    runner.start()
    started.wait(10)
    for ask in asks[1:]:
        threads.append(threading.Thread(target=client, args=(ask,), daemon=True))
        threads[-1].start()
    while worker.jobs.qsize() < 2 and runner.is_alive():
        time.sleep(0.01)
    runner.join(10)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "a request still waits for a worker that stopped"
    late = threading.Thread(target=client, args=(asks[1],), daemon=True)
    late.start()
    late.join(10)
    assert not late.is_alive()
    assert sum(isinstance(x, KeyboardInterrupt) for x in heard) == 1  # run_forever's own
    assert sum(isinstance(x, Stopped) for x in heard) == 4, heard


@pytest.mark.host
def test_env_names_the_commit_only_where_there_is_one(monkeypatch):
    """An installed gumiho has no commit: `gumiho env` printed `gumiho 0.2.0 (gumiho 0.2.0)`."""
    from gumiho import env
    from gumiho.version import __version__

    facts = env.report()
    facts["gumiho"]["code"] = f"gumiho {__version__}"
    assert env.text(facts).splitlines()[0] == f"gumiho {__version__} at {facts['gumiho']['path']}"
    facts["gumiho"]["code"] = "abc1234+dirty"
    assert env.text(facts).splitlines()[0].startswith(f"gumiho {__version__} (abc1234+dirty) at ")


@pytest.mark.host
def test_a_child_killed_by_a_signal_without_a_name_is_reported():
    """A worker killed by a real-time signal (Linux: SIGRTMIN + n, 34-64, only some named)
    raised ValueError in the parent's report, an internal error instead of its line."""
    from gumiho.errors import how_it_ended

    assert how_it_ended(-40) == "was killed by signal 40"
    assert how_it_ended(-9) == "was killed by SIGKILL (out of memory?)"
    assert how_it_ended(-99) == "was killed by signal 99"
    assert how_it_ended(2) == "exited with status 2"
