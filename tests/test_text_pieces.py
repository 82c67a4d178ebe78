"""`stream`'s text pieces: each decode a short window, the pieces joined = the answer's text."""

import random

import pytest

from gumiho.text_pieces import TextPieces

TEXTS = [
    "Hello, world! Here are three uses:\n1. Hold paper.\n2. Pick a lock.\n3. A hook.",
    "def add(a, b):\n    return a + b  # spaces    kept\n\n\tprint('tab')",
    "Emoji 🦊🦊 and accents: café, naïve, Zürich; CJK: 九尾の狐 (gumiho 구미호).",
    "   leading spaces, trailing spaces   ",
]


@pytest.mark.parametrize("text", TEXTS + ["\n".join(TEXTS * 8)], ids=range(len(TEXTS) + 1))
def test_pieces_join_to_the_whole_decode_for_any_chunking(smollm2, text):
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    whole = smollm2.decode(ids)
    rng = random.Random(len(text))
    lengths = []

    def decode(part):
        lengths.append(len(part))
        return smollm2.decode(part)

    for _ in range(20):
        lengths.clear()
        pieces = TextPieces(decode)
        got, i = [], 0
        while i < len(ids):
            n = rng.choice([1, 1, 2, 3, 5])
            got.append(pieces.push(ids[i : i + n]))
            i += n
        got.append(pieces.finish(whole))
        assert "".join(got) == whole
        # a window holds the last piece's tokens and those held back since, whatever the
        # answer's length (the long text is 863 tokens)
        assert max(lengths) <= 32


def test_a_split_character_is_held_back_until_it_is_whole(smollm2):
    ids = smollm2.tokenizer.encode("🦊", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this emoji
    pieces = TextPieces(smollm2.decode)
    assert pieces.push(ids[:1]) == ""
    assert pieces.push(ids[1:]) == "🦊"
    assert pieces.finish("🦊") == ""


def test_finish_gives_what_was_held_back(smollm2):
    ids = smollm2.tokenizer.encode("ok 🦊", add_special_tokens=False)
    pieces = TextPieces(smollm2.decode)
    first = pieces.push(ids[:-1])  # ends inside the emoji: all of it held back
    assert first == ""
    assert first + pieces.finish(smollm2.decode(ids)) == smollm2.decode(ids)
