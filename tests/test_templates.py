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

from gumiho import templates
from gumiho.errors import GumihoError
from gumiho.ge_data.conversations import normalise, salvage_json_array
from gumiho.templates import mask_by_characters, tokenize_conversation, turn_end_token

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
# a `--template` whose turns end in plain whitespace: SmolLM2's BPE makes the "\n\n" that
# ends a render one token, and two once the next turn follows, so its renders are prefixes
# of each other as text but not as tokens
WHITESPACE = ("{% for m in messages %}{% if m['role'] == 'user' %}"
              "{{ '### Human: ' + m['content'] + '\n\n' }}{% elif m['role'] == 'assistant' %}"
              "{{ '### Assistant: ' + m['content'] + '\n\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '### Assistant:' }}{% endif %}")
THREE = CHAT + [{"role": "user", "content": "Now 4+4, please."},
                {"role": "assistant", "content": "8.\n\nThat is all."}]
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


def test_whitespace_template_masks_each_reply(smollm2):
    """Each reply's tokens are masked, and the whitespace that ends it; nothing of the user
    turns or of "### Assistant:" is."""
    tok = smollm2.tokenizer
    ids, mask = tokenize_conversation(tok, THREE, 4096, smollm2.stop_token_ids, WHITESPACE)
    assert tok.decode(ids) == tok.apply_chat_template(THREE, tokenize=False,
                                                      chat_template=WHITESPACE)
    replies = [m["content"] for m in THREE if m["role"] == "assistant"]
    assert masked_segments(tok, ids, mask) == [f" {reply}\n\n" for reply in replies]


def test_whitespace_template_cut_equals_the_whole_one_cut(smollm2):
    """Every cut, one inside or at the end of the first reply too (where only one turn is
    rendered and nothing shows the template inconsistent), is the whole conversation's."""
    tok, stops = smollm2.tokenizer, smollm2.stop_token_ids
    whole_ids, whole_mask = tokenize_conversation(tok, THREE, 10**9, stops, WHITESPACE)
    for max_len in range(1, len(whole_ids) + 1):
        ids, mask = tokenize_conversation(tok, THREE, max_len, stops, WHITESPACE)
        assert ids.tolist() == whole_ids[:max_len].tolist(), max_len
        assert mask.tolist() == whole_mask[:max_len].tolist(), max_len


def test_template_inconsistent_as_text_is_refused(smollm2):
    counting = "{{ messages | length }}" + WHITESPACE  # each render starts otherwise
    with pytest.raises(GumihoError, match="not prefix-consistent"):
        tokenize_conversation(smollm2.tokenizer, CHAT, 4096, smollm2.stop_token_ids, counting)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_consistent_templates_keep_the_token_masks(smollm2, family, monkeypatch):
    """The golden masks come from the token differences, never from characters."""
    def refuse(*args):
        raise AssertionError("masked by characters")

    monkeypatch.setattr(templates, "mask_by_characters", refuse)
    test_loss_mask_matches_golden(smollm2, family)


def test_characters_mask_chatml_as_tokens_do(smollm2):
    """On real ShareGPT conversations under ChatML the character spans give the token
    spans' ids and masks, cut or not."""
    from gumiho.ge_data.conversations import load_conversations, split

    tok, stops = smollm2.tokenizer, smollm2.stop_token_ids
    for conv in split(load_conversations("sharegpt"))[0][:12]:
        for max_len in (24, 512, 10**9):
            ids, mask = tokenize_conversation(tok, conv["messages"], max_len, stops)
            by_chars = mask_by_characters(tok, conv["messages"], max_len, stops, None)
            assert ids.tolist() == by_chars[0].tolist()
            assert mask.tolist() == by_chars[1].tolist()


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
