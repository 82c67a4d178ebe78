"""Loss masks cover exactly the assistant tokens, per template family (golden files).

SmolLM2's tokenizer is the only real one offline: the Llama-3, Llama-2-chat, Vicuna and
Gemma cases give it those families' special tokens and templates (written from their
published formats), so the masking logic meets each layout. (The Llama-3 stand-in's masks
start with one "\n": SmolLM2's BPE merges the header's "\n\n" with the reply; Llama-3's own
tokenizer has "\n\n" as a single token.)
"""

import copy
import json
from pathlib import Path

import pytest

from gumiho.ge_data.conversations import normalise, salvage_json_array
from gumiho.templates import tokenize_conversation, turn_end_token

from families import GEMMA_TEMPLATE

GOLDEN = Path(__file__).parent / "golden"
CHAT = [{"role": "user", "content": "Hi! What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "3+3 is 6. Anything else?"}]

LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
LLAMA2 = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<s>[INST] ' + m['content']"
          " + ' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' </s>'"
          " }}{% endif %}{% endfor %}")
FAMILIES = {"chatml": (None, []), "llama3": (LLAMA3, ["<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
            "llama2": (LLAMA2, ["<s>", "</s>"]), "vicuna": ("vicuna", ["<s>", "</s>"]),
            "gemma": (GEMMA_TEMPLATE, ["<bos>", "<start_of_turn>", "<end_of_turn>"])}
STOPS = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "llama2": "</s>", "vicuna": "</s>",
         "gemma": "<end_of_turn>"}


def family_tokenizer(smollm2, family):
    template, specials = FAMILIES[family]
    tok = copy.deepcopy(smollm2.tokenizer)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials})
    if family in ("llama2", "vicuna"):
        tok.bos_token, tok.eos_token = "<s>", "</s>"
    if family == "gemma":
        tok.bos_token = "<bos>"
    return tok, template


def masked_segments(tok, ids, mask):
    segments, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            segments.append(tok.decode(current))
            current = []
    if current:
        segments.append(tok.decode(current))
    return segments


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_mask_matches_golden(smollm2, family):
    tok, template = family_tokenizer(smollm2, family)
    stop = tok.convert_tokens_to_ids(STOPS[family])
    ids, mask = tokenize_conversation(tok, CHAT, 4096, frozenset({stop}), template)
    got = {"text": tok.decode(ids), "masked": masked_segments(tok, ids, mask)}
    golden = GOLDEN / f"mask_{family}.json"
    want = json.loads(golden.read_text())
    assert got == want


@pytest.mark.parametrize("family", FAMILIES)
def test_turn_end_token_is_read_from_the_template(smollm2, family):
    """The stop token that ends an assistant turn comes from rendering the template."""
    from gumiho.templates import TEMPLATES

    tok, template = family_tokenizer(smollm2, family)
    assert turn_end_token(tok, TEMPLATES.get(template, template)) == STOPS[family]


def test_mask_is_cut_by_max_len(smollm2):
    ids, mask = tokenize_conversation(smollm2.tokenizer, CHAT, 20,
                                      smollm2.stop_token_ids)
    assert ids.shape == mask.shape == (20,)


@pytest.mark.parametrize("family", ["chatml", "gemma"])
def test_cut_conversation_equals_the_whole_one_cut(smollm2, family):
    """Rendering stops at the turn that reaches max_len; the ids and mask are still the
    whole conversation's, cut (real ShareGPT conversations, some cut mid-turn, some in a
    user turn, some not at all)."""
    from gumiho.ge_data.conversations import load_conversations, split

    tok, template = family_tokenizer(smollm2, family)
    stops = frozenset({tok.convert_tokens_to_ids(STOPS[family])})
    conversations = split(load_conversations("sharegpt"))[0][:12]
    for conv in conversations:
        whole_ids, whole_mask = tokenize_conversation(tok, conv["messages"], 10**9, stops,
                                                      template)
        for max_len in (24, 200, 512):
            ids, mask = tokenize_conversation(tok, conv["messages"], max_len, stops, template)
            assert ids.tolist() == whole_ids[:max_len].tolist()
            assert mask.tolist() == whole_mask[:max_len].tolist()


def test_salvage_truncated_array():
    text = '[{"id": "a", "conversations": []}, {"id": "b"}, {"id": "c", "conv'
    assert [r["id"] for r in salvage_json_array(text)] == ["a", "b"]


def test_normalise_roles_and_alternation():
    rec = {"conversations": [{"from": "gpt", "value": "orphan"},
                             {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                             {"from": "human", "value": "dangling"}]}
    assert normalise(rec) == [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a"}]
    assert normalise({"conversations": [{"from": "gpt", "value": "x"}]}) is None
