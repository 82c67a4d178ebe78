"""Captured engines give the same tokens as eager execution (STYLE: the fast path may not
change outputs). On a CPU: `static` (every step through its replay buffers) on the real
SmolLM2 with oracle drafters that accept up to 8 tokens a cycle, and `compile` (inductor)
on a tiny Llama. On a GPU (`device`): CUDA graphs."""

import contextlib
from dataclasses import replace

import pytest
import torch

from gumiho import engine as loop
from gumiho.config import TreeConfig
from gumiho.demo import shipped_drafter
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.errors import GumihoError
from gumiho.graphs import StaticStep, resolve_engine
from gumiho.sampling import accept_greedy, accept_matching, match_on_host
from gumiho.target import load_target
from gumiho.tree import DraftTree

from conftest import REFERENCE_TOKENS as N
from drafters_for_tests import oracle_drafter, random_tree


@pytest.mark.parametrize("method", ["gumiho", "eagle2"])
def test_static_buffers_give_eager_tokens_with_long_accepts(smollm2, reference, method):
    ids, plain = reference
    full = ids + plain.token_ids
    tree = TreeConfig.for_method(method)
    runs = {}
    for engine in ("eager", "static"):
        drafter = oracle_drafter(method, smollm2, full, tree, engine=engine)
        config = GenerateConfig(max_new_tokens=N, engine=engine)
        runs[engine] = [run(smollm2, drafter, ids, config) for _ in range(2)]  # reuses steps
    for out in runs["eager"] + runs["static"]:
        assert out.token_ids == plain.token_ids
    assert runs["static"][1].accept_lengths == runs["eager"][1].accept_lengths
    assert max(runs["static"][0].accept_lengths) >= 7  # padded catch-ups of every length


@pytest.mark.parametrize("levels", [3, 4])
def test_deeper_serial_levels_keep_plain_tokens_and_full_depth_accepts(smollm2, reference,
                                                                       levels):
    """`--serial-levels S` with a drafter that knows the answer: every level, serial or
    MLP, is drafted from the right parent (a misaligned head or branch would stop the
    accepts at level S + 1), recorded as eagerly, and the output is plain decoding's."""
    runs = oracle_runs(smollm2, reference, TreeConfig.for_method("gumiho",
                                                                 serial_levels=levels))
    assert runs["static"].token_ids == runs["eager"].token_ids == reference[1].token_ids
    assert runs["static"].accept_lengths == runs["eager"].accept_lengths
    assert max(runs["eager"].accept_lengths) == 8  # 7 levels and the bonus token


def oracle_runs(target, reference, tree: TreeConfig) -> dict:
    """The reference prompt answered by an oracle Gumiho drafter on `tree`, by engine
    (eager, static)."""
    ids, plain = reference
    full = ids + plain.token_ids
    return {engine: run(target, oracle_drafter("gumiho", target, full, tree, engine=engine),
                        ids, GenerateConfig(max_new_tokens=N, engine=engine))
            for engine in ("eager", "static")}


@pytest.mark.parametrize("fta", ["official", "exact"])
def test_static_buffers_with_fta_finish_the_tree_on_the_host(smollm2, reference, fta):
    """The FTA modes draft through the recorded catch-up and levels steps (not the one
    drafting step) and finish the tree eagerly: the same tokens as eager, and as plain."""
    outs = oracle_runs(smollm2, reference, TreeConfig.for_method("gumiho", fta=fta))
    assert outs["static"].token_ids == outs["eager"].token_ids == reference[1].token_ids
    assert outs["static"].accept_lengths == outs["eager"].accept_lengths
    assert max(outs["static"].accept_lengths) > 2


@pytest.mark.parametrize("method", ["ar", "medusa"])
def test_static_buffers_plain_and_medusa(smollm2, reference, method):
    ids, plain = reference
    drafter = PlainDrafter() if method == "ar" else load_drafter(
        method, smollm2, "random", tree=TreeConfig.for_method(method, total_tokens=16),
        engine="static")
    out = run(smollm2, drafter, ids, GenerateConfig(max_new_tokens=N, engine="static"))
    assert out.token_ids == plain.token_ids


