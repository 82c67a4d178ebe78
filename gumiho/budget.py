"""`--total-tokens auto`: the draft tree shape that maximises expected tokens/s here.

A bigger, deeper tree accepts more per cycle but costs more to draft and to verify; where
the balance lies depends on the device (on a CPU the verify cost grows with width, on a
GPU it is nearly flat) and on how good the drafter is. We measure all three and pick:

1. Acceptance by shape, from one calibration run at the reference shape. Every
   candidate shape's tree is a subtree of the reference tree: the W - 1 best nodes by
   selection priority among those at depth <= D (exact for the dynamic trees of Gumiho and
   EAGLE-2, whose candidate pool does not depend on the budget, while the reference tree
   holds enough nodes of depth <= D; Medusa's static tree is built best-first), or, for a
   chain, the best child at each level. A subtree accepts exactly the part of each
   cycle's accepted path that lies inside it. The calibration decodes at the temperature
   asked for: at T > 0 the target draws one token at every node (sampling.py), and with
   those draws fixed a subtree also accepts exactly the part of the path inside it.
2. Drafting cost by shape: the drafter at that shape proposes repeatedly from one state
   (median; the shape caps every level at the budget, see SerialDrafter), plus the
   catch-up on accepted tokens that every cycle pays, from the calibration run.
3. Verify cost by width: the median target step over a tree of that many tokens.

expected tokens/s (shape) = accepted per cycle / (draft + verify(W) + accept and commit)

4. The model's best `FINALISTS` shapes, and plain decoding, run whole cycles at the
   calibration's temperature on the calibration prompts in turns (`whole_cycles`), and the
   shape with the most tokens/s there (the median of its runs) is chosen. The model ranks
   the candidates; its best dozen lay within 1-3% of each other on a 2-core CPU, and six
   calibrations there picked four different shapes, one of them 7-8% behind the best in a
   six-benchmark run.
5. Past the reference, where a wider verify costs little (a GPU with a small target: a
   step there is launch-bound), the candidates also take trees of up to `WIDE_WIDTHS[-1]`
   tokens at each depth that can hold them, and every shape is then drawn from a wider
   pool (beam `WIDE_BEAM`, `WIDE_PRUNING` nodes a level; Medusa's static tree, built best
   first, only grows): a bigger tree only adds its
   least likely nodes, so it accepts more where its verify costs no more. They join when
   the verify at the reference width costs at most `FLAT_VERIFY` plain steps here and the
   caller fixed neither top_k nor pruning (a flag given wins), and the
   calibration then runs at the pool's own size, so every shape is still a subtree of its
   trees. (On a 2-core CPU a 64-token verify costs ~3 plain steps: none join there.)
6. The chosen shape's break-even (`break_even` in the report; `--draft-gate`, gate.py): its
   whole cycle in plain steps, from those runs (the phase timings above carry a sync per
   phase and overstate a small cycle: a chain of 2 was predicted at 1.45 plain steps on a
   2-core CPU and measured at 1.28-1.29). The drafter pays where its cycles emit more
   tokens than that.

The choice is cached in the gumiho cache dir per target, drafter, device (a GPU's or the
CPU's model), dtype, engine, temperature and thread count (`_cache_file` lists the rest).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from gumiho import rowamx, rowgemm, rowlayer
from gumiho.config import TreeConfig
from gumiho.engine import GenerateConfig, TargetRunner, prefill, run, verify_tree
from gumiho.errors import GumihoError
from gumiho.linear import PackedLinear
from gumiho.methods import method_spec
from gumiho.paths import cache_dir, write_atomically
from gumiho.profiling import fastest_interleaved, timed
from gumiho.sampling import sample_tokens
from gumiho.target import Target
from gumiho.tree import DraftTree

log = logging.getLogger("gumiho")

CANDIDATE_WIDTHS = (3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Trees past the reference where a verify at its width is nearly free (5. above). The
# shipped Gumiho over 32,768 draft tokens, six benchmarks x 3 questions (fp32, session 54):
# mean tau 3.02 at the reference 64 tokens (beam 14, 35 a level), 3.18 at 128 (beam 32),
# 3.32 at 256 (beam 32, 64 a level); docs/gpu.md, "Trees past the reference".
WIDE_WIDTHS = (96, 128, 192, 256)
WIDE_BEAM, WIDE_PRUNING = 32, 64
FLAT_VERIFY = 1.5  # plain steps a reference-width verify may cost for them to be tried
FINALISTS = 3  # the model's best shapes that run whole cycles before the choice
WHOLE_CYCLE_TOKENS = 48  # the finalists' answers: tokens each (at most the calibration's)
CALIBRATION_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
)


@dataclass(frozen=True)
class Shape:
    """A candidate tree: `total_tokens` verified (root included) down to `depth`, or the
    best chain of that depth (`chain`: beam 1, one candidate per level)."""

    total_tokens: int
    depth: int
    chain: bool = False

    def tree(self, reference: TreeConfig) -> TreeConfig:
        if self.chain:
            return replace(reference, total_tokens=self.depth + 1, depth=self.depth, top_k=1,
                           mlp_topk=1, pruning=1, fta="off")
        return replace(reference, total_tokens=self.total_tokens, depth=self.depth)


def _ranks(tree: DraftTree) -> list[int]:
    """Each non-root node's rank by selection priority (0 = kept first), on the host."""
    order = torch.argsort(tree.priority[1:].cpu(), descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=order.device)
    return [0, *[int(r) + 1 for r in rank]]  # the root first


