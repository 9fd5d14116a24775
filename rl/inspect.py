"""`longhorizon inspect RUN_DIR`: what a run did, from its store and metrics.

- default: a per-iteration table (episodes, reward, milestones, lengths, loss, versions);
- `--episode ID`: one episode turn by turn (generated text, tool results, milestones);
- `--json`: a machine-readable summary.

Reads the Parquet store shard by shard and never needs the actors. (The HTML viewer, token view
and filters come with the store/inspect work.)
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from rl.store import TrajectoryStore, row_to_trajectory

SUMMARY_COLUMNS = ["episode_id", "iteration", "reward", "policy_versions", "num_turns",
                   "num_generated", "milestones", "stop_reason"]


def load_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not a JSON line") from None
    return rows


def summary(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    store = TrajectoryStore(run_dir)
    if not store.shards():
        raise FileNotFoundError(f"{run_dir} holds no trajectory shards (expected {store.dir}/*.parquet)")
    per_iter: dict[int, list[dict]] = defaultdict(list)
    versions: set[int] = set()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reported in the summary instead
        rows = list(store.rows(SUMMARY_COLUMNS))
    for row in rows:
        per_iter[row["iteration"]].append(row)
        versions.update(row["policy_versions"])
    iters = sorted(per_iter)
    milestone_rates = []
    for i in iters:
        counts: dict[str, int] = defaultdict(int)
        for row in per_iter[i]:
            for name in {m["name"] for m in json.loads(row["milestones"])}:
                counts[name] += 1
        milestone_rates.append({k: v / len(per_iter[i]) for k, v in sorted(counts.items())})
    return {
        "run_dir": str(run_dir),
        "iterations": len(iters),
        "episodes": sum(len(v) for v in per_iter.values()),
        "mean_reward": [sum(r["reward"] for r in per_iter[i]) / len(per_iter[i]) for i in iters],
        "milestone_rates": milestone_rates,
        "mean_generated_tokens": [sum(r["num_generated"] for r in per_iter[i]) / len(per_iter[i]) for i in iters],
        "policy_versions": sorted(versions),
        "shards": [str(p) for p in store.shards()],
        "corrupt_shards": dict(store.corrupt),
    }


def print_summary(run_dir: str | Path, console: Console) -> None:
    s = summary(run_dir)
    metrics = {m["iteration"]: m for m in load_metrics(Path(run_dir))}
    table = Table(title=f"{s['run_dir']}: {s['episodes']} episodes, policy versions {s['policy_versions']}")
    for col in ("iter", "reward", "milestones", "gen tokens", "loss", "→ version", "sync ms"):
        table.add_column(col, justify="right")
    for i, (reward, rates, gen) in enumerate(zip(s["mean_reward"], s["milestone_rates"], s["mean_generated_tokens"])):
        m = metrics.get(i, {})
        table.add_row(
            str(i), f"{reward:.3f}", " ".join(f"{k} {v:.0%}" for k, v in rates.items()) or "-", f"{gen:.0f}",
            f"{m['loss']:+.4f}" if "loss" in m else "-", str(m.get("policy_version", "-")),
            f"{m['sync_s'] * 1e3:.0f}" if "sync_s" in m else "-",
        )
    console.print(table)
    for shard, why in s["corrupt_shards"].items():
        console.print(f"[red]corrupt shard skipped[/]: {shard}: {why}")


def find_episode(run_dir: str | Path, episode_id: str):
    for row in TrajectoryStore(run_dir).rows():
        if row["episode_id"] == episode_id:
            return row_to_trajectory(row)
    raise KeyError(f"no episode {episode_id!r} in {run_dir}")


def print_episode(run_dir: str | Path, episode_id: str, console: Console) -> None:
    t = find_episode(run_dir, episode_id)
    console.print(f"[bold]{t.episode_id}[/] env {t.env_id} seed {t.seed}  reward {t.reward:.3f}  "
                  f"stop {t.stop_reason}  tokens {len(t.token_ids)} ({t.num_generated} generated)")
    by_turn = defaultdict(list)
    for m in t.milestones:
        by_turn[m["turn"]].append(f"{m['name']} +{m['reward']:g}")
    for i, turn in enumerate(t.turns):
        title = (f"turn {i} · v{turn.policy_version} · {turn.gen_end - turn.gen_start} tokens · "
                 f"{turn.tool_calls} tool result(s), {turn.tool_errors} error(s) · {turn.finish_reason}")
        console.print(Panel(turn.text or "(empty)", title=title, title_align="left", border_style="cyan"))
        if turn.observation:
            console.print(Panel(turn.observation, title="observation", title_align="left", border_style="dim"))
        if by_turn.get(i):
            console.print(f"  [green]milestones: {', '.join(by_turn[i])}[/]")
        for event in turn.sandbox_events:
            console.print(f"  [yellow]sandbox: {event}[/]", markup=True, highlight=False)
