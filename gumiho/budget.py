"""`--total-tokens auto`: the tree size that maximises expected tokens/s on this device.

A bigger tree accepts more per cycle but costs more to verify; where the balance lies
depends on the device (on a CPU the verify cost grows with width, on a GPU it is nearly
flat) and on how good the drafter is. We measure both and pick:

1. Acceptance by size, from one greedy calibration run at the largest size. For the
   dynamic trees (Gumiho, EAGLE-2: EAGLE-2's expand-then-rerank design) the candidate
   pool does not depend on the size: a tree
   of size W is the W - 1 best pool nodes by score. So the accepted path of each cycle
   tells exactly what a smaller tree would have accepted: the path's leading nodes whose
   score rank is below W - 1 (ancestors always outrank their children). Medusa's static
   tree is built best-first, so its node order is its rank. (Exact for greedy decoding;
   at T > 0 it is the greedy proxy.)
2. Cost by size: the median of a verify step at each candidate width on this device and
   engine, plus the calibration run's mean drafting and accept/commit time per cycle.

expected tokens/s (W) = mean accepted-per-cycle(W) / (draft + verify(W) + commit)

The choice is cached per target, drafter, device, dtype and engine in the gumiho cache dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path

import torch

from gumiho.config import TreeConfig
from gumiho.engine import GenerateConfig, run
from gumiho.target import Target, cache_dir
from gumiho.tree import DraftTree

log = logging.getLogger("gumiho")

CANDIDATE_WIDTHS = (4, 8, 12, 16, 24, 32, 48, 64)
CALIBRATION_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
)


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


def accept_by_size(trees: list[DraftTree], drafts: list[list[int]], widths: list[int]
                   ) -> dict[int, float]:
    """Mean tokens per verify cycle that trees of each width would have emitted, from the
    trees a drafter proposed at its largest width and the draft tokens each cycle accepted."""
    totals = dict.fromkeys(widths, 0)
    for tree, accepted in zip(trees, drafts, strict=True):
        if tree.priority is None:
            raise ValueError("accept_by_size needs trees with a selection priority")
        # host-side bookkeeping: the calibration's trees may live on an accelerator
        order = torch.argsort(tree.priority[1:].cpu(), descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.shape[0], device=order.device)
        path = [int(rank[node - 1]) for node in accepted_nodes(tree, accepted)]
        for width in widths:
            kept = next((i for i, r in enumerate(path) if r >= width - 1), len(path))
            totals[width] += 1 + kept  # accepted drafts plus the bonus token
    return {w: totals[w] / max(len(trees), 1) for w in widths}


def verify_cost(target: Target, widths: list[int], engine: str, context: int = 128,
                repeats: int = 5) -> dict[int, float]:
    """Median seconds of a verify step over a `width`-node tree, per width."""
    from gumiho.evaluation.timing import verify_step_seconds

    return {w: verify_step_seconds(target, w, context, repeats, engine=engine) for w in widths}


def _cache_file(target: Target, method: str, draft: str, tree: TreeConfig, engine: str
                ) -> Path | None:
    if draft == "random":
        return None
    draft_path = Path(draft).resolve()
    weights = next(iter(sorted(draft_path.glob("*.safetensors")) +
                        sorted(draft_path.glob("*.bin"))), None)
    stamp = weights.stat().st_mtime_ns if weights else 0
    device = target.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = json.dumps([target.name, method, str(draft_path), stamp, vars(tree), device_name,
                      str(target.dtype), engine, torch.__version__], default=str)
    return cache_dir() / "auto_tree" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


def choose_total_tokens(target: Target, method: str, draft: str, tree: TreeConfig,
                        engine: str, max_new_tokens: int = 64,
                        widths: tuple[int, ...] = CANDIDATE_WIDTHS) -> dict:
    """Pick total_tokens for `method`'s drafter `draft` on this device; returns the
    report (`total_tokens`, and per width the expected accept, cycle time, tokens/s)."""
    from gumiho.drafters import load_drafter

    path = _cache_file(target, method, draft, tree, engine)
    if path is not None and path.exists():
        try:
            report = json.loads(path.read_text())
            report["widths"] = {int(w): row for w, row in report["widths"].items()}
            return report
        except (json.JSONDecodeError, KeyError, ValueError):
            log.warning("ignoring an unreadable cached tree size %s", path)
    largest = tree.total_tokens
    widths = sorted({w for w in widths if w <= largest} | {largest})
    log.warning("choosing the tree size for this device (once per drafter and device; "
                "about a minute on a CPU) ...")
    # Calibrate on the plain dynamic tree: its sub-trees are what smaller sizes give.
    drafter = load_drafter(method, target, draft, tree=replace(tree, fta="off"),
                           engine=engine)
    trees: list[DraftTree] = []
    propose = drafter.propose

    def recording_propose():
        trees.append(propose())
        return trees[-1]

    drafter.propose = recording_propose
    config = GenerateConfig(max_new_tokens=max_new_tokens, profile=True, engine=engine)
    run(target, drafter, target.chat_ids(CALIBRATION_PROMPTS[0]),
        replace(config, max_new_tokens=8))  # warm-up (and captures)
    kept: list[DraftTree] = []
    drafts: list[list[int]] = []
    phase = {"draft": 0.0, "accept_commit": 0.0}
    for prompt in CALIBRATION_PROMPTS:
        trees.clear()
        result = run(target, drafter, target.chat_ids(prompt), config)
        emitted = result.token_ids[result.accept_lengths[0]:]  # after the prefill's token
        offset = 0
        for drafted, n in zip(trees, result.accept_lengths[1:], strict=False):
            kept.append(drafted)
            drafts.append(emitted[offset : offset + n - 1])
            offset += n
        for name in phase:
            phase[name] += result.phase_s.get(name, 0.0)
    verify = verify_cost(target, [1, *widths], engine)
    accept = accept_by_size(kept, drafts, widths)
    overhead = sum(phase.values()) / max(len(kept), 1)
    plain_step = verify[1]
    rows = {}
    for w in widths:
        cycle = overhead + verify[w]
        rows[w] = {"accept": accept[w], "cycle_s": cycle, "tokens_per_s": accept[w] / cycle,
                   "speedup": accept[w] / cycle * plain_step}
    best = max(widths, key=lambda w: rows[w]["tokens_per_s"])
    report = {"total_tokens": best, "method": method, "draft": str(draft),
              "device": str(target.device), "engine": engine, "plain_step_s": plain_step,
              "draft_commit_s": overhead, "widths": rows}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(path)
        except OSError as exc:  # e.g. GUMIHO_CACHE names a file: measure again next time
            log.warning("could not cache the tree size in %s (%s)", path.parent, exc.strerror)
    return report
