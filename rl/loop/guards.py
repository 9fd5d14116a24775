"""When a run cannot learn: iterations in a row whose episodes failed for reasons outside the
policy (`stop_after_failed`, `max_infra_error_share`), or gave the learner no signal at all
(`stop_after_flat`). The trainer asks after each iteration's metrics row is written, and the run
stops with `CannotLearn` instead of finishing green; what it wrote stays. A run that ends on a failed
iteration (however few it had: a one-iteration run whose every episode failed) also stops with
`CannotLearn` (`finish`), not "done".
"""

from __future__ import annotations

from pathlib import Path

from rollout.trajectory import Trajectory


class CannotLearn(RuntimeError):
    """Iteration after iteration the episodes failed for reasons outside the policy, or gave no
    learning signal (`flat`); metrics, trajectories and checkpoints written so far are kept.
    `reason`: why, without where the run's files are (what a report quotes)."""

    def __init__(self, reason: str, run_dir: Path, flat: bool = False):
        super().__init__(f"{reason}. What was written is kept in {run_dir}")
        self.reason, self.flat = reason, flat


class LearningGuard:
    def __init__(
        self,
        run_dir: Path,
        *,
        max_infra_error_share: float,
        stop_after_failed: int,
        stop_after_flat: int,
        ppo: bool,
    ):
        """The run's `max_infra_error_share`, `stop_after_failed` and `stop_after_flat`; `ppo`:
        the signal is a reward spread (no groups)."""
        self.run_dir, self.ppo = run_dir, ppo
        self.max_infra_error_share = max_infra_error_share
        self.stop_after_failed, self.stop_after_flat = stop_after_failed, stop_after_flat
        self._failed_in_a_row = 0  # iterations whose episodes failed for reasons outside the policy
        self._flat_in_a_row = 0  # iterations without a learning signal (every advantage zero)
        self._why = ""  # what went wrong in the last failed iteration

    def check(self, it: int, trajs: list[Trajectory], stats: dict) -> None:
        """Count failed iterations in a row (config: max_infra_error_share, stop_after_failed); raise
        `CannotLearn` quoting the first failure once there are too many; the same for iterations
        without a learning signal (stop_after_flat)."""
        errors = [t for t in trajs if t.infra_error]
        failed = bool(stats.get("skipped_update")) or len(
            errors
        ) > self.max_infra_error_share * len(trajs)
        self._failed_in_a_row = self._failed_in_a_row + 1 if failed else 0
        if failed:
            self._why = (
                f"{len(errors)} of {len(trajs)} episodes of iteration {it} ended in infrastructure errors, "
                f"the first: {errors[0].infra_error}"
                if errors
                else f"the learner had no usable episode in iteration {it} ({len(trajs)} episodes)"
            )
        if self.stop_after_failed and self._failed_in_a_row >= self.stop_after_failed:
            raise CannotLearn(
                f"the run cannot learn: {self._failed_in_a_row} failed iterations in a row; {self._why}",
                self.run_dir,
            )
        if failed:
            return
        ppo = self.ppo
        flat = (
            stats.get("reward_spread", 1) == 0 if ppo else stats.get("groups_with_signal", 1) == 0
        )
        self._flat_in_a_row = self._flat_in_a_row + 1 if flat else 0
        if self.stop_after_flat and self._flat_in_a_row >= self.stop_after_flat:
            ok = [t for t in trajs if not t.infra_error]
            rewards = sorted({round(t.reward, 6) for t in ok})
            what = (
                "every episode earned the same reward"
                if ppo
                else "no group's episodes earned different rewards"
            )
            raise CannotLearn(
                f"the run cannot learn: {self._flat_in_a_row} iterations in a row in which {what} "
                f"(rewards of iteration {it}: {', '.join(map(str, rewards[:5]))}), so every advantage is zero; "
                f"a policy that never reaches a milestone needs a warm start (warm_start.demos) or an easier task, one that "
                f"always does a harder one "
                f"(stop_after_flat=0 lets such a run go on)",
                self.run_dir,
                flat=True,
            )

    def finish(self) -> None:
        """At the end of a run: `CannotLearn` if its last iteration failed (quoted), so a short run that
        could not learn never ends green."""
        if self._failed_in_a_row:
            raise CannotLearn(
                f"the run cannot learn: its last {self._failed_in_a_row} iteration(s) failed; {self._why}",
                self.run_dir,
            )
