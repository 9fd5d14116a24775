"""Rewards: the bottom layer, pure functions over what an episode recorded (no imports of ours).

`rewards.milestones` pays milestones once per episode, turns recorded milestone events into rewards
(sum, terminal-only, discounted, per turn) and decides `solved`; the environments use it while they
run, milestone credit (rl/learner/credit.py) when it assigns rewards to turns,
and `longhorizon replay --rescore` afterwards. `rewards.rubric` makes an episode's reward a weighted
sum of named parts over its record (the run's `reward:` section), scored in the rollout workers.
"""
