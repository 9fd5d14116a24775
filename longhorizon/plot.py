"""Curves of a run: `longhorizon plot RUN_DIR` (PNG files).

It reads the rows of `metrics.jsonl` (one per iteration), so it works on a finished run, a
running one and a killed one alike. Numeric fields are plotted; nested ones (`stop_reasons`) are
not. The live loggers the trainer writes as it goes (TensorBoard, W&B) are rl/loggers.py.
"""

from __future__ import annotations

from pathlib import Path

from longhorizon.inspect import load_metrics
from rl.loggers import numeric_series

# what a person looks at first, in this order; every other numeric field goes on the last page
PANELS = [
    ("reward", ["mean_reward"], "mean episode reward"),
    ("heldout", ["eval/success", "eval/ci95_low", "eval/ci95_high"], "held-out success (95% interval)"),
    ("milestones", None, "fraction of episodes reaching each milestone"),
    ("loss", ["loss", "value_loss"], "learner loss"),
    ("logprob_gap", ["rollout_logprob_diff_mean", "rollout_logprob_diff_max"], "|learner − engine| log-prob"),
    ("sync", ["sync_s", "sync_publish_s", "sync_load_s_max"], "weight sync seconds"),
    ("throughput", ["gen_tokens_per_s"], "generated tokens / s"),
    ("staleness", ["staleness_max", "staleness_token_mean"], "policy versions behind the trained weights"),
]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per panel (and `other.png` for the remaining metrics); returns their paths."""
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
    used, written = {"policy_version"}, []
    panels = list(PANELS) + [("other", sorted(k for k in series if not k.startswith("milestone_rate/")), "other metrics")]
    for name, keys, title in panels:
        if keys is None:
            keys = sorted(k for k in series if k.startswith("milestone_rate/"))
        if name == "other":
            keys = [k for k in keys if k not in used]
        keys = [k for k in keys if k in series]
        if not keys:
            continue
        used.update(keys)
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        for k in keys:
            xs, ys = zip(*series[k])
            ax.plot(xs, ys, marker="o", label=k.removeprefix("milestone_rate/"))
        ax.set_title(f"{title} · {run_dir.name}", fontsize=10)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(keys) > 1 or name == "milestones":
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
