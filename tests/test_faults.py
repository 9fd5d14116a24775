"""Fault tolerance on a real multi-node Ray cluster: a head (the learner's node) and two worker nodes
(rollout and env workers), started by the test on loopback and killed by PID.

One training run (`longhorizon train --address`, as a user runs it) meets, one iteration after the
other: an env worker killed mid-rollout, a rollout worker killed mid-rollout, a whole worker node
killed mid-rollout, and the learner killed. The first three the run survives by itself; the fourth
stops it with a clear error, and `longhorizon train --resume` finishes it. Each test below checks
one of those, and the last that the store holds every episode id exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_cluster import LocalCluster, kill

from conftest import REPO

pytestmark = pytest.mark.slow

ITERATIONS = 6
EPISODES = 4  # per iteration: 2 groups of 2, one group per rollout worker
# env worker killed in iteration 1, a rollout worker in 2, a worker node in 3, the learner in 4
ENV_KILL, ROLLOUT_KILL, NODE_KILL, LEARNER_KILL = 1, 2, 3, 4


def _overrides(policy: str) -> list[str]:
    return [
        f"iterations={ITERATIONS}",
        f"policy.path={policy}",
        "checkpoint_every=1",
        "rollout.num_workers=2",
        "rollout.groups_per_iteration=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=16",
        "rollout.cpus_per_worker=0.5",
        # slow tools: every rollout lasts seconds, so a kill lands while episodes are in flight
        "env.workers=2",
        "env.kwargs={max_turns: 4, step_latency_s: 1.0}",
        "ray.rollout_resources={rollout: 1}",
        "ray.env_worker_resources={env_worker: 1}",
        "ray.learner_resources={learner: 1}",
        "ray.max_restarts=3",
        "sync.timeout_s=240",
    ]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.exists()
        else []
    )


class _Run:
    """The training driver as a subprocess, its output in a file."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self.fh = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "longhorizon.cli", "train", *args],
            cwd=REPO,
            stdout=self.fh,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_rows(self, run_dir: Path, n: int, timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while len(_rows(run_dir)) < n:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the run exited ({self.proc.returncode}) before iteration {n - 1} was "
                    f"done:\n{self.log.read_text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"iteration {n - 1} not done in {timeout}s:\n{self.log.read_text()[-4000:]}"
                )
            time.sleep(0.2)

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.fh.close()
        return code, self.log.read_text()


@pytest.fixture(scope="module")
def fault_run(tiny_policy, tmp_path_factory):
    cluster = LocalCluster([{"rollout": 2, "env_worker": 2}] * 2, head_resources={"learner": 1})
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    out: dict = {"run_dir": run_dir}
    try:
        run = _Run(
            [
                "configs/quickstart.yaml",
                "--run-dir",
                str(run_dir),
                "--address",
                cluster.address,
                *_overrides(tiny_policy),
            ],
            run_dir.parent / "first.log",
        )

        def mid_rollout(iteration: int) -> None:
            # iteration-1 is written: `iteration` is rolling out now
            run.wait_rows(run_dir, iteration)
            time.sleep(1.5)

        mid_rollout(ENV_KILL)
        envs = cluster.actor_pids("EnvWorker")
        assert len(envs) == 2, envs
        kill(envs[0])

        mid_rollout(ROLLOUT_KILL)
        workers = cluster.actor_pids("RolloutWorker")
        assert len(workers) == 2, workers
        kill(workers[0])

        mid_rollout(NODE_KILL)
        node = cluster.node_of(cluster.actor_pids("RolloutWorker")[0])
        out["node_actors"] = {
            c: len(cluster.actor_pids(c, node)) for c in ("RolloutWorker", "EnvWorker")
        }
        cluster.kill_node(node)
        out["killed_node"] = node

        run.wait_rows(run_dir, LEARNER_KILL)
        out["survivors"] = {
            c: [cluster.node_of(pid) for pid in cluster.actor_pids(c)]
            for c in ("RolloutWorker", "EnvWorker", "Learner")
        }
        learner = cluster.actor_pids("Learner", node=-1)
        assert len(learner) == 1, learner
        kill(learner[0])
        out["first"] = run.finish()
        out["rows_before_resume"] = _rows(run_dir)

        resumed = _Run(
            ["--resume", str(run_dir), "--address", cluster.address], run_dir.parent / "resume.log"
        )
        out["resume"] = resumed.finish()
        out["rows"] = _rows(run_dir)
        yield out
    finally:
        cluster.stop()
        time.sleep(0.5)
        assert cluster.leftovers() == []


def _row(out: dict, iteration: int) -> dict:
    (row,) = [r for r in out["rows"] if r["iteration"] == iteration]
    return row


