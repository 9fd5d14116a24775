"""Asynchronous schedule end to end on the session's Ray: rollouts of later iterations run while
the learner trains, every turn carries the version that generated it, no token is older than
`max_staleness` allows, the learner sees (and reports) the lag, and the last bucketed sync still
leaves the engine on exactly the learner's weights. Metrics also go to an offline W&B run."""

import json

import pytest
import ray
import torch

from conftest import REPO
from rl.store import TrajectoryStore

pytestmark = pytest.mark.slow
TOL = 1e-3
STALENESS = 2
ITERATIONS = 4


@pytest.fixture(scope="module")
def async_run(ray_cluster, tiny_policy, tmp_path_factory):
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"iterations={ITERATIONS}",
            f"policy.path={tiny_policy}",
            "algo.entropy_coef=0.01",
            "rollout.num_workers=1",
            "rollout.groups_per_iteration=2",
            "rollout.group_size=2",
            "rollout.max_turns=2",
            "schedule.mode=async",
            f"schedule.max_staleness={STALENESS}",
            "sync.bucket_mb=0.25",
            "log.wandb_project=longhorizon-tests",
            "log.wandb_mode=offline",
        ],
    )
    run_dir = tmp_path_factory.mktemp("async-run")
    trainer = Trainer(cfg, run_dir)
    trainer.start()
    try:
        before = ray.get(trainer.workers[0].engine_busy_s.remote())
        rows = trainer.run()
        trainer.engine_busy_in_run = ray.get(trainer.workers[0].engine_busy_s.remote()) - before
        yield trainer, rows, run_dir
    finally:
        trainer.close()


def test_each_iteration_is_generated_by_the_version_the_schedule_allows(async_run):
    _, rows, run_dir = async_run
    versions = {}
    for t in TrajectoryStore(run_dir).trajectories():
        versions.setdefault(t.iteration, set()).update(turn.policy_version for turn in t.turns)
    # iterations 0..STALENESS start together on version 0; iteration j > STALENESS waits for version
    # j - STALENESS, and a load landing while it runs serves its later turns (trained at version j)
    assert sorted(versions) == list(range(ITERATIONS))
    for j, vs in versions.items():
        assert max(0, j - STALENESS) <= min(vs) and max(vs) <= j, (j, vs)
    assert versions[0] == {0}
    assert [r["staleness_max"] for r in rows] == [j - min(versions[j]) for j in range(ITERATIONS)]
    assert max(r["staleness_max"] for r in rows) > 0  # the schedule did run ahead of the learner
    # the engine's share of each row's wall time: in async mode a row may find its rollouts done
    # earlier, but over the rows every second the engine spent in calls during the run is counted once
    # (1.1: the worker reads its clock inside a Ray call, a few milliseconds off the driver's)
    trainer = async_run[0]
    assert all(0 <= r["engine_busy"] <= 1.1 for r in rows) and trainer.engine_busy_in_run > 0
    counted = sum(r["engine_busy"] * r["iteration_s"] for r in rows)
    assert counted == pytest.approx(trainer.engine_busy_in_run, rel=1e-3, abs=0.01)
    assert [r["policy_version"] for r in rows] == list(range(1, ITERATIONS + 1))
    assert all(r["stale_episodes_dropped"] == 0 for r in rows)


def test_the_learner_measures_the_lag_of_stale_tokens(async_run):
    _, rows, _ = async_run
    # iteration 0: tokens of the weights being trained, so the engine's log-probs match the learner's
    assert (
        rows[0]["rollout_logprob_diff_mean_current"] < TOL
        and "rollout_logprob_diff_mean_stale" not in rows[0]
    )
    # later iterations' stale tokens: sampled by older weights, the learner's log-probs differ for real
    stale = [r for r in rows[1:] if r["staleness_max"] > 0]
    assert stale
    for r in stale:
        assert r["rollout_logprob_diff_mean_stale"] > 10 * TOL
        assert 0 < r["staleness_token_mean"] <= r["staleness_max"] <= STALENESS


