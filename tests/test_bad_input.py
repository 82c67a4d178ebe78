"""Bad input gets one clear line and loses nothing (issue 13).

The table runs each command's `main` in-process on bad input and checks: exit status 2,
exactly one stderr line starting `error:` (the last one), no exception escaping (no
traceback), and every file that existed before unchanged.
"""

import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gumiho.errors import GumihoError, cli_errors

from conftest import child_env

ANSWER_ARGS = ["--method", "ar", "--bench", "mt_bench", "--question-end", "2",
               "--max-new-tokens", "3", "--warmup", "0"]
ALLOC_ARGS = ["--end", "4", "--shard-size", "2", "--max-len", "64"]
HI = ["--target", "{tiny}", "--prompt", "hi"]  # a generate call that would otherwise run
RANDOM_GUMIHO = ["--method", "gumiho", "--draft", "random"]
RANDOM_MEDUSA = ["--method", "medusa", "--draft", "random"]
# (module, argv) -- {tiny}: a tiny target dir; {dir}: the case's own folder of victims.
BAD = {
    # export: never writes into a file or over another directory's files
    "export_out_is_a_file": ("export", ["--draft", "{dir}/drafter", "--target", "{tiny}",
                                        "--out", "{dir}/README.md"]),
    "export_out_not_empty": ("export", ["--draft", "{dir}/drafter", "--target", "{tiny}",
                                        "--out", "{dir}/olddata"]),
    "export_unknown_format": ("export", ["--draft", "{dir}/drafter", "--out", "{dir}/new",
                                         "--format", "onnx"]),
    "generate_draft_is_a_file": ("generate", ["--target", "{tiny}", "--method", "gumiho",
                                              "--draft", "{dir}/t.csv", "--prompt", "hi"]),
    "train_draft_vocab_beyond_vocabulary": (
        "train", ["--target", "{tiny}", "--online", "--num-conversations", "2", "--max-len",
                  "32", "--output-dir", "{dir}/run", "--draft-vocab", "999999999"]),
    "train_draft_vocab_negative": ("train", ["--target", "{tiny}", "--online", "--output-dir",
                                             "{dir}/run", "--draft-vocab", "-5"]),
    "accuracy_draft_vocab_negative": ("accuracy", ["--draft", "{dir}/drafter", "--data",
                                                   "{dir}/olddata", "--draft-vocab", "-5"]),
    # gen_answers: never rewrites a file that is not its own, never resumes on mismatch
    "answers_into_readme": ("gen_answers", ["--target", "{tiny}", *ANSWER_ARGS,
                                            "--answer-file", "{dir}/README.md"]),
    "answers_into_csv_even_with_overwrite": (
        "gen_answers", ["--target", "{tiny}", *ANSWER_ARGS, "--answer-file", "{dir}/t.csv",
                        "--overwrite"]),
    "answers_corrupt_middle_line": ("gen_answers", ["--target", "{tiny}", *ANSWER_ARGS,
                                                    "--answer-file", "{dir}/broken.jsonl"]),
    "answers_other_max_new_tokens": (
        "gen_answers", ["--target", "{tiny}", "--method", "ar", "--bench", "mt_bench",
                        "--question-end", "3", "--max-new-tokens", "7", "--warmup", "0",
                        "--answer-file", "{dir}/answers.jsonl"]),
    "answers_other_method": ("gen_answers", ["--target", "{tiny}", "--method", "gumiho",
                                             "--draft", "random", "--bench", "mt_bench",
                                             "--max-new-tokens", "3", "--answer-file",
                                             "{dir}/answers.jsonl"]),
    "answers_file_is_a_dir": ("gen_answers", ["--target", "{tiny}", *ANSWER_ARGS,
                                              "--answer-file", "{dir}"]),
    "answers_folder_is_a_file": ("gen_answers", ["--target", "{tiny}", *ANSWER_ARGS,
                                                 "--answer-file", "{dir}/README.md/a.jsonl"]),
    "answers_begin_beyond_questions": ("gen_answers", [
        "--target", "{tiny}", "--method", "ar", "--bench", "mt_bench", "--question-begin",
        "80", "--answer-file", "{dir}/new.jsonl"]),
    "answers_end_before_begin": ("gen_answers", [
        "--target", "{tiny}", "--method", "ar", "--bench", "humaneval", "--question-begin",
        "5", "--question-end", "5", "--answer-file", "{dir}/new.jsonl"]),
    "answers_nan_temperature": ("gen_answers", ["--target", "{tiny}", *ANSWER_ARGS,
                                                "--temperature", "nan", "--answer-file",
                                                "{dir}/new.jsonl"]),
    "answers_max_new_tokens_past_context": (
        "gen_answers", ["--target", "{tiny}", "--method", "ar", "--bench", "mt_bench",
                        "--max-new-tokens", "5000", "--answer-file", "{dir}/new.jsonl"]),
    # interleave: every run's file is checked before anything loads or is written
    "interleave_one_run_into_readme": ("interleave", [
        "--target", "{tiny}", "--bench", "mt_bench", "--max-new-tokens", "3",
        "--run", "--method ar --answer-file {dir}/new.jsonl",
        "--run", "--method lookup --answer-file {dir}/README.md"]),
    "interleave_one_run_other_settings": ("interleave", [
        "--target", "{tiny}", "--bench", "mt_bench", "--max-new-tokens", "7",
        "--run", "--method lookup --answer-file {dir}/new.jsonl",
        "--run", "--method ar --answer-file {dir}/answers.jsonl"]),
    "interleave_shared_flag_inside_run": ("interleave", [
        "--target", "{tiny}", "--bench", "mt_bench",
        "--run", "--method ar --max-new-tokens 3 --answer-file {dir}/new.jsonl"]),
    # generate
    "generate_huge_max_new_tokens": ("generate", [*HI, "--max-new-tokens", "1000000000000"]),
    "generate_prompt_plus_max_new_tokens_past_context": (
        "generate", [*HI, "--max-new-tokens", "1010"]),
    "generate_demo_preset_without_a_drafter": ("generate", [*HI, "--preset", "demo"]),
    "generate_whitespace_prompt": ("generate", ["--target", "{tiny}", "--prompt", " \n\t"]),
    "generate_nan_temperature": ("generate", [*HI, "--temperature", "nan"]),
    "generate_negative_temperature": ("generate", [*HI, "--temperature", "-0.5"]),
    "generate_zero_top_p": ("generate", [*HI, "--temperature", "1", "--top-p", "0"]),
    "generate_negative_sample_top_k": ("generate", [*HI, "--temperature", "1",
                                                    "--sample-top-k", "-3"]),
    "generate_min_p_above_one": ("generate", [*HI, "--temperature", "1", "--min-p", "1.5"]),
    "generate_zero_repetition_penalty": ("generate", [*HI, "--repetition-penalty", "0"]),
    "generate_word_repetition_penalty": ("generate", [*HI, "--repetition-penalty", "high"]),
    "generate_empty_stop": ("generate", [*HI, "--stop", ""]),
    "generate_stop_token_id_beyond_vocab": ("generate", [*HI, "--stop-token-id", "10000000"]),
    "generate_negative_stop_token_id": ("generate", [*HI, "--stop-token-id", "-2"]),
    "generate_negative_no_repeat_ngram_size": ("generate", [*HI, "--no-repeat-ngram-size",
                                                            "-1"]),
    "generate_top_logprobs_past_20": ("generate", [*HI, "--top-logprobs", "21"]),
    "generate_logit_bias_without_a_bias": ("generate", [*HI, "--logit-bias", "12"]),
    "generate_logit_bias_past_100": ("generate", [*HI, "--logit-bias", "12=150"]),
    "generate_logit_bias_id_beyond_vocab": ("generate", [*HI, "--logit-bias", "99999999=1"]),
    "generate_logit_bias_twice": ("generate", [*HI, "--logit-bias", "5=1",
                                               "--logit-bias", "5=2"]),
    "generate_min_tokens_past_max_new_tokens": ("generate", [*HI, "--max-new-tokens", "4",
                                                             "--min-tokens", "5"]),
    "generate_big_presence_penalty": ("generate", [*HI, "--presence-penalty", "3"]),
    "generate_word_frequency_penalty": ("generate", [*HI, "--frequency-penalty", "lots"]),
    "generate_banana_device": ("generate", [*HI, "--device", "banana"]),
    "generate_mlp_topk_beyond_vocab": ("generate", [*HI, *RANDOM_GUMIHO, "--mlp-topk",
                                                    "100000"]),
    "generate_top_k_beyond_vocab": ("generate", [*HI, "--method", "eagle2", "--draft",
                                                 "random", "--top-k", "60000"]),
    "generate_fta_with_eagle2": ("generate", [*HI, "--method", "eagle2", "--draft", "random",
                                              "--fta", "exact"]),
    "generate_lookup_first_without_lookup": ("generate", [*HI, *RANDOM_GUMIHO,
                                                          "--lookup-first"]),
    "generate_lookup_first_with_plain_lookup": ("generate", [*HI, "--method", "lookup",
                                                             "--lookup-first"]),
    "generate_negative_draft_gate": ("generate", [*HI, *RANDOM_GUMIHO, "--draft-gate", "-1"]),
    "generate_draft_gate_without_drafter": ("generate", [*HI, "--method", "ar",
                                                         "--draft-gate", "1.3"]),
    "generate_min_confidence_one": ("generate", [*HI, *RANDOM_GUMIHO, "--min-confidence",
                                                 "1"]),
    "generate_min_confidence_with_medusa": ("generate", [*HI, *RANDOM_MEDUSA,
                                                         "--min-confidence", "0.2"]),
    "generate_extend_confidence_one": ("generate", [*HI, *RANDOM_GUMIHO,
                                                    "--extend-confidence", "1"]),
    "generate_extend_confidence_with_medusa": ("generate", [*HI, *RANDOM_MEDUSA,
                                                            "--extend-confidence", "0.4"]),
    "train_init_from_missing": ("train", ["--target", "{tiny}", "--online", "--output-dir",
                                          "{dir}/never", "--init-from", "{dir}/nowhere"]),
    "generate_broken_chat_template": ("generate", [*HI, "--chat-template", "{{ oops("]),
    "generate_verify_width_below_the_tree": ("generate", [*HI, *RANDOM_GUMIHO, "--total-tokens",
                                                          "16", "--verify-width", "8"]),
    # told before the (here broken) target loads
    "generate_empty_draft_dir": ("generate", ["--target", "{dir}/truncated", "--method",
                                              "gumiho", "--draft", "{dir}/empty_draft",
                                              "--prompt", "hi"]),
    "generate_graphs_engine_here": ("generate", ["--target", "{dir}/truncated", "--engine",
                                                 "graphs", "--prompt", "hi"]),
    "generate_chat_template_without_the_messages": ("generate", [*HI, "--chat-template",
                                                                 "{{ messages[5] }}"]),
    "generate_truncated_weights": ("generate", ["--target", "{dir}/truncated", "--prompt",
                                                "hi"]),
    "generate_target_without_tokenizer": ("generate", ["--target", "{dir}/no_tokenizer",
                                                       "--prompt", "hi"]),
    "generate_garbage_drafter_config": ("generate", [*HI, "--method", "gumiho", "--draft",
                                                     "{dir}/drafter"]),
    "generate_seed_not_a_number": ("generate", [*HI, "--seed", "x"]),
    # timing
    "timing_widths_not_numbers": ("timing", ["--target", "{tiny}", "--widths", "a,b"]),
    "timing_width_zero": ("timing", ["--target", "{tiny}", "--widths", "0"]),
    "timing_repeats_zero": ("timing", ["--target", "{tiny}", "--repeats", "0"]),
    "timing_unknown_method": ("timing", ["--target", "{tiny}", "--methods", "gumiho,ar"]),
    "timing_context_past_positions": ("timing", ["--target", "{tiny}", "--widths", "8",
                                                 "--context", "5000"]),
    "timing_draft_vocab_of_a_trained_drafter": ("timing", ["--target", "{tiny}", "--methods",
                                                           "gumiho", "--draft", "{dir}",
                                                           "--draft-vocab", "64"]),
    # vocab_sizes
    "vocab_sizes_not_numbers": ("vocab_sizes", ["--sizes", "4096,foo"]),
    "vocab_sizes_beyond_vocabulary": ("vocab_sizes", ["--target", "{tiny}", "--sizes",
                                                      "8,999999", "--new-tokens", "0"]),
    # speed
    "speed_on_a_readme": ("speed", ["--answers", "{dir}/README.md", "--out", "{dir}/r"]),
    "speed_missing_file": ("speed", ["--answers", "{dir}/nope.jsonl", "--out", "{dir}/r"]),
    "speed_out_would_clobber_readme": ("speed", ["--answers", "{dir}/answers.jsonl", "--out",
                                                 "{dir}/README"]),
    # allocation
    "alloc_start_beyond_data": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                               "--start", "100000"]),
    "alloc_start_after_end": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                             "--start", "10", "--end", "5"]),
    "alloc_negative_start": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                            "--start", "-3"]),
    "alloc_max_len_zero": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                          "--max-len", "0"]),
    "alloc_shard_size_zero": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                             "--shard-size", "0"]),
    "alloc_workers_zero": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                          "--workers", "0"]),
    "alloc_outdir_is_a_file": ("allocation", ["--outdir", "{dir}/README.md", "--target",
                                              "{tiny}", *ALLOC_ARGS]),
    "alloc_garbage_manifest": ("allocation", ["--outdir", "{dir}/olddata", "--target",
                                              "{tiny}", *ALLOC_ARGS]),
    "alloc_no_usable_conversations": ("allocation", ["--outdir", "{dir}/data", "--target",
                                                     "{tiny}", "--data", "{dir}/t.csv"]),
    "alloc_empty_split": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                         "--data", "{dir}/two_train.json", "--split",
                                         "held_out"]),
    "alloc_broken_template": ("allocation", ["--outdir", "{dir}/data", "--target", "{tiny}",
                                             "--template", "{% for %}", *ALLOC_ARGS]),
}
MODULES = {"gen_answers": "gumiho.evaluation.gen_answers", "generate": "gumiho.generate",
           "interleave": "gumiho.evaluation.interleave",
           "timing": "gumiho.evaluation.timing", "speed": "gumiho.evaluation.speed",
           "allocation": "gumiho.ge_data.allocation", "export": "gumiho.export",
           "train": "gumiho.train.__main__", "accuracy": "gumiho.train.accuracy",
           "vocab_sizes": "gumiho.evaluation.vocab_sizes"}


