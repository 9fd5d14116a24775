"""Live metric loggers: what the trainer writes as it goes, one metrics row per iteration.

`TensorBoardLog` writes `RUN_DIR/tensorboard/`, so `tensorboard --logdir runs/` shows live runs;
`WandbLog` sends the same rows to Weights & Biases when `log.wandb_project` is set (offline by
default: `RUN_DIR/wandb/`, uploaded later with `wandb sync`). Numeric fields are logged; nested
ones (`stop_reasons`) are not. PNG curves of a finished run are `longhorizon plot`.
"""

from __future__ import annotations

from pathlib import Path


def numeric_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
                series.setdefault(k, []).append((int(row["iteration"]), float(v)))
    return series


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

    def __init__(self, log, run_dir: str | Path, config: dict):
        """`log`: the run's LogConfig; `config`: the whole run's, recorded with the run."""
        import wandb

        self.run = wandb.init(
            project=log.wandb_project,
            entity=log.wandb_entity or None,
            mode=log.wandb_mode,
            dir=str(Path(run_dir)),
            name=Path(run_dir).name,
            config=config,
            resume="allow",
            id=_wandb_id(run_dir),
            # the trainer has its own progress display; W&B's banner and console capture would garble it
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, row: dict) -> None:
        self.run.log(
            {k: pts[0][1] for k, pts in numeric_series([row]).items()}, step=int(row["iteration"])
        )

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_dir) -> str:
    """One W&B run per run directory, kept across `--resume` (its id is stored next to the metrics)."""
    import uuid

    path = Path(run_dir) / "wandb-run-id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()
