"""GRPO advantages and loss against values computed by hand."""

import math

import pytest
import torch

from rl.learner.grpo import group_advantages, policy_loss, token_logprobs


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, scale="group", eps=1e-4)
    # group 0: mean 0.5, Bessel std sqrt(1/3); group 1: all equal -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0], abs=1e-6)


def test_group_advantages_unscaled_and_batch():
    rewards = torch.tensor([3.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([7, 7, 9, 9])
    assert group_advantages(rewards, groups, scale="none").tolist() == pytest.approx(
        [1.0, -1.0, 0.0, 0.0]
    )
    batch_std = torch.tensor([3.0, 1.0, 0.0, 0.0]).std().item()
    expect = [1 / (batch_std + 1e-4), -1 / (batch_std + 1e-4), 0.0, 0.0]
    assert group_advantages(rewards, groups, scale="batch").tolist() == pytest.approx(
        expect, abs=1e-6
    )
    with pytest.raises(ValueError, match="unknown reward scaling"):
        group_advantages(rewards, groups, scale="rank")


def _case():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.5, -0.5, -2.5]])
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.5, 1.5]])
    logp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logp, old, adv, mask


def test_clipped_loss_token_mean_by_hand():
    logp, old, adv, mask = _case()
    loss, m = policy_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="token_mean"
    )
    # ep0 (A=+1): -1, -min(1.5, 1.28) = -1.28, masked; ep1 (A=-1): +1, -min(-0.5, -0.8) = 0.8, -min(-1.5, -1.28) = 1.5
    assert loss.item() == pytest.approx((-1 - 1.28 + 1 + 0.8 + 1.5) / 5, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    loss.backward()
    g = logp.grad
    assert g[0, 1].item() == 0.0  # clipped with A > 0: no gradient
    assert g[1, 1].item() == 0.0  # clipped with A < 0: no gradient
    # ratio*A kept: d(-r*A)/dlogp = -A*r / n
    assert g[1, 2].item() == pytest.approx(-1 * 1.5 * -1 / 5)
    assert g[0, 2].item() == 0.0  # masked


def test_clipped_loss_seq_mean_by_hand():
    logp, old, adv, mask = _case()
    loss, _ = policy_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="seq_mean"
    )
    assert loss.item() == pytest.approx(((-1 - 1.28) / 2 + (1 + 0.8 + 1.5) / 3) / 2, abs=1e-6)


def test_entropy_bonus_lowers_loss_by_coef_times_mean_entropy():
    logp, old, adv, mask = _case()
    ent = torch.full((2, 3), 2.0)
    base, _ = policy_loss(logp, old, adv, mask)
    bonus, _ = policy_loss(logp, old, adv, mask, entropy_BT=ent, entropy_coef=0.1)
    assert (base - bonus).item() == pytest.approx(0.2, abs=1e-6)


def test_token_logprobs_shift_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
    ids = torch.tensor([[0, 1, 2]])
    lp = token_logprobs(logits, ids)
    assert lp.exp()[0].tolist() == pytest.approx([0.25, 0.1], abs=1e-6)


def test_dual_clip_bounds_negative_advantage_loss_by_hand():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(5.0), math.log(1.1)]])  # ratios 5 and 1.1
    adv = torch.tensor([-1.0])
    mask = torch.ones(1, 2)
    plain, _ = policy_loss(logp, old, adv, mask, aggregation="token_mean")
    dual, _ = policy_loss(logp, old, adv, mask, aggregation="token_mean", dual_clip=3.0)
    # plain: -min(-5, -1.28) = 5 and -min(-1.1, -1.1) = 1.1; dual clip caps the first at 3
    assert plain.item() == pytest.approx((5 + 1.1) / 2)
    assert dual.item() == pytest.approx((3 + 1.1) / 2)


def test_rollout_importance_weights_by_hand():
    """Every `algo.rollout_is` mode on two sequences whose learner/engine ratios are known: tokens
    (1.25, 4, 1) and (1, 0.25, and a token outside the mask)."""
    from rl.learner.grpo import rollout_is_weights

    old = torch.tensor([[0.5, 0.2, 0.3], [0.4, 0.1, 0.9]]).log()
    rollout = torch.tensor([[0.4, 0.05, 0.3], [0.4, 0.4, 0.1]]).log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    geo = 5 ** (1 / 3)  # sequence ratios: products 5 and 0.25, geometric means 5^(1/3) and 0.5
    cases = [
        (dict(mode="token_truncate", high=2.0), [[1.25, 2, 1], [1, 0.25, 1]]),
        (dict(mode="token_truncate", low=0.5, high=2.0), [[1.25, 2, 1], [1, 0.5, 1]]),
        (
            dict(mode="token_mask", low=0.5, high=2.0),
            [[1.25, 0, 1], [1, 0, 1]],
        ),  # IcePop: both sides dropped
        (dict(mode="sequence_truncate", high=2.0), [[2, 2, 2], [0.25, 0.25, 1]]),
        (
            dict(mode="sequence_mask", low=0.5, high=10.0),
            [[5, 5, 5], [0, 0, 1]],
        ),  # MIS: the second sequence dropped
        (dict(mode="geometric_mask", low=0.6, high=2.0), [[geo] * 3, [0, 0, 1]]),
    ]
    for kwargs, expected in cases:
        w = rollout_is_weights(old, rollout, mask, **kwargs)
        assert w.tolist() == [pytest.approx(row, rel=1e-5) for row in expected], kwargs
    long = rollout_is_weights(
        torch.zeros(1, 4000),
        torch.full((1, 4000), -0.1),
        torch.ones(1, 4000),
        mode="sequence_mask",
        high=2.0,
    )
    assert torch.equal(long, torch.zeros(1, 4000))  # e^400 is out of bounds, not inf·0 = NaN
    with pytest.raises(ValueError, match="unknown rollout importance-sampling mode"):
        rollout_is_weights(old, rollout, mask, mode="tokens")


