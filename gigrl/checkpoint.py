"""Orbax checkpoints of the full trainer state; atomic, asynchronous, last N kept.

A checkpoint holds two items: ``state`` (a pytree of arrays: params, optimizer state,
reference params, the advantage-estimator state such as HA-DW's anchor) and ``meta`` (JSON:
step, phase, the query pool with its RNG state, data positions, the config). Orbax writes each
step into a temporary directory and renames it when complete, so a run killed mid-write leaves
the previous checkpoints intact. A checkpoint that fails to restore is reported and the previous
one is used. Restoring with an abstract tree whose leaves carry another mesh's shardings puts the
arrays straight onto that mesh (orbax reshards on restore).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` with corrupt-checkpoint fallback."""

  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

  def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> None:
    """Starts an (async) save of ``state`` and ``meta`` at ``step``."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """Restores the newest checkpoint that loads; None if there is none.

    Args:
      abstract_state: pytree of ``jax.ShapeDtypeStruct`` (with target shardings).
    Returns:
      (step, state, meta) or None. Checkpoints that fail to load are logged and skipped.
    """
    for step in reversed(self.steps()):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return step, restored.state, dict(restored.meta)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("checkpoint step %d in %s is unreadable (%s: %s); trying the "
                        "previous one", step, self.directory, type(e).__name__, e)
        print(f"[gigrl] WARNING: checkpoint {step} is corrupt or partial "
              f"({type(e).__name__}); falling back to an earlier one", flush=True)
    return None

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a live pytree, for restore."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)
