"""`gumiho demo`: the embedded default, SmolLM2-135M-Instruct with the Gumiho drafter
shipped for it, on the CPU. Streams an answer, then decodes the same prompt plainly and
prints tau, tokens/s and the speedup (greedy, so both outputs must be identical)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gumiho.config import TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.errors import GumihoError, cli_errors
from gumiho.generate import SpeculativeGenerator
from gumiho.target import load_target

SHIPPED = Path(__file__).parent / "assets" / "smollm2"
PROMPT = "Explain in a few sentences why the sky is blue."
# A small tree wins on a CPU, where verify cost grows with width (README: measured costs).
CPU_TREE_TOKENS = 24


def shipped_drafter(method: str = "gumiho") -> Path:
    path = SHIPPED / method
    if not (path / "model.safetensors").exists():
        raise GumihoError(f"no shipped {method} drafter at {path}: reinstall the package")
    return path


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gumiho demo", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--method", default="gumiho", choices=("gumiho", "eagle2", "medusa"))
    p.add_argument("--total-tokens", type=int, default=None,
                   help=f"verified tokens per cycle (default: {CPU_TREE_TOKENS} on CPU, the "
                   "method's reference on GPU)")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="gumiho: %(message)s")
    target = load_target("smollm2", device=args.device)
    width = args.total_tokens or (CPU_TREE_TOKENS if target.device.type == "cpu" else None)
    tree = TreeConfig.for_method(args.method, total_tokens=width)
    drafter = load_drafter(args.method, target, str(shipped_drafter(args.method)), tree=tree)
    gen = SpeculativeGenerator(target, drafter)
    ids = gen.prompt_ids(args.prompt)
    config = GenerateConfig(max_new_tokens=args.max_new_tokens)
    run(target, drafter, ids, GenerateConfig(max_new_tokens=8))  # warm-up, untimed
    print(f"> {args.prompt}\n")
    for piece in gen.stream(ids, args.max_new_tokens):
        print(piece, end="", flush=True)
    fast = gen.last_result
    print("\n\n(decoding the same prompt plainly for comparison ...)", flush=True)
    run(target, PlainDrafter(), ids, GenerateConfig(max_new_tokens=8))
    plain = run(target, PlainDrafter(), ids, config)
    same = "identical" if plain.token_ids == fast.token_ids else "DIFFERENT (a bug!)"
    print(f"\n{args.method} ({tree.total_tokens}-token tree, fta {tree.fta}) on "
          f"{target.device}: {fast.new_tokens} tokens, tau {fast.tau:.2f}, "
          f"{fast.tokens_per_s:.1f} tokens/s")
    print(f"plain decoding: {plain.tokens_per_s:.1f} tokens/s -> speedup "
          f"{fast.tokens_per_s / plain.tokens_per_s:.2f}x; outputs {same}")
    return 0 if plain.token_ids == fast.token_ids else 1


if __name__ == "__main__":
    sys.exit(main())
