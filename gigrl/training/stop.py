"""Why a run stops early: SIGTERM / Ctrl-C (a checkpoint, then a clean exit), or too many
non-finite updates in a row."""
from __future__ import annotations

import signal
import threading
from typing import Any, Callable


class NonFiniteError(RuntimeError):
  """Too many consecutive updates had a NaN/Inf loss or gradient."""


class StopSignals:
  """SIGTERM (preemption) and SIGINT (Ctrl-C) request a checkpoint and a clean exit.

  A second Ctrl-C interrupts at once (KeyboardInterrupt). Handlers are installed only on the
  main thread (Python allows no other).
  """

  def __init__(self, log: Callable[[str], None]):
    self.name: str | None = None
    self._log = log
    self._prev: dict[int, Any] = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._prev[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    if self.name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.name = signal.Signals(signum).name
    self._log(f"{self.name}: finishing the current step, then checkpointing "
              "(Ctrl-C again to stop at once)")

  def __exit__(self, *exc) -> None:
    for sig, prev in self._prev.items():
      signal.signal(sig, prev)


def check_finite(step: int, in_a_row: int, limit: int, record: dict[str, Any],
                 checkpoints: Callable[[], list[int]]) -> None:
  """Stops the run when ``limit`` (``train.max_consecutive_nonfinite``) updates in a row were
  skipped; the checkpoints written so far (``checkpoints()``, their steps) hold only finite
  updates.

  Raises:
    NonFiniteError: naming the step, the loss and gradient norm, the last checkpoint and what
      to lower.
  """
  if in_a_row >= limit:
    raise NonFiniteError(
        f"step {step}: {in_a_row} consecutive updates had a non-finite loss or gradient norm "
        f"(loss {record.get('loss')}, grad_norm {record.get('grad_norm')}); stopping. The "
        f"last checkpoint ({checkpoints()[-1:] or 'none'}) holds finite params; lower "
        "the learning rate (train.learning_rate / train.sft_learning_rate) and rerun")
