"""The reduced draft vocabulary: EAGLE-3 buffers, restricted logits, checkpoints, and
output that stays exactly the target's (greedy and sampled)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from gumiho import rowgemm
from gumiho.checkpoint import load_drafter_model, save_drafter
from gumiho.config import TreeConfig
from gumiho.drafters import MedusaDrafter, random_drafter_model
from gumiho.engine import GenerateConfig, run
from gumiho.modeling import DraftHead, draft_vocabulary, vocab
from gumiho.modeling.vocab import draft_ids_of, vocab_buffers
from gumiho.serial_drafter import SerialDrafter
from gumiho.train.dataset import token_counts

from conftest import tiny_llama
from drafters_for_tests import OracleHead, oracle_drafter
from test_sampling import chi_square_rejects, exact_marginals


@pytest.mark.host
def test_token_counts_count_assistant_tokens_on_the_host():
    """Under another default device (a GPU suite runs tests inside `with torch.device`, a
    notebook may set one) the counts still come out on the host, beside the samples."""
    samples = [{"input_ids": torch.tensor([4, 2, 2, 7], dtype=torch.int32),
                "loss_mask": torch.tensor([0, 1, 1, 1], dtype=torch.uint8)},
               {"input_ids": torch.tensor([7, 9], dtype=torch.int32),
                "loss_mask": torch.tensor([1, 0], dtype=torch.uint8)}]
    with torch.device("meta"):
        counts = token_counts(samples, 8)  # ids past the vocabulary count as the last id
    assert counts.device.type == "cpu" and counts.tolist() == [0, 0, 2, 0, 0, 0, 0, 2]


@pytest.mark.host
def test_draft_vocabulary_takes_the_most_frequent_and_the_required():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    ids = draft_vocabulary(counts, 4, always=[6])
    assert ids.tolist() == [2, 3, 5, 6]  # increasing target ids; ties to the lower id
    d2t, t2d = vocab_buffers(ids, 8)
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()  # target = draft + d2t[draft]
    assert t2d.tolist() == [False, False, True, True, False, True, True, False]
    with pytest.raises(ValueError):
        draft_vocabulary(counts, 9)
    with pytest.raises(ValueError, match="stop tokens"):  # it could not hold both
        draft_vocabulary(counts, 1, always=[1, 6])


@pytest.mark.host
def test_coverage_counts_test_tokens_inside_the_chosen_vocabulary():
    from gumiho.evaluation.vocab_sizes import coverage

    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])  # draft vocabulary of 4: 2, 3, 5, 6
    test = torch.tensor([1, 1, 2, 0, 0, 4, 2, 0])  # 10 tokens, 8 of them in {2, 3, 5, 6}
    assert coverage(counts, test, 4, always=[6]) == pytest.approx(0.8)
    assert coverage(counts, test, 0, always=[]) == 1.0  # 0: the whole vocabulary


def test_draft_head_is_the_lm_heads_rows(smollm2):
    ids = torch.tensor([3, 17, 200, 4000, 49151])
    head = DraftHead(smollm2.lm_head, ids)
    hidden = torch.randn(2, 7, 576)
    torch.testing.assert_close(head(hidden), smollm2.lm_head(hidden)[..., ids])
    assert head.to_target(torch.tensor([0, 4])).tolist() == [3, 49151]
    draft, inside = head.to_draft(torch.tensor([17, 18, 49151]))
    assert draft[inside].tolist() == [1, 4] and inside.tolist() == [True, False, True]


def test_a_drafting_head_computes_from_16_bits(smollm2, monkeypatch):
    """A generation's head over a float32 CPU weight keeps a 16-bit copy and computes its
    logits from it: exactly the float32 product of the rounded weight (half the bytes a
    drafting pass reads). Training's head, and any product a gradient flows through, keep
    the float32 weight."""
    ids = torch.arange(0, 49152, 6)
    exact = DraftHead(smollm2.lm_head, ids)
    drafting = DraftHead(smollm2.lm_head, ids, drafting=True)
    assert exact.short is None
    if smollm2.device.type != "cpu" or rowgemm.kernel() is None:
        assert drafting.short is None  # a GPU's head is bf16 already; no kernel, no copy
        return
    assert drafting.short.weight.dtype == torch.float16
    assert drafting.short.weight.shape == exact.weight.shape
    hidden = torch.randn(5, 576)
    short = drafting(hidden)
    assert torch.equal(short, rowgemm.linear(hidden, drafting.short.weight.float()))
    assert torch.equal(drafting.logits(hidden, packed=False), exact(hidden))
    torch.testing.assert_close(short, exact(hidden), rtol=0, atol=0.05)  # 11 bits a weight
    assert not torch.equal(short, exact(hidden))  # (it is the copy that ran)
    monkeypatch.setattr(vocab, "available_memory", lambda: 2 * 2 * exact.weight.numel() - 2)
    assert DraftHead(smollm2.lm_head, ids, drafting=True).short is None  # no room for it
    monkeypatch.undo()
    monkeypatch.setenv("GUMIHO_DRAFT_HEAD16", "0")
    assert DraftHead(smollm2.lm_head, ids, drafting=True).short is None  # switched off


@pytest.mark.host
def test_a_drafting_copy_takes_the_16_bits_that_hold_the_weight():
    if rowgemm.kernel() is None:
        pytest.skip("rowgemm.c does not build here")
    weight = torch.randn(8, 16)
    assert rowgemm.drafting_copy(weight).weight.dtype == torch.float16
    wide = weight.clone()
    wide[3, 5] = 1e5  # past float16's range
    assert rowgemm.drafting_copy(wide).weight.dtype == torch.bfloat16
    held = weight.bfloat16().float()  # exactly 16-bit values: kept exactly
    assert torch.equal(rowgemm.drafting_copy(held).weight.float(), held)
    bias = torch.randn(8)
    x = torch.randn(2, 16)
    copy = rowgemm.drafting_copy(weight, bias)
    assert torch.equal(copy(x), rowgemm.linear(x, copy.weight.float(), bias))
    assert rowgemm.drafting_copy(weight.half()) is None  # float32 weights only


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_reduced_vocabulary_checkpoint_round_trip(tmp_path, smollm2, method):
    ids = torch.arange(0, 49152, 7)
    model = random_drafter_model(method, smollm2, seed=2, draft_ids=ids)
    save_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == ids.shape[0] and config["vocab_size"] == 49152
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert int(state["t2d"].sum()) == ids.shape[0]
    loaded = load_drafter_model(tmp_path, smollm2)
    assert torch.equal(draft_ids_of(loaded), ids)
    (tmp_path / "config.json").unlink()  # official-style: no config, shape from the keys
    assert torch.equal(draft_ids_of(load_drafter_model(tmp_path, smollm2, method)), ids)


class RestrictedOracle(OracleHead):
    """The oracle's logits over a part of the vocabulary only."""

    def __init__(self, full, vocab_size, ids):
        super().__init__(full, vocab_size)
        self.ids = ids

    def __call__(self, hidden):
        return super().__call__(hidden)[..., self.ids]

    def to_target(self, indices):
        return self.ids[indices]


