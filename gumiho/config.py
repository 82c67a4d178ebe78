"""Config dataclasses, one per concern: the drafter's shape and the draft tree's settings.

`DrafterConfig` is saved as `config.json` beside each checkpoint: the 2-layer Llama fields
of the serial head plus the Gumiho fields that vLLM's GumihoConfig looks for.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from gumiho.errors import GumihoError
from gumiho.methods import BY_NAME, DRAFTER_METHODS, drafter_spec, method_spec

FTA_MODES = ("off", "official", "exact")
# The attention implementations attention.py registers with transformers, by the names a
# model's config and every answer file record (here, so that reading those needs no torch)
SDPA_GQA = "sdpa_gqa"
SDPA_INVARIANT = "sdpa_invariant"
MAX_TREE_SETTING = 1024  # sanity bound on any tree size or width (memory grows with it)


@dataclass(frozen=True)
class DrafterConfig:
    method: str  # gumiho | eagle2 | medusa
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default",
                                                          "rope_theta": 10000.0})
    hidden_act: str = "silu"
    num_hidden_layers: int = 2  # serial (transformer) layers; eagle2 uses 1, medusa 0
    num_mlp_heads: int = 5  # gumiho parallel heads; medusa heads
    num_mlp_layers: int = 5  # residual H->H blocks per head (after gumiho's 2H->H block)
    medusa_own_lm_head: bool = False  # original Medusa: one vocab projection per head
    # Reduced draft vocabulary (modeling/vocab.py): 0 = the target's whole vocabulary.
    draft_vocab_size: int = 0

    def __post_init__(self):
        """Types and ranges, so a hand-edited config.json fails here in one line, not deep
        inside a model constructor (TypeError/ValueError name the field)."""
        if self.method not in DRAFTER_METHODS:
            raise ValueError(f"method must be one of {', '.join(DRAFTER_METHODS)}, got "
                             f"{self.method!r}")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                     "num_hidden_layers", "num_mlp_heads", "num_mlp_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < (0 if name in ("num_hidden_layers", "num_mlp_heads") else 1):
                raise ValueError(f"{name} must be positive, got {value}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
            raise ValueError(f"rms_norm_eps must be a positive number, got {eps!r}")
        if not isinstance(self.rope_parameters, dict) or not isinstance(self.hidden_act, str):
            raise TypeError("rope_parameters must be an object and hidden_act a string")
        from transformers.activations import ACT2FN

        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not an activation "
                             "transformers knows")
        if method_spec(self.method).serial and self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1 for {self.method}, got "
                             f"{self.num_hidden_layers}")
        size = self.draft_vocab_size
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= \
                self.vocab_size:
            raise ValueError(f"draft_vocab_size must be an int from 0 to vocab_size "
                             f"({self.vocab_size}), got {size!r}")
        if not isinstance(self.medusa_own_lm_head, bool):
            raise TypeError(f"medusa_own_lm_head must be true or false, got "
                            f"{self.medusa_own_lm_head!r}")

    @classmethod
    def for_target(cls, target_config, method: str = "gumiho", **overrides) -> DrafterConfig:
        """The drafter shape for a target: its width, heads, norms and RoPE settings."""
        t = target_config.get_text_config() if hasattr(target_config, "get_text_config") \
            else target_config
        heads = t.num_attention_heads
        spec = drafter_spec(method)
        rope = dict(getattr(t, "rope_parameters", None) or {})
        if isinstance(rope.get("full_attention"), dict):  # per layer type: the drafter's
            rope = dict(rope["full_attention"])  # layers see the whole context
        if not rope:
            rope = {"rope_type": "default", "rope_theta": getattr(t, "rope_theta", 10000.0)}
        values = dict(
            method=method, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
            vocab_size=t.vocab_size,
            rms_norm_eps=getattr(t, "rms_norm_eps", None) or getattr(t, "layer_norm_eps", None)
            or 1e-6,  # the drafter's norms are RMSNorms whatever the target's are (Cohere's
            # are LayerNorms)
            max_position_embeddings=t.max_position_embeddings, rope_parameters=rope,
            hidden_act=getattr(t, "hidden_act", None) or getattr(t, "hidden_activation", None)
            or "silu",
        )
        values.update(spec.shape)
        values.update(overrides)
        return cls(**values)

    def llama_config(self):
        """The transformers LlamaConfig of the serial layers (sdpa attention)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=max(self.num_hidden_layers, 1),
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=float(self.rms_norm_eps),  # an int (1) is valid; LlamaConfig refuses it
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), hidden_act=self.hidden_act,
            attn_implementation="sdpa",
        )

    def to_json(self) -> dict:
        """config.json: Llama fields of the drafter plus the Gumiho/vLLM fields."""
        out = asdict(self)
        out.update(
            model_type=BY_NAME[self.method].model_type,
            architectures=[BY_NAME[self.method].architecture],
            rope_theta=self.rope_parameters.get("rope_theta"),
            rope_scaling=None if self.rope_parameters.get("rope_type", "default") == "default"
            else dict(self.rope_parameters),
            gumiho_fc_bias=True, draft_vocab_size=self.draft_vocab_size or self.vocab_size,
        )
        return out

    @classmethod
    def from_json(cls, data: dict) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("draft_vocab_size") == values.get("vocab_size"):
            values["draft_vocab_size"] = 0  # written out in full for vLLM; 0 means full here
        if "rope_parameters" not in values and "rope_theta" in data:
            values["rope_parameters"] = dict(data.get("rope_scaling") or {"rope_type": "default"},
                                             rope_theta=data["rope_theta"])
        return cls(**values)


