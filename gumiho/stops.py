"""Stop strings: the answer ends at the token that completes one of them.

A user's `stop=["\\n\\n", "User:"]` (vLLM's `stop`, OpenAI's `stop`, transformers'
`generate(stop_strings=...)`) is text, and text does not follow token boundaries: "\\n\\n"
may come as two tokens, or inside one with more after it. So the loop decodes and looks
for the strings in the text, and ends after the first token at which the answer's text
holds one, wherever in that token the string ends; that token is the last one kept, as
transformers' StopStringCriteria keeps it. A speculative cycle may accept several tokens
past that one: they are dropped, so the token ids are plain decoding's with the same stop.
The text stops before the stop string, which is not part of the answer (OpenAI's and
vLLM's convention; the token ids still hold the tokens that spelled it).

Only the answer is searched, not the prompt. Each cycle decodes a short window: the last
`2 * longest + 8` tokens before the cycle's new ones, the longest stop string measured in
UTF-8 bytes (a token spells at least one byte, so a string of n bytes spans at most n
tokens; in characters it did not hold: an emoji is 3 of SmolLM2's byte-level tokens, and
plain decoding missed such a stop that a cycle of several tokens found; empty special
tokens, under `ignore_eos`, are not counted), and the new ones; only where the window
holds a stop string are its prefixes decoded to find the token that completed it. On the
2-core Xeon (2026-12-01, SmolLM2's tokenizer, 3 tokens a cycle) that cost 13 us a cycle
for "\\n\\n" and 17 us for two strings of up to 7 characters, against a 22 ms plain
step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gumiho.errors import GumihoError


def check_stops(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """A stop argument as a tuple of strings: None or () for none, one string, or several."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stops = tuple(stop)
    except TypeError:
        raise TypeError(f"stop must be a string or a list of strings, got "
                        f"{type(stop).__name__}") from None
    for s in stops:
        if not isinstance(s, str):
            raise TypeError(f"stop must be a string or a list of strings, got a "
                            f"{type(s).__name__} in it")
        if not s:
            raise GumihoError("a stop string must not be empty")
    return stops


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first of `stops` starts in `text` (None: none is there)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


class StopStrings:
    """The loop's search for stop strings, a cycle's tokens at a time."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        # tokens of context before a cycle's: a token spells at least one byte (a character
        # can take several tokens: an emoji is 3 of SmolLM2's), so twice a stop's bytes
        self.reach = 2 * max(len(s.encode()) for s in stops) + 8
        self.tokens: list[int] = []

    def through(self, new: list[int]) -> int | None:
        """How many of `new` (a cycle's tokens, in order) to keep: through the token that
        completes a stop string, None where none does. Records the tokens kept."""
        back = self.tokens[-self.reach:]
        if first_stop(self.decode(back + new), self.stops) is None:
            self.tokens += new
            return None
        for n in range(1, len(new)):  # the window holds one: which token completed it
            if first_stop(self.decode(back + new[:n]), self.stops) is not None:
                break
        else:
            n = len(new)
        self.tokens += new[:n]
        return n

    def text(self, text: str) -> str:
        """The answer's text before its first stop string."""
        end = first_stop(text, self.stops)
        return text if end is None else text[:end]


class HeldText:
    """A stream's text pieces with stop strings: never shows a stop string, nor text that
    may yet turn out to be the start of one (the longest end of the text so far that
    begins a stop string waits for the next piece), so no shown text is ever taken back."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.seen = self.shown = ""

    def push(self, piece: str) -> str:
        self.seen += piece
        end = first_stop(self.seen, self.stops)
        if end is None:
            end = len(self.seen) - self.held()
        out = self.seen[len(self.shown):end]
        self.shown += out
        return out

    def held(self) -> int:
        """The length of the longest end of the text so far that begins a stop string."""
        for n in range(min(len(self.seen), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.seen[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def finish(self, text: str, tail: str = "") -> str:
        """What the whole answer's text (cut at its stop) holds beyond the pieces shown;
        where the pieces are not its start (a byte-fallback run that turned invalid, see
        text_pieces.py), what this holds back and `tail` (the pieces' text still owed) up
        to a stop, so the held-back end is not lost."""
        if text.startswith(self.shown):
            return text[len(self.shown):]
        seen = self.seen + tail
        end = first_stop(seen, self.stops)
        return seen[len(self.shown):len(seen) if end is None else end]
