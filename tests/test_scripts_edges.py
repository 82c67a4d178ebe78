"""Review of the measuring scripts (scripts/): what each measures is what its docstring and
the README say, and bad or plausible input gets one line, not a traceback."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env

ROOT = Path(__file__).parents[1]


def script(name: str):
    """scripts/NAME.py as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(f"review_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefix_reuse_ab_each_conversation_starts_fresh(tiny_target_dir, monkeypatch):
    """A later round's reuse conversation must not find an earlier round's sequences (an
    eager runner keeps the last four): its first turn then reused all but one prompt token
    and every later turn its whole prompt, and the medians reported were of those."""
    from gumiho import SpeculativeGenerator

    ab = script("prefix_reuse_ab")
    monkeypatch.setattr(ab, "TURNS", ab.TURNS[:2])
    gen = SpeculativeGenerator.load(tiny_target_dir, "ar")
    first, _ = ab.conversation(gen, True, 3)
    ab.conversation(gen, False, 3)  # the other arm between, as the rounds alternate
    again, _ = ab.conversation(gen, True, 3)
    assert first[0][1] == 0 and first[1][1] > 0  # the second turn reuses the first's
    assert [turn[:2] for turn in again] == [turn[:2] for turn in first]


def write_log(run: Path, rows: list[dict]) -> Path:
    run.mkdir()
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_compare_train_logs_takes_a_position_one_run_or_step_lacks(tmp_path, capsys):
    """A step that logged no accuracy for a later head (a batch with no position that far:
    `evaluate`'s note), or a run with fewer heads than the other (EAGLE-2 against Gumiho):
    that position is compared over the steps both logged, not a KeyError."""
    ctl = script("compare_train_logs")
    a = write_log(tmp_path / "a", [
        {"step": 1, "acc_serial1": 0.5, "acc_mlp1": 0.3},
        {"step": 2, "acc_serial1": 0.6},
        {"step": 2, "eval": {"acc_serial1": 0.55, "acc_mlp1": 0.2}}])
    b = write_log(tmp_path / "b", [
        {"step": 1, "acc_serial1": 0.52, "acc_mlp1": 0.35},
        {"step": 2, "acc_serial1": 0.61, "acc_mlp1": 0.3},
        {"step": 2, "eval": {"acc_serial1": 0.56, "acc_mlp1": 0.25}}])
    assert ctl.main([str(a), str(b), "--span", "2"]) == 0
    out = capsys.readouterr().out
    span = next(line for line in out.splitlines() if line.startswith("   1-2"))
    assert span.split()[2:] == ["+0.0150", "+0.0500"]  # serial1 over 2 steps, mlp1 over 1
    assert "held-out at step 2: serial1 +0.0100, mlp1 +0.0500" in out
    capsys.readouterr()
    assert ctl.main([str(b), str(tmp_path / "a"), "--span", "2"]) == 0  # either order
    eagle = write_log(tmp_path / "eagle", [{"step": 1, "acc_serial1": 0.5},
                                           {"step": 2, "acc_serial1": 0.6}])
    capsys.readouterr()
    assert ctl.main([str(eagle), str(b)]) == 0
    assert "mlp1" not in capsys.readouterr().out.splitlines()[1]  # only what both logged


@pytest.mark.host  # a CPU tool: the static engine's data flow timed on the CPU
def test_host_time_runs_with_its_defaults(capsys):
    """`python scripts/host_time.py` (default --method gumiho, no --draft) times the shipped
    drafter, not a traceback after the target loaded; a bad method is one line."""
    ht = script("host_time")
    assert ht.main(["--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("gumiho: ")
    assert ht.main(["--method", "bogus"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: unknown method 'bogus': use one of ar, lookup, gumiho, eagle2, medusa"]


@pytest.mark.parametrize("argv, says", [
    (["bench_peers.py", "--draft", "gumiho/assets/smollm2/gumiho"], "give METHOD=DIR"),
    (["bench_peers.py", "--methods", "ar,foo"], "unknown method 'foo'"),
    (["greedy_equality.py", "--methods", "gumiho,foo"], "foo not among"),
    (["cpu_ab.py", "--prompts", "0"], "--prompts: at least 1"),
])
def test_bad_arguments_stop_before_loading(argv, says):
    """A --draft without METHOD= (every other script's --draft is a DIR), an unknown method,
    or --prompts 0 (which took all the benchmark's questions but the last): argparse's one
    line and exit status 2, before any model loads, not a traceback after."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1]


def run_real_model(name: str, extra: str, **env) -> str:
    """The COMMON_ARGS that eval_common.sh's run_real_model hands its runs (no GPU check,
    nothing run)."""
    call = (f'source scripts/eval_common.sh; need_gpu() {{ :; }}; '
            f'run_all() {{ echo "[$COMMON_ARGS]"; }}; run_real_model {name} "{extra}"')
    proc = subprocess.run(["bash", "-c", call], cwd=ROOT, capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items() if k != "COMMON_ARGS"},
                               "TARGET": str(ROOT), "GUMIHO_DRAFT": str(ROOT), **env},
                          check=True)
    return proc.stdout.splitlines()[0]


def test_eval_vicuna_keeps_its_template_under_common_args():
    """eval_vicuna.sh's --chat-template vicuna stays when the caller sets COMMON_ARGS (it
    was dropped with the default --device cuda: prompts without the paper's layout)."""
    assert run_real_model("vicuna", "--chat-template vicuna") == \
        "[--device cuda --chat-template vicuna]"
    assert run_real_model("vicuna", "--chat-template vicuna",
                          COMMON_ARGS="--dtype float16") == \
        "[--dtype float16 --chat-template vicuna]"
    assert run_real_model("llama3", "", COMMON_ARGS="--dtype float16") == "[--dtype float16]"


def test_the_cpu_measures_load_on_the_cpu_on_any_machine(monkeypatch):
    """host_time.py (a step's body timed as it runs: a GPU's would be its launch) and
    bench_train_throughput.py (CPU-seconds, the CPU's autocast) load their target on the
    CPU, not on the machine's default device."""
    from gumiho.errors import GumihoError

    seen = []

    def stop(*args, **kwargs):
        seen.append(kwargs.get("device"))
        raise GumihoError("loaded")

    ht = script("host_time")
    monkeypatch.setattr(ht.SpeculativeGenerator, "load", stop)
    assert ht.main(["--method", "ar"]) == 2
    bt = script("bench_train_throughput")
    monkeypatch.setattr(bt, "load_target", stop)
    monkeypatch.setattr(sys, "argv", ["bench_train_throughput.py", "--data", "unused"])
    with pytest.raises(GumihoError):
        bt.main()
    assert seen == ["cpu", "cpu"]
