"""Streaming text from token ids: `TextPieces` (used by `SpeculativeGenerator.stream`)."""

from __future__ import annotations


class TextPieces:
    """The text of a growing list of token ids, a piece at a time, each decode a short window.

    Decoding the whole text after every cycle costs O(n) a cycle, O(n^2) an answer. Decoding
    only the new tokens is wrong: a tokenizer may drop a leading space, and a character may
    span two tokens. So each push decodes a window that starts at the tokens before the last
    piece (the context a tokenizer needs at the boundary) and emits what that window adds
    beyond them, held back while it ends inside a UTF-8 character (U+FFFD; the tokens before
    that character are given) or the window's text does not extend its context's. `finish`
    compares with the whole answer's decode and gives what is still owed, so the pieces join
    to it whenever the pieces so far are its start (tests/test_text_pieces.py: SmolLM2's
    byte-level BPE over code, emoji, accents and CJK, in random chunks; a tokenizer whose
    decode changes text across a boundary would hold its pieces back and give them at the
    end).

    One decoder changes text already shown: a byte-fallback decoder (SentencePiece models:
    Llama-2, Mistral, Vicuna, the rebuilt Gemma-3) turns a whole run of byte tokens into
    U+FFFD once one of them is not valid UTF-8, so a character shown from the run's first
    bytes becomes U+FFFD in the answer's text. The window then never extends its context
    again; once it ends on a whole character, the new tokens' own text is given and the
    stream goes on (the pieces keep the character; nothing after it is lost).
    """

    def __init__(self, decode):
        self.decode = decode
        self.tokens: list[int] = []
        self.start = 0  # the window's first token: the last piece's context
        self.mark = 0  # tokens before this have been shown
        self.pieces: list[str] = []  # what push gave so far

    def push(self, new: list[int]) -> str:
        self.tokens += new
        # the newest token first; where the text ends inside a character, the tokens before
        # it (an emoji-only answer whose cycles all end mid-character streamed nothing
        # until its end): a few more short decodes, only then
        for end in range(len(self.tokens), self.mark, -1):
            piece = self.owed(end=end)
            if piece and not piece.endswith("\ufffd"):
                self.start, self.mark = self.mark, end
                self.pieces.append(piece)
                return piece
        return ""  # wait for more tokens

    def owed(self, final: bool = False, end: int | None = None) -> str:
        """The text the tokens not yet shown (up to `end`) add: the window's beyond its
        context's; where the window no longer starts with its context (a byte-fallback run
        turned invalid), the new tokens' own text once the window ends on a whole character
        (or `final`)."""
        context = self.decode(self.tokens[self.start : self.mark])
        window = self.decode(self.tokens[self.start : end])
        if window.startswith(context):
            return window[len(context) :]
        if window.endswith("\ufffd") and not final:
            return ""  # a character may still be completing the run: wait
        return self.decode(self.tokens[self.mark : end])

    def finish(self, text: str) -> str:
        """What the whole answer's text holds beyond the pieces given (held-back tokens);
        where the pieces are not its start (see the class doc), the held-back tokens' text."""
        shown = "".join(self.pieces)
        return text[len(shown) :] if text.startswith(shown) else self.owed(final=True)
