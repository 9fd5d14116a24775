"""A run that cannot learn stops with an error instead of finishing green (rl/loop/guards.py
`LearningGuard`, which the trainer asks after every iteration): the driver's bookkeeping, on real
trajectory records, without starting Ray."""

from __future__ import annotations

import pytest

from conftest import REPO


def _trajs(n: int, errors: int) -> list:
    from rollout.trajectory import Trajectory

    return [
        Trajectory(
            episode_id=f"e{i}",
            iteration=0,
            group_id=i // 2,
            env_id="tools/calculator-v0",
            seed=i,
            prompt_len=1,
            token_ids=[1, 2],
            loss_mask=[0, 1],
            rollout_logprobs=[0.0, -1.0],
            infra_error=f"reset: RuntimeError: sandbox {i} died" if i < errors else "",
        )
        for i in range(n)
    ]


def _trainer(tmp_path, *overrides):
    from rl.config import load_config
    from rl.loop.trainer import Trainer

    return Trainer(load_config(REPO / "configs/quickstart.yaml", list(overrides)), tmp_path / "run")


def _guard(tmp_path, *overrides):
    return _trainer(tmp_path, *overrides).guard  # the trainer's own


def test_failed_iterations_in_a_row_stop_the_run_quoting_the_first_failure(tmp_path):
    from rl.loop.guards import CannotLearn

    guard = _guard(tmp_path)  # defaults: more than half infra errors, twice in a row
    guard.check(0, _trajs(8, 5), {})  # one failed iteration (a crashed worker) is survived
    guard.check(1, _trajs(8, 4), {})  # exactly half is not a failure: the count starts again
    guard.check(2, _trajs(8, 8), {})
    with pytest.raises(
        CannotLearn,
        match=r"8 of 8 episodes of iteration 3 .* the first: reset: RuntimeError: "
        r"sandbox 0 died",
    ):
        guard.check(3, _trajs(8, 8), {})


def test_a_run_that_ends_on_a_failed_iteration_does_not_end_green(tmp_path):
    """However few iterations it had: one iteration whose 8 episodes were all infra errors is below
    stop_after_failed (2), and still the run's end raises, quoting the failure."""
    from rl.loop.guards import CannotLearn

    guard = _guard(tmp_path)
    guard.check(0, _trajs(8, 8), {})
    with pytest.raises(
        CannotLearn,
        match=r"its last 1 iteration\(s\) failed; 8 of 8 episodes of iteration 0 ended in "
        r"infrastructure errors, the first: reset: RuntimeError: sandbox 0 died",
    ):
        guard.finish()
    guard.check(1, _trajs(8, 0), {})
    guard.finish()  # a run whose last iteration learned ends as usual


def test_an_iteration_the_learner_skipped_counts_as_failed(tmp_path):
    from rl.loop.guards import CannotLearn

    guard = _guard(tmp_path, "stop_after_failed=3")
    for it in range(2):
        guard.check(it, _trajs(4, 0), {"skipped_update": 1})
    with pytest.raises(
        CannotLearn, match="3 failed iterations in a row; the learner had no usable episode"
    ):
        guard.check(2, _trajs(4, 0), {"skipped_update": 1})


def test_the_guard_can_be_turned_off(tmp_path):
    guard = _guard(tmp_path, "stop_after_failed=0")
    for it in range(5):
        guard.check(it, _trajs(4, 4), {})
    assert guard._failed_in_a_row == 5


