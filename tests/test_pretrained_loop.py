"""The whole loop on the real pretrained policy: SmolLM2-135M-Instruct from the installed package,
upcycled into a 4-expert top-1 Mixtral (rl/start/pretrained.py), served by vLLM, trained in full by the
learner, synced back in place. Two short iterations: the engine's and the learner's log-probs
agree before the first update and again after a sync, every parameter (routers included) moves,
the expert-load metric is reported, and the checkpoint is a Mixtral that `longhorizon eval` serves."""

import json
import subprocess
import sys

import numpy as np
import pytest
import ray

from conftest import REPO
from rl.store import TrajectoryStore

pytestmark = pytest.mark.slow

OVERRIDES = [
    "iterations=2",
    "policy.pretrained=smollm2-135m-instruct",
    "policy.upcycle.experts=4",
    "policy.upcycle.top_k=1",
    "rollout.num_workers=1",
    "rollout.groups_per_iteration=1",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=24",
    "rollout.temperature=0.7",
    "rollout.max_episode_tokens=1024",
    "rollout.max_model_len=1024",
    "rollout.cpus_per_worker=0",
    "algo.lr=1e-5",
    "algo.entropy_coef=0.01",
    "algo.router_aux_coef=0.01",
    "learner.microbatch_tokens=2048",
]


def naive_load_imbalance(policy_dir: str, sequences: list[list[int]]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    loads: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for ids in sequences:
            out = model(torch.tensor([list(ids)]), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):  # tokens × experts
                count = torch.bincount(logits.argmax(-1).flatten(), minlength=logits.shape[-1])
                loads[layer] = loads.get(layer, 0) + count
    return max(float(c.max()) / float(c.float().mean()) for c in loads.values())


@pytest.fixture(scope="module")
def pretrained_run(ray_cluster, tmp_path_factory):
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    cfg = load_config(REPO / "configs" / "quickstart.yaml", OVERRIDES)
    run_dir = tmp_path_factory.mktemp("pretrained-run")
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.start()
        yield trainer, trainer.run(), run_dir
    finally:
        trainer.close()


def test_engine_and_learner_agree_before_the_first_update_and_after_a_sync(pretrained_run):
    trainer, rows, run_dir = pretrained_run
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert ray.get([w.version.remote() for w in trainer.workers]) == [2]
    # iteration 0 was sampled from the upcycled checkpoint vLLM loaded from disk, iteration 1 from
    # the weights the learner synced in place after its first update
    for r in rows:
        assert r["rollout_kl"] < 1e-3 and r["rollout_logprob_diff_max"] < 1e-3, r
        assert r["grad_norm"] > 0
    (traj, *_) = TrajectoryStore(run_dir).trajectories()
    ids = traj.token_ids[:160]
    learner = np.array(trainer.learner.call("logprobs", ids))
    engine = np.array(ray.get(trainer.workers[0].score.remote(ids)))
    assert np.abs(engine - learner).max() < 1e-3


def test_expert_load_is_reported_and_every_parameter_trains(pretrained_run):
    import torch
    from safetensors import safe_open

    trainer, rows, run_dir = pretrained_run
    # the reported load is the worst layer's max/mean expert load over the first step's tokens: the
    # same count, done naively (Hugging Face's own Mixtral on the starting checkpoint, one episode at
    # a time, each token's top-1 expert from its router logits); the learner routes as vLLM did
    # (routing replay), so a token near a tie may count for another expert
    episodes = [t for t in TrajectoryStore(run_dir).trajectories() if t.iteration == 0]
    assert len(episodes) == 2
    naive = naive_load_imbalance(trainer.policy_path(), [t.token_ids for t in episodes])
    assert abs(rows[0]["router_load_max_over_mean"] - naive) < 0.02 * naive, (rows[0], naive)
    # every layer's shares per expert are in the row too (the plot's router_load.png)
    shares = np.array(rows[0]["router_load"])
    assert shares.shape == (30, 4) and np.allclose(shares.sum(-1), 1.0)
    assert abs(shares.max() * 4 - rows[0]["router_load_max_over_mean"]) < 1e-4
    assert all(r["router_aux_loss"] > 0 for r in rows)
    ckpt = run_dir / "checkpoints" / "version-000002"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4
    start = trainer.policy_path()
    moved = []
    with (
        safe_open(f"{start}/model.safetensors", "pt") as a,
        safe_open(f"{ckpt}/model.safetensors", "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            moved.append((name, not torch.equal(a.get_tensor(name), b.get_tensor(name))))
    routers = [ok for name, ok in moved if name.endswith("block_sparse_moe.gate.weight")]
    assert len(routers) == 30 and all(routers)  # top-1 routers learn from the balancing term alone
    assert sum(ok for _, ok in moved) / len(moved) > 0.9, [n for n, ok in moved if not ok][:10]


def test_the_checkpoint_is_served_by_eval(pretrained_run):
    _, _, run_dir = pretrained_run
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "eval",
            str(run_dir),
            "--episodes",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 2 and summary["infra_errors"] == 0
    assert summary["policy"].endswith("version-000002")
