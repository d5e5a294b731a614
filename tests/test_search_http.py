"""Search-R1 HTTP protocol: the stdlib server, the client, and the CLI (loopback only)."""
import http.client
import json
import os
import subprocess
import sys
import threading
import urllib.parse

import pytest

from gigrl.data import qa
from gigrl.cli import serve_retriever as serve_cli
from gigrl.search import base, bm25, http_client, server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CountingRetriever:
  """Forwards to a retriever and records every batch it receives."""

  def __init__(self, inner):
    self.inner, self.batches = inner, []
    self.num_docs = inner.num_docs

  def search(self, queries, topk):
    self.batches.append((list(queries), topk))
    return self.inner.search(queries, topk)


@pytest.fixture(scope="module")
def local():
  return bm25.BM25Retriever(qa.load_bundled_corpus())


@pytest.fixture(scope="module")
def served(local):
  counting = CountingRetriever(local)
  srv, url = server.serve_in_thread(counting, "127.0.0.1", 0)
  yield counting, url
  srv.shutdown()
  srv.server_close()


def raw_request(url, method, path, body=None, headers=None, with_headers=False):
  """(status, decoded JSON[, response headers]) of one request.

  ``body`` may be bytes or a JSON-able object.
  """
  parts = urllib.parse.urlsplit(url)
  assert parts.hostname == "127.0.0.1"
  conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
  try:
    if body is not None and not isinstance(body, bytes):
      body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    return (*out, dict(resp.getheaders())) if with_headers else out
  finally:
    conn.close()


def test_http_results_equal_in_process_results(local, served):
  counting, url = served
  questions = [q.question for q in qa.load_bundled_questions()[:32]] + ["", "the"]
  client = http_client.HttpRetriever(url, timeout_s=10)
  counting.batches.clear()
  got = client.search(questions, 3)
  assert got == local.search(questions, 3)  # ids, contents and float32 scores exactly
  assert counting.batches == [(questions, 3)]  # the whole turn in ONE request
  assert got[-1] == [] and got[-2] == [] and all(got[:32])


def test_health_reports_corpus_size(local, served):
  _, url = served
  status, body = raw_request(url, "GET", "/health")
  assert (status, body) == (200, {"status": "ok", "num_docs": local.num_docs})


def test_wire_format_with_and_without_scores(local, served):
  _, url = served
  status, body = raw_request(url, "POST", "/retrieve", {
      "queries": ["Evan Morris lobbyist", "capital of France"], "topk": 2,
      "return_scores": True})
  assert status == 200 and len(body["result"]) == 2
  item = body["result"][0][0]
  assert set(item) == {"document", "score"} and set(item["document"]) == {"id", "contents"}
  expected = local.search(["Evan Morris lobbyist"], 2)[0][0]
  assert (item["document"]["id"], item["score"]) == (expected.id, expected.score)
  # Search-R1's default: return_scores false -> bare documents; topk null -> server's 3.
  status, body = raw_request(url, "POST", "/retrieve",
                             {"queries": ["capital of France"], "topk": None})
  assert status == 200 and len(body["result"][0]) == 3
  assert set(body["result"][0][0]) == {"id", "contents"}


def test_verl_agent_single_query_shape(served):
  _, url = served
  status, body = raw_request(url, "POST", "/retrieve",
                             {"query": "capital of France", "topk": 1, "return_scores": True})
  assert status == 200 and len(body["result"]) == 1 and len(body["result"][0]) == 1


@pytest.mark.parametrize("body,field", [
    ({"queries": "not a list"}, "queries"),
    ({"queries": ["ok", 3]}, "queries"),
    ({"topk": 3}, "queries"),
    ({"query": 5}, "query"),
    ({"queries": ["x"], "topk": 0}, "topk"),
    ({"queries": ["x"], "topk": "3"}, "topk"),
    ({"queries": ["x"], "return_scores": "yes"}, "return_scores"),
    ([1, 2], "<body>"),
    (b"{not json", "<body>"),
])
def test_bad_requests_get_400_naming_the_field(served, body, field):
  _, url = served
  status, reply = raw_request(url, "POST", "/retrieve", body)
  assert status == 400 and reply["field"] == field and field in reply["error"]


def test_unknown_paths_get_404(served):
  _, url = served
  assert raw_request(url, "GET", "/nope")[0] == 404
  assert raw_request(url, "POST", "/search", {"queries": []})[0] == 404
  assert raw_request(url, "PUT", "/nope", b"x")[0] == 404


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/retrieve", "POST"), ("POST", "/health", "GET"), ("PUT", "/retrieve", "POST"),
    ("DELETE", "/health?x=1", "GET"),
])
def test_wrong_method_gets_405_with_allow(served, method, path, allow):
  _, url = served
  body = {"queries": ["x"]} if method in ("POST", "PUT") else None
  status, reply, headers = raw_request(url, method, path, body, with_headers=True)
  assert status == 405 and headers["Allow"] == allow
  assert reply["field"] == "<method>" and allow in reply["error"]


