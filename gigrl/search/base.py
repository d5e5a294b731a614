"""Retriever interface shared by every search backend.

A retriever maps a batch of query strings to the top-k passages of each query,
in query order (contract in ``docs/architecture.md``):

  ``Retriever.search(queries: list[str], topk: int) -> list[list[Passage]]``

plus the per-step hooks ``new_step()`` (drop per-step state such as a query cache) and
``metrics() -> dict[str, float]`` (cumulative counters), which :class:`BaseRetriever` implements
as no-ops.

``Passage.contents`` keeps the Search-R1 corpus convention ``'"Title"\\ntext'``
(Search-R1 ``search_r1/search/retrieval_server.py``; ``gigrl.data.qa``).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable


class Passage(NamedTuple):
  """One retrieved passage.

  Attributes:
    id: corpus document id (string; integer ids are converted).
    contents: ``'"Title"\\ntext'`` as in the Search-R1 corpus.
    score: retrieval score (higher is better); 0.0 when the backend sends none.
  """
  id: str
  contents: str
  score: float


@runtime_checkable
class Retriever(Protocol):
  """A batched ``search`` plus the per-training-step hooks the trainer calls.

  The trainer calls ``new_step()`` once at the start of every training step (before the
  rollout), reads ``metrics()`` before and after the rollout, and logs each counter's change
  over the step as ``search/<name>``. Backends without per-step state or counters inherit the
  no-op hooks of :class:`BaseRetriever`.
  """

  def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
    """Returns, for each query in order, at most ``topk`` passages, best first."""
    ...

  def new_step(self) -> None:
    """Starts a training step: drops per-step state (e.g. a query cache). Does not reset the
    counters of :meth:`metrics`."""
    ...

  def metrics(self) -> dict[str, float]:
    """Cumulative counters (e.g. ``requests``, ``search_failures``), each growing from
    construction on (``ResilientRetriever.reset_metrics`` zeroes them); ``{}`` for a backend
    that keeps none. Thread-safe."""
    ...


class BaseRetriever:
  """Default :class:`Retriever` hooks: no per-step state, no counters."""

  def new_step(self) -> None:
    """Nothing to reset."""

  def metrics(self) -> dict[str, float]:
    """No counters: ``{}``."""
    return {}


class NullRetriever(BaseRetriever):
  """Closed book: every query returns no passage (``search.backend='none'``), so the policy
  sees an empty ``<information></information>`` block and answers from its own weights. The
  closed-book baseline of a search agent is the same policy with this retriever."""

  def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
    """``[[] for each query]``."""
    del topk
    return [[] for _ in queries]


class SearchError(RuntimeError):
  """A search request failed.

  Attributes:
    url: where the request went ('' for in-process backends).
    what: short description of the failure, e.g. ``"timed out after 0.2 s"``.
    attempts: how many requests were made (1 for a single failed request).
    retryable: True for transient failures (timeout, refused connection,
      HTTP 5xx, malformed reply) that a retry may fix; False otherwise
      (e.g. HTTP 4xx: the request itself is wrong).
  """

  def __init__(self, url: str, what: str, *, attempts: int = 1,
               retryable: bool = False):
    self.url, self.what = url, what
    self.attempts, self.retryable = attempts, retryable
    where = f" at {url}" if url else ""
    plural = "" if attempts == 1 else "s"
    super().__init__(
        f"search request{where} failed after {attempts} attempt{plural}: {what}")


def check_topk(topk: int) -> int:
  """Returns ``topk`` if it is an int >= 1; ValueError otherwise."""
  if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
    raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
  return topk
