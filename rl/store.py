"""TrajectoryStore: trajectories as Parquet shards under `RUN_DIR/trajectories/`.

One shard per write (`iter-000001.parquet`), written to a temporary name, fsynced and renamed, so
a crash mid-write leaves no partial shard and shards already written are never touched. Shards
read with `datasets.load_dataset("parquet", data_files=...)` or pyarrow directly. Nested records
(turns, milestones, timings) are JSON strings so the schema stays flat and stable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rollout.trajectory import Trajectory, Turn, failure_kind

# 2: routed_experts (shards of version 1 read with it None); 3: failure, turns' failures; 4: reward_parts;
# 5: sample_starts (an agent program's episode stored as several sequences; older shards read with [])
# 6: context (the agent loop's context management; older shards read with ""), turns' kind; tool calls'
#    arguments checked against their tools' schemas (envs/base.py: replay of older records turns it off)
SCHEMA_VERSION = 6

SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("episode_id", pa.string()),
        ("iteration", pa.int32()),
        ("group_id", pa.int32()),
        ("env_id", pa.string()),
        ("seed", pa.int64()),
        ("task", pa.string()),
        ("prompt_len", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("policy_versions", pa.list_(pa.int32())),
        ("turns", pa.string()),
        ("milestones", pa.string()),
        ("reward", pa.float64()),
        ("stop_reason", pa.string()),
        ("infra_error", pa.string()),
        ("num_turns", pa.int32()),
        ("num_generated", pa.int32()),
        ("timings", pa.string()),
        ("routed_experts", pa.list_(pa.list_(pa.list_(pa.int16())))),
        ("failure", pa.string()),
        ("reward_parts", pa.string()),
        ("sample_starts", pa.list_(pa.int32())),
        ("context", pa.string()),
    ]
)


# The learner's view of each trained episode, in a sidecar shard per iteration written after the
# update (`trajectories/learner/iter-NNNNNN.parquet`): trajectories never wait for the learner, and a
# learner crash loses no episode.
LEARNER_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("episode_id", pa.string()),
        ("policy_version", pa.int32()),
        ("learner_logprobs", pa.list_(pa.float32())),
        ("advantages", pa.list_(pa.float32())),
    ]
)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TrajectoryStore:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "trajectories"
        self.corrupt: dict[str, str] = {}  # shard path -> why it could not be read

    def write(self, name: str, trajectories: list[Trajectory]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        rows = {f.name: [] for f in SCHEMA}
        for t in trajectories:
            rows["schema_version"].append(SCHEMA_VERSION)
            for key in (
                "episode_id",
                "iteration",
                "group_id",
                "env_id",
                "seed",
                "task",
                "prompt_len",
                "token_ids",
                "loss_mask",
                "rollout_logprobs",
                "reward",
                "stop_reason",
                "infra_error",
            ):
                rows[key].append(getattr(t, key))
            # the agent loop sets it; a record made elsewhere (a test, a conversion) gets it derived here
            rows["failure"].append(t.failure or stored_failure(vars(t), t.turns, t.milestones))
            rows["policy_versions"].append(sorted({turn.policy_version for turn in t.turns}))
            rows["turns"].append(json.dumps([vars(turn) for turn in t.turns]))
            rows["milestones"].append(json.dumps(t.milestones))
            rows["num_turns"].append(len(t.turns))
            rows["num_generated"].append(t.num_generated)
            rows["timings"].append(json.dumps(t.timings))
            rows["routed_experts"].append(t.routed_experts)
            rows["reward_parts"].append(json.dumps(t.reward_parts))
            rows["sample_starts"].append(t.sample_starts)
            rows["context"].append(t.context)
        return self._write_atomic(self.dir, name, pa.table(rows, schema=SCHEMA))

    def write_learner(self, name: str, annotations: dict, policy_version: int) -> Path:
        """The learner's per-token log-probs and advantages of the episodes it trained on."""
        ids = sorted(annotations)
        table = pa.table(
            {
                "schema_version": [SCHEMA_VERSION] * len(ids),
                "episode_id": ids,
                "policy_version": [policy_version] * len(ids),
                "learner_logprobs": [annotations[i]["learner_logprobs"] for i in ids],
                "advantages": [annotations[i]["advantages"] for i in ids],
            },
            schema=LEARNER_SCHEMA,
        )
        return self._write_atomic(self.learner_dir, name, table)

    @staticmethod
    def _write_atomic(directory: Path, name: str, table: pa.Table) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"{name}.parquet"
        if final.exists():
            raise FileExistsError(
                f"shard {final} already exists; the store never overwrites a shard"
            )
        tmp = directory / f".{name}.parquet.tmp"
        with open(tmp, "wb") as fh:
            # one row group per episode: a reader filtering by episode id loads only that episode
            pq.write_table(table, fh, row_group_size=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
        return final

    @property
    def learner_dir(self) -> Path:
        return self.dir / "learner"

    def learner_shards(self) -> list[Path]:
        return sorted(self.learner_dir.glob("*.parquet")) if self.learner_dir.exists() else []

    def _read(
        self,
        shards: list[Path],
        episode_ids: list[str] | None = None,
        columns: list[str] | None = None,
    ) -> Iterator[dict]:
        """Rows of `shards` (only the row groups of `episode_ids` when given, only `columns` when
        given); an unreadable shard is named in `self.corrupt` and skipped."""
        filters = (
            None
            if episode_ids is None
            else [("episode_id", "in", list(dict.fromkeys(episode_ids)))]
        )
        for shard in shards:
            try:
                table = pq.read_table(shard, filters=filters, columns=columns)
                rows = table.to_pylist()
                _check_rows(rows)
            except (pa.ArrowInvalid, OSError, CorruptRecord) as exc:
                self.corrupt[str(shard)] = str(exc)
                continue
            yield from rows

    def episode(self, episode_id: str) -> Trajectory:
        """One episode, reading only its row group of each shard (a 1M-token episode never brings
        the rest of the run into memory)."""
        row = next(self._read(self.shards(), [episode_id]), None)
        if row is None:
            raise KeyError(f"no episode {episode_id!r} in {self.dir.parent}")
        return row_to_trajectory(row)

    def episodes(self, episode_ids: list[str]) -> Iterator[Trajectory]:
        """The given episodes, in store order, reading only their row groups (one pass over the shards)."""
        return map(row_to_trajectory, self._read(self.shards(), episode_ids))

    def learner_records(self, columns: list[str] | None = None) -> Iterator[dict]:
        """Every learner record (or only its `columns`), shard by shard."""
        return self._read(self.learner_shards(), columns=columns)

    def learner_record(self, episode_id: str) -> dict | None:
        """The learner's record of an episode (`policy_version`, `learner_logprobs`, `advantages`), or
        None when it was not trained on (infra error, dropped group) or predates these records."""
        return next(self._read(self.learner_shards(), [episode_id]), None)

    def shards(self) -> list[Path]:
        return sorted(self.dir.glob("*.parquet")) if self.dir.exists() else []

    def set_aside(self, from_iteration: int) -> int:
        """Move the shards (and the learner's) of `from_iteration` on to `superseded/`, kept and
        never deleted: a resumed run plays those iterations again. How many moved."""
        aside, moved, stamp = self.dir / "superseded", 0, int(time.time())
        for shard in self.shards() + self.learner_shards():
            if int(shard.stem.split("-")[1]) >= from_iteration:
                aside.mkdir(exist_ok=True)
                prefix = "learner-" if shard.parent == self.learner_dir else ""
                os.replace(shard, aside / f"{prefix}{shard.stem}-{stamp}.parquet")
                moved += 1
        return moved

    def rows(
        self,
        columns: list[str] | None = None,
        strict: bool = True,
        shards: list[Path] | None = None,
    ) -> Iterator[dict]:
        """Every stored episode (of `shards`, default all) as a dict of columns, shard by shard (one
        shard in memory at a time).

        A shard that cannot be read raises `CorruptShard` naming it (what reads the whole run —
        export, replay, training from a store — must not pass over episodes silently);
        `strict=False` skips it instead, names it in `self.corrupt` and warns, so inspection can
        still show the rest."""
        for shard in self.shards() if shards is None else shards:
            try:
                # one open: the footer tells which columns this shard has
                pf = pq.ParquetFile(shard)
                present = pf.schema_arrow.names
                table = pf.read(
                    columns=None if columns is None else [c for c in columns if c in present]
                )
                rows = table.to_pylist()
                _check_rows(rows)
            except (pa.ArrowInvalid, OSError, CorruptRecord) as exc:
                if strict:
                    raise CorruptShard(shard, exc) from exc
                if str(shard) not in self.corrupt:
                    warnings.warn(f"skipping corrupt trajectory shard {shard}: {exc}", stacklevel=2)
                self.corrupt[str(shard)] = str(exc)
                continue
            missing = [c for c in (columns or SCHEMA.names) if c not in present]  # an older shard's
            for row in rows:
                yield {**row, **dict.fromkeys(missing)} if missing else row

    def trajectories(self, shard: Path | None = None, strict: bool = True) -> Iterator[Trajectory]:
        for row in self.rows(shards=None if shard is None else [shard], strict=strict):
            yield row_to_trajectory(row)

    def unreadable(self) -> list[CorruptShard]:
        """Shards whose footer or episode ids cannot be read, checked without reading the token
        columns: a quick look before a long pass over the run."""
        bad = []
        for shard in self.shards():
            try:
                pq.read_table(shard, columns=["episode_id"])
            except (pa.ArrowInvalid, OSError) as exc:
                bad.append(CorruptShard(shard, exc))
        return bad


class CorruptRecord(ValueError):
    """An episode whose nested records (turns, milestones, ...) are not what the store writes: a
    crafted or damaged shard, refused whole like an unreadable one."""


_TURN_INTS = (
    "gen_start",
    "gen_end",
    "obs_end",
    "tool_calls",
    "tool_errors",
    "policy_version",
    "seed",
)
_TURN_TEXTS = ("text", "observation", "finish_reason", "kind")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    import math

    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def record_problem(row: dict) -> str | None:
    """What in a row's JSON columns is not a record the store writes (types included), or None."""

    def parsed(key, kind):
        try:
            value = json.loads(row[key])
        except (TypeError, ValueError):
            raise CorruptRecord(f"{key} is not JSON") from None
        if not isinstance(value, kind):
            raise CorruptRecord(f"{key} is not a JSON {kind.__name__}")
        return value

    try:
        if row.get("turns") is not None:
            fields = {f.name for f in dataclasses.fields(Turn)}
            for i, t in enumerate(parsed("turns", list)):
                if not isinstance(t, dict) or not set(t) <= fields:
                    raise CorruptRecord(f"turn {i} is not a turn record")
                bad = (
                    [k for k in _TURN_INTS if k in t and not _is_int(t[k])]
                    + [k for k in _TURN_TEXTS if k in t and not isinstance(t[k], str)]
                    + [
                        k
                        for k in ("sandbox_events", "failures")
                        if k in t
                        and not (isinstance(t[k], list) and all(isinstance(x, str) for x in t[k]))
                    ]
                )
                if bad:
                    raise CorruptRecord(f"turn {i}: {bad[0]} has the wrong type")
        if row.get("milestones") is not None:
            for m in parsed("milestones", list):
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("name"), str)
                    and _is_number(m.get("reward"))
                    and all(_is_int(m[k]) for k in ("turn", "token") if k in m)
                ):
                    raise CorruptRecord(
                        "a milestone is not {name: str, reward: number, turn: int, token: int}"
                    )
        if row.get("reward_parts") is not None:
            parts = parsed("reward_parts", dict)
            if not all(_is_number(v) for v in parts.values()):
                raise CorruptRecord("a reward part is not a number")
        if row.get("timings") is not None:
            parsed("timings", dict)
    except CorruptRecord as exc:
        return str(exc)
    return None


