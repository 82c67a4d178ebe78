"""Which tokens end an answer: `stop_token_ids` (more ids that end it), `ignore_eos` (the
target's own stop tokens do not) and `min_tokens` (none of them before the answer is that
long), each as transformers' `generate` (eos_token_id, min_new_tokens) ends the answer,
for plain decoding and drafters that accept several tokens a cycle."""

import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.engine import GenerateConfig, run
from gumiho.errors import GumihoError
from gumiho.penalty import MinTokens, penalties
from gumiho.tree import DraftTree

from drafters_for_tests import oracle_drafter

# SmolLM2 answers it in 8 tokens ("The capital of France is Paris."), its stop token
# last; kept from ending there, it goes on and ends by itself at 43 tokens
PROMPT = "What is the capital of France?"
LONG = 48


@pytest.mark.host
@pytest.mark.parametrize("count", [0, 2, 3, 5])
def test_min_tokens_masks_each_tree_row_by_its_depth(count):
    """Row i predicts the answer's token `count + depth(i)`: its stop-token logits are
    -inf exactly where that falls short of the minimum; everything else keeps its bits.
    The next-token and the drafters' logits are masked while the answer is short."""
    tokens = torch.tensor([7, 3, 5, 9, 7, 3, 11])  # depths 0, 1, 1, 2, 2, 3, 2
    tree = DraftTree.from_parents(tokens, torch.tensor([-1, 0, 0, 1, 1, 3, 2]))
    depths = [0, 1, 1, 2, 2, 3, 2]
    part = MinTokens(4, [2, 13, 99], 16, torch.device("cpu"))  # 99: outside, left out
    part.add(torch.zeros(count, dtype=torch.long))
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(0)) * 3
    got = part.rows(logits, tree.tokens, tree.verify_mask)
    for i, depth in enumerate(depths):
        masked = count + depth < 4
        for v in range(16):
            want = float("-inf") if masked and v in (2, 13) else logits[i, v]
            assert got[i, v] == want, (i, v)
    assert not torch.equal(got, logits) or count >= 4
    short = count < 4
    assert (part.last(logits[:1])[0, 13] == float("-inf")) == short
    ids = torch.tensor([5, 13, 0, 2])  # a draft vocabulary: draft id -> target id
    drafted = part.drafted(logits[:2, :4].clone(), ids)
    assert (drafted[:, [1, 3]] == float("-inf")).all().item() == short
    assert torch.equal(drafted[:, [0, 2]], logits[:2, [0, 2]])
    assert penalties(1.0, 0.0, 0.0, 16, torch.tensor([1]), 4, frozenset()) is None


@pytest.fixture(scope="module")
def france(smollm2):
    return smollm2.chat_ids(PROMPT)


def hf_greedy(target, ids, eos, max_new_tokens, **kwargs):
    """transformers' greedy answer with `eos` as its stop ids."""
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids], device=target.device),
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=sorted(eos), pad_token_id=0, **kwargs)
    answer = out[0, len(ids):].tolist()
    while len(answer) > 1 and answer[-1] == 0 and answer[-2] in eos:  # the padding
        answer.pop()
    return answer


