"""Generate with a target and a drafter: the notebook API and `gumiho generate`.

    >>> from gumiho import SpeculativeGenerator
    >>> gen = SpeculativeGenerator.load(target="smollm2", method="ar")
    >>> out = gen.generate("Name three colours.", max_new_tokens=32)
    >>> out.text, out.tau, out.tokens_per_s
    >>> for piece in gen.stream("Tell me a joke."):
    ...     print(piece, end="", flush=True)
"""

from __future__ import annotations

import argparse
import json
import logging
import operator
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from gumiho.budget import choose_tree, temperature_key
from gumiho.checkpoint import check_drafter_files
from gumiho.config import (
    TreeConfig,
    check_engine_options,
    check_tree_options,
    preset_options,
)
from gumiho.drafter_api import Drafter
from gumiho.drafters import load_drafter
from gumiho.engine import (
    GenerateConfig,
    GenerationResult,
    check_prompt,
    check_token_ids,
    generate,
)
from gumiho.errors import (
    ArgumentParser,
    GumihoError,
    check_positive_int,
    cli_errors,
    nonnegative_int,
    positive_int,
)
from gumiho.flags import (
    add_answer_args,
    add_generator_args,
    add_sampling_args,
    answer_settings,
    sampling_settings,
    tree_options,
)
from gumiho.graphs import resolve_engine
from gumiho.methods import METHODS, method_spec
from gumiho.stops import HeldText, check_stops
from gumiho.target import (
    Target,
    choose_device_dtype,
    load_target,
    resolve_target_path,
)
from gumiho.text_pieces import TextPieces

log = logging.getLogger("gumiho")
Prompt = str | list[dict] | list[int]
ROLES = ("system", "user", "assistant")


def sized_tree(tree: TreeConfig, report: dict) -> TreeConfig:
    """`tree` at the shape `budget.choose_tree` chose (its report), logged."""
    sized = replace(tree, **report["tree"])
    temperature = report.get("temperature", 0.0)
    log.info("auto tree%s: %s tokens, depth %s; its cycle costs %.2f plain steps here "
             "(--draft-gate %.2f drafts only while that pays)",
             f" for T = {temperature:g}" if temperature else "", sized.total_tokens,
             sized.depth, report["break_even"], report["break_even"])
    return sized


def check_verify_width(verify_width: int | None, drafter: Drafter) -> None:
    if verify_width is not None and verify_width < drafter.max_nodes:
        raise GumihoError(f"--verify-width {verify_width} is narrower than this tree's "
                          f"{drafter.max_nodes} tokens (root included): give at least "
                          f"{drafter.max_nodes}, or leave it out")