def test_concurrent_clients_get_their_own_answers(local, served):
  _, url = served
  questions = [q.question for q in qa.load_bundled_questions()[:16]]
  expected = local.search(questions, 3)
  got, errors = [None] * len(questions), []

  def worker(i):
    try:
      got[i] = http_client.HttpRetriever(url, timeout_s=20).search([questions[i]], 3)[0]
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(questions))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert not errors and got == expected


def test_empty_batch_makes_no_request():
  client = http_client.HttpRetriever("http://127.0.0.1:9/retrieve", timeout_s=0.2)
  assert client.search([], 3) == []  # port 9 would refuse; no request is made
  with pytest.raises(ValueError, match="topk"):
    client.search(["x"], 0)


# --- reply parsing ----------------------------------------------------------------------


def test_parse_reply_accepts_every_search_r1_form():
  with_scores = {"result": [[{"document": {"id": "1", "contents": '"T"\nx'}, "score": 2.5}]]}
  no_scores = {"result": [[{"id": 7, "contents": '"T"\nx'}], []]}
  title_text = [[{"document": {"id": "2", "title": "Evan Morris", "text": "He was."},
                  "score": 1}]]
  assert http_client.parse_reply(with_scores, 1) == [[base.Passage("1", '"T"\nx', 2.5)]]
  assert http_client.parse_reply(no_scores, 2) == [[base.Passage("7", '"T"\nx', 0.0)], []]
  assert http_client.parse_reply(title_text, 1) == [
      [base.Passage("2", '"Evan Morris"\nHe was.', 1.0)]]


@pytest.mark.parametrize("payload,problem", [
    ({"results": []}, "no 'result'"),
    ({"result": [[]]}, "1 result lists for 2"),
    ({"result": [{}, []]}, r"result\[0\]"),
    ({"result": [[3], []]}, "JSON object"),
    ({"result": [[{"id": "1"}], []]}, "contents"),
    ({"result": [[{"document": {"contents": "x"}, "score": "high"}], []]}, "score"),
])
def test_parse_reply_rejects_malformed_shapes(payload, problem):
  with pytest.raises(ValueError, match=problem):
    http_client.parse_reply(payload, 2)


# --- CLI ------------------------------------------------------------------------------


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
    env.pop(k, None)
  return env


def _read_line(proc, timeout_s):
  """First stdout line of ``proc`` within ``timeout_s`` seconds ('' if none)."""
  out = []
  reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
  reader.start()
  reader.join(timeout_s)
  return out[0] if out else ""


def test_cli_serves_a_corpus_file_as_a_subprocess(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text(
      '{"id": "0", "contents": "\\"Evan Morris\\"\\nEvan Morris was a lobbyist."}\n'
      '{"id": "1", "contents": "\\"Oslo\\"\\nOslo is the capital of Norway."}\n')
  proc = subprocess.Popen(
      [sys.executable, "-m", "gigrl.cli.serve_retriever", "--corpus", str(corpus),
       "--port", "0", "--host", "127.0.0.1", "--topk", "1"],
      cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    line = _read_line(proc, 60)
    assert line.startswith("serving 2 docs on http://127.0.0.1:"), (
        line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
    url = line.split(" on ")[1].strip()
    assert url.endswith("/retrieve")
    assert raw_request(url, "GET", "/health")[1] == {"status": "ok", "num_docs": 2}
    got = http_client.HttpRetriever(url, timeout_s=10).search(["capital of Norway"], 1)
    assert [p.id for p in got[0]] == ["1"]
    status, body = raw_request(url, "POST", "/retrieve", {"queries": ["Evan Morris"]})
    assert status == 200 and [d["id"] for d in body["result"][0]] == ["0"]  # --topk 1
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


def test_cli_rejects_a_bad_corpus_and_bad_flags(tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": "0"}\n')
  with pytest.raises(SystemExit) as e:
    serve_cli.run(["--corpus", str(bad), "--port", "0"])
  assert e.value.code == 2
  assert "bad.jsonl:1: field 'contents'" in capsys.readouterr().err
  for argv in (["--topk", "0"], ["--port", "70000"], ["--port", "x"]):
    with pytest.raises(SystemExit) as e:
      serve_cli.run(argv)
    assert e.value.code == 2
  with pytest.raises(SystemExit) as e:
    serve_cli.run(["--corpus", str(tmp_path / "missing.jsonl"), "--port", "0"])
  assert e.value.code == 2


def test_cli_port_in_use_is_one_line(tmp_path, capsys):
  corpus = tmp_path / "c.jsonl"
  corpus.write_text('{"id": "0", "contents": "\\"T\\"\\ntext"}\n')
  srv, url = server.serve_in_thread(bm25.BM25Retriever([qa.Document("0", '"T"\ntext')]))
  port = urllib.parse.urlsplit(url).port
  try:
    with pytest.raises(SystemExit) as e:
      serve_cli.run(["--corpus", str(corpus), "--port", str(port)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gigrl-serve-retriever: error: cannot listen on 127.0.0.1:{port}")
    assert len(err.splitlines()) == 1
  finally:
    srv.shutdown()
    srv.server_close()
