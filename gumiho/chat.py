"""`gumiho chat`: a conversation with a target, turn by turn, each answer streamed as the
speculative loop makes it, with its tau and tokens/s.

Medusa shipped a chat command line and EAGLE a web page for trying a drafter by hand; this is
ours. With no flags it runs what `gumiho demo` runs (SmolLM2 and its shipped Gumiho drafter
at the demo preset; on a CPU with AMX bf16, exact); every flag of `gumiho generate` applies
but --prompt, --json and the logprobs.
Each turn sends the whole conversation through the target's chat template, as an API client
does, reusing the cache's entries for the history (prefix.py); when it outgrows the context,
the oldest turns are left out (and a note says so). --show-cycles colours each cycle's text
in turn. Commands: /reset (a new conversation), /stats (the session's totals), /save FILE
and /load FILE (the conversation as JSON), /help, /exit; a line of three double quotes
opens and closes a turn of several lines. Ctrl-C stops an answer (what came so far stays in
the conversation); at the prompt it ends the chat.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gumiho.engine import GenerationResult, context_length
from gumiho.errors import ArgumentParser, GumihoError, cli_errors, one_line, positive_int
from gumiho.generate import check_messages
from gumiho.metrics import added
from gumiho.paths import write_atomically
from gumiho.target import check_unicode

log = logging.getLogger("gumiho")

# each cycle's text in the other of two colours (--show-cycles): a run of one colour is
# what one target step produced
SHADES = ("\033[39m", "\033[36m")
RESET = "\033[0m"
BLOCK = '"""'  # a line of it opens or closes a turn of several lines
HELP = ("/reset starts a new conversation, /stats shows this session's totals, /save FILE "
        "and /load FILE keep and take up a conversation (JSON), /exit (or "
        'Ctrl-D) ends the chat; Ctrl-C stops an answer; a line of """ opens and closes a '
        "turn of several lines, as does a backslash at a line's end")


@dataclass
class Totals:
    """What the session's answers add up to (the /stats line)."""

    turns: int = 0
    new_tokens: int = 0
    cycles: int = 0
    wall_s: float = 0.0
    # of the verify cycles (the prefill's left out), how many accepted a draft at depth k + 1
    verifies: int = 0
    accepted_at: list[int] = field(default_factory=list)

    def add(self, result: GenerationResult) -> None:
        self.turns += 1
        self.new_tokens += result.new_tokens
        self.cycles += result.cycles
        self.wall_s += result.wall_s
        self.verifies += max(result.cycles - 1, 0)  # the prefill's left out
        self.accepted_at = added(self.accepted_at, result.accepted_by_depth())

    def depths(self) -> str:
        """How often each draft depth was accepted, over the verify cycles."""
        shares = [f"{k + 1}: {n / self.verifies:.0%}" for k, n in enumerate(self.accepted_at)]
        return f"; drafts accepted at depth {', '.join(shares)}" if shares else ""

    def line(self) -> str:
        tau = self.new_tokens / max(self.cycles, 1)
        speed = self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0
        return (f"{self.turns} answer{'s' if self.turns != 1 else ''}, {self.new_tokens} "
                f"tokens in {self.cycles} cycles, tau {tau:.2f}, {speed:.1f} tokens/s"
                f"{self.depths()}")


