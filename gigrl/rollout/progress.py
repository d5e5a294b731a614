"""What long calls report: progress lines (a rollout's turns) and the seconds jax spent compiling.

A rollout of the SmolLM2 recipe takes a minute and a 300-question evaluation several; a
progress bar that only moves between them stands still for minutes. The stage that knows how far
it is calls :func:`report` (a no-op unless someone listens); the tool that owns the bar listens
with :func:`reporting`, e.g. ``with progress.reporting(bar.set_postfix_str): ...``.
:func:`compile_seconds` tells a step whether it paid for new programs (``time/*_compile_s``).
Used by every stage; imports only jax.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Callable, Iterator

import jax

_listeners: list[Callable[[str], None]] = []


def report(msg: str) -> None:
  """Passes ``msg`` (one short line, e.g. ``"rollout turn 2/5: decode 40 rows"``) to the
  innermost listener, if any."""
  if _listeners:
    _listeners[-1](msg)


@contextlib.contextmanager
def reporting(fn: Callable[[str], None]) -> Iterator[None]:
  """Within the block, :func:`report` calls ``fn(msg)``."""
  _listeners.append(fn)
  try:
    yield
  finally:
    _listeners.pop()


# jax's compile phases (jax.monitoring duration events, the same names on jax 0.10 and 0.11)
_COMPILE_EVENTS = frozenset(("/jax/core/compile/jaxpr_trace_duration",
                             "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"))
_compiling = {"listening": False}
_seconds_by_thread: dict[int, float] = collections.defaultdict(float)


def _on_duration(event: str, secs: float, *_, **__) -> None:
  if event in _COMPILE_EVENTS:     # jax reports a compile's phases in the thread that compiles
    _seconds_by_thread[threading.get_ident()] += secs


def compile_seconds() -> float:
  """Seconds jax has spent compiling (tracing, lowering, XLA) in the calling thread since the
  first call; a difference around a call is what that call paid for new programs (0.0 when every
  program it ran was compiled before). Per thread, so that with ``train.max_staleness >= 1`` a
  compile on the sampler thread is never booked to the update running beside it, nor the
  reverse. A duration, not a count: a resumed run compiles again, and its metrics lines must
  equal an uninterrupted run's but for timings."""
  if not _compiling["listening"]:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _compiling["listening"] = True
  return _seconds_by_thread[threading.get_ident()]