def test_compile_engine_gives_eager_tokens(tiny_target):
    prompt = [5, 17, 3, 42, 8, 9, 11]
    plain = run(tiny_target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=20))
    full = prompt + plain.token_ids
    tree = TreeConfig.for_method("gumiho", total_tokens=16, top_k=4, mlp_topk=4, pruning=4)
    drafter = oracle_drafter("gumiho", tiny_target, full, tree, engine="compile")
    config = GenerateConfig(max_new_tokens=20, engine="compile")
    for _ in range(2):
        out = run(tiny_target, drafter, prompt, config)
        assert out.token_ids == plain.token_ids
    assert max(out.accept_lengths) > 2
    compiled_plain = run(tiny_target, PlainDrafter(), prompt, config)
    assert compiled_plain.token_ids == plain.token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("engine", ["graphs", "compile"])  # compile: inductor's, recorded
def test_cuda_graphs_give_eager_tokens(engine):
    from conftest import tiny_llama

    target = tiny_llama(logit_scale=4.0)
    target.model.to("cuda")
    prompt = [5, 17, 3, 42, 8, 9, 11, 5, 17, 3]  # a recurring 3-gram: the lookup chain drafts
    trees = {"gumiho": TreeConfig.for_method("gumiho", total_tokens=16, top_k=4, mlp_topk=4,
                                             pruning=4),
             "gumiho+lookup": TreeConfig.for_method("gumiho", total_tokens=16, top_k=4,
                                                    mlp_topk=4, pruning=4, lookup=4),
             "eagle2": TreeConfig.for_method("eagle2", total_tokens=16, top_k=4, depth=4),
             "medusa": TreeConfig.for_method("medusa", total_tokens=16)}
    outs = {}
    for name in ("eager", engine):
        drafters = [load_drafter(method.split("+")[0], target, "random", tree=tree,
                                 engine=name) for method, tree in trees.items()]
        outs[name] = [run(target, d, prompt, GenerateConfig(max_new_tokens=32,
                                                            engine=name)).token_ids
                      for d in drafters + [PlainDrafter()]]
    assert outs[engine] == outs["eager"]


def test_graphs_engine_refused_without_a_gpu():
    with pytest.raises(GumihoError, match="needs a CUDA or ROCm device"):
        resolve_engine("graphs", torch.device("cpu"))
    assert resolve_engine(None, torch.device("cpu")) == "eager"


@pytest.mark.host
def test_every_capture_runs_on_the_stream_its_warm_up_ran_on(monkeypatch):
    """cuBLAS allocates a stream's workspace at the stream's first product, so a capture on
    a stream no product has run on allocates inside the capture (the GPU suite's cuBLAS
    internal errors). Each step is warmed up and captured on one side stream, the same for
    every step of a device, made on that device and used with it current (a kernel runs
    on the current stream of its tensors' GPU: a step of a target on cuda:1 while cuda:0 is
    current would otherwise run outside the capture). torch.cuda stood in for, so it runs
    without a GPU."""
    from gumiho import graphs

    events, current = [], [0]

    class Stream:
        def __init__(self, device=None):
            self.device = device

        def wait_stream(self, other):
            pass

    main = Stream()

    @contextlib.contextmanager
    def on(stream):
        events.append(("warm-up", stream, current[0]))
        yield

    @contextlib.contextmanager
    def device(gpu):  # as torch's: a device without an index leaves the current one
        before = current[0]
        current[0] = before if gpu.index is None else gpu.index
        yield
        current[0] = before

    class capture:
        def __init__(self, graph, pool=None, stream=None):
            self.stream = stream

        def __enter__(self):
            events.append(("capture", self.stream, current[0]))

        def __exit__(self, *exc):
            return False

    for name, value in [("Stream", Stream), ("current_stream", lambda: main),
                        ("current_device", lambda: current[0]), ("stream", on),
                        ("device", device), ("CUDAGraph", object), ("graph", capture)]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(graphs, "_CAPTURE_STREAMS", {})
    for gpu in ("cuda:1", "cuda", "cuda:1"):  # bare "cuda": the current device, 0
        for fn in (lambda x: (x + 1,), lambda x: (x * 2,)):
            graphs._Graph(fn, (torch.zeros(2),), pool=None, device=torch.device(gpu))
    assert [kind for kind, _, _ in events] == ["warm-up", "capture"] * 6
    streams = {stream for _, stream, _ in events}
    assert len(streams) == 2 and not streams & {main, None}
    for _, stream, current_device in events:
        assert stream.device == current_device
    assert [gpu for _, _, gpu in events] == [1] * 4 + [0] * 4 + [1] * 4
    assert current[0] == 0  # put back