def _rewarded(rewards: list[float], group_size: int = 2) -> list:
    from rollout.trajectory import Trajectory

    return [
        Trajectory(
            episode_id=f"e{i}",
            iteration=0,
            group_id=i // group_size,
            env_id="tools/calculator-v0",
            seed=i,
            prompt_len=1,
            token_ids=[1, 2],
            loss_mask=[0, 1],
            rollout_logprobs=[0.0, -1.0],
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]


def test_iterations_without_a_learning_signal_stop_the_run(tmp_path):
    """GRPO learns nothing when every group's episodes earned one reward (all advantages zero):
    the learner's own usable-episode count says so, and after `stop_after_flat` such iterations in a
    row the run stops. A single group with two rewards is a signal and starts the count again."""
    from rl.learner.learner import usable_episodes
    from rl.loop.guards import CannotLearn

    guard = _guard(tmp_path, "stop_after_flat=2")
    # two groups, each one reward: no signal, though rewards differ
    flat = _rewarded([0.0, 0.0, 1.0, 1.0])
    live = _rewarded([0.0, 0.0, 0.0, 1.0])
    assert (
        usable_episodes(flat)[1]["groups_with_signal"] == 0
        and usable_episodes(live)[1]["groups_with_signal"] == 1
    )
    guard.check(0, flat, usable_episodes(flat)[1])
    guard.check(1, live, usable_episodes(live)[1])
    guard.check(2, flat, usable_episodes(flat)[1])
    with pytest.raises(
        CannotLearn,
        match=r"2 iterations in a row in which no group's episodes earned different "
        r"rewards \(rewards of iteration 3: 0.0, 1.0\).*warm_start.demos",
    ):
        guard.check(3, flat, usable_episodes(flat)[1])


def test_for_ppo_only_one_reward_across_the_batch_is_flat(tmp_path):
    """PPO's baseline is a learned value, not the group mean: rewards that differ between groups
    are a signal; one reward for every episode is not."""
    from rl.learner.learner import usable_episodes
    from rl.loop.guards import CannotLearn

    guard = _guard(tmp_path, "stop_after_flat=1", "algo.name=ppo")
    between = _rewarded([0.0, 0.0, 1.0, 1.0])
    guard.check(0, between, usable_episodes(between)[1])
    same = _rewarded([0.5] * 4)
    with pytest.raises(CannotLearn, match="every episode earned the same reward"):
        guard.check(1, same, usable_episodes(same)[1])


def test_the_quickstart_turns_the_flat_guard_off_and_says_why():
    """The quickstart's random policy earns nothing by design; the default keeps the guard on."""
    from rl.config import RunConfig, load_config

    assert RunConfig().stop_after_flat == 3
    assert load_config(REPO / "configs/quickstart.yaml").stop_after_flat == 0
    assert "A random policy earns no reward" in (REPO / "configs/quickstart.yaml").read_text()


@pytest.mark.slow
def test_rollout_workers_the_cluster_cannot_place_stop_the_start_naming_what_they_asked_for(
    ray_cluster, tiny_policy, tmp_path
):
    """Ray waits without a word for an actor it has no room for; the start gives up after
    `ray.start_timeout_s` and says what the workers asked for and what the cluster had free."""
    trainer = _trainer(
        tmp_path,
        f"policy.path={tiny_policy}",
        "rollout.cpus_per_worker=64",
        "ray.start_timeout_s=5",
    )
    try:
        with pytest.raises(
            TimeoutError,
            match=r"2 of 2 rollout workers did not start within 5s; each asks for 64.0 "
            r"CPU\(s\).*lower rollout.cpus_per_worker",
        ):
            trainer.start()
    finally:
        trainer.close()


def test_a_learner_killed_for_memory_stops_the_run_in_one_line(tmp_path):
    """Ray's memory monitor killing the learner mid-call (an `OutOfMemoryError` from `ray.get`, seen
    in make demo) is the learner's death, with the resume hint, not a raw traceback."""
    import ray

    from rl.faults import LearnerDied, learner_alive

    with pytest.raises(LearnerDied) as err:
        with learner_alive(tmp_path, "publishing weights"):
            raise ray.exceptions.OutOfMemoryError("1 worker was killed: the node ran low on memory")
    text = str(err.value)
    assert "\n" not in text and "killed for memory" in text and "publishing weights" in text
    assert f"longhorizon train --resume {tmp_path}" in text
