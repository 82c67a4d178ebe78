"""The speed report as people read it: the markdown table (R.md) and the plot (R.png) of
what `speed.report` computed."""

from __future__ import annotations

from pathlib import Path

from gumiho.config import SDPA_GQA
from gumiho.evaluation.benchmarks import LABELS


def shown_attention(recorded: str) -> str:
    """The --attention a user gave for what the answers record (the model's own name:
    sdpa runs as our grouped form, attention.py)."""
    return "sdpa" if recorded == SDPA_GQA else recorded


def markdown(rep: dict, env: dict, engine: str = "eager", versus: str = "lookup",
             baseline: str = "ar") -> str:
    lines = [f"Device: {env.get('device_name', '?')} ({env.get('device', '?')}), dtype "
             f"{env.get('dtype', '?')}"
             + (f", attention {shown_attention(env['attention'])}" if env.get("attention")
                else "")
             + f", engine {engine}, torch {env.get('torch', '?')}, "
             f"transformers {env.get('transformers', '?')}, commit "
             f"{env.get('git_commit', '?')[:10]}.", ""]
    same = "plain" if baseline == "ar" else baseline  # what `identical` compares with
    for temp, benches in rep.items():
        lines += [f"### T = {temp}", "",
                  "| benchmark | method | tokens/s | speedup | 90% interval | tau | "
                  f"tau (official formula) | same text as {same} | faster than "
                  f"{versus} (questions) | acceptance a1..a7 (unconditional) | questions "
                  f"({baseline} tokens/s on them) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        order = [b for b in LABELS if b in benches] + ["mean"]
        for bench in order:
            for label, row in sorted(benches[bench].items()):
                name = LABELS.get(bench) or mean_name(row, len(benches) - 1)
                lines.append(table_row(name, label, row, benches[bench].get(baseline)))
        lines.append("")
    return "\n".join(lines)


def mean_name(row: dict, benchmarks: int) -> str:
    """The mean row's name, with how many benchmarks it averages where that is fewer."""
    ran = len(row.get("benchmarks", ())) or benchmarks
    return "**mean**" + (f" ({ran} of {benchmarks})" if ran < benchmarks else "")


def table_row(name: str, label: str, row: dict, base_row: dict | None) -> str:
    """One row of the markdown table. Its last cell: the questions it covers and, where
    those are fewer than the baseline's row covers, the baseline's tokens/s on them (what
    its speedup divides by)."""
    acc = " ".join(f"{a:.2f}" for a in row.get("acceptance", []))
    speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
    same = "{}/{}".format(*row["identical"]) if "identical" in row else "-"
    won = "{}/{}".format(*row["wins_vs"]) if "wins_vs" in row else "-"
    span = "{:.2f}-{:.2f}".format(*row["speedup_interval"]) \
        if "speedup_interval" in row else "-"
    questions = str(row.get("questions", "-"))
    if "baseline_tokens_per_s" in row and base_row and \
            base_row.get("questions") != row.get("questions"):
        questions += f" ({row['baseline_tokens_per_s']:.1f})"
    return (f"| {name} | {label} | {row['tokens_per_s']:.1f} | {speedup} | {span} | "
            f"{row['tau']:.2f} | {row['tau_official']:.2f} | {same} | {won} | {acc} | "
            f"{questions} |")


def plot(rep: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    temps = list(rep)
    fig, axes = plt.subplots(len(temps), 2, figsize=(11, 4 * len(temps)), squeeze=False)
    for ax_row, temp in zip(axes, temps, strict=True):
        mean = rep[temp]["mean"]
        labels = sorted(mean)
        ax_row[0].bar(labels, [mean[k]["tau"] for k in labels], color="tab:blue")
        ax_row[0].set_title(f"mean tau over benchmarks (T = {temp})")
        ax_row[0].tick_params(axis="x", rotation=20)
        for label in labels:
            acc = mean[label]["acceptance"]
            ax_row[1].plot(range(1, len(acc) + 1), acc, marker="o", label=label)
        ax_row[1].set_title("per-position acceptance (unconditional)")
        ax_row[1].set_xlabel("draft position")
        ax_row[1].set_ylim(0, 1)
        ax_row[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True
