"""Our loop against what a user already has, side by side in one process: transformers'
`generate` (plain, and with prompt lookup), our plain loop, our prompt lookup and our
drafters. Greedy; each variant runs on every prompt in turn, repeats interleaved, so
machine load hits every variant alike. Prints tokens/s per prompt and ratios to HF plain.

    python scripts/bench_peers.py [--new-tokens 96] [--repeats 3] [--methods ar,lookup,gumiho]
    python scripts/bench_peers.py --device cuda [--hf-static]   # a GPU: bf16, our graphs

On a GPU our loop runs on its default engine (CUDA graphs) and transformers' `generate` as
a user calls it (a dynamic cache, eager kernels); `--hf-static` adds `generate` with
`cache_implementation="static"`, which transformers compiles: the fastest baseline a GPU
user has without a serving engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.errors import GumihoError
from gumiho.generate import SpeculativeGenerator
from gumiho.methods import method_spec
from gumiho.target import load_target, resolve_target_path

# A summary and a list edit (the answer copies the prompt), open-ended text, code.
ARTICLE = (
    "The city council met on Tuesday to discuss the new bus routes. After two hours of "
    "debate, the council voted to add three routes connecting the north suburbs to the "
    "central station, to extend evening service until midnight, and to cut the fare for "
    "students by half. The changes start in March and cost about 2 million dollars a year, "
    "paid from the parking fund. Residents of the north suburbs had asked for better "
    "service for years; several spoke at the meeting in support.")
PROMPTS = {
    "summary": f"Summarise this article in three sentences, reusing its wording:\n\n{ARTICLE}",
    "reverse": "Write this list in reverse order, one item per line: apple, banana, cherry, "
               "date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine.",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "code": "Write a Python function that checks whether a string is a palindrome, "
            "ignoring case and punctuation, with a docstring and two examples.",
}
DRAFTS = {"gumiho": "gumiho/assets/smollm2/gumiho", "eagle2": "gumiho/assets/smollm2/eagle2",
          "medusa": "gumiho/assets/smollm2/medusa"}


def stock_model(name: str, device: torch.device, dtype: torch.dtype):
    """The target as a user loads it: a stock transformers model with sdpa attention,
    untouched by us (wrap_target switches its own copy's attention function)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_target_path(name), dtype=dtype,
                                                attn_implementation="sdpa").to(device).eval()


def hf_runner(model, target, ids: list[int], new_tokens: int, lookup: int | None,
              cache: str | None = None):
    input_ids = torch.tensor([ids], device=model.device)
    stops = sorted(target.stop_token_ids)
    extra = {"cache_implementation": cache} if cache else {}

    def go() -> int:
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=stops, pad_token_id=stops[0],
                             prompt_lookup_num_tokens=lookup, **extra)
        if out.device.type == "cuda":
            torch.cuda.synchronize()
        return out.shape[1] - input_ids.shape[1]

    return go


def our_runner(gen: SpeculativeGenerator, ids: list[int], new_tokens: int):
    def go() -> int:
        return gen.generate(ids, max_new_tokens=new_tokens).new_tokens

    return go


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="ar,lookup,gumiho")
    p.add_argument("--draft", action="append", default=[],
                   help="METHOD=DIR: a drafter other than the shipped one")
    p.add_argument("--target", default="smollm2",
                   help="a target name (smollm2, gemma3-270m) or a local model directory; "
                        "give --methods ar,lookup for one without a shipped drafter")
    p.add_argument("--chat-template", default=None,
                   help="'vicuna' or a Jinja string, for a target without one of its own")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None,
                   help="default: float32 on a CPU, bfloat16 on a GPU")
    p.add_argument("--attention", default=None, choices=["sdpa", "eager", "sdpa_invariant"],
                   help="our target's attention (transformers' stays sdpa), e.g. the AMX "
                        "demo's bf16 sdpa_invariant")
    p.add_argument("--preset", default=None, choices=["demo"],
                   help="our drafters' tree settings (`gumiho generate --preset`)")
    p.add_argument("--hf-static", action="store_true",
                   help="also transformers' generate with a static (compiled) cache")
    args = p.parse_args()
    for d in args.draft:  # before anything loads: one line, as argparse's own errors
        if not d.partition("=")[0] or not d.partition("=")[2]:
            p.error(f"--draft {d!r}: give METHOD=DIR, e.g. gumiho=runs/my_drafter")
    for method in args.methods.split(","):
        try:
            method_spec(method)
        except GumihoError as exc:
            p.error(f"--methods: {exc}")
    drafts = {**DRAFTS, **dict(d.split("=", 1) for d in args.draft)}
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    target = load_target(args.target, device=str(device), dtype=str(dtype).split(".")[1],
                         chat_template=args.chat_template, attn_implementation=args.attention)
    stock = stock_model(args.target, device, dtype)
    prompts = {name: target.chat_ids(text) for name, text in PROMPTS.items()}
    variants = {"hf": lambda ids: hf_runner(stock, target, ids, args.new_tokens, None),
                "hf_lookup": lambda ids: hf_runner(stock, target, ids, args.new_tokens, 10)}
    if args.hf_static:
        variants["hf_static"] = lambda ids: hf_runner(stock, target, ids, args.new_tokens,
                                                      None, "static")
    for method in args.methods.split(","):
        preset = args.preset if method_spec(method).drafter else None
        gen = SpeculativeGenerator.load(target, method, drafts.get(method), preset=preset)
        variants[method] = lambda ids, gen=gen: our_runner(gen, ids, args.new_tokens)
    runners = {(v, name): make(ids) for v, make in variants.items()
               for name, ids in prompts.items()}
    for go in runners.values():  # warm-up (and the output lengths)
        go()
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    for _ in range(args.repeats):
        for key, go in runners.items():
            start = time.perf_counter()
            n = go()
            rates[key].append(n / (time.perf_counter() - start))
    table = {}
    for name in prompts:
        base = statistics.median(rates[("hf", name)])
        table[name] = {v: {"tokens_per_s": round(statistics.median(rates[(v, name)]), 1),
                           "vs_hf": round(statistics.median(rates[(v, name)]) / base, 2)}
                       for v in variants}
    print(json.dumps({"target": args.target, "new_tokens": args.new_tokens, "repeats": args.repeats,
                      "device": str(device), "dtype": str(dtype),
                      "attention": target.config._attn_implementation,
                      "preset": args.preset,
                      "drafts": {m: drafts[m] for m in args.methods.split(",") if m in drafts},
                      "threads": torch.get_num_threads(), "prompts": table}, indent=1))


if __name__ == "__main__":
    main()
