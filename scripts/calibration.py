"""Are a Gumiho or EAGLE-2 drafter's confidences calibrated against greedy acceptance?

At T = 0 a draft token is accepted when it is the target's argmax, and the dynamic tree
ranks nodes by the drafter's cumulative log-probs as a stand-in for that. This reads
held-out samples (teacher-forced, as `python -m gumiho.train.accuracy` does) and prints,
per draft position: top-1 accuracy against the mean top-1 confidence, a reliability table
(confidence bins: count / mean confidence / accuracy), and the negative log-likelihood of
the target's argmax under the drafter's distribution at a few temperatures (the best is
the temperature that would calibrate that position).

    python scripts/calibration.py --draft DIR --data data/self_heldout512
"""

from __future__ import annotations

import argparse

import torch

from gumiho.checkpoint import load_drafter_model
from gumiho.ge_data.shards import load_samples
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.dataset import collate

TEMPERATURES = (0.6, 0.8, 1.0, 1.2, 1.5, 2.0)
MISS_LOGPROB = -20.0  # a target token outside the draft vocabulary


def positions(outputs: dict) -> list[tuple[str, torch.Tensor, int]]:
    """(name, estimates (B, T, H), shift): each draft position's estimate of f_{t+shift}."""
    found = [("serial1", outputs["out1"], 1)]
    if "out2" in outputs:
        found.append(("serial2", outputs["out2"], 2))
    if "mlp" in outputs:
        found += [(f"mlp{i + 1}", outputs["mlp"][:, :, i], 3 + i)
                  for i in range(outputs["mlp"].shape[2])]
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--target", default="smollm2")
    args = p.parse_args()
    _, samples = load_samples(args.data)
    target = load_target(args.target)
    model = load_drafter_model(args.draft, target, None).float().eval()
    head = DraftHead.for_model(target, model)
    stats: dict[str, dict] = {}
    with torch.no_grad():
        for i in range(0, len(samples), 4):
            batch = {k: v.to(target.device) for k, v in collate(samples[i : i + 4]).items()}
            features, scored = batch["hidden_state"].float(), batch["loss_mask"].bool()
            outputs = model(batch["input_ids"], features, batch["valid"])
            for name, estimates, shift in positions(outputs):
                keep = scored[:, shift : shift + estimates.shape[1]]
                rows = estimates[:, : keep.shape[1]][keep]
                later = features[:, shift : shift + keep.shape[1]][keep]
                truth = target.lm_head(later.to(target.lm_head.weight))  # a bf16 target
                drafted, inside = head.to_draft(truth.argmax(-1))
                logits = head(rows).float()
                confidence, argmax = torch.softmax(logits, -1).max(-1)
                hit = (argmax == drafted) & inside
                s = stats.setdefault(name, {"n": 0, "hit": 0.0, "conf": 0.0,
                                            "nll": [0.0] * len(TEMPERATURES),
                                            "bins": [[0, 0.0, 0.0] for _ in range(10)]})
                s["n"] += rows.shape[0]
                s["hit"] += float(hit.sum())
                s["conf"] += float(confidence.sum())
                bins = (confidence * 10).long().clamp(max=9)
                for b in range(10):
                    m = bins == b
                    s["bins"][b][0] += int(m.sum())
                    s["bins"][b][1] += float(confidence[m].sum())
                    s["bins"][b][2] += float(hit[m].sum())
                for j, t in enumerate(TEMPERATURES):
                    logp = torch.log_softmax(logits / t, -1).gather(
                        1, drafted.clamp(min=0)[:, None])[:, 0]
                    s["nll"][j] -= float(torch.where(inside, logp, MISS_LOGPROB).sum())
    for name, s in stats.items():
        n = max(s["n"], 1)
        nll = [x / n for x in s["nll"]]
        best = TEMPERATURES[min(range(len(nll)), key=nll.__getitem__)]
        print(f"{name}: {s['n']} positions, top-1 {s['hit'] / n:.3f}, mean confidence "
              f"{s['conf'] / n:.3f}, best temperature {best}; NLL "
              + " ".join(f"T{t}:{v:.3f}" for t, v in zip(TEMPERATURES, nll, strict=True)))
        print("  bins " + " ".join(f"{b / 10:.1f}:{c}/{conf / c:.2f}/{h / c:.2f}"
                                   for b, (c, conf, h) in enumerate(s["bins"]) if c))


if __name__ == "__main__":
    main()
