"""The decoding methods, one `MethodSpec` each: adding a method is one entry here.

A spec is plain data, so it sits at the bottom of the import graph (config.py reads its
defaults). The code that builds and runs a drafter chooses by what a spec says the method
*is*, never by its name:

* `drafter` False: plain decoding, nothing to load (`ar`; `lookup` adds a prompt-lookup
  chain through its tree defaults). True: a trained network, from `--draft DIR` or `random`.
* `serial` True: a serial transformer head drafted level by level (`SerialDrafter`,
  `DraftModel`, `serial_loss`); `serial_levels` of them before Gumiho's parallel MLP heads
  draw the deeper levels all at once, or None for a serial head at every level (EAGLE-2).
  False: Medusa heads on the newest target feature (`MedusaDrafter`, `MedusaHeads`,
  `medusa_loss`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gumiho.errors import GumihoError


@dataclass(frozen=True)
class MethodSpec:
    name: str
    drafter: bool = True  # drafts with a network (needs --draft DIR or random)
    serial: bool = True  # a serial transformer head (else Medusa heads on f_t)
    serial_levels: int | None = None  # serial levels before the MLP heads; None: all
    # DrafterConfig fields over the target's shape (layers and heads)
    shape: Mapping[str, int] = field(default_factory=dict)
    # TreeConfig reference values (the paper's settings) over TreeConfig's defaults
    tree: Mapping[str, int | str] = field(default_factory=dict)
    tree_flags: tuple[str, ...] = ()  # the tree options it reads; others are refused
    # Checkpoint layout: config.json's model_type and architectures (vLLM reads them), and
    # the heads' key prefix (`{prefix}.{head}.{block}.linear.*`; "" for no heads).
    model_type: str = ""
    architecture: str = ""
    head_keys: str = ""
    # `--total-tokens auto`: the shallowest depth it may try (sizes and chains down to it),
    # or None when only the size may vary (a static tree keeps its depth).
    auto_min_depth: int | None = None

    @property
    def parallel_heads(self) -> bool:
        """Gumiho's MLP heads follow the serial levels."""
        return self.serial and self.serial_levels is not None

    @property
    def head_key(self) -> re.Pattern | None:
        """A checkpoint key of one head block: groups head, block, weight|bias."""
        if not self.head_keys:
            return None
        return re.compile(rf"^{re.escape(self.head_keys)}\.(\d+)\.(\d+)\.linear\.(weight|bias)$")


SPECS = (
    MethodSpec("ar", drafter=False),
    MethodSpec("lookup", drafter=False, tree={"total_tokens": 2, "lookup": 10},
               tree_flags=("lookup",)),
    MethodSpec("gumiho", serial_levels=2, tree={"depth": 7},
               tree_flags=("total_tokens", "top_k", "mlp_topk", "pruning", "depth", "fta",
                           "lookup", "lookup_first", "draft_gate", "min_confidence",
                           "extend_confidence", "serial_levels"),
               model_type="gumiho", architecture="GumihoLlamaForCausalLM", head_keys="mlp",
               auto_min_depth=1),
    MethodSpec("eagle2", shape={"num_hidden_layers": 1, "num_mlp_heads": 0},
               tree={"total_tokens": 60, "top_k": 10, "depth": 6, "fta": "off"},
               tree_flags=("total_tokens", "top_k", "depth", "lookup", "lookup_first",
                           "draft_gate", "min_confidence", "extend_confidence"),
               model_type="eagle2",
               architecture="EagleLlamaForCausalLM", auto_min_depth=1),
    MethodSpec("medusa", serial=False,
               shape={"num_hidden_layers": 0, "num_mlp_heads": 4, "num_mlp_layers": 1},
               tree={"total_tokens": 64, "depth": 4, "fta": "off"},
               tree_flags=("total_tokens", "depth", "lookup", "lookup_first", "draft_gate"),
               model_type="medusa",
               architecture="MedusaModel", head_keys="medusa_head"),
)
BY_NAME = {spec.name: spec for spec in SPECS}
METHODS = tuple(BY_NAME)  # every method `generate` runs
DRAFTER_METHODS = tuple(s.name for s in SPECS if s.drafter)  # those with a network to train


def method_spec(name: str) -> MethodSpec:
    if name not in BY_NAME:
        raise GumihoError(f"unknown method {name!r}: use one of {', '.join(METHODS)}")
    return BY_NAME[name]


def drafter_spec(name: str) -> MethodSpec:
    """The spec of a method with a drafter network (else one line naming those)."""
    spec = BY_NAME.get(name)
    if spec is None or not spec.drafter:
        raise GumihoError(f"no drafter for method {name!r}: use "
                          f"{', '.join(DRAFTER_METHODS[:-1])} or {DRAFTER_METHODS[-1]}")
    return spec


def spec_from_keys(keys) -> MethodSpec:
    """The drafter method of an official checkpoint without a Gumiho config, from its
    keys: the one whose head keys it holds, else the serial head alone (EAGLE-2)."""
    keys = list(keys)
    for spec in SPECS:
        if spec.head_keys and any(spec.head_key.match(k) for k in keys):
            return spec
    return next(s for s in SPECS if s.drafter and s.serial and not s.head_keys)
