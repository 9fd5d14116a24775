"""Rewards: milestone specs, verifiers and their composition.

For now milestone rewards are paid by the environments themselves (`info["milestones"]`, see
`envs/base.py`) and summed per episode by the agent loop; reusable milestone specs and verifiers
(answers, unit tests) land here with the learner's milestone credit assignment.
"""
