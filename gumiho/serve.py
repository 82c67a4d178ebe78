"""An OpenAI-compatible HTTP server over one speculative generator: `gumiho serve`.

    gumiho serve --method gumiho --draft gumiho/assets/smollm2/gumiho --preset demo
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

The endpoints are the ones OpenAI's clients and vLLM's users call: `POST
/v1/chat/completions` (the chat template applied), `POST /v1/completions` (a raw prompt),
`GET /v1/models`, `GET /health`, `GET /version`, `GET /metrics` (Prometheus' text format, vLLM's
metric names under `gumiho:`, metrics.py), and vLLM's `POST /tokenize` and `POST
/detokenize`. A request's sampling fields are OpenAI's
(`temperature`, `top_p`, `max_tokens`/`max_completion_tokens`, `stop`, `seed`,
`presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs`, `top_logprobs`,
`stream` with `stream_options.include_usage`) and vLLM's extras (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`; and transformers'
`no_repeat_ngram_size`), each handed to
`SpeculativeGenerator.generate`/`stream`, so an answer is plain decoding's under the same
settings. Every response adds a `speculative` object (method, tau, cycles, tokens/s).

One generation runs at a time (the target's caches belong to one), on the main thread
(`Worker`): requests wait their turn, while `/health` and `/v1/models` answer at once.
`n` answers are sampled one after another with seeds `seed`, `seed + 1`, ... (a request
without a seed gets a random one, so it samples afresh each time, as OpenAI's). Not
served: `best_of` above 1, `echo`, `suffix`, tools and a `response_format` other than
text; each is refused with a 400 that says so. A stream with `logprobs` sends a chunk a
cycle, holding that cycle's tokens'. Python's standard library serves it (no web framework
to install).
"""

from __future__ import annotations

import argparse
import codecs
import hmac
import itertools
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from gumiho.engine import (
    GenerateConfig,
    check_in_vocabulary,
    check_prompt,
    check_token_ids,
    context_length,
)
from gumiho.errors import ArgumentParser, GumihoError, cli_errors, positive_int
from gumiho.metrics import Metrics
from gumiho.target import check_unicode
from gumiho.version import __version__, code_version
from gumiho.worker import Stopped, Worker

log = logging.getLogger("gumiho")

MAX_CHOICES = 16  # n per request
MAX_BODY = 16 * 2**20  # bytes of a request body
FINISH = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length",
          "closed": "stop"}
# request fields passed to generate() under their own names or another
RENAMED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "seed": "seed", "repetition_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
           "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
           "stop_token_ids": "stop_token_ids", "stop": "stop",
           "no_repeat_ngram_size": "no_repeat_ngram_size"}
UNSERVED = {"echo": "echo", "suffix": "suffix", "tools": "tools", "functions": "functions",
            "guided_json": "guided decoding", "guided_regex": "guided decoding",
            "guided_choice": "guided decoding"}


def byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE token stands for (GPT-2's
    bytes_to_unicode, inverted: printable bytes as themselves, the others from U+0100)."""
    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in shown]
    return {chr(b): b for b in shown} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_OF = byte_level_alphabet()
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TextOffsets:
    """Where each token of an answer begins in its text (completions' `text_offset`), read
    from the tokens' bytes in turn: a token inside a character split across tokens begins
    where that character does (each such token's text alone is one U+FFFD)."""

    def __init__(self):
        self.chars = 0  # the whole characters so far
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, data: list[int]) -> int:
        """The next token's offset, given its bytes."""
        at = self.chars
        self.chars += len(self.decoder.decode(bytes(data)))
        return at


class RequestError(Exception):
    """A request the server refuses: its HTTP status and a one-line reason."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def settings_from(body: dict, default_max_tokens: int, chat: bool) -> dict:
    """`generate`'s keyword arguments from an OpenAI request body (types and ranges are
    checked by GenerateConfig; what it refuses becomes a 400)."""
    for field, what in UNSERVED.items():
        if body.get(field) not in (None, False, "", [], {}):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{what} is not supported here")
    form = body.get("response_format")
    if form not in (None, {}) and form != {"type": "text"}:  # text: the default, a no-op
        raise RequestError(HTTPStatus.BAD_REQUEST, "response_format other than "
                           "{'type': 'text'} is not supported here")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"seed must be an integer, got {seed!r}")
    # as OpenAI's: "false" or 1 would read as true (completions' logprobs is a count)
    for field in ("stream", *(("logprobs",) if chat else ())):
        if not isinstance(body.get(field), bool | None):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{field} must be true or false, "
                               f"got {body[field]!r}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "stream_options must be an object, "
                               f"got {options!r}")
        if not body.get("stream"):
            raise RequestError(HTTPStatus.BAD_REQUEST, "stream_options is only for a "
                               "request with stream: true")
        if not isinstance(options.get("include_usage", False), bool | None):
            raise RequestError(HTTPStatus.BAD_REQUEST, "stream_options.include_usage must "
                               f"be true or false, got {options['include_usage']!r}")
    if body.get("best_of", 1) not in (1, None):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"best_of must be 1 here, got "
                           f"{body['best_of']!r}")
    settings = {RENAMED[k]: v for k, v in body.items() if k in RENAMED and v is not None}
    settings.setdefault("temperature", 1.0)  # OpenAI's and vLLM's default
    if settings.get("top_k") == -1:  # vLLM's "all tokens", as 0 here
        settings["top_k"] = 0
    # without a seed each request samples afresh, as OpenAI's (generate's default is 0);
    # any integer is a seed, as OpenAI's and vLLM's (negative ones too): generate's are
    # 0..2**63 - 1
    settings["seed"] = secrets.randbelow(2**62) if seed is None else seed % 2**63
    if settings.get("stop") is None:
        settings.pop("stop", None)
    limit = token_limit(body)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):  # (generate would name its max_new_tokens)
        name = "max_tokens" if body.get("max_completion_tokens") is None \
            else "max_completion_tokens"
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{name} must be an integer >= 1, got "
                           f"{limit!r}")
    settings["max_new_tokens"] = default_max_tokens if limit is None else limit
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "logit_bias must be an object of "
                               "token id -> bias")
        try:
            settings["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "logit_bias keys must be token ids "
                               f"(integers), got {list(bias)!r}") from None
    logprobs = body.get("logprobs")
    if chat:  # logprobs: true/false, top_logprobs: 0-20
        if body.get("top_logprobs") and not logprobs:
            raise RequestError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs: true")
        if logprobs:
            settings["logprobs"] = True
            settings["top_logprobs"] = body.get("top_logprobs") or 0
    elif logprobs is not None:  # completions: logprobs is the number of alternatives
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
            raise RequestError(HTTPStatus.BAD_REQUEST, "logprobs must be an integer >= 0 "
                               f"(the alternatives per token), got {logprobs!r}")
        settings["logprobs"] = True
        settings["top_logprobs"] = logprobs
    choices(body)  # checked here, before a stream's first chunk
    return settings


def token_limit(body: dict) -> int | None:
    """The request's max_completion_tokens, else its max_tokens (None: it names neither)."""
    limit = body.get("max_completion_tokens")  # present but null: max_tokens holds
    return body.get("max_tokens") if limit is None else limit


@contextmanager
def bad_request():
    """A ValueError or TypeError raised by checking a request: a 400 saying why."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise RequestError(HTTPStatus.BAD_REQUEST, str(exc)) from None


def seeded(settings: dict, i: int) -> dict:
    """The settings of a request's answer i: its seed is the request's + i."""
    return {**settings, "seed": (settings["seed"] + i) % 2**63}


def choices(body: dict) -> int:
    """The request's `n`: how many answers (each sampled with seed, seed + 1, ...)."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"n must be an integer from 1 to "
                           f"{MAX_CHOICES}, got {n!r}")
    return n


