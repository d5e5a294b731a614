"""Device mesh and partition-spec presets for training (FSDP, opt. TP) and rollout (TP).

Mesh axes are `('data', 'fsdp', 'tp')`, all `AxisType.Auto` (jax 0.10's
`make_mesh` default is Explicit, which breaks embedding gathers; see the
`jax.sharding.AxisType` docs and Tunix `docs/models.md`). Parameters follow the Megatron-LM layout (Shoeybi
et al., arXiv:1909.08053) with ZeRO-3/FSDP sharding of the other dimension
(Rajbhandari et al., arXiv:1910.02054), the same split Tunix's qwen2 ShardingConfig
uses:

  param                   shape            'fsdp_tp' spec
  embed                   [V, D]           P('tp', 'fsdp')
  lm_head                 [D, V]           P('fsdp', 'tp')
  wq / wk / wv            [L, D, H*Dh]     P(None, 'fsdp', 'tp')   column parallel
  bq / bk / bv            [L, H*Dh]        P(None, 'tp')
  wo                      [L, H*Dh, D]     P(None, 'tp', 'fsdp')   row parallel
  w_gate / w_up           [L, D, F]        P(None, 'fsdp', 'tp')
  w_down                  [L, F, D]        P(None, 'tp', 'fsdp')
  attn_norm / mlp_norm    [L, D]           replicated
  final_norm              [D]              replicated
  <w>_lora_a / _lora_b    [L, in, r] / [L, r, out]  in / out dim over both of w's axes (LoRA)

Preset 'fsdp' drops the 'tp' entries, 'tp' drops the 'fsdp' entries, 'replicated'
drops both; 'auto' (the rollout default) is 'tp' for models up to 2 GiB of parameters
and 'fsdp_tp' above, so a large policy is never copied whole onto every chip. A dimension that the axis size does not divide is left unsharded. Batch
dimensions of activations, data and the KV cache go over ('data', 'fsdp').
"""
from __future__ import annotations

import functools

import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gigrl.config_utils import ConfigError
from gigrl.models.config import ModelConfig
from gigrl.models.transformer import KVCache

AXES = ("data", "fsdp", "tp")
BATCH = ("data", "fsdp")
PRESET_NAMES = ("replicated", "fsdp", "fsdp_tp", "tp", "auto")
# "auto" (the rollout default): parameters up to this size keep a copy per TP group
# ("tp"); larger models are also sharded over fsdp ("fsdp_tp"), so a 3B/7B policy is
# never replicated on every chip of a tp = 1 mesh.
AUTO_REPLICATE_MAX_BYTES = 2 << 30

_F, _T = "fsdp", "tp"
# Full ('fsdp_tp') specs per parameter name; presets mask axes out.
_FULL: dict[str, tuple] = {
    "embed": (_T, _F),
    "lm_head": (_F, _T),
    "wq": (None, _F, _T), "wk": (None, _F, _T), "wv": (None, _F, _T),
    "bq": (None, _T), "bk": (None, _T), "bv": (None, _T),
    "wo": (None, _T, _F),
    "w_gate": (None, _F, _T), "w_up": (None, _F, _T),
    "w_down": (None, _T, _F),
    "attn_norm": (None, None), "mlp_norm": (None, None),
    "final_norm": (None,),
}
_KEEP = {"replicated": (), "fsdp": (_F,), "tp": (_T,), "fsdp_tp": (_F, _T)}


def mesh_shape(sizes: Mapping[str, int], n_devices: int) -> tuple[int, int, int]:
  """Resolves {'data', 'fsdp', 'tp'} sizes (one may be -1) against the device count."""
  shape = [int(sizes.get(a, 1)) for a in AXES]
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if n_devices % known:
      raise ConfigError("model.mesh", dict(zip(AXES, shape)),
                        f"fixed axis sizes dividing the {n_devices} devices")
    shape[shape.index(-1)] = n_devices // known
  if math.prod(shape) != n_devices:
    raise ConfigError("model.mesh", dict(zip(AXES, shape)),
                      f"axis sizes whose product is the {n_devices} devices")
  return tuple(shape)


