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
    first = pieces.push(ids[:-1])  # ends inside the emoji: the text before it is given
    assert first and "ok".startswith(first.strip()) and "\ufffd" not in first
    assert first + pieces.finish(smollm2.decode(ids)) == smollm2.decode(ids)


def test_pushes_that_each_end_inside_a_character_still_stream(smollm2):
    """An emoji-only answer whose every cycle ends mid-character gave nothing until its end
    (session 66: a chat stream of five emoji came as one piece); each push now gives the
    characters its tokens complete."""
    text = "🎉🎉🎉🚀🚀🦊"
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    pieces = TextPieces(smollm2.decode)
    got = []
    for i in range(0, len(ids), 3):  # 3-token pushes: emoji are 2-4 tokens here
        got.append(pieces.push(ids[i : i + 3]))
    got.append(pieces.finish(smollm2.decode(ids)))
    assert "".join(got) == text
    assert sum(bool(g) for g in got[:-1]) >= 3  # not held back to the end
    assert all("\ufffd" not in g for g in got)


def byte_fallback_decode():
    """A SentencePiece-style tokenizer's decode (Llama-2, Mistral, the rebuilt Gemma-3):
    <0xXX> byte pieces joined by tokenizers' ByteFallback, which turns a whole run of them
    into U+FFFD once one byte of it is not valid UTF-8."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["\u2581abc", "\u2581def"]
    tok = Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return tok.decode, {p: i for i, p in enumerate(pieces)}


def test_text_after_a_byte_run_that_turned_invalid_is_not_lost():
    """'é' as two byte tokens, then a stray byte, then words: the whole text turns the run
    into U+FFFD, so the shown 'é' is no longer its start. Before, every later piece was
    held back and `finish` gave nothing: the stream ended at 'é'."""
    decode, ids = byte_fallback_decode()
    tokens = [ids["<0xC3>"], ids["<0xA9>"], ids["<0xC3>"], ids["\u2581abc"], ids["\u2581def"]]
    whole = decode(tokens)
    assert whole == "\ufffd\ufffd\ufffd abc def"
    pieces = TextPieces(decode)
    got = [pieces.push([t]) for t in tokens]
    got.append(pieces.finish(whole))
    assert got[:2] == ["", "é"]
    assert got[3:5] == ["\ufffd abc", " def"]  # streamed as they come, not held
    assert "".join(got) == "é\ufffd abc def"


def test_text_pieces_still_join_to_the_whole_text_under_byte_fallback():
    """Whole characters as byte runs, in every chunking: the pieces are the whole text."""
    decode, ids = byte_fallback_decode()
    text_bytes = "é 🦊".encode() + b" "
    tokens = [ids[f"<0x{b:02X}>"] for b in text_bytes] + [ids["\u2581abc"]]
    whole = decode(tokens)
    assert whole == "é 🦊  abc"
    for size in (1, 2, 3):
        pieces = TextPieces(decode)
        got = [pieces.push(tokens[i : i + size]) for i in range(0, len(tokens), size)]
        assert "".join(got) + pieces.finish(whole) == whole