def answer_record(qid: int, target: str, max_new_tokens: int = 3) -> dict:
    return {"question_id": qid, "turns": [{"text": "x", "new_tokens": 1, "cycles": 1,
                                           "wall_s": 0.1, "accept_lengths": [1]}],
            "settings": {"target": target, "method": "ar", "draft": None, "bench": "mt_bench",
                         "temperature": 0.0, "max_new_tokens": max_new_tokens, "seed": 0,
                         "tree": None, "engine": "eager"},
            "env": {"device": "cpu", "dtype": "torch.float32"}}


def make_victims(folder: Path, tiny: str) -> None:
    """Files a careless command could destroy, and broken inputs."""
    shutil.copy(Path(__file__).parents[1] / "README.md", folder / "README.md")
    (folder / "t.csv").write_text("name,value\nalpha,1\nbeta,2\n")
    (folder / "empty_draft").mkdir()
    chat = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    (folder / "two_train.json").write_text(json.dumps(  # ids "a", "b": both in training
        [{"id": "a", "conversations": chat}, {"id": "b", "conversations": chat}]))
    lines = [json.dumps(answer_record(i, tiny)) for i in range(3)]
    (folder / "answers.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "broken.jsonl").write_text(lines[0] + "\n" + lines[1][:40] + "\n" + lines[2]
                                         + "\n")
    truncated = folder / "truncated"
    shutil.copytree(tiny, truncated)
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    no_tok = folder / "no_tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny) / name, no_tok / name)
    drafter = folder / "drafter"
    drafter.mkdir()
    save_file({"fc.weight": torch.zeros(64, 128)}, str(drafter / "model.safetensors"))
    (drafter / "config.json").write_text("{not json")
    (folder / "olddata").mkdir()
    (folder / "olddata" / "manifest.json").write_text("{half a manif")


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_cli_input_gets_one_error_line(case, tmp_path, tiny_target_dir, capsys):
    module, argv = BAD[case]
    make_victims(tmp_path, tiny_target_dir)
    before = snapshot(tmp_path)
    argv = [a.replace("{tiny}", tiny_target_dir).replace("{dir}", str(tmp_path))
            for a in argv]
    main = importlib.import_module(MODULES[module]).main
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert "Traceback" not in err
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before, "a file was changed"


