"""Conversations as users give them: valid JSONL records that hold a Unicode line
separator, or a file that starts with a byte-order mark, are kept; a conversation the chat
template refuses (a system turn under Gemma-2's or Mistral's template) is skipped with a
note, not the end of every rerun, in data generation and online training; a regenerated
reply stops at the --template's own end-of-turn token."""

import json

import pytest

from gumiho.errors import GumihoError
from gumiho.ge_data import allocation
from gumiho.ge_data.conversations import load_conversations
from gumiho.ge_data.shards import load_samples

# ChatML, refusing a system turn as Gemma-2's template does
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
             "supported') }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + "
             "'\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt "
             "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat(i: int, system: bool = False, text: str = "") -> dict:
    turns = [{"from": "human", "value": f"question {i}{text}"},
             {"from": "gpt", "value": f"answer {i}"}]
    head = [{"from": "system", "value": "be brief"}] if system else []
    return {"id": f"c{i}", "conversations": head + turns}


def test_jsonl_records_holding_unicode_line_separators_are_kept(tmp_path):
    """json.dumps(..., ensure_ascii=False) writes U+2028, U+2029 and U+0085 unescaped, as
    JSON allows; str.splitlines cut each such record in two (3 of these 4 were lost)."""
    path = tmp_path / "chats.jsonl"
    records = [chat(i, text=s) for i, s in enumerate(["", "a\u2028b", "c\x85d", "e\u2029f"])]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")
    notes: list[str] = []
    found = load_conversations(str(path), notes)
    assert [c["id"] for c in found] == ["c0", "c1", "c2", "c3"]
    assert notes == []
    assert found[1]["messages"][0]["content"] == "question 1a\u2028b"


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path, suffix):
    """A file saved with a UTF-8 byte-order mark: the JSON array was refused as 'not a JSON
    array', the JSONL's first record dropped as invalid."""
    records = [chat(0), chat(1)]
    body = json.dumps(records) if suffix == ".json" else \
        "".join(json.dumps(r) + "\n" for r in records)
    path = tmp_path / f"chats{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    notes: list[str] = []
    assert [c["id"] for c in load_conversations(str(path), notes)] == ["c0", "c1"]
    assert notes == []


@pytest.mark.parametrize("regenerate", [False, True])
def test_allocation_skips_a_conversation_the_chat_template_refuses(
        tmp_path, tiny_target_dir, capsys, regenerate):
    """The worker stopped at the first conversation with a system turn, and every rerun
    stopped there again."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat(i, system=i == 2)) + "\n" for i in range(6)))
    out = tmp_path / "out"
    extra = ["--regenerate", "--regen-max-tokens", "2", "--max-len", "96"] if regenerate \
        else ["--max-len", "64"]
    assert allocation.main(["--outdir", str(out), "--target", tiny_target_dir, "--data",
                            str(data), "--template", NO_SYSTEM, "--shard-size", "2",
                            *extra]) == 0
    _, samples = load_samples(out)
    assert sorted(s["id"] for s in samples) == ["c0", "c1", "c3", "c4", "c5"]
    err = capsys.readouterr().err
    assert "note: conversation 'c2' skipped: the chat template fails" in err
    assert "System role not supported" in err


def test_online_samples_skip_a_conversation_the_chat_template_refuses(tmp_path,
                                                                      tiny_target_dir, capsys):
    from gumiho.target import load_target
    from gumiho.train.dataset import online_samples

    target = load_target(tiny_target_dir, device="cpu", dtype="float32")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat(i, system=i == 2)) + "\n" for i in range(6)))
    for threads in (1, 2):
        samples = online_samples(target, str(data), 6, 64, NO_SYSTEM, progress=True,
                                 cache=False, threads=threads)
        assert len(samples) == 5
        assert "note: the chat template refuses 1 of 6 conversations (skipped; the first, " \
               "'c2'" in capsys.readouterr().err
    only = tmp_path / "system.jsonl"  # refused whole: the template's error, not 0 samples
    only.write_text(json.dumps(chat(0, system=True)) + "\n")
    with pytest.raises(GumihoError, match="System role not supported"):
        online_samples(target, str(only), 1, 64, NO_SYSTEM, cache=False, threads=1)


def test_a_regenerated_reply_ends_at_the_templates_own_turn_end(tmp_path, tiny_target_dir,
                                                                monkeypatch):
    """--regenerate with a --template that ends a turn with another token than the
    tokenizer's own template: the worker's target did not stop there, so a reply ran on
    past its turn into a made-up next one."""
    from transformers import AutoTokenizer, GenerationMixin

    template = NO_SYSTEM.replace("<|im_end|>", "<file_sep>")
    end = AutoTokenizer.from_pretrained(tiny_target_dir).convert_tokens_to_ids("<file_sep>")
    stops = []
    generate = GenerationMixin.generate

    def recording(self, *args, **kwargs):
        stops.append(set(kwargs["eos_token_id"]))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recording)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(2)))
    assert allocation.main(["--outdir", str(tmp_path / "out"), "--target", tiny_target_dir,
                            "--data", str(data), "--template", template, "--regenerate",
                            "--regen-max-tokens", "2", "--max-len", "96"]) == 0
    assert stops and all(end in s for s in stops)