def _check_rows(rows: list[dict]) -> None:
    for row in rows:
        problem = record_problem(row)
        if problem:
            raise CorruptRecord(f"episode {row.get('episode_id')!r}: {problem}")


class CorruptShard(ValueError):
    def __init__(self, shard: Path, exc: BaseException):
        super().__init__(f"corrupt trajectory shard {shard}: {' '.join(str(exc).split())}")
        self.shard = str(shard)


def legacy_failures(turn: Turn) -> list[str]:
    """A schema-2 turn's failures, read back from the observation texts envs/base.py writes for
    them (those shards predate `Turn.failures`)."""
    out = []
    for line in turn.observation.splitlines():
        if line.startswith("No tool call found"):
            out.append("no_tool_call")
        elif line.startswith("error: malformed tool call"):
            out.append("malformed_call")
        elif line.startswith("error: unknown tool"):
            out.append("unknown_tool")
        elif line.startswith("error: ") and not line.startswith("error: the tool could not run"):
            out.append("tool_error")
    return out + ["sandbox_limit" for e in turn.sandbox_events if e.endswith("limit reached")]


def stored_turns(turns_json: str) -> list[Turn]:
    """A row's `turns` column as Turn records; a turn written before schema 3 gets its failures
    from `legacy_failures`."""
    raw = json.loads(turns_json)
    turns = [Turn(**t) for t in raw]
    for t, r in zip(turns, raw):
        if "failures" not in r:
            t.failures = legacy_failures(t)
    return turns