@pytest.mark.parametrize("method", ["gumiho", "eagle2"])
def test_restricted_oracle_equals_plain(smollm2, reference, method):
    """Tokens outside the draft vocabulary can't be drafted; output is unchanged."""
    ids, plain = reference
    full = ids + plain.token_ids
    answer = sorted(set(plain.token_ids))
    missing = set(answer[::3])  # a third of the answer's tokens are not in the vocabulary
    vocab = torch.tensor([t for t in range(49152) if t not in missing])
    drafter = oracle_drafter(method, smollm2, full, TreeConfig.for_method(method))
    begin = drafter.begin

    def restricted_begin(target, capacity):
        begin(target, capacity)
        drafter.head = RestrictedOracle(full, 49152, vocab)

    drafter.begin = restricted_begin
    out = run(smollm2, drafter, ids, GenerateConfig(max_new_tokens=len(plain.token_ids)))
    assert out.token_ids == plain.token_ids
    assert out.tau > 1.5  # the oracle still drafts the tokens it has


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_random_reduced_drafter_equals_plain(smollm2, reference, method):
    ids, plain = reference
    vocab = torch.tensor(sorted(set(range(0, 49152, 5)) | set(plain.token_ids)))
    model = random_drafter_model(method, smollm2, draft_ids=vocab)
    tree = TreeConfig.for_method(method, total_tokens=24)
    drafter = MedusaDrafter(model, tree) if method == "medusa" else SerialDrafter(model, tree)
    out = run(smollm2, drafter, ids, GenerateConfig(max_new_tokens=len(plain.token_ids)))
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_a_draft_vocabulary_narrower_than_the_tree_drafts_what_it_has(smollm2, reference,
                                                                       method):
    """Four draft tokens under a tree that takes 10 candidates a node (top-k, MLP top-k,
    Medusa's ranks): each level takes the four (`topk` had failed mid-answer), and the
    output is plain decoding's."""
    ids, plain = reference
    vocab = torch.tensor(sorted(set(plain.token_ids))[:4])
    model = random_drafter_model(method, smollm2, draft_ids=vocab)
    tree = TreeConfig.for_method(method, total_tokens=24)
    drafter = MedusaDrafter(model, tree) if method == "medusa" else SerialDrafter(model, tree)
    assert int(drafter.ranks.max()) < 4 if method == "medusa" else \
        drafter.beam == drafter.mlp_topk == 4
    out = run(smollm2, drafter, ids, GenerateConfig(max_new_tokens=len(plain.token_ids)))
    assert out.token_ids == plain.token_ids


def test_reduced_vocabulary_sampling_matches_target():
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    prompt = [3, 9, 1, 12]
    want2, want3 = exact_marginals(target, prompt, 1.0, vocab)
    model = random_drafter_model("eagle2", target, seed=0, draft_ids=torch.arange(0, 16, 2))
    # the whole draft vocabulary at the first level: a draft is accepted whenever the
    # target samples a token inside it
    drafter = SerialDrafter(model, TreeConfig.for_method("eagle2", total_tokens=16, top_k=8,
                                                         depth=2))
    got2, got3 = torch.zeros(vocab), torch.zeros(vocab)
    drafted = 0
    for seed in range(1500):
        out = run(target, drafter, prompt, GenerateConfig(max_new_tokens=3, temperature=1.0,
                                                          seed=seed))
        got2[out.token_ids[1]] += 1
        got3[out.token_ids[2]] += 1
        drafted += out.accept_lengths[1] - 1
    assert drafted > 200, "too few accepted drafts for the test to mean anything"
    assert not chi_square_rejects(got2, want2)
    assert not chi_square_rejects(got3, want3)
