"""Training data besides live rollouts: chat files and stored trajectories (grain), for the sft / rft / offline
paradigms (jaxagent/train/paradigms.py)."""
