"""`longhorizon eval`: held-out success of a run's newest checkpoint, or any checkpoint (rl/loop/evaluate.py)."""

from __future__ import annotations

import json
import sys

from longhorizon.errors import message


def run(args) -> int:
    """Held-out evaluation of a run's latest checkpoint (or its initial policy), or of a checkpoint."""
    from longhorizon.serve import policy_of
    from rl.config import ConfigError

    env_kwargs = {}
    try:
        policy, rollout, cfg = policy_of(args.target)
        if cfg is not None and args.env in (None, cfg.env.id):
            args.env, env_kwargs = cfg.env.id, dict(cfg.env.kwargs)
        if args.env is None:
            raise ValueError(
                "--env is required for a checkpoint (a run directory defaults to its environment)"
            )
        import envs

        if args.episodes < 1 or not 1 <= args.k <= args.episodes:
            raise ValueError(
                f"--episodes must be >= 1 and --k between 1 and --episodes (got --episodes "
                f"{args.episodes} --k {args.k})"
            )
        if args.env_kwargs:
            try:
                env_kwargs = json.loads(args.env_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--env-kwargs is not JSON: {exc}") from None
            if not isinstance(env_kwargs, dict):
                raise ValueError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
        if args.temperature is not None and args.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature:g}")
        problem = envs.config_problem(args.env, env_kwargs)
        if problem:
            raise ValueError(f"--env{'-kwargs' if problem[0] == 'kwargs' else ''}: {problem[1]}")
        why = envs.host_problem(args.env, env_kwargs)
        if why:
            raise ValueError(f"--env {args.env} cannot run on this machine: {why}")
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    from rl.loop.evaluate import evaluate_policy

    try:
        summary, _ = evaluate_policy(
            str(policy),
            rollout,
            args.env,
            args.episodes,
            k=args.k,
            env_kwargs=env_kwargs,
            temperature=args.temperature,
            seed=args.seed,
            split=args.split,
        )
    except (RuntimeError, OSError) as exc:  # the engine's or an environment's failure, as one line
        print(f"error: the evaluation failed: {message(exc)}", file=sys.stderr)
        return 1
    summary["policy"] = str(policy)
    if args.json:
        print(json.dumps(summary))
        return 0
    lo, hi = summary["ci95"]
    print(f"{summary['env_id']} on {summary['episodes']} held-out episodes of {policy}:")
    print(f"  success        {summary['success']:.3f}  (95% CI {lo:.3f}–{hi:.3f})")
    print(
        f"  milestones     {summary['milestones_mean']:.2f} per episode, reward {summary['reward_mean']:.3f}"
    )
    if args.k > 1:
        print(f"  pass@{args.k}         {summary[f'pass@{args.k}']:.3f}")
    if summary["infra_errors"]:
        print(f"  infra errors   {summary['infra_errors']} (not counted)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="success rate on held-out seeds (95%% interval), milestones, pass@k"
    )
    p.add_argument("target", metavar="RUN_DIR|CHECKPOINT")
    p.add_argument("--env", help="environment id (default: the run's)")
    p.add_argument(
        "--env-kwargs",
        help="environment arguments as JSON (default: the run's, for its environment)",
    )
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument(
        "--k", type=int, default=1, help="episodes per held-out seed; reports pass@k when > 1"
    )
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the run's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split",
        choices=["validation", "test"],
        default="validation",
        help="held-out seeds to play: validation (what is tuned or watched) or test (what is reported)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=run)
