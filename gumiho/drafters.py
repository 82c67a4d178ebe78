"""The methods' drafters (plain decoding and Medusa here, Gumiho and EAGLE-2's in
serial_drafter.py) and `load_drafter`, which builds one for a method with its wrappers
(drafter_api.py describes the interface they share).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from gumiho.checkpoint import drafter_network, load_drafter_model
from gumiho.config import DrafterConfig, TreeConfig
from gumiho.drafter_api import Drafter
from gumiho.errors import GumihoError
from gumiho.gate import GatedDrafter
from gumiho.graphs import StaticStep, resolve_engine
from gumiho.linear import pack_linears
from gumiho.lookup import LookupDrafter
from gumiho.methods import method_spec
from gumiho.modeling import DraftHead, draft_size
from gumiho.profiling import PhaseTimer
from gumiho.serial_drafter import SerialDrafter
from gumiho.tree import DraftTree, static_tree


class PlainDrafter:
    """Plain autoregressive decoding: the tree is the root alone, so each cycle is one step."""

    name = "ar"
    max_nodes = 1
    draft_depth = 0

    def begin(self, target, capacity: int) -> None:
        self.root: Tensor | None = None
        self._single = None

    def observe(self, features: Tensor, next_tokens: Tensor,
                tokens: list[int] | None = None) -> None:
        self.root = next_tokens[-1:]

    def propose(self) -> DraftTree:
        if self._single is None:
            self._single = DraftTree.chain(self.root)
        return replace(self._single, tokens=self.root)  # same one-node shape every cycle





class MedusaDrafter:
    """Medusa: heads on the newest target feature f_t; head i proposes x_{t+2+i}; a fixed
    tree whose node at depth d takes its head's rank-r token."""

    def __init__(self, model, tree: TreeConfig, head_accuracy: list[float] | None = None,
                 engine: str = "eager"):
        self.model, self.tree = model, tree
        self.name = model.config.method
        n_heads = model.w.shape[0]
        depth = self.draft_depth = min(tree.depth, n_heads)
        # the released tree's per-head accuracies, the last repeated for more heads
        acc = head_accuracy or ([0.6, 0.4, 0.3, 0.25] + [0.2] * max(depth - 4, 1))[:depth]
        parents, _, self.ranks = static_tree(tree.total_tokens - 1, depth, acc,
                                             max_rank=draft_size(model, 10))
        # static_tree lists nodes best first, so a smaller budget keeps a prefix
        self.shape = replace(DraftTree.from_parents(torch.zeros_like(parents), parents),
                             priority=-torch.arange(parents.shape[0], dtype=torch.float,
                                                    device=parents.device))
        self.max_nodes = self.shape.size
        self.max_rank = int(self.ranks.max()) + 1
        self._heads_step = StaticStep(self._heads_fn, engine)
        self.timer = PhaseTimer(torch.device("cpu"), enabled=False)
        self.engine = engine
        self.penalty = None  # the generation's penalties (engine.py, penalty.py), eager only

    def begin(self, target, capacity: int) -> None:
        if getattr(self, "head_target", None) is not target:  # once per target
            self.head = DraftHead.for_model(target, self.model, drafting=True)
            self.head_target = target
            # recorded anew: a recorded step reads the head it was recorded with
            self._heads_step = StaticStep(self._heads_fn, self.engine)
        device = target.device
        self.shape = DraftTree(*(getattr(self.shape, f).to(device) for f in
                                 ("tokens", "parents", "depths", "mask")),
                               priority=self.shape.priority.to(device))
        self.ranks = self.ranks.to(device)

    def observe(self, features: Tensor, next_tokens: Tensor,
                tokens: list[int] | None = None) -> None:
        self.feature, self.root = features[-1], next_tokens[-1:]

    def _heads_fn(self, feature: Tensor, root: Tensor) -> tuple[Tensor]:
        """The tree's tokens (K,): the root, then each node's head's rank-r token."""
        hidden = self.model(feature.to(self.model.w.dtype))  # (N, H)
        logits = self.model.logits(hidden, self.head).float()  # (N, Vd)
        if self.penalty is not None and self.engine == "eager":  # (penalty.py)
            logits = self.penalty.drafted(logits, self.head.ids)
        ranked = logits.topk(self.max_rank).indices  # (N, r)
        ranked = self.head.to_target(ranked)
        depths = self.shape.depths
        return (torch.where(depths > 0, ranked[(depths - 1).clamp(min=0), self.ranks], root),)

    @torch.no_grad()  # not inference_mode: compiled steps reject inference tensors
    def propose(self) -> DraftTree:
        with self.timer("draft_heads"):
            (tokens,) = self._heads_step(self.feature, self.root)
        return replace(self.shape, tokens=tokens)


