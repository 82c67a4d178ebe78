"""Would a third serial step draft position 3 better than Gumiho's first MLP head?

Held-out top-1 (teacher-forced, as `python -m gumiho.train.accuracy` measures it) of the
serial layers run a third time, on (x_{t+3}, out2_t) at position t+2, seeing the true pairs
0..t, its own step-2 entry and itself, as a third drafted level would at inference; beside
serial steps 1 and 2 and MLP heads 1 and 2 (head 1 predicts the same position as step 3).

    python scripts/third_serial_step.py --draft gumiho/assets/smollm2/gumiho --data data/heldout512
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from transformers import DynamicCache

from gumiho.checkpoint import load_drafter_model
from gumiho.ge_data.shards import load_samples
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.dataset import collate
from gumiho.train.loss import TargetDistributions, feature_losses


def step_mask(keys: torch.Tensor, rows: int, earlier: list[int]) -> torch.Tensor:
    """(B, 1, rows, n + sum(earlier) + rows) for a serial step after the first: the true
    pairs up to each row's own (keys (B, n): which pairs are real), then each earlier
    step's entry of the same row (`earlier`: those steps' widths), then itself."""
    batch, n = keys.shape
    parts = [torch.ones(rows, n, dtype=torch.bool).tril()[None] & keys[:, None, :]]
    parts += [torch.eye(rows, width, dtype=torch.bool)[None].expand(batch, -1, -1)
              for width in earlier]
    parts.append(torch.eye(rows, dtype=torch.bool)[None].expand(batch, -1, -1))
    return torch.cat(parts, -1)[:, None]


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="gumiho/assets/smollm2/gumiho")
    p.add_argument("--data", default="data/heldout512")
    args = p.parse_args()
    _, samples = load_samples(args.data)
    target = load_target("smollm2", device="cpu")
    model = load_drafter_model(args.draft, target, "gumiho").float().eval()
    head = DraftHead.for_model(target, model)
    sums: dict[str, float] = {}
    batches = 0
    for i in range(0, len(samples), 4):
        batch = collate(samples[i : i + 4])
        ids, valid = batch["input_ids"], batch["valid"]
        features = batch.get("hidden_state")
        if features is None:
            features = target.features(ids, valid.long())
        features = features.float()
        n = ids.shape[1] - 1
        keys = valid[:, 1:]  # pair t is real iff x_{t+1} is
        positions = torch.arange(n).expand(ids.shape[0], -1)
        cache = DynamicCache()
        causal = (torch.ones(n, n, dtype=torch.bool).tril()[None] & keys[:, None, :])[:, None]
        out1 = model.serial_step(ids[:, 1:], features[:, :-1], positions, causal, cache)
        out2 = model.serial_step(ids[:, 2:], out1[:, :-1], positions[:, 1:],
                                 step_mask(keys, n - 1, []), cache)
        out3 = model.serial_step(ids[:, 3:], out2[:, :-1], positions[:, 2:],
                                 step_mask(keys, n - 2, [n - 1]), cache)
        mlp = model.parallel_heads(ids[:, 2:-1], out1[:, :-2], ids[:, 3:], out2[:, :-1])
        truth = TargetDistributions(features, batch["loss_mask"].bool(), head, target.lm_head)
        for name, out, shift in (("serial1", out1, 1), ("serial2", out2, 2),
                                 ("serial3", out3, 3), ("mlp1", mlp[:, :, 0], 3),
                                 ("mlp2", mlp[:, :, 1], 4)):
            acc = feature_losses(out, features, shift, truth, head, False, True)["acc"]
            sums[name] = sums.get(name, 0.0) + float(acc)
        batches += 1
    print(json.dumps({"draft": args.draft, "samples": len(samples),
                      **{k: round(v / batches, 4) for k, v in sums.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