@pytest.mark.host
def test_static_step_copies_inputs_and_outputs():
    calls = []

    def double(x):
        calls.append(x)
        return (x * 2,)

    step = StaticStep(double, "static")
    first = step(torch.tensor([[1.0, 2.0]]))[0]
    second = step(torch.tensor([[3.0, 4.0]]))[0]
    assert first.tolist() == [[2.0, 4.0]] and second.tolist() == [[6.0, 8.0]]
    assert calls[0] is calls[1]  # the same static buffer both times, refilled


@pytest.mark.host
def test_static_engine_refuses_what_a_capture_would_freeze():
    """`static` compares each call of a step with its first: a Python number that changes,
    a tensor replaced instead of refilled, or a branch on host state would replay stale on
    a GPU, so each raises; refilled state and new input values do not."""
    state = {"n": 1, "table": torch.arange(4.0), "flag": True}

    def step(x):
        return (x + state["n"] + state["table"][:1],)

    fine = StaticStep(step, "static")
    fine(torch.zeros(1))
    state["table"].copy_(torch.arange(4.0) + 1)  # refilled in place: a graph sees it
    assert fine(torch.ones(1))[0].tolist() == [3.0]
    state["n"] = 2
    with pytest.raises(GumihoError, match=r"operator 0 at test_engines.py:\d+ was "
                                          r"aten.add.Tensor.*1\) when recorded"):
        fine(torch.ones(1))
    state["n"], replaced = 1, StaticStep(step, "static")
    replaced(torch.zeros(1))
    state["table"] = torch.arange(4.0)
    with pytest.raises(GumihoError, match="would freeze"):
        replaced(torch.zeros(1))

    def branching(x):
        return (x * 2 if state["flag"] else x.clone(),)

    branch = StaticStep(branching, "static")
    branch(torch.zeros(1))
    state["flag"] = False
    with pytest.raises(GumihoError, match="would freeze"):
        branch(torch.zeros(1))


@pytest.mark.host
def test_static_engine_refuses_a_step_that_waits_on_the_device():
    """A CUDA capture fails on any read of a device value inside the step (the eighth
    lease's oracle drafter asked `bool()` there); `static` refuses the same on a CPU,
    naming the line, and takes the device-side choice that replaces it."""

    def asks(x):
        return (x * 2 if bool((x > 0).all()) else x.clone(),)

    with pytest.raises(GumihoError, match=r"makes the host wait.*item\(\)/int\(\)/bool\(\) "
                                          r"at tests/test_engines.py:\d+"):
        StaticStep(asks, "static")(torch.ones(1))

    def chooses(x):
        return (torch.where((x > 0).all(), x * 2, x),)

    step = StaticStep(chooses, "static")
    assert step(torch.ones(1))[0].tolist() == [2.0]
    assert step(-torch.ones(1))[0].tolist() == [-1.0]


@pytest.mark.host
@pytest.mark.parametrize("seed", range(4))
def test_sync_free_tree_and_accept_match_the_checked_path(seed):
    """from_parents with a depth bound (no host syncs) builds the same tree, and the
    mask-based greedy accept picks a path as long as the path-based one."""
    rng = torch.Generator().manual_seed(seed)
    tree = random_tree(torch.tensor([3]), 40, 6, rng)
    fast = DraftTree.from_parents(tree.tokens, tree.parents, max_depth=int(tree.depths.max()))
    assert torch.equal(fast.mask, tree.mask) and torch.equal(fast.depths, tree.depths)
    logits = torch.randn(tree.size, 6, generator=rng, device="cpu") * 4
    accepted, bonus = accept_greedy(fast, logits)
    argmax = logits.argmax(-1)
    nodes = accepted.tolist()
    edges = list(zip(nodes, nodes[1:], strict=False))
    assert nodes[0] == 0 and all(tree.parents[b] == a for a, b in edges)
    assert all(tree.tokens[b] == argmax[a] for a, b in edges)
    assert int(bonus) == int(argmax[nodes[-1]])
    # as long as the longest matching root-to-leaf path (the path-based rule)
    along_paths, _ = accept_greedy(replace(fast, spliced_paths=tree.paths), logits)
    assert len(nodes) == along_paths.shape[0]