def test_the_learner_reports_and_corrects_the_engine_mismatch(tiny_policy, tokenizer):
    """A batch whose engine log-probs equal the learner's except on one episode, off by δ per token:
    the KL, χ² and perplexity ratio are those of that gap, and sequence_mask drops that episode."""
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner
    from rollout.trajectory import Trajectory

    delta = 0.3
    learner = Learner(
        tiny_policy,
        AlgoConfig(minibatch_episodes=4, rollout_is="sequence_mask", tis_cap=2.0, is_low=0.5),
        LearnerConfig(threads=1),
        seed=0,
    )
    batch, gen = [], []
    for i, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        ids = tokenizer.encode(f"question {i} answer {i * 7} and more")
        lp = [0.0] + learner.logprobs(ids)
        mask = [0] * 3 + [1] * (len(ids) - 3)
        off = delta if i == 0 else 0.0
        batch.append(
            Trajectory(
                f"e{i}",
                0,
                i // 2,
                "x",
                0,
                3,
                ids,
                mask,
                [x - off if m else 0.0 for x, m in zip(lp, mask)],
                reward=reward,
            )
        )
        gen.append(sum(mask))
    stats = learner.train_step(batch)
    share = gen[0] / sum(gen)  # the episode's share of the generated tokens
    assert stats["rollout_is_dropped_seqs"] == 0.25 and stats[
        "rollout_is_dropped_tokens"
    ] == pytest.approx(share)
    assert stats["rollout_kl"] == pytest.approx((math.exp(-delta) + delta - 1) * share, rel=1e-3)
    assert stats["rollout_chi2"] == pytest.approx((math.exp(delta) - 1) ** 2 * share, rel=1e-3)
    assert stats["rollout_ppl_ratio"] == pytest.approx(math.exp(-delta * share), rel=1e-3)
    assert stats["rollout_is_weight_mean"] == pytest.approx(1 - share, abs=1e-4)


def test_truncated_importance_weights_and_k1_kl_by_hand():
    from rl.learner.grpo import rollout_is_weights

    old = torch.tensor([[math.log(0.5), math.log(0.2)]])
    rollout = torch.tensor([[math.log(0.4), math.log(0.05)]])
    w = rollout_is_weights(old, rollout, torch.ones(1, 2), high=2.0)
    assert w.tolist()[0] == pytest.approx([1.25, 2.0])  # 0.2/0.05 = 4 is capped
    logp = old.clone()
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    weighted, _ = policy_loss(logp, old, adv, mask, is_weight_BT=w)
    assert weighted.item() == pytest.approx(-(1.25 + 2.0) / 2)
    ref = logp - torch.tensor([[0.1, -0.3]])
    with_kl, _ = policy_loss(logp, old, adv, mask, kl_beta=0.5, ref_logp_BT=ref, kl_estimator="k1")
    assert with_kl.item() == pytest.approx(-1 + 0.5 * (0.1 - 0.3) / 2)  # k1 = logp - ref, ratio 1


def test_learner_with_reference_kl_and_tis(tiny_policy, tokenizer):
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner
    from rollout.trajectory import Trajectory

    learner = Learner(
        tiny_policy,
        AlgoConfig(kl_beta=0.1, tis_cap=2.0, minibatch_episodes=2),
        LearnerConfig(threads=1),
        seed=0,
        max_generated_tokens=8,
    )
    assert learner.ref_model is not None and not any(
        p.requires_grad for p in learner.ref_model.parameters()
    )
    batch = []
    for i, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        ids = tokenizer.encode(f"question {i} answer {i * 7}")
        gen = len(ids) - 3
        lp = learner.logprobs(ids)
        batch.append(
            Trajectory(
                episode_id=f"e{i}",
                iteration=0,
                group_id=i // 2,
                env_id="x",
                seed=0,
                prompt_len=3,
                token_ids=ids,
                loss_mask=[0] * 3 + [1] * gen,
                rollout_logprobs=[0.0] * 3 + [x - 0.05 for x in lp[2:]],
                reward=reward,
            )
        )
    before = [p.detach().clone() for p in learner.model.parameters()]
    stats = learner.train_step(batch)
    assert stats["policy_version"] == 1
    assert stats["rollout_logprob_diff_max"] == pytest.approx(0.05, abs=1e-4)
    # every token's engine log-prob is 0.05 below the learner's: k3 KL = e^-0.05 + 0.05 - 1 per token
    assert stats["rollout_kl"] == pytest.approx(math.exp(-0.05) + 0.05 - 1, rel=1e-3)
    assert any((p - b).abs().max() > 0 for p, b in zip(learner.model.parameters(), before))
    assert stats["grad_norm"] > 0