def test_stop_ids_ignore_eos_and_min_tokens_are_transformers_generate(smollm2, france):
    """Plain decoding, prompt lookup, the shipped Gumiho drafter and an oracle drafter
    proposing the whole answer (whose cycles run through the masked stop token and past
    the minimum) each give transformers' greedy answer for each setting (with ignore_eos,
    min_tokens masking the target's stop tokens as vLLM's does: transformers' processor
    given them while generation ends at other ids)."""
    from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

    from gumiho import SpeculativeGenerator

    ids, stops = france, set(smollm2.stop_token_ids)
    natural = hf_greedy(smollm2, ids, stops, LONG)
    assert len(natural) == 8 and natural[-1] in stops
    period = natural[-2]  # "."
    never = smollm2.embed_tokens.weight.shape[0] - 1  # a token the answer does not hold
    cases = [  # (settings, transformers' eos and arguments, how it should end)
        ({"min_tokens": 8}, (stops, {"min_new_tokens": 8}), "stop_token"),
        ({"ignore_eos": True}, ({never}, {}), "max_new_tokens"),
        ({"stop_token_ids": [period]}, (stops | {period}, {}), "stop_token"),
        # vLLM's min_tokens under ignore_eos: the target's stop tokens are held off too
        ({"ignore_eos": True, "stop_token_ids": [period], "min_tokens": 10},
         ({period}, {"logits_processor": LogitsProcessorList([MinNewTokensLengthLogitsProcessor(
             len(ids), 10, sorted(stops | {period}), device=str(smollm2.device))])}),
         "stop_token"),
        ({"ignore_eos": True, "min_tokens": 20},
         ({never}, {"logits_processor": LogitsProcessorList([MinNewTokensLengthLogitsProcessor(
             len(ids), 20, sorted(stops), device=str(smollm2.device))])}), "max_new_tokens"),
    ]
    gens = {"ar": SpeculativeGenerator.load(smollm2, "ar"),
            "lookup": SpeculativeGenerator.load(smollm2, "lookup"),
            "gumiho": SpeculativeGenerator.load(smollm2, "gumiho",
                                                "gumiho/assets/smollm2/gumiho", total_tokens=8)}
    for settings, (eos, extra), how in cases:
        want = hf_greedy(smollm2, ids, eos, LONG, **extra)
        assert want != natural, settings
        for method, gen in gens.items():
            out = gen.generate(ids, LONG, **settings)
            assert out.token_ids == want, (method, settings)
            assert out.stopped_by == how, (method, settings)
        oracle = oracle_drafter("gumiho", smollm2, ids + want + [0] * 8,
                                TreeConfig.for_method("gumiho"))
        out = run(smollm2, oracle, ids, GenerateConfig(max_new_tokens=LONG, **settings))
        assert out.token_ids == want, settings
        assert out.cycles <= max(2, len(want) // 4), (settings, out.accept_lengths)
    # with min_tokens the masked stop token is where the answer would end: 8 -> 43
    assert len(hf_greedy(smollm2, ids, stops, LONG, min_new_tokens=8)) == 43


def test_a_sampled_answer_with_min_tokens_reaches_the_minimum(smollm2, france):
    """At T > 0 no answer ends before `min_tokens`, for plain decoding and a drafter."""
    from gumiho import SpeculativeGenerator

    for gen in (SpeculativeGenerator.load(smollm2, "ar"),
                SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                          total_tokens=8)):
        for seed in range(3):
            out = gen.generate(france, 24, temperature=1.0, seed=seed, min_tokens=12)
            assert out.new_tokens >= 12
            assert not set(out.token_ids[:11]) & set(smollm2.stop_token_ids)


@pytest.mark.host
def test_bad_stop_token_settings_are_refused():
    with pytest.raises(TypeError, match="stop_token_ids"):
        GenerateConfig(stop_token_ids=5)
    with pytest.raises(GumihoError, match="stop token id"):
        GenerateConfig(stop_token_ids=[3, -1])
    with pytest.raises(TypeError, match="ignore_eos"):
        GenerateConfig(ignore_eos="yes")
    with pytest.raises(GumihoError, match="min_tokens"):
        GenerateConfig(max_new_tokens=8, min_tokens=9)
    assert GenerateConfig(stop_token_ids=[4, 2]).stop_token_ids == (4, 2)
    with pytest.raises(GumihoError, match="logit_bias of token 3"):
        GenerateConfig(logit_bias={3: float("nan")})
    with pytest.raises(TypeError, match="logit_bias"):
        GenerateConfig(logit_bias=[1, 2])
    assert GenerateConfig(logit_bias={9: -1, 2: 5}).logit_bias == ((2, 5.0), (9, -1.0))


def test_a_stop_token_id_outside_the_vocabulary_is_refused(smollm2, france):
    from gumiho import SpeculativeGenerator

    gen = SpeculativeGenerator.load(smollm2, "ar")
    with pytest.raises(GumihoError, match="outside the vocabulary"):
        gen.stream(france, 8, stop_token_ids=[10**7])  # at the call, before any piece


def test_the_cli_flags(capsys, smollm2, france):
    """`gumiho generate --min-tokens/--ignore-eos/--stop-token-id` reach the loop."""
    import json

    from gumiho.generate import main

    natural = hf_greedy(smollm2, france, set(smollm2.stop_token_ids), LONG)
    base = ["--target", "smollm2", "--method", "lookup", "--prompt", PROMPT,
            "--max-new-tokens", str(LONG), "--json"]
    for flags, tokens, how in ((["--min-tokens", "8"], 43, "stop_token"),
                               (["--ignore-eos"], LONG, "max_new_tokens"),
                               (["--stop-token-id", str(natural[2])], 3, "stop_token"),
                               (["--logit-bias", f"{natural[-1]}=-100"], LONG,
                                "max_new_tokens")):
        assert main(base + flags) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["new_tokens"], result["stopped_by"]) == (tokens, how), flags


def test_a_recorded_engine_applies_min_tokens_and_a_logit_bias(smollm2, france):
    """The static engine (one recorded verify shape) gives the eager answer with
    min_tokens, a logit bias and top logprobs: they act on the logits leaving the step."""
    from gumiho import SpeculativeGenerator

    settings = {"min_tokens": 8, "logit_bias": {11: 3.0}}
    want = SpeculativeGenerator.load(smollm2, "ar").generate(france, LONG, **settings)
    gen = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                    total_tokens=8, engine="static")
    out = gen.generate(france, LONG, top_logprobs=2, **settings)
    assert out.token_ids == want.token_ids and len(want.token_ids) > 8
    assert out.tau > 1.5 and len(out.top_logprobs) == out.new_tokens
