"""Search-R1-compatible retrieval server: BM25 over a corpus, standard library only.

Reference: Search-R1 ``search_r1/search/retrieval_server.py`` (protocol only).

  ``POST /retrieve``  ``{"queries": [str, ...], "topk": int|null, "return_scores": bool}``
      -> ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``
      (items are ``{"id", "contents"}`` when ``return_scores`` is false, the default).
      verl-agent's single-query shape ``{"query": str, ...}`` is accepted too and
      answered with a result list of length 1.
  ``GET /health``  -> ``{"status": "ok", "num_docs": N}``

Bad requests get HTTP 400 with ``{"error": "...", "field": "<name>"}``; a known path with the
wrong method gets 405 with an ``Allow`` header (``GET /retrieve`` -> ``Allow: POST``); any
other path gets 404.

CLI: ``gigrl-serve-retriever --corpus FILE|bundled --port 8000 [--host 127.0.0.1] [--topk 3]``
(:mod:`gigrl.cli.serve_retriever`).
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gigrl.search.base import Passage, Retriever

MAX_BODY_BYTES = 16 * 1024 * 1024
ROUTES = {"/retrieve": "POST", "/health": "GET"}   # path -> the method it answers


class BadRequest(ValueError):
  """A request field is wrong; ``field`` names it."""

  def __init__(self, field: str, problem: str):
    self.field = field
    super().__init__(f"field '{field}': {problem}")


def parse_request(body: Any, default_topk: int) -> tuple[list[str], int, bool, bool]:
  """Validates a decoded request.

  Returns:
    (queries, topk, return_scores, single) where ``single`` marks the
    verl-agent ``{"query": str}`` shape.
  Raises:
    BadRequest: naming the offending field.
  """
  if not isinstance(body, dict):
    raise BadRequest("<body>", "expected a JSON object")
  single = "queries" not in body and "query" in body
  if single:
    queries = body["query"]
    if not isinstance(queries, str):
      raise BadRequest("query", "expected a string")
    queries = [queries]
  else:
    queries = body.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
      raise BadRequest("queries", "expected a list of strings")
  topk = body.get("topk")
  if topk is None:
    topk = default_topk
  if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
    raise BadRequest("topk", f"expected an integer >= 1 or null, got {topk!r}")
  return_scores = body.get("return_scores", False)
  if not isinstance(return_scores, bool):
    raise BadRequest("return_scores", f"expected a boolean, got {return_scores!r}")
  return queries, topk, return_scores, single


def format_result(results: list[list[Passage]], return_scores: bool) -> dict:
  """Passages -> the Search-R1 reply body."""
  def item(p: Passage) -> dict:
    doc = {"id": p.id, "contents": p.contents}
    return {"document": doc, "score": p.score} if return_scores else doc
  return {"result": [[item(p) for p in per_query] for per_query in results]}


def _make_handler(retriever: Retriever, num_docs: int, default_topk: int):
  """A request handler class bound to ``retriever``."""

  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # pylint: disable=redefined-builtin
      del format, args  # quiet: one line per request is too much in training

    def _send(self, code: int, payload: dict, headers: dict[str, str] | None = None) -> None:
      data = json.dumps(payload).encode("utf-8")
      self.send_response(code)
      for name, value in (headers or {}).items():
        self.send_header(name, value)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def _wrong_method_or_path(self) -> None:
      """405 (with ``Allow``) for a known path, 404 otherwise."""
      path = self.path.split("?")[0]
      allow = ROUTES.get(path)
      if allow:
        self._send(405, {"error": f"{self.command} {path} is not allowed; use {allow}",
                         "field": "<method>"}, {"Allow": allow})
      else:
        self._send(404, {"error": f"no such path {self.path}", "field": "<path>"})

    def do_GET(self):  # pylint: disable=invalid-name
      if self.path.split("?")[0] == "/health":
        self._send(200, {"status": "ok", "num_docs": num_docs})
      else:
        self._wrong_method_or_path()

    def _other_method(self) -> None:
      self.close_connection = True       # a body, if any, is not read
      self._wrong_method_or_path()

    do_PUT = do_DELETE = do_PATCH = _other_method

    def _read_body(self) -> Any:
      try:
        length = int(self.headers.get("Content-Length", ""))
      except ValueError:
        raise BadRequest("Content-Length", "missing or not an integer") from None
      if length < 0 or length > MAX_BODY_BYTES:
        raise BadRequest("Content-Length", f"must be 0..{MAX_BODY_BYTES} bytes")
      raw = self.rfile.read(length)
      try:
        return json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest("<body>", f"not valid JSON ({e})") from None

    def do_POST(self):  # pylint: disable=invalid-name
      if self.path.split("?")[0] != "/retrieve":
        self.close_connection = True     # the unread body must not become the next request
        self._wrong_method_or_path()
        return
      try:
        queries, topk, scores, _ = parse_request(self._read_body(), default_topk)
      except BadRequest as e:
        self.close_connection = True
        self._send(400, {"error": str(e), "field": e.field})
        return
      try:
        results = retriever.search(queries, topk)
      except Exception as e:  # pylint: disable=broad-except
        self._send(500, {"error": f"retriever failed: {e!r}"})
        return
      self._send(200, format_result(results, scores))

  return Handler


def serve_in_thread(retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                    *, topk: int = 3, num_docs: int | None = None
                    ) -> tuple[ThreadingHTTPServer, str]:
  """Starts a server in a daemon thread (for tests and benchmarks).

  Args:
    retriever: what to serve (search must be thread-safe).
    host, port: where to listen; port 0 picks a free port.
    topk: default when a request has no ``topk``.
    num_docs: reported by ``/health`` (default ``retriever.num_docs`` or -1).
  Returns:
    (server, url) with url ``http://host:port/retrieve``; stop with
    ``server.shutdown(); server.server_close()`` (shutdown takes <= 0.05 s).
  """
  if num_docs is None:
    num_docs = getattr(retriever, "num_docs", -1)
  server = ThreadingHTTPServer((host, port), _make_handler(retriever, num_docs, topk))
  server.daemon_threads = True
  thread = threading.Thread(target=server.serve_forever, args=(0.05,),
                            name="retriever-server", daemon=True)
  thread.start()
  return server, f"http://{host}:{server.server_address[1]}/retrieve"