def chat_messages(body: dict) -> list[dict]:
    """The request's messages as {"role", "content"} dicts with text content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "each message must be an object")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise RequestError(HTTPStatus.BAD_REQUEST, "only text content is supported")
            content = "".join(p.get("text", "") for p in content)
        out.append({"role": m.get("role"), "content": content})
    return out


class Server:
    """What the handler calls: one generator and its name; `worker` runs generations."""

    def __init__(self, gen, name: str, max_tokens: int, method: str, worker: Worker,
                 reuse_prefix: bool = False, api_key: str | None = None):
        self.gen, self.name, self.max_tokens, self.method = gen, name, max_tokens, method
        self.worker = worker
        self.reuse_prefix = reuse_prefix  # every generation's (prefix.py)
        self.api_key = api_key or None  # the key requests must send (Handler.authorized)
        self.metrics = Metrics()

    def metrics_text(self) -> str:
        return self.metrics.text(self.worker.running, self.worker.jobs.qsize())

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model not in (None, self.name):
            raise RequestError(HTTPStatus.NOT_FOUND, f"the model {model!r} is not served "
                               f"here (this server serves {self.name!r})")

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model",
                                           "created": 0, "owned_by": "gumiho"}]}

    def prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            prompt = chat_messages(body)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
                if len(prompt) != 1:
                    raise RequestError(HTTPStatus.BAD_REQUEST, "one prompt per request")
                prompt = prompt[0]
            if isinstance(prompt, str):
                if not prompt:
                    raise RequestError(HTTPStatus.BAD_REQUEST, "empty prompt")
                check_unicode(prompt)
                prompt = self.gen.target.tokenizer(prompt).input_ids  # raw: no template
        return self.gen.prompt_ids(prompt)

    def tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize: a prompt's ids as a completion (`prompt`) or a chat
        (`messages`, the template applied) would see them."""
        self.check_model(body)
        with bad_request():
            ids = self.prompt(body, chat="messages" in body)
        return {"count": len(ids), "max_model_len": context_length(self.gen.target),
                "tokens": ids}

    def detokenize(self, body: dict) -> dict:
        """vLLM's /detokenize: the text of token ids."""
        self.check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError(HTTPStatus.BAD_REQUEST, "tokens must be a list of token ids")
        check_in_vocabulary(self.gen.target, "token id", tokens)
        return {"prompt": self.gen.target.decode(tokens)}

    def stats(self, *results) -> dict:
        """The method, tau, cycles and tokens/s over a request's answers."""
        tokens = sum(r.new_tokens for r in results)
        cycles = sum(r.cycles for r in results)
        wall = sum(r.wall_s for r in results)
        return {"method": self.method, "tau": round(tokens / max(cycles, 1), 4),
                "cycles": cycles, "tokens_per_s": round(tokens / wall, 2) if wall else 0.0}

    def usage(self, ids: list[int], *results) -> dict:
        tokens = sum(r.new_tokens for r in results)
        usage = {"prompt_tokens": len(ids), "completion_tokens": tokens,
                 "total_tokens": len(ids) + tokens}
        if self.reuse_prefix:  # OpenAI's count of prompt tokens served from a cache
            usage["prompt_tokens_details"] = {"cached_tokens": results[0].reused_tokens}
        return usage

    def request(self, body: dict, chat: bool) -> tuple[dict, list[int]]:
        """A request's `generate` settings and prompt ids, checked here as `generate` would
        check them: what it refuses is the request's fault (a 400), so a ValueError or
        TypeError raised later, while generating, is the server's (a 500, logged)."""
        self.check_model(body)
        settings = settings_from(body, self.max_tokens, chat)
        settings["reuse_prefix"] = self.reuse_prefix
        with bad_request():
            ids = self.prompt(body, chat)
            room = context_length(self.gen.target)
            if token_limit(body) is None and room is not None:
                # the server's default, not the client's ask: at most what the context
                # leaves (a prompt that fills it is refused as too long)
                room -= len(ids)
                settings["max_new_tokens"] = max(1, min(self.max_tokens, room))
            config = GenerateConfig(**settings)  # (the stop strings checked there too)
            check_prompt(self.gen.target, ids, config.max_new_tokens)
            check_token_ids(self.gen.target, config)
        return settings, ids

    def head(self, chat: bool, chunk: bool = False) -> dict:
        """A response's id, object, time and model."""
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat \
            else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.name}

    def answer(self, body: dict, chat: bool) -> dict:
        """A whole (not streamed) completion."""
        arrived = time.perf_counter()
        settings, ids = self.request(body, chat)
        results, began = [], []

        def generate(i: int):
            began.append(time.perf_counter())  # off the queue
            return self.gen.generate(ids, **seeded(settings, i))
        for i in range(choices(body)):
            # a turn each: another request may come between two answers
            results.append(self.worker.call(lambda i=i: generate(i)))
        self.metrics.record(len(ids), results, arrived, began[0])
        answers = []
        for i, result in enumerate(results):
            choice = {"index": i, "finish_reason": FINISH[result.stopped_by]}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
                choice["logprobs"] = self.chat_logprobs(result) if result.logprobs else None
            else:
                choice["text"] = result.text
                choice["logprobs"] = self.text_logprobs(result) if result.logprobs else None
            answers.append(choice)
        return {**self.head(chat), "choices": answers, "usage": self.usage(ids, *results),
                "speculative": self.stats(*results)}

    def chunks(self, body: dict, chat: bool) -> Iterator[dict]:
        """A streamed completion's chunks (checked before the first is made): its `n`
        answers one after another, each chunk naming its answer's index."""
        arrived = time.perf_counter()
        settings, ids = self.request(body, chat)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n = choices(body)
        return self.worker.iterate(lambda: self._chunks(ids, settings, chat, usage, arrived,
                                                        n))

    def _chunks(self, ids, settings, chat, usage, arrived, n) -> Iterator[dict]:
        head = self.head(chat, chunk=True)

        def chunk(i: int, text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None,
                          "finish_reason": finish}
            # with include_usage every chunk has the field, null until the last (OpenAI's)
            return {**head, "choices": [choice], **({"usage": None} if usage else {})}

        results, began = [], time.perf_counter()  # off the queue
        logprobs = bool(settings.get("logprobs"))  # then a chunk a cycle, with its tokens'
        try:
            for i in range(n):
                pieces = self.gen.stream(ids, **seeded(settings, i), cycles=logprobs)
                try:
                    if chat:
                        yield chunk(i, "", None, role=True)
                    offsets = TextOffsets()  # completions' text_offset, chunk to chunk
                    for piece in pieces:
                        if not logprobs:
                            if piece:
                                yield chunk(i, piece, None)
                            continue
                        one = chunk(i, piece.text, None)
                        if piece.token_ids:  # (the last may be held-back text alone)
                            scores = (self.chat_logprobs(piece) if chat
                                      else self.text_logprobs(piece, offsets))
                            one["choices"][0]["logprobs"] = scores
                        yield one
                finally:
                    pieces.close()  # a client gone mid-answer stops the generation
                    if (result := self.gen.last_result) is not None:  # None: it failed
                        results.append(result)
                end = chunk(i, None, FINISH[result.stopped_by])
                end["speculative"] = self.stats(result)
                yield end
        finally:
            if results:
                self.metrics.record(len(ids), results, arrived, began)
        if usage:
            yield {**head, "choices": [], "usage": self.usage(ids, *results)}

    def token_text(self, token_id: int) -> str:
        return self.gen.target.decode([token_id])

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """A token's own UTF-8 bytes (OpenAI's `bytes`, which join into a character split
        across tokens: decoded alone, as `text`, such a token is U+FFFD)."""
        if "\ufffd" in text:
            piece = self.gen.target.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and (byte := BYTE_TOKEN.fullmatch(piece)):
                return [int(byte[1], 16)]
            if isinstance(piece, str) and piece and all(c in BYTE_OF for c in piece):
                return [BYTE_OF[c] for c in piece]  # byte-level BPE (GPT-2's, SmolLM2's)
        return list(text.encode())

    def chat_logprobs(self, result) -> dict:
        """OpenAI's chat `logprobs` of a result's tokens (or a stream Cycle's)."""
        def entry(token_id, logprob):
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob,
                    "bytes": self.token_bytes(token_id, text)}
        tops = result.top_logprobs or [[] for _ in result.token_ids]
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                            for t, lp, top in zip(result.token_ids, result.logprobs, tops,
                                                  strict=True)]}

    def text_logprobs(self, result, offsets: TextOffsets | None = None) -> dict:
        """OpenAI's completions `logprobs` of a result's tokens (or of a stream Cycle's,
        `offsets` then holding the answer's earlier tokens)."""
        offsets = TextOffsets() if offsets is None else offsets
        tokens = [self.token_text(t) for t in result.token_ids]
        starts = [offsets.add(self.token_bytes(t, text))
                  for t, text in zip(result.token_ids, tokens, strict=True)]
        tops = result.top_logprobs
        return {"tokens": tokens, "token_logprobs": result.logprobs, "text_offset": starts,
                "top_logprobs": None if tops is None else [
                    {self.token_text(i): v for i, v in top} for top in tops]}


