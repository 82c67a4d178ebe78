"""The answer file that `gen_answers` writes and `speed` reads: one JSON record per line.

A record: {"question_id", "turns": [{"text", "new_tokens", "cycles", "wall_s",
"accept_lengths", ...}], "settings": {"method", "bench", "temperature", ...}, "env": {...}}.
Reading is strict, because a resume appends to the file: anything that is not a record of
this shape is refused with its line number, never dropped or rewritten. The one exception
is a half-written last line (no newline, not valid JSON), which an interrupted run leaves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gumiho.errors import GumihoError
from gumiho.paths import same_place

TURN_KEYS = ("new_tokens", "cycles", "wall_s", "accept_lengths")
# Settings that must agree for answers to share a file (and a row of the speed report).
# How every record line starts (json.dumps of a dict whose first key is question_id).
RECORD_START = b'{"question_id": '
RESUME_KEYS = ("target", "method", "draft", "draft_sha256", "bench", "temperature",
               "sample_top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "ignore_eos", "max_new_tokens", "seed", "tree", "engine",
               "chat_template")
# Settings recorded since a later version: a record without one (older code's) is not
# compared on it, so its file still resumes and still pools in a report.
LATER_KEYS = ("draft_sha256", "chat_template")
# Settings recorded since a later version whose absence means a value: answers from before
# the sampling cut, the penalties and ignore_eos existed were made without them (and env
# "switches", the GUMIHO_* variables, is recorded since session 66: none then means none set).
DEFAULTS = {"sample_top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False,
            "switches": {}}


@dataclass
class AnswerFile:
    records: list[dict]  # every complete record, in file order
    lines: list[int]  # the 1-based line number of each record
    keep_bytes: int  # file length without a half-written last line
    needs_newline: bool  # the last record lacks its newline (killed right after writing it)
    half_line: int | None = None  # the 1-based number of a half-written last line, dropped


def record_problem(rec) -> str | None:
    """Why `rec` is not an answer record, or None if it is one."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an answer record"
    missing = [k for k in ("question_id", "turns", "settings") if k not in rec]
    if missing:
        return f"no {', '.join(missing)} field"
    if isinstance(rec["question_id"], bool) or not isinstance(rec["question_id"], str | int):
        return "question_id is not a string or an integer"
    if not isinstance(rec["settings"], dict) or not all(
            k in rec["settings"] for k in ("method", "bench", "temperature")):
        return "its settings lack method, bench or temperature"
    turns = rec["turns"]
    if not isinstance(turns, list) or not turns:
        return "turns is not a non-empty list"
    for turn in turns:
        if not isinstance(turn, dict) or any(k not in turn for k in TURN_KEYS):
            return f"a turn lacks one of {', '.join(TURN_KEYS)}"
        if not isinstance(turn["accept_lengths"], list) or not all(
                isinstance(turn[k], int | float) and not isinstance(turn[k], bool)
                for k in ("new_tokens", "cycles", "wall_s")):
            return "a turn has non-numeric counts"
    return None


def read_answer_file(path: Path, writing: bool = True) -> AnswerFile:
    """Every record of an answer file. Refuses (GumihoError naming the line) a file that is
    not an answer file or has a damaged line anywhere but at its very end; `writing`: the
    refusal says what a run that would append to it does (else what a reader does)."""
    if path.is_dir():
        raise GumihoError(f"answer file {path} is a directory: give a .jsonl file path")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GumihoError(f"cannot read answer file {path}: {exc.strerror}") from None
    records, numbers = [], []
    offset, keep, needs_newline, half_line = 0, 0, False, None
    raw_lines = data.split(b"\n")
    for number, raw in enumerate(raw_lines, 1):
        last = number == len(raw_lines)
        end = offset + len(raw) + (0 if last else 1)
        if not raw.strip():
            offset = end
            if not last:
                keep = end
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if last and raw.startswith(RECORD_START):  # cut short by an interrupted run
                half_line = number
                break
            what = "binary data" if isinstance(exc, UnicodeDecodeError) else "not JSON"
            raise GumihoError(_refusal(path, number, what, bool(records), writing)
                              ) from None
        problem = record_problem(rec)
        if problem:
            raise GumihoError(_refusal(path, number, problem, bool(records), writing))
        records.append(rec)
        numbers.append(number)
        keep, offset = end, end
        needs_newline = last
    return AnswerFile(records, numbers, keep, needs_newline, half_line)


def _refusal(path: Path, number: int, problem: str, has_records: bool, writing: bool) -> str:
    if not has_records:
        return (f"{path} is not an answer file of gen_answers (line {number}: {problem}); "
                "it was left untouched: " + ("choose another --answer-file" if writing else
                                             "give the .jsonl files gen_answers wrote"))
    return (f"{path} line {number} is damaged ({problem}); the file was left untouched: "
            "fix or delete that line, then " + ("rerun to resume" if writing else
                                                "run this again"))


def settings_mismatch(old: dict, new: dict, keys: tuple[str, ...] = RESUME_KEYS,
                      sides: tuple[str, str] = ("in the file", "now")) -> str | None:
    """The first of `keys` on which two records' settings differ, each value followed by
    its side's name."""
    for key in keys:
        a, b = old.get(key, DEFAULTS.get(key)), new.get(key, DEFAULTS.get(key))
        if key in ("target", "draft") and a and b and same_place(a, b):
            continue
        if key in LATER_KEYS and (key not in old or key not in new):
            continue  # one side predates the setting: nothing to compare
        if a != b and key == "draft_sha256":  # the path is the same (checked before)
            return (f"the weights of drafter {new.get('draft')!r}: sha256 {_digest(a)} "
                    f"{sides[0]}, {_digest(b)} {sides[1]}")
        if a != b:
            return f"{key}={_show(a)} {sides[0]}, {_show(b)} {sides[1]}"
    return None


def _digest(value) -> str:
    return f"{value[:12]}..." if isinstance(value, str) else repr(value)


def _show(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return repr(value)


def check_can_write(path: Path) -> None:
    """The answer file's folder exists or can be made, and is writable."""
    from gumiho.paths import check_writable_dir

    if path.exists() and not path.is_file():
        raise GumihoError(f"answer file {path} exists and is not a regular file: give a "
                          ".jsonl file path")
    check_writable_dir(path.parent, "--answer-file folder")
    if path.exists() and not os.access(path, os.W_OK):
        raise GumihoError(f"answer file {path} is not writable")
