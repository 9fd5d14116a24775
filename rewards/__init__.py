"""Rewards: functions of a recorded trajectory, milestone specs and verifiers.

Milestone rewards are paid by the environments themselves (`info["milestones"]`, see
`envs/base.py`) and summed per episode by the agent loop; `rewards.milestones` holds reward
functions over those records (for `longhorizon replay --rescore`). Verifiers (answers, unit tests)
and milestone credit assignment land here with the learner's milestone work.
"""