class Handler(BaseHTTPRequestHandler):
    server_version = "gumiho"
    server: GumihoHTTPServer

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        log.info("%s %s", self.address_string(), format % args)

    def send_json(self, status: HTTPStatus, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, status: HTTPStatus, message: str) -> None:
        if self.server.gumiho is not None:
            self.server.gumiho.metrics.refused(status)
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.send_json(status, {"error": {"message": message, "type": kind,
                                          "code": int(status)}})

    def authorized(self, path: str) -> bool:
        """With an API key (--api-key), the /v1 endpoints, /tokenize and /detokenize want
        it as `Authorization: Bearer KEY` (as vLLM's and OpenAI's clients send it); a
        request without it gets a 401. /health, /version and /metrics stay open."""
        key = self.server.gumiho.api_key if self.server.gumiho else None
        if key is None or path in ("/health", "/version", "/metrics"):
            return True
        sent = self.headers.get("Authorization", "")
        if hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            return True
        self.send_error_json(HTTPStatus.UNAUTHORIZED, "a valid API key is needed: send "
                             "the header 'Authorization: Bearer KEY'")
        return False

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = urlsplit(self.path).path.rstrip("/")  # a query string is ignored
        if not self.authorized(path):
            return
        if path == "/health":
            self.send_json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/version":
            self.send_json(HTTPStatus.OK, {"version": __version__,
                                           "code": code_version(short=True)})
        elif path == "/v1/models":
            self.send_json(HTTPStatus.OK, self.server.gumiho.models())
        elif path == "/metrics":
            data = self.server.gumiho.metrics_text().encode()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_error_json(HTTPStatus.NOT_FOUND, f"no such path: {self.path}")

    def read_body(self) -> bytes:
        """The request's body, read whole before any reply (a client still sending it
        would hear a refusal as a broken pipe)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "send the body with a "
                               "Content-Length (chunked bodies are not read)")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length must be a whole "
                               f"number of bytes, got {self.headers.get('Content-Length')!r}")
        if length > MAX_BODY:
            self.close_connection = True  # the body stays unread
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is "
                               f"{length} bytes; at most {MAX_BODY} are read")
        return self.rfile.read(length)

    def do_POST(self):  # noqa: N802
        path = urlsplit(self.path).path.rstrip("/")
        try:
            raw = self.read_body()
        except RequestError as exc:
            self.send_error_json(exc.status, str(exc))
            return
        if not self.authorized(path):
            return
        if path not in ("/v1/chat/completions", "/v1/completions", "/tokenize",
                        "/detokenize"):
            self.send_error_json(HTTPStatus.NOT_FOUND, f"no such path: {self.path}")
            return
        chat = path == "/v1/chat/completions"
        try:
            try:
                body = json.loads(raw or b"null")
            except (ValueError, RecursionError) as exc:  # (a JSONDecodeError is a ValueError)
                raise RequestError(HTTPStatus.BAD_REQUEST, "invalid JSON: it nests too "
                                   "deeply" if isinstance(exc, RecursionError)
                                   else f"invalid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
            if path in ("/tokenize", "/detokenize"):
                gumiho = self.server.gumiho
                self.send_json(HTTPStatus.OK, gumiho.tokenize(body) if path == "/tokenize"
                               else gumiho.detokenize(body))
            elif body.get("stream"):
                self.stream(self.server.gumiho.chunks(body, chat))
            else:
                self.send_json(HTTPStatus.OK, self.server.gumiho.answer(body, chat))
        except (BrokenPipeError, ConnectionResetError):  # nobody to tell
            log.info("client left before its answer was sent")
        except RequestError as exc:
            self.send_error_json(exc.status, str(exc))
        except Stopped as exc:  # Ctrl-C on the server: not a bug
            log.info("%s", exc)
            self.send_error_json(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
        except GumihoError as exc:  # a prompt past the context, found while generating
            self.send_error_json(HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:  # a bug: the client hears of it, the server goes on
            log.exception("request failed")
            self.send_error_json(HTTPStatus.INTERNAL_SERVER_ERROR,
                                 f"{type(exc).__name__}: {exc}")

    def stream(self, chunks: Iterator[dict]) -> None:
        """Server-sent events, one chunk each, then `data: [DONE]`. A failure after the
        first chunk (the status is sent by then) is an `error` event before `[DONE]`."""
        first = next(chunks)  # errors in the settings surface here, as a 400
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            try:
                for one in itertools.chain([first], chunks):
                    self.wfile.write(f"data: {json.dumps(one)}\n\n".encode())
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # noqa: BLE001 - told to the client, in the stream
                if isinstance(exc, Stopped):
                    log.info("%s", exc)
                else:
                    log.exception("a stream failed")
                kind = "invalid_request_error" if isinstance(exc, GumihoError) \
                    else "server_error"
                error = {"error": {"message": str(exc), "type": kind}}
                self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            chunks.close()  # the client left: the generation stops
            log.info("client left mid-stream")


class GumihoHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, server: Server | None):
        super().__init__(address, Handler)
        self.gumiho = server


def port_number(text: str) -> int:
    """--port: a TCP port, 0..65535 (socket's bind raises an OverflowError past it)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text}")
    return port


def build_parser() -> argparse.ArgumentParser:
    from gumiho.flags import add_generator_args

    parser = ArgumentParser(prog="gumiho serve", description=__doc__.split("\n")[0])
    add_generator_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=port_number, default=8000,
                        help="port to listen on (default 8000; 0: any free port)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: --target)")
    parser.add_argument("--max-tokens", type=positive_int, default=512,
                        help="new tokens when a request names no max_tokens (default 512; "
                        "fewer where the prompt leaves less room in the context)")
    parser.add_argument("--api-key", default=os.environ.get("GUMIHO_API_KEY"),
                        help="a key requests to /v1/*, /tokenize and /detokenize must send "
                        "as 'Authorization: Bearer KEY' (default: $GUMIHO_API_KEY; none: "
                        "open)")
    parser.add_argument("--reuse-prefix", action="store_true",
                        help="reuse the cache's entries where a prompt begins with the last "
                        "sequence (a conversation's history): its prefill skips them; in "
                        "bf16 an answer can then differ from a fresh prompt's at a near tie")
    return parser


