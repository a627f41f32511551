"""One figure from `bench_pd.sh` runs of several layouts (the same --rates each): per class (long,
short) TTFT p50 / p99 and ITL p50 / p99 against the request rate, one line per layout.

  python benchmarks/plot_pd.py OUT.png LABEL=pd_tp2.json LABEL=pd_dp2.json (the last "=" splits) ...
Runs of one rate each give bars per layout instead.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [("long", "ttft"), ("short", "ttft"), ("short", "itl")]


def bars(out: str, runs: list[tuple[str, dict]]) -> None:
    """Runs of one rate each: per panel, a p50 and a p99 bar per layout."""
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for ax, (cls, metric) in zip(axes, PANELS):
        for i, (label, rate) in enumerate(runs):
            for j, q in enumerate(("p50", "p99")):
                ax.bar(i + 0.4 * j - 0.2, rate["classes"][cls][f"{metric}_{q}_ms"], 0.4, color=f"C{i}",
                       alpha=1.0 if q == "p50" else 0.5, label=q if i == 0 else None)
        ax.set_xticks(range(len(runs)), [label for label, _ in runs], rotation=20, fontsize=7)
        ax.set(title=f"{cls} requests: {metric.upper()} p50 (dark) / p99 (light), "
                     f"{runs[0][1]['rate']:g} req/s", ylabel="ms")
        ax.title.set_fontsize(8)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(out: str, runs: list[str]) -> None:
    loaded = [(label, json.load(open(path))["rates"]) for label, path in (r.rsplit("=", 1) for r in runs)]
    if all(len(rates) == 1 for _, rates in loaded):
        return bars(out, [(label, rates[0]) for label, rates in loaded])
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for i, run in enumerate(runs):
        label, path = run.rsplit("=", 1)
        rates = json.load(open(path))["rates"]
        x = [r["rate"] for r in rates]
        for ax, (cls, metric) in zip(axes, PANELS):
            for q, style in (("p50", "-o"), ("p99", "--x")):
                y = [r["classes"][cls][f"{metric}_{q}_ms"] for r in rates]
                ax.plot(x, y, style, color=f"C{i}", label=f"{label} {q}")
    for ax, (cls, metric) in zip(axes, PANELS):
        ax.set(title=f"{cls} requests: {metric.upper()}", xlabel="request rate (req/s)", ylabel="ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
