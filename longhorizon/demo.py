"""`longhorizon demo`: the loop learning on the real policy, reported so that it cannot flatter RL.

For each demo config (`make demo`: configs/demo/calculator.yaml and shell.yaml; `make demo-long`:
configs/demo/oncall.yaml), in one run (one Ray start, one set of engines):

1. warm start on the run's learner until held-out success on *validation* seeds stops improving
   (rl/start/warm_start.py; `warm_start.patience`, capped by `warm_start.rounds`); RL starts from the best
   round, not from one stopped early so that RL has room. That policy is evaluated on *test* seeds
   (stage `warm_start`);
2. RL from it (GRPO through the full loop), watched on validation seeds (`eval.every`); the final
   policy on test seeds (stage `rl`);
3. the best warm start continued on fresh demonstrations for the wall time of the RL phase
   (iterations without their validation evaluations), on test seeds (stage `warm_start_more`): what
   RL adds over more supervised training for the same time.

An RL phase that cannot learn stops as any run does (rl/loop/guards.py: e.g. a warm start that
solves every training episode leaves no group a learning signal); the demo records why it stopped
in results.md and goes on with the weights it has, so the comparison is still made and shown.

What is tested is the config's `eval.test` cells (each a set of environment kwargs, a context mode,
episodes and the stages it is played at); the default is one cell, the run's environment, every
stage. Nothing is tuned on test seeds: the warm start's length is chosen on validation seeds, the
configs' learning rates and thresholds were (their comments say so), and test seeds are played once
per stage here.

Writes, under OUT:
    eval.json      a list of rows {env, horizon, context, stage, split, success, ci95, episodes,
                   mean_total_tokens, max_model_len}, split always `test`
    results.md     the rows as a table, with each run's warm start, RL and wall times
    curve.png      train reward and validation success against RL wall time, per environment
    horizon.png    test success against horizon per stage and context (runs whose cells vary it)
    NAME/          each run (metrics.jsonl, trajectories/, checkpoints/, warm-start/, ...); its test
                   episodes in NAME/test/STAGE (a store: `longhorizon inspect NAME/test/rl`)

`overrides` apply to every config (the slow tests run shortened demos this way).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

DEMO_CONFIGS = ["configs/demo/calculator.yaml", "configs/demo/shell.yaml"]
LONG_CONFIGS = ["configs/demo/oncall.yaml"]
STAGES = ("warm_start", "rl", "warm_start_more")


def cells(cfg) -> list[dict]:
    """The config's test cells, each with every key filled in."""
    out = []
    for cell in cfg.eval.test or [{}]:
        out.append(
            {
                "kwargs": dict(cell.get("kwargs") or {}),
                "context": dict(cell.get("context") or {}),
                "episodes": cell.get("episodes") or cfg.eval.test_episodes,
                "stages": list(cell.get("stages") or STAGES),
                "max_turns": cell.get("max_turns"),
            }
        )
    return out


def test_rows(trainer, stage: str, log) -> list[dict]:
    """Play the test cells of `stage` with the weights the workers hold; one eval.json row each."""
    cfg = trainer.cfg
    rows = []
    for i, cell in enumerate(cells(cfg)):
        if stage not in cell["stages"]:
            continue
        loop = {"context": cell["context"]} if cell["context"] else {}
        if cell["max_turns"]:
            loop["max_turns"] = cell["max_turns"]
        t0 = time.perf_counter()
        # kept in RUN_DIR/test/STAGE, a shard per cell: what each test episode did can be looked at
        s, trajs = trainer.play_held_out(
            "test", cell["episodes"], cell["kwargs"], loop, keep=f"test/{stage}/cell-{i:02d}"
        )
        kwargs = {**cfg.env.kwargs, **cell["kwargs"]}
        context = {"mode": cfg.rollout.context.mode, **cell["context"]}["mode"]
        ran = [t for t in trajs if not t.infra_error]
        row = {
            "env": s["env_id"],
            "horizon": kwargs.get("horizon"),
            "context": context,
            "stage": stage,
            "split": "test",
            "success": s["success"],
            "ci95": list(s["ci95"]),
            "episodes": s["episodes"],
            "mean_total_tokens": sum(len(t.token_ids) for t in ran) / max(1, len(ran)),
            "max_model_len": cfg.rollout.max_model_len,
            "infra_errors": s["infra_errors"],
            "seconds": time.perf_counter() - t0,
        }
        log(
            f"test: {row['env']} {'horizon ' + str(row['horizon']) + ' ' if row['horizon'] else ''}{context} "
            f"{stage}: {row['success']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}] over {row['episodes']} "
            f"episodes, {row['mean_total_tokens']:.0f} tokens each ({row['seconds']:.0f} s)"
        )
        rows.append(row)
    return rows


