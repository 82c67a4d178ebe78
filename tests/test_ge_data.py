"""Data generation: shard contents equal a direct target forward; resume redoes only what
is missing or half-written; a run with other settings is refused."""

import pytest
import torch

from gumiho.errors import GumihoError
from gumiho.ge_data import allocation
from gumiho.ge_data.shards import load_samples, read_manifest, shard_path
from gumiho.ge_data.worker import planned_conversations
from gumiho.target import load_target
from gumiho.templates import tokenize_conversation

ARGS = ["--end", "6", "--shard-size", "2", "--max-len", "64"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_target_dir):
    out = tmp_path_factory.mktemp("data")
    assert allocation.main(["--outdir", str(out), "--target", tiny_target_dir, *ARGS]) == 0
    return out


def test_tiny_data_fixture_is_usable(tiny_data_dir):
    assert len(load_samples(tiny_data_dir)[1]) > 0


def test_shards_equal_direct_forward(data_dir, tiny_target_dir):
    manifest, samples = load_samples(data_dir)
    assert manifest["num_shards"] == 3 and 0 < len(samples) <= 6
    target = load_target(tiny_target_dir)
    conversations = {c["id"]: c for c in planned_conversations(manifest)}
    for sample in samples:
        conv = conversations[sample["id"]]
        ids, mask = tokenize_conversation(target.tokenizer, conv["messages"], 64,
                                          target.stop_token_ids)
        assert sample["input_ids"].tolist() == ids.tolist()
        assert sample["loss_mask"].tolist() == mask.tolist()
        want = target.features(ids[None].to(target.device))[0].cpu()  # shards are on the host
        torch.testing.assert_close(sample["hidden_state"].float(), want, atol=2e-3, rtol=1e-2)


def test_resume_redoes_only_missing_shards(data_dir, tiny_target_dir):
    count = len(load_samples(data_dir)[1])
    kept = shard_path(data_dir, 0).stat().st_mtime_ns
    shard_path(data_dir, 1).unlink()
    (data_dir / "shard_00002.pt.tmp").write_bytes(b"half")  # an interrupted write
    before = shard_path(data_dir, 2).stat().st_mtime_ns
    assert allocation.main(["--outdir", str(data_dir), "--target", tiny_target_dir,
                            *ARGS]) == 0
    assert shard_path(data_dir, 1).exists()
    assert not (data_dir / "shard_00002.pt.tmp").exists()
    assert shard_path(data_dir, 0).stat().st_mtime_ns == kept
    assert shard_path(data_dir, 2).stat().st_mtime_ns == before
    assert len(load_samples(data_dir)[1]) == count


def test_other_settings_are_refused(data_dir, tiny_target_dir, capsys):
    code = allocation.main(["--outdir", str(data_dir), "--target", tiny_target_dir,
                            "--end", "6", "--shard-size", "3", "--max-len", "64"])
    assert code == 2
    assert "shard_size=2" in capsys.readouterr().err


def test_cpu_workers_run_on_the_cpu_whatever_the_default_device(tmp_path, tiny_target_dir,
                                                                monkeypatch):
    """`--workers` hides the GPUs from its workers; a GUMIHO_DEVICE naming an accelerator
    (as the suite sets on a GPU) must not send them looking for one: not a worker process
    (`--workers 2`, one shard: one process started) nor the one CPU worker that runs in
    allocation's own process."""
    monkeypatch.setenv("GUMIHO_DEVICE", "cuda")
    for workers in ("2", "1"):
        out = tmp_path / workers
        assert allocation.main(["--outdir", str(out), "--target", tiny_target_dir, "--end",
                                "2", "--shard-size", "2", "--max-len", "64", "--workers",
                                workers]) == 0
        assert len(load_samples(out)[1]) > 0


def test_missing_shard_is_reported_by_loader(tmp_path):
    (tmp_path / "manifest.json").write_text('{"num_shards": 2}')
    with pytest.raises(GumihoError, match="2 shards missing"):
        load_samples(tmp_path)
    assert read_manifest(tmp_path)["num_shards"] == 2


@pytest.mark.host
def test_a_conversation_file_is_parsed_once_per_version(tmp_path, monkeypatch):
    """Allocation reads its --data twice in one process (the plan, then its CPU worker):
    the second read reuses the first's parse, notes included; a rewritten file is read
    again."""
    import json

    from gumiho.ge_data import conversations

    path = tmp_path / "c.json"
    chat = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    path.write_text(json.dumps([{"id": "a", "conversations": chat}, {"id": "b"}]))
    parses = []
    monkeypatch.setattr(conversations, "parse_conversations",
                        lambda p, parse=conversations.parse_conversations:
                        parses.append(p) or parse(p))
    first, second = [], []
    got = conversations.load_conversations(str(path), first)
    again = conversations.load_conversations(str(path), second)
    assert got == again and [c["id"] for c in got] == ["a"] and len(parses) == 1
    assert first == second and "1 of 2 records are not usable" in first[0]
    again.clear()  # a caller's list is its own
    assert len(conversations.load_conversations(str(path))) == 1 and len(parses) == 1
    path.write_text(json.dumps([{"id": "a", "conversations": chat},
                                {"id": "c", "conversations": chat}]))  # another size
    assert [c["id"] for c in conversations.load_conversations(str(path))] == ["a", "c"]
    assert len(parses) == 2