def test_every_sync_arrived_in_order(async_run):
    trainer, rows, _ = async_run
    synced = [r["sync_version"] for r in rows if "sync_version" in r]
    # the final version reached the worker
    assert synced == sorted(synced) and synced[-1] == ITERATIONS
    assert all(r["sync_buckets"] > 2 for r in rows if "sync_buckets" in r)
    assert ray.get([w.version.remote() for w in trainer.workers]) == [ITERATIONS]


def test_after_the_last_bucketed_sync_the_engine_matches_the_learner(async_run):
    trainer, _, run_dir = async_run
    t = next(iter(TrajectoryStore(run_dir).trajectories()))
    ids = t.token_ids[:200]
    learner = trainer.learner.call("logprobs", ids)
    engine = ray.get(trainer.workers[0].score.remote(ids))
    assert max(abs(a - b) for a, b in zip(learner, engine)) < TOL


def test_metrics_reach_an_offline_wandb_run(async_run):
    _, rows, run_dir = async_run
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    # one history record per row (plus the summary): every row's metric names are in the run's log
    for key in ("mean_reward", "policy_version", "staleness_max", "sync_s"):
        assert data.count(key.encode()) >= sum(key in r for r in rows), key
    assert (run_dir / "wandb-run-id").read_text().strip() in run_file.name
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == list(range(ITERATIONS))


def test_a_worker_runs_rollouts_at_once_and_one_waits_there_for_its_version(
    ray_cluster, tiny_policy
):
    """What the async schedule relies on: with a threaded actor, a rollout that needs a version not
    loaded yet waits on the worker while another rollout runs and ends; the load, arriving later,
    releases it, and its turns are that version's. A worker whose calls run one at a time refuses
    at once instead (waiting would hold the load behind it)."""
    from rl.config import EnvConfig
    from rollout.config import RolloutConfig
    from rollout.trajectory import EpisodeTask
    from rollout.weights import CheckpointTensors, publish, to_wire
    from rollout.worker import RolloutWorkerActor, StaleWorkerError

    cfg = RolloutConfig(
        max_model_len=1024, max_episode_tokens=512, max_new_tokens=24, max_turns=2, kv_cache_gib=1.0
    )
    env = EnvConfig(id="tools/calculator-v0", kwargs={"max_turns": 2})
    tasks = [EpisodeTask(f"e{i}", group_id=i, seed=i, iteration=0) for i in range(4)]
    worker = RolloutWorkerActor.options(num_cpus=0, max_concurrency=4).remote(
        tiny_policy, cfg, env, seed=0, wait_for_version_s=120.0
    )
    try:
        waiting = worker.rollout.remote(tasks[:2], 1)  # version 1 is not there yet
        running = worker.rollout.remote(tasks[2:], 0)
        done = ray.get(running, timeout=120)
        assert {turn.policy_version for t in done for turn in t.turns} == {0}
        # still waiting: nothing loaded version 1
        assert ray.wait([waiting], timeout=0)[1] == [waiting]
        ckpt = CheckpointTensors(tiny_policy)
        manifest = publish(
            to_wire(((n, ckpt[n]) for n in ckpt.files), torch.float32), 1, bucket_mb=1.0
        )
        assert ray.get(worker.load_weights.remote(manifest), timeout=120)["version"] == 1
        released = ray.get(waiting, timeout=120)
        assert len(released) == 2 and {
            turn.policy_version for t in released for turn in t.turns
        } == {1}
        # concurrent calls may start out of order: an older version arriving late never replaces a newer one
        older = publish(
            to_wire(((n, ckpt[n]) for n in ckpt.files), torch.float32), 0, bucket_mb=1.0
        )
        assert ray.get(worker.load_weights.remote(older), timeout=120)["superseded"] == 1
        assert ray.get(worker.version.remote()) == 1
    finally:
        ray.kill(worker)
    serial = RolloutWorkerActor.options(num_cpus=0).remote(tiny_policy, cfg, env, seed=0)
    try:
        with pytest.raises(StaleWorkerError, match="holds policy version 0, the rollout needs 1"):
            ray.get(serial.rollout.remote(tasks[:1], 1), timeout=120)
    finally:
        ray.kill(serial)
