"""Rollout: the jitted multi-turn sampler, the environment bridge and the multi-turn engine."""
