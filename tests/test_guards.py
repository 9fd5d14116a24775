"""A run that cannot learn stops with an error instead of finishing green (rl/trainer.py
`_check_can_learn`): the driver's bookkeeping, on real trajectory records, without starting Ray."""

from __future__ import annotations

import pytest

from conftest import REPO


def _trajs(n: int, errors: int) -> list:
    from rollout.trajectory import Trajectory

    return [Trajectory(episode_id=f"e{i}", iteration=0, group_id=i // 2, env_id="tools/calculator-v0", seed=i,
                       prompt_len=1, token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -1.0],
                       infra_error=f"reset: RuntimeError: sandbox {i} died" if i < errors else "")
            for i in range(n)]


def _trainer(tmp_path, *overrides):
    from rl.config import load_config
    from rl.trainer import Trainer

    return Trainer(load_config(REPO / "configs/quickstart.yaml", list(overrides)), tmp_path / "run")


def test_failed_iterations_in_a_row_stop_the_run_quoting_the_first_failure(tmp_path):
    from rl.trainer import CannotLearn

    trainer = _trainer(tmp_path)  # defaults: more than half infra errors, twice in a row
    trainer._check_can_learn(0, _trajs(8, 5), {})  # one failed iteration (a crashed worker) is survived
    trainer._check_can_learn(1, _trajs(8, 4), {})  # exactly half is not a failure: the count starts again
    trainer._check_can_learn(2, _trajs(8, 8), {})
    with pytest.raises(CannotLearn, match=r"8 of 8 episodes of iteration 3 .* the first: reset: RuntimeError: "
                                          r"sandbox 0 died"):
        trainer._check_can_learn(3, _trajs(8, 8), {})


def test_an_iteration_the_learner_skipped_counts_as_failed(tmp_path):
    from rl.trainer import CannotLearn

    trainer = _trainer(tmp_path, "stop_after_failed=3")
    for it in range(2):
        trainer._check_can_learn(it, _trajs(4, 0), {"skipped_update": 1})
    with pytest.raises(CannotLearn, match="3 failed iterations in a row; the learner had no usable episode"):
        trainer._check_can_learn(2, _trajs(4, 0), {"skipped_update": 1})


def test_the_guard_can_be_turned_off(tmp_path):
    trainer = _trainer(tmp_path, "stop_after_failed=0")
    for it in range(5):
        trainer._check_can_learn(it, _trajs(4, 4), {})
    assert trainer._failed_in_a_row == 5