def kept_nodes(tree: DraftTree, shape: Shape) -> set[int]:
    """The reference tree's nodes that a tree of `shape` keeps (the root included)."""
    if tree.priority is None:
        raise ValueError("shapes need trees with a selection priority")
    depths, parents = tree.depths.tolist(), tree.parents.tolist()
    ranks = _ranks(tree)
    if shape.chain:
        kept, node = {0}, 0
        for _ in range(shape.depth):
            children = [i for i, p in enumerate(parents) if p == node]
            if not children:
                break
            node = min(children, key=lambda i: ranks[i])
            kept.add(node)
        return kept
    allowed = sorted((i for i in range(1, len(depths)) if depths[i] <= shape.depth),
                     key=lambda i: ranks[i])
    return {0, *allowed[: shape.total_tokens - 1]}


def accepted_nodes(tree: DraftTree, drafts: list[int]) -> list[int]:
    """The tree nodes (root excluded) of an accepted run of draft tokens, walked from the
    root by token."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    nodes, node = [], 0
    for token in drafts:
        child = next((i for i in range(1, len(tokens))
                      if parents[i] == node and tokens[i] == token), None)
        if child is None:
            break
        nodes.append(child)
        node = child
    return nodes


def accept_by_shape(trees: list[DraftTree], drafts: list[list[int]], shapes: list[Shape]
                    ) -> dict[Shape, float]:
    """Mean tokens per verify cycle each shape would have emitted, from the reference
    trees a drafter proposed and the draft tokens each cycle accepted."""
    totals = dict.fromkeys(shapes, 0)
    for tree, accepted in zip(trees, drafts, strict=True):
        path = accepted_nodes(tree, accepted)
        for shape in shapes:
            kept = kept_nodes(tree, shape)
            inside = next((i for i, node in enumerate(path) if node not in kept), len(path))
            totals[shape] += 1 + inside  # accepted drafts plus the bonus token
    return {s: totals[s] / max(len(trees), 1) for s in shapes}


def accept_by_size(trees: list[DraftTree], drafts: list[list[int]], widths: list[int]
                   ) -> dict[int, float]:
    """`accept_by_shape` over sizes alone (every depth allowed)."""
    shapes = [Shape(w, 10**6) for w in widths]
    by_shape = accept_by_shape(trees, drafts, shapes)
    return {s.total_tokens: v for s, v in by_shape.items()}


def verify_step(target: Target, width: int, context: int, engine: str = "eager",
                temperature: float = 0.0):
    """A call of one target step over a `width`-node tree (a balanced binary tree) on top of
    `context` committed tokens, through `engine`'s (captured) step, and the target's pick
    at every node at `temperature` (as a verify in the loop makes it), ready to time."""
    device = target.device
    runner = TargetRunner(target, engine)
    cache = runner.cache_for(context + width + 1)
    low, high = token_range(target)
    prompt = torch.randint(low, high, (1, context), device=device)
    prefill(target, cache, prompt)
    parents = torch.cat([torch.tensor([-1], device=device),
                         torch.arange(width - 1, device=device) // 2])
    tree = DraftTree.from_parents(torch.randint(low, high, (width,), device=device), parents)
    generator = torch.Generator(device=device).manual_seed(0)
    return lambda: sample_tokens(verify_tree(target, cache, tree, step=runner.step_for(None))[1],
                                 temperature, generator)


def verify_step_seconds(target: Target, width: int, context: int, repeats: int,
                        engine: str = "eager") -> float:
    """Median seconds of `verify_step`."""
    return timed(verify_step(target, width, context, engine), target.device, repeats)


def token_range(target: Target) -> tuple[int, int]:
    """Ordinary token ids to time with: [100, 1000), inside the vocabulary."""
    vocab = target.embed_tokens.weight.shape[0]
    return (100, 1000) if vocab >= 1000 else (0, vocab)


def shape_depths(method: str, reference: TreeConfig) -> range | None:
    """The depths auto tries for a dynamic tree: from the method's `auto_min_depth` (or the
    reference's own where it asks for less) to the reference's; None for a static tree,
    which keeps its depth."""
    low = method_spec(method).auto_min_depth
    if low is None:
        return None
    return range(min(low, reference.depth), reference.depth + 1)  # `--depth 1`: that one


def candidate_shapes(method: str, reference: TreeConfig,
                     widths: tuple[int, ...] = CANDIDATE_WIDTHS, wide: list[Shape] = (),
                     holds: dict[int, int] | None = None) -> list[Shape]:
    """Sizes up to the reference's; for the dynamic trees also every depth
    (`shape_depths`), chains, and the `wide` shapes past the reference (5. above). With
    `holds` (`capacities`), a size past what the tree holds down to a depth is that many:
    the same tree, named for what it verifies."""
    sizes = sorted({w for w in widths if w <= reference.total_tokens}
                   | {reference.total_tokens})
    depths = shape_depths(method, reference)

    def fitted(width: int, depth: int) -> Shape:
        return Shape(width if holds is None else min(width, holds[depth]), depth)

    if depths is None:
        shapes = [fitted(w, reference.depth) for w in sizes] + list(wide)
    else:
        shapes = [fitted(w, d) for w in sizes for d in depths if w - 1 >= d] + \
            [Shape(d + 1, d, chain=True) for d in depths] + list(wide)
    return list(dict.fromkeys(shapes))  # each tree once


def capacities(model, method: str, pool: TreeConfig, engine: str) -> dict[int, int]:
    """The most tokens (root included) a tree drawn from `pool` holds down to each depth
    auto tries (a static tree: its own)."""
    return {depth: shape_drafter(model, method, replace(pool, depth=depth), engine).max_nodes
            for depth in shape_depths(method, pool) or (pool.depth,)}


def wide_pool(method: str, reference: TreeConfig) -> TreeConfig:
    """The tree that calibrates a choice with sizes past the reference: the largest of
    them, for a dynamic tree from a wider beam and more nodes a level (every smaller shape
    is the best W - 1 nodes of it; a static tree, built best first, only grows)."""
    wider = replace(reference, total_tokens=max(WIDE_WIDTHS))
    if shape_depths(method, reference) is None:
        return wider
    return replace(wider, top_k=max(reference.top_k, WIDE_BEAM),
                   pruning=max(reference.pruning, WIDE_PRUNING))


def wide_shapes(reference: TreeConfig, holds: dict[int, int]) -> list[Shape]:
    """The sizes past the reference (`WIDE_WIDTHS`) at each depth auto tries (a static
    tree: its own), as far as the wider pool holds nodes down to that depth (`holds`, its
    `capacities`: a depth-3 Gumiho pool of beam 32 and 64 a level holds 128)."""
    return [Shape(w, depth) for depth, most in holds.items() for w in WIDE_WIDTHS
            if reference.total_tokens < w <= most]


def time_widths(target: Target, shapes: list[Shape], engine: str, temperature: float
                ) -> dict[int, float]:
    """Seconds of a verify at every shape's width and at 1 (a plain step), in turns, the
    fastest round of each (profiling.fastest_interleaved): on a shared machine a burst of
    load once moved one width's median enough to change the pick."""
    return fastest_interleaved(
        {w: verify_step(target, w, 128, engine, temperature)
         for w in sorted({1, *(s.total_tokens for s in shapes)})}, target.device, 21)


