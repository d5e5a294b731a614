"""The ``search`` config section: defaults, validation and the retriever factory."""
from __future__ import annotations

import inspect
from typing import Any

import ml_collections

from gigrl.config_utils import ConfigError, check_choice, check_file, check_range, get_field
from gigrl.search.base import NullRetriever, Retriever
from gigrl.search.http_client import HttpRetriever
from gigrl.search.resilient import ON_FAILURE, ResilientRetriever

# The failure-handling defaults are ResilientRetriever's (defined once, there).
_RESILIENT = {k: p.default for k, p in
              inspect.signature(ResilientRetriever.__init__).parameters.items()
              if k in ("max_retries", "backoff_s", "on_failure", "cache", "max_failure_frac")}

BACKENDS = ("bm25", "http", "none")


def default_config() -> ml_collections.ConfigDict:
  """Defaults of the ``search`` section.

  Fields:
    backend: 'bm25' (in-process, over ``corpus``), 'http' (Search-R1 server at ``url``) or
      'none' (closed book: every search returns no passage, :class:`NullRetriever`).
    url: Search-R1 ``/retrieve`` endpoint (backend 'http').
    topk: passages per query (Search-R1 uses 3).
    timeout_s: per-request socket timeout, seconds.
    max_retries: retries of a transient failure; backoff_s: first retry delay,
      seconds, doubling per retry.
    on_failure: 'raise' (SearchError) or 'empty' (empty results, counted, warned).
    max_failure_frac: with 'empty', the largest share of a step's queries that may
      fail before the run stops (1.0 = never stop).
    cache: per-step query cache.
    corpus: 'bundled' or a Search-R1 corpus jsonl path (backend 'bm25').
    index_cache: where the BM25 index of ``corpus`` is saved once built and loaded by later
      runs: 'auto' (``$GIGRL_CACHE_DIR/bm25``, else ``~/.cache/gigrl/bm25``), a directory,
      or '' to build it every time.
  """
  return ml_collections.ConfigDict({
      "backend": "bm25",
      "url": "http://127.0.0.1:8000/retrieve",
      "topk": 3,
      "timeout_s": 30.0,
      **_RESILIENT,
      "corpus": "bundled",
      "index_cache": "auto",
  })


def _check_str(root: Any, field: str, ok: bool, allowed: str) -> str:
  value = get_field(root, field)
  if not isinstance(value, str) or not ok:
    raise ConfigError(field, value, allowed)
  return value


def validate(cfg_search: Any) -> None:
  """Checks the ``search`` section.

  Raises:
    ConfigError: naming the field as ``search.<name>``, e.g. backend 'http'
      with an empty ``url`` names ``search.url``; a missing corpus file names
      ``search.corpus``.
  """
  root = {"search": cfg_search}
  backend = check_choice(root, "search.backend", BACKENDS)
  check_range(root, "search.topk", 1, integer=True)
  check_range(root, "search.timeout_s", 0, lo_open=True)
  check_range(root, "search.max_retries", 0, 10, integer=True)
  check_range(root, "search.backoff_s", 0, 60)
  check_choice(root, "search.on_failure", ON_FAILURE)
  check_range(root, "search.max_failure_frac", 0, 1)
  check_choice(root, "search.cache", (True, False))
  if backend == "http":
    url = get_field(root, "search.url")
    _check_str(root, "search.url",
               isinstance(url, str) and url.startswith(("http://", "https://")),
               "a non-empty http:// or https:// URL when search.backend is 'http'")
  elif backend == "bm25" and get_field(root, "search.corpus") != "bundled":
    check_file(root, "search.corpus", "'bundled' or a Search-R1 corpus jsonl")
  _check_str(root, "search.index_cache", True, "'auto', a directory, or '' (no cache)")





def make_retriever(cfg_search: Any, *, health_check: bool = True) -> ResilientRetriever:
  """Validates ``cfg_search`` and builds the retriever it describes.

  Args:
    cfg_search: the ``search`` section.
    health_check: send one query before returning (:meth:`ResilientRetriever.health_check`),
      so a server that is down stops the run at start-up, before anything (SFT
      demonstrations, rollouts) is built on empty observations.
  Returns:
    A :class:`ResilientRetriever` around ``BM25Retriever`` (backend 'bm25'; builds the index,
    about 1.3 s for the bundled corpus, or loads it from ``search.index_cache``) or
    ``HttpRetriever`` or ``NullRetriever`` (backend 'none').
  Raises:
    ConfigError: see :func:`validate`.
    gigrl.data.qa.DataError: a malformed corpus row, or a corpus without rows.
    SearchError: the health check failed (the message says "failed its health check").
  """
  validate(cfg_search)
  inner: Retriever
  if cfg_search.backend == "none":
    inner = NullRetriever()
  elif cfg_search.backend == "http":
    inner = HttpRetriever(cfg_search.url, timeout_s=float(cfg_search.timeout_s))
  else:
    from gigrl.search.bm25 import BM25Retriever  # pylint: disable=import-outside-toplevel
    from gigrl.search.bm25 import resolve_cache_dir  # pylint: disable=import-outside-toplevel
    inner = BM25Retriever.from_corpus(cfg_search.corpus,
                                      cache_dir=resolve_cache_dir(cfg_search.index_cache))
  retriever = ResilientRetriever(inner, max_retries=cfg_search.max_retries,
                                 backoff_s=float(cfg_search.backoff_s),
                                 on_failure=cfg_search.on_failure, cache=cfg_search.cache,
                                 max_failure_frac=float(cfg_search.max_failure_frac))
  if health_check:
    retriever.health_check()
  return retriever
