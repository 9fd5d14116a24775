"""Curves of a run: `longhorizon plot RUN_DIR` (PNG files).

It reads the rows of `metrics.jsonl` (one per iteration), so it works on a finished run, a
running one and a killed one alike. Numeric fields are plotted; nested ones (`stop_reasons`) are
not. The live loggers the trainer writes as it goes (TensorBoard, W&B) are rl/loop/loggers.py.
"""

from __future__ import annotations

from pathlib import Path

from longhorizon.inspect import load_metrics
from rl.loop.loggers import numeric_series

# what a person looks at first, in this order. A string instead of a key list: every key with that
# prefix, the page drawn even when there is none (an empty plot says "none reached" better than a missing file). What no panel takes
# goes to `seconds.png` (keys ending in _s: one unit, one axis) or `other.png`, one small axes per
# metric, so counts, bytes and rewards never share a scale.
PANELS = [
    ("reward", ["mean_reward"], "mean episode reward"),
    (
        "heldout",
        ["eval/success", "eval/ci95_low", "eval/ci95_high"],
        "held-out success (95% interval)",
    ),
    ("milestones", "milestone_rate/", "fraction of episodes reaching each milestone"),
    ("failures", "failure/", "share of episodes by how they ended"),
    ("loss", ["loss", "value_loss"], "learner loss"),
    (
        "logprob_gap",
        ["rollout_logprob_diff_mean", "rollout_logprob_diff_max"],
        "|learner − engine| log-prob",
    ),
    ("sync", ["sync_s", "sync_publish_s", "sync_load_s_max"], "weight sync seconds"),
    ("throughput", ["gen_tokens_per_s"], "generated tokens / s"),
    (
        "staleness",
        ["staleness_max", "staleness_token_mean"],
        "policy versions behind the trained weights",
    ),
]


def pages(keys: list[str]) -> list[tuple[str, list[str], str]]:
    """Which metrics go on which page: (file name, keys, title), in order. A PANELS page with a
    prefix is listed even when no key has it; `seconds` holds the remaining keys ending in _s;
    `other` every key left, each drawn on its own axes."""
    used, out = {"policy_version", "iteration"}, []
    for name, want, title in PANELS:
        mine = (
            sorted(k for k in keys if k.startswith(want))
            if isinstance(want, str)
            else [k for k in want if k in keys]
        )
        used.update(mine)
        if mine or isinstance(want, str):
            out.append((name, mine, title))
    rest = [k for k in sorted(keys) if k not in used]
    seconds = [k for k in rest if k.endswith("_s")]
    if seconds:
        out.append(("seconds", seconds, "seconds per iteration"))
    if len(seconds) < len(rest):
        out.append(
            ("other", [k for k in rest if k not in seconds], "other metrics, each on its own scale")
        )
    return out


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per panel, `seconds.png` and `other.png` for the remaining metrics; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl rows to plot")
    series = numeric_series(rows)
    out = Path(out_dir or run_dir / "plots")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    prefixes = {name: want for name, want, _ in PANELS if isinstance(want, str)}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    for name, keys, title in pages(list(series)):
        if name == "other":  # small multiples: one scale per metric
            cols = 4
            nrows = (len(keys) + cols - 1) // cols
            fig, grid = plt.subplots(
                nrows, cols, figsize=(3.2 * cols, 2.1 * nrows), dpi=100, squeeze=False
            )
            for ax, k in zip(grid.flat, keys):
                xs, ys = zip(*series[k])
                ax.plot(xs, ys, marker=".", linewidth=1)
                ax.set_title(k, fontsize=8)
                ax.tick_params(labelsize=7)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(alpha=0.3)
            for ax in list(grid.flat)[len(keys) :]:
                ax.axis("off")
            fig.suptitle(f"{title} · {run_dir.name}", fontsize=10)
            save(fig, name)
            continue
        prefix = prefixes.get(name, "")
        fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
        ax.set_title(f"{title} · {run_dir.name}", fontsize=10)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        # shares that add up to one: stacked, the most common at the bottom
        if name == "failures" and keys:
            keys = sorted(keys, key=lambda k: -sum(y for _, y in series[k]))
            xs = [x for x, _ in series[keys[0]]]
            ax.stackplot(
                xs,
                *[[y for _, y in series[k]] for k in keys],
                labels=[k.removeprefix(prefix) for k in keys],
                alpha=0.85,
            )
            ax.set_ylim(0, 1)
        else:
            for k in keys:
                xs, ys = zip(*series[k])
                ax.plot(xs, ys, marker="o", label=k.removeprefix(prefix))
        if not keys:
            ax.text(
                0.5,
                0.5,
                "none reached in this run" if name == "milestones" else "nothing recorded",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
            ax.set_xlim(rows[0]["iteration"] - 0.5, rows[-1]["iteration"] + 0.5)
        elif len(keys) > 1 or prefix:
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        ax.set_ylabel(
            "share of episodes" if prefix else "seconds" if name in ("seconds", "sync") else ""
        )
        save(fig, name)
    loads = [(r["iteration"], r["router_load"]) for r in rows if _is_load(r.get("router_load"))]
    if loads:
        save(_router_load_figure(plt, loads, run_dir.name), "router_load")
    return written


def _is_load(value) -> bool:
    """A `router_load` field as the learner writes it: layers × experts shares."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(row, list) and row for row in value)
        and len({len(row) for row in value}) == 1
        and all(isinstance(x, (int, float)) for row in value for x in row)
    )


def _router_load_figure(plt, loads: list[tuple[int, list[list[float]]]], name: str):
    """Expert load, from `router_load` (each MoE layer's share of tokens per expert, per iteration):
    the last iteration's loads relative to the mean (1 = balanced) per layer and expert, and each
    layer's max/mean over the iterations."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    its = [it for it, _ in loads]
    share_ILE = np.array([load for _, load in loads], dtype=float)
    n_experts = share_ILE.shape[-1]
    rel_ILE = share_ILE * n_experts  # load / mean load
    fig, (heat, lines) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    image = heat.imshow(rel_ILE[-1], aspect="auto", cmap="viridis", vmin=0)
    fig.colorbar(image, ax=heat, label="load / mean")
    heat.set_title(f"expert load, iteration {its[-1]}", fontsize=9)
    heat.set_xlabel("expert")
    heat.set_ylabel("MoE layer")
    heat.xaxis.set_major_locator(MaxNLocator(integer=True))
    worst_IL = rel_ILE.max(-1)
    for layer in range(worst_IL.shape[1]):
        lines.plot(its, worst_IL[:, layer], color="gray", alpha=0.35, linewidth=1)
    lines.plot(its, worst_IL.max(-1), color="C3", marker="o", label="worst layer")
    lines.plot(its, np.median(worst_IL, -1), color="C0", marker=".", label="median layer")
    lines.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    lines.set_title("max / mean expert load per layer (gray: each layer)", fontsize=9)
    lines.set_xlabel("iteration")
    lines.xaxis.set_major_locator(MaxNLocator(integer=True))
    lines.legend(fontsize=7, frameon=False)
    lines.grid(alpha=0.3)
    fig.suptitle(f"router load · {name}", fontsize=10)
    return fig