class ChatSession:
    """A conversation: the messages so far, and a generator that answers the next turn.

    `settings` are `stream`'s keyword arguments (max_new_tokens, temperature, ...);
    `reuse_prefix` is on unless they say otherwise: each turn's prompt begins with the last
    turn's prompt and answer, whose prefill it skips (prefix.py)."""

    def __init__(self, gen, system: str | None = None, **settings):
        self.gen = gen
        self.system = system
        self.settings = {"max_new_tokens": 256, "reuse_prefix": True, **settings}
        self.totals = Totals()
        self.dropped = 0  # turns left out of the last answer's prompt to fit the context
        self.last: GenerationResult | None = None  # the last answer's, if it has one
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def save(self, path: str) -> str:
        """Write the conversation to `path` as JSON ({"messages": [...]}, whole or not at
        all); what happened, in a line."""
        data = json.dumps({"messages": self.messages}, ensure_ascii=False, indent=1)
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (undecodable bytes typed): escaped
            data = json.dumps({"messages": self.messages}, indent=1)
        try:
            write_atomically(Path(path).expanduser(),  # (~ is the user's home, as a shell's)
                             lambda tmp: tmp.write_text(data + "\n", encoding="utf-8"))
        except OSError as exc:
            raise GumihoError(f"cannot write {path}: {exc.strerror or exc}") from None
        return f"(the conversation, {len(self.messages)} messages, saved to {path})"

    def load(self, path: str) -> str:
        """Go on with the conversation `save` wrote to `path` (or any {"messages": [{"role",
        "content"}, ...]}); a file that is not one changes nothing."""
        file = Path(path).expanduser()
        if file.exists() and not file.is_file():  # a FIFO, /dev/zero: no end
            raise GumihoError(f"cannot read {path}: not a file")
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise GumihoError(f"cannot read {path}: {exc.strerror or exc}") from None
        except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise GumihoError(f"{path} is not JSON in UTF-8: {one_line(exc)}") from None
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise GumihoError(f"{path} holds no conversation: expected "
                              '{"messages": [{"role": ..., "content": ...}, ...]}')
        check_messages(messages)
        try:
            for m in messages:
                check_unicode(m["content"])
        except GumihoError as exc:
            raise GumihoError(f"{path}: {exc}") from None
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        return f"(a conversation of {len(messages)} messages loaded from {path})"

    def fitted(self, messages: list[dict]) -> list[dict]:
        """`messages` without their oldest turns (a user message and what came after it
        up to the next one), as many as prompt + max_new_tokens needs to fit the target's
        context; a system message first and the new turn stay. One turn alone too long is
        `stream`'s error to report."""
        limit = context_length(self.gen.target)
        room = None if limit is None else limit - self.settings["max_new_tokens"]
        head = 1 if messages[0]["role"] == "system" else 0  # (a loaded one's too)
        self.dropped = 0
        while (room is not None and len(messages) - head > 1
               and len(self.gen.prompt_ids(messages)) > room):
            end = head + 1
            while end < len(messages) - 1 and messages[end]["role"] != "user":
                end += 1
            messages = messages[:head] + messages[end:]
            self.dropped += 1
        return messages

    def reply(self, text: str, cycles: bool = False) -> Iterator:
        """Text pieces of the answer to the user's `text` (with `cycles`, `stream`'s Cycles).
        The turn and its answer join the conversation once the answer ends or is stopped
        early (closing this iterator), not when generating fails (a bad setting, a prompt
        past the context: raised at the first piece; nor when another generation on the
        same target superseded it). `last` is then this answer's result, else None."""
        self.last = None
        asked = self.fitted(self.messages + [{"role": "user", "content": text}])
        pieces = self.gen.stream(asked, **self.settings, cycles=cycles)
        owner = self.gen.target.stream_owner  # this stream's; a newer call replaces it
        try:
            yield from pieces
        finally:
            pieces.close()
            result = self.gen.last_result
            if result is not None and self.gen.target.stream_owner is owner:
                self.messages = asked + [{"role": "assistant", "content": result.text}]
                self.totals.add(result)
                self.last = result


def answer_line(method: str, result: GenerationResult) -> str:
    stopped = " (stopped)" if result.stopped_by == "closed" else \
        " (cut at --max-new-tokens)" if result.stopped_by == "max_new_tokens" else ""
    reused = f", {result.reused_tokens} prompt tokens reused" if result.reused_tokens else ""
    return f"[{method}] {result.summary()}{reused}{stopped}"


class Block(str):
    """A turn typed as a block of lines: its text as it came (indentation kept), never a
    command."""


def turns(lines: Iterable[str]) -> Iterator[str]:
    """The user's turns in the lines typed or piped: a line is a turn, but a line ending in
    a backslash goes on to the next, and a line of three double quotes opens a block of
    lines (pasted text, code) that the next such line closes, one turn (a `Block`)."""
    held: list[str] = []
    block = False
    for line in lines:
        line = line.rstrip("\r\n")
        if line.strip() == BLOCK:
            if block:
                yield Block("\n".join(held))
                held = []
            elif held:  # a backslash line before the block: a turn of its own
                yield "\n".join(held)
                held = []
            block = not block
        elif block:
            held.append(line)
        elif line.endswith("\\"):
            held.append(line[:-1])
        else:
            yield "\n".join(held + [line])
            held = []
    if held:
        yield Block("\n".join(held)) if block else "\n".join(held)


def converse(session: ChatSession, lines: Iterable[str], out: TextIO, info: TextIO,
             method: str, show_cycles: bool = False) -> None:
    """The chat loop over `lines` (the user's turns and commands, `turns`): answers to
    `out` (with `show_cycles` each cycle's text in the other colour), each answer's
    statistics, notes and errors to `info`. Ends at /exit or when `lines` do."""
    for text in turns(lines):
        if isinstance(text, Block):  # pasted text: as it is, even if it starts with a /
            if text.strip():
                answer(session, text.strip("\n"), out, info, method, show_cycles)
            continue
        text = text.strip()
        if not text:
            continue
        command = text.lower()
        word, _, path = text.partition(" ")
        if command in ("/exit", "/quit"):
            return
        if word.lower() in ("/save", "/load") and not path.strip():
            print(f"error: {word.lower()} needs a file: {word.lower()} FILE", file=info,
                  flush=True)
            continue
        if word.lower() in ("/save", "/load"):
            try:
                note = (session.save if word.lower() == "/save" else session.load)(path.strip())
                print(note, file=info, flush=True)
            except GumihoError as exc:
                print(f"error: {one_line(exc)}", file=info, flush=True)
            continue
        if command == "/reset":
            session.reset()
            print("(a new conversation)", file=info, flush=True)
        elif command == "/stats":
            print(f"[{method}] {session.totals.line()}", file=info, flush=True)
        elif command in ("/help", "/?"):
            print(HELP, file=info, flush=True)
        elif text.startswith("/") and not any(c.isspace() for c in text):
            print(f"error: unknown command {text}: {HELP}", file=info, flush=True)
        else:
            answer(session, text, out, info, method, show_cycles)