def run_demo(
    out_dir: str | Path,
    configs: list[str] | None = None,
    overrides: list[str] | None = None,
    console=None,
) -> list[dict]:
    from rich.console import Console

    from longhorizon.inspect import load_metrics
    from rl.config import load_config
    from rl.loop.guards import CannotLearn
    from rl.loop.trainer import Trainer

    console = console or Console(stderr=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, curves, runs, t_all = [], {}, [], time.perf_counter()
    for path in configs or DEMO_CONFIGS:
        cfg = load_config(path, list(overrides or []))
        if not cfg.eval.every:
            raise ValueError(
                f"{path}: a demo config must set eval.every (the validation curve is the point)"
            )
        run_dir = out / Path(path).stem
        trainer, t0 = Trainer(cfg, run_dir, console), time.perf_counter()
        try:
            trainer.start()
            warm_s = time.perf_counter() - t0
            rows += test_rows(trainer, "warm_start", console.log)
            stopped, flat = "", False
            try:
                rl_rows = trainer.run()
            except CannotLearn as exc:  # recorded, and the comparison still made
                stopped, flat = exc.reason, exc.flat
                console.log(f"RL stopped: {stopped}")
                rl_rows = load_metrics(run_dir)
            rows += test_rows(trainer, "rl", console.log)
            # the RL phase's wall time, without the validation evaluations it made along the way
            rl_s = sum(r["iteration_s"] - r.get("eval/s", 0.0) for r in rl_rows)
            more = {}
            if trainer.warm is not None and any(
                "warm_start_more" in c["stages"] for c in cells(cfg)
            ):
                more = trainer.warm.more(rl_s)
                rows += test_rows(trainer, "warm_start_more", console.log)
        finally:
            trainer.close()
        env_id = cfg.eval.env_id or cfg.env.id
        initial = json.loads((run_dir / "eval-initial.json").read_text())
        curves[env_id] = (initial, rl_rows)
        runs.append(
            {
                "env_id": env_id,
                "config": path,
                "iterations": len(rl_rows),
                "rl_min": rl_s / 60,
                "warm_start": trainer.warm_start_summary,
                "warm_start_min": warm_s / 60,
                "more_min": more.get("seconds", 0.0) / 60,
                "run_min": (time.perf_counter() - t0) / 60,
                "stopped": stopped,
                "no_signal": flat,
            }
        )
        # after each run: nothing is lost
        (out / "eval.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot_curves(curves, out / "curve.png")
    if any(r["horizon"] is not None for r in rows):
        plot_horizons(rows, out / "horizon.png")
    (out / "results.md").write_text(results_table(rows, runs, (time.perf_counter() - t_all) / 60))
    return rows


def _fmt(row: dict) -> str:
    lo, hi = row["ci95"]
    return f"{row['success']:.3f} [{lo:.3f}, {hi:.3f}]"


def results_table(rows: list[dict], runs: list[dict], total_min: float) -> str:
    """Markdown: per environment, horizon and context, test success (95% interval) of the best warm
    start, after RL and after more warm start for the same time; bold where RL's interval lies above
    the warm start's. Then each run's phases and wall times."""
    table = {}
    for r in rows:
        table.setdefault((r["env"], r["horizon"], r["context"]), {})[r["stage"]] = r
    lines = [
        "| environment | horizon | context | best warm start | after RL | more warm start, same time | "
        "episodes each | tokens per episode (RL) | max_model_len |",
        "| --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for (env, horizon, context), by in table.items():
        ws, rl, more = by.get("warm_start"), by.get("rl"), by.get("warm_start_more")
        rl_text = _fmt(rl) if rl else "–"
        if rl and ws and rl["ci95"][0] > ws["ci95"][1]:
            rl_text = f"**{rl_text}**"
        any_row = rl or ws or more
        lines.append(
            f"| `{env}` | {horizon if horizon is not None else '–'} | {context} | {_fmt(ws) if ws else '–'} | "
            f"{rl_text} | {_fmt(more) if more else '–'} | {any_row['episodes']} | "
            f"{(rl or any_row)['mean_total_tokens']:.0f} | {any_row['max_model_len']} |"
        )
    lines.append(
        "\n| environment | warm start | RL | more warm start | whole run |\n| --- | --- | --- | --- | ---: |"
    )
    for run in runs:
        w = run["warm_start"] or {}
        v = w.get("validation")
        ws = (
            (
                f"{w.get('rounds', 0)} round(s), best {int(w['best_round']) + 1}"
                + (f" (validation {v['success']:.3f})" if v else "")
                + f", {run['warm_start_min']:.1f} min"
            )
            if w
            else "none"
        )
        rl = f"{run['iterations']} iterations, {run['rl_min']:.1f} min"
        if run.get("stopped"):
            rl += " (stopped: no learning signal)" if run.get("no_signal") else " (stopped)"
        lines.append(
            f"| `{run['env_id']}` | {ws} | {rl} | {run['more_min']:.1f} min | {run['run_min']:.1f} min |"
        )
    for run in runs:
        if run.get("stopped"):
            lines.append(f"\nRL on `{run['env_id']}` stopped: {run['stopped']}.")
    lines.append(
        f"\nAll runs together: {total_min:.1f} min. Test seeds only; the warm start's length was chosen "
        "on validation seeds.\n"
    )
    return "\n".join(lines) + "\n"


def plot_curves(curves: dict, path: Path) -> Path:
    """Train reward and validation success against wall time (iteration seconds summed), one line per
    environment; the warm start's evaluation is at 0 s."""
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
        ax_s.plot(
            xs,
            [e["eval/success"] for _, e in evals],
            marker="o",
            color=line.get_color(),
            label=env_id,
        )
        ax_s.fill_between(
            xs,
            [e["eval/ci95_low"] for _, e in evals],
            [e["eval/ci95_high"] for _, e in evals],
            color=line.get_color(),
            alpha=0.2,
        )
    ax_r.set(xlabel="wall time of RL (min)", ylabel="mean train reward", title="train reward")
    ax_s.set(
        xlabel="wall time of RL (min)",
        ylabel="validation success",
        title="validation success (95% interval)",
        ylim=(-0.02, 1.02),
    )
    for ax in (ax_r, ax_s):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_horizons(rows: list[dict], path: Path) -> Path:
    """Test success (95% intervals) against horizon: a line per stage for the run's context mode,
    a marker per other context mode where it was tested."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["horizon"] is not None]
    main = max({r["context"] for r in rows}, key=lambda c: sum(r["context"] == c for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colours = {"warm_start": "#888", "warm_start_more": "#c80", "rl": "#26c"}
    names = {
        "warm_start": "best warm start",
        "rl": "after RL",
        "warm_start_more": "more warm start, same time",
    }
    for stage in STAGES:
        pts = sorted(
            (r["horizon"], r) for r in rows if r["stage"] == stage and r["context"] == main
        )
        if not pts:
            continue
        xs = [h for h, _ in pts]
        ax.errorbar(
            xs,
            [r["success"] for _, r in pts],
            capsize=3,
            marker="o",
            color=colours[stage],
            yerr=[
                [r["success"] - r["ci95"][0] for _, r in pts],
                [r["ci95"][1] - r["success"] for _, r in pts],
            ],
            label=f"{names[stage]} ({main})",
        )
    markers = {"window": "s", "full": "x", "compact": "^"}
    for r in rows:
        if r["context"] != main:
            ax.errorbar(
                [r["horizon"]],
                [r["success"]],
                yerr=[[r["success"] - r["ci95"][0]], [r["ci95"][1] - r["success"]]],
                marker=markers.get(r["context"], "d"),
                color=colours[r["stage"]],
                linestyle="none",
                capsize=3,
                label=f"{names[r['stage']]} ({r['context']})",
            )
    tokens = {r["horizon"]: r["max_model_len"] for r in rows}
    ax.set(
        xlabel="horizon (tool calls a solution needs)",
        ylabel="test success",
        ylim=(-0.02, 1.02),
        title=f"test success against horizon ({rows[0]['env']}, window {max(tokens.values())} tokens)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
