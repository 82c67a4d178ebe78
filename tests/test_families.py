"""Every supported family as a target: tiny random Llama, Qwen2 (mixed sliding/full layers),
Qwen3 (q/k norms, head_dim != H / heads), Mistral (sliding window), Gemma 2 (logit and
attention softcapping, scaled embeddings), Gemma 3 (mixed sliding/full, head_dim 48),
Granite (logits divided by `logits_scaling`, scaled embeddings and residuals) and Cohere
(logits times `logit_scale`, LayerNorm, parallel attention and MLP).

Contexts here are longer than the 16-token windows, so sliding layers must hide old tokens
relative to each tree node's own position, exactly as sequential decoding does.
"""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from gumiho.config import DrafterConfig, TrainConfig, TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, prefill, run, verify_tree
from gumiho.errors import GumihoError
from gumiho.ge_data.worker import make_samples
from gumiho.kv_cache import KVCache
from gumiho.modeling import DraftHead
from gumiho.target import default_attention, load_target, wrap_target
from gumiho.train.dataset import collate
from gumiho.train.start import new_model
from gumiho.train.step import batch_loss

from conftest import DEVICE
from drafters_for_tests import RandomDrafter, oracle_drafter, random_tree
from families import FAMILIES, WINDOW, save_family
from test_sampling import chi_square_rejects, exact_marginals

