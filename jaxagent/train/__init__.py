"""Training: immutable train state, the jitted train step, checkpoints, metrics and the loop."""
