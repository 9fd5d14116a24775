"""`make demo`: a quickstart that learns, on two built-in environments.

For each demo config (`configs/demo/*.yaml`): a supervised warm start on the environment's scripted
expert (TRL's SFTTrainer, rl/sft.py), then GRPO with milestone credit through the full loop (Ray,
vLLM rollout workers, the learner, weight sync), with held-out evaluation before RL and every few
iterations (rl/evaluate.py). Each run lives in `OUT/<config name>/`; then

    OUT/eval.json    per environment id: {"warm_start": {success, ci95, episodes}, "final": {...}}
    OUT/curve.png    train reward and held-out success (95% band) against wall time, per environment
    OUT/results.md   the same as a table, with each run's RL iterations and wall times
                     (`results_table`; the README's demo table is docs/demo.md's, made by it from
                     recorded runs, checked by a test)

`overrides` apply to every config (the slow test runs a shortened demo this way).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

DEMO_CONFIGS = ["configs/demo/calculator.yaml", "configs/demo/shell.yaml"]


def _held_out(ev: dict) -> dict:
    return {"success": ev["eval/success"], "ci95": [ev["eval/ci95_low"], ev["eval/ci95_high"]],
            "episodes": ev["eval/episodes"]}


def run_demo(out_dir: str | Path, configs: list[str] | None = None, overrides: list[str] | None = None,
             console=None) -> dict:
    from rl.config import load_config
    from rl.trainer import Trainer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, curves, runs, t_all = {}, {}, [], time.perf_counter()
    for path in configs or DEMO_CONFIGS:
        cfg = load_config(path, list(overrides or []))
        if not cfg.eval.every:
            raise ValueError(f"{path}: a demo config must set eval.every (the held-out curve is the point)")
        run_dir = out / Path(path).stem
        trainer, t0 = Trainer(cfg, run_dir, console), time.perf_counter()
        try:
            trainer.start()
            rows = trainer.run()
        finally:
            trainer.close()
        initial = json.loads((run_dir / "eval-initial.json").read_text())
        final = next(r for r in reversed(rows) if "eval/success" in r)
        env_id = cfg.eval.env_id or cfg.env.id
        results[env_id] = {"warm_start": _held_out(initial), "final": _held_out(final)}
        curves[env_id] = (initial, rows)
        runs.append({"env_id": env_id, "config": path, "iterations": len(rows),
                     "rl_min": sum(r["iteration_s"] for r in rows) / 60, "run_min": (time.perf_counter() - t0) / 60})
    (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    plot_curves(curves, out / "curve.png")
    (out / "results.md").write_text(results_table(results, runs, (time.perf_counter() - t_all) / 60))
    return results


def _fmt(entry: dict) -> str:
    lo, hi = entry["ci95"]
    return f"{entry['success']:.3f} [{lo:.3f}, {hi:.3f}]"


def results_table(results: dict, runs: list[dict], total_min: float) -> str:
    """Markdown: per environment, held-out success (95% interval) after the warm start and after RL,
    bold where the final interval lies above the start's; RL iterations and minutes; the total."""
    lines = ["| environment | held-out success after the warm start | after RL | episodes each | RL | whole run |",
             "| --- | --- | --- | ---: | --- | ---: |"]
    for run in runs:
        r = results[run["env_id"]]
        final = _fmt(r["final"])
        if r["final"]["ci95"][0] > r["warm_start"]["ci95"][1]:
            final = f"**{final}**"
        lines.append(f"| `{run['env_id']}` | {_fmt(r['warm_start'])} | {final} | {r['final']['episodes']} | "
                     f"{run['iterations']} iterations, {run['rl_min']:.1f} min | {run['run_min']:.1f} min |")
    lines.append(f"\nAll runs together: {total_min:.1f} min.\n")
    return "\n".join(lines) + "\n"


def plot_curves(curves: dict, path: Path) -> Path:
    """Train reward and held-out success against wall time (iteration seconds summed), one line per
    environment; the warm-started policy's evaluation is at 0 s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for env_id, (initial, rows) in curves.items():
        t, wall = 0.0, []
        for r in rows:
            t += r["iteration_s"]
            wall.append(t / 60)
        line = ax_r.plot(wall, [r["mean_reward"] for r in rows], label=env_id)[0]
        evals = [(0.0, initial)] + [(w, r) for w, r in zip(wall, rows) if "eval/success" in r]
        xs = [w for w, _ in evals]
        ax_s.plot(xs, [e["eval/success"] for _, e in evals], marker="o", color=line.get_color(), label=env_id)
        ax_s.fill_between(xs, [e["eval/ci95_low"] for _, e in evals], [e["eval/ci95_high"] for _, e in evals],
                          color=line.get_color(), alpha=0.2)
    ax_r.set(xlabel="wall time of RL (min)", ylabel="mean train reward", title="train reward")
    ax_s.set(xlabel="wall time of RL (min)", ylabel="held-out success", title="held-out success (95% interval)",
             ylim=(-0.02, 1.02))
    for ax in (ax_r, ax_s):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