def test_error_lines_say_what_is_wrong(tmp_path, tiny_target_dir, capsys):
    """Spot checks of the wording: the input is named, and what to do."""
    make_victims(tmp_path, tiny_target_dir)
    cases = {"answers_corrupt_middle_line": "line 2 is damaged",
             "answers_other_max_new_tokens": "max_new_tokens=3 in the file, 7 now",
             "answers_into_readme": "is not an answer file",
             "generate_huge_max_new_tokens": "context of 1024 tokens",
             "generate_prompt_plus_max_new_tokens_past_context": "exceeds",
             "alloc_start_beyond_data": "--start 100000 is beyond the data",
             "generate_fta_with_eagle2": "--fta does not apply to --method eagle2",
             "generate_lookup_first_without_lookup": "--lookup-first needs a lookup chain",
             "generate_lookup_first_with_plain_lookup": "--lookup-first does not apply",
             "generate_draft_gate_without_drafter": "--draft-gate does not apply",
             "generate_min_confidence_with_medusa": "--min-confidence does not apply",
             "generate_extend_confidence_with_medusa": "--extend-confidence does not apply",
             "interleave_one_run_other_settings": "max_new_tokens=3 in the file, 7 now",
             "interleave_shared_flag_inside_run": "give --max-new-tokens once",
             # a reader says what a reader does (not "choose another --answer-file")
             "speed_on_a_readme": "give the .jsonl files gen_answers wrote",
             "generate_broken_chat_template": "--chat-template '{{ oops(' fails on a prompt",
             "alloc_empty_split": "the held_out split of",
             "generate_empty_draft_dir": "empty_draft: no model.safetensors or "
                                         "pytorch_model.bin found",
             "generate_verify_width_below_the_tree": "narrower than this tree's 16 tokens",
             "generate_chat_template_without_the_messages": "renders a prompt as no tokens",
             "vocab_sizes_beyond_vocabulary": "--sizes 999999 is larger than the target's"}
    for case, words in cases.items():
        module, argv = BAD[case]
        argv = [a.replace("{tiny}", tiny_target_dir).replace("{dir}", str(tmp_path))
                for a in argv]
        importlib.import_module(MODULES[module]).main(argv)
        assert words in capsys.readouterr().err, case