PROMPT = "Explain in two sentences why the sky is blue during the day."
NEW = 40
CHATS = [[{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris is the capital of France."},
          {"role": "user", "content": "And of Italy?"},
          {"role": "assistant", "content": "Rome."}],
         [{"role": "user", "content": "Name a prime number."},
          {"role": "assistant", "content": "Seven is prime."}]]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("families")
    return {f: save_family(root / f, f, smollm2.tokenizer) for f in FAMILIES}


@pytest.fixture(scope="session")
def family_targets(family_dirs):
    return {f: load_target(path, device=str(DEVICE)) for f, path in family_dirs.items()}


@pytest.fixture(scope="session")
def plain_outputs(family_targets):
    """Each family's plain greedy answer through our engine: (prompt ids, result)."""
    out = {}
    for family, target in family_targets.items():
        ids = target.chat_ids(PROMPT)
        out[family] = ids, run(target, PlainDrafter(), ids, GenerateConfig(max_new_tokens=NEW))
    return out


def sequential_logits(target, tokens):
    """The stock model's own forward over the whole sequence (its own masks, no cache)."""
    with torch.inference_mode():
        return target.model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("trim", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_verify_equals_sequential_past_the_window(family_targets, family, trim):
    """Two cycles on a 40-token context (window 16): tree logits equal the model's own
    sequential logits for every root-to-leaf path, before and after compaction, with a
    whole-capacity cache and with a trimmed one (eager steps)."""
    target = family_targets[family]
    vocab = target.config.vocab_size
    rng = torch.Generator().manual_seed(FAMILIES.index(family))
    prompt = torch.randint(vocab, (40,), generator=rng, device="cpu").tolist()
    cache = KVCache.for_model(target.model, 128, trim)
    prefill(target, cache, torch.tensor([prompt]))
    committed = list(prompt)
    for _ in range(2):
        tree = random_tree(torch.randint(vocab, (1,), generator=rng, device="cpu"), 24, vocab, rng)
        _, logits = verify_tree(target, cache, tree)
        for path in tree.paths:
            nodes = path[path >= 0]
            want = sequential_logits(target, committed + tree.tokens[nodes].tolist())
            torch.testing.assert_close(logits[nodes], want[len(committed):], atol=1e-4, rtol=0)
        longest = max(tree.paths, key=lambda p: int((p >= 0).sum()))
        accepted = longest[longest >= 0]
        cache.compact(accepted)
        committed += tree.tokens[accepted].tolist()
    assert len(committed) > 2 * WINDOW
    if cache.window is not None:  # the window matters here: one mask without it is wrong
        blind = KVCache.for_model(target.model, 128)
        blind.window = None
        prefill(target, blind, torch.tensor([committed]))
        _, logits = verify_tree(target, blind, tree)
        nodes = longest[longest >= 0]
        want = sequential_logits(target, committed + tree.tokens[nodes].tolist())
        assert (logits[nodes] - want[len(committed):]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_decoding_equals_hf_generate(family_targets, plain_outputs, family):
    """Our engine's plain decoding equals transformers' own greedy generate (its own cache
    and masks), past the window."""
    target = family_targets[family]
    ids, plain = plain_outputs[family]
    assert len(ids) + NEW > WINDOW
    with torch.inference_mode():
        hf = target.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                   eos_token_id=sorted(target.stop_token_ids) or None)
    want = hf[0, len(ids):].tolist()
    assert plain.token_ids == want[: len(plain.token_ids)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reused_prefix_past_the_window(family_targets, family):
    """Prefix reuse (prefix.py) on every family, sliding windows included: a prompt that
    continues the last answer reuses its entries, and the answer is transformers' greedy
    answer to the whole prompt."""
    target = family_targets[family]
    ids = target.chat_ids(PROMPT)
    config = GenerateConfig(max_new_tokens=NEW, reuse_prefix=True)
    first = run(target, PlainDrafter(), ids, config)
    turn = ids + first.token_ids + target.tokenizer(" And more.").input_ids
    assert len(turn) > len(ids) + NEW > WINDOW
    result = run(target, PlainDrafter(), turn, config)
    assert result.reused_tokens == len(ids) + first.new_tokens - 1
    with torch.inference_mode():
        hf = target.model.generate(torch.tensor([turn]), max_new_tokens=NEW, do_sample=False,
                                   eos_token_id=sorted(target.stop_token_ids) or None)
    assert result.token_ids == hf[0, len(turn):].tolist()[:result.new_tokens]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_equals_plain(family_targets, plain_outputs, family):
    target = family_targets[family]
    ids, plain = plain_outputs[family]
    config = GenerateConfig(max_new_tokens=NEW)
    for method in ("gumiho", "eagle2", "medusa"):
        tree = TreeConfig.for_method(method, total_tokens=16)
        out = run(target, load_drafter(method, target, "random", tree=tree), ids, config)
        assert out.token_ids == plain.token_ids, method
    for method in ("gumiho", "eagle2"):  # long accepted paths: compaction on every cycle
        drafter = oracle_drafter(method, target, ids + plain.token_ids,
                                 TreeConfig.for_method(method, total_tokens=24))
        out = run(target, drafter, ids, config)
        assert out.token_ids == plain.token_ids, method
        assert out.tau > 3, (method, out.accept_lengths)


@pytest.mark.parametrize("family", FAMILIES)
def test_data_generation_and_a_training_step(family_targets, family):
    """Features and loss masks from the family's own template, then one optimizer step."""
    target = family_targets[family]
    manifest = {"regenerate": False, "dtype": "float32", "max_len": 96, "template": None}
    samples = make_samples(target, [{"id": str(i), "messages": m} for i, m in enumerate(CHATS)],
                           manifest)
    assert len(samples) == 2
    for sample in samples:  # the mask ends on the template's end-of-turn token
        ids, mask = sample["input_ids"], sample["loss_mask"].bool()
        ends = [i for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
        assert all(int(ids[i]) in target.stop_token_ids for i in ends), family
    model = new_model(target, TrainConfig(online=True, draft_vocab=64), samples, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    head = DraftHead.for_model(target, model)
    loss, _ = batch_loss(model, target, head, collate(samples), "gumiho", epoch=3, noise=0.2)
    loss.backward()
    torch.optim.AdamW(params, lr=1e-3).step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


def test_drafter_shape_and_inputs_follow_the_target(family_targets):
    """head_dim from the target's config (48 at H 64); the drafter's embedding is the
    target's scaled one (Gemma: sqrt(H)); RoPE of the full-attention layers."""
    target = family_targets["gemma3"]
    config = DrafterConfig.for_target(target.config, "gumiho")
    assert config.head_dim == 48 and config.rope_parameters["rope_theta"] == 1e6
    drafter = load_drafter("gumiho", target, "random")
    ids = torch.tensor([5, 77, 1000])
    want = target.embed_tokens(ids)
    torch.testing.assert_close(drafter.model.embed_tokens(ids), want)
    assert not torch.allclose(want, target.embed_tokens.weight[ids])  # it is scaled
    llama = family_targets["llama"]
    torch.testing.assert_close(load_drafter("gumiho", llama, "random").model.embed_tokens(ids),
                               llama.embed_tokens.weight[ids])


def test_final_logit_softcap_is_applied(family_targets):
    target = family_targets["gemma2"]
    cache = KVCache.for_model(target.model, 16)
    _, logits = prefill(target, cache, torch.tensor([[3, 4, 5]]))
    assert logits.abs().max() <= 5.0
    # the prompt's last token only (a prompt needs no more)
    torch.testing.assert_close(logits, sequential_logits(target, [3, 4, 5])[-1:], atol=1e-5,
                               rtol=0)
    drafter_logits = target.lm_head(torch.randn(2, 64) * 100)
    assert drafter_logits.abs().max() <= 5.0  # drafters and training see the same cap


def test_stop_tokens_follow_generation_config_and_template(family_targets, family_dirs):
    gemma = family_targets["gemma3"]
    tok = gemma.tokenizer
    want = {tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")}
    assert want <= gemma.stop_token_ids
    assert tok.convert_tokens_to_ids("<|im_end|>") in family_targets["llama"].stop_token_ids


def test_attention_implementations(family_dirs, family_targets):
    """Softcapped attention loads eagerly (sdpa would drop the cap); eager and sdpa give the
    same tree logits; attention that takes no 4D mask is refused with one line."""
    assert default_attention(family_dirs["gemma2"]) == "eager"
    assert family_targets["gemma2"].config._attn_implementation == "eager"
    assert default_attention(family_dirs["gemma3"]) == "sdpa"
    rng = torch.Generator().manual_seed(9)
    tree = random_tree(torch.tensor([7]), 12, 1000, rng)
    prompt = torch.randint(1000, (30,), generator=rng, device="cpu")[None]
    for family in ("llama", "gemma3"):
        outs = []
        for attn in ("sdpa", "eager"):
            target = load_target(family_dirs[family], attn_implementation=attn)
            cache = KVCache.for_model(target.model, 64)
            prefill(target, cache, prompt)
            outs.append(verify_tree(target, cache, tree)[1])
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
    with pytest.raises(GumihoError, match="takes no tree mask"):
        load_target(family_dirs["llama"], attn_implementation="flex_attention")


def test_sampling_matches_the_target_on_a_sliding_softcapped_family():
    """The chi-square end-to-end test of test_sampling at T = 1, on a Gemma 2 target
    (softcapping, alternating sliding/full layers) whose 4-token window is shorter than the
    context, with trees deeper than the window."""
    vocab, temperature = 16, 1.0
    torch.manual_seed(1)
    config = Gemma2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                          final_logit_softcapping=8.0, attn_logit_softcapping=20.0,
                          attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # sharp distributions, capped at |logit| <= 8
    target = wrap_target(model, name="tiny-gemma2")
    target.stop_token_ids = frozenset()
    prompt = [3, 9, 1, 12, 5, 7]
    want2, want3 = exact_marginals(target, prompt, temperature, vocab)
    drafter = RandomDrafter(vocab, size=24, seed=0)
    got2, got3 = torch.zeros(vocab), torch.zeros(vocab)
    drafted = 0
    # Seeds 0-1499 fall in the test's 1-in-1000 tail since sampling.draw draws one uniform
    # number a row (2026-11-30): after token 12, token 10 came 39 times against 23.6 expected,
    # the same with plain decoding, and drawing from the exact conditionals with these seeds
    # alone gives the same counts; over seeds 0-59,999 it is 322 against 315.3, over
    # 100,000-159,999 301: the seeds, not a bias. So the next 1,500.
    for seed in range(1500, 3000):
        out = run(target, drafter, prompt, GenerateConfig(
            max_new_tokens=3, temperature=temperature, seed=seed))
        got2[out.token_ids[1]] += 1
        got3[out.token_ids[2]] += 1
        drafted += out.accept_lengths[1] - 1
    assert drafted > 200, "too few accepted drafts for the test to mean anything"
    assert not chi_square_rejects(got2, want2)
    assert not chi_square_rejects(got3, want3)


def test_layers_other_than_attention_are_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(GumihoError, match="linear_attention layers"):
        KVCache(config, 8, torch.device("cpu"), torch.float32)


def test_a_logit_transform_we_do_not_know_is_refused(family_targets, monkeypatch):
    """Granite's and Cohere's scales are read from their configs (the tree test above checks
    the logits); a family whose forward changes its logits some other way is refused at
    load, not sampled from wrongly."""
    assert family_targets["granite"].logit_form.scale == 0.25
    assert family_targets["cohere"].logit_form.scale == 0.25
    model = family_targets["llama"].model
    wrap_target(model, name="llama")  # its own forward passes
    forward = type(model).forward

    def doubled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    monkeypatch.setattr(type(model), "forward", doubled)
    with pytest.raises(GumihoError, match="transforms its logits"):
        wrap_target(model, name="llama-doubled")