@dataclass(frozen=True)
class Cycle:
    """One cycle of `stream(..., cycles=True)`: the tokens it emitted (accepted drafts, then
    the target's own next token), their text (what the stream shows now: empty while held
    back), and with `logprobs` their log-probabilities (and top_logprobs)."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @classmethod
    def of(cls, result: GenerationResult, new: list[int], text: str) -> Cycle:
        """The cycle that just added `new` to `result` (whose logprob lists grow as the
        engine runs)."""
        end = result.new_tokens
        span = slice(end - len(new), end)
        return cls(text, new, None if result.logprobs is None else result.logprobs[span],
                   None if result.top_logprobs is None else result.top_logprobs[span])


class SpeculativeGenerator:
    """A target and a drafter loaded once; `generate` and `stream` as often as you like."""

    def __init__(self, target: Target, drafter: Drafter, verify_width: int | None = None,
                 engine: str | None = None):
        self.target = target
        self.drafter = drafter
        self.verify_width = verify_width  # pad verify steps to one static shape
        self.engine = engine  # graphs.ENGINES; None: graphs on GPU, eager on CPU
        self.last_result: GenerationResult | None = None
        self._active: object | None = None  # the stream now driving the caches
        self.auto_report: dict | None = None
        # with total_tokens="auto": (method, draft, the unsized tree), and the drafter and
        # report chosen for each temperature asked for (`drafter_for`)
        self._auto: tuple[str, str, TreeConfig, frozenset[str]] | None = None
        self._sized: dict[float, tuple[Drafter, dict]] = {}

    @classmethod
    def load(cls, target: str | Target = "smollm2", method: str = "ar",
             draft: str | None = None,
             device: str | None = None, dtype: str | None = None,
             chat_template: str | None = None, verify_width: int | None = None,
             engine: str | None = None, attention: str | None = None,
             preset: str | None = None, temperature: float = 0.0, **tree_options):
        """tree_options: TreeConfig fields (total_tokens, top_k, mlp_topk, pruning, depth,
        serial_levels, fta, lookup, lookup_first, draft_gate, min_confidence,
        extend_confidence); unset ones
        take the preset's values, then the method's reference defaults. preset="demo": what
        `gumiho demo` runs, for speed on this device (`config.preset_options`); None or
        "reference": the method's reference tree. total_tokens="auto" times this device and the
        drafter and picks the fastest tree shape (budget.py) for decoding at `temperature`
        (greedy by default); its report (`auto_report`) holds the shape's break-even, a
        value for draft_gate (gate.py). A call at another temperature chooses again for
        that one, once (`drafter_for`). A loaded Target is shared as it is (several
        generators on one model): device, dtype, chat_template and attention then stay
        unset. attention: the target's attention implementation
        (load_target's `attn_implementation`; "sdpa_invariant" makes bf16 verifies on a CPU
        bit for bit sequential decoding's, attention.py)."""
        check_load_args(target, method, draft, tree_options)
        GenerateConfig(temperature=temperature)  # a number >= 0, as generate checks it
        user_options, asked_depth = tree_options, tree_options.get("depth")
        asked_tokens = tree_options.get("total_tokens")
        asked_tokens = asked_tokens if isinstance(asked_tokens, int) else None  # not "auto"
        place, kind = (target.device, target.dtype) if isinstance(target, Target) \
            else choose_device_dtype(device, dtype)  # what the load will choose
        tree_options = preset_options(preset, method, kind == torch.float32, tree_options)
        if isinstance(target, Target) and (device, dtype, chat_template, attention) != \
                (None,) * 4:
            raise TypeError("device, dtype, chat_template and attention belong to loading a "
                            "target; an already loaded Target keeps its own")
        if verify_width is not None:
            check_positive_int("verify_width", verify_width)
        auto = tree_options.get("total_tokens") == "auto"
        if auto:
            tree_options = {**tree_options, "total_tokens": None}
        tree = TreeConfig.for_method(method, **tree_options)  # bad sizes fail before loading
        draft = None if draft is None else str(draft)
        auto = auto and method_spec(method).drafter  # nothing to size without a drafter
        if auto and draft is None:
            raise GumihoError(f"--total-tokens auto needs --draft for --method {method}")
        # before the load: --engine graphs on a CPU, and the user's flags that only the
        # eager engine reads (the preset's are for eager alone)
        engine = resolve_engine(engine, place)
        check_engine_options(user_options, engine)
        loaded = target if isinstance(target, Target) else load_target(
            str(target), device=device, dtype=dtype, chat_template=chat_template,
            attn_implementation=attention)
        tree.check_vocab(loaded.lm_head.weight.shape[0])
        report, unsized = None, tree
        kept = frozenset(k for k in ("top_k", "pruning") if user_options.get(k) is not None)
        if auto:
            report = choose_tree(loaded, method, draft, tree, engine, temperature=temperature,
                                 kept=kept)
            tree = sized_tree(tree, report)
        drafter = load_drafter(method, loaded, draft, tree=tree, engine=engine)
        if auto and asked_depth is not None and tree.depth < asked_depth:
            asked_depth = None  # auto chose a shallower tree: the drafter may reach further
        note_reach(drafter, asked_depth, asked_tokens)
        check_verify_width(verify_width, drafter)
        gen = cls(loaded, drafter, verify_width, engine)
        gen.auto_report = report  # how `auto` chose the tree size, or None
        if auto:
            gen._auto = method, draft, unsized, kept
            gen._sized[temperature_key(temperature)] = drafter, report
        return gen

    def drafter_for(self, temperature: float) -> Drafter:
        """The drafter that decodes at `temperature`: `drafter`, except that with
        total_tokens="auto" a temperature other than the load's gets the tree shape chosen
        for it (budget.py: a sampled draft is accepted less often than a greedy one, so a
        smaller tree can pay more), chosen at its first call and kept."""
        return self._sized_for(temperature)[0]

    def auto_report_for(self, temperature: float) -> dict | None:
        """How `auto` chose the tree for `temperature` (`drafter_for`), or None."""
        return self._sized_for(temperature)[1]

    def _sized_for(self, temperature: float) -> tuple[Drafter, dict | None]:
        if self._auto is None:
            return self.drafter, self.auto_report
        key = temperature_key(temperature)
        if key not in self._sized:
            method, draft, tree, kept = self._auto
            report = choose_tree(self.target, method, draft, tree, self.engine,
                                 temperature=key, kept=kept)
            drafter = load_drafter(method, self.target, draft, tree=sized_tree(tree, report),
                                   engine=self.engine)
            check_verify_width(self.verify_width, drafter)
            self._sized[key] = drafter, report
        return self._sized[key]

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A string is one user turn, a list of dicts a chat, a list of ints raw token ids
        (a tuple or a 1-D integer tensor also works)."""
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
                raise TypeError("a tensor prompt must be 1-D integer token ids, got shape "
                                f"{list(prompt.shape)} of {prompt.dtype}")
            prompt = prompt.tolist()
        if isinstance(prompt, tuple):
            prompt = list(prompt)
        if isinstance(prompt, str):
            return self.target.chat_ids(prompt)
        if not isinstance(prompt, list):
            raise TypeError("prompt must be a string, a list of {'role', 'content'} messages "
                            f"or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise GumihoError("empty prompt: give some text to answer")
        if all(isinstance(m, dict) for m in prompt):
            check_messages(prompt)
            return self.target.chat_ids(prompt)
        if all(hasattr(t, "__index__") and not isinstance(t, bool) for t in prompt):
            return [operator.index(t) for t in prompt]  # ints, numpy ints, 0-d int tensors
        raise TypeError("prompt must be a string, a list of {'role', 'content'} messages or "
                        "a list of token ids (ints), got a list holding "
                        f"{', '.join(sorted({type(x).__name__ for x in prompt}))}")

    def _steps(self, prompt: Prompt, result: GenerationResult | None = None, **settings):
        """The engine's generator for `prompt` with `settings` (GenerateConfig's fields)."""
        config = GenerateConfig(**settings, verify_width=self.verify_width,
                                engine=self.engine)
        ids = self.prompt_ids(prompt)
        check_prompt(self.target, ids, config.max_new_tokens)  # now, not at the first piece
        check_token_ids(self.target, config)
        return generate(self.target, self.drafter_for(config.temperature), ids, config,
                        result)

    def generate(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0,
                 seed: int = 0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, stop: str | Sequence[str] = (),
                 logprobs: bool = False, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, min_tokens: int = 0,
                 logit_bias: dict[int, float] | None = None,
                 top_logprobs: int = 0, no_repeat_ngram_size: int = 0,
                 reuse_prefix: bool = False) -> GenerationResult:
        """The whole answer: text, token ids and statistics (tau, tokens/s, ...).

        temperature 0 decodes greedily; above it the target samples, from its `top_k`
        likeliest tokens (0: all), then its `top_p` nucleus (1.0: all), then the tokens at
        least `min_p` times as likely as the likeliest (0.0: all), where those are set, as
        transformers' `generate(do_sample=True, top_k=..., top_p=..., min_p=...)` does
        (sampling.cut). (The tree's own top_k, drafts per level, is `load`'s.)
        `repetition_penalty` (1.0: none; transformers' and vLLM's, e.g. 1.1-1.3) divides
        the logits of the tokens already in the sequence, prompt included, at any
        temperature (penalty.py): the output is plain decoding's with the same penalty.
        `presence_penalty` and `frequency_penalty` (0.0: none; OpenAI's and vLLM's, in
        [-2, 2]) subtract from the logit of each token in the answer (not the prompt) the
        first, plus the second times its count there, after the repetition penalty.
        `stop` (a string or several) ends the answer after the token that completes the
        first of them in its text (`stopped_by == "stop_string"`); the text ends before
        it, the token ids keep the tokens that spelled it (stops.py).
        `logprobs` fills `logprobs`: each token's log-probability under the target's own
        distribution (the log-softmax of its logits, before penalties, temperature and
        cut; vLLM's default "raw" logprobs), from the verify that accepted it;
        `top_logprobs` (0-20; OpenAI's) fills `top_logprobs` with the k likeliest (token
        id, log-probability) pairs of each position too, and turns `logprobs` on.
        `stop_token_ids` end the answer too, as the target's stop tokens (its eos and chat
        end markers) do, the token kept (`stopped_by == "stop_token"`); `ignore_eos` lets
        the answer run past the target's own stop tokens (to `max_new_tokens`, a stop
        string or `stop_token_ids`), and `min_tokens` keeps every token that would end it
        out of reach until the answer holds that many (vLLM's `min_tokens`, transformers'
        `min_new_tokens`; penalty.py): both are plain decoding's answers under the same
        settings. `logit_bias` ({token id: bias in [-100, 100]}; OpenAI's and vLLM's)
        adds to those tokens' logits at every position, before the penalties.
        `no_repeat_ngram_size` n (transformers'; 0: off) lets no n-gram of the sequence,
        prompt included, come twice. `reuse_prefix` keeps the target's cache entries for
        the start of the prompt that repeats the last sequence's tokens (a conversation's
        history) and prefills only the rest (`reused_tokens` says how many it spared), and
        leaves this sequence's for the next; the answer is then plain decoding's with the
        same reuse, which can differ from a fresh prompt's at a near tie (prefix.py).

        The text is decoded once, at the end: a decode after every cycle, as `stream` needs
        (of a short window), would cost plain decoding (a cycle per token) a larger share
        than a drafter's fewer cycles on a GPU, where a small model's step takes
        milliseconds."""
        for _ in self._run(prompt, None, max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=seed, top_k=top_k, top_p=top_p,
                           min_p=min_p, repetition_penalty=repetition_penalty,
                           presence_penalty=presence_penalty,
                           frequency_penalty=frequency_penalty, stop=stop,
                           logprobs=logprobs, stop_token_ids=stop_token_ids,
                           ignore_eos=ignore_eos, min_tokens=min_tokens,
                           logit_bias=logit_bias, top_logprobs=top_logprobs,
                           no_repeat_ngram_size=no_repeat_ngram_size,
                           reuse_prefix=reuse_prefix):
            pass
        return self.last_result

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0,
               seed: int = 0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, stop: str | Sequence[str] = (),
               logprobs: bool = False, stop_token_ids: Sequence[int] = (),
               ignore_eos: bool = False, min_tokens: int = 0,
               logit_bias: dict[int, float] | None = None,
               top_logprobs: int = 0, no_repeat_ngram_size: int = 0,
               reuse_prefix: bool = False, cycles: bool = False) -> Iterator[str] | Iterator[Cycle]:
        """Text pieces as the cycles emit them (the other arguments: `generate`'s); the
        statistics land in `last_result`. With `stop`, text that may be the start of a
        stop string waits for the next cycle, so no piece shows any part of one.

        With `cycles`, a `Cycle` for every cycle instead: the tokens it emitted (the drafts
        the target accepted and its own next token), their text piece (empty while it is
        held back, e.g. inside a character) and, with `logprobs`, their log-probabilities;
        then, if held-back text remains, one more with that text and no tokens.

        Stopping early (`break`, closing the iterator, or Ctrl-C) leaves in `last_result`
        the part generated so far, with `stopped_by == "closed"`; an error leaves None. One
        generation at a time: a newer `generate`/`stream` call ends an older stream.
        """
        return self._run(prompt, "cycles" if cycles else "text", max_new_tokens=max_new_tokens,
                         temperature=temperature, seed=seed, top_k=top_k, top_p=top_p,
                         min_p=min_p, repetition_penalty=repetition_penalty,
                         presence_penalty=presence_penalty,
                         frequency_penalty=frequency_penalty, stop=stop,
                         logprobs=logprobs, stop_token_ids=stop_token_ids,
                         ignore_eos=ignore_eos, min_tokens=min_tokens,
                         logit_bias=logit_bias, top_logprobs=top_logprobs,
                         no_repeat_ngram_size=no_repeat_ngram_size,
                         reuse_prefix=reuse_prefix)

    def _run(self, prompt: Prompt, pieces: str | None, **settings) -> Iterator:
        """`stream`'s loop, yielding text pieces (`pieces` "text") or Cycles ("cycles");
        with None it yields nothing and decodes nothing (the engine decodes the whole answer
        once, into `result.text`). The call itself, not
        its first piece, supersedes an older stream and checks the prompt and `settings`
        (GenerateConfig's fields)."""
        self.last_result = None
        # The caches belong to the target, which other generators may share: one owner.
        owner = self._active = self.target.stream_owner = object()
        result = GenerationResult()
        # read once: a one-shot iterable (a generator) would reach the engine and leave
        # the stream's hold-back nothing (it showed the stop string the answer ends before)
        stops = settings["stop"] = check_stops(settings.get("stop"))
        steps = self._steps(prompt, result, **settings)
        return self._pieces(owner, steps, result, pieces, stops)

    def _pieces(self, owner: object, steps: Iterator[list[int]], result: GenerationResult,
                pieces: str | None, stops: tuple[str, ...] = ()) -> Iterator:
        text = TextPieces(self.target.decode) if pieces else None
        held = HeldText(stops) if pieces and stops else None
        cycles = pieces == "cycles"
        try:
            while True:
                if self.target.stream_owner is not owner:
                    raise GumihoError("this stream was superseded by a newer generate/stream "
                                      "call on the same target (this generator or another "
                                      "sharing it): finish one before the next")
                try:
                    new = next(steps)
                except StopIteration:
                    self.last_result = result
                    if text is not None:
                        rest = text.finish(result.text)
                        if held is not None:
                            rest = held.finish(result.text, rest)
                        if rest:
                            yield Cycle(rest, []) if cycles else rest
                    return
                if text is None:
                    continue
                piece = text.push(new)
                if piece and held is not None:
                    piece = held.push(piece)
                if cycles:
                    yield Cycle.of(result, new, piece)
                elif piece:
                    yield piece
        except (GeneratorExit, KeyboardInterrupt):  # stopped early: describe what it got
            steps.close()
            if self._active is owner:
                self.last_result = result
            raise


def note_reach(drafter: Drafter, asked_depth: int | None, asked_tokens: int | None) -> None:
    """A --depth past the drafter's levels, or a --total-tokens past the candidates its
    tree settings give, runs at what the drafter reaches, and says so."""
    reach = getattr(drafter, "draft_depth", None)
    if asked_depth is not None and reach is not None and reach < asked_depth:
        log.warning("depth %d is past what this drafter drafts: its trees stop at depth %d "
                    "(the levels its network has)", asked_depth, reach)
    if asked_tokens is not None and drafter.max_nodes < asked_tokens:
        log.warning("total tokens %d is more than these tree settings draft: its trees stop "
                    "at %d tokens (raise --top-k, --mlp-topk or --pruning for more "
                    "candidates)", asked_tokens, drafter.max_nodes)


def check_load_args(target, method, draft, tree_options: dict) -> None:
    """API arguments of `SpeculativeGenerator.load`, checked before anything loads."""
    for name, value in (("target", target), ("draft", draft)):
        if value is not None and not isinstance(value, str | os.PathLike) and not (
                name == "target" and isinstance(value, Target)):
            raise TypeError(f"{name} must be a path or a name (str), got {value!r}")
    if not isinstance(method, str):
        raise TypeError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    check_tree_options(method, tree_options)
    if draft is not None and str(draft) != "random":  # its files, method and completeness
        check_drafter_files(draft, method if method_spec(method).drafter else None)


def check_messages(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise GumihoError(f"message {i} must be {{'role': one of {', '.join(ROLES)}, "
                              f"'content': str}}, got {m!r}"[:300])


def check_context_room(target: str, max_new_tokens: int,
                       flag: str = "--max-new-tokens") -> None:
    """Before a slow load or tree-size calibration: max_new_tokens alone must fit the
    target's context (prompt + max_new_tokens is checked exactly before generating); the
    error names `flag`, the command's own name for it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_target_path(target)).get_text_config()
    except GumihoError:
        raise
    except Exception:  # noqa: BLE001 - load_target reports a broken config in one line
        return
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and max_new_tokens >= limit:
        raise GumihoError(f"{flag} {max_new_tokens} leaves no room for a prompt in "
                          f"{target}'s context of {limit} tokens: ask for fewer")


def load_from_args(args: argparse.Namespace, temperature: float = 0.0
                   ) -> SpeculativeGenerator:
    """The generator `add_generator_args`' flags describe (`temperature`: the one an
    auto-sized tree is sized for first)."""
    return SpeculativeGenerator.load(args.target, args.method, args.draft,
                                     device=args.device, dtype=args.dtype,
                                     chat_template=args.chat_template,
                                     verify_width=args.verify_width, engine=args.engine,
                                     attention=args.attention, preset=args.preset,
                                     temperature=temperature, **tree_options(args))


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="gumiho generate", description=__doc__.split("\n")[0])
    add_generator_args(parser)
    parser.add_argument("--prompt", required=True, help="one user turn")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    add_sampling_args(parser)
    add_answer_args(parser)
    parser.add_argument("--logprobs", action="store_true",
                        help="with --json: each token's log-probability under the target")
    parser.add_argument("--top-logprobs", type=nonnegative_int, default=0, metavar="K",
                        help="with --json: also the K likeliest tokens' log-probabilities "
                        "at each position (0-20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="gumiho: %(message)s", stream=sys.stderr)
    if not args.prompt.strip():
        raise GumihoError("empty prompt: give some text to answer")
    check_context_room(args.target, args.max_new_tokens)
    gen = load_from_args(args, args.temperature)
    pieces = gen.stream(args.prompt, args.max_new_tokens, **sampling_settings(args),
                        **answer_settings(args), logprobs=args.logprobs,
                        top_logprobs=args.top_logprobs)
    try:
        for piece in pieces:
            if not args.json:
                print(piece, end="", flush=True)
    except KeyboardInterrupt:
        if not args.json:
            print(flush=True)  # the streamed line ends before the one that says so
        raise
    result = gen.last_result
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"\n\n[{args.method}] {result.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
