"""The learner group (rl/learner/learner_group.py): N Learner actors sharding one model (FSDP2 + expert
parallelism over gloo) must train exactly like the single learner, for the tiny Hugging Face
Qwen3-MoE and for the `policy/` model, save sharded checkpoints that resume, and run the
quickstart end to end."""

from __future__ import annotations

import random

import pytest
import torch

from rl.config import AlgoConfig, LearnerConfig
from rl.learner.shares import deal_by_tokens, padded_slots
from rollout.trajectory import Trajectory, Turn


def test_episodes_are_dealt_by_tokens_and_every_rank_gets_the_same_number_of_slots():
    lengths = [50, 10, 40, 30, 20, 5, 45]
    shares = deal_by_tokens(list(range(7)), lengths, 3)
    assert sorted(i for s in shares for i in s) == list(range(7))  # each episode exactly once
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first keeps the shares near
    assert shares == deal_by_tokens(list(range(7)), lengths, 3)  # every rank computes the same deal
    assert deal_by_tokens([0, 1], [3, 3], 4) == [[0], [1], [], []]
    micro = [[[0, 1], [2]], [[3]], []]
    assert [padded_slots(micro, r) for r in range(3)] == [[[0, 1], [2]], [[3], None], [None, None]]


def batch_of(tokenizer, n: int, seed: int) -> list[Trajectory]:
    """`n` episodes of different lengths in groups of two, rewards mixed so advantages are non-zero."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        reward = float((i + seed) % 3 == 0)
        ids = tokenizer.encode(
            " ".join(
                f"step {rng.randint(0, 99)} is {rng.randint(0, 99)}"
                for _ in range(rng.randint(1, 6))
            )
        )
        gen = len(ids) - 3
        out.append(
            Trajectory(
                episode_id=f"s{seed}-e{i}",
                iteration=0,
                group_id=i // 2,
                env_id="x",
                seed=i,
                prompt_len=3,
                token_ids=ids,
                loss_mask=[0] * 3 + [1] * gen,
                rollout_logprobs=[0.0] * 3 + [-2.0] * gen,
                reward=reward,
                milestones=[{"name": "solved", "reward": reward, "turn": 0}] if reward else [],
                turns=[
                    Turn(
                        gen_start=3,
                        gen_end=len(ids),
                        obs_end=len(ids),
                        text="",
                        observation="",
                        tool_calls=0,
                        tool_errors=0,
                        policy_version=seed,
                        seed=i,
                        finish_reason="stop",
                    )
                ],
            )
        )
    return out


ALGO = dict(lr=1e-2, minibatch_episodes=5, max_grad_norm=0.01)
SYSTEM = LearnerConfig(microbatch_tokens=48, threads=1)


def single_run(path: str, algo: AlgoConfig, batches) -> tuple[list[dict], list[dict]]:
    from rl.learner.learner import Learner

    learner = Learner(path, algo, SYSTEM, seed=0, max_generated_tokens=64)
    stats, states = [], []
    for batch in batches:
        stats.append(learner.train_step(batch))
        states.append({n: torch.from_numpy(a.copy()) for n, a in learner.weights()})
    return stats, states


def assert_close_to_single(stats, state, ref_stats, ref_state, lr: float) -> None:
    for key in ("loss", "grad_norm", "rollout_kl", "adv_abs_mean"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-4, abs=1e-6), key
    assert ref_stats["grad_norm"] > ALGO["max_grad_norm"]  # clipping was exercised
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        # AdamW's step is ~lr·sign(g): float noise in a near-zero gradient entry shows as a visible
        # step, so the tolerance is a share of one step per optimiser step taken
        assert torch.allclose(state[name], ref, atol=0.02 * lr), (
            name,
            (state[name] - ref).abs().max(),
        )
    ann, ref_ann = stats["annotations"], ref_stats["annotations"]
    assert ann.keys() == ref_ann.keys()
    for ep, a in ann.items():
        assert a["learner_logprobs"] == pytest.approx(ref_ann[ep]["learner_logprobs"], abs=1e-4)
        assert a["advantages"] == pytest.approx(ref_ann[ep]["advantages"], abs=1e-6)


def group_state(group) -> dict:
    return {n: torch.from_numpy(a.copy()) for n, a in group.call("weights")}


@pytest.mark.slow
def test_a_two_rank_group_trains_the_hf_moe_like_one_learner_and_resumes_from_its_sharded_checkpoint(
    ray_cluster, tiny_policy, tokenizer, tmp_path
):
    """Tiny Qwen3-MoE (8 experts, 4 per rank), GRPO, two minibatches of five episodes each packed
    unevenly (ranks run dummy micro-batches): loss, clipped norm, KL, advantages, annotations and
    every weight equal the single learner's. A sharded checkpoint then resumes on a fresh group,
    whose next step equals the single learner's second (parameters and AdamW moments restored)."""
    from rl.learner.learner import Learner
    from rl.learner.learner_group import LearnerGroup
    from rl.learner.logprobs import load_causal_lm

    algo = AlgoConfig(**ALGO)
    batches = [batch_of(tokenizer, 10, seed) for seed in (0, 1)]
    ref_stats, ref_states = single_run(tiny_policy, algo, batches)
    group = LearnerGroup(
        2, {"num_cpus": 0}, tiny_policy, algo, SYSTEM, seed=0, max_generated_tokens=64
    )
    try:
        stats = group.call("train_step", batches[0])
        assert stats["policy_version"] == 1
        state = group_state(group)
        assert_close_to_single(stats, state, ref_stats[0], ref_states[0], algo.lr)
        ckpt = tmp_path / "version-000001"
        group.call("save_checkpoint", str(ckpt), {"iteration": 0})
    finally:
        group.kill()
    assert len(list((ckpt / "sharded").glob("*.distcp"))) == 2  # one file of shards per rank
    full = load_causal_lm(ckpt, torch.float32)  # the full copy, HF format, named as published
    saved = dict(full.checkpoint_names(full.module.state_dict().items()))
    assert all(torch.equal(saved[n], state[n]) for n in state)
    with pytest.raises(ValueError, match="learner group of 2 ranks"):
        Learner(tiny_policy, algo, SYSTEM).load_checkpoint(str(ckpt))

    group = LearnerGroup(
        2, {"num_cpus": 0}, tiny_policy, algo, SYSTEM, seed=0, max_generated_tokens=64
    )
    try:
        restored = group.call("load_checkpoint", str(ckpt))
        assert restored["version"] == 1 and restored["iteration"] == 0
        assert all(torch.equal(v, state[n]) for n, v in group_state(group).items())
        stats = group.call("train_step", batches[1])
        assert stats["policy_version"] == 2
        assert_close_to_single(stats, group_state(group), ref_stats[1], ref_states[1], algo.lr)
    finally:
        group.kill()


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["quantile", "quantile_hist"])
def test_a_two_rank_group_trains_the_policy_model_with_ppo_and_balancing_like_one_learner(
    ray_cluster, tmp_path, balance
):
    """The `policy/` debug flavour (3 LatentMoE layers, 8 experts), PPO (a value head outside the
    sharded model, its gradients summed across ranks) and quantile balancing from every rank's
    router scores (exact: the scores gathered; histogram: the counts summed): one update equals the
    single learner's, router biases included."""
    import dataclasses

    from transformers import AutoTokenizer

    from policy.args import load_model_args
    from rl.learner.learner_group import LearnerGroup
    from rl.start.tiny import make_tiny_policy

    args = load_model_args("configs/policy/debug.yaml")
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, balance=balance))
    path = str(make_tiny_policy(tmp_path / "policy", args))
    tokenizer = AutoTokenizer.from_pretrained(path)
    algo = AlgoConfig(**ALGO, name="ppo")
    batch = batch_of(tokenizer, 10, 0)
    ref_stats, ref_states = single_run(path, algo, [batch])
    assert any("router.bias" in n for n in ref_states[0])
    group = LearnerGroup(2, {"num_cpus": 0}, path, algo, SYSTEM, seed=0, max_generated_tokens=64)
    try:
        stats = group.call("train_step", batch)
        assert stats["value_loss"] == pytest.approx(ref_stats[0]["value_loss"], rel=1e-4)
        assert stats["router_load_max_over_mean"] == pytest.approx(
            ref_stats[0]["router_load_max_over_mean"]
        )
        assert_close_to_single(stats, group_state(group), ref_stats[0], ref_states[0], algo.lr)
    finally:
        group.kill()


