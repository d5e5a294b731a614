"""Retries, failure policy and a per-step query cache around any retriever.

A transient failure of the inner retriever (``SearchError`` with
``retryable=True``: timeout, refused connection, HTTP 5xx, malformed reply) is
retried up to ``max_retries`` times, sleeping ``backoff_s * 2**i`` seconds
before retry ``i`` (i = 0, 1, ...). So one batch takes at most
``(max_retries + 1) * timeout_s + backoff_s * (2**max_retries - 1)`` seconds
and the rollout never hangs. After that, ``on_failure='raise'`` raises
``SearchError`` (url, what failed, attempts) and ``on_failure='empty'`` gives
each uncached query of the batch ``[]`` and counts a ``search_failures``.

Identical ``(query, topk)`` pairs are sent once per batch, and answers are
kept until :meth:`ResilientRetriever.new_step` (call it once per training
step), so a query repeated across the G rollouts of a group costs one lookup.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from gigrl.search.base import Passage, Retriever, SearchError, check_topk

ON_FAILURE = ("raise", "empty")
_METRICS = ("search_failures", "failed_queries", "cache_hits", "requests", "retries")


class ResilientRetriever:
  """Wraps a :class:`Retriever` with bounded retries, a failure policy and a cache.

  Metrics (``metrics()``; counters since the last ``reset_metrics()``):
    search_failures: batches that failed after all retries (policy 'empty').
    failed_queries: queries answered with ``[]`` because of those failures.
    cache_hits: queries answered without asking the inner retriever
      (repeats within a batch and hits of the per-step cache).
    requests: calls to the inner retriever (HTTP requests), retries included.
    retries: calls that were retries.
  """

  def __init__(self, inner: Retriever, *, max_retries: int = 3,
               backoff_s: float = 0.5, on_failure: str = "raise",
               cache: bool = True,
               sleep: Callable[[float], None] = time.sleep):
    """Args:
      inner: the retriever to call (e.g. ``HttpRetriever``, ``BM25Retriever``).
      max_retries: retries after the first failed attempt (>= 0).
      backoff_s: first retry delay, seconds (>= 0); doubles each retry.
      on_failure: 'raise' or 'empty' (see module docstring).
      cache: keep answers until ``new_step()``.
      sleep: injectable for tests.
    Raises:
      ValueError: a bad argument.
    """
    if on_failure not in ON_FAILURE:
      raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
      raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
    if not backoff_s >= 0:
      raise ValueError(f"backoff_s must be >= 0, got {backoff_s!r}")
    self.inner, self.max_retries, self.backoff_s = inner, max_retries, backoff_s
    self.on_failure, self.use_cache, self._sleep = on_failure, cache, sleep
    self._cache: dict[tuple[str, int], list[Passage]] = {}
    self._lock = threading.Lock()
    self.reset_metrics()

  @property
  def num_docs(self) -> int:
    return getattr(self.inner, "num_docs", -1)

  def new_step(self) -> None:
    """Clears the per-step cache (call at the start of every training step)."""
    with self._lock:
      self._cache.clear()

  def reset_metrics(self) -> None:
    with self._lock:
      self._metrics = dict.fromkeys(_METRICS, 0)

  def metrics(self) -> dict[str, int]:
    """Counters: search_failures, failed_queries, cache_hits, requests, retries."""
    with self._lock:
      return dict(self._metrics)

  def _count(self, name: str, n: int = 1) -> None:
    with self._lock:
      self._metrics[name] += n

  def _call_with_retries(self, queries: list[str], topk: int) -> list[list[Passage]]:
    """Inner search with retries; raises the final SearchError (attempts set)."""
    attempt = 0
    while True:
      self._count("requests")
      try:
        return self.inner.search(queries, topk)
      except SearchError as e:
        attempt += 1
        if not e.retryable or attempt > self.max_retries:
          raise SearchError(e.url, e.what, attempts=attempt,
                            retryable=e.retryable) from e
      self._sleep(self.backoff_s * 2 ** (attempt - 1))
      self._count("retries")

  def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
    """Top-``topk`` passages per query, in query order.

    Args:
      queries: B query strings.
      topk: passages per query (>= 1).
    Returns:
      B lists of passages; with on_failure='empty', ``[]`` for the queries of
      a failed batch (cached queries keep their answers).
    Raises:
      SearchError: on_failure='raise' and the inner retriever failed (after
        retries if the failure was transient).
      ValueError: ``topk`` < 1.
    """
    check_topk(topk)
    unique = list(dict.fromkeys(queries))
    answers: dict[str, list[Passage]] = {}
    if self.use_cache:
      with self._lock:
        answers = {q: self._cache[(q, topk)] for q in unique
                   if (q, topk) in self._cache}
    todo = [q for q in unique if q not in answers]
    self._count("cache_hits", len(queries) - len(todo))
    if todo:
      try:
        fresh = self._call_with_retries(todo, topk)
      except SearchError:
        if self.on_failure == "raise":
          raise
        self._count("search_failures")
        self._count("failed_queries", len(todo))
        fresh = [[] for _ in todo]
      else:
        if len(fresh) != len(todo):
          raise SearchError(getattr(self.inner, "url", ""),
                            f"{len(fresh)} result lists for {len(todo)} queries")
        if self.use_cache:
          with self._lock:
            self._cache.update(((q, topk), r) for q, r in zip(todo, fresh))
      answers.update(zip(todo, fresh))
    return [list(answers[q]) for q in queries]