PRESETS = ("reference", "demo")
# `gumiho demo`'s confidence floors, for the methods that take them, in float32. On the
# 2-core CPU the demo was tuned on, --min-confidence 0.1 took its prompt 0.95x -> 1.01x
# plain and six benchmarks 1.34x -> 1.36x (docs/methods.md); not in bf16, where a wider
# verify costs little on an AMX CPU and the floors cost speed (six benchmarks 1.80x without,
# 1.67x with). --extend-confidence 0.4: a deeper level costs a drafter step, the first
# draft only a slightly wider verify.
DEMO_FLOOR, DEMO_EXTEND, DEMO_LOOKUP = 0.1, 0.4, 10


def preset_options(preset: str | None, method: str, float32: bool, options: dict) -> dict:
    """`options` (TreeConfig fields, None = unset) with a preset's values where unset.
    "reference" (or None) sets nothing: the method's reference tree, as the papers evaluate
    it. "demo" is what `gumiho demo` runs, chosen by measurement on 2-core CPUs: the tree
    sized for this device and drafter (`total_tokens="auto"`), a prompt-lookup chain of 10
    that a cycle verifies alone when it finds one, while the last one found guessed right
    (`lookup_first`, lookup.LookupDrafter's trust; eager engine; in bf16 on
    an AMX CPU too, where merging the chain into the tree read 1.77x against 1.82x:
    docs/results/campaign/lookup_first_bf16_amx.md), and in float32 the confidence floors
    above (captured engines ignore them). Only for methods with a drafter."""
    if preset is not None and preset not in PRESETS:
        raise GumihoError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    if preset != "demo":
        return options
    spec = method_spec(method)
    if not spec.drafter:
        raise GumihoError(f"--preset demo sizes a drafter's tree: --method {method} has none")
    fill = {"total_tokens": "auto", "lookup": DEMO_LOOKUP}
    if "min_confidence" in spec.tree_flags and float32:
        fill |= {"min_confidence": DEMO_FLOOR, "extend_confidence": DEMO_EXTEND}
    merged = {**options, **{k: v for k, v in fill.items() if options.get(k) is None}}
    if merged.get("lookup") and merged.get("lookup_first") is None:
        merged["lookup_first"] = True
    return merged


def check_number(name: str, value, integer: bool = True) -> None:
    """A tree setting of the API's own type (the CLI's argparse converts): TypeError."""
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got "
                        f"{value!r} ({type(value).__name__})")


EAGER_ONLY = ("min_confidence", "extend_confidence", "draft_gate", "lookup_first")


def check_engine_options(options: dict, engine: str) -> None:
    """Refuse the tree flags that only the eager engine reads (each changes a cycle's shape
    as it runs, where a captured step keeps one), rather than ignore them."""
    asked = [k for k in EAGER_ONLY if options.get(k)]
    if asked and engine != "eager":
        flags = ", ".join("--" + k.replace("_", "-") for k in asked)
        raise GumihoError(f"{flags} work{'s' if len(asked) == 1 else ''} on the eager engine "
                          "only (a captured step keeps one "
                          f"shape), not --engine {engine}: add --engine eager, or leave "
                          f"{'it' if len(asked) == 1 else 'them'} out")