def shape_drafter(model, method: str, tree: TreeConfig, engine: str):
    """The calibration drafter's network drafting at another tree shape."""
    from gumiho.drafters import MedusaDrafter
    from gumiho.serial_drafter import SerialDrafter

    cls = SerialDrafter if method_spec(method).serial else MedusaDrafter
    return cls(model, tree, engine=engine)


def _prime(target: Target, drafter, ids: list[int]) -> tuple[Tensor, Tensor]:
    """Start `drafter` on the prompt `ids`: observed, not yet caught up. Returns the
    prompt's features (n, H) and next tokens (n,)."""
    runner = TargetRunner(target, "eager")
    cache = runner.cache_for(len(ids) + 8)
    prompt = torch.tensor([ids], device=target.device)
    features, logits = prefill(target, cache, prompt)
    drafter.begin(target, len(ids) + 64)
    tokens = torch.cat([prompt[0, 1:], logits[-1].argmax().view(1)])
    drafter.observe(features, tokens, ids[1:] + [0])
    return features, tokens


def draft_step(target: Target, model, method: str, shape_tree: TreeConfig, engine: str,
               ids: list[int]):
    """A call of one proposal at a shape, ready to time (no catch-up: re-proposals from
    the state after the prompt, which the first call catches up)."""
    drafter = shape_drafter(model, method, shape_tree, engine)
    _prime(target, drafter, ids)
    return drafter.propose