def test_debug_shows_the_traceback(monkeypatch, capsys):
    @cli_errors
    def main(argv):
        raise GumihoError("bad thing: do this")

    assert main([]) == 2
    assert capsys.readouterr().err == "error: bad thing: do this\n"
    monkeypatch.setenv("GUMIHO_DEBUG", "1")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("error: bad thing: do this\n")


def test_interrupt_and_bugs_are_one_line(capsys):
    @cli_errors(resume="rerun the same command to resume")
    def interrupted(argv):
        raise KeyboardInterrupt

    @cli_errors
    def buggy(argv):
        return {}["missing"]

    assert interrupted([]) == 130
    assert capsys.readouterr().err == "interrupted: rerun the same command to resume\n"
    assert buggy([]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: internal error KeyError")
    assert "GUMIHO_DEBUG=1" in err[0]


def test_gumiho_cache_that_is_a_file_fails_before_converting(tmp_path, monkeypatch):
    from gumiho import embedded

    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "convert_gguf", lambda *a, **k: pytest.fail("converted"))
    for make in (embedded.smollm2_dir, embedded.gemma3_dir):
        with pytest.raises(GumihoError, match="is a file, not a directory"):
            make()


def test_cuda_device_without_cuda():
    import torch

    from gumiho.target import choose_device_dtype

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(GumihoError, match="no cuda device is available"):
        choose_device_dtype("cuda")


