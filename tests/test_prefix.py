"""Prefix reuse (prefix.py): the cache a generation leaves holds exactly the entries of
the tokens it records (as a fresh prefill of them computes them), a prompt that begins
with them skips their prefill, and speculative decoding stays plain decoding's under the
same reuse."""

import pytest
import torch

from gumiho import SpeculativeGenerator
from gumiho.engine import prefill
from gumiho.kv_cache import KVCache
from gumiho.prefix import shared_length

from conftest import REFERENCE_PROMPT as PROMPT

SHIPPED = "gumiho/assets/smollm2/gumiho"


def test_shared_length():
    assert shared_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert shared_length([1, 2, 3], [1, 2, 3]) == 2  # the last prompt token is prefilled
    assert shared_length([1, 2, 3], [1, 9, 3, 4]) == 1
    assert shared_length([], [1, 2]) == 0 and shared_length([5], [1, 2]) == 0
    assert shared_length([1, 2, 3, 4], [1, 2]) == 1


@pytest.fixture(scope="module")
def gens(smollm2):
    """(plain, Gumiho at an 8-token tree) on the real target, sharing it."""
    return (SpeculativeGenerator.load(smollm2, "ar"),
            SpeculativeGenerator.load(smollm2, "gumiho", SHIPPED, total_tokens=8))


def fresh(target, ids):
    """A fresh prefill of `ids`: its cache and features."""
    cache = KVCache.for_model(target.model, len(ids) + 1)
    with torch.inference_mode():
        features, _ = prefill(target, cache, torch.tensor([ids]))
    return cache, features


def check_prefix(target, engine="eager"):
    """The runner's cache holds the entries of the tokens it records, as a fresh prefill of
    them computes them, and their features."""
    prefix = target.runners[engine].prefixes.latest
    assert prefix is not None and prefix.usable()
    n = len(prefix.tokens)
    cache, features = fresh(target, prefix.tokens)
    torch.testing.assert_close(prefix.cache.storage[..., :n, :], cache.storage[..., :n, :],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(prefix.features), features, rtol=1e-4, atol=1e-4)
    return prefix


def test_the_cache_left_holds_what_it_records(gens):
    """After a Gumiho answer (compacted tree paths), one cut by a stop string inside a
    cycle, and one stopped early: the recorded tokens start with the prompt and continue with
    the answer, and the cache holds their entries."""
    _, gen = gens
    ids = gen.prompt_ids(PROMPT)
    out = gen.generate(ids, 40, reuse_prefix=True)
    prefix = check_prefix(gen.target)
    assert prefix.tokens[:len(ids)] == ids and max(out.accept_lengths) > 1
    # the answer but its last token; past it, drafts a cycle accepted beyond the cut
    assert prefix.tokens[len(ids):][:out.new_tokens - 1] == out.token_ids[:-1]
    cut = gen.generate(ids, 40, stop=out.text[20:24], reuse_prefix=True)
    assert cut.stopped_by == "stop_string"
    assert check_prefix(gen.target).tokens[len(ids):][:cut.new_tokens - 1] == \
        cut.token_ids[:-1]
    for _ in gen.stream(ids, 40, reuse_prefix=True):
        break
    kept = check_prefix(gen.target)
    gen.generate(ids, 4)  # without reuse: its own cache, none kept; the kept ones stay
    assert gen.target.runners["eager"].prefixes.latest is kept


def test_a_prompt_that_continues_the_last_sequence_skips_its_prefill(gens):
    """The next turn's prompt begins with the last prompt and its answer: their entries are
    reused (all but the answer's last token, whose entry was never made), the first token's
    logits are a fresh prefill's to rounding, and Gumiho answers as plain decoding does
    with the same reuse."""
    plain, gen = gens
    ids = gen.prompt_ids(PROMPT)
    n = 24
    answers = {}
    for name, g in (("plain", plain), ("gumiho", gen)):
        gen.target.runners["eager"].prefixes.clear()  # the same history for both
        first = plain.generate(ids, n, reuse_prefix=True)
        turn = ids + first.token_ids + gen.target.tokenizer(" And one more?").input_ids
        answers[name] = g.generate(turn, n, reuse_prefix=True)
        assert answers[name].reused_tokens == len(ids) + n - 1
        assert answers[name].to_json()["reused_tokens"] == len(ids) + n - 1
    assert answers["gumiho"].token_ids == answers["plain"].token_ids
    assert answers["gumiho"].tau > 1.2
    check_prefix(gen.target)

    other = gen.prompt_ids("Something else entirely.")
    unrelated = gen.generate(other, 8, reuse_prefix=True)
    shared = shared_length(ids, other)  # the chat template's opening, at most
    assert unrelated.reused_tokens == shared
    assert unrelated.token_ids == plain.generate(other, 8).token_ids or shared > 0


def test_reused_logits_are_a_fresh_prefills(gens):
    """Prefilling only the rest after reused entries gives the last position's logits a
    fresh prefill of the whole prompt gives, to rounding."""
    plain, _ = gens
    target = plain.target
    ids = plain.prompt_ids(PROMPT)
    runner = target.runners["eager"]
    runner.prefixes.clear()
    first = plain.generate(ids, 16, reuse_prefix=True)
    turn = ids + first.token_ids + target.tokenizer(" Why?").input_ids
    from gumiho.prefix import cache_reusing

    cache, p, kept = cache_reusing(runner, turn, len(turn) + 1)
    assert p == len(ids) + 15 and kept.shape[0] == p
    with torch.inference_mode():
        _, logits = prefill(target, cache, torch.tensor([turn[p:]]))
        want = target.model(torch.tensor([turn])).logits[0, -1:]
    torch.testing.assert_close(logits.float(), want.float(), rtol=1e-4, atol=1e-3)


