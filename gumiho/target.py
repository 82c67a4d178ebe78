"""Load a target model (a local Hugging Face dir or an embedded alias) and run it.

The target is always a stock `AutoModelForCausalLM`: we never vendor its modeling code.
Tree verification drives it through 4D attention masks (one per kind of layer, see
kv_cache.py), explicit position ids and a preallocated cache. Whatever the model family does
around its decoder stack we reproduce from its config, never from its name: a logit scale
(`logits_scaling`, `logit_scale`) and a final softcap (`final_logit_softcapping`) are applied
to every logit we compute (`LogitForm`), and a scaled token embedding is what a drafter
copies (`input_embeddings`). Loading checks the first by comparing our logits with the
model's own forward on a few tokens, so a family that does something else there is refused
rather than sampled wrongly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from gumiho.attention import SDPA_GQA, SDPA_INVARIANT, use_grouped_sdpa
from gumiho.embedded import EMBEDDED, SMOLLM2_ALIAS
from gumiho.errors import GumihoError
from gumiho.fused import FusedDecoder
from gumiho.kv_cache import attention_kinds
from gumiho.linear import (
    LogitForm,
    PackedHead,
    pack_linears,
    pack_weight,
    unpack_linears,
    vocab_linear,
)
from gumiho.templates import TEMPLATES, turn_end_token

log = logging.getLogger("gumiho")

# Chat end markers of common families; whichever exist in a vocabulary stop generation.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>")
# Attention implementations a user may ask for (sdpa becomes SDPA_GQA by itself), and all
# those that take an arbitrary 4D mask (the tree mask).
ATTENTION_CHOICES = ("sdpa", "eager", SDPA_INVARIANT)
MASKED_ATTENTION = (*ATTENTION_CHOICES, SDPA_GQA)


class FormedHead(torch.nn.Module):
    """lm_head followed by the family's LogitForm (scale, softcap), as the model's own
    forward applies it (so p, greedy picks and training targets are the model's)."""

    def __init__(self, head: torch.nn.Module, form: LogitForm):
        super().__init__()
        self.head, self.form = head, form

    @property
    def weight(self) -> Tensor:
        return self.head.weight

    @property
    def bias(self) -> Tensor | None:
        return getattr(self.head, "bias", None)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.form(self.head(hidden))


@dataclass
class Target:
    """A frozen causal LM with its tokenizer, device, dtype and stop tokens."""

    model: torch.nn.Module
    tokenizer: object | None
    name: str
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    # The loop's TargetRunner per engine (engine.target_runner): its KV cache and captured
    # steps are bound to this model, so they live as long as the target does.
    runners: dict = field(default_factory=dict, repr=False, compare=False)
    # The stream now driving those caches, of whichever generator sharing this target
    # (SpeculativeGenerator._run): a newer call supersedes it.
    stream_owner: object | None = field(default=None, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.model.config.get_text_config().hidden_size

    @cached_property
    def lm_head(self) -> torch.nn.Module:
        """hidden (..., H) -> logits (..., V), the family's LogitForm included."""
        head = self.model.get_output_embeddings()
        return head if self.logit_form.identity else FormedHead(head, self.logit_form)

    @cached_property
    def logit_form(self) -> LogitForm:
        return LogitForm.of(self.config)

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @torch.no_grad()
    def input_embeddings(self) -> Tensor:
        """(V, H): every token's embedding as the decoder reads it, i.e. with any scale the
        embedding module applies (sqrt(H) in some families). A drafter copies this."""
        ids = torch.arange(self.embed_tokens.weight.shape[0], device=self.device)
        return self.embed_tokens(ids)

    @cached_property
    def _layer_kinds(self) -> tuple[str, ...]:
        return attention_kinds(self.config.get_text_config(decoder=True))[1]

    def _decoder_masks(self, attention_mask: Tensor):
        """Our (M, 1, K, capacity) bool masks in the form the decoder takes: one 4D mask, or
        a dict by layer type when full and sliding layers are mixed. Additive floats for
        eager attention (it adds the mask to the scores) and for sdpa, whose kernels would
        otherwise turn a bool mask into the same 0 / -inf floats in every layer (a kernel
        per layer per step on a GPU; here once a step). The row-invariant attention reads
        bool masks."""
        implementation = self.config._attn_implementation
        if implementation in ("eager", "sdpa", SDPA_GQA):
            dtype = self.dtype
            hidden = torch.finfo(dtype).min if implementation == "eager" else float("-inf")
            attention_mask = torch.full(attention_mask.shape, hidden, dtype=dtype,
                                        device=attention_mask.device).masked_fill(
                attention_mask, 0.0)
        if attention_mask.shape[0] == 1:
            return attention_mask
        return {kind: m[None] for kind, m in zip(self._layer_kinds, attention_mask, strict=True)}

    @torch.no_grad()  # not inference_mode: compiled steps reject inference tensors
    def forward(
        self, input_ids: Tensor, position_ids: Tensor, cache, attention_mask: Tensor | None = None,
        last_logits: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Run the target on new tokens on top of `cache`.

        input_ids, position_ids: (1, K). attention_mask: (M, 1, K, cache capacity) bool, one
        mask per kind of layer (`KVCache.attention_mask`), or None (causal). Returns features
        (K, H), the last-layer hidden states after the final norm (what the lm_head reads,
        `f_t` in the paper), and logits (K, V) in float32; with `last_logits`, those of the
        last token only (1, V): a prompt needs no more, and the whole prompt's would cost a
        vocabulary-sized product per token (as Hugging Face `generate` avoids too).
        """
        if self._fused is not None and attention_mask is not None and cache is not None:
            features = self._fused(input_ids, position_ids, cache, attention_mask,
                                   self._decoder_masks)[0]
        else:
            if attention_mask is not None:
                attention_mask = self._decoder_masks(attention_mask)
            features = self.model.get_decoder()(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state[0]  # (K, H)
        return features, self.logits(features[-1:] if last_logits else features)

    @cached_property
    def _fused(self) -> FusedDecoder | None:
        """The decoder in fewer operations, the same bits (fused.py), where it applies: a
        Llama target on the CPU. Made on first use, after `load_target` packed the layers."""
        return FusedDecoder.of(self.model)

    @cached_property
    def _packed_head(self) -> PackedHead | None:
        """A plain linear lm_head prepared once for the CPU (bf16: oneDNN's reordered copy
        and rowamx.c's tiles, `pack_weight`), else None."""
        head = self.model.get_output_embeddings()
        return pack_weight(head.weight) if type(head) is torch.nn.Linear else None

    def unpack(self) -> int:
        """Undo the CPU packing of the layers and the lm_head (for torch.compile, whose
        inductor cannot lower the packed products; or to compare); returns how many layers
        went back to `nn.Linear`."""
        self.__dict__["_packed_head"] = None  # the cached properties, settled to "none"
        self.__dict__["_fused"] = None  # (its joined copies of the layers are packed too)
        return unpack_linears(self.model)

    def logits(self, hidden: Tensor) -> Tensor:
        """lm_head(hidden) in float32, the LogitForm included; a plain linear head goes
        through `vocab_linear` (fast at every row count on the CPU, linear.py)."""
        head = self.model.get_output_embeddings()
        logits = vocab_linear(hidden, head.weight, head.bias, self._packed_head) \
            if type(head) is torch.nn.Linear else head(hidden)
        return self.logit_form(logits).float()

    @torch.no_grad()  # not inference_mode: online training keeps them for backward
    def features(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Post-norm last hidden states (B, L, H) of whole sequences, no cache; ids (and the
        mask) on any device, the result on the target's."""
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        out = self.model.get_decoder()(input_ids=input_ids.to(self.device),
                                       attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state

    def chat_ids(self, messages: list[dict] | str) -> list[int]:
        """Token ids of a chat (a prompt string is one user turn) ready for the reply."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not messages or not any(m.get("content", "").strip() for m in messages):
            raise GumihoError("empty prompt: give some text to answer")
        for m in messages:
            check_unicode(m.get("content", ""))
        if self.tokenizer is None:
            raise GumihoError(f"target {self.name} has no tokenizer: pass token ids instead")
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return templated_ids(self.tokenizer, messages)
            except Exception as exc:  # noqa: BLE001 - Jinja errors of a user's template
                raise GumihoError(f"the chat template of {self.name} fails on this prompt "
                                  f"({type(exc).__name__}: {_first_line(exc)}): fix it or "
                                  "pass --chat-template") from None
        text = "\n".join(m["content"] for m in messages)
        return self.tokenizer(text)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""


def check_unicode(text: str) -> None:
    """Text a tokenizer can take: no lone surrogate (what undecodable bytes, or a JSON
    escape such as \\udce9, turn into), which tokenizers refuse with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GumihoError(f"the prompt is not valid Unicode text: {exc.reason} at character "
                          f"{exc.start} ({text[exc.start]!a})") from None


def choose_device_dtype(
    device: str | None = None, dtype: str | None = None
) -> tuple[torch.device, torch.dtype]:
    """Decide device and dtype once. Unset, the device is $GUMIHO_DEVICE if set, else an
    accelerator if there is one, else the CPU; the dtype $GUMIHO_DTYPE if set, else bf16 on
    an accelerator and fp32 on a CPU. A bad value is one line that names where it came
    from (the environment variable, when that set it)."""
    from_env = device is None and bool(os.environ.get("GUMIHO_DEVICE"))
    if device is None:  # ROCm reports as cuda too
        device = os.environ.get("GUMIHO_DEVICE") or (
            "cuda" if torch.cuda.is_available() else "cpu")
    dev = check_device(device, "GUMIHO_DEVICE" if from_env else "--device")
    dtype_from_env = dtype is None and bool(os.environ.get("GUMIHO_DTYPE"))
    if dtype is None:
        dtype = os.environ.get("GUMIHO_DTYPE") or None
    if dtype is None:
        torch_dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    elif dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch_dtype = dtype
    else:
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if isinstance(dtype, torch.dtype):
            raise GumihoError(f"unsupported dtype {dtype}: use torch.float32, torch.bfloat16 "
                              "or torch.float16")
        if not isinstance(dtype, str):
            raise TypeError(f"dtype must be one of {', '.join(names)} or a torch dtype, got "
                            f"{dtype!r} ({type(dtype).__name__})")
        if dtype not in names:
            raise GumihoError(f"unknown dtype {dtype!r}"
                              f"{' (from GUMIHO_DTYPE)' if dtype_from_env else ''}: use one "
                              f"of {', '.join(names)}")
        torch_dtype = names[dtype]
    return dev, torch_dtype


def check_device(device: str | torch.device, flag: str = "--device") -> torch.device:
    """A torch device that exists here, or one line saying what to use instead. flag: where
    the name came from, "--device" or an environment variable (GUMIHO_DEVICE)."""
    env = not flag.startswith("-")
    source = f" (from {flag})" if env else ""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GumihoError(f"unknown device {device!r}{source}: use cpu, cuda, cuda:N or "
                          "mps") from None
    available = {"cpu": lambda: True, "cuda": torch.cuda.is_available,
                 "mps": torch.backends.mps.is_available,
                 "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}
    if dev.type not in available:
        raise GumihoError(f"unsupported device {device!r}{source}: use cpu, cuda, cuda:N or "
                          "mps")
    named = f"{flag}={device}" if env else f"{flag} {device}"
    if not available[dev.type]():
        fix = (f"set {flag}=cpu, or unset it" if env else f"use {flag} cpu, or leave {flag} "
               "out")
        raise GumihoError(f"{named}: no {dev.type} device is available here ({fix} to pick "
                          "automatically)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise GumihoError(f"{named}: only {torch.cuda.device_count()} CUDA "
                          f"device(s) here (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return dev


def resolve_target_path(name_or_path: str) -> Path:
    if name_or_path in EMBEDDED:
        return EMBEDDED[name_or_path]()
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise GumihoError(
            f"target {name_or_path!r}: not a local model directory with config.json "
            f"(give a local Hugging Face model dir or one of the aliases "
            f"{', '.join(EMBEDDED)}; nothing is downloaded from the hub)"
        )
    return path


def target_config(target: str):
    """The target's text config, read without loading its weights."""
    from transformers import AutoConfig

    path = resolve_target_path(target)
    try:
        config = AutoConfig.from_pretrained(path).get_text_config()
    except Exception as exc:  # noqa: BLE001 - garbage or unsupported config.json
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise GumihoError(f"target {target!r}: cannot read its config.json "
                          f"({type(exc).__name__}: {first})") from None
    if not isinstance(getattr(config, "hidden_size", None), int):
        raise GumihoError(f"target {target!r}: its config has no hidden_size (not a causal "
                          "LM config?)")
    return config


def default_attention(path: Path) -> str:
    """sdpa, unless the model softcaps its attention scores, which only eager computes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def load_target(name_or_path: str = SMOLLM2_ALIAS, device: str | None = None,
                dtype: str | None = None, chat_template: str | None = None,
                attn_implementation: str | None = None) -> Target:
    """Load a frozen target model and tokenizer from a local dir or an embedded alias.
    chat_template: 'vicuna' or a Jinja string, for tokenizers without their own.
    attn_implementation: one of ATTENTION_CHOICES (sdpa or eager: both take tree masks;
    sdpa_invariant: a CPU verify's rows each as in one-token decoding, attention.py);
    default `default_attention`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    for name, value in (("chat_template", chat_template), ("attention", attn_implementation)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    if attn_implementation is not None and attn_implementation not in ATTENTION_CHOICES:
        raise GumihoError(f"attention implementation {attn_implementation!r} takes no tree "
                          f"mask; load it with one of {', '.join(ATTENTION_CHOICES)}")
    path = resolve_target_path(name_or_path)
    dev, torch_dtype = choose_device_dtype(device, dtype)
    log.info("target %s on %s in %s", name_or_path, dev, torch_dtype)
    hf_logging.disable_progress_bar()  # a sub-second weight load needs no bar
    try:
        attn = attn_implementation or default_attention(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                     attn_implementation=attn)
    except (ValueError, KeyError, OSError) as exc:
        raise GumihoError(f"target {name_or_path!r} is not a supported causal LM: "
                          f"{_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - truncated/garbage weight files fail in many ways
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            raise
        fix = (f"delete {path} to convert it again" if name_or_path in EMBEDDED
               else "are its files complete?")
        raise GumihoError(f"cannot load the weights of target {name_or_path!r} from {path} "
                          f"({type(exc).__name__}: {_first_line(exc)}): {fix}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False)
    except Exception as exc:  # noqa: BLE001 - missing or garbage tokenizer files
        raise GumihoError(f"target {name_or_path!r} has no usable tokenizer in {path} "
                          f"({type(exc).__name__}: {_first_line(exc)}): copy the model's "
                          "tokenizer files (tokenizer.json, tokenizer_config.json) into it"
                          ) from None
    if chat_template:
        tokenizer.chat_template = TEMPLATES.get(chat_template, chat_template)
    target = wrap_target(model.to(dev).eval(), tokenizer, name=name_or_path)
    # on the CPU: layers reordered once for oneDNN (bf16) or MKL (fp32) (linear.py); the
    # lm_head stays, the drafters' heads and the logits read its weight
    packed = pack_linears(model, skip=(model.get_output_embeddings(),))
    if packed:
        log.info("packed %d %s projections for the CPU", packed, target.dtype)
    if chat_template:  # a broken template fails here, in one line that names the flag
        check_template(target, chat_template)
    return target


def templated_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of `messages` through the tokenizer's chat template, ready for the
    reply (the template's own errors raised as they are)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def check_template(target: Target, template: str) -> None:
    """A user's --chat-template renders a one-message chat to some tokens, or one line
    that names it (not the target's own template, nor "empty prompt")."""
    name = f"--chat-template {template[:60]!r}"
    try:
        ids = templated_ids(target.tokenizer, [{"role": "user", "content": "Hello"}])
    except Exception as exc:  # noqa: BLE001 - Jinja errors of a user's template
        raise GumihoError(f"{name} fails on a prompt ({type(exc).__name__}: "
                          f"{_first_line(exc)}): fix the template") from None
    if not ids:
        raise GumihoError(f"{name} renders a prompt as no tokens: it must write out the "
                          "messages' content")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def wrap_target(model: torch.nn.Module, tokenizer=None, name: str = "model") -> Target:
    """Freeze a loaded causal LM and collect its stop tokens: the generation config's
    eos_token_id (an int or a list), the tokenizer's eos, the token the chat template puts
    after an assistant reply, and known chat end markers among its named special tokens."""
    attn = model.config._attn_implementation
    if attn not in MASKED_ATTENTION:
        raise GumihoError(f"target {name}: attention implementation {attn!r} takes no tree "
                          f"mask; load it with one of {', '.join(MASKED_ATTENTION)}")
    attention_kinds(model.config.get_text_config(decoder=True))  # refuse unsupported layers
    model.requires_grad_(False)
    use_grouped_sdpa(model)  # same attention without copying grouped KV heads (attention.py)
    stops: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(
        model, "generation_config") else None
    stops.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        # Only as the tokenizer's named special tokens: "</s>" is an ordinary control
        # piece in some vocabularies.
        named = set(tokenizer.all_special_tokens)
        stops.update(vocab[t] for t in CHAT_END_TOKENS if t in vocab and t in named)
        end = turn_end_token(tokenizer)
        if end is not None:
            stops.add(vocab[end])
    target = Target(model=model, tokenizer=tokenizer, name=name,
                    stop_token_ids=frozenset(stops))
    check_logit_form(target)
    return target


@torch.inference_mode()
def check_logit_form(target: Target) -> None:
    """Refuse a target whose own forward does to its logits what `LogitForm` does not (a
    family with another transform after its lm_head): our logits would be off, greedy picks
    could survive a positive scale unnoticed while sampling and log-probabilities would not.
    Compares the two on four tokens (one small forward each)."""
    ids = torch.arange(1, 5, device=target.device)[None] % target.config.get_text_config(
        ).vocab_size
    theirs = target.model(input_ids=ids, use_cache=False).logits[0].float()
    ours = target.lm_head(target.features(ids)[0]).float()
    if not (torch.isfinite(theirs).all() and torch.isfinite(ours).all()):
        # not a logit transform of the family's: e.g. Gemma's activations overflow float16
        dtype = str(target.dtype).removeprefix("torch.")
        why = (f"its activations overflow {dtype}: load it in bfloat16 or float32 (--dtype)"
               if target.dtype == torch.float16 else "are its weights finite?")
        raise GumihoError(f"target {target.name}: its logits in {dtype} are not finite (inf "
                          f"or NaN) on a 4-token probe: {why}")
    error, size = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    if not error <= 0.05 * size + 1e-3:  # rounding is ~1% of the largest logit in bf16
        raise GumihoError(
            f"target {target.name}: its forward's logits are not its lm_head's output under "
            f"{target.logit_form} (largest difference {error:.3g}, logits up to {size:.3g}): "
            "its family transforms its logits in a way this package does not reproduce")
