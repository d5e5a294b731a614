"""Orbax checkpoints of the whole :class:`~gigrl.training.state.TrainState`; atomic, async, last N.

A checkpoint holds two items: ``state`` (the state's arrays: params, optimizer state, reference
params, the advantage-estimator state such as HA-DW's beliefs) and ``meta`` (JSON: the step, the
query pool with its RNG state, and the run's config). Orbax writes each step into a temporary
directory and renames it when complete, so a run killed mid-write leaves the previous checkpoints
intact. Restoring with a target whose arrays carry another mesh's shardings puts the arrays
straight onto that mesh (orbax reshards on restore).

Restore never loses data silently:

* a checkpoint whose arrays do not match the current config's state (another model size,
  another ``advantage.hadw.window``, another question set for the pool, ...) raises
  :class:`StateMismatchError` naming the arrays and config fields that differ;
* a checkpoint that cannot be read (torn files) is reported and the previous one is used;
* when none can be read, :class:`CheckpointError` is raised rather than starting over.
"""
from __future__ import annotations

import sys
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from gigrl import config_utils
from gigrl import distributed
from gigrl.training import state as state_lib


class CheckpointError(RuntimeError):
  """No checkpoint in the directory can be read."""


class StateMismatchError(config_utils.ConfigError):
  """The checkpoint's state does not fit the current config (a user-caused error)."""

  def __init__(self, directory: str, step: int, differences: list[str],
               config_changes: list[str]):
    self.field, self.value = "checkpoint", step
    self.allowed = "a config with the checkpoint's state structure"
    self.differences, self.config_changes = differences, config_changes
    more = f" (+{len(differences) - 4} more)" if len(differences) > 4 else ""
    changed = (f"Config fields changed since it was written: {'; '.join(config_changes[:8])}. "
               "To proceed, rerun with the checkpoint's values for those fields"
               if config_changes else "To proceed, rerun with the config it was written with")
    ValueError.__init__(
        self, f"checkpoint step {step} in {directory} does not fit this config: "
        f"{'; '.join(differences[:4])}{more}. {changed}, or use a new --workdir to start a "
        "new run.")


def checkpoint_dir(workdir: str | epath.PathLike) -> epath.Path:
  """``<workdir>/checkpoints`` as an ``etils.epath`` path: a ``gs://bucket/run`` workdir stays
  ``gs://bucket/run/checkpoints`` (no ``os.path`` call ever makes it local); a relative local
  workdir is made absolute (orbax refuses relative checkpoint paths)."""
  path = epath.Path(workdir)
  if "://" not in str(workdir):
    path = path.resolve()
  return path / "checkpoints"


class Checkpointer:
  """``ocp.CheckpointManager`` for :class:`TrainState` with mismatch and corruption checks.

  Multi-host: every process constructs it and calls :meth:`save` / :meth:`restore_latest`
  with the same step; every saved array must be a global ``jax.Array`` (orbax writes each
  process's shards, process 0 writes the metadata and JSON item and commits the step).
  """

  def __init__(self, directory: str | epath.PathLike, *, keep: int, async_save: bool = True):
    self.directory = epath.Path(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    # Handlers named up front, so a fresh process can read a checkpoint's array metadata
    # (structure check) before restoring anything.
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def save(self, state: state_lib.TrainState, extra_meta: dict[str, Any] | None = None, *,
           force: bool = False) -> None:
    """Starts an (async) save of ``state`` at ``state.step``.

    The arrays must not be donated while the write runs: pass :func:`train_state.copy` of a
    state whose arrays the next step donates.
    """
    meta = {**state.static(), **(extra_meta or {})}
    self.manager.save(state.step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state.arrays()), meta=ocp.args.JsonSave(meta)),
        force=force)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore_latest(self, target: state_lib.TrainState,
                     config: dict[str, Any] | None = None
                     ) -> tuple[state_lib.TrainState, dict[str, Any]] | None:
    """Restores the newest readable checkpoint onto ``target``'s shardings.

    Args:
      target: a state of the current config (live or :func:`train_state.abstract`); its
        arrays give the expected structure, shapes, dtypes and target shardings, and its
        ``pool`` the expected pool size and rule.
      config: the current config as a JSON dict; compared with the checkpoint's to name the
        fields that changed.
    Returns:
      (state, meta) or None when the directory has no checkpoint.
    Raises:
      StateMismatchError: the newest readable checkpoint does not fit ``target``.
      CheckpointError: there are checkpoints but none can be read.
    """
    steps = self.steps()
    if not steps:
      return None
    abstract = state_lib.abstract(target)
    for step in reversed(steps):
      try:
        meta = dict(self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta)
        saved = self.manager.item_metadata(step)["state"]
        saved_tree = getattr(saved, "tree", saved)
        if saved_tree is None:
          raise ValueError("no array metadata")
      except Exception as e:  # pylint: disable=broad-except
        _report_unreadable(step, e)
        continue
      differences = structure_differences(saved_tree, abstract.arrays())
      differences += pool_differences(meta.get("pool", {}), target.pool)
      if differences:
        changes = config_differences(meta.get("config") or {}, config or {})
        raise StateMismatchError(str(self.directory), step, differences, changes)
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract.arrays())))
      except Exception as e:  # pylint: disable=broad-except
        _report_unreadable(step, e)
        continue
      return state_lib.TrainState.from_parts(restored.state, meta), meta
    raise CheckpointError(
        f"none of the checkpoints {steps} in {self.directory} can be read (see the warnings "
        f"above); move that directory away to start the run over")

  def close(self) -> None:
    """Waits for the last save to finish, then closes. Not when another process of the run is
    gone (:func:`distributed.peer_was_lost`): the save's barrier could never pass, and the
    unfinished save is not one :meth:`restore` reads."""
    if distributed.peer_was_lost():
      return
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(workdir: str | epath.PathLike, step: int | None, target_params: Any
                   ) -> tuple[Any, dict[str, Any]]:
  """Only the policy params of another run's checkpoint (``train.init_from``).

  Args:
    workdir: that run's workdir (its ``checkpoints/`` folder is read; local or ``gs://``).
    step: the checkpoint step; None = the newest.
    target_params: the current policy's params (live or abstract); their structure, shapes,
      dtypes and shardings are the restore target (the other arrays of the checkpoint, e.g. a
      different estimator's advantage state, are not read).
  Returns:
    (params, the checkpoint's JSON metadata: ``step``, ``phase``, ``config``, ...).
  Raises:
    CheckpointError: no checkpoint there, or not the requested step.
    StateMismatchError: the checkpoint's params differ in structure, shape or dtype.
  """
  directory = checkpoint_dir(workdir)
  manager = _reader(directory)
  try:
    step, meta = _step_and_meta(manager, directory, step)
    saved = manager.item_metadata(step)["state"]
    saved_params = getattr(saved, "tree", saved)["params"]
    abstract = state_lib.abstract(target_params)
    differences = structure_differences(saved_params, abstract)
    if differences:
      raise StateMismatchError(str(directory), step, [f"params: {d}" for d in differences], [])
    item = {"params": abstract}
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)))
    return restored.state["params"], meta
  finally:
    manager.close()


