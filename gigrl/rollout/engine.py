"""The rollout interface: :class:`RolloutEngine` and the ``rollout.engine`` factory.

An engine turns a batch of questions into a :class:`~gigrl.rollout.trajectory.TrajectoryBatch` of
Search-R1 trajectories (prompt, then per turn the generated tokens and the observation) with the
policy's current parameters. One engine implements it, the one rollout core:

  * ``host_loop`` (:class:`gigrl.rollout.host_loop.HostLoopEngine`): jitted prefill, extend,
    decode and copy programs from a bounded shape grid (:mod:`gigrl.rollout.shapes`), all
    compiled before the first step; the host parses actions and searches between turns.

The ``callback`` engine (one jitted program per batch, the search through ``io_callback``) was
retired in issue #50; ``rollout.engine=callback`` is a start-up error naming ``host_loop``
(docs/architecture.md gives the reasons).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import jax

from gigrl.rollout import turns
from gigrl.rollout.trajectory import TrajectoryBatch

RolloutSettings = turns.RolloutSettings
settings_from_config = turns.settings_from_config
ENGINES = ("host_loop",)
RETIRED = {"callback": "the callback engine was retired in issue #50; use 'host_loop', the one "
                       "rollout core (every saving, every program compiled before step 1)"}


@runtime_checkable
class RolloutEngine(Protocol):
  """Anything that rolls out a batch of Search-R1 trajectories."""

  def run(self, params, questions: Sequence[str], key: jax.Array
          ) -> tuple[TrajectoryBatch, dict[str, float]]:
    """Rolls out one trajectory per question (repeat a question G times for a group).

    Args:
      params: the policy's ``nnx.State`` (from ``nnx.split(model)``), on any mesh.
      questions: B question strings; row i of the batch belongs to ``questions[i]``. On several
        JAX processes (one per host), each process passes its own rows, the same B on every
        process; the engine decodes them on that process's devices and sends their queries to
        that process's retriever only.
      key: PRNG key, the same on every process; the rollout is a deterministic function of
        (params, questions, key) for a given engine and device count.
    Returns:
      ``(batch, metrics)``: ``batch`` holds this process's B rows, each of width
      ``settings.seq_len``: tokens i32[B, S], loss_mask f32[B, S] (1 on generated tokens),
      step_ids i32[B, S] (turn of each generated token, -1 elsewhere), lengths i32[B],
      search_calls i32[B], num_steps i32[B], and per row the text of each turn, the anchor
      text of each step and each action's validity. ``metrics`` (this process's) holds at least
      ``time/decode_s``, ``time/search_s`` (seconds), ``rollout/generated_tokens`` and
      ``rollout/retriever_calls`` (counts).
    Raises:
      ValueError: a prompt is longer than ``settings.max_prompt_tokens``, or the retriever
        returned a wrong number of result lists.
    """
    ...


def make_engine(kind: str, model_cfg, graphdef, tokenizer, retriever,
                settings: RolloutSettings, *, mesh: jax.sharding.Mesh | None = None,
                prompt_stats=None, distinct_rows: int | None = None) -> RolloutEngine:
  """``rollout.engine`` dispatch: ``'host_loop'``.

  Args:
    kind: ``'host_loop'``.
    model_cfg, graphdef: the policy's ``ModelConfig`` and ``nnx.GraphDef``.
    tokenizer: a :class:`gigrl.data.tokenizer.Tokenizer`.
    retriever: a :class:`gigrl.search.base.Retriever`.
    settings: rollout options (:class:`RolloutSettings`).
    mesh: the devices to roll out on (the KV cache is sharded over its axes). Default: no mesh.
    prompt_stats, distinct_rows: the shape grid's prompt lengths and distinct prompts per
      batch (:class:`gigrl.rollout.host_loop.HostLoopEngine`).
  Raises:
    ValueError: unknown or retired ``kind`` (the message names the replacement).
  """
  # Imported here: the engine module imports this package's shared modules.
  from gigrl.rollout import host_loop  # pylint: disable=import-outside-toplevel
  if kind == "host_loop":
    return host_loop.HostLoopEngine(model_cfg, graphdef, tokenizer, retriever, settings,
                                    mesh=mesh, prompt_stats=prompt_stats,
                                    distinct_rows=distinct_rows)
  if kind in RETIRED:
    raise ValueError(f"rollout.engine={kind!r}: {RETIRED[kind]}")
  raise ValueError(f"rollout.engine={kind!r}; expected one of {ENGINES}")
