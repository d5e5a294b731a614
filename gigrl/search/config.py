"""The ``search`` config section: defaults, validation and the retriever factory."""
from __future__ import annotations

import os
from typing import Any

import ml_collections

from gigrl.config_utils import ConfigError, check_choice, check_range, get_field
from gigrl.search.base import Retriever
from gigrl.search.http_client import HttpRetriever
from gigrl.search.resilient import ON_FAILURE, ResilientRetriever

BACKENDS = ("bm25", "http")


def default_config() -> ml_collections.ConfigDict:
  """Defaults of the ``search`` section.

  Fields:
    backend: 'bm25' (in-process, over ``corpus``) or 'http' (Search-R1 server at ``url``).
    url: Search-R1 ``/retrieve`` endpoint (backend 'http').
    topk: passages per query (Search-R1 uses 3).
    timeout_s: per-request socket timeout, seconds.
    max_retries: retries of a transient failure; backoff_s: first retry delay,
      seconds, doubling per retry.
    on_failure: 'raise' (SearchError) or 'empty' (empty results, counted).
    cache: per-step query cache.
    corpus: 'bundled' or a Search-R1 corpus jsonl path (backend 'bm25').
  """
  return ml_collections.ConfigDict({
      "backend": "bm25",
      "url": "http://127.0.0.1:8000/retrieve",
      "topk": 3,
      "timeout_s": 30.0,
      "max_retries": 3,
      "backoff_s": 0.5,
      "on_failure": "raise",
      "cache": True,
      "corpus": "bundled",
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
  check_choice(root, "search.cache", (True, False))
  if backend == "http":
    url = get_field(root, "search.url")
    _check_str(root, "search.url",
               isinstance(url, str) and url.startswith(("http://", "https://")),
               "a non-empty http:// or https:// URL when search.backend is 'http'")
  else:
    corpus = get_field(root, "search.corpus")
    _check_str(root, "search.corpus",
               isinstance(corpus, str) and (corpus == "bundled" or os.path.isfile(corpus)),
               "'bundled' or an existing Search-R1 corpus jsonl file")


def make_retriever(cfg_search: Any) -> ResilientRetriever:
  """Validates ``cfg_search`` and builds the retriever it describes.

  Returns:
    A :class:`ResilientRetriever` around ``BM25Retriever`` (backend 'bm25';
    builds the index, about 1 s for the bundled corpus) or ``HttpRetriever``.
  Raises:
    ConfigError: see :func:`validate`.
    gigrl.data.qa.DataError: a malformed corpus row.
  """
  validate(cfg_search)
  inner: Retriever
  if cfg_search.backend == "http":
    inner = HttpRetriever(cfg_search.url, timeout_s=float(cfg_search.timeout_s))
  else:
    from gigrl.search.bm25 import BM25Retriever  # pylint: disable=import-outside-toplevel
    inner = BM25Retriever.from_corpus(cfg_search.corpus)
  return ResilientRetriever(inner, max_retries=cfg_search.max_retries,
                            backoff_s=float(cfg_search.backoff_s),
                            on_failure=cfg_search.on_failure, cache=cfg_search.cache)
