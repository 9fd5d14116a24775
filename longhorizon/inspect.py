"""`longhorizon inspect RUN_DIR`: what a run did, from its store and metrics.

- default: a per-iteration table (episodes, reward, milestones, lengths, loss, versions);
- `--episodes [filters]`: the episode list, filtered by environment, reward, policy version,
  generated length or stop reason;
- `--episode ID`: one episode turn by turn (generated text, tool results, milestones, sandbox events);
- `--episode ID --tokens [--start N --count N]`: a page of its tokens with the engine's and the
  learner's log-probs, their ratio, and the advantage each generated token was trained with;
- `--json`: a machine-readable summary.

Reads the Parquet store shard by shard (one episode's row group for the episode views) and never
needs the actors.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rl.store import TrajectoryStore, stored_failure, stored_turns
from rollout.trajectory import FAILURE_KINDS, STOP_REASONS, TURN_FAILURES, Turn, first_difference

SUMMARY_COLUMNS = [
    "episode_id",
    "iteration",
    "reward",
    "policy_versions",
    "num_turns",
    "num_generated",
    "milestones",
    "stop_reason",
]


def load_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not a JSON line") from None
            if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
                raise ValueError(f"{path}:{n}: not a metrics row (no integer 'iteration')")
            rows.append(row)
    return rows


def summary(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    store = TrajectoryStore(run_dir)
    if not store.shards():
        raise FileNotFoundError(
            f"{run_dir} holds no trajectory shards (expected {store.dir}/*.parquet)"
        )
    per_iter: dict[int, list[dict]] = defaultdict(list)
    versions: set[int] = set()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reported in the summary instead
        # corrupt shards are listed, not fatal
        rows = list(store.rows(SUMMARY_COLUMNS, strict=False))
    for row in rows:
        per_iter[row["iteration"]].append(row)
        versions.update(row["policy_versions"])
    iters = sorted(per_iter)
    # staleness: how many versions older than the learner's weights an episode's oldest token was
    # when it was trained on (0 in synchronous runs; bounded by max_staleness in asynchronous ones)
    trained = {
        r["episode_id"]: r["policy_version"]
        for r in store.learner_records(["episode_id", "policy_version"])
    }
    staleness = []
    for i in iters:
        ages = [
            trained[r["episode_id"]] - min(r["policy_versions"])
            for r in per_iter[i]
            if r["episode_id"] in trained and r["policy_versions"]
        ]
        staleness.append(max(ages) if ages else None)
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
        "iteration_ids": iters,
        "episodes": sum(len(v) for v in per_iter.values()),
        "mean_reward": [sum(r["reward"] for r in per_iter[i]) / len(per_iter[i]) for i in iters],
        "milestone_rates": milestone_rates,
        "mean_generated_tokens": [
            sum(r["num_generated"] for r in per_iter[i]) / len(per_iter[i]) for i in iters
        ],
        "policy_versions": sorted(versions),
        "staleness_max": staleness,
        "infra_errors": [
            sum(1 for r in per_iter[i] if r["stop_reason"] == "infra_error") for i in iters
        ],
        "shards": [str(p) for p in store.shards()],
        "corrupt_shards": dict(store.corrupt),
    }


def print_summary(run_dir: str | Path, console: Console) -> None:
    s = summary(run_dir)
    metrics = {m["iteration"]: m for m in load_metrics(Path(run_dir))}
    table = Table(
        title=f"{s['run_dir']}: {s['episodes']} episodes, policy versions {s['policy_versions']}"
    )
    for col in (
        "iter",
        "reward",
        "milestones",
        "gen tokens",
        "loss",
        "→ version",
        "staleness",
        "infra err",
        "sync ms",
    ):
        table.add_column(col, justify="right")
    for i, reward, rates, gen, stale, infra in zip(
        s["iteration_ids"],
        s["mean_reward"],
        s["milestone_rates"],
        s["mean_generated_tokens"],
        s["staleness_max"],
        s["infra_errors"],
    ):
        m = metrics.get(i, {})
        table.add_row(
            str(i),
            f"{reward:.3f}",
            " ".join(f"{k} {v:.0%}" for k, v in rates.items()) or "-",
            f"{gen:.0f}",
            f"{m['loss']:+.4f}" if "loss" in m else "-",
            str(m.get("policy_version", "-")),
            "-" if stale is None else str(stale),
            str(infra),
            f"{m['sync_s'] * 1e3:.0f}" if "sync_s" in m else "-",
        )
    console.print(table)
    for shard, why in s["corrupt_shards"].items():
        console.print(Text.assemble(("corrupt shard skipped", "red"), f": {shard}: {why}"))


def find_episode(run_dir: str | Path, episode_id: str):
    return TrajectoryStore(run_dir).episode(episode_id)


def episode_json(run_dir: str | Path, episode_id: str) -> dict:
    """One episode, every stored field, as plain JSON values (`inspect --episode ID --json`)."""
    import dataclasses

    return dataclasses.asdict(find_episode(run_dir, episode_id))


def print_episode(run_dir: str | Path, episode_id: str, console: Console) -> None:
    # Everything the model or the environment wrote is shown as plain Text, never parsed as rich
    # markup: a generated "[/b]" would otherwise raise MarkupError (or restyle the page).
    t = find_episode(run_dir, episode_id)
    console.print(
        Text.assemble(
            (t.episode_id, "bold"),
            f" env {t.env_id} seed {t.seed} group {t.group_id}  "
            f"reward {t.reward:.3f}  stop {t.stop_reason}  tokens {len(t.token_ids)} "
            f"({t.num_generated} generated)  "
            + (
                f"{len(t.sample_starts)} {'context segments' if t.context in ('window', 'compact') else 'samples'}  "
                if t.sample_starts
                else ""
            )
            + (f"context {t.context}  " if t.context not in ("", "full") else ""),
            _kind(t.failure),
        )
    )
    if t.reward_parts:  # a rubric's parts, each on its own (rewards/rubric.py)
        console.print(
            Text("reward parts: " + "  ".join(f"{k} {v:.3f}" for k, v in t.reward_parts.items()))
        )
    if t.infra_error:
        console.print(Text.assemble(("infrastructure error: ", "red"), t.infra_error))
    console.print(
        Panel(
            Text(t.task or "(not recorded)"),
            title="task",
            title_align="left",
            border_style="magenta",
        )
    )
    by_turn = defaultdict(list)
    for m in t.milestones:
        by_turn[m["turn"]].append(f"{m['name']} +{m['reward']:g}")
    openers = t.sample_openers()
    for i, turn in enumerate(t.turns):
        if i in openers:
            console.print(Text(opener_note(t, i, openers[i]), style="yellow"))
        # a compaction turn (rollout/context.py): the policy's own summary
        if turn.kind == "summary":
            console.print(
                Panel(
                    Text(turn.text or "(empty)"),
                    title=Text(
                        f"turn {i} · summary (compaction turn) · v{turn.policy_version} · {turn.gen_end - turn.gen_start} tokens · "
                        f"{turn.finish_reason}"
                    ),
                    title_align="left",
                    border_style="yellow",
                )
            )
            continue
        # what went wrong first: a narrow (piped) console cuts a long title at its end
        title = (
            f"turn {i}"
            + (f" · {', '.join(turn.failures)}" if turn.failures else "")
            + f" · v{turn.policy_version} · {turn.gen_end - turn.gen_start} tokens · "
            f"{turn.tool_calls} tool result(s), {turn.tool_errors} error(s) · {turn.finish_reason}"
        )
        console.print(
            Panel(
                Text(turn.text or "(empty)"),
                title=Text(title),
                title_align="left",
                border_style="cyan",
            )
        )
        if turn.observation:
            console.print(
                Panel(
                    Text(turn.observation),
                    title="observation",
                    title_align="left",
                    border_style="red" if turn.failures else "dim",
                )
            )
        if by_turn.get(i):
            console.print(Text(f"  milestones: {', '.join(by_turn[i])}", style="green"))
        for event in turn.sandbox_events:
            console.print(Text(f"  sandbox: {event}", style="yellow"))


def opener_note(t, turn: int, k: int) -> str:
    """What starts sample `k` of a split episode, said where its first turn is shown."""
    n, tokens = len(t.sample_starts), t.turns[turn].gen_start - t.sample_starts[k]
    if t.context in ("window", "compact"):
        how = (
            "the task, the policy's summary and its last turns"
            if t.context == "compact"
            else "the task, a stub for the turns no longer shown and the last turns"
        )
        return (
            f"context segment {k + 1} of {n}: the context was rebuilt from {how} ({tokens} tokens, "
            f"from token {t.sample_starts[k]}); trained as a sequence of its own"
        )
    return (
        f"sample {k + 1} of {n}: the history was rewritten before this call; its prompt was rendered anew "
        f"({tokens} tokens) and is trained as a sequence of its own"
    )


def _kind(failure: str) -> Text:
    """A failure kind as shown: green for success, red for the rest."""
    return Text(failure, style="green" if failure == "success" else "red")


def _calls(turn: Turn) -> str:
    """A turn's tool calls as `name, name`, what went wrong with them in brackets (`bash
    [tool_error]`), or what went wrong instead of a call (`no_tool_call`)."""
    from envs.tool_calls import parse_tool_calls

    names = ", ".join(c.name for c in parse_tool_calls(turn.text)[0])
    failed = ", ".join(dict.fromkeys(turn.failures))
    return f"{names} [{failed}]" if names and failed else names or failed or "-"


def mean_advantage(t, record: dict | None) -> float | None:
    """The advantage the learner gave an episode: the mean over its generated tokens (GRPO gives
    every token the same one), or None when it was not trained on."""
    adv = [a for a, m in zip(record["advantages"], t.loss_mask) if m] if record else []
    return sum(adv) / len(adv) if adv else None


def compare_group(eps: list, advantages: dict) -> tuple[str, list[dict]]:
    """A group's episodes against its best (highest reward, then first id): (best id, one row per
    episode, best first) with reward, advantage, failure, tools per turn, and the turn and token
    where its tokens first differ from the best's (None: the same tokens)."""
    eps = sorted(eps, key=lambda t: (-t.reward, t.episode_id))
    best, rows = eps[0], []
    for t in eps:
        first = first_difference(t.token_ids, best.token_ids)
        turn = (
            None
            if first is None
            else next(
                (i for i, tu in enumerate(t.turns) if first < tu.obs_end), max(len(t.turns) - 1, 0)
            )
        )
        rows.append(
            {
                "episode_id": t.episode_id,
                "reward": t.reward,
                "failure": t.failure,
                "advantage": advantages.get(t.episode_id),
                "stop_reason": t.stop_reason,
                "milestones": [m["name"] for m in t.milestones],
                "turns": [_calls(tu) for tu in t.turns],
                "diverges_at_turn": turn,
                "diverges_at_token": first,
            }
        )
    return best.episode_id, rows


GROUP_NAME = re.compile(r"i\d+-g\d+")
"""A group as episode ids print it: `i1-g2` is iteration 1's group 2 (its episodes `i1-g2-e0`, ...)."""


def parse_group(text: str) -> int | str:
    """`--group`'s value: a group as the episode ids print it (`i1-g2`), or the run-wide group
    number the store records (`7`). Anything else is a ValueError naming both forms."""
    text = text.strip()
    if GROUP_NAME.fullmatch(text):
        return text
    if text.isdigit():
        return int(text)
    raise ValueError(
        f"--group takes a group as the episode ids print it (i1-g2: iteration 1's group 2) or the "
        f"run-wide group number (7), got {text[:40]!r}"
    )


def group_view(run_dir: str | Path, group: int | str) -> dict:
    """One GRPO group side by side (`inspect --group ID`): its task, and each episode with its
    reward, the advantage the learner gave it, how it ended, the tools it called turn by turn, and
    the turn where its generated tokens first differ from the group's best episode. `group`: as
    `parse_group` reads it."""
    store = TrajectoryStore(run_dir)
    rows = store.rows(["episode_id", "group_id"], strict=False)
    if isinstance(group, str):
        ids = [r["episode_id"] for r in rows if r["episode_id"].startswith(group + "-e")]
    else:
        ids = [r["episode_id"] for r in rows if r["group_id"] == group]
    if not ids:
        raise KeyError(f"no group {group} in {run_dir}")
    eps = list(store.episodes(ids))
    best_id, rows = compare_group(
        eps, {t.episode_id: mean_advantage(t, store.learner_record(t.episode_id)) for t in eps}
    )
    best = next(t for t in eps if t.episode_id == best_id)
    name = GROUP_NAME.match(best_id)
    return {
        "group_id": best.group_id,
        "group": name.group(0) if name else None,
        "iteration": best.iteration,
        "env_id": best.env_id,
        "seed": best.seed,
        "task": best.task,
        "best": best_id,
        "episodes": rows,
    }


def print_group(view: dict, console: Console) -> None:
    console.print(
        Text(
            f"group {view['group'] or view['group_id']} (run-wide {view['group_id']}) · iteration {view['iteration']} · {view['env_id']} seed "
            f"{view['seed']} · best {view['best']}",
            style="bold",
        )
    )
    console.print(
        Panel(
            Text(view["task"] or "(not recorded)"),
            title="task",
            title_align="left",
            border_style="magenta",
            width=min(console.width, 120),
        )
    )  # a wide (piped) console
    width = max((len(e["turns"]) for e in view["episodes"]), default=0)
    table = Table(title="episodes, best first; turns show the tools called (or what went wrong)")
    for col in ("episode", "reward", "advantage", "failure", "milestones", "diverges"):
        table.add_column(
            col, justify="right" if col in ("reward", "advantage") else "left", no_wrap=True
        )
    for i in range(width):
        table.add_column(f"turn {i}", no_wrap=True)
    for e in view["episodes"]:
        turn = e["diverges_at_turn"]
        diverges = (
            "(best)"
            if e["episode_id"] == view["best"]
            else "same tokens"
            if turn is None
            else f"turn {turn}"
        )
        cells = []
        for i, calls in enumerate(e["turns"] + [""] * (width - len(e["turns"]))):
            style = "bold" if turn is not None and i == turn else ""
            cells.append(
                Text(
                    calls, style=style + (" red" if calls in TURN_FAILURES or "[" in calls else "")
                )
            )
        table.add_row(
            e["episode_id"],
            f"{e['reward']:.3f}",
            "-" if e["advantage"] is None else f"{e['advantage']:+.3f}",
            _kind(e["failure"]),
            ", ".join(e["milestones"]) or "-",
            diverges,
            *cells,
        )
    console.print(table)


LIST_COLUMNS = [
    "episode_id",
    "iteration",
    "group_id",
    "env_id",
    "reward",
    "policy_versions",
    "num_turns",
    "num_generated",
    "stop_reason",
    "infra_error",
    "failure",
    "turns",
    "milestones",
]


def episode_list(
    run_dir: str | Path,
    *,
    env: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    version: int | None = None,
    min_generated: int | None = None,
    max_generated: int | None = None,
    stop: str | None = None,
    failure: str | None = None,
    min_tool_errors: int | None = None,
) -> list[dict]:
    """Episodes matching every given filter (a few columns only: no token ids are read), each
    with its failure kind and tool-error count."""
    if stop is not None and stop not in STOP_REASONS:
        raise ValueError(
            f"--stop {stop!r} is not a stop reason; they are: "
            + "; ".join(f"{k} ({v})" for k, v in STOP_REASONS.items())
        )
    if failure is not None and failure not in FAILURE_KINDS:
        raise ValueError(
            f"--failure {failure!r} is not a failure kind; they are: {', '.join(FAILURE_KINDS)}"
        )
    out = []
    for row in TrajectoryStore(run_dir).rows(LIST_COLUMNS, strict=False):
        turns = stored_turns(row.pop("turns"))
        row["failure"] = stored_failure(row, turns, json.loads(row.pop("milestones")))
        row["tool_errors"] = sum(t.tool_errors for t in turns)
        if (
            (env is None or row["env_id"] == env)
            and (failure is None or row["failure"] == failure)
            and (min_tool_errors is None or row["tool_errors"] >= min_tool_errors)
            and (min_reward is None or row["reward"] >= min_reward)
            and (max_reward is None or row["reward"] <= max_reward)
            and (version is None or version in row["policy_versions"])
            and (min_generated is None or row["num_generated"] >= min_generated)
            and (max_generated is None or row["num_generated"] <= max_generated)
            and (stop is None or row["stop_reason"] == stop)
        ):
            out.append(row)
    return out


def print_episode_list(rows: list[dict], console: Console, limit: int = 50) -> None:
    table = Table(
        title=f"{len(rows)} episode(s)" + (f", first {limit} shown" if len(rows) > limit else "")
    )
    numeric = ("iter", "group", "reward", "turns", "generated", "tool err")
    for col in (
        "episode",
        "iter",
        "group",
        "env",
        "reward",
        "versions",
        "turns",
        "generated",
        "tool err",
        "stop",
        "failure",
    ):
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=True)
    for r in rows[:limit]:
        table.add_row(
            r["episode_id"],
            str(r["iteration"]),
            str(r["group_id"]),
            r["env_id"],
            f"{r['reward']:.3f}",
            ",".join(map(str, r["policy_versions"])),
            str(r["num_turns"]),
            str(r["num_generated"]),
            str(r["tool_errors"]),
            r["stop_reason"],
            _kind(r["failure"]),
        )
    console.print(table)


def run_tokenizer(run_dir: Path):
    """The run's tokenizer (newest checkpoint, else policy-init), or None."""
    from transformers import AutoTokenizer

    candidates = sorted((run_dir / "checkpoints").glob("version-*"), reverse=True) + [
        run_dir / "policy-init"
    ]
    for c in candidates:
        if (c / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(c)
    return None


def token_rows(run_dir: str | Path, episode_id: str, start: int = 0, count: int = 200) -> dict:
    """A page of one episode's tokens: position, role, text, engine and learner log-probs, ratio, advantage."""
    run_dir = Path(run_dir)
    store = TrajectoryStore(run_dir)
    t = store.episode(episode_id)
    learner = store.learner_record(episode_id)
    tok = run_tokenizer(run_dir)
    end = min(len(t.token_ids), start + count)
    ids = t.token_ids[start:end]
    pieces = tok.convert_ids_to_tokens(ids) if tok is not None else [str(i) for i in ids]
    # the policy version of each generated token is its turn's
    version_at = {
        p: turn.policy_version for turn in t.turns for p in range(turn.gen_start, turn.gen_end)
    }
    rows = []
    for k, (tid, piece) in enumerate(zip(ids, pieces)):
        p = start + k
        gen = bool(t.loss_mask[p])
        row = {
            "pos": p,
            "id": tid,
            "text": str(piece).replace("Ġ", " ").replace("Ċ", "\n"),
            "role": "generated" if gen else ("prompt" if t.in_prompt(p) else "observation"),
            "version": version_at.get(p) if gen else None,
            "rollout_logprob": t.rollout_logprobs[p] if gen else None,
            "learner_logprob": None,
            "ratio": None,
            "advantage": None,
        }
        if learner is not None and gen:
            row["learner_logprob"] = learner["learner_logprobs"][p]
            row["ratio"] = math.exp(row["learner_logprob"] - row["rollout_logprob"])
            row["advantage"] = learner["advantages"][p]
        rows.append(row)
    return {
        "episode_id": episode_id,
        "tokens": len(t.token_ids),
        "start": start,
        "end": end,
        "learner_version": learner["policy_version"] if learner else None,
        "rows": rows,
    }


def print_tokens(page: dict, console: Console) -> None:
    title = (
        f"{page['episode_id']}: tokens {page['start']}–{page['end'] - 1} of {page['tokens']}"
        + (
            f"; learner log-probs of version {page['learner_version']}"
            if page["learner_version"] is not None
            else "; no learner record (not trained on)"
        )
    )
    table = Table(title=title)
    for col in (
        "pos",
        "role",
        "token",
        "version",
        "rollout lp",
        "learner lp",
        "ratio",
        "advantage",
    ):
        table.add_column(col, justify="left" if col in ("role", "token") else "right")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    style = {"prompt": "dim", "observation": "cyan", "generated": ""}
    for r in page["rows"]:
        table.add_row(
            str(r["pos"]),
            r["role"],
            repr(r["text"])[1:-1],
            fmt(r["version"], "d"),
            fmt(r["rollout_logprob"], ".4f"),
            fmt(r["learner_logprob"], ".4f"),
            fmt(r["ratio"], ".4f"),
            fmt(r["advantage"], "+.4f"),
            style=style[r["role"]],
        )
    console.print(table)