def check_tree_options(method: str, options: dict) -> None:
    """Refuse tree flags that `method` does not use (e.g. --fta with eagle2): setting one
    is refused, not silently ignored."""
    reads = method_spec(method).tree_flags
    unknown = set(options) - set(TreeConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown tree option(s) {', '.join(sorted(unknown))}: use "
                        f"{', '.join(TreeConfig.__dataclass_fields__)}")
    unused = [k for k, v in options.items() if v is not None and k not in reads]
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        used = ", ".join("--" + k.replace("_", "-") for k in reads) or "none"
        raise GumihoError(f"{flags} does not apply to --method {method} (its tree flags: "
                          f"{used})")


@dataclass(frozen=True)
class TreeConfig:
    """Draft tree settings; defaults per method follow the papers' reference settings."""

    total_tokens: int = 64  # verified tokens, root included
    top_k: int = 14  # beam width at serial levels
    mlp_topk: int = 35  # candidates per node at each MLP level
    pruning: int = 35  # nodes kept per MLP level
    depth: int = 6  # draft depth: gumiho 2 serial + MLP levels (7), eagle2 serial levels,
    # medusa static tree depth
    # Gumiho: levels the serial head drafts before the MLP heads take over (0 = the paper's
    # 2). With S > 2 the serial head drafts levels 3..S too and MLP head j still draws
    # level j + 2 (heads 1..S-2 unused): a drafter step a level for better candidates there.
    serial_levels: int = 0
    # Full Tree Attention: off | official | exact. Default off: with the shipped drafter
    # exact measured no better (tau 1.63 vs 1.64, 5 held-out prompts; docs/methods.md).
    fta: str = "off"
    # Prompt-lookup candidates (lookup.py): a chain of this many n-gram continuation tokens
    # under the root, beside the drafter's tree (0 = none; the `lookup` method: 10).
    lookup: int = 0
    # With a lookup chain, a cycle where the n-gram index finds a continuation verifies
    # that chain alone and skips the drafter, while the last continuation guessed the next
    # token right (else it goes beside the tree; eager steps; captured ones keep one shape).
    lookup_first: bool = False
    # Draft only while it pays (gate.py): the break-even tokens per drafter cycle, in plain
    # steps; while this sequence's drafter cycles emit fewer, cycles take plain steps
    # (eager steps; 0 = always draft). `--total-tokens auto` measures it for its shape.
    draft_gate: float = 0.0
    # Verify only draft nodes whose path probability under the drafter (the product of its
    # probabilities from the root) is at least this, and stop drafting deeper once no node
    # of a level reaches it (serial_drafter.py; eager steps; 0 = off, default).
    min_confidence: float = 0.0
    # Draft a deeper level (a drafter step: a serial level or the MLP heads) only below a
    # node whose path probability reaches this (serial_drafter.py; eager steps; 0 = the
    # min_confidence floor). A level costs a drafter step and a wider verify, the first
    # draft only a slightly wider verify, so the two floors differ (docs/methods.md).
    extend_confidence: float = 0.0

    def __post_init__(self):
        if self.fta not in FTA_MODES:
            raise GumihoError(f"--fta must be one of {', '.join(FTA_MODES)}, got {self.fta!r}")
        for name in ("total_tokens", "top_k", "mlp_topk", "pruning", "depth"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            check_number(name, value)
            if value < (2 if name == "total_tokens" else 1):
                raise GumihoError(f"{flag} must be at least "
                                  f"{2 if name == 'total_tokens' else 1}, got {value}")
            if value > MAX_TREE_SETTING:
                raise GumihoError(f"{flag} {value} is too large (at most {MAX_TREE_SETTING}: "
                                  "the reference trees verify 60-64 tokens)")
        check_number("serial_levels", self.serial_levels)
        if not (self.serial_levels == 0 or 2 <= self.serial_levels <= MAX_TREE_SETTING):
            raise GumihoError(f"--serial-levels must be 0 (the method's own) or an integer "
                              f"from 2 to {MAX_TREE_SETTING}, got {self.serial_levels!r}")
        if self.serial_levels > 2 and self.fta == "exact":
            raise GumihoError("--fta exact completes paths from MLP level 3: it takes the "
                              "paper's 2 serial levels (leave --serial-levels out)")
        check_number("lookup", self.lookup)
        if not 0 <= self.lookup <= MAX_TREE_SETTING:
            raise GumihoError(f"--lookup must be an integer from 0 to {MAX_TREE_SETTING}, "
                              f"got {self.lookup!r}")
        if not isinstance(self.lookup_first, bool):
            raise TypeError(f"lookup_first must be True or False, got {self.lookup_first!r}")
        if self.lookup_first and not self.lookup:
            raise GumihoError("--lookup-first needs a lookup chain: add --lookup N")
        gate = self.draft_gate
        check_number("draft_gate", gate, integer=False)
        if not 0 <= gate <= MAX_TREE_SETTING:
            raise GumihoError(f"--draft-gate must be a number from 0 to {MAX_TREE_SETTING} "
                              f"(tokens per drafter cycle), got {gate!r}")
        for name in ("min_confidence", "extend_confidence"):
            conf = getattr(self, name)
            check_number(name, conf, integer=False)
            if not 0 <= conf < 1:
                raise GumihoError(f"--{name.replace('_', '-')} must be a probability from 0 "
                                  f"(off) up to but not including 1, got {conf!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Beam and candidate widths cannot exceed the vocabulary they pick from."""
        for name in ("top_k", "mlp_topk"):
            if getattr(self, name) > vocab_size:
                raise GumihoError(f"--{name.replace('_', '-')} {getattr(self, name)} is larger "
                                  f"than the target's vocabulary ({vocab_size} tokens)")

    @classmethod
    def for_method(cls, method: str, **overrides) -> TreeConfig:
        """The method's reference tree (methods.py), with the overrides that are set."""
        spec = BY_NAME.get(method)
        base = cls(**spec.tree) if spec else cls()
        tree = replace(base, **{k: v for k, v in overrides.items() if v is not None})
        if method == "lookup" and not tree.lookup:  # else plain decoding, named "lookup"
            raise GumihoError("--method lookup needs a chain: --lookup of at least 1 (its "
                              "default is 10; plain decoding is --method ar)")
        return tree


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run's result (`gumiho.train` flags map one to one;
    saved with the run's state, and a resume with other values is refused)."""

    method: str = "gumiho"
    target: str = "smollm2"
    data: tuple[str, ...] = ()  # ge_data dirs; empty with `online`
    online: bool = False  # compute the target's features inside the loop
    conversations: str = "sharegpt"  # online: the conversation source
    num_conversations: int = 2000  # online
    skip_conversations: int = 0  # online: start this far into the training split
    max_len: int = 2048  # online: tokens per sample
    template: str | None = None  # online: chat template for a tokenizer without one
    epochs: int = 20
    max_steps: int | None = None  # optimizer steps of the schedule (default: from epochs)
    batch_size: int = 4  # sequences per process per micro-batch
    grad_accum: int = 8  # global batch = batch_size x grad_accum x processes (reference 32)
    lr: float = 2e-4
    warmup_steps: int = 200
    grad_clip: float = 0.5
    noise: float = 0.2  # uniform feature noise scale
    # where the noise is drawn: "cpu", "device", or None: by the device (train.noise_device)
    noise_on: str | None = None
    ploss_fraction: float = 1.0  # positions whose ploss is scored (1.0 = the reference)
    draft_vocab: int = 0  # reduced draft vocabulary size (0 = the target's whole vocabulary)
    # Gumiho's MLP heads train on vloss alone for this many epochs, then ploss joins
    # (reference: 2, chosen for ~20-epoch runs; a short run needs it lower)
    mlp_ploss_after_epochs: int = 2
    # the MLP heads' ploss weight (head i's is this times 0.8^(i+1)); reference 0.1 / 9
    mlp_ploss_weight: float = 0.1 / 9
    # the serial step's ploss weight against its vloss's 1.0; reference 0.1
    ploss_weight: float = 0.1
    # Gumiho: the MLP heads' losses train the heads alone (not the serial layers and fusion
    # layer whose outputs they read); the reference trains all of it on every loss
    mlp_detach: bool = False
    # Gumiho: train the MLP heads alone; the serial layers, fc and their losses stay out
    # (frozen, run without autograd): a drafter whose serial head is good and whose heads
    # are short gets them trained at a fraction of a whole step's cost
    heads_only: bool = False
    # Gumiho: serial step 2's vloss and ploss (on step 1's own output, as at inference)
    # join the loss at this weight times step 1's; the reference has none (0)
    serial2_weight: float = 0.0
    # a drafter checkpoint dir to start from (its weights and draft vocabulary) instead of
    # fresh weights; the optimizer and schedule start fresh
    init_from: str | None = None
    seed: int = 0
    export_dtype: str = "float16"
    # "bf16": bfloat16 autocast over fp32 weights, target in bfloat16; "fp32"; None: bf16
    # on a GPU, fp32 on a CPU (the default before the flag existed, so old runs resume)
    precision: str | None = None

    def check_flags_that_do_nothing(self) -> None:
        """Refuse a setting away from its default where this run would not read it."""
        spec = method_spec(self.method)
        unread = {}  # field -> why this run does not read it
        if not self.online:
            unread |= dict.fromkeys(("conversations", "num_conversations",
                                     "skip_conversations", "max_len", "template"),
                                    "it is for --online training (samples from --data are "
                                    "as the allocation made them)")
        if not spec.parallel_heads:
            unread |= dict.fromkeys(("mlp_detach", "mlp_ploss_weight",
                                     "mlp_ploss_after_epochs"),
                                    f"{self.method} drafters do not use it")
        if not spec.serial:  # Medusa's heads read the clean features, with one loss
            unread |= dict.fromkeys(("ploss_weight", "noise", "noise_on"),
                                    f"{self.method} drafters do not use it")
        defaults = {f.name: f.default for f in fields(self)}
        for name, why in unread.items():
            if getattr(self, name) != defaults[name]:
                raise GumihoError(f"--{name.replace('_', '-')}: {why}; leave it out")

    def __post_init__(self):
        if self.method not in DRAFTER_METHODS:
            raise GumihoError(f"--method {self.method}: use {', '.join(DRAFTER_METHODS[:-1])} "
                              f"or {DRAFTER_METHODS[-1]}")
        positive = {"--batch-size": self.batch_size, "--grad-accum": self.grad_accum,
                    "--epochs": self.epochs, "--num-conversations": self.num_conversations,
                    "--max-len": self.max_len}
        if self.max_steps is not None:
            positive["--max-steps"] = self.max_steps
        for flag, value in positive.items():
            if value < 1:
                raise GumihoError(f"{flag} must be at least 1 (got {value})")
        if not 0 < self.ploss_fraction <= 1:
            raise GumihoError("--ploss-fraction must be in (0, 1]")
        for flag, value in {"--lr": self.lr, "--grad-clip": self.grad_clip}.items():
            if not 0 < value < math.inf:  # NaN too (inf was an internal error in the step)
                raise GumihoError(f"{flag} must be positive and finite (got {value})")
        for flag, value in {"--warmup-steps": self.warmup_steps, "--noise": self.noise,
                            "--draft-vocab": self.draft_vocab,
                            "--mlp-ploss-after-epochs": self.mlp_ploss_after_epochs,
                            "--ploss-weight": self.ploss_weight,
                            "--mlp-ploss-weight": self.mlp_ploss_weight,
                            "--serial2-weight": self.serial2_weight,
                            "--skip-conversations": self.skip_conversations}.items():
            if not 0 <= value < math.inf:
                raise GumihoError(f"{flag} must be at least 0 and finite (got {value})")
        if self.heads_only and not method_spec(self.method).parallel_heads:
            raise GumihoError(f"--heads-only: {self.method} drafters have no MLP heads; only "
                              "gumiho's can train alone")
        if self.heads_only and self.serial2_weight > 0:
            raise GumihoError("--heads-only trains the MLP heads alone: --serial2-weight "
                              "would score the frozen serial step")
        if self.serial2_weight > 0 and not method_spec(self.method).parallel_heads:
            raise GumihoError(f"--serial2-weight: {self.method} drafters train one serial "
                              "step; only gumiho's loss has a serial step 2 to score")
        self.check_flags_that_do_nothing()
        if self.precision not in (None, "bf16", "fp32"):
            raise GumihoError(f"--precision {self.precision}: use bf16 or fp32")
        if self.noise_on not in (None, "cpu", "device"):
            raise GumihoError(f"--noise-on {self.noise_on}: use cpu or device")
        if bool(self.data) == self.online:
            raise GumihoError("give either --data DIR [DIR ...] or --online")
