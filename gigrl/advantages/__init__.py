"""Advantage estimators as pure jit/vmap kernels over padded batches.

One module per estimator (``grpo``, ``stratified``, ``gigpo``, ``hadw``), host
side anchor grouping in ``anchors``, the config-driven composition in
``compose`` (re-exported here), and ``verl``: GiGPO from verl-agent's flat
step rows (``from gigrl.advantages.verl import
compute_gigpo_outcome_advantage`` replaces verl-agent's function). Each
module cites its paper and reference code.
"""
from gigrl.advantages.compose import AdvantageConfig
from gigrl.advantages.compose import AdvantageInputs
from gigrl.advantages.compose import AdvantageState
from gigrl.advantages.compose import compute_advantages
from gigrl.advantages.compose import default_config
from gigrl.advantages.compose import init_state
from gigrl.advantages.compose import make_advantage_fn
from gigrl.advantages.compose import validate

__all__ = [
    "AdvantageConfig", "AdvantageInputs", "AdvantageState",
    "compute_advantages", "default_config", "init_state", "make_advantage_fn",
    "validate",
]
