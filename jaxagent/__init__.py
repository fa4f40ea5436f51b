"""jaxagent: a JAX-native trainer that teaches language-model agents to act (multi-turn RL)."""

__version__ = "0.1.0"