def stored_failure(row: dict, turns: list[Turn], milestones: list[dict]) -> str:
    """The episode's failure kind as stored, or, for a shard older than schema 3, what its record
    still tells (its turns carry no per-turn failures)."""
    if row.get("failure"):
        return row["failure"]
    from rollout.agent_loop import succeeded_in

    infra = row.get("infra_error") or ""
    return failure_kind(
        row["stop_reason"],
        turns,
        not infra and succeeded_in(row["env_id"], milestones, row["reward"]),
        infra,
    )


def row_to_trajectory(row: dict) -> Trajectory:
    turns = stored_turns(row["turns"])
    milestones = json.loads(row["milestones"])
    failure = stored_failure(row, turns, milestones)
    return Trajectory(
        episode_id=row["episode_id"],
        iteration=row["iteration"],
        group_id=row["group_id"],
        env_id=row["env_id"],
        seed=row["seed"],
        task=row.get("task") or "",
        prompt_len=row["prompt_len"],
        token_ids=row["token_ids"],
        loss_mask=row["loss_mask"],
        rollout_logprobs=row["rollout_logprobs"],
        turns=turns,
        milestones=milestones,
        reward=row["reward"],
        stop_reason=row["stop_reason"],
        infra_error=row.get("infra_error") or "",
        timings=json.loads(row["timings"]),
        routed_experts=row.get("routed_experts"),
        failure=failure,
        reward_parts=json.loads(row.get("reward_parts") or "{}"),
        sample_starts=row.get("sample_starts") or [],
        context=row.get("context") or "",
        stored_schema=row.get("schema_version") or 0,
    )
