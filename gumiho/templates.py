"""Chat templating with a loss mask exactly on the assistant's tokens.

The target tokenizer's own chat template is used; templates for models without one (e.g.
Vicuna, the fschat `vicuna_v1.1` format) are written here. Loading a target reads them
(`--chat-template`, and the token that ends a turn is a stop token), and so does data
generation. The mask covers each assistant
reply and the token that ends it, and nothing of the template's glue after that token
(a template that ends turns with no special token, only whitespace: the reply and that
whitespace).
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from gumiho.errors import GumihoError

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's "
                 "questions.")
# fschat's vicuna_v1.1 layout: "SYSTEM USER: q ASSISTANT: a</s>USER: ..."
VICUNA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}" + VICUNA_SYSTEM + "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ ' USER: ' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ASSISTANT: ' + m['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ ' ASSISTANT:' }}{% endif %}"
)
TEMPLATES = {"vicuna": VICUNA_TEMPLATE}


def render(tokenizer, messages: list[dict], add_generation_prompt: bool,
           template: str | None) -> list[int]:
    text = render_text(tokenizer, messages, add_generation_prompt, template)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool,
                template: str | None) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=TEMPLATES.get(template, template))
    except Exception as exc:  # noqa: BLE001 - Jinja errors of a user's template
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise GumihoError(f"the chat template fails ({type(exc).__name__}: {first}): fix "
                          "--template, or use --template vicuna") from None


def check_template_writes_messages(tokenizer, template: str) -> None:
    """--template is a known name or a Jinja template that writes out each message's
    content (a mistyped name is Jinja too, one that renders itself: no sample would
    come of any conversation)."""
    name = f"--template {template[:60]!r}"
    if template not in TEMPLATES and "{{" not in template and "{%" not in template:
        raise GumihoError(f"{name} is not a template: use one of {', '.join(TEMPLATES)}, or "
                          "give a Jinja chat template string")
    user, reply = "Zq7Xw9Kv", "Vb3Nm8Lp"
    chat = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    text = tokenizer.decode(render(tokenizer, chat, False, template))
    if user not in text or reply not in text:
        raise GumihoError(f"{name} does not write out the messages' content: fix the "
                          "template, or use --template vicuna")


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int,
                          stop_token_ids: frozenset[int], template: str | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (L,) and loss_mask (L,) with L <= max_len; mask = assistant tokens.

    Each assistant span is the difference between the conversation rendered up to that
    turn and the same with the generation prompt, cut after the first stop token in it.
    The template's own end-of-turn token counts as a stop token too, so any layout's mask
    ends where its turns end. Rendering stops at the first turn that goes past `max_len`
    tokens (each render is tokenised whole, so a long conversation cost its length times
    its number of turns); the result is the whole conversation's, cut to `max_len`. (Past,
    not up to: the kept tokens are then followed by more text in their render, as in the
    whole conversation, whose tokens may differ at a render's very end.)

    A template whose renders are prefixes of each other as text but not as tokens (turns
    that end in plain whitespace: BPE tokenises "\n\n" at the end of a text otherwise than
    before the next turn) is masked by characters instead: `mask_by_characters`.
    """
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise GumihoError("this tokenizer has no chat template: pass --template vicuna "
                          "(or a Jinja template string)")
    end = turn_end_token(tokenizer, TEMPLATES.get(template, template))
    if end is not None:
        stop_token_ids = stop_token_ids | {tokenizer.convert_tokens_to_ids(end)}
    spans = []  # (start, render through the turn) of each assistant turn rendered
    ids = None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(tokenizer, messages[:i], True, template))
        if start >= max_len:  # this turn and the rest lie past the cut
            before = render(tokenizer, messages[:i], False, template)
            ids = before if len(before) > max_len else None
            break
        through = render(tokenizer, messages[: i + 1], False, template)
        spans.append((start, through))
        if len(through) > max_len:
            ids = through
            break
    if ids is None:
        ids = render(tokenizer, messages, False, template)
    mask = torch.zeros(len(ids), dtype=torch.long)
    for start, through in spans:
        if through != ids[: len(through)] or start > len(through):
            return mask_by_characters(tokenizer, messages, max_len, stop_token_ids, template)
        mark_reply(mask, ids, start, len(through), stop_token_ids)
    return torch.tensor(ids[:max_len]), mask[:max_len]


def mark_reply(mask: torch.Tensor, ids: list[int], start: int, end: int,
               stop_token_ids: frozenset[int]) -> None:
    """Mask a reply's tokens ids[start:end], cut after the first stop token among them."""
    stops = [j for j in range(start, end) if ids[j] in stop_token_ids]
    mask[start : (stops[0] + 1 if stops else end)] = 1


def mask_by_characters(tokenizer, messages: list[dict], max_len: int,
                       stop_token_ids: frozenset[int], template: str | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokenize_conversation` for a template prefix-consistent as text only: each reply is
    the characters from the end of the text rendered with the generation prompt to the end
    of the text rendered through the turn, and its tokens are those of the whole
    conversation's tokenisation (cut to `max_len`) that start inside it (fast-tokenizer
    offsets), cut after the first stop token as there.

    A token straddling a boundary goes with the side it starts on: one starting in the
    generation prompt is the prompt's (at inference the prompt's own tokens are given), one
    starting in the reply and running into the template's glue is the reply's (what ends
    the reply). The whole conversation is rendered once: a render stopped at `max_len`
    ends in tokens the following text would change.
    """
    refused = GumihoError("the chat template is not prefix-consistent; cannot mask turns")
    if not getattr(tokenizer, "is_fast", False):
        raise refused  # offsets need a fast (Rust) tokenizer
    text = render_text(tokenizer, messages, False, template)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"][:max_len]
    starts = [start for start, _ in encoded["offset_mapping"][:max_len]]  # non-decreasing
    mask = torch.zeros(len(ids), dtype=torch.long)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_text(tokenizer, messages[:i], True, template)
        first = bisect_left(starts, len(prompt))  # the reply's first token
        if first >= len(ids):  # this turn and the rest lie past the cut
            break
        through = render_text(tokenizer, messages[: i + 1], False, template)
        if not (through.startswith(prompt) and text.startswith(through)):
            raise refused
        end = bisect_left(starts, len(through))  # one past the reply's last token
        mark_reply(mask, ids, first, end, stop_token_ids)
    return torch.tensor(ids), mask


def turn_end_token(tokenizer, template: str | None = None) -> str | None:
    """The special token a chat template writes right after an assistant reply (the end of a
    turn: e.g. `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), or None.

    Found by rendering a one-exchange chat with a marker reply, not from a list of names."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    marker = "Zq7Xw9Kv"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False, chat_template=template)
    except (TemplateError, ValueError, KeyError, TypeError, IndexError):
        return None  # a template may reject this probe (e.g. one that needs a system turn)
    after = text.split(marker, 1)[-1].lstrip() if marker in text else ""
    specials = set(tokenizer.all_special_tokens) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
        if getattr(t, "special", False)}
    return next((t for t in sorted(specials, key=len, reverse=True)
                 if t and after.startswith(t)), None)