def make_mesh(sizes: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Auto-typed ('data', 'fsdp', 'tp') mesh; default = all devices on 'fsdp'."""
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(sizes or {"fsdp": -1}, len(devices))
  return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def _axis_size(mesh: Mesh, entry) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names if n is not None)


def fit_spec(spec: Sequence, shape: Sequence[int], mesh: Mesh) -> P:
  """Drops spec entries whose mesh size does not divide the dimension."""
  out = []
  for entry, dim in zip(spec, shape):
    if entry is not None and dim % _axis_size(mesh, entry):
      entry = None
    out.append(entry)
  return P(*out)


def _adapter_spec(name: str) -> tuple | None:
  """The full spec of ``name``. A LoRA adapter follows its base weight [L, in, out]: A
  [L, in, r] splits the base's ``in`` dimension, B [L, r, out] its ``out`` dimension, each over
  both mesh axes the base uses (its own dimension's first): the rank dimension is too small
  to split, and with one axis only, a pure FSDP (or TP) layout would copy half the adapters
  onto every chip."""
  if name in _FULL:
    return _FULL[name]
  for suffix, dim in (("_lora_a", 1), ("_lora_b", 2)):
    base = name[:-len(suffix)]
    if name.endswith(suffix) and base in _FULL:
      full = _FULL[base]
      spec = [None, None, None]
      spec[dim] = (full[dim], full[3 - dim])
      return tuple(spec)
  return None


def _masked(entry, keep: tuple):
  """A spec entry with the axes a preset drops removed (a tuple entry keeps its kept axes)."""
  if isinstance(entry, tuple):
    kept = tuple(a for a in entry if a in keep)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
  return entry if entry in keep else None


def param_spec(name: str, shape: Sequence[int], mesh: Mesh, preset: str) -> P:
  """PartitionSpec of parameter `name` (a key of the Transformer state) under `preset`."""
  if preset not in _KEEP:
    raise ValueError(f"unknown sharding preset {preset!r}; one of {PRESET_NAMES} "
                     "('auto' only through param_shardings)")
  full = _adapter_spec(name)
  if full is None:
    raise KeyError(f"no sharding rule for parameter {name!r}")
  keep = _KEEP[preset]
  spec = tuple(_masked(e, keep) for e in full)
  return fit_spec(spec, shape, mesh)


def _leaf_name(path) -> str | None:
  """Last dict key of a pytree path (skips Variable `.value` attribute keys)."""
  for key in reversed(path):
    if isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, str):
      return key.key
  return None


def resolve_preset(preset: str, state: Any) -> str:
  """`preset`, with "auto" -> "tp" when the parameters of `state` take at most
  AUTO_REPLICATE_MAX_BYTES, else "fsdp_tp"."""
  if preset != "auto":
    return preset
  total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
  return "tp" if total <= AUTO_REPLICATE_MAX_BYTES else "fsdp_tp"


def param_shardings(state: Any, mesh: Mesh, preset: str) -> Any:
  """Tree of NamedSharding matching `state` (an nnx.State, pure dict or abstract).

  `preset` is one of PRESET_NAMES ("auto": `resolve_preset`).
  """
  preset = resolve_preset(preset, state)

  def one(path, x):
    return NamedSharding(mesh, param_spec(_leaf_name(path), x.shape, mesh, preset))
  return jax.tree_util.tree_map_with_path(one, state)


def opt_state_shardings(opt_state: Any, params: Any, mesh: Mesh, preset: str) -> Any:
  """Shardings for an optax state: leaves shaped like a parameter (mu, nu, ...) get
  that parameter's spec (matched by name and shape), everything else is replicated.
  """
  def one(path, x):
    name = _leaf_name(path)
    full = _adapter_spec(name) if name else None
    if full is not None and len(x.shape) == len(full):
      return NamedSharding(mesh, param_spec(name, x.shape, mesh, preset))
    return NamedSharding(mesh, P())
  del params  # names and ranks suffice; kept in the signature for clarity
  return jax.tree_util.tree_map_with_path(one, opt_state)


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
  """Sharding of a [B, ...] data array: B over ('data', 'fsdp') when divisible."""
  spec = fit_spec((BATCH,) + (None,) * (len(shape) - 1), shape, mesh)
  return NamedSharding(mesh, spec)


def cache_shardings(cfg: ModelConfig, mesh: Mesh, batch: int, max_len: int) -> KVCache:
  """KVCache of shardings: k/v [L, B, S, KV, Dh] as P(None, batch, None, 'tp', None)."""
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  kv = NamedSharding(mesh, fit_spec((None, BATCH, None, _T, None), shape, mesh))
  pos = NamedSharding(mesh, fit_spec((BATCH,), (batch,), mesh))
  return KVCache(kv, kv, pos)


def shard_state(state: Any, mesh: Mesh, preset: str) -> Any:
  """Copies every array of `state` onto its preset sharding.

  A jitted identity with `out_shardings` rather than `device_put`: in jax 0.10.2
  `device_put(x, replicated, may_alias=False)` still aliases device 0's buffer, so
  donating the result to a step would delete the caller's `state` arrays.
  """
  out = param_shardings(state, mesh, preset)
  leaves, tree = jax.tree.flatten(out)
  return _identity_to(tree, tuple(leaves))(state)


@functools.lru_cache(maxsize=None)
def _identity_to(tree, shardings: tuple):
  """One jitted identity per output layout (compiled once, not per call)."""
  return jax.jit(lambda s: s, out_shardings=jax.tree.unflatten(tree, list(shardings)))


def init_sharded(cfg: ModelConfig, mesh: Mesh, preset: str, seed: int = 0):
  """Initialises a Transformer directly onto its shardings.

  Returns:
    (graphdef, state) with every array laid out per `preset` on `mesh`.
  """
  from flax import nnx

  from gigrl.models.transformer import Transformer

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
  graphdef, abs_state = nnx.split(abstract)
  shardings = param_shardings(abs_state, mesh, preset)

  def init():
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]

  return graphdef, jax.jit(init, out_shardings=shardings)()


def mesh_from_config(cfg_model: Any, devices=None) -> Mesh:
  """Mesh of the `model.mesh` section ({data, fsdp, tp}; one may be -1)."""
  return make_mesh(dict(cfg_model.mesh), devices)


__all__ = ["AXES", "BATCH", "PRESET_NAMES", "make_mesh", "mesh_from_config",
           "param_spec", "param_shardings", "opt_state_shardings", "batch_sharding",
           "cache_shardings", "shard_state", "init_sharded", "fit_spec", "resolve_preset"]
