"""PNG chart of a `bench/serve.py` report: one row per dataset; columns TTFT (p50 solid,
p90 dashed), TPOT p50 and output tokens/s, each against the request rate; one colour per
server."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"tandem": "tab:blue", "vllm": "tab:orange"}


def plot(report: dict, path: Path) -> None:
    servers = report["servers"]
    if not servers:
        return
    datasets = list(next(iter(servers.values()))["runs"])
    fig, axes = plt.subplots(len(datasets), 3, figsize=(13, 3.6 * len(datasets)),
                             squeeze=False)
    for row, ds in zip(axes, datasets, strict=True):
        for name, res in servers.items():
            runs = res["runs"][ds]
            labels = [str(r["rate"]) for r in runs]
            x = list(range(len(runs)))
            color = COLORS.get(name)
            row[0].plot(x, [r["ttft"]["p50"] for r in runs], "o-", color=color,
                        label=f"{name} p50")
            row[0].plot(x, [r["ttft"]["p90"] for r in runs], "o--", color=color,
                        alpha=0.6, label=f"{name} p90")
            row[1].plot(x, [r["tpot"]["p50"] for r in runs], "o-", color=color, label=name)
            row[2].plot(x, [r["output_throughput"] for r in runs], "o-", color=color,
                        label=name)
        for ax, title in zip(row, ("TTFT (s)", "TPOT p50 (s)", "output tokens/s"),
                             strict=True):
            ax.set_title(f"{ds}: {title}")
            ax.set_xticks(x, labels)
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    m = report.get("machine", {})
    fig.suptitle(f"bench/serve.py {report.get('date', '')} - {m.get('cpu_model', '')}, "
                 f"{m.get('cores', '?')} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
