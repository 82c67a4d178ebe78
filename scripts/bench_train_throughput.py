"""Training cost per token on this machine's CPU: one pass of forward + backward over stored
samples, single-threaded, counted in tokens per CPU-second of the process (stable on a
shared machine, unlike wall time).

    python scripts/bench_train_throughput.py --data DIR [--draft-vocab 8192] [--epoch 2]
        [--precision bf16] [--threads 2]

--epoch 2 turns the MLP heads' ploss on (as from the third epoch of a run). --precision bf16
is the trainer's `--precision bf16`: bfloat16 autocast over fp32 weights, target in bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho.config import TrainConfig
from gumiho.ge_data.shards import load_samples
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.dataset import collate, epoch_batches
from gumiho.train.start import new_model
from gumiho.train.step import batch_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--method", default="gumiho")
    p.add_argument("--draft-vocab", type=int, default=0)
    p.add_argument("--epoch", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ploss-fraction", type=float, default=0.25)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bf16 = args.precision == "bf16"
    # on the CPU on any machine: CPU-seconds, and the CPU's autocast, measure the CPU's cost
    target = load_target("smollm2", device="cpu", dtype="bfloat16" if bf16 else "float32")
    _, samples = load_samples(args.data)
    config = TrainConfig(online=True, method=args.method, draft_vocab=args.draft_vocab)
    model = new_model(target, config, samples)
    head = DraftHead.for_model(target, model)
    batches = epoch_batches([s["input_ids"].shape[0] for s in samples], args.batch_size, 0, 0)
    tokens, start, cpu0 = 0, time.perf_counter(), time.process_time()
    for i, idx in enumerate(batches):
        batch = collate([samples[j] for j in idx])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = batch_loss(model, target, head, batch, args.method, args.epoch, 0.2,
                                 log_acc=False, p_fraction=args.ploss_fraction, seed=i)
        loss.backward()
        tokens += int(batch["valid"].sum())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    print(json.dumps({**vars(args), "tokens": tokens, "wall_s": round(wall, 1),
                      "tokens_per_cpu_s": round(tokens / cpu, 1)}))


if __name__ == "__main__":
    main()
