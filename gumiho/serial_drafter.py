"""The serial drafter of Gumiho and EAGLE-2: the catch-up over the committed pairs, the
serial levels, Gumiho's MLP heads and the tree's selection, as one recorded step where the
tree allows (drafter_api.py describes the interface it implements).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from gumiho.config import TreeConfig
from gumiho.fta import exact_fta_tree, splice_official
from gumiho.graphs import StaticStep
from gumiho.hostsync import upload
from gumiho.kv_cache import KVCache, reuse_or_allocate
from gumiho.methods import method_spec
from gumiho.modeling import DraftHead, draft_size
from gumiho.modeling.drafter import FusedSerial
from gumiho.profiling import PhaseTimer
from gumiho.tree import LOGPROB_FLOOR, DraftTree, Pool, Star, expand_level, select_tree


class SerialDrafter:
    """Gumiho (serial levels 1-2, then all MLP heads at once) and EAGLE-2 (serial levels
    all the way down) over one drafter KV cache.

    The drafter's pair t is (f_t, x_{t+1}) at position t. Committed pairs live in its cache;
    draft levels are written after them, uncommitted, and each level's entries see the
    context, their own ancestors' entries and themselves (never their siblings).

    With `tree.min_confidence` (eager steps), nodes whose path score falls below its log
    are not verified, a level is drafted only below a node that reaches it, and a cycle
    whose best first draft falls short is a plain step. A child never scores above its
    parent, so the kept nodes are the best ones and stay ancestor-closed. With
    `tree.extend_confidence` above that floor, a deeper level (a serial step, the MLP heads)
    is drafted only where a node of the level above reaches it instead (then for the whole
    beam, one drafter call, and its nodes are kept from the first floor up): a level costs a
    drafter step and a wider verify, while verifying the first draft costs only the wider
    verify.

    Without floors and FTA (the default tree) a cycle's drafting is one recorded step
    (`_cycle_fn`: the catch-up over the pairs the target committed, the serial levels, the
    MLP heads and the tree's selection), which reads the committed length from a device
    tensor, so on a GPU it is one graph replay and a handful of launches around it (it was
    ~70 launches and five replays). The FTA modes finish their trees on the host from a
    recorded catch-up and levels; floors run eagerly.
    """

    def __init__(self, model, tree: TreeConfig, engine: str = "eager"):
        self.model, self.tree, self.engine = model, tree, engine
        # the serial layers in fewer operations (modeling/drafter.py), where they are Llama's
        self.serial_step = FusedSerial.of(model) or model.serial_step
        spec = method_spec(model.config.method)
        self.method = self.name = spec.name
        self.max_nodes = tree.total_tokens
        levels = spec.serial_levels  # then the MLP heads (Gumiho); None: serial throughout
        if levels is not None and tree.serial_levels:  # `--serial-levels S`
            levels = tree.serial_levels
        # A Gumiho tree shallower than its serial levels (`--depth 1`) drafts level 1 alone:
        # one drafter call a cycle, no serial step, no heads.
        self.serial_depth = tree.depth if levels is None else min(levels, tree.depth)
        # MLP head j (1-based) draws level j + 2 whatever drafted the levels above it, so
        # after S serial levels heads S-1.. follow (0-based `first_head`), as far as the depth
        self.first_head = max(0, self.serial_depth - 2)
        self.heads = 0 if levels is None else max(0, min(
            model.config.num_mlp_heads - self.first_head, tree.depth - self.serial_depth))
        self.draft_depth = self.serial_depth + self.heads  # deepest node a tree can have
        # A node ranked W - 1 or lower within its level is outranked by W - 1 nodes, so it
        # can never be among the W - 1 the tree keeps: no level needs more candidates, and
        # the MLP heads need only the W - 2 best level-2 nodes (each is outranked at least
        # by its own parent). These caps change nothing in the tree, only its cost.
        # Serial levels past the second descend from any level-2 node: all of them get heads.
        # No level can take more candidates than a (reduced) draft vocabulary holds.
        budget = tree.total_tokens - 1
        words = draft_size(model, budget)
        self.beam = min(tree.top_k, budget, words)
        self.mlp_rows = min(self.beam, budget - 1) if self.serial_depth <= 2 else self.beam
        self.mlp_topk = min(tree.mlp_topk, budget, words)
        self.pruning = min(tree.pruning, budget)
        largest = 1 + self.pool_nodes()
        if tree.fta == "off" and largest < tree.total_tokens:
            # no tree outgrows its pool (the FTA modes complete levels): the size it runs
            # at is its tree's, as answer files record it
            self.max_nodes = largest
            self.tree = replace(tree, total_tokens=largest)
        # --min-confidence as a log-prob floor on path scores; eager steps only (it reads
        # scores on the host and changes the tree's size, which captured steps cannot)
        eager = engine == "eager"
        self.floor = math.log(tree.min_confidence) if tree.min_confidence > 0 and eager \
            else None
        extend = max(tree.min_confidence, tree.extend_confidence)
        self.extend_floor = math.log(extend) if extend > 0 and eager else None
        # no FTA and no floors: a cycle's drafting is one recorded step (`_cycle_fn`)
        self.one_step = tree.fta == "off" and self.floor is None and self.extend_floor is None
        # a depth-1 tree is the root's best children: its shape is made once (tree.Star;
        # with `star_trees` False the next `begin` selects it as deeper trees are, the
        # same tree: scripts/cpu_ab.py --switch lean, the tests)
        self.star_trees, self.star = True, None
        self.cache: KVCache | None = None
        self.timer = PhaseTimer(torch.device("cpu"), enabled=False)  # the loop's, to profile
        self.penalty = None  # the generation's penalties (engine.py, penalty.py), eager only

    def pool_nodes(self) -> int:
        """The most candidates a cycle's pool holds (root not counted), so the largest tree
        it can select: `beam` nodes per serial level, then each MLP level at most `pruning`
        of its rows x mlp_topk, from the heads' rows (`mlp_rows` below level 2, else the
        beam). A --total-tokens past it verifies no more tokens."""
        nodes = self.serial_depth * self.beam
        rows = self.mlp_rows if self.serial_depth <= 2 else self.beam
        for _ in range(self.heads):
            rows = min(self.pruning, rows * self.mlp_topk)
            nodes += rows
        return nodes

    def begin(self, target, capacity: int) -> None:
        if getattr(self, "head_target", None) is not target:  # once per target
            self.head = DraftHead.for_model(target, self.model, drafting=True)
            self.head_target = target
            # a new cache, so new recorded steps: the old ones read the last target's head
            # (and their cache has its device and dtype)
            self.cache = None
        if not (self.draft_depth == 1 and self.star_trees):
            self.star = None
        elif self.star is None or self.star.inf.device != target.device:
            self.star = Star(self.beam, target.device)
            self._stars = {self.beam: self.star}  # and smaller ones, under a floor
        self.pending: list[tuple[Tensor, Tensor]] = []
        self.state: tuple[Tensor, ...] | None = None  # root, out1, level 1: drafted from
        self.cache, new = reuse_or_allocate(  # + the uncommitted entries of levels 2..
            self.cache, capacity + (self.serial_depth - 1) * self.beam,
            self.engine != "eager", lambda n, trim: KVCache(self.model.config.llama_config(), n,
                                                            target.device, target.dtype, trim))
        if isinstance(self.serial_step, FusedSerial):  # its rotary table
            self.serial_step.reserve(self.cache.capacity)
        if not new:
            return  # the captured steps stay bound to this cache
        # Recorded (module doc): a whole cycle's drafting, catch-up to tree, as one step; the
        # tree again from the same state; and, for the FTA modes, which finish the tree on
        # the host, the catch-up and the levels. Catch-ups are padded to one width; prompts
        # run eagerly. The last outputs (the state) are read before the step runs again.
        self._cycle_step = StaticStep(self._cycle_fn, self.engine, fresh=5)
        self._draft_step = StaticStep(self._draft_fn, self.engine)
        self._catch_up_step = StaticStep(self._catch_up_fn, self.engine)
        self._levels_step = StaticStep(self._levels_fn, self.engine)

    def observe(self, features: Tensor, next_tokens: Tensor,
                tokens: list[int] | None = None) -> None:
        self.pending.append((features, next_tokens))

    def _top(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k likeliest draft tokens of each row (..., H): their log-probs (..., k),
        floored at LOGPROB_FLOOR (an underflow to -inf would tie and break the tree's
        ranking; flooring here, inside the recorded steps, spares the tree one kernel
        per level), and their target ids (..., k)."""
        logits = self.head(hidden).float()
        if self.penalty is not None and self.engine == "eager":  # (penalty.py)
            logits = self.penalty.drafted(logits, self.head.ids)
        top = torch.log_softmax(logits, -1).topk(k)
        return top.values.clamp(min=LOGPROB_FLOOR), self.head.to_target(top.indices)

    def _phase(self, name: str):
        """The profiler's phase inside drafting: eager steps only (a recorded step is one
        replay, and a profiled phase's device sync cannot happen inside a capture)."""
        return self.timer(name) if self.engine == "eager" else nullcontext()

    def _take_pending(self) -> tuple[Tensor, Tensor, Tensor, int, bool]:
        """The pending pairs (tokens (w,), features (w, H)), `meta` (2,) = [committed
        length, n] on the device, n, and how to run them: as a recorded step, padded to
        the longest accept (bonus + every draft level; padding rows see only themselves
        and are not committed), or eagerly (the eager engine; a captured engine's prompt).
        Reserves the cache slots the cycle's drafting writes."""
        features, tokens = (parts[0] if len(parts) == 1 else torch.cat(parts)  # no copy of one
                            for parts in zip(*self.pending, strict=True))  # (n, H): f_t; x_{t+1}
        self.pending = []
        n, width = tokens.shape[0], self.draft_depth + 1
        recorded = self.engine != "eager" and n <= width
        if recorded and n < width:
            tokens = torch.cat([tokens, tokens[-1:].expand(width - n)])
            features = torch.cat([features, features[-1:].expand(width - n, -1)])
        self.cache.reserve(max(tokens.shape[0], n + (self.serial_depth - 1) * self.beam))
        meta = upload(np.array([self.cache.length, n], dtype=np.int64), tokens.device)
        return tokens, features, meta, n, recorded

    @torch.no_grad()  # an inference cache: never differentiated through
    def _catch_up(self) -> tuple[Tensor, ...]:
        """Run the pending pairs, committing them; returns the drafting state (root, out1,
        level 1's log-probs and tokens), also kept."""
        tokens, features, meta, n, recorded = self._take_pending()
        step = self._catch_up_step if recorded else self._catch_up_fn
        self.state = step(tokens, features, meta)
        self.cache.commit(n)
        return self.state

    def _catch_up_fn(self, tokens: Tensor, features: Tensor, meta: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The serial layers over the pending pairs (w of them, the first n real) at the
        committed length meta[0], writing their cache entries there. Returns the drafting
        state: the root (1,), out1 (H,) of the newest pair and its top_k (log-probs,
        tokens) (k,) each: draft level 1."""
        start, n = meta[:1], meta[1:]
        at = torch.arange(tokens.shape[0], device=tokens.device)
        # real rows see the real rows up to themselves; padding rows see only themselves
        rows = (at[None, :] == at[:, None]) | ((at[None, :] <= at[:, None]) & (at[:, None] < n))
        self.cache.seek(start)
        with self._phase("draft_catchup"):
            out = self.serial_step(tokens[None], features[None], (start + at)[None],
                                   self.cache.mask_at(rows, start), self.cache.hf)[0]
            out1 = out.index_select(0, n - 1)  # (1, H): the newest real pair's
            values, indices = self._top(out1, self.beam)
        return tokens.index_select(0, n - 1), out1[0], values[0], indices[0]

    @torch.no_grad()
    def _serial_level(self, tokens: Tensor, parent_out: Tensor, seen: Tensor,
                      start: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One serial step for k beam nodes. tokens (k,), parent_out (k, H) the output each
        token was drawn from, seen (k, R) the earlier draft entries each node may see,
        start (1,) the committed length (None: the cache's, read on the host).
        Writes the k entries after the R earlier ones; returns out (k, H) and its top_k
        (log-probs (k, top_k), tokens (k, top_k))."""
        k, r = seen.shape
        if start is None:
            self.cache.reserve(r + k)
            start = self.cache.write_position()
        # (k, R + k): its ancestors among the earlier entries, then itself
        rows = torch.cat([seen, torch.eye(k, dtype=torch.bool, device=seen.device)], 1)
        # the R entries are r // k earlier levels, so this level sits that far past the root
        positions = (start + r // max(k, 1)).expand(k)[None]
        self.cache.seek(start + r)
        with self._phase("draft_serial"):
            out = self.serial_step(tokens[None], parent_out[None], positions,
                                   self.cache.mask_at(rows, start), self.cache.hf)[0]
            return out, *self._top(out, self.beam)

    def _levels(self, out1: Tensor, values: Tensor, indices: Tensor, start: Tensor
                ) -> tuple[Pool, tuple[Tensor, Tensor, Tensor]] | None:
        """Serial levels as a beam of k = `beam` nodes, then (Gumiho) the MLP levels'
        candidates: the serial pool (levels 1..serial_depth, k nodes each), the heads' top
        mlp_topk (log-probs, tokens) (R, heads, m) on the first R level-2 nodes, and each
        node of the last serial level's row among those R (the MLP levels below it come
        from that row's heads); all three empty without heads. None when no first draft
        reaches --min-confidence (eager steps only, as are all host reads here).

        The candidate pool is built level by level; within a level, node j of the level
        is pool node `first + j`. Per serial level the tensors line up by beam row:
        `level` (the pool level, k nodes in score order), `outs` (k, H) the serial output
        each node was drawn from (its parent's), and `seen` (k, R) which of the R draft
        entries already in the drafter's cache (earlier levels, k per level) each node may
        attend to: exactly its ancestors. `row` (k,) maps each kept child to its parent's
        beam row, which is how outputs and visibility follow the beam.
        """
        k = self.beam
        level = Pool(tokens=indices, parents=torch.full_like(indices, -1),
                     scores=values, depths=torch.ones_like(indices))
        if not self._reaches_floor(level, self.floor):
            return None  # no draft is likely enough: a plain step
        levels, outs = [level], out1.expand(k, -1)  # level 1 was drawn from out1
        seen = torch.zeros(k, 0, dtype=torch.bool, device=out1.device)  # (k, 0): none yet
        first = 0  # pool index of the current level's node 0
        inputs = branch = None  # the MLP heads' inputs (level 2's), each node's row in them
        for depth in range(2, self.serial_depth + 1):
            if not self._reaches_floor(level, self.extend_floor):
                break  # a child scores at most its parent: none would be verified
            parent_tokens, parent_outs = level.tokens, outs
            # the level's own outputs (k, H), top-k each
            new_outs, top_values, top_indices = self._serial_level(level.tokens, outs, seen,
                                                                   start)
            level, row = expand_level(level.scores, top_indices, top_values, k, first, depth)
            first += levels[-1].tokens.shape[0]
            levels.append(level)
            outs = new_outs[row]  # children are drawn from their parent's output
            if self.heads and depth == 2:
                # MLP inputs per level-2 node: its own level-1 parent's token and output
                # (d1, out1, by `row`; the released code paired rows with the wrong parent),
                # its token and its own serial output (d2, out2). In score order.
                inputs = (parent_tokens[row], parent_outs[row], level.tokens, outs)
            elif self.heads:  # a deeper serial level: each node's level-2 ancestor's row
                branch = row if branch is None else branch[row]
            if depth < self.serial_depth:  # the next level's view: the parent's + the parent
                eye = torch.eye(seen.shape[0], dtype=torch.bool, device=seen.device)
                seen = torch.cat([seen, eye], 1)[row]  # (k, R + k)
        heads = (torch.zeros(0, device=out1.device),) * 2 + (
            torch.zeros(0, dtype=torch.long, device=out1.device),)
        if self.heads and self._reaches_floor(level, self.extend_floor):  # (nor a cut level)
            # Gumiho: the deeper levels from the MLP heads at once
            rows = self.mlp_rows
            with self._phase("draft_heads"):  # (R, heads, m)
                hidden = self.model.parallel_heads(*(x[:rows] for x in inputs), self.heads,
                                                   self.first_head)  # (R, heads, H)
                if branch is None:  # level 2 is the last serial level: its first R nodes
                    branch = torch.arange(rows, device=out1.device)
                heads = (*self._top(hidden, self.mlp_topk), branch)  # (R, heads, m) each
        return Pool.concat(levels), heads

    def _levels_fn(self, out1, values, indices, start):
        """`_levels` as a recorded step (no floors there): the pool's fields and the heads'."""
        serial, heads = self._levels(out1, values, indices, start)
        return (serial.tokens, serial.parents, serial.scores, serial.depths, *heads)

    def _draft_fn(self, root, out1, values, indices, start):
        """The tree from a drafting state: levels, heads, then the best W - 1 nodes
        (DraftTree fields and priority)."""
        if self.star is not None:  # depth 1: the level is the tree
            return self.star.tree(root, values, indices)
        serial, heads = self._levels(out1, values, indices, start)
        return self._tree_fn(root, serial.tokens, serial.parents, serial.scores,
                             serial.depths, *heads)

    def _cycle_fn(self, tokens, features, meta):
        """A cycle's drafting as one step: the catch-up, then the tree from its state
        (the tree's fields and priority, then the state)."""
        state = self._catch_up_fn(tokens, features, meta)
        return (*self._draft_fn(*state, meta[:1] + meta[1:]), *state)

    @torch.no_grad()  # not inference_mode: compiled steps reject inference tensors
    def propose(self) -> DraftTree:
        """The catch-up over the pairs observed since the last proposal (committing them),
        then the tree: serial levels, MLP heads, selection (`_levels`, `_tree_fn`). In the
        default tree (no FTA, no confidence floors) all of it is one recorded step."""
        if self.pending and self.one_step:
            tokens, features, meta, n, recorded = self._take_pending()
            fields = (self._cycle_step if recorded else self._cycle_fn)(tokens, features, meta)
            self.cache.commit(n)
            self.state = fields[5:]
            return DraftTree(*fields[:4], priority=fields[4])
        if self.pending:  # else: propose again from the same state
            self._catch_up()
        root, out1, values, indices = self.state
        if self.star is not None and not self.one_step and self.tree.fta == "off":
            # depth 1 under --min-confidence: the drafts that reach it (a prefix, best first)
            kept = values.shape[0] if self.floor is None else int((values >= self.floor).sum())
            if not kept:
                return DraftTree.chain(root)  # no draft is likely enough: a plain step
            if kept not in self._stars:
                self._stars[kept] = Star(kept, values.device)
            fields = self._stars[kept].tree(root, values[:kept], indices[:kept])
            return DraftTree(*fields[:4], priority=fields[4])
        self.cache.reserve((self.serial_depth - 1) * self.beam)
        start = self.cache.write_position()
        if self.one_step:
            fields = self._draft_step(root, out1, values, indices, start)
            return DraftTree(*fields[:4], priority=fields[4])
        if self.floor is None and self.extend_floor is None:
            fields = self._levels_step(out1, values, indices, start)
            drafted = Pool(*fields[:4]), fields[4:]
        else:
            drafted = self._levels(out1, values, indices, start)
            if drafted is None:
                return DraftTree.chain(root)  # no draft is likely enough: a plain step
        serial, heads = drafted
        pool, branches = self._mlp_pool(serial, *heads, with_branches=self.tree.fta == "exact")
        budget = self.tree.total_tokens - 1
        if self.floor is not None:  # the best nodes are the likeliest: keep those above the floor
            budget = min(budget, int((pool.scores >= self.floor).sum()))
        if self.tree.fta == "exact" and heads[1].dim() == 3:  # MLP levels to complete
            return exact_fta_tree(root[0], pool, budget, branches, heads[1][:, :, 0],
                                  first_mlp_depth=3)
        tree = select_tree(root[0], pool, budget, self.draft_depth)[0]
        return splice_official(tree) if self.tree.fta == "official" else tree

    @staticmethod
    def _reaches_floor(level: Pool, floor: float | None) -> bool:
        """Whether the level's best node (levels are in score order) reaches `floor` (a
        log-prob; None: no floor): the verify floor for its own nodes, the extend floor for
        drafting their children."""
        return floor is None or float(level.scores[0]) >= floor

    def _mlp_pool(self, serial: Pool, top_values: Tensor, top_indices: Tensor,
                  branch: Tensor, with_branches: bool = True) -> tuple[Pool, Tensor | None]:
        """The serial pool extended by one pruned level per MLP head, and each pool node's
        branch: the level-2 row (0..R-1) whose heads drew it or, on the last serial level,
        draw its children (-1 above, and for nodes without heads); head h's candidates for
        a node come from its branch's row. top_values, top_indices (R, heads, m) from the
        heads; branch (P,) the rows of the first P nodes of the last serial level
        (`_levels`). Without `with_branches` (only `--fta exact` reads them, with 2 serial
        levels) the branches are None: 7 kernels fewer in the recorded drafting step."""
        if top_values.numel() == 0:
            return serial, torch.full_like(serial.tokens, -1) if with_branches else None
        k = self.beam
        first = serial.tokens.shape[0] - k  # pool index of the last serial level's node 0
        levels, branches = [serial], []
        if with_branches:  # the last serial level's nodes: their own heads' rows
            row_of = torch.arange(serial.tokens.shape[0], device=branch.device) - first
            inside = (row_of >= 0) & (row_of < branch.shape[0])
            branches.append(torch.where(inside, branch[row_of.clamp(0, branch.shape[0] - 1)],
                                        -1))
        scores = serial.scores[first : first + branch.shape[0]]
        for head in range(self.heads):
            level, row = expand_level(scores, top_indices[branch, head],
                                      top_values[branch, head], self.pruning, first,
                                      self.serial_depth + 1 + head)
            first += levels[-1].tokens.shape[0] if head else k
            branch, scores = branch[row], level.scores
            levels.append(level)
            branches.append(branch)
        return Pool.concat(levels), torch.cat(branches) if with_branches else None

    def _tree_fn(self, root, tokens, parents, scores, depths, top_values, top_indices, branch):
        """The tree from the serial pool and the heads' candidates: the MLP levels, then the
        best W - 1 nodes. Tensors only: DraftTree fields and priority."""
        pool, _ = self._mlp_pool(Pool(tokens, parents, scores, depths), top_values,
                                 top_indices, branch, with_branches=False)
        tree, _ = select_tree(root[0], pool, self.tree.total_tokens - 1, self.draft_depth)
        return tree.tokens, tree.parents, tree.depths, tree.mask, tree.priority
