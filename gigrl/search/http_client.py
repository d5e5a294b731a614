"""Client for a Search-R1 retrieval server (``search_r1/search/retrieval_server.py``).

Protocol: ``POST {url}`` with ``{"queries": [str, ...], "topk": k,
"return_scores": true}``; the reply is ``{"result": [[{"document": {"id",
"contents"}, "score": float}, ...], ...]}``, one list per query, in order.
Also accepted: the no-scores form (items ``{"id", "contents"}``, score 0.0),
a bare top-level list instead of ``{"result": ...}``, and documents with
``title``/``text`` instead of ``contents`` (``contents = '"' + title + '"\\n' + text``).

All queries of a call go in ONE request. Proxies are never used (retrieval
servers are local or on the cluster network).
"""
from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from gigrl.search.base import BaseRetriever, Passage, SearchError, check_topk

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _to_passage(item: Any) -> Passage:
  """One reply item -> Passage; ValueError if it has no usable document."""
  if not isinstance(item, dict):
    raise ValueError(f"expected a JSON object per passage, got {type(item).__name__}")
  doc, score = item, 0.0
  if "document" in item:
    doc, score = item["document"], item.get("score", 0.0)
    if not isinstance(doc, dict):
      raise ValueError("'document' is not a JSON object")
  if isinstance(score, bool) or not isinstance(score, (int, float)):
    raise ValueError(f"'score' is not a number: {score!r}")
  contents = doc.get("contents")
  if not isinstance(contents, str):
    title, text = doc.get("title"), doc.get("text")
    if not isinstance(title, str) or not isinstance(text, str):
      raise ValueError("a document has neither 'contents' nor 'title' and 'text'")
    contents = '"' + title + '"\n' + text
  return Passage(str(doc.get("id", "")), contents, float(score))


def parse_reply(payload: Any, num_queries: int) -> list[list[Passage]]:
  """Parses a decoded Search-R1 reply.

  Args:
    payload: the decoded JSON body.
    num_queries: how many queries were sent (the reply must have one list each).
  Returns:
    ``num_queries`` lists of passages.
  Raises:
    ValueError: the reply does not have that shape (message says what is wrong).
  """
  result = payload.get("result") if isinstance(payload, dict) else payload
  if not isinstance(result, list):
    raise ValueError("reply has no 'result' list")
  if len(result) != num_queries:
    raise ValueError(f"reply has {len(result)} result lists for {num_queries} queries")
  out = []
  for i, per_query in enumerate(result):
    if not isinstance(per_query, list):
      raise ValueError(f"result[{i}] is not a list")
    out.append([_to_passage(item) for item in per_query])
  return out


class HttpRetriever(BaseRetriever):
  """Search-R1 protocol client. Stateless, so safe to share between threads."""

  def __init__(self, url: str, *, timeout_s: float = 30.0):
    """Args:
      url: full endpoint, e.g. ``'http://127.0.0.1:8000/retrieve'``.
      timeout_s: socket timeout, seconds, applied to the connect and to each
        read (a server that answers but trickles bytes can take longer).
    """
    self.url, self.timeout_s = url, timeout_s

  def _fail(self, what: str, retryable: bool) -> SearchError:
    return SearchError(self.url, what, retryable=retryable)

  def _post(self, body: bytes) -> bytes:
    req = urllib.request.Request(
        self.url, data=body, method="POST",
        headers={"Content-Type": "application/json"})
    try:
      with _OPENER.open(req, timeout=self.timeout_s) as resp:
        return resp.read()
    except urllib.error.HTTPError as e:
      try:
        detail = e.read(300).decode("utf-8", "replace")
      except (OSError, http.client.HTTPException):
        detail = "<unreadable body>"
      raise self._fail(f"HTTP {e.code}: {detail}", e.code >= 500) from None
    except (TimeoutError, socket.timeout):
      raise self._fail(f"timed out after {self.timeout_s} s", True) from None
    except urllib.error.URLError as e:
      if isinstance(e.reason, (TimeoutError, socket.timeout)):
        raise self._fail(f"timed out after {self.timeout_s} s", True) from None
      raise self._fail(f"connection failed: {e.reason}", True) from None
    except (ConnectionError, http.client.HTTPException, OSError) as e:
      raise self._fail(f"connection failed: {e!r}", True) from None

  def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
    """Sends all ``queries`` in one request; returns their passages in order.

    Args:
      queries: B query strings (B = 0 makes no request).
      topk: passages per query (>= 1).
    Returns:
      B lists of passages, as the server ranked them.
    Raises:
      SearchError: timeout, refused/reset connection, HTTP error, or a reply
        that is not JSON or not in the protocol's shape. ``retryable`` is
        False only for HTTP 4xx.
      ValueError: ``topk`` < 1.
    """
    check_topk(topk)
    if not queries:
      return []
    body = json.dumps({"queries": list(queries), "topk": topk,
                       "return_scores": True}).encode("utf-8")
    raw = self._post(body)
    try:
      payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise self._fail(f"malformed reply (not JSON): {raw[:100]!r}", True) from None
    try:
      return parse_reply(payload, len(queries))
    except ValueError as e:
      raise self._fail(f"malformed reply: {e}", True) from None