def test_a_captured_engine_reuses_its_own_cache(gens, smollm2):
    """The static engine (a replay's data flow, as CUDA graphs run it) keeps one cache for
    its recorded steps: the reused entries stay where they are, and the answer is the eager
    engine's under the same reuse."""
    plain, gen = gens
    static = SpeculativeGenerator.load(smollm2, "gumiho", SHIPPED, total_tokens=8,
                                       engine="static")
    ids = gen.prompt_ids(PROMPT)
    answers = []
    for g, engine in ((gen, "eager"), (static, "static")):
        if engine in smollm2.runners:
            smollm2.runners[engine].prefixes.clear()
        first = g.generate(ids, 16, reuse_prefix=True)
        left = list(smollm2.runners[engine].prefixes.latest.tokens)
        turn = ids + first.token_ids + smollm2.tokenizer(" Why?").input_ids
        answers.append(g.generate(turn, 16, reuse_prefix=True))
        assert answers[-1].reused_tokens == shared_length(left, turn) >= len(ids) + 15
    runner = smollm2.runners["static"]  # its one cache: one sequence kept
    assert len(runner.prefixes.kept) == 1 and runner.prefixes.latest.cache is runner.cache
    check_prefix(smollm2, "static")
    assert answers[0].token_ids == answers[1].token_ids


def test_lookup_chains_and_plain_steps_record_what_they_commit(smollm2):
    """The demo's kind of tree (a prompt-lookup chain verified alone when found, confidence
    floors that make some cycles plain steps): the cache left still holds what it records,
    and the next turn's answer is plain decoding's under the same reuse."""
    gen = SpeculativeGenerator.load(smollm2, "gumiho", SHIPPED, total_tokens=8, lookup=10,
                                    lookup_first=True, min_confidence=0.1,
                                    extend_confidence=0.4)
    plain = SpeculativeGenerator.load(smollm2, "ar")
    messages = [{"role": "user", "content": "Repeat this list twice: red, green, blue."}]
    ids = gen.prompt_ids(messages)
    answers = []
    for g in (gen, plain):
        if "eager" in smollm2.runners:
            smollm2.runners["eager"].prefixes.clear()
        first = gen.generate(ids, 48, reuse_prefix=True)
        check_prefix(smollm2)
        turn = messages + [{"role": "assistant", "content": first.text},
                           {"role": "user", "content": "Now list them backwards."}]
        answers.append(g.generate(turn, 32, reuse_prefix=True))
        assert answers[-1].reused_tokens >= len(ids)
    assert answers[0].token_ids == answers[1].token_ids and answers[0].new_tokens > 8
    assert answers[0].tau > 1.3


def test_a_side_request_between_two_turns(gens):
    """A chat client asks for a title between two turns: the second turn still reuses the
    conversation's history (a CPU runner keeps four sequences, the most recently used
    last), and past four other sequences it is gone."""
    plain, _ = gens
    runner = plain.target.runners["eager"]
    runner.prefixes.clear()
    messages = [{"role": "user", "content": PROMPT}]
    first = plain.generate(messages, 16, reuse_prefix=True)
    history = plain.prompt_ids(messages) + first.token_ids[:-1]
    title = plain.generate([{"role": "user", "content": "A title for: paperclips."}], 8,
                           reuse_prefix=True)
    assert 0 < title.reused_tokens < 40  # the template's opening, from the conversation
    turn = plain.prompt_ids(messages) + first.token_ids + \
        plain.target.tokenizer(" Two more?").input_ids
    again = plain.generate(turn, 8, reuse_prefix=True)
    assert again.reused_tokens == len(history)
    assert again.token_ids == plain.generate(turn, 8).token_ids  # float32: as fresh
    for i in range(4):  # four other sequences: the conversation's is the oldest, then gone
        plain.generate([{"role": "user", "content": f"Count to {i + 2}."}], 4,
                       reuse_prefix=True)
    assert len(runner.prefixes.kept) == 4
    assert plain.generate(turn, 4, reuse_prefix=True).reused_tokens < 40


def test_a_chat_reuses_its_history(gens):
    from gumiho.chat import ChatSession

    _, gen = gens
    session = ChatSession(gen, max_new_tokens=12, reuse_prefix=True)
    list(session.reply("Name a colour."))
    assert gen.last_result.reused_tokens <= 40  # the template's opening at most
    list(session.reply("And another?"))
    assert gen.last_result.reused_tokens > len(gen.prompt_ids(session.messages[:2])) - 12


def test_reuse_is_a_bool():
    from gumiho.engine import GenerateConfig

    with pytest.raises(TypeError, match="reuse_prefix must be True or False"):
        GenerateConfig(reuse_prefix="yes")


def test_the_official_fta_leaves_nothing_to_reuse(smollm2):
    """The official FTA's splice makes leaves attend to more than their ancestors (fta.py):
    entries a prefill would not make, so a sequence that spliced is not reused."""
    gen = SpeculativeGenerator.load(smollm2, "gumiho", SHIPPED, fta="official")
    ids = gen.prompt_ids(PROMPT)
    gen.generate(ids, 1)  # (the runner made)
    gen.target.runners["eager"].prefixes.clear()  # (earlier tests' sequences)
    out = gen.generate(ids, 24, reuse_prefix=True)
    assert not gen.target.runners["eager"].prefixes.latest.usable()
    again = gen.generate(ids + out.token_ids, 4, reuse_prefix=True)
    assert again.reused_tokens == 0