def test_learner_skips_an_update_with_nothing_usable(tiny_policy, tokenizer):
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner
    from rollout.trajectory import Trajectory

    learner = Learner(tiny_policy, AlgoConfig(), LearnerConfig(threads=1), seed=0)
    ids = tokenizer.encode("a b c d")
    batch = [
        Trajectory(
            episode_id=f"e{i}",
            iteration=0,
            group_id=0,
            env_id="x",
            seed=0,
            prompt_len=2,
            token_ids=ids,
            loss_mask=[0, 0] + [1] * (len(ids) - 2),
            rollout_logprobs=[0.0] * len(ids),
            reward=float(i),
            infra_error="sandbox died",
        )
        for i in range(2)
    ]
    before = [p.detach().clone() for p in learner.model.parameters()]
    stats = learner.train_step(batch)
    assert (
        stats["skipped_update"] == 1
        and stats["infra_errors_dropped"] == 2
        and stats["policy_version"] == 1
    )
    assert all(torch.equal(p, b) for p, b in zip(learner.model.parameters(), before))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_in_the_reward(tiny_policy, tokenizer, estimator):
    """With `kl_in: reward`, each turn's β·KL(π_old‖π_ref) over its generated tokens comes off the
    episode's reward at that turn: checked against a hand computation from the learner's and the
    reference's log-probs, after one update has moved the policy away from the reference."""
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.grpo import group_advantages
    from rl.learner.learner import Learner
    from rollout.trajectory import Trajectory, Turn

    beta = 0.5
    learner = Learner(
        tiny_policy,
        AlgoConfig(
            kl_beta=beta, kl_in="reward", kl_estimator=estimator, lr=1e-2, minibatch_episodes=4
        ),
        LearnerConfig(threads=1),
        seed=0,
    )
    batch = []
    for i, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        ids = tokenizer.encode(f"question {i} answer {i * 7} and more {i}")
        n = len(ids)
        kw = dict(
            text="",
            observation="",
            tool_calls=0,
            tool_errors=0,
            policy_version=0,
            seed=0,
            finish_reason="stop",
        )
        turns = [
            Turn(gen_start=3, gen_end=6, obs_end=7, **kw),
            Turn(gen_start=7, gen_end=n, obs_end=n, **kw),
        ]
        mask = [0] * 3 + [1] * 3 + [0] + [1] * (n - 7)
        batch.append(
            Trajectory(
                episode_id=f"e{i}",
                iteration=0,
                group_id=i // 2,
                env_id="x",
                seed=0,
                prompt_len=3,
                token_ids=ids,
                loss_mask=mask,
                rollout_logprobs=[0.0] * n,
                reward=reward,
                turns=turns,
            )
        )
    first = learner.train_step(batch)  # the policy still equals the reference: no penalty
    assert first["kl_reward_penalty_mean"] == pytest.approx(0.0, abs=1e-6)
    # by hand: per turn, β Σ KL over its generated tokens, from the current and reference log-probs
    expected = []
    for t in batch:
        pol = learner.logprobs(t.token_ids)
        ref = learner.ref.module
        with torch.no_grad():
            logits = ref(torch.tensor([t.token_ids])).logits[0, :-1].float()
        ref_lp = (
            torch.log_softmax(logits, -1)
            .gather(-1, torch.tensor(t.token_ids[1:])[:, None])
            .squeeze(-1)
        )
        pen = []
        for turn in t.turns:
            d = [
                float(ref_lp[p - 1]) - pol[p - 1]
                for p in range(turn.gen_start, turn.gen_end)
                if t.loss_mask[p]
            ]
            pen.append(beta * sum((math.exp(x) - x - 1) if estimator == "k3" else -x for x in d))
        expected.append(pen)
    stats = learner.train_step(batch)
    assert stats["kl_reward_penalty_mean"] == pytest.approx(sum(map(sum, expected)) / 4, rel=1e-4)
    assert stats["kl_reward_penalty_mean"] > 1e-4  # the update moved the policy off the reference
    shaped = torch.tensor([t.reward - sum(p) for t, p in zip(batch, expected)])
    adv = group_advantages(shaped, torch.tensor([0, 0, 1, 1]))
    for i, t in enumerate(batch):  # the advantage each generated token was trained with
        got = stats["annotations"][t.episode_id]["advantages"]
        assert got[3] == pytest.approx(float(adv[i]), rel=1e-4, abs=1e-5)
