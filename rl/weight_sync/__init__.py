"""Weight sync, the driver's side: when and to whom the learner's weights go (driver.py), and how
a version travels to the engines (transport.py: buckets, shared memory, a collective group). The
learner's side is rl/learner/weight_source.py and shared_weights.py; the engines', rollout/weights.py."""
