"""Curves of a run: `longhorizon plot RUN_DIR` (PNG files) and TensorBoard event files.

Both read the rows of `metrics.jsonl` (one per iteration), so they work on a finished run, a
running one and a killed one alike. Numeric fields are plotted; nested ones (`stop_reasons`) are
not. `TensorBoardLog` is what the trainer writes as it goes (`RUN_DIR/tensorboard/`), so
`tensorboard --logdir runs/` shows live runs; `WandbLog` sends the same rows to Weights & Biases
when `log.wandb_project` is set (offline by default: `RUN_DIR/wandb/`, uploaded later with
`wandb sync`).
"""

from __future__ import annotations

from pathlib import Path

from rl.inspect import load_metrics

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


def numeric_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
                series.setdefault(k, []).append((int(row["iteration"]), float(v)))
    return series


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


class TensorBoardLog:
    """Scalars of each metrics row under `RUN_DIR/tensorboard/`, step = iteration."""

    def __init__(self, run_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, row: dict) -> None:
        for k, points in numeric_series([row]).items():
            self.writer.add_scalar(k, points[0][1], global_step=int(row["iteration"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """The metrics rows as a Weights & Biases run (step = iteration), the run config as its config."""

    def __init__(self, cfg, run_dir: str | Path):
        import dataclasses

        import wandb

        log = cfg.log
        self.run = wandb.init(
            project=log.wandb_project, entity=log.wandb_entity or None, mode=log.wandb_mode,
            dir=str(Path(run_dir)), name=Path(run_dir).name, config=dataclasses.asdict(cfg),
            resume="allow", id=_wandb_id(run_dir),
            # the trainer has its own progress display; W&B's banner and console capture would garble it
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, row: dict) -> None:
        self.run.log({k: pts[0][1] for k, pts in numeric_series([row]).items()}, step=int(row["iteration"]))

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_dir) -> str:
    """One W&B run per run directory, kept across `--resume` (its id is stored next to the metrics)."""
    import uuid

    path = Path(run_dir) / "wandb-run-id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()
