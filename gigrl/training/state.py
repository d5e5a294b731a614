"""The whole state of a run: one pytree that is checkpointed and restored as a unit.

``TrainState`` holds every array a resumed run needs (params, optimizer state, reference params,
advantage-estimator state) and, as static fields, the step counter and the query pool's state
(JSON, numpy RNG included). :mod:`gigrl.training.checkpoint` saves the array leaves with orbax and the
static fields as JSON; nothing else is needed to continue a run bitwise (docs/architecture.md,
"Resume equality").
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TrainState:
  """A run's state after ``step`` completed steps (SFT and RL counted together).

  Attributes:
    params: the policy's ``nnx.State`` (training layout).
    opt_state: optax state of the current phase's optimizer (SFT and RL optimizers share one
      tree structure, :func:`gigrl.update.step.make_optimizer`).
    ref_params: the frozen reference policy (the params at the end of the SFT warm-start). Before
      RL starts it holds the params, so the tree has one structure in both phases.
    adv_state: :class:`gigrl.advantages.AdvantageState` (HA-DW's belief history).
    step: completed steps (static: a Python int).
    pool: :meth:`gigrl.data.pool.QueryPool.state_dict` (static, JSON-serialisable).
  """
  params: Any
  opt_state: Any
  ref_params: Any
  adv_state: Any
  step: int = struct.field(pytree_node=False, default=0)
  pool: dict = struct.field(pytree_node=False, default_factory=dict)

  def arrays(self) -> dict[str, Any]:
    """The array part, as saved by orbax: {params, opt_state, ref_params, adv_state}."""
    return {"params": self.params, "opt_state": self.opt_state, "ref_params": self.ref_params,
            "adv_state": self.adv_state}

  def static(self) -> dict[str, Any]:
    """The JSON part: {step, pool}."""
    return {"step": int(self.step), "pool": self.pool}

  @classmethod
  def from_parts(cls, arrays: dict[str, Any], static: dict[str, Any]) -> "TrainState":
    """Inverse of (:meth:`arrays`, :meth:`static`)."""
    return cls(params=arrays["params"], opt_state=arrays["opt_state"],
               ref_params=arrays["ref_params"], adv_state=arrays["adv_state"],
               step=int(static["step"]), pool=dict(static["pool"]))


def abstract(state: TrainState) -> TrainState:
  """The same state with every array replaced by a ``jax.ShapeDtypeStruct`` that keeps its
  sharding (the restore target; orbax puts each array straight onto that sharding)."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      state)


@jax.jit
def _copy_arrays(arrays: list) -> list:
  return [jnp.copy(x) for x in arrays]


def copy(state: Any) -> Any:
  """Device copies of every array (the async checkpoint writer reads them after the next train
  step has donated, i.e. freed, the originals). The device arrays are copied by one jitted
  program per tree (known before step 1: :func:`copy_program`); host leaves as before."""
  leaves, tree = jax.tree.flatten(state)
  on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
  out = [x if isinstance(x, jax.Array) else jnp.copy(x) for x in leaves]
  if on_device:
    for i, c in zip(on_device, _copy_arrays([leaves[i] for i in on_device])):
      out[i] = c
  return jax.tree.unflatten(tree, out)


def copy_program(state: Any):
  """:func:`copy`'s program for a tree like ``state`` (device arrays, or their
  ``jax.ShapeDtypeStruct`` with shardings: ``gigrl-compile``), traced and lowered (not run)."""
  leaves = jax.tree.leaves(state)
  return _copy_arrays.lower([x for x in leaves
                             if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))])


def copy_leaves(tree: Any, leaves: Sequence[int] | None = None) -> dict[int, jax.Array]:
  """Device copies of ``tree``'s device leaves ``leaves`` (``jax.tree.leaves`` indices; None =
  all), by index: what an asynchronous sampler is published after an update, whose next
  update donates (frees) the originals. One jitted program per selection
  (:func:`copy_leaves_program`); all leaves is :func:`copy`'s program."""
  all_ = jax.tree.leaves(tree)
  idx = list(range(len(all_))) if leaves is None else list(leaves)
  return dict(zip(idx, _copy_arrays([all_[i] for i in idx])))


def copy_leaves_program(tree: Any, leaves: Sequence[int] | None = None):
  """:func:`copy_leaves`'s program (``tree``: device arrays or ``jax.ShapeDtypeStruct``),
  traced and lowered (not run)."""
  all_ = jax.tree.leaves(tree)
  return _copy_arrays.lower([all_[i] for i in (range(len(all_)) if leaves is None else leaves)])


def leaves_by_path(tree: Any) -> dict[str, Any]:
  """{'path/to/leaf': leaf} of an array tree (live, abstract or orbax metadata); named-tuple
  fields, dict keys and sequence indices all become path components."""
  return {"/".join(_key_str(k) for k in path): x
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)
