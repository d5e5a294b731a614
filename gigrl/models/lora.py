"""LoRA adapters on the decoder's projections (Hu et al., arXiv:2106.09685).

A target projection ``y = x W`` (W: [L, in, out], stacked over layers) gains two
``nnx.LoRAParam`` matrices, A: [L, in, r] and B: [L, r, out], and becomes

    y = x W + (alpha / r) · (x A) B                                  (LoRA eq. 3)

B starts at zero, so an adapted model at step 0 is exactly its base. A starts as peft
initialises it (Kaiming-uniform with a = √5: U(-1/√in, 1/√in)). Only the LoRAParam leaves
are trained (``trainable_filter``); the reference policy of the KL loss is the same
params with the adapters switched off (``adapters_off``: the LoRAParam leaves zeroed
inside the jitted loss, so no second copy of the base is held).

The adapters live on ``Transformer.layers`` as ``<w>_lora_a`` / ``<w>_lora_b`` next to
the base weight ``<w>`` they adapt (``wq``, ``wk``, ``wv``, ``wo``, ``w_gate``, ``w_up``,
``w_down``); ``Layers.stacked`` hands them to the block, ``Transformer.block`` adds the
low-rank term. Names in ``model.lora.targets`` are the Hugging Face / peft module names.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mlc
from flax import nnx

from gigrl.config_utils import ConfigError, check_range

# peft / HF module name -> gigrl's stacked base weight
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
_TARGET_IDS = {w: i for i, w in enumerate(TARGETS.values())}


def dropout_key(tokens: jax.Array) -> jax.Array:
  """The adapter-dropout key of a training batch, a function of its tokens i32[B, S].

  Stateless: no key threads through the train steps, a resumed run draws the same masks, and
  each batch (each micro-batch) gets its own; a batch seen twice (PPO epochs) gets the same.
  """
  b, s = tokens.shape
  weights = (jnp.arange(1, s + 1, dtype=jnp.int32)[None, :] * 7919
             + jnp.arange(1, b + 1, dtype=jnp.int32)[:, None] * 104729)
  return jax.random.fold_in(jax.random.key(0), jnp.sum(tokens.astype(jnp.int32) * weights))


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """``model.lora``: rank (0 = off), alpha, targets (peft names), dropout."""
  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = tuple(TARGETS)
  dropout: float = 0.0

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    """alpha / rank, the factor on the low-rank term."""
    return self.alpha / self.rank

  def describe(self) -> str:
    return f"LoRA rank {self.rank}, alpha {self.alpha:g} on {','.join(self.targets)}"


def default_config() -> mlc.ConfigDict:
  """The ``model.lora`` config section."""
  c = mlc.ConfigDict()
  c.rank = 0                                  # adapter rank r; 0 = full fine-tuning
  c.alpha = 16.0                              # the low-rank term is scaled by alpha / r
  c.targets = ",".join(TARGETS)               # peft module names, comma-separated (or a list)
  c.dropout = 0.0                             # dropout on the adapters' input, training only
  return c


def _targets(value: Any) -> tuple[str, ...]:
  names = value.split(",") if isinstance(value, str) else list(value)
  return tuple(n.strip() for n in names if n.strip())


def settings_from_config(cfg_model: Any) -> LoraSettings:
  """Validated :class:`LoraSettings` of the ``model`` section (off when it has no ``lora``).

  Raises:
    ConfigError: naming ``model.lora.<field>``: a rank that is negative or not an integer,
      alpha <= 0, a target that names no projection (the message lists those that exist),
      no targets with rank > 0, dropout outside [0, 1).
  """
  if "lora" not in cfg_model:
    return LoraSettings()
  c = {"model": cfg_model}
  rank = check_range(c, "model.lora.rank", 0, integer=True)
  alpha = check_range(c, "model.lora.alpha", 0.0, lo_open=True)
  targets = _targets(cfg_model.lora.targets)
  unknown = [t for t in targets if t not in TARGETS]
  if unknown or (rank and not targets):
    raise ConfigError("model.lora.targets", cfg_model.lora.targets,
                      f"a comma-separated subset of the projections {','.join(TARGETS)}")
  dropout = check_range(c, "model.lora.dropout", 0.0, 1.0, hi_open=True)
  return LoraSettings(rank=int(rank), alpha=float(alpha), targets=targets,
                      dropout=float(dropout))


def add_adapters(model: nnx.Module, settings: LoraSettings, *, rngs: nnx.Rngs) -> nnx.Module:
  """Adds zero-initialised-B adapters for ``settings.targets`` to ``model.layers`` (in place).

  Args:
    model: a ``gigrl.models.Transformer`` (its base weights already loaded).
    settings: enabled :class:`LoraSettings`.
  Returns:
    ``model``; ``model.layers.lora_scale`` = alpha / rank.
  """
  layers = model.layers
  for target in settings.targets:
    base = getattr(layers, TARGETS[target])
    n_layers, d_in, d_out = base.shape
    pd = base[...].dtype
    bound = 1.0 / float(d_in) ** 0.5
    a = jax.random.uniform(rngs.params(), (n_layers, d_in, settings.rank), jnp.float32,
                           -bound, bound)
    setattr(layers, TARGETS[target] + SUFFIX_A, nnx.LoRAParam(a.astype(pd)))
    setattr(layers, TARGETS[target] + SUFFIX_B,
            nnx.LoRAParam(jnp.zeros((n_layers, settings.rank, d_out), pd)))
  layers.lora_scale = settings.scale
  layers.lora_dropout = settings.dropout
  return model


def adapter_names(layers: nnx.Module) -> list[str]:
  """Sorted attribute names of the adapter matrices on ``layers`` (empty without LoRA)."""
  return sorted(k for k in vars(layers) if k.endswith((SUFFIX_A, SUFFIX_B)))


def low_rank(x: jax.Array, p: dict[str, jax.Array], name: str, scale: float,
             dropout: float = 0.0, key: jax.Array | None = None):
  """``scale · (dropout(x) A) B`` of base weight ``name`` if ``p`` holds its adapters, else None.

  x: [..., in] in the compute dtype; A [in, r], B [r, out] one layer's matrices. With a ``key``
  and ``dropout`` > 0 the adapters see x with each entry zeroed with probability ``dropout`` and
  the rest scaled by 1 / (1 - dropout) (peft's ``lora_dropout``; the base term sees x whole).
  """
  a = p.get(name + SUFFIX_A)
  if a is None:
    return None
  if key is not None and dropout > 0.0:
    keep = jax.random.bernoulli(jax.random.fold_in(key, _TARGET_IDS[name]), 1.0 - dropout,
                                x.shape)
    x = jnp.where(keep, x / (1.0 - dropout), 0).astype(x.dtype)
  xa = jnp.matmul(x.reshape(-1, x.shape[-1]), a, preferred_element_type=jnp.float32)
  y = jnp.matmul(xa.astype(x.dtype), p[name + SUFFIX_B], preferred_element_type=jnp.float32)
  return (scale * y).astype(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def is_lora(params: Any) -> bool:
  """Does an ``nnx.State`` hold adapter leaves?"""
  lora, _ = nnx.split_state(params, nnx.LoRAParam, ...)
  return bool(jax.tree.leaves(lora))


def trainable_filter(lora: bool):
  """The nnx filter of the trained parameters: the adapters with LoRA, else every Param."""
  return nnx.LoRAParam if lora else nnx.Param


def split_trainable(params: Any, lora: bool) -> tuple[Any, Any]:
  """(trained, frozen) ``nnx.State`` parts of ``params``; frozen is empty without LoRA."""
  return nnx.split_state(params, trainable_filter(lora), ...)


def trained_leaf_indices(params: Any, lora: bool) -> list[int] | None:
  """The indices (``jax.tree.leaves`` order) of the leaves an update changes: the adapters
  (A and B of each target) with ``lora``, else None (every leaf)."""
  if not lora:
    return None
  trained, _ = split_trainable(params, True)
  keys = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(trained)[0]}
  return [i for i, (k, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])
          if jax.tree_util.keystr(k) in keys]


def merge(trained: Any, frozen: Any) -> Any:
  """The full ``nnx.State`` again (:func:`split_trainable`'s inverse)."""
  return nnx.merge_state(trained, frozen)


def adapters_off(params: Any) -> Any:
  """``params`` with every adapter matrix zeroed: the base model's function.

  Used inside the jitted RL loss for the KL reference policy; the zeros are new (small)
  arrays, the base leaves are the same arrays as in ``params`` (no copy of the base).
  """
  lora, rest = nnx.split_state(params, nnx.LoRAParam, ...)
  return nnx.merge_state(jax.tree.map(jnp.zeros_like, lora), rest)


def merge_into_base(layers: dict[str, Any], scale: float) -> dict[str, Any]:
  """The layer weights with each adapter folded in, W' = W + scale · A B, adapters dropped.

  Args:
    layers: ``nnx.to_pure_dict`` of ``Transformer.layers`` (host or device arrays); the base
      weights [L, in, out], adapters A [L, in, r] and B [L, r, out].
    scale: alpha / rank (``layers.lora_scale``).
  Returns:
    a new dict without ``*_lora_a`` / ``*_lora_b`` (the base model's layout), f32 merge cast
    back to each base weight's dtype.
  """
  out = {k: v for k, v in layers.items() if not k.endswith((SUFFIX_A, SUFFIX_B))}
  for name in layers:
    if name.endswith(SUFFIX_A):
      base = name[:-len(SUFFIX_A)]
      a = jnp.asarray(layers[name], jnp.float32)
      b = jnp.asarray(layers[base + SUFFIX_B], jnp.float32)
      w = out[base]
      out[base] = (jnp.asarray(w, jnp.float32)
                   + scale * jnp.einsum("lir,lro->lio", a, b)).astype(w.dtype)
  return out


def peft_tensors(layers: dict[str, Any]) -> dict[str, Any]:
  """peft's ``adapter_model.safetensors`` tensors of the adapters in ``layers`` (pure dict).

  peft names ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight``
  [r, in] and ``...lora_B.weight`` [out, r] (torch Linear layout: ours transposed).
  """
  module = {v: k for k, v in TARGETS.items()}
  out = {}
  for name, arr in layers.items():
    for suffix, tag in ((SUFFIX_A, "lora_A"), (SUFFIX_B, "lora_B")):
      if name.endswith(suffix):
        proj = module[name[:-len(suffix)]]
        block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        for i, layer in enumerate(arr):
          out[f"base_model.model.model.layers.{i}.{block}.{proj}.{tag}.weight"] = layer.T
  return out


def peft_config(settings: LoraSettings, base: str) -> dict[str, Any]:
  """peft's ``adapter_config.json`` for these adapters on ``base`` (a path or hub id)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
          "r": settings.rank, "lora_alpha": settings.alpha,
          "target_modules": list(settings.targets), "lora_dropout": settings.dropout,
          "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
          "init_lora_weights": True, "use_rslora": False, "use_dora": False}
