"""How much text the training split offers at each --max-len: samples, tokens and assistant
tokens (what the drafter is scored on) of online training's samples, tokenized as training
does (`gumiho.train.dataset.online_samples`, the chat template, stop tokens, truncation).

    python scripts/split_tokens.py --max-lens 512,1024,2048   # ~6 minutes on 2 cores

2026-11-27, SmolLM2 on the 17,671-conversation ShareGPT split: 512 -> 15,256 samples, 7.2M
tokens (5.3M assistant); 1024 -> 16,004, 13.4M (10.2M); 2048 -> 16,639, 22.3M (17.1M).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def main() -> int:
    from gumiho.target import load_target
    from gumiho.train.dataset import online_samples

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-lens", default="512,1024,2048")
    p.add_argument("--conversations", type=int, default=17671)
    p.add_argument("--target", default="smollm2")
    args = p.parse_args()
    target = load_target(args.target, device="cpu")
    for max_len in map(int, args.max_lens.split(",")):
        samples = online_samples(target, "sharegpt", args.conversations, max_len, cache=False)
        print(json.dumps({"max_len": max_len, "samples": len(samples),
                          "tokens": sum(s["input_ids"].shape[0] for s in samples),
                          "assistant_tokens": sum(int(s["loss_mask"].sum()) for s in samples)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
