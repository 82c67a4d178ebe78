"""The speculative loop: draft -> verify -> accept -> commit, shared by every method.

Plain decoding is the same loop with `PlainDrafter` (a one-node tree), so every speedup we
report compares drafting, not cache or timing code.

Counting (the same for every method): the prefill forward emits the first token and counts
as a cycle with accept length 1; each verify cycle emits its accepted draft tokens plus the
bonus token. `new_tokens == sum(accept_lengths)` after cutting at a stop token or
`max_new_tokens`, and tau = new_tokens / cycles (1.0 for plain decoding). The official
scripts' figure, new_tokens / (cycles - 1), is `tau_official`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gumiho import rowgemm
from gumiho.drafter_api import Drafter
from gumiho.errors import GumihoError, check_positive_int
from gumiho.fta import official_for_sampling
from gumiho.graphs import StaticStep, resolve_engine
from gumiho.kv_cache import KVCache, reuse_or_allocate
from gumiho.penalty import Penalties, penalties
from gumiho.prefix import Prefix, Prefixes, cache_reusing
from gumiho.profiling import PhaseTimer
from gumiho.sampling import (
    Acceptance,
    accept_picks,
    match_on_host,
    match_picks,
    matched,
    sample_tokens,
)
from gumiho.stops import StopStrings, check_stops
from gumiho.target import Target
from gumiho.tree import DraftTree

MIN_TEMPERATURE = 1e-4
MAX_TOP_LOGPROBS = 20
PREFIXES_KEPT = 4  # sequences a CPU runner keeps for prefix reuse (prefix.py)
HOST_MATCH = True  # greedy acceptance in Python on the eager CPU loop (False: match_picks)


@dataclass(frozen=True)
class GenerateConfig:
    """One generation's settings (the tree is the drafter's): checked when made."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # sampling only: the k likeliest tokens (0: all)
    top_p: float = 1.0  # sampling only: the likeliest tokens holding this mass (1.0: all)
    min_p: float = 0.0  # sampling only: tokens at least this share of the likeliest's (0: all)
    repetition_penalty: float = 1.0  # the sequence's tokens' logits / it (penalty.py; 1: off)
    presence_penalty: float = 0.0  # subtracted from the answer's tokens' logits (penalty.py)
    frequency_penalty: float = 0.0  # times a token's count in the answer, subtracted too
    no_repeat_ngram_size: int = 0  # no n-gram of the sequence twice (transformers'; 0: off)
    stop: tuple[str, ...] = ()  # stop strings: the answer ends at the first (stops.py)
    stop_token_ids: tuple[int, ...] = ()  # ids that end the answer too (its last token)
    ignore_eos: bool = False  # the target's own stop tokens do not end the answer
    min_tokens: int = 0  # no stop token before the answer holds this many (penalty.py)
    # (token id, bias) pairs added to those logits (a dict is taken too; penalty.py)
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False  # each emitted token's log-probability under the target's logits
    top_logprobs: int = 0  # and the k likeliest tokens' at each position (0-20; sets logprobs)
    seed: int = 0
    # keep the cache's entries for the prompt's start where it begins with the last
    # sequence's tokens, and leave this one's for the next (prefix.py)
    reuse_prefix: bool = False
    profile: bool = False  # time each phase (adds a device sync around every phase)
    verify_width: int | None = None  # pad every verify step to this many tokens (static shape)
    engine: str | None = None  # graphs.ENGINES; None: graphs on a GPU, eager on a CPU

    def __post_init__(self):
        check_positive_int("max_new_tokens", self.max_new_tokens)
        check_positive_int("seed", self.seed, allow_zero=True)
        if self.seed >= 2**63:
            raise GumihoError(f"seed must be below 2**63, got {self.seed}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise TypeError(f"temperature must be a number, got {t!r} ({type(t).__name__})")
        if not math.isfinite(t) or t < 0:
            raise GumihoError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if 0 < t < MIN_TEMPERATURE:  # logits / T would overflow to inf
            raise GumihoError(f"temperature {t} is too small to sample with: use 0 (greedy) "
                              f"or at least {MIN_TEMPERATURE}")
        check_positive_int("top_k", self.top_k, allow_zero=True)
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float):
            raise TypeError(f"top_p must be a number, got {p!r} ({type(p).__name__})")
        if not 0 < p <= 1:  # (NaN fails too)
            raise GumihoError(f"top_p must be in (0, 1] (1 = no nucleus cut), got {p}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, int | float):
            raise TypeError(f"min_p must be a number, got {m!r} ({type(m).__name__})")
        if not 0 <= m <= 1:
            raise GumihoError(f"min_p must be in [0, 1] (0 = no min-p cut), got {m}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float):
            raise TypeError(f"repetition_penalty must be a number, got {r!r} "
                            f"({type(r).__name__})")
        if not (math.isfinite(r) and r > 0):
            raise GumihoError(f"repetition_penalty must be a finite number > 0 (1 = none, "
                              f"above 1 discourages repeats), got {r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
            if not -2 <= v <= 2:  # (NaN fails too) OpenAI's and vLLM's range
                raise GumihoError(f"{name} must be in [-2, 2] (0 = none), got {v}")
        object.__setattr__(self, "stop", check_stops(self.stop))  # a string, or a list
        ids = self.stop_token_ids
        if isinstance(ids, int | str) or not isinstance(ids, Iterable):
            raise TypeError(f"stop_token_ids must be a list of ints, got {ids!r}")
        ids = tuple(ids)
        for i in ids:
            check_positive_int("a stop token id", i, allow_zero=True)
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("ignore_eos", "reuse_prefix"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_positive_int("min_tokens", self.min_tokens, allow_zero=True)
        check_positive_int("no_repeat_ngram_size", self.no_repeat_ngram_size, allow_zero=True)
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        check_positive_int("top_logprobs", self.top_logprobs, allow_zero=True)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise GumihoError(f"top_logprobs must be at most {MAX_TOP_LOGPROBS} (OpenAI's "
                              f"limit), got {self.top_logprobs}")
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)
        if self.min_tokens > self.max_new_tokens:
            raise GumihoError(f"min_tokens ({self.min_tokens}) must not exceed "
                              f"max_new_tokens ({self.max_new_tokens})")
        if self.verify_width is not None:
            check_positive_int("verify_width", self.verify_width)


def check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias ({token id: bias} or (id, bias) pairs) as sorted pairs, each bias a
    number in [-100, 100] (OpenAI's range: -100 bans a token, 100 all but forces it)."""
    if bias is None:
        return ()
    try:
        pairs = tuple(bias.items() if isinstance(bias, dict) else bias)
        pairs = tuple((i, b) for i, b in pairs)
    except (TypeError, ValueError):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {bias!r}") \
            from None
    for i, b in pairs:
        check_positive_int("a logit_bias token id", i, allow_zero=True)
        if isinstance(b, bool) or not isinstance(b, int | float):
            raise TypeError(f"logit_bias of token {i} must be a number, got {b!r}")
        if not -100 <= b <= 100:  # (NaN fails too)
            raise GumihoError(f"logit_bias of token {i} must be in [-100, 100], got {b}")
    if len({i for i, _ in pairs}) < len(pairs):
        raise GumihoError("logit_bias names a token id twice")
    return tuple(sorted((i, float(b)) for i, b in pairs))


@dataclass
class GenerationResult:
    """One answer: its tokens and text, and how the loop made them (tau, tokens/s, each
    cycle's accept length and time; README, How tokens and tau are counted)."""

    token_ids: list[int] = field(default_factory=list)  # new tokens only
    accept_lengths: list[int] = field(default_factory=list)  # per cycle, prefill first
    cycle_s: list[float] = field(default_factory=list)  # each cycle's own time
    wall_s: float = 0.0
    text: str = ""  # the tokens' text, ending before a stop string (GenerateConfig.stop)
    # "stop_token", "stop_string", "max_new_tokens", or "closed" (a stream stopped early)
    stopped_by: str = ""
    phase_s: dict[str, float] = field(default_factory=dict)  # with GenerateConfig.profile
    # with GenerateConfig.logprobs: each token's log-probability under the target's own
    # distribution (its logits' log-softmax, before penalties, temperature and cut)
    logprobs: list[float] | None = None
    # with GenerateConfig.top_logprobs: at each position the k likeliest (token id,
    # log-probability) pairs under the same distribution, likeliest first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    reused_tokens: int = 0  # prompt tokens whose prefill was reused (reuse_prefix)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cycles(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return self.new_tokens / max(self.cycles, 1)

    @property
    def tau_official(self) -> float:
        return self.new_tokens / max(self.cycles - 1, 1)

    def summary(self) -> str:
        """tokens, cycles, tau and tokens/s in a line (`gumiho generate`, `gumiho chat`)."""
        return (f"{self.new_tokens} tokens in {self.cycles} cycles, tau {self.tau:.2f}, "
                f"{self.tokens_per_s:.1f} tokens/s")

    def accepted_by_depth(self) -> list[int]:
        """How many verify cycles (the prefill's left out) accepted a draft at depth k + 1,
        for each k: the acceptance at depth k + 1 is that over `cycles - 1`."""
        counts: list[int] = []
        for emitted in self.accept_lengths[1:]:
            drafts = max(emitted - 1, 0)  # all but the target's own token (a stop may cut it)
            counts += [0] * (drafts - len(counts))
            for k in range(drafts):
                counts[k] += 1
        return counts

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "new_tokens": self.new_tokens,
                "cycles": self.cycles, "tau": self.tau, "tau_official": self.tau_official,
                "accept_lengths": self.accept_lengths, "wall_s": self.wall_s,
                "tokens_per_s": self.tokens_per_s, "stopped_by": self.stopped_by,
                **({"reused_tokens": self.reused_tokens} if self.reused_tokens else {}),
                **({"phase_s": self.phase_s} if self.phase_s else {}),
                **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
                **({"top_logprobs": [[list(pair) for pair in row] for row in self.top_logprobs]}
                   if self.top_logprobs is not None else {})}


def prefill(target: Target, cache: KVCache, input_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Run the prompt (1, P) through the target after what the cache holds (nothing, or a
    reused prefix: prefix.py); commit it to the cache. Returns features (P, H) and the last
    token's logits (1, V). The ids may come from anywhere (a tokenizer's are on the CPU):
    they move to the target's device here."""
    input_ids = input_ids.to(target.device)
    p, start = input_ids.shape[1], cache.length
    cache.begin_step(p)
    causal = torch.ones(p, p, dtype=torch.bool, device=input_ids.device).tril()
    positions = torch.arange(start, start + p, device=input_ids.device)[None]
    features, logits = target.forward(input_ids, positions, cache.hf,
                                      cache.attention_mask(causal, positions[0]),
                                      last_logits=True)
    cache.commit(p)
    return features, logits


def verify_tree(target: Target, cache: KVCache, tree: DraftTree, width: int | None = None,
                step: StaticStep | None = None) -> tuple[Tensor, Tensor]:
    """One target forward over all tree nodes: features (K, H) and logits (K, V).

    Node i sits at position length + depth(i) and sees the committed context, itself and
    its ancestors; the step writes its K cache entries at slots length..length+K-1.
    With `width`, the input is padded to that many tokens so every step has one shape:
    padding rows see only the context and themselves, and no real row sees them.
    `step`: a TargetRunner's (possibly recorded) step for that width (`step_for`); None
    runs the target eagerly.
    """
    cache.reserve(max(width or 0, tree.size))
    start = cache.write_position()
    if step is None:
        return tree_forward(target, cache, width, tree.tokens, tree.depths, tree.verify_mask,
                            start)
    return step(tree.tokens, tree.depths, tree.verify_mask, start)


def tree_forward(target: Target, cache: KVCache, width: int | None, tokens: Tensor,
                 depths: Tensor, mask: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    """`verify_tree`'s forward, tensors only (a recorded step): the committed length is
    `start` (1,) on the device, and padding, positions and masks are made here."""
    k = tokens.shape[0]
    if width is not None and width > k:
        pad = width - k
        tokens = torch.cat([tokens, tokens[:1].expand(pad)])
        depths = torch.cat([depths, depths.new_zeros(pad)])
        mask = torch.eye(width, dtype=torch.bool, device=mask.device) | \
            torch.nn.functional.pad(mask, (0, pad, 0, pad))
    positions = (start + depths)[None]
    masks = cache.mask_at(mask, start, positions[0])  # one per kind of layer (kv_cache.py)
    cache.seek(start)
    features, logits = target.forward(tokens[None], positions, cache.hf, masks)
    return features[:k], logits[:k]


def verify_greedy(target: Target, cache: KVCache, tree: DraftTree, width: int | None,
                  step: StaticStep) -> tuple[Tensor, Acceptance]:
    """`verify_tree` and greedy acceptance in one (recorded) step, `step_for(width,
    greedy=True)`: the features (K, H) and the Acceptance (the cycle's one host sync).
    The logits stay inside the step. Trees without the official FTA's splice."""
    cache.reserve(max(width or 0, tree.size))
    dead = () if tree.dead is None else (tree.dead,)
    features, packed, order, bonus = step(tree.tokens, tree.parents, tree.depths, tree.mask,
                                          cache.write_position(), *dead)
    return features, matched(tree.size, packed, order, bonus)


def greedy_tree_forward(target: Target, cache: KVCache, width: int | None, tokens: Tensor,
                        parents: Tensor, depths: Tensor, mask: Tensor, start: Tensor,
                        *dead: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`tree_forward`, then `match_picks` on the target's argmax at every node (tensors
    only): features and match_picks' outputs. dead: the tree's, if it has one."""
    features, logits = tree_forward(target, cache, width, tokens, depths, mask, start)
    dead_nodes = dead[0] if dead else torch.zeros_like(tokens, dtype=torch.bool)
    return features, *match_picks(tokens, parents, depths, mask, dead_nodes,
                                  rowgemm.argmax(logits))


class TargetRunner:
    """The target's side of the loop on one engine: its KV cache and its step.

    Eager runs size the cache to each sequence. Captured engines keep one cache (rounded
    up to 512 slots) across generations, because their recorded steps are bound to its
    memory; a sequence that needs more slots replaces it and the steps are recaptured.
    """

    def __init__(self, target: Target, engine: str):
        self.target, self.engine = target, engine
        if engine == "compile":  # inductor cannot lower the packed products (linear.py)
            target.unpack()
        self.cache: KVCache | None = None
        # what the caches hold for later sequences (prefix.py): on a CPU a few, each in its
        # own cache; a GPU's memory keeps one
        self.prefixes = Prefixes(PREFIXES_KEPT if target.device.type == "cpu" else 1)
        # the target's step by padded width, and whether it accepts greedily too
        self.steps: dict[tuple[int | None, bool], StaticStep] = {}
        # acceptance's device part (tensors only), recorded per tree size like any step
        self.accept_step = StaticStep(match_picks, engine)

    def cache_for(self, capacity: int) -> KVCache:
        """The cache for a sequence of `capacity` slots (reset: nothing reused)."""
        if self.engine != "eager":  # one cache, reset in place: what it held goes
            self.prefixes.clear()
        model = self.target.model
        cache, new = reuse_or_allocate(self.cache, capacity, self.engine != "eager",
                                       lambda n, trim: KVCache.for_model(model, n, trim))
        if new:  # recorded steps are bound to a cache
            self.cache, self.steps = cache, {}
        return cache

    def step_for(self, width: int | None, greedy: bool = False) -> StaticStep:
        """The target's step over trees padded to `width` tokens (None: unpadded) on the
        current cache (`cache_for`), recorded per tree size by captured engines: the
        forward (`tree_forward`), or with `greedy` the forward and greedy acceptance
        (`greedy_tree_forward`)."""
        if (width, greedy) not in self.steps:
            cache, target = self.cache, self.target
            fn = greedy_tree_forward if greedy else tree_forward
            # A greedy cycle reads its outputs before the next verify (the host list, the
            # accepted nodes' features and cache entries): no copies (graphs.StaticStep)
            self.steps[width, greedy] = StaticStep(
                lambda *inputs: fn(target, cache, width, *inputs), self.engine,
                fresh=0 if greedy else None)
        return self.steps[width, greedy]


def target_runner(target: Target, engine: str) -> TargetRunner:
    """The target's runner for `engine`, made once per target and engine (kept in
    `target.runners`)."""
    if engine not in target.runners:
        target.runners[engine] = TargetRunner(target, engine)
    return target.runners[engine]


def commit_accepted(cache: KVCache, drafter: Drafter, tree: DraftTree, features: Tensor,
                    result: Acceptance) -> None:
    """Keep the accepted path in the cache and tell the drafter (device ops only; the
    emitted tokens are already on the host). A path of nodes 0..n-1 (plain decoding, a
    chain) already lies in place: no copy."""
    nodes = result.nodes
    if result.contiguous:
        cache.commit(nodes.shape[0])
    else:
        cache.compact(nodes)
    drafter.observe(features[nodes], torch.cat([tree.tokens[nodes[1:]], result.bonus.view(1)]),
                    result.tokens)


class TokenLogprobs:
    """The emitted tokens' log-probabilities (GenerateConfig.logprobs), and with `top` the
    `top` likeliest tokens' at each position, gathered cycle by cycle on the host."""

    def __init__(self, top: int = 0):
        self.top = top
        self.values: list[float] = []
        self.tops: list[list[tuple[int, float]]] | None = [] if top else None

    def add(self, logits: Tensor, tokens: Tensor) -> None:
        """log p(tokens[i]) under the softmax of logits[i] (N, V), in float32."""
        rows = torch.log_softmax(logits.float(), -1)
        self.values += rows.gather(1, tokens.view(-1, 1).to(rows.device)).view(-1).tolist()
        if self.top:
            best = rows.topk(self.top, -1)
            self.tops += [list(zip(ids, values, strict=True)) for ids, values in
                          zip(best.indices.tolist(), best.values.tolist(), strict=True)]


def share_penalty(drafter: Drafter, penalty: Penalties | None) -> None:
    """Hand a generation's penalties (None: none) to the drafters that draft with
    it (a `penalty` attribute: the serial drafters and Medusa's), through any wrappers."""
    while drafter is not None:
        if hasattr(drafter, "penalty"):
            drafter.penalty = penalty
        drafter = getattr(drafter, "inner", None)


def context_length(target: Target) -> int | None:
    """The most positions the target was trained for (None if its config does not say)."""
    config = target.config.get_text_config()
    return getattr(config, "max_position_embeddings", None)


def check_in_vocabulary(target: Target, what: str, ids) -> None:
    """Refuse the first of `ids` outside the target's vocabulary, naming it as `what`."""
    vocab = target.embed_tokens.weight.shape[0]
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise GumihoError(f"{what} {bad} is outside the vocabulary of {target.name} "
                          f"(0..{vocab - 1})")


def check_token_ids(target: Target, config: GenerateConfig) -> None:
    """Refuse stop token ids and logit_bias ids outside the target's vocabulary."""
    check_in_vocabulary(target, "stop token id", config.stop_token_ids)
    check_in_vocabulary(target, "logit_bias token id", [i for i, _ in config.logit_bias])


def answer_stops(target: Target, config: GenerateConfig) -> frozenset[int]:
    """The token ids that end an answer (emitted, then it stops): the target's stop tokens
    (its eos and chat end markers; none with `ignore_eos`) and `config.stop_token_ids`."""
    own = frozenset() if config.ignore_eos else frozenset(target.stop_token_ids)
    return own | frozenset(config.stop_token_ids)


def min_tokens_stops(target: Target, config: GenerateConfig) -> frozenset[int]:
    """The tokens `min_tokens` keeps out of an answer shorter than it: the target's stop
    tokens and `stop_token_ids`, under `ignore_eos` too (as vLLM's min_tokens: a
    fixed-length answer, ignore_eos with min_tokens = max_tokens, holds no end marker)."""
    return frozenset(target.stop_token_ids) | frozenset(config.stop_token_ids)


def check_prompt(target: Target, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Refuse, before any forward, what would fail deep inside torch or silently run past
    the target's context: empty prompts, token ids outside the vocabulary, and prompt +
    max_new_tokens beyond the context length."""
    if not prompt_ids:
        raise GumihoError("empty prompt: give some text to answer")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
        bad = next(t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool))
        raise TypeError(f"prompt token ids must be ints, got {bad!r} ({type(bad).__name__})")
    check_in_vocabulary(target, "prompt token id", prompt_ids)
    limit = context_length(target)
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        if len(prompt_ids) >= limit:
            raise GumihoError(f"the prompt is {len(prompt_ids)} tokens, but {target.name}'s "
                              f"context is {limit} tokens: shorten the prompt")
        raise GumihoError(f"the prompt ({len(prompt_ids)} tokens) + max new tokens "
                          f"({max_new_tokens}) exceeds {target.name}'s context of {limit} "
                          f"tokens: ask for at most {limit - len(prompt_ids)} new tokens")


def speculative_cycles(target: Target, drafter: Drafter, prompt_ids: list[int],
                       config: GenerateConfig, timer: PhaseTimer | None = None,
                       on_cycle: Callable[[DraftTree, list[int]], None] | None = None,
                       logprobs: TokenLogprobs | None = None,
                       answer: GenerationResult | None = None) -> Iterator[list[int]]:
    """Yield the tokens each cycle emits (host ints), the prefill's single token first.
    Unbounded: the caller stops it (see `generate`). on_cycle(tree, emitted): called after
    each verify cycle (calibration and analysis hooks). `logprobs`, with config.logprobs,
    gets each emitted token's log-probability (`TokenLogprobs`) before it is yielded;
    `answer`, if given, the prompt tokens a reused prefix spared (`reused_tokens`)."""
    check_prompt(target, prompt_ids, config.max_new_tokens)
    check_token_ids(target, config)
    timer = timer or PhaseTimer(target.device, enabled=False)
    generator = torch.Generator(device=target.device).manual_seed(config.seed)
    input_ids = torch.tensor([prompt_ids], device=target.device)
    runner = target_runner(target, resolve_engine(config.engine, target.device))
    # Captured engines pad every verify to the drafter's largest tree: one shape, one graph.
    width = config.verify_width or (drafter.max_nodes if runner.engine != "eager" else None)
    capacity = (len(prompt_ids) + config.max_new_tokens + 1
                + max(drafter.max_nodes, width or 0))
    if config.reuse_prefix:
        cache, reused, kept = cache_reusing(runner, prompt_ids, capacity)
    else:
        cache, reused, kept = runner.cache_for(capacity), 0, None
    if answer is not None:
        answer.reused_tokens = reused
    if timer.enabled and hasattr(drafter, "timer"):
        drafter.timer = timer  # the drafter's own phases (serial steps, MLP heads)
    cut = config.top_k, config.top_p, config.min_p
    with timer("prefill"):
        features, logits = prefill(target, cache, input_ids[:, reused:])
        if kept is not None:  # the reused entries' features: the drafter reads them all
            features = torch.cat([kept, features])
        raw = logits
        penalty = penalties(config.repetition_penalty, config.presence_penalty,
                            config.frequency_penalty, logits.shape[-1], input_ids[0],
                            config.min_tokens, min_tokens_stops(target, config),
                            dict(config.logit_bias),
                            config.no_repeat_ngram_size)
        if penalty is not None:
            logits = penalty.last(logits)
        root = sample_tokens(logits[-1], config.temperature, generator, *cut)
        share_penalty(drafter, penalty)
        drafter.begin(target, capacity)
        if penalty is not None:
            penalty.add(root.view(1))
        first = int(root)  # the prefill's token, on the host
        if config.logprobs:
            logprobs.add(raw[-1:], root.view(1))
        drafter.observe(features, torch.cat([input_ids[0, 1:], root.view(1)]),
                        prompt_ids[1:] + [first])
        if config.reuse_prefix:  # the cache's entries, for the next sequence
            prefix = Prefix(cache, list(prompt_ids), [features])
            runner.prefixes.keep(prefix)
    last = first  # the last emitted token: the next tree's root, whose entry it commits
    yield [first]
    # Greedy acceptance: inside the verify's (recorded) step on a device, so that a cycle
    # syncs once; eagerly on a CPU, in Python over the tree's host copy (match_on_host).
    # A penalty needs the logits: its greedy cycles pick outside the step.
    host_match = runner.engine == "eager" and target.device.type == "cpu" and HOST_MATCH
    while True:
        with timer("draft"):
            tree = drafter.propose()
            if config.temperature > 0 and tree.spliced_paths is not None:
                tree = official_for_sampling(tree)  # the released order at T > 0 (fta.py)
        greedy = config.temperature == 0 and tree.spliced_paths is None and \
            tree.spliced_attend is None
        if greedy and host_match:
            with timer("verify"):  # and the target's picks, as on a device
                features, logits = verify_tree(target, cache, tree, width,
                                               runner.step_for(width))
                raw = logits
                if penalty is not None:
                    logits = penalty.rows(logits, tree.tokens, tree.mask)  # own path only
                picks = rowgemm.argmax(logits).tolist()
            with timer("accept_commit"):
                result = match_on_host(tree, picks)
                commit_accepted(cache, drafter, tree, features, result)
        elif greedy and penalty is None and not config.logprobs:
            with timer("verify"):  # and greedy acceptance, in one step
                features, result = verify_greedy(target, cache, tree, width,
                                                 runner.step_for(width, greedy=True))
            with timer("accept_commit"):
                commit_accepted(cache, drafter, tree, features, result)
        else:
            with timer("verify"):  # and the target's picks, as a greedy verify makes them
                features, logits = verify_tree(target, cache, tree, width,
                                               runner.step_for(width))
                raw = logits
                if penalty is not None:
                    logits = penalty.rows(logits, tree.tokens, tree.mask)  # own path only
                picks = sample_tokens(logits, config.temperature, generator, *cut)
            with timer("accept_commit"):
                result = accept_picks(tree, picks, config.temperature, runner.accept_step)
                commit_accepted(cache, drafter, tree, features, result)
        if penalty is not None or config.logprobs:  # the emitted tokens, on the device
            emitted = torch.cat([tree.tokens[result.nodes[1:]], result.bonus.view(1)])
            if penalty is not None:
                penalty.add(emitted)
            if config.logprobs:  # row n_i of the path predicted its token i + 1
                logprobs.add(raw[result.nodes], emitted)
        if config.reuse_prefix:  # the root and the accepted drafts: the committed entries
            prefix.spoiled |= tree.spliced_attend is not None  # (official FTA: fta.py)
            prefix.add([last] + result.tokens[:-1], features[result.nodes])
            last = result.tokens[-1]
        if on_cycle is not None:
            on_cycle(tree, result.tokens)
        yield result.tokens


def generate(target: Target, drafter: Drafter, prompt_ids: list[int],
             config: GenerateConfig = GenerateConfig(),
             result: GenerationResult | None = None,
             on_cycle: Callable[[DraftTree, list[int]], None] | None = None
             ) -> Iterator[list[int]]:
    """Run the loop to a stop token or max_new_tokens.

    A generator: yields each cycle's new token ids (cut at the stop) and returns the
    GenerationResult (get it with `result = yield from generate(...)`, or use `run`).
    `result`, if given, is filled in place; closed early, it describes the tokens yielded
    so far (`stopped_by == "closed"`).
    """
    result = GenerationResult() if result is None else result
    timer = PhaseTimer(target.device, config.profile)
    start = last = time.perf_counter()
    # The caller's time between cycles (a stream's printing) is its own, not the loop's:
    # wall_s and cycle_s leave out every pause at `yield`.
    away, paused_at = 0.0, None
    strings = StopStrings(target.decode, config.stop) if config.stop else None
    stop_ids = answer_stops(target, config)
    logprobs = TokenLogprobs(config.top_logprobs) if config.logprobs else None
    if logprobs is not None:  # growing as the cycles run (a stream reads them: Cycle.of)
        result.logprobs, result.top_logprobs = logprobs.values, logprobs.tops
    cycles = speculative_cycles(target, drafter, prompt_ids, config, timer, on_cycle,
                                logprobs, result)
    try:
        for new in cycles:
            room = config.max_new_tokens - result.new_tokens
            stops = [i for i, t in enumerate(new[:room]) if t in stop_ids]
            end = stops[0] + 1 if stops else min(len(new), room)
            if strings is not None and (kept := strings.through(new[:end])) is not None:
                new, result.stopped_by = new[:kept], "stop_string"
            elif stops:
                new, result.stopped_by = new[:end], "stop_token"
            elif len(new) >= room:
                new, result.stopped_by = new[:room], "max_new_tokens"
            now = paused_at = time.perf_counter()
            result.token_ids += new
            result.accept_lengths.append(len(new))
            result.cycle_s.append(now - last)
            yield new
            last = time.perf_counter()
            away, paused_at = away + last - now, None
            if result.stopped_by:
                break
    finally:  # also when the caller stops early: the result covers what it was given
        cycles.close()
        result.stopped_by = result.stopped_by or "closed"
        end = time.perf_counter() if paused_at is None else paused_at  # closed at a yield
        result.wall_s = end - start - away
        result.phase_s = dict(timer.totals)
        result.text = target.decode(result.token_ids)
        if logprobs is not None:  # the tokens kept (a stop may have cut a cycle short)
            result.logprobs = logprobs.values[:result.new_tokens]
            if logprobs.tops is not None:
                result.top_logprobs = logprobs.tops[:result.new_tokens]
        if strings is not None:  # the stop string is not part of the answer's text
            result.text = strings.text(result.text)
    return result


def run(target: Target, drafter: Drafter, prompt_ids: list[int],
        config: GenerateConfig = GenerateConfig(),
        on_cycle: Callable[[DraftTree, list[int]], None] | None = None) -> GenerationResult:
    """`generate` without streaming: the finished GenerationResult."""
    steps = generate(target, drafter, prompt_ids, config, on_cycle=on_cycle)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
