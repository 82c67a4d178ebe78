"""Data generation refuses what would mix or lose data: a resume with settings that change
a shard's bytes, another data file under the same name, an edited manifest, a template
that writes no messages, a folder that is not a data dir; its workers die with it, a
killed one is named with its signal, and progress counts conversations."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gumiho.errors import GumihoError
from gumiho.ge_data import allocation, worker
from gumiho.ge_data.shards import MANIFEST, load_samples, shard_path

from conftest import child_env

TINY = ["--end", "4", "--shard-size", "2", "--max-len", "64"]
REGEN = ["--regenerate", "--max-len", "256"]  # room for a prompt and a reply
DROP = object()  # edit_manifest: remove the key
NEW_KEYS = ("compute_dtype", "data_path", "data_bytes", "data_sha256")  # old manifests lack
CHAT = [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello there!"}]


def alloc(out: Path, target: str, *extra: str) -> int:
    return allocation.main(["--outdir", str(out), "--target", target, *TINY, *extra])


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def edit_manifest(out: Path, **changes) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    manifest.update(changes)
    manifest = {k: v for k, v in manifest.items() if v is not DROP}
    (out / MANIFEST).write_text(json.dumps(manifest))



@pytest.fixture(scope="module")
def regen_dir(tmp_path_factory, tiny_target_dir):
    out = tmp_path_factory.mktemp("regen") / "d"
    assert alloc(out, tiny_target_dir, *REGEN, "--regen-max-tokens", "4") == 0
    return out


@pytest.mark.parametrize("extra, said", [
    (["--regen-max-tokens", "8"], "regen_max_tokens=4, not 8"),
    (["--regen-max-tokens", "4", "--regen-batch-size", "2"], "regen_batch_size=32, not 2"),
    (["--regen-max-tokens", "4", "--target-dtype", "bfloat16"],
     "compute_dtype='float32', not 'bfloat16'"),
])
def test_a_resume_with_settings_that_change_the_shards_is_refused(
        regen_dir, tiny_target_dir, capsys, extra, said):
    shard_path(regen_dir, 1).unlink(missing_ok=True)
    assert alloc(regen_dir, tiny_target_dir, *REGEN, *extra) == 2
    assert error_lines(capsys) == [f"error: {regen_dir} holds data made with {said}: use "
                                   "another --outdir or the same settings"]
    assert not shard_path(regen_dir, 1).exists()


def test_settings_that_leave_the_shards_alone_resume(regen_dir, tiny_target_dir):
    """The dtype the target ran in, named or by default, and the workers: not compared."""
    shard_path(regen_dir, 1).unlink(missing_ok=True)
    assert alloc(regen_dir, tiny_target_dir, *REGEN, "--regen-max-tokens", "4",
                 "--target-dtype", "float32", "--workers", "2") == 0
    assert shard_path(regen_dir, 1).exists()


def test_without_regenerate_its_settings_are_not_compared(tmp_path, tiny_target_dir):
    out = tmp_path / "d"
    assert alloc(out, tiny_target_dir, "--end", "2") == 0
    assert alloc(out, tiny_target_dir, "--end", "2", "--regen-max-tokens", "9") == 0


def test_a_manifest_from_older_code_still_resumes(tmp_path, tiny_target_dir, monkeypatch):
    """Made before compute_dtype and the data's content were recorded: its data name is
    compared by place (another name of the same file is the same data)."""
    data = tmp_path / "c.json"
    data.write_text(json.dumps([{"id": f"c{i}", "conversations": CHAT} for i in range(4)]))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "d"
    assert alloc(out, tiny_target_dir, "--data", "c.json") == 0
    edit_manifest(out, **dict.fromkeys(NEW_KEYS, DROP))
    shard_path(out, 1).unlink()
    assert alloc(out, tiny_target_dir, "--data", str(data)) == 0
    assert shard_path(out, 1).exists()
    assert json.loads((out / MANIFEST).read_text())["data_path"] == str(data.resolve())


def test_the_data_file_is_compared_by_content_not_by_name(tmp_path, tiny_target_dir,
                                                          monkeypatch, capsys):
    """The same relative --data from another folder is another file: refused. The same
    file by its absolute path, or moved, is the same data: resumed, from where it is."""
    for folder, word in (("a", "Hello"), ("b", "Goodbye")):
        (tmp_path / folder).mkdir()
        chat = [CHAT[0], {"from": "gpt", "value": f"{word} there!"}]
        (tmp_path / folder / "c.json").write_text(json.dumps(
            [{"id": f"c{i}", "conversations": chat} for i in range(4)]))
    out = tmp_path / "d"
    monkeypatch.chdir(tmp_path / "a")
    assert alloc(out, tiny_target_dir, "--data", "c.json") == 0
    shard_path(out, 1).unlink()
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    assert alloc(out, tiny_target_dir, "--data", "c.json") == 2
    [line] = error_lines(capsys)
    assert "holds data made with data='c.json' (sha256" in line
    assert not shard_path(out, 1).exists()
    moved = tmp_path / "moved.json"
    os.replace(tmp_path / "a" / "c.json", moved)
    assert alloc(out, tiny_target_dir, "--data", str(moved)) == 0
    assert {s["id"] for s in load_samples(out)[1]} <= {f"c{i}" for i in range(4)}


def test_the_target_is_compared_by_where_it_is_not_by_name(tmp_path, tiny_target_dir,
                                                           monkeypatch, capsys):
    """The same relative --target from another folder is another model dir: refused (it
    used to mix two models' features in one data dir). The same dir by its absolute path,
    or moved, resumes, and the workers load it from where it is."""
    for folder in ("a", "b"):
        shutil.copytree(tiny_target_dir, tmp_path / folder / "t")
    out = tmp_path / "d"
    monkeypatch.chdir(tmp_path / "a")
    assert alloc(out, "t") == 0
    shard_path(out, 1).unlink()
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    assert alloc(out, "t") == 2
    [line] = error_lines(capsys)
    assert f"holds data made with target='t' ({tmp_path / 'a' / 't'}), not 't' " \
           f"({tmp_path / 'b' / 't'})" in line
    assert not shard_path(out, 1).exists()
    assert alloc(out, str(tmp_path / "a" / "t")) == 0
    shard_path(out, 1).unlink()
    os.replace(tmp_path / "a", tmp_path / "c")  # the dir moved: the name as typed, from there
    monkeypatch.chdir(tmp_path / "c")
    assert alloc(out, "t") == 0 and shard_path(out, 1).exists()
    assert json.loads((out / MANIFEST).read_text())["target_path"] == str(tmp_path / "c" / "t")


@pytest.mark.parametrize("changes, said", [
    ({"num_shards": 1}, "num_shards 1, but conversations 0..3 in shards of 2 make 2"),
    ({"num_shards": -1}, "num_shards -1"),
    ({"num_shards": 1, "end": 2}, "num_shards 1, but shard_00001.pt is there"),
    ({"shard_size": 0}, "start 0, end 4, shard_size 0"),
])
def test_an_edited_manifest_is_refused(tmp_path, tiny_target_dir, capsys, changes, said):
    out = tmp_path / "d"
    assert alloc(out, tiny_target_dir, "--end", "4") == 0
    edit_manifest(out, **changes)
    before = (out / MANIFEST).read_text()
    capsys.readouterr()
    assert alloc(out, tiny_target_dir, "--end", "4") == 2
    assert error_lines(capsys) == [f"error: {out / MANIFEST} is inconsistent ({said}): it "
                                   "was edited or damaged; restore it or make the data "
                                   "again in another --outdir"]
    assert (out / MANIFEST).read_text() == before
    with pytest.raises(GumihoError, match="is inconsistent"):
        load_samples(out)


@pytest.mark.parametrize("template, said", [
    ("nosuch", "--template 'nosuch' is not a template: use one of vicuna"),
    ("Hello {{ bos_token }}", "does not write out the messages' content"),
])
def test_a_template_that_writes_no_messages_is_refused_first(tmp_path, tiny_target_dir,
                                                              capsys, template, said):
    out = tmp_path / "d"
    assert alloc(out, tiny_target_dir, "--template", template) == 2
    [line] = error_lines(capsys)
    assert said in line
    assert not out.exists()


def test_vicuna_and_a_jinja_template_are_accepted(tmp_path, tiny_target_dir):
    jinja = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}"
             "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    for name, template in (("v", "vicuna"), ("j", jinja)):
        assert alloc(tmp_path / name, tiny_target_dir, "--end", "2", "--template",
                     template) == 0


def test_a_folder_that_is_not_a_data_dir_is_refused(tmp_path, tiny_target_dir, capsys):
    drafter = tmp_path / "drafter"
    (drafter / "state").mkdir(parents=True)
    (drafter / "model.safetensors").write_bytes(b"weights")
    assert alloc(drafter, tiny_target_dir) == 2
    assert error_lines(capsys) == [
        f"error: --outdir {drafter} is not a data folder (it holds model.safetensors and 1 "
        "more, no manifest.json): use an empty or new folder"]
    assert sorted(p.name for p in drafter.iterdir()) == ["model.safetensors", "state"]


def test_an_empty_folder_or_a_killed_first_run_is_resumed(tmp_path, tiny_target_dir):
    """A run killed before its manifest was in place leaves at most temp files."""
    empty, killed = tmp_path / "empty", tmp_path / "killed"
    empty.mkdir()
    killed.mkdir()
    (killed / "manifest.json.tmp").write_text('{"num_')
    (killed / "shard_00000.pt.tmp").write_bytes(b"half")
    for out in (empty, killed):
        assert alloc(out, tiny_target_dir, "--end", "2") == 0
        assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "shard_00000.pt"]


def test_a_worker_killed_by_a_signal_is_named(tmp_path, tiny_target_dir, monkeypatch,
                                               capsys):
    """Not "it crashed", exit 2 (bad input): the signal, and the status a shell shows."""
    popen = subprocess.Popen
    die = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    monkeypatch.setattr(allocation.subprocess, "Popen", lambda cmd, **kw: popen(die, **kw))
    assert alloc(tmp_path / "d", tiny_target_dir, "--workers", "2") == 128 + 9
    assert error_lines(capsys) == [
        "error: 2 worker(s) failed, worker 0 was killed by SIGKILL (out of memory?); "
        "finished shards are kept: rerun the same command to resume"]


PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                         text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""
CHILD = """
import os, sys, time
from gumiho.ge_data.worker import die_with_parent
print(die_with_parent(os.getppid()), flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_workers_die_with_allocation_even_by_kill_9(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], env=child_env(),
                              stdout=subprocess.PIPE, text=True)
    pid, ready = parent.stdout.readline().split()
    assert ready == "True"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(int(pid))


def alive(pid: int) -> bool:
    """Running and not a zombie waiting for its (new) parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_worker_whose_parent_is_gone_does_nothing(tmp_path):
    script = ("import sys; from gumiho.ge_data import worker; sys.exit(worker.main(["
              f"'--outdir', {str(tmp_path)!r}, '--shards', '0', '--parent-pid', '1']))")
    proc = subprocess.run([sys.executable, "-c", script], env=child_env(), timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr == ""


def test_progress_counts_conversations(tmp_path, tiny_target_dir, monkeypatch):
    bars = []

    class Bar:
        def __init__(self, *args, **kwargs):
            self.kwargs, self.done = kwargs, 0
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.done += n

    monkeypatch.setattr(worker, "tqdm", Bar)
    out = tmp_path / "d"
    assert alloc(out, tiny_target_dir, "--end", "5", "--shard-size", "3") == 0
    [bar] = bars
    assert bar.kwargs["total"] == 5 and bar.kwargs["unit"] == "conv" and bar.done == 5
    shard_path(out, 0).unlink()
    assert alloc(out, tiny_target_dir, "--end", "5", "--shard-size", "3") == 0
    assert bars[1].kwargs["total"] == 3 and bars[1].done == 3
    # with --regenerate the bar moves as replies are generated (most of the time), batch by
    # batch, each conversation counted once
    steps = []
    monkeypatch.setattr(Bar, "update", lambda self, n=1: steps.append(n) or None)
    assert alloc(tmp_path / "r", tiny_target_dir, *REGEN, "--end", "5", "--shard-size", "5",
                 "--regen-max-tokens", "2", "--regen-batch-size", "2") == 0
    assert sum(steps) == 5 and steps[-3:] == [2, 2, 1], steps
