"""An iteration's metrics row, where it goes (metrics.jsonl, TensorBoard, W&B when
`log.wandb_project` is set), and the clocks behind its rates: the wall time since the last row
and the rollout engines' busy seconds over it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ray

from rl.config import LogConfig
from rl.loop.loggers import TensorBoardLog
from rl.weight_sync.transport import WORKER_LOST


class MetricsLog:
    def __init__(self, cfg: LogConfig, run_dir: Path, workers: list, run_config: dict):
        """`run_config`: the whole run's config, as W&B records it beside the metrics."""
        self.cfg, self.run_dir, self.workers, self.run_config = cfg, run_dir, workers, run_config
        self.tensorboard = None
        self.wandb = None
        self._busy_last: list[float] = []  # the engines' busy seconds at the last row
        self._last_row_t = 0.0

    def drop_from(self, iteration: int) -> None:
        """Forget the metrics rows of `iteration` on (a resumed run writes them again)."""
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["iteration"] < iteration
            ]
            path.write_text("".join(line + "\n" for line in kept))

    def start_clock(self) -> None:
        """From now on: what the engines did before (an evaluation) is no iteration's."""
        self.engine_busy()
        self._last_row_t = time.perf_counter()

    def clocks(self, t0: float) -> tuple[float | None, float]:
        """(the engines' busy seconds, the wall seconds) since the last row (or `t0`), both restarted."""
        busy = self.engine_busy()  # read first: the clock below then spans what it spans
        now = time.perf_counter()
        iteration_s = now - (self._last_row_t or t0)
        self._last_row_t = now
        return busy, iteration_s

    def engine_busy(self) -> float | None:
        """Mean seconds the rollout workers' engines spent in engine calls since the last call; None
        when a worker cannot answer (dead, restarting) or when there are no workers."""
        if not self.workers:
            return None
        try:
            now = ray.get([w.engine_busy_s.remote() for w in self.workers], timeout=30)
        except (*WORKER_LOST, ray.exceptions.GetTimeoutError):
            return None
        last = self._busy_last if len(self._busy_last) == len(now) else [0.0] * len(now)
        self._busy_last = now
        # a restarted worker counts from zero again
        return sum(n - b if n >= b else n for n, b in zip(now, last)) / len(now)

    def write(self, row: dict) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tensorboard is None:
            self.tensorboard = TensorBoardLog(self.run_dir)
        self.tensorboard.log(row)
        if self.cfg.wandb_project:
            if self.wandb is None:
                from rl.loop.loggers import WandbLog

                self.wandb = WandbLog(self.cfg, self.run_dir, self.run_config)
            self.wandb.log(row)

    def finish(self) -> None:
        """W&B writes its run file out when the run finishes."""
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        self.finish()


def progress_line(row: dict) -> str:
    loss = f"loss {row['loss']:+.4f}" if "loss" in row else "no usable episodes"
    sync = f"  sync {row['sync_s'] * 1e3:.0f} ms" if "sync_s" in row else ""
    status = f"reward {row['mean_reward']:.3f}  {loss}  v{row['policy_version']}{sync}"
    if row.get("infra_errors"):
        status += f"  infra errors {row['infra_errors']}"
    return status


def rates_line(row: dict) -> str:
    busy = f"  engine busy {row['engine_busy']:.0%}" if "engine_busy" in row else ""
    return (
        f"{row['episodes_per_s']:.2f} episodes/s  gen {row['gen_tokens_per_s']:.0f} tok/s  "
        f"staleness {row['staleness_max']}{busy}"
    )
