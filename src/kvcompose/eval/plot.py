"""The fidelity plot: what each policy keeps of the model's behaviour against the memory it really uses."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

KL_FLOOR = 1e-6  # KL below this (fullkv's self-check) is noted on the KL panel instead of plotted


def plot_fidelity(rows: list[dict], path: str | Path, title: str | None = None, topk: int = 10,
                  basis: str = "bfloat16") -> Path:
    """Write a PNG: top-1 agreement, mean KL and top-k key recall against measured KV memory %.

    ``rows`` are :meth:`FidelityResult.rows` dicts. One point per policy (and budget);
    points of one preset are joined in memory order so a budget sweep reads as a curve.
    ``basis``: the dtype of the full cache the memory is a percentage of.
    Uses matplotlib's Agg canvas directly, so it never touches a display or pyplot state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from matplotlib import colormaps

    fig = Figure(figsize=(15, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    panels = [
        ("agreement", 100.0, "top-1 agreement with full KV (%)", False),
        ("kl_mean", 1.0, "mean KL(full ‖ policy) (nats)", True),
        ("recall_mean", 100.0, f"top-{topk} attention-key recall (%)", False),
    ]
    by_preset: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_preset[r["preset"]].append(r)
    palette = colormaps["tab10" if len(by_preset) <= 10 else "tab20"]  # one color per preset
    for i, (preset, group) in enumerate(sorted(by_preset.items())):
        group = sorted(group, key=lambda r: r["memory_pct_mean"])
        color = palette(i % palette.N)
        marker = "*" if preset == "fullkv" else "o"
        for ax, (key, scale, _, log) in zip(axes, panels):
            # On the log KL panel, a (self-checked) KL of ~0 would squash every real point into one band.
            shown = [r for r in group if not (log and r[key] < KL_FLOOR)]
            if not shown:
                continue
            xs = [r["memory_pct_mean"] for r in shown]
            ys = [r[key] * scale for r in shown]
            ax.plot(xs, ys, marker=marker, markersize=11 if marker == "*" else 6, color=color, label=preset)
            for r, x, y in zip(shown, xs, ys):
                ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    for ax, (_, _, ylabel, log) in zip(axes, panels):
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    fig.supxlabel(f"KV memory, % of a full {basis} cache of the same tokens (measured, mean over steps)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside right center")
    tiny = [r["label"] for r in rows if r["kl_mean"] < KL_FLOOR]
    if tiny:
        axes[1].text(0.02, 0.02, f"KL < {KL_FLOOR:g} (not drawn): {', '.join(tiny)}", transform=axes[1].transAxes,
                     fontsize=7, color="0.4")
    if title:
        fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