def cycle_step(target: Target, drafter, engine: str, ids: list[int]):
    """A captured engine's whole drafting step, ready to time: `drafter`'s catch-up over a
    full accept (bonus + every draft level) and its proposal, the step the loop replays
    (the calibration's drafter: already recorded), run again at the same cache slots
    (nothing is committed). Less `draft_step`'s proposal at its shape, timed in turns with
    it, it is the catch-up's share. None where drafting is not one recorded step (the eager
    engine, a drafter without a catch-up: Medusa)."""
    if engine == "eager" or not getattr(drafter, "one_step", False):
        return None
    features, tokens = _prime(target, drafter, ids)
    drafter.propose()  # catches up on the prompt (eagerly), committing it
    width = min(drafter.draft_depth + 1, len(ids))
    drafter.observe(features[-width:], tokens[-width:], ids[-width:])
    pending = drafter._take_pending()[:3]  # (tokens, features, meta): recorded, uncommitted

    @torch.no_grad()  # as `propose` runs it (the step's products take other paths with grad)
    def whole():
        return drafter._cycle_step(*pending)
    return whole


def without_wrappers(tree: TreeConfig) -> TreeConfig:
    """The tree without the settings applied on top of its shape (the prompt-lookup chain,
    the gate, the confidence floor): calibration runs without them and the caller keeps its
    own, so they are not part of the choice or its cache key."""
    return replace(tree, lookup=0, lookup_first=False, draft_gate=0.0, min_confidence=0.0,
                   extend_confidence=0.0)


