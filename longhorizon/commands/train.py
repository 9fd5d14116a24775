"""`longhorizon train`: an RL job from a config (or `--resume RUN_DIR`, or `--from-store`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from longhorizon.errors import message, unwritable
from longhorizon.terminal import SafeConsole


def run(args) -> int:
    from rl.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.config and "=" in args.config and not Path(args.config).exists():
        overrides.insert(0, args.config)  # `train --resume DIR key=value`: an override, not a file
        args.config = None
    if args.iterations is not None:
        overrides.append(f"iterations={args.iterations}")
    if args.address:
        overrides.append(f"ray.address={args.address}")
    if args.checkpoint and not args.resume:
        print(
            "error: --checkpoint names the checkpoint a --resume starts from; give --resume RUN_DIR too",
            file=sys.stderr,
        )
        return 2
    if args.resume:
        run_dir = Path(args.resume)
        # the config as run, unless another is given
        config = args.config or run_dir / "config.yaml"
        if not Path(config).exists():
            print(f"error: nothing to resume in {run_dir}: no {config}", file=sys.stderr)
            return 2
    elif args.config:
        config = args.config
        run_dir = Path(
            args.run_dir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    else:
        print("error: train needs a CONFIG, or --resume RUN_DIR", file=sys.stderr)
        return 2
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    # paths and sandboxes of this machine (--from-store makes no environment); a cluster's nodes check their own
    problem = cfg.local_problem(with_envs=not args.from_store)
    if problem:
        print(f"error: {config}: {problem}", file=sys.stderr)
        return 2
    problem = unwritable(run_dir)
    if problem:
        print(f"error: run directory {problem}", file=sys.stderr)
        return 2
    console = SafeConsole(stderr=True)

    from rl.learner.checkpoints import CheckpointError
    from rl.loop.guards import CannotLearn
    from rl.loop.trainer import LearnerDied, Trainer, WorkerLost
    from rl.start.pretrained import PretrainedError

    try:
        trainer = Trainer(cfg, run_dir, console, from_store=args.from_store)
    except FileNotFoundError as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    try:
        trainer.start(resume=bool(args.resume), checkpoint=args.checkpoint)
        trainer.run()
    except (FileExistsError, FileNotFoundError, CheckpointError, PretrainedError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    except (
        LearnerDied,
        WorkerLost,
        CannotLearn,
    ) as exc:  # what was written is kept; the message says how to go on
        print(f"error: {message(exc)}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    console.print(f"[bold green]done[/]: run directory {run_dir.resolve()}")
    console.print(f"  metrics      {run_dir / 'metrics.jsonl'}")
    console.print(f"  trajectories {run_dir / 'trajectories'}")
    console.print(f"  checkpoints  {run_dir / 'checkpoints'}")
    console.print(f"  look at it:  longhorizon inspect {run_dir}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="run an RL job")
    p.add_argument("config", nargs="?", help="YAML run config, e.g. configs/quickstart.yaml")
    p.add_argument("--run-dir", help="where the run writes everything (default runs/NAME-TIME)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    p.add_argument(
        "--checkpoint",
        metavar="NAME",
        help="with --resume: continue from this checkpoint (e.g. "
        "version-000008) instead of the latest",
    )
    p.add_argument("--iterations", type=int, help="override the config's iterations")
    p.add_argument(
        "--address",
        help="join this running Ray cluster (GCS address HOST:PORT) instead of starting "
        "a local one; same as ray.address=...",
    )
    p.add_argument(
        "--from-store",
        metavar="RUN_DIR",
        help="no rollouts: iteration i trains on the i-th trajectory shard of RUN_DIR",
    )
    p.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. rollout.group_size=8"
    )
    p.set_defaults(fn=run)
