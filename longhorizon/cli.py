"""`longhorizon`: the command line.

longhorizon train CONFIG [--run-dir DIR] [--iterations N] [--address HOST:PORT] [section.key=value ...]
longhorizon train --resume DIR [--iterations N] [--address HOST:PORT]
longhorizon train CONFIG --from-store RUN_DIR [...]   # learner only, on stored trajectories
longhorizon inspect DIR [--episode ID [--tokens]] [--episodes FILTERS] [--json] [--html OUT.html]
longhorizon replay DIR (--episode ID | --all) [--rescore RUBRIC] [--json]
longhorizon export DIR [--out FILE] [--format jsonl|datasets]
longhorizon plot DIR [--out DIR]
longhorizon eval RUN_DIR|CHECKPOINT --env ID --episodes N [--k K] [--json]   (rl/loop/evaluate.py)
longhorizon demo [--out runs/demo] [--config C ...] [key=value ...]          (longhorizon/demo.py)
longhorizon submit CONFIG --address http://HEAD:8265 [--wait] [key=value ...]   (longhorizon/jobs.py)
longhorizon jobs status|logs|stop ID --address http://HEAD:8265
longhorizon policy info CONFIG [--json]
longhorizon policy upcycle SRC --experts E [--top-k K] --out DIR [--json]   (rl/start/pretrained.py)
longhorizon policy pretrained NAME [--experts E --top-k K]   # into the local cache; prints the path
longhorizon serve RUN_DIR|CHECKPOINT [--host H --port P --api-key K]   # OpenAI-compatible API (longhorizon/serve.py)
longhorizon envs list|show|check|play ...          (longhorizon/envs_cli.py)
longhorizon sandbox run [--backend B] ... -- CMD   (longhorizon/envs_cli.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from longhorizon.errors import message
from longhorizon.terminal import SafeConsole, visible


def _train(args) -> int:
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

    try:
        trainer = Trainer(cfg, run_dir, console, from_store=args.from_store)
    except FileNotFoundError as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    try:
        trainer.start(resume=bool(args.resume), checkpoint=args.checkpoint)
        trainer.run()
    except (FileExistsError, FileNotFoundError, CheckpointError) as exc:
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


def unwritable(directory: Path) -> str | None:
    """Why `directory` (made if missing) cannot hold a run's files, or None: found before anything
    starts, not as a PermissionError traceback from the first file a run writes."""
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as exc:
        return f"{directory} cannot be written ({exc.strerror or type(exc).__name__})"
    return None


def _inspect(args) -> int:
    from longhorizon import inspect as insp

    # piped, rich would cut tables at 80 columns ("miles…"); a wide console keeps every cell whole
    console = SafeConsole() if sys.stdout.isatty() else SafeConsole(width=400)
    try:
        if args.group is not None:
            view = insp.group_view(args.run_dir, args.group)
            if args.json:
                print(json.dumps(view, indent=2))
            else:
                insp.print_group(view, console)
        elif args.html:
            from longhorizon.viewer import write_html

            print(f"wrote {write_html(args.run_dir, args.html)}")
        elif args.episodes:
            rows = insp.episode_list(
                args.run_dir,
                env=args.env,
                min_reward=args.min_reward,
                max_reward=args.max_reward,
                version=args.version,
                min_generated=args.min_generated,
                max_generated=args.max_generated,
                stop=args.stop,
                failure=args.failure,
                min_tool_errors=args.min_tool_errors,
            )
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                insp.print_episode_list(rows, console, limit=args.limit)
        elif args.episode and args.tokens:
            page = insp.token_rows(args.run_dir, args.episode, start=args.start, count=args.count)
            if args.json:
                print(json.dumps(page, indent=2))
            else:
                insp.print_tokens(page, console)
        elif args.json and args.episode:
            print(json.dumps(insp.episode_json(args.run_dir, args.episode)))
        elif args.json:
            print(json.dumps(insp.summary(args.run_dir), indent=2))
        elif args.episode:
            insp.print_episode(args.run_dir, args.episode, SafeConsole())
        else:
            insp.print_summary(args.run_dir, console)
    except (OSError, KeyError, ValueError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    return 0


def _replay(args) -> int:
    from longhorizon.replay import (
        agent_tokenizer,
        replay_episode,
        rescore,
        run_env_kwargs,
        run_rollout,
    )
    from rl.store import TrajectoryStore

    try:
        store = TrajectoryStore(args.run_dir)
        if not store.shards():
            raise FileNotFoundError(f"{args.run_dir} holds no trajectory shards")
        trajs = [
            t
            for t in store.trajectories(strict=not args.skip_corrupt)
            if args.all or t.episode_id == args.episode
        ]
        _report_skipped(store)
        if not trajs:
            raise KeyError(f"no episode {args.episode!r} in {args.run_dir}")
        if args.rescore:
            judge: dict = {}
            rows = rescore(trajs, args.rescore, args.run_dir, judge)
            if judge:  # on stderr: --json output is the only thing on stdout
                print(
                    f"judge: {judge['cache_hits']} of {judge['requests']} scores from the run's cache",
                    file=sys.stderr,
                )
            parts = lambda r: (
                "  (" + ", ".join(f"{k} {v:g}" for k, v in r["parts"].items()) + ")"
                if len(r["parts"]) > 1
                else ""
            )  # noqa: E731
            print(
                json.dumps(rows, indent=2)
                if args.json
                else "\n".join(
                    f"{r['episode_id']}: not scored ({r['not_scored']})"
                    if r["rescored"] is None
                    else f"{r['episode_id']}: {r['recorded']:g} -> {r['rescored']:g}{parts(r)}"
                    for r in rows
                )
            )
            return 0
        kwargs = run_env_kwargs(args.run_dir)
        # None unless an agent program's episode, or one of several context segments, is replayed
        tokenizer = agent_tokenizer(args.run_dir, trajs)
        rollout = run_rollout(args.run_dir) if tokenizer is not None else None
        results = [replay_episode(t, kwargs, tokenizer=tokenizer, rollout=rollout) for t in trajs]
    except (OSError, KeyError, ValueError, ImportError, AttributeError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    bad = [r for r in results if not r.ok]
    skipped = [r for r in results if r.not_replayed]
    if args.json:
        print(
            json.dumps(
                {
                    "replayed": len(results) - len(skipped),
                    "diverged": len(bad),
                    "not_replayed": len(skipped),
                    "results": [r.to_dict() for r in results],
                },
                indent=2,
            )
        )
    else:
        for r in bad:
            print(visible(f"{r.episode_id}: DIVERGED at {r.divergence}"))
        for r in skipped:
            print(visible(f"{r.episode_id}: not replayed: {r.not_replayed}"))
        print(
            f"replayed {len(results) - len(skipped)} episode(s): {len(results) - len(bad) - len(skipped)} identical, "
            f"{len(bad)} diverged"
            + (f"; {len(skipped)} never ran (infra errors), not replayed" if skipped else "")
        )
    return 1 if bad else 0


def _report_skipped(store) -> None:
    if store.corrupt:  # --skip-corrupt: say what was left out
        print(
            visible(
                f"warning: skipped {len(store.corrupt)} corrupt trajectory shard(s): "
                f"{', '.join(Path(s).name for s in store.corrupt)}"
            ),
            file=sys.stderr,
        )


def _export(args) -> int:
    from rl.store import TrajectoryStore

    store = TrajectoryStore(args.run_dir)
    if not store.shards():
        print(f"error: {args.run_dir} holds no trajectory shards", file=sys.stderr)
        return 2
    strict = not args.skip_corrupt
    bad = store.unreadable() if strict else []
    if bad:  # before anything is written
        print(
            visible(f"error: {bad[0]} ({len(bad)} in all; --skip-corrupt leaves them out)"),
            file=sys.stderr,
        )
        return 2
    import warnings

    from rl.store import CorruptShard

    default = "trajectories-dataset" if args.format == "datasets" else "trajectories.jsonl"
    out = Path(args.out or Path(args.run_dir) / default)
    if not out.parent.is_dir():
        print(f"error: --out {out}: its directory {out.parent} does not exist", file=sys.stderr)
        return 2
    # reported below, once
    warnings.filterwarnings("ignore", message="skipping corrupt trajectory shard")
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if args.format == "datasets":  # a `datasets` directory: datasets.load_from_disk(OUT)
            import tempfile

            from datasets import Dataset, Features
            from datasets.exceptions import DatasetGenerationError

            from rl.store import SCHEMA

            # a private cache: datasets would otherwise reuse an earlier export of the same store, stale
            with tempfile.TemporaryDirectory() as cache:
                # the store's own column types (int32 ids, int8 mask, float32 log-probs, nested expert
                # ids): inferred from Python values they would widen to int64/float64, and an all-None
                # column to null
                try:
                    ds = Dataset.from_generator(
                        store.rows,
                        gen_kwargs={"strict": strict},
                        cache_dir=cache,
                        features=Features.from_arrow_schema(SCHEMA),
                    )
                except DatasetGenerationError as exc:  # datasets wraps what the generator raised
                    if isinstance(exc.__cause__, CorruptShard):
                        raise exc.__cause__ from None
                    raise
                # only once every row was read: a failure leaves OUT as it was
                ds.save_to_disk(str(out))
            n = len(ds)
        else:
            n = 0
            with open(tmp, "w") as fh:  # renamed into place only when complete
                for row in store.rows(strict=strict):
                    fh.write(json.dumps(row) + "\n")
                    n += 1
            tmp.replace(out)
    except CorruptShard as exc:  # a shard whose ids read but whose other columns do not
        tmp.unlink(missing_ok=True)
        print(f"error: {message(exc)} (--skip-corrupt leaves it out)", file=sys.stderr)
        return 2
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"error: --out {out}: {message(exc)}", file=sys.stderr)
        return 2
    _report_skipped(store)
    print(
        f"wrote {n} episodes to {out}"
        + (" (datasets.load_from_disk)" if args.format == "datasets" else "")
    )
    return 0


def _submit(args) -> int:
    from longhorizon import jobs
    from rl.config import ConfigError

    try:
        job_id, run_dir = jobs.submit(
            args.config,
            args.address,
            overrides=args.overrides,
            run_dir=args.run_dir,
            python=args.python,
        )
    except (ConfigError, ConnectionError, FileNotFoundError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    # the jobs API's refusal (e.g. "No available agent to submit job"), as one line
    except RuntimeError as exc:
        print(
            f"error: the cluster at {args.address} did not take the job: {message(exc)}",
            file=sys.stderr,
        )
        return 1
    print(f"submitted {job_id}; run directory on the head: {run_dir}")
    if not args.wait:
        print(f"follow it: longhorizon jobs logs {job_id} --address {args.address}")
        return 0
    try:
        state = jobs.wait(args.address, job_id, timeout_s=args.timeout)
    except (ConnectionError, RuntimeError) as exc:
        print(f"error: following job {job_id}: {message(exc)}", file=sys.stderr)
        return 1
    print(f"job {job_id}: {state}")
    return 0 if state == "SUCCEEDED" else 1


def _jobs(args) -> int:
    from longhorizon import jobs

    try:
        if args.action == "status":
            print(jobs.status(args.address, args.job_id))
        elif args.action == "logs":
            print(jobs.logs(args.address, args.job_id), end="")
        else:
            print("stopped" if jobs.stop(args.address, args.job_id) else "not running")
    except (
        ConnectionError,
        RuntimeError,
    ) as exc:  # RuntimeError: the jobs API's answer for an unknown id
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    return 0


def _eval(args) -> int:
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


def _demo(args) -> int:
    from longhorizon.demo import DEMO_CONFIGS, run_demo
    from rl.config import ConfigError
    from rl.loop.guards import CannotLearn
    from rl.loop.trainer import LearnerDied, WorkerLost

    console = SafeConsole(stderr=True)
    problem = unwritable(Path(args.out))
    if problem:
        print(f"error: --out {problem}", file=sys.stderr)
        return 2
    try:
        rows = run_demo(args.out, args.config or DEMO_CONFIGS, args.overrides, console)
    except (ConfigError, ValueError, FileExistsError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    except (
        LearnerDied,
        WorkerLost,
        CannotLearn,
    ) as exc:  # what was written is kept; the message says how to go on
        print(f"error: {message(exc)}", file=sys.stderr)
        return 1
    console.print((Path(args.out) / "results.md").read_text(), markup=False, highlight=False)
    console.print(
        f"wrote {Path(args.out) / 'eval.json'} ({len(rows)} test rows), results.md and curve.png"
    )
    return 0


def _plot(args) -> int:
    from longhorizon.plot import plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except (OSError, ValueError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


def _policy_info(args) -> int:
    from policy.args import load_model_args
    from policy.info import human, policy_info
    from rl.config import ConfigError

    try:
        info = policy_info(load_model_args(args.config))
    except ConfigError as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"policy {info['name']} ({args.config})", show_header=False)
    rows = [
        (
            "layers",
            f"{info['layers']} ({info['kda_layers']} KDA, {info['mla_layers']} MLA; "
            f"{info['dense_layers']} dense, {info['moe_layers']} MoE)",
        ),
        ("pattern", info["layer_pattern"]),
        ("total parameters", human(info["total_params"])),
        ("active parameters / token", human(info["active_params"])),
        ("cache bytes / token (MLA, bf16)", f"{info['cache_bytes_per_token']:,}"),
        ("state bytes / sequence (KDA)", f"{info['state_bytes_per_sequence']:,}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    SafeConsole().print(table)
    return 0


def _policy_upcycle(args) -> int:
    """Dense Llama-family checkpoint (or a packaged pretrained model's name) → sparse-MoE Mixtral."""
    from rl.start.pretrained import PRETRAINED, PretrainedError, dense, upcycle

    out = Path(args.out)
    try:
        if out.exists():
            raise PretrainedError(f"--out {out} already exists (choose a new directory)")
        src = dense(args.src) if args.src in PRETRAINED else Path(args.src)
        result = upcycle(src, out, args.experts, args.top_k, seed=args.seed)
    except (PretrainedError, OSError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    summary = {
        "path": str(result.path),
        "source": str(src),
        "experts": args.experts,
        "top_k": args.top_k,
        "total_params": result.total_params,
        "active_params": result.active_params,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {result.path}: {args.experts} experts, top-{args.top_k}, "
            f"{result.total_params / 1e6:.1f}M total / {result.active_params / 1e6:.1f}M active parameters"
        )
    return 0


def _policy_pretrained(args) -> int:
    """Convert a packaged pretrained model into the local cache (what `make install` runs)."""
    from rl.start.pretrained import PretrainedError, policy

    try:
        path = policy(args.name, args.experts, args.top_k)  # experts 0: the dense model alone
    except (PretrainedError, OSError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    print(path)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (it prints the usage block first); subcommands' parsers
    are of this class too."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, its control characters visible (it may name a crafted file)."""
    print(visible(f"warning: {message}"), file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="longhorizon", description="Agentic RL post-training of sparse-MoE LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

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
    p.set_defaults(fn=_train)

    p = sub.add_parser("submit", help="run a training job on a Ray cluster (Ray Jobs API)")
    p.add_argument("config")
    p.add_argument(
        "--address", required=True, help="the cluster's jobs endpoint, e.g. http://HEAD:8265"
    )
    p.add_argument(
        "--run-dir", help="run directory on the head (default ~/longhorizon-runs/NAME-TIME)"
    )
    p.add_argument(
        "--python",
        default=None,
        help="the cluster's Python with the project installed (default: the one running Ray on the head)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="follow the job's log until it ends; exit 1 unless it succeeded",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=24 * 3600,
        help="with --wait: give up after this many seconds",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(fn=_submit)

    p = sub.add_parser("jobs", help="a submitted job's status, logs, or stop it")
    p.add_argument("action", choices=["status", "logs", "stop"])
    p.add_argument("job_id")
    p.add_argument(
        "--address", required=True, help="the cluster's jobs endpoint, e.g. http://HEAD:8265"
    )
    p.set_defaults(fn=_jobs)

    from rollout.trajectory import FAILURE_KINDS, STOP_REASONS

    p = sub.add_parser("inspect", help="summarise a run, or show one episode")
    p.add_argument("run_dir")
    p.add_argument("--episode", help="episode id to show turn by turn")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.add_argument(
        "--html", metavar="OUT.html", help="write a self-contained HTML viewer of the run"
    )
    p.add_argument("--episodes", action="store_true", help="list episodes (filters below)")
    p.add_argument("--env", help="only this environment id")
    p.add_argument("--min-reward", type=float)
    p.add_argument("--max-reward", type=float)
    p.add_argument("--version", type=int, help="only episodes with a turn of this policy version")
    p.add_argument("--min-generated", type=int, help="at least this many generated tokens")
    p.add_argument("--max-generated", type=int)
    p.add_argument("--stop", help=f"only this stop reason ({', '.join(STOP_REASONS)})")
    p.add_argument("--failure", help=f"only this failure kind ({', '.join(FAILURE_KINDS)})")
    p.add_argument(
        "--min-tool-errors", type=int, help="only episodes with at least this many tool errors"
    )
    p.add_argument(
        "--group",
        type=int,
        help="one GRPO group side by side: rewards, advantages, failures, "
        "tools per turn, where each departs from the best",
    )
    p.add_argument("--limit", type=int, default=50, help="rows shown (default 50)")
    p.add_argument("--tokens", action="store_true", help="with --episode: a page of its tokens")
    p.add_argument("--start", type=int, default=0, help="first token of the page")
    p.add_argument("--count", type=int, default=200, help="tokens per page (default 200)")
    p.set_defaults(fn=_inspect)

    p = sub.add_parser(
        "replay", help="re-run recorded episodes in fresh environments and check them"
    )
    p.add_argument("run_dir")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--episode", help="episode id")
    which.add_argument("--all", action="store_true", help="every episode of the run")
    p.add_argument(
        "--rescore",
        metavar="RUBRIC",
        help="recompute rewards instead: a rubric YAML file, `run` (the run's "
        "reward section), a built-in part (milestones, solved, format, length) or module:function",
    )
    p.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="leave out unreadable shards (default: stop, naming them)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_replay)

    p = sub.add_parser(
        "export", help="write the run's trajectories as JSON lines or a datasets directory"
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--out", help="output file or directory (default RUN_DIR/trajectories.jsonl or -dataset)"
    )
    p.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="leave out unreadable shards (default: stop, naming them)",
    )
    p.add_argument(
        "--format",
        choices=["jsonl", "datasets"],
        default="jsonl",
        help="JSON lines (default) or a Hugging Face `datasets` directory",
    )
    p.set_defaults(fn=_export)

    p = sub.add_parser(
        "plot", help="PNG curves of a run's metrics (reward, milestones, loss, sync, throughput)"
    )
    p.add_argument("run_dir")
    p.add_argument("--out", help="directory for the PNG files (default RUN_DIR/plots)")
    p.set_defaults(fn=_plot)

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
    p.set_defaults(fn=_eval)

    p = sub.add_parser(
        "demo",
        help="warm start + RL + held-out evaluation on the demo configs: eval.json, curve.png",
    )
    p.add_argument("--out", default="runs/demo", help="where the runs, eval.json and curve.png go")
    p.add_argument(
        "--config",
        action="append",
        help="a demo config (repeatable; default configs/demo/calculator.yaml and shell.yaml, the real policy)",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every config")
    p.set_defaults(fn=_demo)

    p = sub.add_parser("policy", help="the project's sparse-MoE policy")
    psub = p.add_subparsers(dest="policy_command", required=True)
    pi = psub.add_parser(
        "info", help="layer pattern, parameter counts and cache sizes of a flavour (built on meta)"
    )
    pi.add_argument("config", help="policy config, e.g. configs/policy/k3.yaml")
    pi.add_argument("--json", action="store_true")
    pi.set_defaults(fn=_policy_info)
    pu = psub.add_parser(
        "upcycle",
        help="a dense Llama-family checkpoint as a sparse MoE (Mixtral) that computes "
        "the same function: every MLP copied into experts behind a new router",
    )
    pu.add_argument(
        "src", help="checkpoint directory, or a packaged model's name (smollm2-135m-instruct)"
    )
    pu.add_argument("--experts", type=int, required=True)
    pu.add_argument("--top-k", type=int, default=1)
    pu.add_argument("--seed", type=int, default=0, help="seeds the new routers")
    pu.add_argument("--out", required=True, help="new directory for the upcycled checkpoint")
    pu.add_argument("--json", action="store_true")
    pu.set_defaults(fn=_policy_upcycle)
    pp = psub.add_parser(
        "pretrained",
        help="convert a packaged pretrained model into the local cache; prints its path",
    )
    pp.add_argument("name", help="e.g. smollm2-135m-instruct")
    pp.add_argument(
        "--experts", type=int, default=0, help="also upcycle it (0: the dense model only)"
    )
    pp.add_argument("--top-k", type=int, default=1)
    pp.set_defaults(fn=_policy_pretrained)

    from longhorizon.envs_cli import add_parsers as add_env_parsers
    from longhorizon.serve import add_parser as add_serve_parser

    add_env_parsers(sub)
    add_serve_parser(sub)

    # Overrides may come before or after the options; argparse alone stops collecting positionals
    # at the first option, so gather the leftovers here.
    args, extra = parser.parse_known_args(argv)
    bad = [
        x
        for x in extra
        if x.startswith("-") or args.command not in ("train", "submit", "demo") or "=" not in x
    ]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    warnings.showwarning = _show_warning
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, where a reader that left can be caught, not at interpreter exit
        return code
    # `longhorizon ... --json | head`: the reader left; no traceback for that
    except BrokenPipeError:
        import os

        # so the exit's flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a command ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
