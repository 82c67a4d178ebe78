"""The timing tool runs end to end and its per-phase profile is consistent."""

import json

import pytest
import torch

from gumiho.errors import GumihoError
from gumiho.evaluation import timing


def test_timing_tool_reports_every_phase(tiny_target_dir, capsys):
    code = timing.main(["--target", tiny_target_dir, "--widths", "1,4", "--methods",
                        "gumiho,eagle2,medusa", "--repeats", "1", "--context", "16", "--json",
                        "--max-new-tokens", "8", "--tau", "3", "--total-tokens", "8",
                        "--top-k", "3", "--mlp-topk", "3", "--pruning", "3", "--kernels", "4"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from gumiho.graphs import default_engine

    assert set(report["verify_s"]) == {"1", "4"}
    assert report["engine"] == default_engine(torch.device(report["device"]))
    assert set(report["cycles"]) == {"gumiho", "eagle2", "medusa"}
    gumiho = report["cycles"]["gumiho"]
    assert gumiho["identical_to_plain"] and gumiho["tree"]["total_tokens"] == 8
    if report["engine"] == "eager":  # drafting's parts; recorded, drafting is one step
        assert set(gumiho["per_cycle_s"]) == {"draft", "draft_catchup", "draft_serial",
                                              "draft_heads", "draft_tree", "verify",
                                              "accept_commit"}
        assert gumiho["per_cycle_s"]["draft_serial"] > 0
        assert gumiho["per_cycle_s"]["draft_heads"] > 0
        assert "draft_heads" not in report["cycles"]["eagle2"]["per_cycle_s"] or \
            report["cycles"]["eagle2"]["per_cycle_s"]["draft_heads"] == 0
    else:
        assert set(gumiho["per_cycle_s"]) == {"draft", "verify", "accept_commit"}
    # building the tree, timed alone (a part of the recorded drafting step otherwise); not
    # compared with the drafting's time: two timings of a shared machine (on the seventh
    # lease's GPU, beside 7 other test workers, 3.8 ms alone against 3.0 ms for all of it)
    assert 0 < gumiho["tree_build_s"] < float("inf")
    assert report["cycles"]["medusa"]["tree_build_s"] is None  # a fixed tree
    # the projection is tau x plain step / cycle, both timed without the profile's syncs
    wall = gumiho["unprofiled"]
    assert wall["cycle_s"] > 0 and wall["plain_step_s"] > 0
    expected = 3 * wall["plain_step_s"] / wall["cycle_s"]
    assert gumiho["projected"]["speedup"] == pytest.approx(expected)
    # --kernels: what the cycles past the first spend their time on, most first
    for key, wall_s in (("kernels", wall["cycle_s"]), ("plain_kernels", wall["plain_step_s"])):
        table = gumiho[key]
        assert table["cycles"] >= 1 and len(table["top"]) == 4
        spent = [row["s"] for row in table["top"]]
        assert spent == sorted(spent, reverse=True) and spent[-1] > 0
        assert all(row["calls"] > 0 and row["name"] for row in table["top"])
        assert sum(spent) <= table["busy_s"] * (1 + 1e-9) and table["busy_s"] < 50 * wall_s
    # plain decoding's table is made once, for every method (its times would differ)
    assert all(report["cycles"][m]["plain_kernels"] == gumiho["plain_kernels"]
               for m in ("eagle2", "medusa"))
    # the drafter's own products show up in the drafting cycle, not in plain decoding's
    assert gumiho["kernels"]["busy_s"] > gumiho["plain_kernels"]["busy_s"]
    timing.print_report({**report, "cycles": {"gumiho": gumiho}})
    printed = capsys.readouterr().out
    assert "the most per cycle" in printed and gumiho["kernels"]["top"][0]["name"][:40] in printed


def test_a_random_draft_vocabulary_shrinks_the_drafter_head(tiny_target_dir, capsys):
    assert timing.main(["--target", tiny_target_dir, "--widths", "1", "--methods", "gumiho",
                        "--repeats", "1", "--context", "16", "--json", "--max-new-tokens",
                        "4", "--total-tokens", "8", "--draft-vocab", "64"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["cycles"]["gumiho"]["draft_vocab"] == 64
    from gumiho.drafters import load_drafter
    from gumiho.target import load_target

    drafter = load_drafter("gumiho", load_target(tiny_target_dir), "random", random_vocab=64)
    assert drafter.model.config.draft_vocab_size == 64


def test_shape_builds_a_random_llama_of_that_size():
    config = timing.shape_config("llama3-8b", layers=1)  # building it: ~35 s on 2 cores
    assert (config.hidden_size, config.num_key_value_heads, config.vocab_size) == \
        (4096, 8, 128256)
    assert config.num_hidden_layers == 1
    target = timing.shape_target("smollm2", "cpu", "float32", layers=2)
    config = target.model.config
    assert (config.hidden_size, config.num_key_value_heads, config.vocab_size) == \
        (576, 3, 49152)
    assert config.num_hidden_layers == 2 and target.tokenizer is None
    assert target.model.model.embed_tokens.weight.std() > 0  # random, not empty
    with pytest.raises(GumihoError, match="unknown shape"):
        timing.shape_config("llama3-70b")


def test_projected_speedup_arithmetic():
    assert timing.projected_speedup(3.0, 0.010, 0.015) == pytest.approx(2.0)


def test_tree_building_is_timed_where_a_captured_engine_ignores_the_floors(tiny_target):
    """Captured steps cannot read path scores on the host, so they draft without
    --min-confidence / --extend-confidence; the eager stand-in that times the tree's
    building must drop them too. Eager drafting with floors builds on the host: no step."""
    from gumiho.config import TreeConfig
    from gumiho.drafters import load_drafter
    from gumiho.evaluation.profiling import tree_build_s

    tree = TreeConfig.for_method("gumiho", total_tokens=8, top_k=3, mlp_topk=3, pruning=3,
                                 depth=4, min_confidence=0.05, extend_confidence=0.2)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    static = load_drafter("gumiho", tiny_target, "random", tree=tree, engine="static")
    assert static.one_step and tree_build_s(tiny_target, static, ids, "static", repeats=2) > 0
    eager = load_drafter("gumiho", tiny_target, "random", tree=tree, engine="eager")
    assert not eager.one_step and tree_build_s(tiny_target, eager, ids, "eager") is None


@pytest.mark.host  # a CPU tool: on a GPU machine too, with the CPU as the default device
def test_step_anatomy_splits_a_step_and_counts_a_proposal(capsys):
    """scripts/step_anatomy.py (a CPU tool: its target loads on the CPU on any machine) runs
    end to end on SmolLM2, its parts add up to the step, and the kernels it timed are the
    modules' own again afterwards."""
    import importlib.util
    from pathlib import Path

    from gumiho import rowamx, rowgemm, rowlayer

    path = Path(__file__).parents[1] / "scripts" / "step_anatomy.py"
    spec = importlib.util.spec_from_file_location("step_anatomy", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    kernels = rowgemm.kernel, rowamx.kernel
    assert script.main(["--dtype", "float32", "--widths", "1,5", "--repeats", "1",
                        "--total-tokens", "4"]) == 0
    assert (rowgemm.kernel, rowamx.kernel) == kernels
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 1 ")
            or line.startswith("| 5 ")]
    assert len(rows) == 2
    for row in rows:
        if rowlayer.enabled():
            assert float(row[2]) > 0  # the step in one C call
        step = float(row[3].split()[0])
        products, attention, rest = (float(x) for x in row[4:7])
        assert products >= 0 and attention >= 0 and rest > 0
        assert products + attention + rest == pytest.approx(step, abs=0.11)
        if rowgemm.kernel() is not None:
            assert products > 0 and attention > 0
    assert "torch operations each" in out


def test_the_projection_takes_the_runs_tokens_per_verify_cycle(tiny_target_dir, capsys):
    """Without --tau the projection multiplies the per-verify-cycle times by the tokens a
    verify cycle made, not by tau, which counts the prefill as a cycle of one token."""
    assert timing.main(["--target", tiny_target_dir, "--widths", "1", "--methods", "gumiho",
                        "--draft", "random", "--repeats", "1", "--context", "16", "--json",
                        "--max-new-tokens", "12", "--total-tokens", "4"]) == 0
    cycle = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cycles"]["gumiho"]
    assert cycle["projected"]["tau"] == cycle["tokens_per_verify"]
    assert cycle["tokens_per_verify"] >= cycle["tau"]
