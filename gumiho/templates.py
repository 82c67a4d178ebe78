"""Chat templating with a loss mask exactly on the assistant's tokens.

The target tokenizer's own chat template is used; templates for models without one (e.g.
Vicuna, the fschat `vicuna_v1.1` format) are written here. Loading a target reads them
(`--chat-template`, and the token that ends a turn is a stop token), and so does data
generation. The mask covers each assistant
reply and the token that ends it, and nothing of the template's glue after that token.
"""

from __future__ import annotations

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
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=TEMPLATES.get(template, template))
    except Exception as exc:  # noqa: BLE001 - Jinja errors of a user's template
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise GumihoError(f"the chat template fails ({type(exc).__name__}: {first}): fix "
                          "--template, or use --template vicuna") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    ends where its turns end. Rendering stops at the first turn that reaches `max_len`
    tokens (each render is tokenised whole, so a long conversation cost its length times
    its number of turns); the result is the whole conversation's, cut to `max_len`.
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
            ids = before if len(before) >= max_len else None
            break
        through = render(tokenizer, messages[: i + 1], False, template)
        spans.append((start, through))
        if len(through) >= max_len:
            ids = through
            break
    if ids is None:
        ids = render(tokenizer, messages, False, template)
    mask = torch.zeros(len(ids), dtype=torch.long)
    for start, through in spans:
        if through != ids[: len(through)] or start > len(through):
            raise GumihoError("the chat template is not prefix-consistent; cannot mask turns")
        stops = [j for j in range(start, len(through)) if ids[j] in stop_token_ids]
        mask[start : (stops[0] + 1 if stops else len(through))] = 1
    return torch.tensor(ids[:max_len]), mask[:max_len]


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