def _reader(directory: epath.Path) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False),
                               item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                              "meta": ocp.JsonCheckpointHandler()})


def _step_and_meta(manager, directory, step: int | None, field: str = "train.init_from"
                   ) -> tuple[int, dict[str, Any]]:
  steps = sorted(manager.all_steps()) if directory.exists() else []
  if not steps or (step is not None and step not in steps):
    raise CheckpointError(f"{field}: {directory} has no checkpoint"
                          + (f" at step {step} (it has {steps})" if step is not None and steps
                             else ""))
  step = steps[-1] if step is None else step
  return step, dict(manager.restore(step, args=ocp.args.Composite(
      meta=ocp.args.JsonRestore())).meta)


def restore_meta(workdir: str | epath.PathLike, step: int | None,
                 field: str = "train.init_from") -> dict[str, Any]:
  """The JSON metadata of another run's checkpoint (``step``, ``phase``, ``config``, and
  ``lora_base`` for a LoRA run); ``step`` None = the newest.

  Raises:
    CheckpointError: naming ``field`` (the flag or config field that pointed there): no
      checkpoint there, or not the requested step.
  """
  directory = checkpoint_dir(workdir)
  manager = _reader(directory)
  try:
    return _step_and_meta(manager, directory, step, field)[1]
  finally:
    manager.close()


def _report_unreadable(step: int, e: Exception) -> None:
  print(f"[gigrl] WARNING: checkpoint {step} is corrupt or partial "
        f"({type(e).__name__}: {str(e)[:200]}); falling back to an earlier one",
        file=sys.stderr, flush=True)


def structure_differences(saved: Any, expected: Any) -> list[str]:
  """Human-readable differences between a checkpoint's array metadata and a state's arrays.

  Leaves are matched by path (orbax stores named tuples as dicts, so order is not enough) and
  compared by shape and dtype. Returns [] when they match.
  """
  s, e = _by_path(saved), _by_path(expected)
  out = []
  only_s, only_e = sorted(set(s) - set(e)), sorted(set(e) - set(s))
  if only_s:
    out.append(f"{len(only_s)} arrays only in the checkpoint (e.g. {', '.join(only_s[:3])})")
  if only_e:
    out.append(f"{len(only_e)} arrays only in this config's state (e.g. "
               f"{', '.join(only_e[:3])})")
  for k in sorted(set(s) & set(e)):
    if s[k] != e[k]:
      out.append(f"{k} is {s[k][1]}{list(s[k][0])} in the checkpoint, {e[k][1]}{list(e[k][0])} "
                 "here")
  return out


def _by_path(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  return {k: (tuple(int(d) for d in x.shape), str(x.dtype))
          for k, x in state_lib.leaves_by_path(tree).items()}


def pool_differences(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
  """Query-pool fields that must match for the pool state to be restored (its size = the
  number of training questions, and its rule)."""
  out = []
  for key, why in (("num_queries", "training questions"), ("rule", "pool rule")):
    if key in saved and key in expected and saved[key] != expected[key]:
      out.append(f"the query pool has {why} {saved[key]!r} in the checkpoint, "
                 f"{expected[key]!r} here")
  return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(d, dict):
    return {prefix: d}
  out = {}
  for k, v in d.items():
    out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
  return out


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  """``["train.num_steps: 4 -> 6", ...]`` for every field that differs (JSON dicts)."""
  a, b = _flatten(old), _flatten(new)
  out = []
  for k in sorted(set(a) | set(b)):
    va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
    if va != vb:
      out.append(f"{k}: {va!r} -> {vb!r}")
  return out
