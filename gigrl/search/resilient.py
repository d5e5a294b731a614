"""Retries, failure policy and a per-step query cache around any retriever.

A transient failure of the inner retriever (``SearchError`` with
``retryable=True``: timeout, refused connection, HTTP 5xx, malformed reply) is
retried up to ``max_retries`` times, sleeping ``backoff_s * 2**i`` seconds
before retry ``i`` (i = 0, 1, ...). So one batch takes at most
``(max_retries + 1) * timeout_s + backoff_s * (2**max_retries - 1)`` seconds
and the rollout never hangs. After that, ``on_failure='raise'`` raises
``SearchError`` (url, what failed, attempts) and ``on_failure='empty'`` gives
each uncached query of the batch ``[]`` and counts a ``search_failures``.

With ``on_failure='empty'``, failures are never silent: the first failed batch
of each step (the calls between two :meth:`ResilientRetriever.new_step`) logs
one warning, and once the failed share of the step's queries passes
``max_failure_frac`` the search raises :class:`TooManySearchFailures` (checked
after every failed batch, so a step whose first turn finds the server down
stops before its update). :meth:`ResilientRetriever.health_check` sends one
query whatever the policy, so a run can stop before it builds anything on
empty observations (``make_retriever`` calls it).

Identical ``(query, topk)`` pairs are sent once per batch, and answers are
kept until :meth:`ResilientRetriever.new_step` (call it once per training
step), so a query repeated across the G rollouts of a group costs one lookup.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from absl import logging

from gigrl.search.base import Passage, Retriever, SearchError, check_topk

ON_FAILURE = ("raise", "empty")
_METRICS = ("queries", "search_failures", "failed_queries", "cache_hits", "requests",
            "retries")
HEALTH_CHECK_QUERY = "health check"


def _health_error(e: SearchError) -> SearchError:
  where = f" at {e.url}" if e.url else ""
  plural = "" if e.attempts == 1 else "s"
  e.args = (f"search backend{where} failed its health check ({e.attempts} attempt{plural}): "
            f"{e.what}",)
  return e


class TooManySearchFailures(SearchError):
  """More than ``max_failure_frac`` of a step's queries failed (``on_failure='empty'``).

  Attributes (besides SearchError's): failed, asked: the step's failed / asked queries;
  max_failure_frac: the bound.
  """

  def __init__(self, last: SearchError, failed: int, asked: int, max_failure_frac: float):
    self.failed, self.asked, self.max_failure_frac = failed, asked, max_failure_frac
    super().__init__(last.url, last.what, attempts=last.attempts, retryable=last.retryable)
    self.args = (f"{failed} of {asked} search queries of this step failed "
                 f"({failed / asked:.0%}, more than search.max_failure_frac="
                 f"{max_failure_frac}); last error: {last}",)


class ResilientRetriever:
  """Wraps a :class:`Retriever` with bounded retries, a failure policy and a cache.

  Metrics (``metrics()``; counters since the last ``reset_metrics()``):
    queries: queries asked (repeats and cache hits included).
    search_failures: batches that failed after all retries (policy 'empty').
    failed_queries: queries answered with ``[]`` because of those failures
      (repeats included).
    cache_hits: queries answered without asking the inner retriever
      (repeats within a batch and hits of the per-step cache).
    requests: calls to the inner retriever (HTTP requests), retries included.
    retries: calls that were retries.
  """

  def __init__(self, inner: Retriever, *, max_retries: int = 3,
               backoff_s: float = 0.5, on_failure: str = "raise",
               cache: bool = True, max_failure_frac: float = 0.5,
               sleep: Callable[[float], None] = time.sleep):
    """Args:
      inner: the retriever to call (e.g. ``HttpRetriever``, ``BM25Retriever``).
      max_retries: retries after the first failed attempt (>= 0).
      backoff_s: first retry delay, seconds (>= 0); doubles each retry.
      on_failure: 'raise' or 'empty' (see module docstring).
      cache: keep answers until ``new_step()``.
      max_failure_frac: with 'empty', the largest share (0..1) of a step's
        queries that may fail; more raises TooManySearchFailures (1 = never).
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
    if not 0 <= max_failure_frac <= 1:
      raise ValueError(f"max_failure_frac must be in [0, 1], got {max_failure_frac!r}")
    self.inner, self.max_retries, self.backoff_s = inner, max_retries, backoff_s
    self.on_failure, self.use_cache, self._sleep = on_failure, cache, sleep
    self.max_failure_frac = max_failure_frac
    self._cache: dict[tuple[str, int], list[Passage]] = {}
    self._lock = threading.Lock()
    self._step = {"asked": 0, "failed": 0, "warned": False}
    self.reset_metrics()

  @property
  def num_docs(self) -> int:
    return getattr(self.inner, "num_docs", -1)

  def new_step(self) -> None:
    """Starts a step: clears the per-step cache and the step's failure counts.

    Call it at the start of every training step.
    """
    with self._lock:
      self._cache.clear()
      self._step = {"asked": 0, "failed": 0, "warned": False}

  def health_check(self) -> None:
    """Sends one query (:data:`HEALTH_CHECK_QUERY`) with retries, whatever ``on_failure``.

    Not counted in the metrics.

    Raises:
      SearchError: the backend failed it (after retries if the failure was transient); the
        message says "failed its health check".
    """
    try:
      got = self._call_with_retries([HEALTH_CHECK_QUERY], 1, count=False)
    except SearchError as e:
      raise _health_error(SearchError(e.url, e.what, attempts=e.attempts,
                                      retryable=e.retryable)) from e
    if len(got) != 1:
      raise _health_error(SearchError(getattr(self.inner, "url", ""),
                                      f"{len(got)} result lists for 1 query"))

  def reset_metrics(self) -> None:
    with self._lock:
      self._metrics = dict.fromkeys(_METRICS, 0)

  def metrics(self) -> dict[str, int]:
    """Counters: queries, search_failures, failed_queries, cache_hits, requests, retries."""
    with self._lock:
      return dict(self._metrics)

  def _count(self, name: str, n: int = 1) -> None:
    with self._lock:
      self._metrics[name] += n

  def _call_with_retries(self, queries: list[str], topk: int, *,
                         count: bool = True) -> list[list[Passage]]:
    """Inner search with retries; raises the final SearchError (attempts set)."""
    attempt = 0
    while True:
      if count:
        self._count("requests")
      try:
        return self.inner.search(queries, topk)
      except SearchError as e:
        attempt += 1
        if not e.retryable or attempt > self.max_retries:
          raise SearchError(e.url, e.what, attempts=attempt,
                            retryable=e.retryable) from e
      self._sleep(self.backoff_s * 2 ** (attempt - 1))
      if count:
        self._count("retries")

  def _record_failure(self, error: SearchError, failed: int) -> None:
    """Counts a failed batch of the step; warns once per step; raises past the bound."""
    with self._lock:
      self._metrics["search_failures"] += 1
      self._metrics["failed_queries"] += failed
      self._step["failed"] += failed
      step_failed, asked = self._step["failed"], self._step["asked"]
      warn, self._step["warned"] = not self._step["warned"], True
    if step_failed > self.max_failure_frac * asked:
      raise TooManySearchFailures(error, step_failed, asked, self.max_failure_frac) from error
    if warn:
      logging.warning("search: %d of %d queries of this step so far got no passages "
                      "(search.on_failure=empty; the run stops above "
                      "search.max_failure_frac=%s): %s", step_failed, asked,
                      self.max_failure_frac, error)

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
      TooManySearchFailures: on_failure='empty' and more than
        ``max_failure_frac`` of this step's queries failed.
      ValueError: ``topk`` < 1.
    """
    check_topk(topk)
    with self._lock:
      self._metrics["queries"] += len(queries)
      self._step["asked"] += len(queries)
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
      except SearchError as e:
        if self.on_failure == "raise":
          raise
        failed = set(todo)
        self._record_failure(e, sum(q in failed for q in queries))
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
