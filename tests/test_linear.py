"""Vocabulary-sized projections: oneDNN where MKL is slow, the same product either way, and
the loop's wide verifies going through it while output stays plain decoding's."""

import pytest
import torch

from gumiho import linear, rowamx, rowgemm
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.linear import MIN_OUTPUTS, uses_onednn, vocab_linear

from conftest import DEVICE, REPEAT_PROMPT, rows_through

needs_onednn = pytest.mark.skipif(linear.ONEDNN_LINEAR is None, reason="torch without oneDNN")


@pytest.fixture
def no_rowgemm(monkeypatch):
    """torch's products as on a machine where rowgemm.c does not build (the paths below
    are that machine's; tests/test_rowgemm.py holds rowgemm's)."""
    monkeypatch.setattr(rowgemm, "kernel", lambda: None)


@pytest.fixture
def no_rowamx(monkeypatch):
    """oneDNN's bf16 products as on a CPU without AMX tiles (tests/test_rowamx.py holds
    rowamx.c's)."""
    monkeypatch.setattr(rowamx, "kernel", lambda: None)


@needs_onednn
@pytest.mark.host
@pytest.mark.parametrize("rows", [1, 3, 4, 11, 16, 40])
def test_vocab_linear_is_the_same_product(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(MIN_OUTPUTS, 64), torch.randn(MIN_OUTPUTS)
    hidden = torch.randn(1, rows, 64)  # a batch dim, as the target's features have none
    with torch.no_grad():
        for b in (None, bias):
            expected = torch.nn.functional.linear(hidden, weight, b)
            got = vocab_linear(hidden, weight, b)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
            assert got[0].argmax(-1).tolist() == expected[0].argmax(-1).tolist()


@needs_onednn
@pytest.mark.host
def test_only_wide_float32_cpu_products_of_a_large_weight_use_onednn():
    big, small = torch.randn(MIN_OUTPUTS, 8), torch.randn(MIN_OUTPUTS - 1, 8)
    with torch.no_grad():
        assert uses_onednn(torch.randn(4, 8), big)
        assert uses_onednn(torch.randn(1, 4, 8), big)
        assert not uses_onednn(torch.randn(3, 8), big)  # MKL is fast for 1-3 rows
        assert not uses_onednn(torch.randn(4, 8), small)  # and for smaller weights
        assert not uses_onednn(torch.randn(4, 8).bfloat16(), big.bfloat16())
    assert not uses_onednn(torch.randn(4, 8, requires_grad=True), big)  # autograd: torch's


@needs_onednn
@pytest.mark.host
def test_vocab_linear_compiles():
    """Under torch.compile (`--engine compile` on a CPU) a wide product is inductor's to
    lower: handing it the oneDNN op failed in lowering (a verify of 8 tokens)."""
    torch.manual_seed(0)
    weight, hidden = torch.randn(MIN_OUTPUTS, 16), torch.randn(1, 8, 16)
    with torch.no_grad():
        got = torch.compile(vocab_linear, dynamic=False)(hidden, weight)
    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(DEVICE.type != "cpu" or linear.ONEDNN_LINEAR is None,
                    reason="the oneDNN path is the CPU's")
def test_wide_verifies_use_onednn_and_equal_plain(smollm2, monkeypatch, no_rowgemm):
    """A prompt-lookup chain makes verifies of up to 11 rows: their logits come from oneDNN,
    plain decoding's single rows from torch's default, and the tokens are the same."""
    calls = rows_through(monkeypatch, linear, "ONEDNN_LINEAR")
    ids = smollm2.chat_ids(REPEAT_PROMPT)
    config = GenerateConfig(max_new_tokens=48)
    plain = run(smollm2, PlainDrafter(), ids, config)
    assert calls == []  # one row per step (the prompt's logits are its last token's)
    out = run(smollm2, load_drafter("lookup", smollm2, tree=None), ids, config)
    assert out.token_ids == plain.token_ids
    assert max(out.accept_lengths) >= 4 and any(4 <= rows < 16 for rows in calls), calls


needs_packing = pytest.mark.skipif(linear.ONEDNN_REORDER is None, reason="torch without oneDNN")


@needs_packing
@pytest.mark.host
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_is_the_same_product(bias, no_rowamx):
    """bf16 layers reordered once for oneDNN give exactly nn.Linear's outputs (the same
    kernel runs), for any batch shape and for float32 inputs (cast as the layer would)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=bias).bfloat16().requires_grad_(False)
    packed = linear.PackedLinear(layer)
    with torch.no_grad():
        for shape in ((1, 64), (3, 64), (2, 7, 64), (1, 40, 64)):
            x = torch.randn(shape).bfloat16()
            assert torch.equal(packed(x), layer(x))
        assert torch.equal(packed(x.float()), layer(x))
    assert torch.equal(packed.weight, layer.weight)


needs_mkl_packing = pytest.mark.skipif(linear.MKL_REORDER is None, reason="torch without MKL")


@needs_mkl_packing
@pytest.mark.host
@pytest.mark.parametrize("bias", [False, True])
def test_a_float32_packed_linear_is_the_same_product(bias, no_rowgemm):
    """float32 layers packed for MKL: below MIN_ROWS rows and above MKL_MAX_ROWS the plain
    weight runs (bit for bit nn.Linear: a plain decode step, a prefill, a training batch);
    in between MKL's packed GEMM, the same product up to the order of float additions."""
    torch.manual_seed(0)
    for shape in ((96, 64), (1536, 576), (576, 1536)):
        layer = torch.nn.Linear(shape[1], shape[0], bias=bias).requires_grad_(False)
        packed = linear.PackedLinear(layer)
        assert torch.equal(packed.weight, layer.weight)
        with torch.no_grad():
            for rows in (1, 2, 3, linear.MKL_MAX_ROWS + 1, 300):
                x = torch.randn(rows, shape[1])
                assert torch.equal(packed(x), layer(x))
            for x in (torch.randn(4, shape[1]), torch.randn(13, shape[1]),
                      torch.randn(2, 7, shape[1]), torch.randn(1, 80, shape[1])):
                got = packed(x)
                assert got.shape == x.shape[:-1] + (shape[0],)
                torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


@needs_packing
@needs_mkl_packing
@pytest.mark.host
def test_pack_linears_takes_frozen_bf16_and_float32_cpu_layers_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8),
                                torch.nn.Sequential(torch.nn.Linear(8, 8)),
                                torch.nn.Linear(8, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 8))
    model.bfloat16().requires_grad_(False)
    model[1].float()  # MKL's packed GEMM
    model[3].requires_grad_(True)  # a layer being trained stays
    model[5].double()  # no packed GEMM for float64
    assert linear.pack_linears(model, skip=(model[4],)) == 3
    assert [type(m).__name__ for m in (model[0], model[1], model[2][0], model[3], model[4],
                                       model[5])] \
        == ["PackedLinear", "PackedLinear", "PackedLinear", "Linear", "Linear", "Linear"]
    assert model[1].mkl and not model[0].mkl
    assert linear.pack_weight(model[3].weight) is None  # trainable
    assert linear.pack_weight(model[1].weight.detach()) is None  # vocabulary heads: bf16 only
    assert linear.unpack_linears(model) == 3
    assert type(model[1]) is torch.nn.Linear and model[1].weight.dtype == torch.float32


