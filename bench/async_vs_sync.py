"""Asynchronous vs synchronous schedule: iterations per minute with slow environments, measured
in the same run on the same config.

    .venv/bin/python bench/async_vs_sync.py [--step-latency 0.5] [--iterations 16] [--repeats 2]

The config is the quickstart's (tiny Qwen3-MoE, vLLM rollout workers, GRPO learner) on
`tools/calculator-v0` whose every step sleeps `--step-latency` seconds, standing in for a remote
tool backend. Only the schedule and the learner's threads differ between the runs: sync, async
with `schedule.max_staleness=1` and with 2, each with `learner.threads` 2 and 1. In async mode a
worker runs the rollouts in flight at once on its one engine (rl/loop/trainer.py), so one iteration's
episodes generate while another's wait for their tools, and the learner trains while the engine is
busy: on these 2 cores two learner threads beside it oversubscribe them. The ratios are against
the faster of the two sync runs. An async run's first iteration waits for a whole rollout, as a
sync one does, and the later ones overlap: 16 iterations a run, so that the ratio is that of a
run's course rather than of its first iterations (a real run has hundreds). Runs alternate (each
setting in turn, then again) on one local Ray so that load on this noisy machine hits all alike;
each run's wall clock covers its iterations, not the start-up of its actors. The engine's busy
share is its time inside engine calls (generate and loads) over that wall clock. Prints a Markdown
table; `--json` prints the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step-latency", type=float, default=0.5)
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import ray
    import torch
    import vllm
    from rich.console import Console

    from rl.config import load_config
    from rl.loop.trainer import Trainer
    from rl.ray_utils import init_ray
    from rl.start.tiny import make_tiny_qwen3_moe

    tmp = Path(tempfile.mkdtemp(prefix="lh-bench-async-"))
    policy = make_tiny_qwen3_moe(tmp / "policy", seed=0)
    common = [
        f"iterations={args.iterations}",
        f"policy.path={policy}",
        "rollout.num_workers=1",
        "rollout.groups_per_iteration=2",
        "rollout.group_size=4",
        "rollout.max_turns=3",
        f"env.kwargs={{max_turns: 3, step_latency_s: {args.step_latency}}}",
        "algo.entropy_coef=0.01",
    ]
    # (schedule, max staleness, learner threads): the learner shares this machine's cores with the engine,
    # which in async mode is busy while it trains, so async is also run with one learner thread
    modes = {
        ("sync", 0, 2): ["schedule.mode=sync", "learner.threads=2"],
        ("sync", 0, 1): ["schedule.mode=sync", "learner.threads=1"],
        ("async", 1, 2): ["schedule.mode=async", "schedule.max_staleness=1", "learner.threads=2"],
        ("async", 2, 2): ["schedule.mode=async", "schedule.max_staleness=2", "learner.threads=2"],
        ("async", 1, 1): ["schedule.mode=async", "schedule.max_staleness=1", "learner.threads=1"],
        ("async", 2, 1): ["schedule.mode=async", "schedule.max_staleness=2", "learner.threads=1"],
    }
    cfg0 = load_config(REPO / "configs" / "quickstart.yaml", common)
    init_ray(cfg0.ray)
    quiet = Console(stderr=True, quiet=True)
    per_min: dict[str, list[float]] = {m: [] for m in modes}
    details: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode, extra in modes.items():
            cfg = load_config(REPO / "configs" / "quickstart.yaml", common + extra)
            trainer = Trainer(cfg, tmp / ("-".join(map(str, mode)) + f"-{r}"), console=quiet)
            trainer.start()
            try:
                t0 = time.perf_counter()
                rows = trainer.run()
                wall = time.perf_counter() - t0
                busy = ray.get(trainer.workers[0].engine_busy_s.remote())
            finally:
                trainer.close()
            per_min[mode].append(60 * len(rows) / wall)
            details[mode].append(
                {
                    "wall_s": wall,
                    "engine_busy": busy / wall,
                    "train_s": sum(x.get("train_s", 0) for x in rows),
                    "rollout_wait_s": sum(x["rollout_s"] for x in rows),
                    "staleness_max": max(x["staleness_max"] for x in rows),
                }
            )
            print(
                f"run {r} {mode}: {per_min[mode][-1]:.2f} iterations/min",
                file=sys.stderr,
                flush=True,
            )

    shutil.rmtree(tmp, ignore_errors=True)  # the runs were only measured, not kept
    med = {m: statistics.median(v) for m, v in per_min.items()}
    # the ratios are against the faster sync setting
    s = max(v for m, v in med.items() if m[0] == "sync")
    best = max((m for m in med if m[0] == "async"), key=med.get)
    result = {
        "sync_iter_per_min": s,
        "best_async": list(best),
        "ratio": med[best] / s,
        "runs": {
            "-".join(map(str, m)): {"iter_per_min": med[m], "runs": d} for m, d in details.items()
        },
        "step_latency_s": args.step_latency,
        "iterations": args.iterations,
        "repeats": args.repeats,
        "versions": {
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "ray": ray.__version__,
            "python": platform.python_version(),
        },
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"# async vs sync: tiny Qwen3-MoE, 1 vLLM worker (concurrent rollouts in async), 8 episodes/iteration, calculator env with "
        f"{args.step_latency:g} s per step; {args.iterations} iterations per run, median of {args.repeats} runs each"
    )
    print(
        f"# torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, {platform.machine()}\n"
    )
    print(
        "| schedule | max_staleness | learner threads | iterations / min | learner s per run | rollout wait s per run "
        "| engine busy | max staleness seen | vs the faster sync |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, value in med.items():
        d = details[mode]
        print(
            f"| {mode[0]} | {mode[1] if mode[0] == 'async' else '–'} | {mode[2]} | {value:.2f} | "
            f"{statistics.median(x['train_s'] for x in d):.1f} | "
            f"{statistics.median(x['rollout_wait_s'] for x in d):.1f} | "
            f"{statistics.median(x['engine_busy'] for x in d):.0%} | {max(x['staleness_max'] for x in d)} | "
            f"{value / s:.2f}× |"
        )


if __name__ == "__main__":
    main()