def test_unknown_and_missing_commands(capsys):
    from gumiho import cli

    assert cli.main([]) == 2
    assert capsys.readouterr().err.startswith("error: no command given")
    assert cli.main(["frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'frobnicate'")


# The notebook API: a clear GumihoError / TypeError before anything runs.

@pytest.fixture(scope="module")
def plain_gen(smollm2):
    from gumiho.drafters import PlainDrafter
    from gumiho.generate import SpeculativeGenerator

    return SpeculativeGenerator(smollm2, PlainDrafter())


@pytest.mark.parametrize("prompt, error, words", [
    ([5, 49152], GumihoError, "outside the vocabulary"),
    ([-1, 5], GumihoError, "outside the vocabulary"),
    ([], GumihoError, "empty prompt"),
    (None, TypeError, "prompt must be"),
    (42, TypeError, "prompt must be"),
    ({"role": "user", "content": "hi"}, TypeError, "prompt must be"),
    (["hello", "world"], TypeError, "prompt must be"),
    ([1, 2.5], TypeError, "prompt must be"),
    ([True, 3], TypeError, "prompt must be"),
    ([{"role": "robot", "content": "hi"}], GumihoError, "message 0 must be"),
    ([{"role": "user", "content": 7}], GumihoError, "message 0 must be"),
])
def test_api_bad_prompts(plain_gen, prompt, error, words):
    with pytest.raises(error, match=words):
        plain_gen.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"max_new_tokens": 0}, GumihoError, "max_new_tokens must be at least 1"),
    ({"max_new_tokens": -5}, GumihoError, "max_new_tokens must be at least 1"),
    ({"max_new_tokens": "8"}, TypeError, "max_new_tokens must be an int"),
    ({"max_new_tokens": 8.0}, TypeError, "max_new_tokens must be an int"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an int"),
    ({"temperature": float("nan")}, GumihoError, "temperature must be a finite"),
    ({"temperature": -1.0}, GumihoError, "temperature must be a finite"),
    ({"temperature": "hot"}, TypeError, "temperature must be a number"),
    ({"temperature": 1e-40}, GumihoError, "too small to sample with"),
    ({"seed": -1}, GumihoError, "seed must be >= 0"),
    ({"temperature": 1.0, "top_p": 0.0}, GumihoError, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, GumihoError, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": float("nan")}, GumihoError, "top_p must be in"),
    ({"temperature": 1.0, "top_p": "0.9"}, TypeError, "top_p must be a number"),
    ({"temperature": 1.0, "top_k": -1}, GumihoError, "top_k must be >= 0"),
    ({"temperature": 1.0, "top_k": 2.0}, TypeError, "top_k must be an int"),
    ({"temperature": 1.0, "min_p": -0.1}, GumihoError, r"min_p must be in \[0, 1\]"),
    ({"temperature": 1.0, "min_p": 1.5}, GumihoError, r"min_p must be in \[0, 1\]"),
    ({"temperature": 1.0, "min_p": None}, TypeError, "min_p must be a number"),
    ({"repetition_penalty": 0.0}, GumihoError, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": -1.2}, GumihoError, "repetition_penalty must be a finite"),
    ({"repetition_penalty": float("inf")}, GumihoError, "repetition_penalty must be a finite"),
    ({"repetition_penalty": float("nan")}, GumihoError, "repetition_penalty must be a finite"),
    ({"repetition_penalty": "1.2"}, TypeError, "repetition_penalty must be a number"),
    ({"presence_penalty": 2.5}, GumihoError, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, GumihoError, "frequency_penalty must be in"),
    ({"frequency_penalty": "0.5"}, TypeError, "frequency_penalty must be a number"),
    ({"stop": ""}, GumihoError, "a stop string must not be empty"),
    ({"stop": ["User:", None]}, TypeError, "stop must be a string or a list of strings"),
    ({"stop": 7}, TypeError, "stop must be a string or a list of strings"),
])
def test_api_bad_settings(plain_gen, kwargs, error, words):
    with pytest.raises(error, match=words):
        plain_gen.generate("Hello", **{"max_new_tokens": 4, **kwargs})


def test_prompt_beyond_the_context_is_refused_before_generating(plain_gen, smollm2):
    limit = smollm2.model.config.max_position_embeddings
    assert limit == 8192
    with pytest.raises(GumihoError, match="the prompt is 8200 tokens, but .* context is "
                                          "8192 tokens"):
        plain_gen.generate([100] * 8200, max_new_tokens=4)
    with pytest.raises(GumihoError, match=r"the prompt \(8000 tokens\) \+ max new tokens "
                                          r"\(500\) exceeds .* 8192 .* at most 192"):
        plain_gen.generate([100] * 8000, max_new_tokens=500)
    with pytest.raises(GumihoError, match="exceeds"):
        plain_gen.generate("Hi", max_new_tokens=10**12)


def test_breaking_out_of_stream_leaves_the_partial_result(plain_gen):
    older = plain_gen.generate("Name three colours.", max_new_tokens=6)
    assert older.stopped_by in ("max_new_tokens", "stop_token")
    full = plain_gen.generate("Tell me a long story about a fox.", max_new_tokens=24)
    pieces = []
    for piece in plain_gen.stream("Tell me a long story about a fox.", max_new_tokens=24):
        pieces.append(piece)
        if len(pieces) == 5:
            break
    partial = plain_gen.last_result
    assert partial is not None and partial is not full and partial.stopped_by == "closed"
    assert 5 <= partial.new_tokens < full.new_tokens
    assert partial.token_ids == full.token_ids[: partial.new_tokens]
    assert partial.text.startswith("".join(pieces))
    assert partial.cycles == partial.new_tokens and partial.wall_s > 0


def test_generate_decodes_once_and_stream_short_windows(plain_gen, monkeypatch):
    """`generate` decodes the text once, at the end: a decode of the text so far every
    cycle would cost plain decoding, a cycle per token, more than a drafter, and the
    evaluation times `generate`. `stream` decodes a short window a cycle (the last piece's
    tokens and the new ones), and its pieces join to the same text."""
    decoded = []
    original = type(plain_gen.target).decode
    monkeypatch.setattr(type(plain_gen.target), "decode",
                        lambda self, ids: decoded.append(len(ids)) or original(self, ids))
    result = plain_gen.generate("Name three colours.", max_new_tokens=12)
    assert decoded == [result.new_tokens]
    decoded.clear()
    pieces = list(plain_gen.stream("Name three colours.", max_new_tokens=12))
    assert len(decoded) == 2 * plain_gen.last_result.cycles + 1
    assert decoded[-1] == result.new_tokens  # the engine's, once
    assert max(decoded[:-1]) <= 3 < result.new_tokens  # a cycle per token: short windows
    assert "".join(pieces) == plain_gen.last_result.text == result.text


def test_a_stream_on_a_shared_target_is_superseded_by_another_generators_call(plain_gen,
                                                                             smollm2):
    """The KV cache is the target's: a call on another generator sharing it ends an older
    stream (it raises when continued) instead of corrupting its text."""
    from gumiho.drafters import PlainDrafter
    from gumiho.generate import SpeculativeGenerator

    other = SpeculativeGenerator(smollm2, PlainDrafter())
    alone = plain_gen.generate("Name three colours.", max_new_tokens=12)
    first = plain_gen.stream("Name three colours.", max_new_tokens=12)
    head = next(first)
    other.generate("Write a haiku about the sea.", max_new_tokens=12)
    with pytest.raises(GumihoError, match="superseded .* another sharing it"):
        next(first)
    assert alone.text.startswith(head)
    assert plain_gen.generate("Name three colours.", max_new_tokens=12).text == alone.text


def test_stream_supersedes_and_checks_its_prompt_when_called(plain_gen):
    """stream() itself, before its first piece: an older result is no longer
    `last_result`, and a bad prompt raises at the call."""
    plain_gen.generate([1, 2, 3], max_new_tokens=4)
    pieces = plain_gen.stream("Hi", max_new_tokens=4)
    assert plain_gen.last_result is None
    pieces.close()
    with pytest.raises(GumihoError, match="empty prompt"):
        plain_gen.stream("", max_new_tokens=4)
    with pytest.raises(GumihoError, match="exceeds"):
        plain_gen.stream("Hi", max_new_tokens=10**12)


def test_a_streams_speed_leaves_out_the_callers_time(plain_gen):
    """wall_s (so tokens/s) and cycle_s count the loop, not what the caller does between
    pieces (printing to a slow terminal, a notebook's output): at most the time the stream
    took less the time the caller slept, whether it ran to the end or was closed."""
    import time

    def consume(stop_after=None):
        slept, begin = 0.0, time.perf_counter()
        for i, _ in enumerate(plain_gen.stream("Name three colours.", max_new_tokens=8)):
            t = time.perf_counter()
            time.sleep(0.1)
            slept += time.perf_counter() - t
            if i == stop_after:
                break
        return time.perf_counter() - begin - slept

    own = consume()
    result = plain_gen.last_result
    assert result.stopped_by != "closed" and result.cycles >= 4
    assert result.wall_s <= own and sum(result.cycle_s) <= own
    own = consume(stop_after=2)
    assert plain_gen.last_result.stopped_by == "closed"
    assert plain_gen.last_result.wall_s <= own


def test_a_newer_stream_supersedes_an_older_one(plain_gen):
    first = plain_gen.stream("Count to ten.", max_new_tokens=20)
    next(first)
    second = plain_gen.generate("Say hi.", max_new_tokens=4)
    with pytest.raises(GumihoError, match="superseded"):
        next(first)
    assert plain_gen.last_result is second
    with pytest.raises(GumihoError):  # a failed call leaves no stale result behind
        plain_gen.generate([10**9], max_new_tokens=4)
    assert plain_gen.last_result is None


@pytest.mark.parametrize("kwargs, error, words", [
    ({"target": 123}, TypeError, "target must be a path"),
    ({"method": "banana"}, GumihoError, "unknown method 'banana'"),
    ({"method": "gumiho", "draft": "random", "total_tokens": "64"}, TypeError,
     "total_tokens must be an int, got '64' \\(str\\)"),
    ({"method": "gumiho", "draft": "random", "top_k": 2.5}, TypeError,
     "top_k must be an int, got 2.5"),
    ({"method": "gumiho", "draft": "random", "min_confidence": "0.1"}, TypeError,
     "min_confidence must be a number"),
    ({"method": "gumiho", "draft": "random", "lookup": 2, "lookup_first": 1}, TypeError,
     "lookup_first must be True or False"),
    ({"attention": "flash_attention_2"}, GumihoError,  # not "delete the converted model"
     "^attention implementation 'flash_attention_2' takes no tree mask; load it with one "
     "of sdpa, eager, sdpa_invariant$"),
    ({"attention": 5}, TypeError, "attention must be a string"),
    ({"method": "lookup", "lookup": 0}, GumihoError, "--method lookup needs a chain"),
    ({"chat_template": 5}, TypeError, "chat_template must be a string"),
    ({"dtype": 5}, TypeError, "dtype must be one of float32"),
    ({"method": "gumiho", "draft": "random", "top_k": 0}, GumihoError,
     "--top-k must be at least 1"),
    ({"method": "eagle2", "draft": "random", "fta": "exact"}, GumihoError,
     "--fta does not apply to --method eagle2"),
    ({"method": "ar", "total_tokens": 16}, GumihoError, "does not apply to --method ar"),
    ({"method": "ar", "temperature": -1.0}, GumihoError, "temperature must be a finite"),
    ({"method": "gumiho", "draft": "random", "temperature": "0.7"}, TypeError,
     "temperature must be a number"),
    ({"method": "gumiho", "draft": "random", "verify_width": 0}, GumihoError,
     "verify_width must be at least 1"),
    ({"method": "gumiho", "draft": "random", "beam": 3}, TypeError, "unknown tree option"),
    ({"method": "gumiho", "draft": "random", "engine": "static", "min_confidence": 0.5},
     GumihoError, "^--min-confidence works on the eager engine only .* not --engine static: "
     "add --engine eager, or leave it out$"),
    ({"method": "eagle2", "draft": "random", "engine": "compile", "draft_gate": 2.0,
      "lookup": 4, "lookup_first": True}, GumihoError,
     "^--draft-gate, --lookup-first work on the eager engine only .* leave them out$"),
])
def test_api_bad_load_arguments(kwargs, error, words):
    from gumiho.generate import SpeculativeGenerator

    with pytest.raises(error, match=words):
        SpeculativeGenerator.load(**kwargs)


def test_beam_wider_than_the_vocabulary():
    from gumiho.config import TreeConfig

    with pytest.raises(GumihoError, match="--mlp-topk 100 is larger than the target's "
                                          "vocabulary \\(97 tokens\\)"):
        TreeConfig(mlp_topk=100).check_vocab(97)
    TreeConfig(top_k=97, mlp_topk=97).check_vocab(97)


@pytest.mark.parametrize("config", ["configs/accelerate_single.yaml", "configs/multi_gpu.yaml"])
def test_train_script_passes_the_trainers_one_line(config, tmp_path):
    """scripts/train.sh: a bad flag stops at the dry run with the trainer's own line and exit
    status, whatever the accelerate config (no launcher traceback around it)."""
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    env = child_env(ACCELERATE_CONFIG=config,
                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "scripts/train.sh", "--online", "--output-dir",
                           str(tmp_path / "run"), "--lr", "-1"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --lr") and "Traceback" not in proc.stderr


def test_train_script_reads_paths_from_the_callers_folder(tmp_path):
    """scripts/train.sh run from elsewhere: --data and --output-dir are the caller's paths
    (it had moved to the repository root, so they resolved there)."""
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "scripts" / "train.sh"
    env = child_env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(script), "--data", "nodata", "--output-dir", "run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: {tmp_path / 'nodata'}: no manifest.json; make data "
                                   "with python -m gumiho.ge_data.allocation --outdir DIR")


@pytest.mark.parametrize("spec, words", [("gumiho", "NAME:METHOD:DRAFT_DIR"),
                                         ("g:gumiho:no/such/dir", "does not exist")])
def test_tau_script_refuses_bad_drafter_specs_before_generating(spec, words, tmp_path):
    """scripts/tau_heldout.sh checks every NAME:METHOD:DRAFT_DIR before its first answer."""
    import subprocess

    root = Path(__file__).parents[1]
    out = tmp_path / "tau"
    proc = subprocess.run(["bash", "scripts/tau_heldout.sh", str(out), spec], cwd=root,
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
    assert lines[0].startswith("error: ") and not out.exists()


def test_a_depth_past_the_drafters_levels_is_noted(tiny_target_dir, caplog):
    """A depth the drafter cannot reach (Gumiho: 2 serial levels + its MLP heads; Medusa:
    its heads) still runs, at the depth it can, and says so; one it reaches says nothing."""
    import logging

    from gumiho.generate import SpeculativeGenerator

    with caplog.at_level(logging.WARNING, logger="gumiho"):
        for method, reach in (("gumiho", 7), ("medusa", 4)):
            caplog.clear()
            gen = SpeculativeGenerator.load(tiny_target_dir, method, "random", depth=reach + 2)
            assert gen.drafter.draft_depth == reach
            assert f"depth {reach + 2} is past what this drafter drafts: its trees stop at " \
                   f"depth {reach}" in caplog.text
            caplog.clear()
            SpeculativeGenerator.load(tiny_target_dir, method, "random", depth=reach)
            assert "past what this drafter drafts" not in caplog.text


@pytest.mark.parametrize("method, options", [
    ("gumiho", {}), ("gumiho", {"top_k": 4, "mlp_topk": 3, "pruning": 7}),
    ("gumiho", {"serial_levels": 3, "top_k": 3, "pruning": 5}),
    ("gumiho", {"depth": 3}), ("eagle2", {"top_k": 5, "depth": 4})])
def test_total_tokens_past_the_pool_is_noted_and_verifies_the_pool(tiny_target_dir, caplog,
                                                                   method, options):
    """--total-tokens past the candidates the tree settings draw runs at the pool's size
    (pool_nodes: the trees are then the whole pool, every cycle), and says so; it used to be
    recorded and shown as asked while the verify width padded the rest."""
    import logging

    from gumiho.generate import SpeculativeGenerator

    with caplog.at_level(logging.WARNING, logger="gumiho"):
        gen = SpeculativeGenerator.load(tiny_target_dir, method, "random", total_tokens=1000,
                                        **options)
    inner = gen.drafter
    while not hasattr(inner, "pool_nodes"):
        inner = inner.inner
    assert gen.drafter.max_nodes == inner.pool_nodes() + 1 < 1000
    assert inner.tree.total_tokens == gen.drafter.max_nodes  # what answer files record
    assert f"total tokens 1000 is more than these tree settings draft: its trees stop at " \
           f"{gen.drafter.max_nodes} tokens" in caplog.text
    sizes, propose = [], inner.propose
    inner.propose = lambda: sizes.append((tree := propose()).tokens.shape[0]) or tree
    gen.generate([1, 2, 3], max_new_tokens=6)
    assert sizes and set(sizes) == {gen.drafter.max_nodes}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gumiho"):
        SpeculativeGenerator.load(tiny_target_dir, method, "random",
                                  total_tokens=gen.drafter.max_nodes, **options)
    assert "total tokens" not in caplog.text


def test_an_open_progress_bar_ends_its_line_before_the_report(capsys):
    """A report mid-job starts a line of its own: tqdm leaves its bar without a newline, and
    `interrupted: ...` after Ctrl-C in training used to continue the bar's line."""
    from tqdm import tqdm

    from gumiho.errors import cli_errors

    @cli_errors
    def fails(argv=None):
        bar = tqdm(total=10, desc="work")
        bar.update(3)
        raise GumihoError("bad flag")

    assert fails([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("\rwork:") and err.endswith("]\nerror: bad flag\n"), repr(err)