def make_server(gen, name: str, method: str, worker: Worker, host: str = "127.0.0.1",
                port: int = 0, max_tokens: int = 512, reuse_prefix: bool = False,
                api_key: str | None = None) -> GumihoHTTPServer:
    """An HTTP server over `gen` (a SpeculativeGenerator of `method`) whose generations
    run where `worker.run_forever` runs; not yet serving (port 0: any free port;
    `server.server_address` says which)."""
    return GumihoHTTPServer((host, port), Server(gen, name, max_tokens, method, worker,
                                                 reuse_prefix, api_key))


@cli_errors
def main(argv: list[str] | None = None) -> int:
    from gumiho.demo import exact_bf16_default
    from gumiho.generate import check_context_room, load_from_args

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="gumiho: %(message)s", stream=sys.stderr)
    check_context_room(args.target, args.max_tokens, flag="--max-tokens")
    exact_bf16_default(args)  # on a CPU with AMX, as `gumiho demo` chooses
    name = args.served_model_name or args.target
    try:  # the address first: a port in use fails at once, not after the load
        server = GumihoHTTPServer((args.host, args.port), None)
    except OSError as exc:
        raise GumihoError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") \
            from None
    gen = load_from_args(args)
    worker = Worker()
    server.gumiho = Server(gen, name, args.max_tokens, args.method, worker,
                           args.reuse_prefix, args.api_key)
    log.info("warming up (greedy and sampled; a sized tree is chosen once per temperature)")
    for temperature in (0.0, 1.0):  # so that no first request pays for it
        gen.generate("Hi", 8, temperature=temperature)
    host, port = server.server_address[:2]
    log.info("serving %r (%s) on http://%s:%d/v1 (Ctrl-C stops)", name, args.method, host,
             port)
    listener = threading.Thread(target=server.serve_forever, daemon=True)
    listener.start()
    try:
        worker.run_forever()  # here, on the main thread (Worker says why)
    except KeyboardInterrupt:
        log.info("stopped")
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
