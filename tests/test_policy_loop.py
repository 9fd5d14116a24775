"""The whole loop with the project's own `policy/` model, by config only (configs/quickstart_policy.yaml):
a random debug-flavour policy made on the fly, served by vLLM through the project's plugin (the
config as written), or by native-engine rollout workers recording routed experts for the learner to
replay (`rollout.engine=native`); weight sync, checkpoints and held-out evaluation."""

import json
import subprocess
import sys

import numpy as np
import pytest
import ray

from conftest import REPO
from rl.store import TrajectoryStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy_run(ray_cluster, tmp_path_factory):
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    cfg = load_config(
        REPO / "configs" / "quickstart_policy.yaml", OVERRIDES + ["rollout.engine=native"]
    )
    run_dir = tmp_path_factory.mktemp("policy-run")
    trainer = Trainer(cfg, run_dir)
    try:  # a failed run still takes its actors down
        trainer.start()
        yield trainer, trainer.run(), run_dir
    finally:
        trainer.close()


OVERRIDES = [
    "iterations=2",
    "algo.entropy_coef=0.01",
    "rollout.groups_per_iteration=2",
    "rollout.max_new_tokens=24",
    "sync.bucket_mb=0.05",
    # the session's other runs may hold most of the local Ray's CPUs
    "rollout.cpus_per_worker=0",
]


def test_the_config_as_written_trains_the_policy_model_through_vllm(ray_cluster, tmp_path):
    """configs/quickstart_policy.yaml unchanged but shortened: vLLM rollout workers serving the
    policy/ model through the plugin, its log-probs equal to the learner's before the first update,
    two updates synced into both workers (their scores then equal the learner's), policy/
    checkpoints. No routing is recorded (vLLM's CPU build has no capture), so none is replayed."""
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    cfg = load_config(REPO / "configs" / "quickstart_policy.yaml", OVERRIDES)
    assert cfg.rollout.engine == "vllm"
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.start()
        rows = trainer.run()
        assert [r["policy_version"] for r in rows] == [1, 2]
        assert ray.get([w.version.remote() for w in trainer.workers]) == [2, 2]
        assert all(r["grad_norm"] > 0 for r in rows)
        assert rows[0]["rollout_kl"] < 1e-3 and rows[0]["rollout_logprob_diff_max"] < 1e-3
        assert "routing_replay_decisions" not in rows[0]
        (traj, *_) = TrajectoryStore(tmp_path / "run").trajectories()
        ids = traj.token_ids[:200]
        learner = np.array(trainer.learner.call("logprobs", ids))
        for w in trainer.workers:
            assert np.abs(np.array(ray.get(w.score.remote(ids))) - learner).max() < 1e-3
    finally:
        trainer.close()
    cfg = json.loads(
        (tmp_path / "run" / "checkpoints" / "version-000002" / "config.json").read_text()
    )
    assert cfg["model_type"] == "longhorizon_policy"


def test_the_loop_trains_the_policy_model_through_the_native_engine(policy_run):
    trainer, rows, run_dir = policy_run
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert ray.get([w.version.remote() for w in trainer.workers]) == [2, 2]
    assert all(r["grad_norm"] > 0 for r in rows)  # the entropy bonus moves the weights every step
    # routing replay ran on every generated token's context, and before the first update the
    # learner's router agrees with the engine's recorded choices and its log-probs with the engine's
    assert all(r["routing_replay_decisions"] > 0 for r in rows)
    assert rows[0]["router_decisions_differ"] < 1e-3 and rows[0]["rollout_kl"] < 1e-3
    assert (run_dir / "policy-init" / "tokenizer.json").exists()


def test_after_sync_the_workers_serve_the_learners_weights(policy_run):
    trainer, _, run_dir = policy_run
    (traj, *_) = TrajectoryStore(run_dir).trajectories()
    ids = traj.token_ids[:200]
    learner = np.array(trainer.learner.call("logprobs", ids))
    for w in trainer.workers:
        assert np.abs(np.array(ray.get(w.score.remote(ids))) - learner).max() < 1e-3


def test_stored_trajectories_carry_routed_experts_for_replay(policy_run):
    _, _, run_dir = policy_run
    stored = list(TrajectoryStore(run_dir).trajectories())
    assert len(stored) == 2 * 2 * 4
    moe_layers, top_k = 3, 2  # debug flavour: layers 1-3 LatentMoE, top-2
    for t in stored:
        assert len(t.routed_experts) == len(t.token_ids)
        recorded = [r for r in t.routed_experts if r]
        # every token the engine ran is recorded: all but the episode's last token(s) never fed back
        assert len(recorded) >= len(t.token_ids) - 2
        assert all(
            len(r) == moe_layers and all(len(x) == top_k and len(set(x)) == top_k for x in r)
            for r in recorded
        )
        gen = [p for p, m in enumerate(t.loss_mask) if m]
        assert all(t.routed_experts[p] for p in gen[:-1])


def test_checkpoints_are_policy_checkpoints_that_eval_serves(policy_run):
    _, _, run_dir = policy_run
    ckpt = run_dir / "checkpoints" / "version-000002"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "longhorizon_policy" and (ckpt / "tokenizer.json").exists()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "eval",
            str(ckpt),
            "--env",
            "tools/calculator-v0",
            "--episodes",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        summary["episodes"] == 4 and summary["policy"] == str(ckpt) and summary["infra_errors"] == 0
    )