@pytest.mark.host
@pytest.mark.parametrize("seed", range(24))
def test_greedy_matching_on_the_host_is_match_picks(seed):
    """The eager CPU loop's acceptance in Python (`match_on_host`) takes the nodes, bonus
    and tokens `match_picks` takes: trees with repeated sibling tokens (matched at the
    first only, so the reachable nodes are one path) and dead slots."""
    rng = torch.Generator().manual_seed(seed)
    size = int(torch.randint(1, 30, (), generator=rng))
    tree = random_tree(torch.tensor([2]), size, 3, rng)  # 3 tokens: many repeats
    if seed % 2:
        tree = replace(tree, dead=torch.rand(size, generator=rng) < 0.2)
    picks = torch.randint(0, 3, (size,), generator=rng)
    host, device = match_on_host(tree, picks.tolist()), accept_matching(tree, picks)
    assert torch.equal(host.nodes, device.nodes) and int(host.bonus) == int(device.bonus)
    assert host.nodes.dtype == device.nodes.dtype and host.bonus.shape == device.bonus.shape
    assert (host.tokens, host.contiguous) == (device.tokens, device.contiguous)


@pytest.mark.parametrize("method", ["gumiho", "eagle2"])
@pytest.mark.parametrize("size,floor", [(2, 0.0), (4, 0.0), (4, 0.1)])
def test_depth_1_trees_keep_plain_output_on_the_lean_cycle(smollm2, reference, monkeypatch,
                                                           method, size, floor):
    """A depth-1 tree on the eager loop (under a confidence floor too): its fixed shape
    (tree.Star) and, on a CPU, the acceptance in Python, against the general selection and
    match_picks: the same accepts cycle by cycle, plain decoding's tokens."""
    ids, plain = reference
    tree = TreeConfig.for_method(method, total_tokens=size, depth=1, min_confidence=floor)
    runs = {}
    for lean in (True, False):
        monkeypatch.setattr(loop, "HOST_MATCH", lean)
        drafter = load_drafter(method, smollm2, str(shipped_drafter(method)), tree=tree)
        drafter.star_trees = lean
        runs[lean] = run(smollm2, drafter, ids, GenerateConfig(max_new_tokens=N))
        assert (drafter.star is not None) == lean
    assert runs[True].token_ids == runs[False].token_ids == plain.token_ids
    assert runs[True].accept_lengths == runs[False].accept_lengths
    assert max(runs[True].accept_lengths) == 2  # a depth-1 tree accepts at most one draft
    # the star inside the recorded drafting step too (floors: eager only), captured on a GPU
    engines = ("static", "graphs") if smollm2.device.type == "cuda" else ("static",)
    for engine in engines if not floor else ():
        drafter = load_drafter(method, smollm2, str(shipped_drafter(method)), tree=tree,
                               engine=engine)
        recorded = run(smollm2, drafter, ids, GenerateConfig(max_new_tokens=N, engine=engine))
        assert drafter.star is not None
        assert recorded.accept_lengths == runs[True].accept_lengths


@pytest.mark.host
def test_compile_engine_with_invariant_attention_gives_eager_tokens():
    """sdpa_invariant under torch.compile: the attention's per-mask plan memo replayed
    another mask's plan in a traced call, and compiled decoding (plain too) gave nonsense
    where eager gave the model's text (session 66, `gumiho demo --engine compile` on an AMX
    CPU said "outputs DIFFERENT")."""
    target = load_target("smollm2", device="cpu", dtype="float32",
                         attn_implementation="sdpa_invariant")
    prompt = target.chat_ids("Why is the sky blue?")
    plain = run(target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=12))
    compiled = run(target, PlainDrafter(), prompt,
                   GenerateConfig(max_new_tokens=12, engine="compile"))
    assert compiled.token_ids == plain.token_ids
