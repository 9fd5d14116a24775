"""PPO: GAE and the value loss against hand-computed values, decision points over turns, and a
learner that trains its value head towards the returns."""

import pytest
import torch

from rl.learner.ppo import decision_points, gae, value_loss
from rollout.trajectory import Trajectory, Turn


def test_gae_by_hand():
    adv, ret = gae([0.0, 0.0, 1.0], [0.5, 0.2, 0.4], gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.4
    d1 = 0.0 + 0.9 * 0.4 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert adv == pytest.approx([a0, a1, a2])
    assert ret == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4])
    adv, ret = gae([1.0, 2.0], [0.0, 0.0], gamma=1.0, lam=1.0)  # lambda 1: Monte-Carlo returns
    assert adv == [3.0, 2.0] and ret == [3.0, 2.0]


def test_value_loss_clips_by_hand():
    v, old, r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([2.0, 1.0])
    # first point: unclipped (1-2)^2 = 1, clipped value 0.2 -> (0.2-2)^2 = 3.24: max 3.24; second: 1
    assert value_loss(v, old, r, clip=0.2).item() == pytest.approx(0.5 * (3.24 + 1.0))


def _episode():
    # prompt 0-1, turn 0 generated 2-4, observation 5-6, turn 1 generated 7-8 then a closing token 9
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1, 0]
    turns = [
        Turn(2, 5, 7, "a", "o", 1, 0, 0, 0, "stop"),
        Turn(7, 10, 10, "b", "", 0, 0, 0, 1, "length"),
    ]
    return Trajectory(
        episode_id="e",
        iteration=0,
        group_id=0,
        env_id="x",
        seed=0,
        prompt_len=2,
        token_ids=list(range(10)),
        loss_mask=mask,
        rollout_logprobs=[-1.0 * m for m in mask],
        turns=turns,
        milestones=[
            {"name": "a", "reward": 0.25, "turn": 0},
            {"name": "b", "reward": 1.0, "turn": 1},
        ],
        reward=1.25,
    )


def test_decision_points_per_token_and_per_turn():
    t = _episode()
    points, covers, rewards = decision_points(t, "token")
    assert points == [2, 3, 4, 7, 8] and rewards == [
        0,
        0,
        0.25,
        0,
        1.0,
    ]  # the closing token 9 is not an action
    points, covers, rewards = decision_points(t, "turn")
    assert points == [2, 7] and covers == [[2, 3, 4], [7, 8]] and rewards == [0.25, 1.0]


def test_ppo_learner_fits_values_to_returns(tiny_policy, tokenizer):
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner

    learner = Learner(
        tiny_policy,
        AlgoConfig(
            name="ppo", lr=3e-3, vf_coef=1.0, value_clip=10.0, ppo_level="turn", gae_lambda=1.0
        ),
        LearnerConfig(threads=1),
    )
    ids = tokenizer.encode("one two three four five six seven eight nine ten")[:10]
    t = _episode()
    t.token_ids = ids
    losses = [learner.train_step([t, t])["value_loss"] for _ in range(30)]
    assert losses[-1] < 0.2 * losses[0]  # turn values move towards the returns 1.25 and 1.0
    with torch.no_grad():
        h = learner.lm.hidden(torch.tensor([ids]))
        v = learner.value_head(h[:, :-1])[0]
    assert v[1].item() == pytest.approx(1.25, abs=0.3) and v[6].item() == pytest.approx(
        1.0, abs=0.3
    )


def test_ppo_checkpoint_keeps_the_value_head(tiny_policy, tokenizer, tmp_path):
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner

    algo, system = AlgoConfig(name="ppo"), LearnerConfig(threads=1)
    learner = Learner(tiny_policy, algo, system)
    with torch.no_grad():
        learner.value_head.proj.weight.normal_()
    path = learner.save_checkpoint(str(tmp_path / "ck"), {"iteration": 0})
    again = Learner(tiny_policy, algo, system)
    again.load_checkpoint(path)
    assert torch.equal(again.value_head.proj.weight, learner.value_head.proj.weight)