def test_env_worker_death_ends_its_episodes_as_infra_errors_and_the_run_goes_on(fault_run):
    row = _row(fault_run, ENV_KILL)
    assert row["episodes"] == EPISODES
    # its in-flight episodes, kept out of the group statistics
    assert 0 < row["infra_errors"] <= EPISODES, row
    assert row["stop_reasons"].get("infra_error", 0) == row["infra_errors"]
    # kept out of the group statistics: the learner trained on (and annotated) the others only
    from rl.store import TrajectoryStore

    store = TrajectoryStore(fault_run["run_dir"])
    shard = store.dir / f"iter-{ENV_KILL:06d}.parquet"
    trajs = list(store.trajectories(shard))
    failed = {t.episode_id for t in trajs if t.infra_error}
    assert len(failed) == row["infra_errors"]
    trained = {r["episode_id"] for r in store.learner_records(["episode_id"])}
    usable = {}  # group -> its episodes that did not fail; a group needs two to compare
    for t in trajs:
        if not t.infra_error:
            usable.setdefault(t.group_id, set()).add(t.episode_id)
    expected = set().union(*[ids for ids in usable.values() if len(ids) >= 2])
    assert {t.episode_id for t in trajs} & trained == expected
    # Ray restarted it: the episodes after the node loss run on env workers again, with no infra error
    assert _row(fault_run, ITERATIONS - 1)["infra_errors"] == 0


def test_rollout_worker_death_reruns_its_share_on_the_restarted_worker(fault_run):
    code, log = fault_run["first"]
    before, row = _row(fault_run, ROLLOUT_KILL - 1), _row(fault_run, ROLLOUT_KILL)
    assert "died" in log and f"iteration {ROLLOUT_KILL} again" in log, log[-3000:]
    assert row["worker_restarts"] > before["worker_restarts"]
    assert row["episodes_rerun"] - before["episodes_rerun"] == EPISODES // 2  # exactly its share
    assert row["episodes"] == EPISODES and row["infra_errors"] == 0
    # every turn, the rerun ones included, was generated by this iteration's weights (version
    # ROLLOUT_KILL, after the updates before it), not the restarted worker's initial ones
    from rl.store import TrajectoryStore

    store = TrajectoryStore(fault_run["run_dir"])
    trajs = list(store.trajectories(store.dir / f"iter-{ROLLOUT_KILL:06d}.parquet"))
    assert len(trajs) == EPISODES
    assert {turn.policy_version for t in trajs for turn in t.turns} == {ROLLOUT_KILL}
    assert row["policy_version"] == ROLLOUT_KILL + 1


def test_worker_node_death_moves_its_actors_to_the_surviving_node(fault_run):
    assert fault_run["node_actors"]["RolloutWorker"] >= 1
    before, row = _row(fault_run, NODE_KILL - 1), _row(fault_run, NODE_KILL)
    assert row["worker_restarts"] > before["worker_restarts"]
    assert row["episodes"] == EPISODES
    # after it, every actor lives again, the workers on the surviving node, the learner on the head
    survivor = 1 - fault_run["killed_node"]
    assert fault_run["survivors"] == {
        "RolloutWorker": [survivor] * 2,
        "EnvWorker": [survivor] * 2,
        "Learner": [-1],
    }


def test_learner_death_stops_the_run_with_a_clear_error_and_resume_finishes_it(fault_run):
    code, log = fault_run["first"]
    assert code == 1, log[-3000:]
    assert "the learner died during the update of iteration 4" in log
    assert f"--resume {fault_run['run_dir']}" in log and "version-000004" in log
    assert [r["iteration"] for r in fault_run["rows_before_resume"]] == list(range(LEARNER_KILL))
    code, log = fault_run["resume"]
    assert code == 0, log[-3000:]
    assert "resumed from version-000004" in log
    assert [r["iteration"] for r in fault_run["rows"]] == list(range(ITERATIONS))
    assert [r["policy_version"] for r in fault_run["rows"]] == list(range(1, ITERATIONS + 1))
    assert (
        fault_run["run_dir"] / "checkpoints" / f"version-{ITERATIONS:06d}" / "trainer_state.pt"
    ).exists()


def test_the_store_holds_every_episode_id_exactly_once(fault_run):
    from rl.store import TrajectoryStore

    store = TrajectoryStore(fault_run["run_dir"])
    ids = [t.episode_id for t in store.trajectories()]
    expected = {f"i{i}-g{g}-e{k}" for i in range(ITERATIONS) for g in range(2) for k in range(2)}
    assert len(ids) == len(set(ids)) == ITERATIONS * EPISODES
    assert set(ids) == expected
    # the iteration the learner died in was rolled out twice: its first shard is set aside, not deleted
    assert list((store.dir / "superseded").glob(f"iter-{LEARNER_KILL:06d}-*.parquet"))
