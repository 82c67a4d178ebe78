"""Log-probabilities: each emitted token's under the target's own distribution, the same
whether it came from a one-token step or deep in an accepted draft path, and the same as
the model's forward over the whole answer gives."""

import torch

from gumiho.config import TreeConfig
from gumiho.engine import GenerateConfig, run

from conftest import REFERENCE_TOKENS as N
from drafters_for_tests import oracle_drafter


def forward_logprobs(target, prompt, answer):
    """log p(answer[i] | prompt + answer[:i]) from one forward over the whole sequence."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + answer], device=target.device)
        logits = target.model(ids).logits[0, len(prompt) - 1:-1].float()
        rows = torch.log_softmax(logits, -1)
    return rows.gather(1, torch.tensor(answer, device=rows.device)[:, None]).view(-1).tolist()


def close(got, want, tol=2e-4):
    return len(got) == len(want) and all(abs(a - b) <= tol for a, b in zip(got, want,
                                                                             strict=True))


def test_logprobs_are_the_targets_for_every_drafter(smollm2, reference):
    """Plain decoding, the shipped Gumiho drafter and an oracle drafter (most tokens from
    deep in accepted paths) give each token the log-probability the model's forward over
    the whole answer gives it (float32: equal to rounding)."""
    from gumiho import SpeculativeGenerator

    ids, full = reference[0], reference[1].token_ids
    want = forward_logprobs(smollm2, ids, full)
    assert all(-30 < lp <= 0 for lp in want) and min(want) < -0.01  # not all certain
    plain = SpeculativeGenerator.load(smollm2, "ar")
    out = plain.generate(ids, N, logprobs=True)
    assert out.token_ids == full and close(out.logprobs, want)
    gumiho = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                       total_tokens=8)
    out = gumiho.generate(ids, N, logprobs=True)
    assert out.token_ids == full and close(out.logprobs, want) and out.tau > 1.1
    oracle = oracle_drafter("gumiho", smollm2, ids + full, TreeConfig.for_method("gumiho"))
    out = run(smollm2, oracle, ids, GenerateConfig(max_new_tokens=N, logprobs=True))
    assert out.token_ids == full and close(out.logprobs, want) and out.tau > 4
    assert "logprobs" not in gumiho.generate(ids, 4).to_json()  # only when asked for
    assert gumiho.last_result.logprobs is None


def test_logprobs_are_the_raw_distributions_when_sampling_with_penalties(smollm2, reference):
    """At T = 0.8 with a repetition penalty and a stop string the log-probabilities are
    still the target's unprocessed ones (vLLM's default), one per kept token."""
    from gumiho import SpeculativeGenerator

    ids = reference[0]
    gumiho = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                       total_tokens=8)
    out = gumiho.generate(ids, 40, temperature=0.8, seed=5, repetition_penalty=1.3,
                          stop="\n", logprobs=True)
    assert close(out.logprobs, forward_logprobs(smollm2, ids, out.token_ids))
    assert out.tau > 1 and len(out.logprobs) == out.new_tokens


def forward_top(target, prompt, answer, k):
    """The k likeliest (id, log-probability) pairs at each answer position, one forward."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + answer], device=target.device)
        logits = target.model(ids).logits[0, len(prompt) - 1:-1].float()
        best = torch.log_softmax(logits, -1).topk(k, -1)
    return best.indices.tolist(), best.values.tolist()


def test_top_logprobs_are_the_targets_likeliest_at_each_position(smollm2, reference):
    """top_logprobs=5: at each position the model's five likeliest tokens, likeliest
    first, for plain decoding and an oracle drafter; the greedy token is the first, its
    log-probability `logprobs`' own; `logprobs` comes with it; JSON pairs."""
    from gumiho import SpeculativeGenerator

    ids, full = reference[0], reference[1].token_ids
    want_ids, want_values = forward_top(smollm2, ids, full, 5)
    oracle = oracle_drafter("gumiho", smollm2, ids + full, TreeConfig.for_method("gumiho"))
    plain = SpeculativeGenerator.load(smollm2, "ar").generate(ids, N, top_logprobs=5)
    fast = run(smollm2, oracle, ids, GenerateConfig(max_new_tokens=N, top_logprobs=5))
    assert fast.tau > 4
    for out in (plain, fast):
        assert out.token_ids == full and len(out.top_logprobs) == N
        got_ids = [[i for i, _ in row] for row in out.top_logprobs]
        got_values = [v for row in out.top_logprobs for _, v in row]
        # ties in float32 rounding could swap two ids: compare where the values are apart
        apart = [r for r, values in enumerate(want_values) if min(
            b - a for a, b in zip(values[1:], values[:-1], strict=True)) > 1e-3]
        assert len(apart) > N // 2
        assert all(got_ids[r] == want_ids[r] for r in apart)
        assert close(got_values, [v for row in want_values for v in row])
        assert [row[0][0] for row in out.top_logprobs] == full  # greedy: the likeliest
        assert [row[0][1] for row in out.top_logprobs] == out.logprobs
    record = plain.to_json()["top_logprobs"]
    assert record[0][0] == [full[0], plain.logprobs[0]]
    assert "top_logprobs" not in SpeculativeGenerator.load(smollm2, "ar").generate(
        ids, 2, logprobs=True).to_json()


def test_a_stream_of_cycles_is_the_answer_cycle_by_cycle(smollm2, reference):
    """stream(cycles=True): one Cycle per cycle whose tokens are what that cycle accepted
    (their counts the accept lengths after the prefill's), whose texts join to the answer's,
    and whose logprobs and top_logprobs are the whole answer's, cut where the tokens are;
    with a stop string the texts end before it, as a text stream's do."""
    from gumiho import SpeculativeGenerator
    from gumiho.generate import Cycle

    ids, full = reference[0], reference[1]
    gen = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                    total_tokens=8)
    whole = gen.generate(ids, N, top_logprobs=2)
    got = list(gen.stream(ids, N, top_logprobs=2, cycles=True))
    result = gen.last_result
    assert all(isinstance(c, Cycle) for c in got) and result.tau > 1.1
    tokens = [c.token_ids for c in got if c.token_ids]
    assert [len(t) for t in tokens] == result.accept_lengths
    assert sum(tokens, []) == whole.token_ids == full.token_ids
    assert "".join(c.text for c in got) == whole.text
    assert sum((c.logprobs for c in got if c.token_ids), []) == whole.logprobs
    assert sum((c.top_logprobs for c in got if c.token_ids), []) == whole.top_logprobs
    assert all(c.logprobs is None for c in gen.stream(ids, 4, cycles=True))

    stop = whole.text[30:34]
    texts = list(gen.stream(ids, N, stop=stop))
    cut = list(gen.stream(ids, N, stop=stop, cycles=True))
    assert "".join(c.text for c in cut) == "".join(texts) == gen.last_result.text
    assert sum((c.token_ids for c in cut), []) == gen.last_result.token_ids
