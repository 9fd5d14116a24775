"""The RL loop: the driver (trainer.py, the loop on one page) and the objects it is made of: the
actors, the episodes in flight, held-out evaluation, the metrics row, the guard that stops a run
that cannot learn, checkpoints to resume from, and the local Ray it starts."""