@pytest.mark.slow
def test_the_quickstart_runs_with_a_two_rank_learner_and_resumes(
    ray_cluster, tiny_policy, tmp_path
):
    """`learner.world_size=2` by config only: two iterations through vLLM, env workers and weight
    sync; the rollout worker serves exactly the group's gathered weights; the run resumes from its
    sharded checkpoint for a third iteration."""
    import numpy as np
    import ray

    from conftest import REPO
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    overrides = [
        "iterations=2",
        f"policy.path={tiny_policy}",
        "learner.world_size=2",
        "algo.entropy_coef=0.01",
        "rollout.cpus_per_worker=0",
        "eval.every=0",
    ]
    run_dir = tmp_path / "run"
    trainer = Trainer(load_config(REPO / "configs" / "quickstart.yaml", overrides), run_dir)
    try:
        trainer.start()
        rows = trainer.run()
        assert [r["policy_version"] for r in rows] == [1, 2]
        assert all(r["grad_norm"] > 0 for r in rows)
        # after the last sync the worker's engine scores a sequence as the group's sharded model does
        seq = list(range(5, 25))
        learner = np.array(trainer.learner.call("logprobs", seq))
        engine = np.array(ray.get(trainer.workers[0].score.remote(seq)))
        assert np.abs(learner - engine).max() < 2e-3
    finally:
        trainer.close()
    assert (run_dir / "checkpoints" / "version-000002" / "sharded").is_dir()
    trainer = Trainer(
        load_config(
            REPO / "configs" / "quickstart.yaml",
            [o for o in overrides if o != "iterations=2"] + ["iterations=3"],
        ),
        run_dir,
    )
    try:
        trainer.start(resume=True)
        rows = trainer.run()
        assert [r["policy_version"] for r in rows] == [3]
    finally:
        trainer.close()
