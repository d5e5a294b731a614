"""Rollout stage: the Search-R1 protocol and the multi-turn engines.

  * :mod:`gigrl.rollout.engine`: the ``RolloutEngine`` protocol, ``RolloutSettings``,
    ``make_engine`` (``rollout.engine``);
  * :mod:`gigrl.rollout.turns`: what both engines share (prompts, stop sequences, the turn
    dispatch, process-local rows);
  * :mod:`gigrl.rollout.host_loop`: the one engine (its shapes: :mod:`gigrl.rollout.shapes`);
  * :mod:`gigrl.rollout.protocol`: template, action parsing, observation format;
  * :mod:`gigrl.rollout.trajectory`: trajectory records and batches;
  * :mod:`gigrl.rollout.demos`: SFT demonstrations in rollout format.
"""
