"""The timing tool runs end to end and its profile of real generation is consistent."""

import json

from gumiho.evaluation import timing


def test_timing_tool_reports_every_phase(tiny_target_dir, capsys):
    code = timing.main(["--target", tiny_target_dir, "--widths", "1,4", "--methods",
                        "gumiho,eagle2,medusa", "--repeats", "1", "--context", "16", "--json",
                        "--profile-draft", "random", "--max-new-tokens", "8",
                        "--total-tokens", "8", "--top-k", "3", "--mlp-topk", "3",
                        "--pruning", "3"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["verify_s"]) == {"1", "4"}
    assert set(report["draft_s"]) == {"gumiho", "eagle2", "medusa"}
    profile = report["profile"]
    assert set(profile["per_cycle_s"]) == {"draft", "verify", "accept_commit"}
    assert profile["identical_to_plain"] and profile["tree"]["total_tokens"] == 8
    assert all(v > 0 for v in profile["per_cycle_s"].values())
