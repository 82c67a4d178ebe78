"""Shared fixtures: a tiny random Llama (fast unit tests) and the real SmolLM2 target.

The suite runs on the CPU (CI) unless GUMIHO_TEST_DEVICE names another device, e.g.
`GUMIHO_TEST_DEVICE=cuda python -m pytest`: then every target loads there in float32 (also
in the subprocesses the CLI tests start, through GUMIHO_DEVICE and GUMIHO_DTYPE) and tensors
a test makes without a device land there too; tests marked `host` (arithmetic on hand-made
tensors, or a machine without a GPU simulated) stay on the CPU.
"""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gumiho.target import load_target, wrap_target

# Under pytest-xdist (the README's command runs `-n auto`) each worker takes its share of the
# cores, for the processes the CLI tests start too: two workers each running torch's
# default pool of every core would spin against each other.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _threads = max(1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

DEVICE = torch.device(os.environ.get("GUMIHO_TEST_DEVICE", "cpu"))
os.environ["GUMIHO_DEVICE"] = str(DEVICE)  # the library's default device, subprocesses too
# The equality tests assert what "lossless" guarantees exactly: float32 (in bf16, the GPU's
# default, a tree-shaped verify may break a near-tie of the top two logits otherwise than a
# one-token step: scripts/greedy_equality.py, README "Lossless"). GUMIHO_DTYPE overrides.
os.environ.setdefault("GUMIHO_DTYPE", "float32")


# a prompt whose answer repeats itself: prompt-lookup chains of up to 11 verify rows
REPEAT_PROMPT = ("Repeat this sentence exactly three times: the quick brown fox jumps over "
                 "the lazy dog near the river bank.")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a `python -m` the test starts: this checkout first on PYTHONPATH,
    ahead of (not instead of) what was there (the GPU lease puts staged data packages
    there), plus `extra`."""
    root = str(Path(__file__).parents[1])
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def rows_through(monkeypatch, module, name: str) -> list[int]:
    """Record the row count of every call to `module.name`, a product whose first argument
    is its input (..., features); returns the list the calls append to."""
    calls = []
    product = getattr(module, name)

    def counting(x, *args):
        calls.append(x.numel() // x.shape[-1])
        return product(x, *args)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture(autouse=True)
def _test_device(request, monkeypatch):
    if DEVICE.type == "cpu":
        yield
    elif request.node.get_closest_marker("host"):  # the library's default device too
        monkeypatch.setenv("GUMIHO_DEVICE", "cpu")
        yield
    else:
        with DEVICE:
            yield


def cuda_unusable() -> str | None:
    """Why this process can no longer use its GPU, or None while it can. A device-side
    assert, or a failed capture that leaves torch's CUDA generator marked as capturing, lasts
    for the process: every later CUDA test of an xdist worker failed the same way (the GPU
    suite of 2026-11-30 lost 140 tests of one worker to one assert, 8 of another to one
    failed capture). Draws one number and puts the generator's state back."""
    try:
        torch.cuda.synchronize()
        state = torch.cuda.get_rng_state()
        torch.rand(1, device="cuda")
        torch.cuda.set_rng_state(state)
        torch.cuda.synchronize()
    except Exception as e:  # torch.AcceleratorError, RuntimeError
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if outcome.get_result().failed:
        item.stash[_FAILED] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a failed test on a GPU, end the worker if its GPU is unusable: xdist starts a
    fresh one for the tests left (the crash is charged to this test, which failed anyway);
    without xdist the run stops with the reason."""
    yield
    if DEVICE.type != "cuda" or not item.stash.get(_FAILED, False):
        return
    why = cuda_unusable()
    if why is None:
        return
    line = f"the GPU is unusable in this process after {item.nodeid}: {why}"
    if "PYTEST_XDIST_WORKER" in os.environ:
        sys.stderr.write(f"{line}; ending worker {os.environ['PYTEST_XDIST_WORKER']}\n")
        sys.stderr.flush()
        os._exit(3)
    pytest.exit(line, returncode=1)


def pytest_runtest_logreport(report):
    """With GUMIHO_TEST_FAILURES=FILE, each failure's traceback and the end of what it
    printed (a CLI's `error: ...` line is often all that says why) are appended to FILE as
    it happens (a run cut short, as on a lent GPU machine, still tells why; pytest prints
    both only in its closing summary)."""
    path = os.environ.get("GUMIHO_TEST_FAILURES")
    # under xdist the controller gets every worker's reports: write there only
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        printed = "".join(f"--- {name}\n{text[-2000:]}\n" for name, text in report.sections
                          if name.startswith("Captured std") and text.strip())
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n{printed}\n")


def tiny_llama(vocab_size: int = 97, seed: int = 0, logit_scale: float = 1.0,
               device: torch.device | str | None = None):
    """A 2-layer random Llama on `device`, by default the library's (the suite's device,
    the CPU in `host` tests); logit_scale sharpens its next-token distributions."""
    device = device or os.environ["GUMIHO_DEVICE"]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    target = wrap_target(model.to(device), name="tiny")
    target.stop_token_ids = frozenset()
    return target


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(device=DEVICE)


@pytest.fixture(scope="session")
def smollm2():
    return load_target("smollm2", device=str(DEVICE))  # whichever test asks first


@pytest.fixture(scope="module")
def served(smollm2):
    """The shipped Gumiho drafter served on a free local port: (base url, generator); one
    server a test module (test_serve.py, test_serve_fields.py)."""
    from gumiho import SpeculativeGenerator
    from gumiho.serve import make_server
    from gumiho.worker import Worker

    gen = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                    total_tokens=8)
    worker = Worker()  # on its own thread here: the test's main thread sends the requests
    server = make_server(gen, "smollm2", "gumiho", worker)
    for loop in (server.serve_forever, worker.run_forever):
        threading.Thread(target=loop, daemon=True).start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}", gen
    server.shutdown()
    server.server_close()
    worker.stop()


REFERENCE_PROMPT = "List three uses of a paperclip."
REFERENCE_TOKENS = 24


@pytest.fixture(scope="session")
def reference(smollm2):
    """SmolLM2's plain greedy answer to REFERENCE_PROMPT: (prompt ids, GenerationResult)."""
    from gumiho.drafters import PlainDrafter
    from gumiho.engine import GenerateConfig, run

    ids = smollm2.chat_ids(REFERENCE_PROMPT)
    return ids, run(smollm2, PlainDrafter(), ids,
                    GenerateConfig(max_new_tokens=REFERENCE_TOKENS))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2):
    """A local HF model dir: a tiny random Llama with SmolLM2's real tokenizer and template."""
    path = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    vocab = len(smollm2.tokenizer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=smollm2.model.generation_config.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory, tiny_target_dir):
    """Stored training data for the tiny target: 12 real ShareGPT conversations."""
    from gumiho.ge_data import allocation

    out = tmp_path_factory.mktemp("tiny_data")
    assert allocation.main(["--outdir", str(out), "--target", tiny_target_dir, "--end", "12",
                            "--shard-size", "6", "--max-len", "96"]) == 0
    return str(out)
