"""Progress lines from inside long calls (a rollout's turns, an update's micro-batches).

A rollout of the SmolLM2 recipe takes a minute and a 300-question evaluation several; a
progress bar that only moves between them stands still for minutes. The stage that knows how far
it is calls :func:`report` (a no-op unless someone listens); the tool that owns the bar listens
with :func:`reporting`, e.g. ``with progress.reporting(bar.set_postfix_str): ...``. Used by
every stage, imports nothing.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

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
