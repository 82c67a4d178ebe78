"""Stop strings: the answer ends after the token that completes one, as transformers'
`generate(stop_strings=...)` ends it, for plain decoding and drafters that accept several
tokens a cycle; the text ends before the string, and a stream never shows any of it."""

import random

import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.engine import GenerateConfig, run
from gumiho.errors import GumihoError
from gumiho.stops import HeldText, StopStrings, check_stops

from conftest import REFERENCE_TOKENS as N
from drafters_for_tests import oracle_drafter

# the reference answer, "1. A paperclip is used to create a makeshift paperweight.\n2. A
# paperclip ...": "\n2." spans three tokens, "perwe" ends inside " paperweight"'s second
STOPS = ("\n2.", "perwe")

PIECES = ["1", ".", " A", " paper", "weight", ".", "\n", "2", ".", " B"]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


@pytest.mark.host
def test_the_token_that_completes_a_stop_string_is_the_last_kept():
    strings = StopStrings(decode, ("\n2.",))
    assert strings.through([0, 1, 2]) is None
    assert strings.through([3, 4, 5, 6]) is None  # "\n" alone is no stop yet
    assert strings.through([7, 8, 9]) == 2  # "2", "." complete it: " B" is dropped
    at_once = StopStrings(decode, ("\n2",))
    assert at_once.through([0, 1, 2, 3, 4, 5, 6]) is None
    assert at_once.through([7, 8]) == 1  # a cycle's first token completes it
    inside = StopStrings(decode, ("perw", "zzz"))
    assert inside.through([0, 1, 2, 3, 4, 5]) == 5  # ends inside "weight": kept through it
    assert inside.text(decode([0, 1, 2, 3, 4])) == "1. A pa"
    first = StopStrings(decode, ("B", "."))
    assert first.through([0, 1, 2]) == 2  # the earliest token wins, whichever string


def test_a_stop_of_characters_several_tokens_long_is_found_a_token_at_a_time(smollm2):
    """SmolLM2 spells an emoji in 3 byte-level tokens: a stop string of 10 of them spans 30
    tokens, past a window sized in characters, where plain decoding (a token a cycle) ran
    on while a cycle of several tokens stopped. Both stop at the token completing it."""
    from gumiho import SpeculativeGenerator

    ids = smollm2.tokenizer("\U0001f98a\U0001f436\U0001f431" * 4).input_ids
    stop = "\U0001f436\U0001f431" * 5
    assert len(smollm2.tokenizer(stop).input_ids) == 30
    plain = SpeculativeGenerator.load(smollm2, "ar").generate(
        ids, 48, stop=stop, ignore_eos=True, logit_bias={i: 5.0 for i in set(ids)})
    assert plain.stopped_by == "stop_string" and stop not in plain.text
    assert stop in smollm2.decode(plain.token_ids)
    gumiho = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                       total_tokens=8).generate(
        ids, 48, stop=stop, ignore_eos=True, logit_bias={i: 5.0 for i in set(ids)})
    assert gumiho.token_ids == plain.token_ids


@pytest.mark.host
def test_a_stream_never_shows_part_of_a_stop_string():
    """Random pieces of a text holding a stop string: what is shown, joined, is always the
    start of the text before the stop, and all of it in the end."""
    text = "Some answer.\n\nUser: and more\n\nUser: again"
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        held, shown = HeldText(("\n\nUser:", "zz")), ""
        for piece in pieces:
            shown += held.push(piece)
            assert "Some answer.".startswith(shown)
            assert "\n" not in shown
        assert shown + held.finish("Some answer.") == "Some answer."


def test_greedy_with_stop_strings_is_transformers_generate(smollm2, reference):
    """Plain decoding, the shipped Gumiho drafter and an oracle drafter (which accepts the
    whole answer in a few cycles, so the stop falls inside a cycle) stop at the token where
    transformers' StopStringCriteria stops, for a stop across three tokens and one that
    ends inside a token; the text ends before the stop string."""
    from gumiho import SpeculativeGenerator

    ids, full = reference[0], reference[1].token_ids
    gens = [SpeculativeGenerator.load(smollm2, "ar"),
            SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                      total_tokens=8)]
    oracle = oracle_drafter("gumiho", smollm2, ids + full, TreeConfig.for_method("gumiho"))
    for stop in STOPS:
        with torch.inference_mode():
            out = smollm2.model.generate(torch.tensor([ids], device=smollm2.device),
                                         max_new_tokens=N, do_sample=False,
                                         stop_strings=[stop], tokenizer=smollm2.tokenizer)
        want = out[0, len(ids):].tolist()
        assert len(want) < len(full)  # it stopped early
        text = smollm2.decode(want)
        for gen in gens:
            got = gen.generate(ids, N, stop=stop)
            assert got.token_ids == want, (gen, stop)
            assert got.stopped_by == "stop_string"
            assert got.text == text[:text.index(stop)] and stop not in got.text
        got = run(smollm2, oracle, ids, GenerateConfig(max_new_tokens=N, stop=(stop,)))
        assert got.token_ids == want and max(got.accept_lengths) > 4


def test_a_stream_with_a_stop_gives_the_text_before_it(smollm2, reference):
    from gumiho import SpeculativeGenerator

    gen = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                    total_tokens=8)
    pieces = list(gen.stream(reference[0], N, stop=["zzz", "\n2."]))
    assert "".join(pieces) == gen.last_result.text == \
        "1. A paperclip is used to create a makeshift paperweight."
    assert gen.last_result.stopped_by == "stop_string"
    whole = gen.generate(reference[0], N, stop="no such text")  # a stop never met
    assert whole.token_ids == reference[1].token_ids and whole.stopped_by != "stop_string"


@pytest.mark.host
def test_stop_arguments_are_checked():
    assert check_stops(None) == () and check_stops("a") == ("a",)
    assert check_stops(["a", "b"]) == ("a", "b")
    with pytest.raises(GumihoError, match="must not be empty"):
        GenerateConfig(stop=("a", ""))
    with pytest.raises(TypeError, match="stop must be a string"):
        GenerateConfig(stop=3)
    with pytest.raises(TypeError, match="stop must be a string"):
        GenerateConfig(stop=["a", 3])
    assert GenerateConfig(stop="ab").stop == ("ab",)


def test_held_text_gives_its_held_end_where_the_answer_no_longer_starts_with_it():
    """A byte-fallback decoder can turn a shown character into U+FFFD in the answer's text
    (text_pieces.py); the stream's held-back end (text that might have begun a stop string,
    and what the pieces still owe) was then dropped. It is given, up to a stop."""
    held = HeldText(("xyz",))
    assert held.push("café x") == "café "  # "x" may begin "xyz": held back
    answer = "caf\ufffd\ufffd x!"  # the shown "é" is two U+FFFD in the whole decode
    assert held.finish(answer, "!") == "x!"
    held = HeldText(("xyz",))
    held.push("café x")
    assert held.finish("caf\ufffd\ufffd x", "yz and on") == ""  # the stop, not past it
    assert HeldText(("xyz",)).finish("ok", "") == "ok"  # the usual case: the text's rest
