"""Search stage: retriever interface, BM25 (``bm25s``), Search-R1 HTTP client and server.

  * :mod:`gigrl.search.base`: ``Passage``, ``Retriever``, ``SearchError``;
  * :mod:`gigrl.search.bm25`: ``BM25Retriever`` (in-process);
  * :mod:`gigrl.search.http_client`: ``HttpRetriever`` (Search-R1 protocol);
  * :mod:`gigrl.search.resilient`: retries, failure policy (``TooManySearchFailures``,
    health check), per-step cache;
  * :mod:`gigrl.search.server`: ``serve_in_thread`` (``gigrl-serve-retriever``'s library call);
  * :mod:`gigrl.search.config`: the ``search`` config section and ``make_retriever``.

``BM25Retriever`` is imported lazily (``bm25s`` takes ~1 s to import), and the
server module is not imported here (``gigrl.cli.serve_retriever`` imports it).
"""
from gigrl.search.base import NullRetriever, Passage, Retriever, SearchError
from gigrl.search.config import default_config, make_retriever, validate
from gigrl.search.http_client import HttpRetriever
from gigrl.search.resilient import ResilientRetriever, TooManySearchFailures

__all__ = ["NullRetriever", "Passage", "Retriever", "SearchError", "BM25Retriever",
           "HttpRetriever", "ResilientRetriever", "TooManySearchFailures", "default_config", "validate",
           "make_retriever"]


def __getattr__(name):
  if name == "BM25Retriever":
    from gigrl.search.bm25 import BM25Retriever  # pylint: disable=import-outside-toplevel
    return BM25Retriever
  raise AttributeError(f"module 'gigrl.search' has no attribute {name!r}")
