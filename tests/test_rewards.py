"""rewards/: milestones paid once per episode, and the reward schemes over recorded events."""

import pytest

from rewards.milestones import MilestoneLedger, episode_reward, solved, step_reward, turn_rewards


def test_a_milestone_is_paid_once_per_episode():
    ledger, events = MilestoneLedger(), []
    assert ledger.reach("matches", 0.5, events) and not ledger.reach("matches", 0.5, events)
    assert ledger.reach("solved", 0.25, events)
    assert events == [{"name": "matches", "reward": 0.5}, {"name": "solved", "reward": 0.25}]
    assert step_reward(events) == 0.75 and solved(events)
    assert MilestoneLedger().reach("matches", 0.5, [])  # a new episode's ledger pays it again


def test_reward_schemes_over_recorded_milestones():
    ms = [
        {"name": "product", "reward": 0.25, "turn": 0},
        {"name": "count", "reward": 0.5, "turn": 2},
        {"name": "solved", "reward": 1.0, "turn": 3},
    ]
    assert episode_reward(ms) == pytest.approx(1.75)
    assert episode_reward(ms, "terminal") == 1.0 and episode_reward(ms[:2], "terminal") == 0.0
    assert episode_reward(ms, "discounted", 0.5) == pytest.approx(0.25 + 0.5 * 0.25 + 1.0 * 0.125)
    assert episode_reward(ms, "discounted", 1.0) == pytest.approx(episode_reward(ms))
    # per turn; a milestone recorded past the episode's turns (a truncated record) is dropped
    assert turn_rewards(ms, 4) == pytest.approx([0.25, 0.0, 0.5, 1.0])
    assert turn_rewards(ms, 3) == pytest.approx([0.25, 0.0, 0.5])
    with pytest.raises(ValueError, match="unknown reward scheme 'best'"):
        episode_reward(ms, "best")
    with pytest.raises(ValueError, match="gamma must be in"):
        episode_reward(ms, "discounted", 0.0)