@needs_packing
@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_packed_models_state_is_the_plain_ones(dtype):
    """state_dict (and so save_drafter) of a packed model holds each layer's weight and bias
    as the nn.Linear it replaced had them: a drafter loaded for decoding saves whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False))
    if dtype == torch.float16:  # float32 values that are exactly float16 ones (narrowed)
        model.half().float()
    else:
        model.to(dtype)
    model.requires_grad_(False)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert linear.pack_linears(model) == 2
    got = model.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


@pytest.mark.host
def test_a_model_off_the_cpu_builds_no_cpu_kernels(monkeypatch):
    """A GPU model has nothing to pack: pack_linears leaves it without building (or
    probing) the CPU's kernels, and rowlayer.c's steps are not considered for its layers
    ("meta" stands in for CUDA)."""
    from gumiho import rowlayer
    from gumiho.fused import LlamaLayers

    def no_build():
        raise AssertionError("a CPU kernel was asked for")

    for module in (rowgemm, rowamx, rowlayer):
        monkeypatch.setattr(module, "kernel", no_build)
    monkeypatch.setattr(rowlayer, "enabled", no_build)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).bfloat16()
    model.requires_grad_(False)
    assert linear.pack_linears(model) == 0
    assert type(model[0]) is torch.nn.Linear
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1)
    with torch.device("meta"):
        layers = LlamaLayers([LlamaDecoderLayer(config, 0).bfloat16()], None, lambda _: None)
    assert rowlayer.RowLayers.of(layers, None, torch.bfloat16, sdpa=True) is None


@needs_packing
@needs_mkl_packing
@pytest.mark.host
def test_float32_layers_stay_unpacked_where_their_second_copy_would_not_fit(monkeypatch,
                                                                            caplog, no_rowgemm):
    """A packed float32 layer keeps its plain weight too: where that copy would take more
    than half the available memory, float32 layers are left alone (said in one warning);
    bf16 ones, packed in place, still are."""
    def model():
        torch.manual_seed(0)
        layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        layers.requires_grad_(False)
        layers[1].bfloat16()
        return layers

    monkeypatch.setattr(linear, "available_memory", lambda: 2 * 64 * 64 * 4 - 2)
    tight = model()
    assert linear.pack_linears(tight) == 1
    assert type(tight[0]) is torch.nn.Linear and type(tight[1]) is linear.PackedLinear
    assert "float32 layers not packed" in caplog.text
    for room in (2 * 64 * 64 * 4, None):
        monkeypatch.setattr(linear, "available_memory", lambda room=room: room)
        assert linear.pack_linears(model()) == 2
    monkeypatch.undo()
    assert linear.available_memory() is None or linear.available_memory() > 0


@needs_packing
@pytest.mark.host
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_vocab_linear_with_a_packed_weight_is_the_same_product(rows, no_rowamx):
    torch.manual_seed(0)
    weight = torch.randn(4096, 64).bfloat16()
    hidden = torch.randn(1, rows, 64).bfloat16()
    packed = linear.pack_weight(weight)
    with torch.no_grad():
        assert torch.equal(vocab_linear(hidden, weight, None, packed),
                           torch.nn.functional.linear(hidden, weight))
    grad = hidden.float().requires_grad_(True)  # autograd needs torch's own product
    out = vocab_linear(grad, weight.float(), None, packed)
    out.sum().backward()
    assert grad.grad is not None


@needs_packing
@pytest.mark.skipif(DEVICE.type != "cpu", reason="packing is the CPU's")
def test_a_bf16_target_is_packed_and_decodes_as_unpacked(tiny_target_dir, monkeypatch,
                                                         no_rowamx):
    """load_target packs a bf16 CPU target's layers (not its lm_head, which the logits and
    the drafters read), and packing changes no output: the same features, logits and
    greedy tokens as the same target unpacked, plain and with a drafter."""
    import gumiho.target as target_module
    from gumiho.target import load_target

    packed = load_target(tiny_target_dir, device="cpu", dtype="bfloat16")
    monkeypatch.setattr(target_module, "pack_linears", lambda *a, **k: 0)
    plain = load_target(tiny_target_dir, device="cpu", dtype="bfloat16")
    kinds = {type(m).__name__ for m in packed.model.model.modules()}
    assert "PackedLinear" in kinds and "Linear" not in kinds
    assert type(packed.model.lm_head) is torch.nn.Linear and packed._packed_head is not None
    assert not any(type(m).__name__ == "PackedLinear" for m in plain.model.modules())
    ids = packed.chat_ids("Name a colour.")
    features = packed.features(torch.tensor([ids]))
    assert torch.equal(features, plain.features(torch.tensor([ids])))
    with torch.no_grad():
        assert torch.equal(packed.logits(features[0]), plain.logits(features[0]))
    config = GenerateConfig(max_new_tokens=12)
    for drafter in (PlainDrafter(), None):
        out = [run(t, drafter or load_drafter("gumiho", t, "random"), ids, config).token_ids
               for t in (packed, plain)]
        assert out[0] == out[1]


@needs_mkl_packing
@pytest.mark.skipif(DEVICE.type != "cpu", reason="packing is the CPU's")
def test_a_float32_target_is_packed_and_decodes_as_unpacked(smollm2, reference, monkeypatch):
    """load_target packs a float32 CPU target's layers for MKL (the lm_head stays); plain
    decoding (one row a step: the plain weights) gives the unpacked target's answer, and
    the prompt's features (many rows: MKL's packed GEMM) agree to float32 rounding."""
    import gumiho.target as target_module
    from gumiho.target import load_target

    assert smollm2.dtype == torch.float32
    kinds = {type(m).__name__ for m in smollm2.model.model.layers.modules()}
    assert "PackedLinear" in kinds and "Linear" not in kinds
    assert type(smollm2.model.lm_head) is torch.nn.Linear and smollm2._packed_head is None
    monkeypatch.setattr(target_module, "pack_linears", lambda *a, **k: 0)
    plain = load_target("smollm2", device="cpu")
    assert not any(type(m).__name__ == "PackedLinear" for m in plain.model.modules())
    ids, result = reference
    torch.testing.assert_close(smollm2.features(torch.tensor([ids])),
                               plain.features(torch.tensor([ids])), rtol=1e-4, atol=1e-4)
    config = GenerateConfig(max_new_tokens=len(result.token_ids))
    assert run(plain, PlainDrafter(), ids, config).token_ids == result.token_ids


@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_heads_inference_and_training_products_agree(dtype):
    """Gumiho's MLP heads run one product per head at inference and one batched product in
    training (neither copies the stacked weights, as einsum did): both give the einsum
    formula's outputs, for all heads and for the leading ones only."""
    from gumiho.modeling.drafter import ParallelHeads

    torch.manual_seed(0)
    heads = ParallelHeads(32, 4, 3).to(dtype)
    with torch.no_grad():
        heads.w_res.normal_(std=0.1)
        heads.b_res.normal_(std=0.1)

    def einsum_heads(x, n):
        act = torch.nn.functional.silu
        h = act(torch.einsum("...i,noi->...no", x, heads.w_in[:n]) + heads.b_in[:n])
        for r in range(heads.w_res.shape[1]):
            h = h + act(torch.einsum("...ni,noi->...no", h, heads.w_res[:n, r])
                        + heads.b_res[:n, r])
        return h

    x = torch.randn(2, 5, 64).to(dtype)
    for n in (4, 2):
        expected = einsum_heads(x, n).detach()
        with torch.no_grad():
            inference = heads(x, n)
        training = heads(x, n)
        assert inference.shape == (2, 5, n, 32)
        torch.testing.assert_close(inference, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(training.detach(), expected, rtol=1e-5, atol=1e-5)
        training.sum().backward()
        assert heads.w_res.grad is not None and heads.w_res.grad[:n].abs().sum() > 0
        heads.zero_grad()


@needs_packing
@pytest.mark.host
def test_gumiho_pack_0_turns_packing_off(monkeypatch):
    weight = torch.randn(16, 8).bfloat16()
    assert linear.can_pack(weight)
    monkeypatch.setenv("GUMIHO_PACK", "0")
    assert not linear.can_pack(weight) and linear.pack_weight(weight) is None


@needs_packing
@pytest.mark.skipif(DEVICE.type != "cpu", reason="packing is the CPU's")
def test_the_compile_engine_unpacks(tiny_target_dir):
    """inductor cannot lower oneDNN's packed product: a compile runner puts nn.Linear back
    (the same weights), and a drafter for the compile engine is never packed."""
    from gumiho.engine import TargetRunner
    from gumiho.target import load_target

    target = load_target(tiny_target_dir, device="cpu", dtype="bfloat16")
    ids = torch.tensor([target.chat_ids("Name a colour.")])
    before = target.features(ids)
    TargetRunner(target, "compile")
    assert not any(type(m) is linear.PackedLinear for m in target.model.modules())
    assert target._packed_head is None
    assert torch.equal(target.features(ids), before)
    drafter = load_drafter("gumiho", target, "random", engine="compile")
    assert not any(type(m) is linear.PackedLinear for m in drafter.model.modules())
    assert any(type(m) is linear.PackedLinear
               for m in load_drafter("gumiho", target, "random").model.modules())