def whole_cycles(target: Target, model, method: str, trees: dict[str, TreeConfig],
                 engine: str, max_new_tokens: int = WHOLE_CYCLE_TOKENS, repeats: int = 3,
                 temperature: float = 0.0) -> dict[str, dict]:
    """Unprofiled runs at `temperature` of drafter `model` at each of `trees` and of plain
    decoding on the calibration prompts, every tree and plain decoding in turn (the first
    rotating), whole cycles after the prefill. Per name ("plain" and each of `trees`):
    `cycle_s`, the seconds a cycle, and `tokens_per_s`, the tokens emitted per second; each
    prompt's time is the median of its `repeats` runs (a burst of load on a shared machine
    moves one run, not the figure; greedy, the prompts' tokens are the same every run; at
    T > 0 each repeat draws with its own seed, the same for every tree)."""
    from gumiho.drafters import PlainDrafter

    drafters = {"plain": PlainDrafter(),
                **{name: shape_drafter(model, method, tree, engine) for name, tree in
                   trees.items()}}
    config = GenerateConfig(max_new_tokens=max_new_tokens, engine=engine,
                            temperature=temperature)
    prompts = calibration_ids(target)
    for drafter in drafters.values():  # warm-up (and captures)
        run(target, drafter, prompts[0], replace(config, max_new_tokens=8))
    names = list(drafters)
    runs: dict[tuple[str, int], list[tuple[float, int, int]]] = {}
    for turn in range(repeats * len(prompts)):
        p = turn % len(prompts)
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            result = run(target, drafters[name], prompts[p],
                         replace(config, seed=turn // len(prompts)))
            runs.setdefault((name, p), []).append(
                (sum(result.cycle_s[1:]), len(result.cycle_s) - 1,
                 sum(result.accept_lengths[1:])))
    out = {}
    for name in names:
        seconds = cycles = tokens = 0
        for p in range(len(prompts)):
            measured = sorted(runs[name, p])
            middle = measured[len(measured) // 2]  # the median run's seconds, cycles, tokens
            seconds, cycles, tokens = seconds + middle[0], cycles + middle[1], tokens + middle[2]
        out[name] = {"cycle_s": seconds / max(cycles, 1),
                     "tokens_per_s": tokens / seconds if seconds else 0.0}
    return out


def calibration_ids(target: Target) -> list[list[int]]:
    """The calibration prompts' token ids, through the target's chat template; a target
    without a tokenizer gets fixed ids of the same lengths' order (its own text would need
    one)."""
    if target.tokenizer is None:
        vocab = target.lm_head.weight.shape[0]
        return [[(7 * i + 11 * k) % vocab for i in range(32 + 8 * k)]
                for k in range(len(CALIBRATION_PROMPTS))]
    return [target.chat_ids(prompt) for prompt in CALIBRATION_PROMPTS]


def temperature_key(temperature: float) -> float:
    """The temperature a tree shape is chosen and cached for: to two decimals (0.0:
    greedy)."""
    return round(float(temperature), 2) if temperature > 0 else 0.0  # 1 and 1.0: one key


def measured_device(device: torch.device) -> str:
    """The device that measured costs are cached under: a GPU's name, the CPU's model
    (a cache folder in a home shared by several machines must not hand one CPU's choice
    to another), else the kind of device (an "mps" choice is not the CPU's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from gumiho.env import cpu_name

        return f"cpu {cpu_name()}"
    return device.type


def target_key(name: str) -> list:
    """The target as the cache knows it: a local model folder by where it is (a relative
    name means another model from another folder) and when its files last changed (a model
    replaced in place is measured again); a name (an embedded model's) as it is."""
    path = Path(name)
    if not path.is_dir():
        return [name]
    files = [f for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".json")]
    return [str(path.resolve()), max((f.stat().st_mtime_ns for f in files), default=0)]


def _cache_file(target: Target, method: str, draft: str, tree: TreeConfig, engine: str,
                temperature: float = 0.0, kept: frozenset[str] = frozenset()) -> Path | None:
    from gumiho.checkpoint import weights_file

    if draft == "random":
        return None
    draft_path = Path(draft).resolve()
    try:
        weights = weights_file(draft_path)  # the file a load reads
        stamp = [weights.stat().st_mtime_ns, (draft_path / "config.json").stat().st_mtime_ns
                 if (draft_path / "config.json").exists() else 0]
    except (GumihoError, OSError):
        stamp = 0
    device_name = measured_device(target.device)
    # the first item versions what the costs measure (5: wide verifies' logits via oneDNN;
    # 6: bf16 CPU projections packed, MLP heads without weight copies; 7: float32 ones
    # packed for MKL; 8: float32 ones through rowgemm.c; 9: verify widths timed in turns,
    # the fastest round each; 10: the proposals likewise; 11: with fused.py; 12: 3 tokens
    # and, for Gumiho, depth 1 among the candidates; 13: a depth-1 tree's fixed shape,
    # greedy acceptance on the host on a CPU, the finalists' whole cycles; 14: trees past the
    # reference where its verify is nearly free; 15: a float32 CPU drafter's vocabulary head
    # from 16 bits); whether the
    # target's layers are packed ($GUMIHO_PACK), whether rowgemm (with its AVX-512 blocks)
    # and rowamx built here ($GUMIHO_ROWGEMM, $GUMIHO_ROWGEMM512, $GUMIHO_ROWAMX) and
    # whether fused.py runs the target's decoder ($GUMIHO_FUSED), and rowlayer.c its steps
    # ($GUMIHO_ROWLAYER), change them; so do the threads the kernels run on, the drafter's
    # 16-bit head ($GUMIHO_DRAFT_HEAD16), the calibration prompts' ids (the chat template)
    # and which of top_k and pruning the caller fixed (no wider pool then)
    packed = any(type(m) is PackedLinear for m in target.model.modules())
    fused = target._fused
    steps = None if fused is None else "rowlayer" if fused.rows is not None else "fused"
    keyed = temperature_key(temperature)  # greedy keys stay as they were before T > 0
    prompts = hashlib.sha1(json.dumps(calibration_ids(target)).encode()).hexdigest()[:12]
    key = json.dumps([17, steps, rowlayer.identity(), target_key(target.name), method,
                      str(draft_path), stamp,
                      asdict(without_wrappers(tree)), device_name, str(target.dtype),
                      engine, torch.__version__, packed, rowgemm.identity(), rowamx.identity(),
                      target.config._attn_implementation, torch.get_num_threads(),
                      os.environ.get("GUMIHO_DRAFT_HEAD16", "1"), prompts, sorted(kept)]
                     + ([keyed] if keyed else []), default=str)
    return cache_dir() / "auto_tree" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


def calibrate(target: Target, drafter, engine: str, max_new_tokens: int,
              temperature: float = 0.0
              ) -> tuple[list[DraftTree], list[list[int]], dict[str, float]]:
    """Runs at `temperature` on the calibration prompts: every cycle's tree and accepted
    drafts, and the per-cycle seconds of the phases every shape pays alike."""
    trees: list[DraftTree] = []
    config = GenerateConfig(max_new_tokens=max_new_tokens, profile=True, engine=engine,
                            temperature=temperature)
    prompts = calibration_ids(target)
    run(target, drafter, prompts[0], replace(config, max_new_tokens=8))  # warm-up (captures)
    kept, drafts = [], []
    totals = {"draft": 0.0, "draft_catchup": 0.0, "accept_commit": 0.0}
    for prompt in prompts:
        trees.clear()
        result = run(target, drafter, prompt, config,
                     on_cycle=lambda tree, emitted: trees.append(tree))
        emitted = result.token_ids[result.accept_lengths[0]:]  # after the prefill's token
        offset = 0
        for drafted, n in zip(trees, result.accept_lengths[1:], strict=False):
            kept.append(drafted)
            drafts.append(emitted[offset : offset + n - 1])
            offset += n
        for name in totals:
            totals[name] += result.phase_s.get(name, 0.0)
    return kept, drafts, {k: v / max(len(kept), 1) for k, v in totals.items()}


def choose_tree(target: Target, method: str, draft: str, tree: TreeConfig, engine: str,
                max_new_tokens: int = 64, widths: tuple[int, ...] = CANDIDATE_WIDTHS,
                temperature: float = 0.0, kept: frozenset[str] = frozenset()) -> dict:
    """Pick the tree shape for `method`'s drafter `draft` on this device, for decoding at
    `temperature`; returns the report: `tree` (the TreeConfig fields to use), and per shape
    the expected accept, cycle time and tokens/s. `kept`: the tree options the caller set
    (a flag given wins: with top_k or pruning among them no wider pool is tried)."""
    from gumiho.drafters import load_drafter

    temperature = temperature_key(temperature)  # what the cached choice is for
    path = _cache_file(target, method, draft, tree, engine, temperature, kept)
    if path is not None and path.exists():
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            chosen_row(report)  # the fields a report has, or KeyError
            if not isinstance(report["tree"], dict) or "break_even" not in report:
                raise KeyError("tree")
            return report
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring an unreadable cached tree shape %s: measuring again", path)
    # Calibrate on the plain dynamic tree: its subtrees are what smaller shapes give.
    reference = replace(without_wrappers(tree), fta="off")
    drafter = load_drafter(method, target, draft, tree=reference, engine=engine)
    holds = capacities(drafter.model, method, reference, engine)
    shapes = candidate_shapes(method, reference, widths, holds=holds)
    own_width = holds[reference.depth]  # what the reference verifies
    if engine == "compile":  # every shape and width is a step of its own to compile
        steps = len(shapes) + len({1, *(s.total_tokens for s in shapes)})
        log.warning("choosing the tree shape for this device (once per drafter, device and "
                    "engine): --engine compile compiles each of the %d shapes and widths it "
                    "times, which can take an hour (--total-tokens N skips the choice) "
                    "...", steps)
    else:
        log.warning("choosing the tree shape for this device (once per drafter and device%s;"
                    " about a minute on a CPU) ...",
                    f", and for T = {temperature:g}" if temperature else "")
    verify = time_widths(target, shapes, engine, temperature)
    flat = verify[own_width] / verify[1]  # the reference's verify, plain steps
    pool = reference  # every shape's tree is drawn from it: the calibration's
    wide = []
    if flat <= FLAT_VERIFY and not kept & {"top_k", "pruning"}:
        wide_holds = capacities(drafter.model, method, wide_pool(method, reference), engine)
        wide = wide_shapes(reference, wide_holds)
    if wide:
        pool = wide_pool(method, reference)
        drafter = shape_drafter(drafter.model, method, pool, engine)
        log.warning("a %d-token verify costs %.2f plain steps here: trying trees of up to %d "
                    "tokens too%s", own_width, flat,
                    max(s.total_tokens for s in wide),
                    "" if shape_depths(method, reference) is None else
                    f" (beam {pool.top_k}, {pool.pruning} nodes a level)")
        shapes = candidate_shapes(method, reference, widths, wide, holds=wide_holds)
        verify = time_widths(target, shapes, engine, temperature)  # all widths in turns
    trees, drafts, fixed = calibrate(target, drafter, engine, max_new_tokens, temperature)
    accept = accept_by_shape(trees, drafts, shapes)
    ids = calibration_ids(target)[0]
    # the shapes' proposals in turns too, the fastest round each
    calls = {shape: draft_step(target, drafter.model, method, shape.tree(pool), engine,
                               ids) for shape in shapes}
    own = Shape(pool.total_tokens, pool.depth)  # the calibration's shape
    if own not in calls:
        calls[own] = draft_step(target, drafter.model, method, pool, engine, ids)
    # Captured engines record a cycle's drafting, catch-up included, as one step
    # (serial_drafter.py), so the profile has no catch-up phase: its share is that step less
    # a proposal at the calibration's shape, both timed in these turns. (The profile's mean
    # drafting less the fastest proposal was a difference of two windows of a shared
    # machine's load: it could read 0 on a small drafter.) Medusa has none.
    whole = None if fixed["draft_catchup"] else cycle_step(target, drafter, engine, ids)
    if whole is not None:
        calls["cycle"] = whole
    cost = fastest_interleaved(calls, target.device, 11)
    if whole is not None:
        fixed["draft_catchup"] = max(cost.pop("cycle") - cost[own], 0.0)
    rows = {}
    for shape in shapes:
        cycle = fixed["draft_catchup"] + cost[shape] + verify[shape.total_tokens] + \
            fixed["accept_commit"]
        rows[f"{shape.total_tokens}/{shape.depth}{'/chain' if shape.chain else ''}"] = {
            **asdict(shape), "accept": accept[shape], "cycle_s": cycle,
            "tokens_per_s": accept[shape] / cycle, "speedup": accept[shape] / cycle * verify[1]}
    # The model's best few run whole cycles in turns, and the fastest of those is
    # chosen: its predictions for the top shapes lie within a few percent of each other
    # (the sums of phases timed apart), where whole cycles measure what the loop pays.
    finalists = sorted(rows, key=lambda name: -rows[name]["tokens_per_s"])[:FINALISTS]
    base = replace(tree, top_k=pool.top_k, pruning=pool.pruning)  # the caller's, drawn as pool
    cycles = whole_cycles(target, drafter.model, method, {
        name: without_wrappers(Shape(rows[name]["total_tokens"], rows[name]["depth"],
                                     rows[name]["chain"]).tree(base)) for name in finalists},
        engine, max_new_tokens=min(max_new_tokens, WHOLE_CYCLE_TOKENS),
        temperature=temperature)
    for name in finalists:
        rows[name]["measured_tokens_per_s"] = cycles[name]["tokens_per_s"]
    winner = max(finalists, key=lambda name: cycles[name]["tokens_per_s"])
    best = rows[winner]
    chosen = Shape(best["total_tokens"], best["depth"], best["chain"]).tree(base)
    plain = cycles["plain"]["cycle_s"]
    gate = cycles[winner]["cycle_s"] / plain if plain else 1.0
    report = {"tree": {k: getattr(chosen, k) for k in
                       ("total_tokens", "depth", "top_k", "mlp_topk", "pruning", "serial_levels",
                        "fta")},
              "method": method, "draft": str(draft), "device": str(target.device),
              "temperature": temperature,
              "engine": engine, "plain_step_s": verify[1], "break_even": gate,
              "reference_verify": flat, "pool": {k: getattr(pool, k) for k in
                                                 ("total_tokens", "top_k", "pruning")},
              "cycles": len(trees), "chosen": winner,
              "fixed_s": fixed, "shapes": rows}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(report, indent=1),
                                                              encoding="utf-8"))
        except OSError as exc:  # e.g. GUMIHO_CACHE names a file: measure again next time
            log.warning("could not cache the tree size in %s (%s)", path.parent, exc.strerror)
    return report


def chosen_row(report: dict) -> tuple[str, dict]:
    """The name and row of the shape that `choose_tree` chose: the fastest finalist by its
    whole cycles, which need not be the model's best row. (Reports cached before they named
    it are matched by the chosen tree's size.)"""
    shapes = report["shapes"]
    if report.get("chosen") in shapes:
        return report["chosen"], shapes[report["chosen"]]
    tree = report["tree"]
    chain = tree["top_k"] == 1 and tree["mlp_topk"] == 1 and tree["pruning"] == 1
    for name, row in shapes.items():
        if (row["total_tokens"], row["depth"], row["chain"]) == \
                (tree["total_tokens"], tree["depth"], chain):
            return name, row
    raise KeyError(f"no shape in the report matches its chosen tree {tree}")