def answer(session: ChatSession, text: str, out: TextIO, info: TextIO, method: str,
           show_cycles: bool = False) -> None:
    """Stream one answer; Ctrl-C stops it (kept as far as it came), a bad turn is one
    `error:` line and leaves the conversation as it was."""
    shown = 0  # pieces shown: the next takes the other colour
    try:
        pieces = session.reply(text, cycles=show_cycles)
        try:
            for piece in pieces:
                if show_cycles and piece.text:
                    piece = f"{SHADES[shown % 2]}{piece.text}{RESET}"
                elif show_cycles:
                    continue  # held back: its text comes with a later cycle's
                print(piece, end="", file=out, flush=True)
                shown += 1
        except KeyboardInterrupt:
            pieces.close()
    except GumihoError as exc:
        if shown:
            print(file=out, flush=True)
        print(f"error: {one_line(exc)}", file=info, flush=True)
        return
    print(file=out, flush=True)
    if session.last is None:  # (Ctrl-C before it began)
        return
    if session.dropped:
        print(f"(the {session.dropped} oldest turn{'s' if session.dropped > 1 else ''} "
              "left out to fit the context)", file=info, flush=True)
    print(answer_line(method, session.last), file=info, flush=True)


def typed_lines(prompt: str) -> Iterator[str]:
    """What the user types at a terminal (line editing by `input`), until Ctrl-D or
    Ctrl-C at the prompt."""
    while True:
        try:
            yield input(prompt)
        except (EOFError, KeyboardInterrupt):
            print()
            return


def build_parser() -> argparse.ArgumentParser:
    from gumiho.flags import add_answer_args, add_generator_args, add_sampling_args

    parser = ArgumentParser(prog="gumiho chat", description=__doc__.split("\n")[0])
    add_generator_args(parser)
    parser.set_defaults(method="gumiho")  # and, for a drafter, --preset demo (chat_defaults)
    parser.add_argument("--system", default=None,
                        help="a system message that opens every conversation")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256,
                        help="the longest answer (default 256)")
    parser.add_argument("--show-cycles", action="store_true",
                        help="print each cycle's text in the other of two colours: a run of "
                        "one colour is what one target step produced")
    parser.add_argument("--no-reuse-prefix", action="store_true",
                        help="prefill each turn's whole conversation afresh (default: reuse "
                        "the cache's entries for the history the last turn left)")
    add_sampling_args(parser)
    add_answer_args(parser)
    return parser


def chat_defaults(args: argparse.Namespace) -> None:
    """A drafter method runs at --preset demo unless another is given, and on the embedded
    SmolLM2 without --draft takes the drafter shipped for it, as `gumiho demo` does."""
    from gumiho.demo import shipped_drafter
    from gumiho.methods import DRAFTER_METHODS

    if args.method not in DRAFTER_METHODS:
        return
    args.preset = args.preset or "demo"
    if args.draft is None:
        if args.target != "smollm2":
            raise GumihoError(f"--method {args.method} needs --draft (a drafter trained for "
                              f"{args.target}), or use --method ar or lookup")
        args.draft = str(shipped_drafter(args.method))


@cli_errors
def main(argv: list[str] | None = None) -> int:
    from gumiho.demo import exact_bf16_default
    from gumiho.flags import answer_settings, sampling_settings
    from gumiho.generate import check_context_room, load_from_args

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="gumiho: %(message)s", stream=sys.stderr)
    check_context_room(args.target, args.max_new_tokens)
    chat_defaults(args)
    exact_bf16_default(args)
    gen = load_from_args(args, args.temperature)
    session = ChatSession(gen, args.system, max_new_tokens=args.max_new_tokens,
                          reuse_prefix=not args.no_reuse_prefix, **sampling_settings(args),
                          **answer_settings(args))
    gen.generate([{"role": "user", "content": "Hi"}], 4, **sampling_settings(args))  # warm-up
    interactive = sys.stdin.isatty()
    print(f"(chatting with {args.target}, --method {args.method}; {HELP})", file=sys.stderr,
          flush=True)
    lines = typed_lines("> ") if interactive else sys.stdin
    converse(session, lines, sys.stdout, sys.stderr, args.method, args.show_cycles)
    if session.totals.turns:
        print(f"[{args.method}] {session.totals.line()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
