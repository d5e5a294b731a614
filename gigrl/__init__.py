"""gigrl: JAX/TPU-native reinforcement learning for LLM search agents.

Data flow (one module per stage, no cycles):
  data -> rollout (policy = gigrl.models, search = gigrl.search) -> reward
  -> advantages -> loss -> update (gigrl.cli.train).
"""
__version__ = "0.1.0"