def random_drafter_model(method: str, target, seed: int = 0,
                         draft_ids: Tensor | None = None, dtype: torch.dtype | None = None,
                         **config_overrides):
    """A seeded fresh drafter network of `method` for `target` (training starts here;
    `--draft random` uses it for checks and timing), on the target's device and `dtype`
    (default the target's). draft_ids: the target ids of a reduced draft vocabulary
    (modeling/vocab.py)."""
    torch.manual_seed(seed)
    if draft_ids is not None:
        config_overrides["draft_vocab_size"] = draft_ids.shape[0]
    config = DrafterConfig.for_target(target.config, method, **config_overrides)
    return drafter_network(config, target, draft_ids=draft_ids, dtype=dtype)


def load_drafter(method: str, target, draft: str | None = None,
                 tree: TreeConfig | None = None, seed: int = 0,
                 engine: str | None = None, random_vocab: int = 0) -> Drafter:
    """The drafter for `method` on `target`: a checkpoint dir, or `random` weights.
    engine: how its steps run (graphs.py); None picks by the target's device.
    random_vocab: with `random`, a draft vocabulary of the target's first N ids (what a
    reduced vocabulary costs, for timing; 0 = the whole vocabulary).
    A tree with `draft_gate` > 0 drafts only while drafting pays (gate.py, eager engine);
    one with `lookup` > 0 adds a prompt-lookup chain (lookup.py); `lookup` is plain
    decoding with one."""
    spec = method_spec(method)
    tree = tree or TreeConfig.for_method(method)
    engine = resolve_engine(engine, target.device)
    if not spec.drafter:
        if draft is not None:
            raise GumihoError(f"--method {method} takes no --draft: it has no drafter network")
        drafter: Drafter = PlainDrafter()
    else:
        if draft is None:
            raise GumihoError(f"--method {method} needs --draft DIR (a trained drafter) or "
                              "random")
        if random_vocab and draft != "random":
            raise GumihoError("a random draft vocabulary goes with --draft random (a trained "
                              "drafter keeps its own)")
        vocab = target.lm_head.weight.shape[0]
        if random_vocab > vocab:
            raise GumihoError(f"--draft-vocab {random_vocab} is larger than the target's "
                              f"vocabulary ({vocab} tokens)")
        # the whole vocabulary is the full one (no d2t/t2d buffers)
        ids = torch.arange(random_vocab, device=target.device) \
            if 0 < random_vocab < vocab else None
        model = random_drafter_model(method, target, seed, ids) if draft == "random" else \
            load_drafter_model(draft, target, method)
        model.eval().requires_grad_(False)
        if engine != "compile":  # inductor cannot lower the packed product
            pack_linears(model)  # on the CPU (linear.py)
        drafter = (SerialDrafter if spec.serial else MedusaDrafter)(model, tree, engine=engine)
        if tree.draft_gate and engine == "eager":
            drafter = GatedDrafter(drafter, tree.draft_gate)
    if not tree.lookup:
        return drafter
    return LookupDrafter(drafter, tree.lookup, static_shape=engine != "eager", engine=engine,
                         first=tree.lookup_first)
