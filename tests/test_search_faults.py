"""Fault injection: dead server, slow replies, garbage replies, retries, cache (loopback only)."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gigrl.data import qa
from gigrl.search import base, bm25, http_client, resilient, server

TIMEOUT_S = 0.2
CORPUS = [
    qa.Document("p", '"Paris"\nParis is the capital of France.'),
    qa.Document("b", '"Berlin"\nBerlin is the capital of Germany.'),
    qa.Document("r", '"Rome"\nRome is the capital of Italy.'),
]
GOOD_REPLY = {"result": [[{"document": {"id": "p", "contents": '"Paris"\nx'}, "score": 1.0}]]}


class FakeServer:
  """A loopback server whose replies come from ``behave(n) -> (status, body bytes, delay_s)``.

  ``n`` counts requests from 0. Sleeping handlers wake early when the server stops.
  """

  def __init__(self, behave):
    self.behave, self.requests, self.stop_event = behave, 0, threading.Event()
    fake = self

    class Handler(BaseHTTPRequestHandler):
      def log_message(self, *args):
        del args

      def do_POST(self):  # pylint: disable=invalid-name
        self.rfile.read(int(self.headers["Content-Length"]))
        n, fake.requests = fake.requests, fake.requests + 1
        status, body, delay = fake.behave(n)
        if delay:
          fake.stop_event.wait(delay)
        try:
          self.send_response(status)
          self.send_header("Content-Length", str(len(body)))
          self.end_headers()
          self.wfile.write(body)
        except OSError:
          pass  # the client gave up (timeout)

    self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"

  def close(self):
    self.stop_event.set()
    self.server.shutdown()
    self.server.server_close()


@pytest.fixture
def fake_server():
  servers = []

  def start(behave):
    servers.append(FakeServer(behave))
    return servers[-1]

  yield start
  for s in servers:
    s.close()


class Recorder:
  """An inner retriever that records batches; fails the first ``fail`` calls."""

  def __init__(self, fail=0, retryable=True):
    self.batches, self.fail, self.retryable = [], fail, retryable

  def search(self, queries, topk):
    self.batches.append(list(queries))
    if len(self.batches) <= self.fail:
      raise base.SearchError("fake://", "injected", retryable=self.retryable)
    return [[base.Passage(q, f"doc for {q}", float(topk))] for q in queries]


def dead_url():
  """A loopback URL nobody listens on (a port just freed)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  return f"http://127.0.0.1:{port}/retrieve"


def wrap(url, on_failure, max_retries=2, backoff_s=0.01, cache=True, max_failure_frac=1.0):
  inner = http_client.HttpRetriever(url, timeout_s=TIMEOUT_S)
  return resilient.ResilientRetriever(inner, max_retries=max_retries, backoff_s=backoff_s,
                                      on_failure=on_failure, cache=cache,
                                      max_failure_frac=max_failure_frac)


# --- server killed mid-run ------------------------------------------------------------


@pytest.mark.parametrize("on_failure", ["empty", "raise"])
def test_server_killed_mid_run(on_failure):
  srv, url = server.serve_in_thread(bm25.BM25Retriever(CORPUS), "127.0.0.1", 0)
  r = wrap(url, on_failure)
  try:
    first = r.search(["capital of France"], 1)
    assert [p.id for p in first[0]] == ["p"]
  finally:
    srv.shutdown()
    srv.server_close()
  t0 = time.perf_counter()
  if on_failure == "empty":
    got = r.search(["capital of Germany", "capital of Italy", "capital of France"], 1)
    # The cached query keeps its answer; the batch that failed is empty.
    assert got == [[], [], first[0]]
    assert r.search(["capital of Germany"], 1) == [[]]  # failures are not cached
    m = r.metrics()
    assert (m["search_failures"], m["failed_queries"]) == (2, 3)
    assert (m["requests"], m["retries"], m["cache_hits"]) == (1 + 3 + 3, 4, 1)
  else:
    with pytest.raises(base.SearchError) as e:
      r.search(["capital of Germany"], 1)
    msg = str(e.value)
    assert url in msg and "after 3 attempts" in msg and "connection failed" in msg
    assert e.value.attempts == 3 and r.metrics()["search_failures"] == 0
  assert time.perf_counter() - t0 < 5.0


def test_refused_connection_is_retried_with_exponential_backoff():
  sleeps = []
  r = resilient.ResilientRetriever(
      http_client.HttpRetriever(dead_url(), timeout_s=TIMEOUT_S),
      max_retries=3, backoff_s=0.05, on_failure="empty", max_failure_frac=1.0,
      sleep=sleeps.append)
  assert r.search(["a", "b"], 3) == [[], []]
  assert sleeps == [0.05, 0.1, 0.2]
  assert r.metrics() == {"queries": 2, "search_failures": 1, "failed_queries": 2,
                         "cache_hits": 0, "requests": 4, "retries": 3}
  r.reset_metrics()
  assert set(r.metrics().values()) == {0}


# --- slow and garbage replies ---------------------------------------------------------


def test_reply_slower_than_timeout_times_out_within_bounded_time(fake_server):
  slow = fake_server(lambda n: (200, json.dumps(GOOD_REPLY).encode(), 5.0))
  r = wrap(slow.url, "raise", max_retries=1, backoff_s=0.01)
  t0 = time.perf_counter()
  with pytest.raises(base.SearchError) as e:
    r.search(["capital of France"], 1)
  elapsed = time.perf_counter() - t0
  assert f"timed out after {TIMEOUT_S} s" in str(e.value) and e.value.attempts == 2
  assert slow.requests == 2
  assert 2 * TIMEOUT_S <= elapsed < 2.0, elapsed


def test_slow_then_fast_reply_recovers(fake_server):
  flaky = fake_server(lambda n: (200, json.dumps(GOOD_REPLY).encode(), 5.0 if n == 0 else 0))
  r = wrap(flaky.url, "raise")
  got = r.search(["capital of France"], 1)
  assert [p.id for p in got[0]] == ["p"]
  assert (r.metrics()["retries"], r.metrics()["search_failures"]) == (1, 0)


@pytest.mark.parametrize("status,body,what", [
    (200, b"<html>definitely not json</html>", "not JSON"),
    (200, b'{"result": [[], []]}', "2 result lists for 1 queries"),
    (200, b'{"result": [[{"document": {"id": "1"}, "score": 1}]]}', "contents"),
    (500, b"<html>Internal Server Error</html>", "HTTP 500"),
    (503, b"{}", "HTTP 503"),
])
def test_garbage_and_5xx_replies_are_retried_then_fail(fake_server, status, body, what):
  bad = fake_server(lambda n: (status, body, 0))
  r = wrap(bad.url, "raise", max_retries=2)
  with pytest.raises(base.SearchError, match=what) as e:
    r.search(["capital of France"], 1)
  assert bad.requests == 3 and e.value.attempts == 3 and e.value.retryable
  empty = wrap(bad.url, "empty", max_retries=1)
  assert empty.search(["q1", "q2", "q3"], 1) == [[], [], []]
  assert empty.metrics()["search_failures"] == 1 and empty.metrics()["requests"] == 2


def test_4xx_is_not_retried(fake_server):
  bad = fake_server(lambda n: (400, b'{"error": "field \'topk\': bad", "field": "topk"}', 0))
  r = wrap(bad.url, "raise", max_retries=3)
  with pytest.raises(base.SearchError, match="HTTP 400.*topk") as e:
    r.search(["x"], 1)
  assert bad.requests == 1 and e.value.attempts == 1 and not e.value.retryable


def test_transient_5xx_then_success(fake_server):
  flaky = fake_server(lambda n: (503, b"busy", 0) if n < 2 else
                      (200, json.dumps(GOOD_REPLY).encode(), 0))
  r = wrap(flaky.url, "raise", max_retries=2)
  assert [p.id for p in r.search(["capital of France"], 1)[0]] == ["p"]
  assert r.metrics() == {"queries": 1, "search_failures": 0, "failed_queries": 0,
                         "cache_hits": 0, "requests": 3, "retries": 2}


def test_zero_retries_fails_on_first_error():
  r = resilient.ResilientRetriever(Recorder(fail=1), max_retries=0, on_failure="raise",
                                   sleep=lambda s: None)
  with pytest.raises(base.SearchError, match="after 1 attempt: injected"):
    r.search(["x"], 1)


# --- cache ----------------------------------------------------------------------------


def test_duplicates_in_a_batch_are_sent_once():
  inner = Recorder()
  r = resilient.ResilientRetriever(inner, on_failure="raise")
  got = r.search(["a", "b", "a", "a", "c"], 2)
  assert inner.batches == [["a", "b", "c"]]
  assert [res[0].id for res in got] == ["a", "b", "a", "a", "c"]
  assert r.metrics()["cache_hits"] == 2


def test_per_step_cache_and_new_step():
  inner = Recorder()
  r = resilient.ResilientRetriever(inner, on_failure="raise")
  r.search(["a", "b"], 2)
  assert [res[0].id for res in r.search(["b", "c"], 2)] == ["b", "c"]
  assert inner.batches == [["a", "b"], ["c"]]
  r.search(["a"], 3)  # topk is part of the key
  assert inner.batches[-1] == ["a"]
  r.new_step()
  r.search(["a", "b"], 2)
  assert inner.batches[-1] == ["a", "b"]
  assert r.metrics()["cache_hits"] == 1 and r.metrics()["requests"] == 4


def test_cache_off_sends_every_batch_but_still_dedupes_it():
  inner = Recorder()
  r = resilient.ResilientRetriever(inner, on_failure="raise", cache=False)
  r.search(["a", "a"], 2)
  r.search(["a"], 2)
  assert inner.batches == [["a"], ["a"]]


def test_results_are_copies_so_callers_cannot_poison_the_cache():
  r = resilient.ResilientRetriever(Recorder(), on_failure="raise")
  r.search(["a"], 1)[0].clear()
  assert len(r.search(["a"], 1)[0]) == 1


def test_bad_arguments():
  with pytest.raises(ValueError, match="on_failure"):
    resilient.ResilientRetriever(Recorder(), on_failure="ignore")
  with pytest.raises(ValueError, match="max_retries"):
    resilient.ResilientRetriever(Recorder(), max_retries=-1)
  with pytest.raises(ValueError, match="backoff_s"):
    resilient.ResilientRetriever(Recorder(), backoff_s=-1.0)
  with pytest.raises(ValueError, match="topk"):
    resilient.ResilientRetriever(Recorder()).search(["a"], 0)
  with pytest.raises(ValueError, match="max_failure_frac"):
    resilient.ResilientRetriever(Recorder(), max_failure_frac=1.5)


# --- failures are never silent (on_failure='empty') ------------------------------------


class Flaky:
  """An inner retriever whose call ``i`` fails when ``i in failing`` (not retryable)."""

  def __init__(self, failing):
    self.calls, self.failing = 0, set(failing)

  def search(self, queries, topk):
    self.calls += 1
    if self.calls - 1 in self.failing:
      raise base.SearchError("fake://", "injected", retryable=False)
    return [[base.Passage(q, q, 1.0)] for q in queries]


def test_failed_share_of_a_step_past_the_bound_stops_the_run():
  # call 0 fails: 2 of 2 queries (100% > 50%) -> stop, naming the field and the share.
  r = resilient.ResilientRetriever(Flaky({0}), on_failure="empty", max_failure_frac=0.5)
  with pytest.raises(resilient.TooManySearchFailures, match=(
      r"2 of 2 search queries of this step failed \(100%, more than "
      r"search.max_failure_frac=0.5\); last error: .*injected")) as e:
    r.search(["a", "b"], 1)
  assert isinstance(e.value, base.SearchError) and (e.value.failed, e.value.asked) == (2, 2)


def test_failed_share_is_counted_per_step():
  # Calls 0-2 succeed (6 queries), call 3 fails (2 queries): 2/8 = 25% <= 30%, one warning.
  r = resilient.ResilientRetriever(Flaky({3, 5}), on_failure="empty", max_failure_frac=0.3)
  for batch in (["a", "b"], ["c", "d"], ["e", "f"]):
    r.search(batch, 1)
  assert r.search(["g", "h"], 1) == [[], []]
  r.new_step()                      # a new step: its share starts from 0
  r.search(["i", "j"], 1)           # call 4 succeeds: 0 of 2
  with pytest.raises(resilient.TooManySearchFailures, match="2 of 4"):
    r.search(["k", "l"], 1)         # call 5 fails: 2 of 4 = 50% > 30%
  m = r.metrics()
  assert (m["queries"], m["failed_queries"], m["search_failures"]) == (12, 4, 2)


def test_every_step_with_failures_warns_once(monkeypatch):
  warnings = []
  monkeypatch.setattr(resilient.logging, "warning",
                      lambda msg, *args: warnings.append(msg % args))
  r = resilient.ResilientRetriever(Flaky({1, 2, 5}), on_failure="empty",
                                   max_failure_frac=1.0)
  r.search(["a"], 1)
  r.search(["b"], 1)                # fails: warning 1
  r.search(["c", "c"], 1)           # fails again in the same step: no second warning
  assert len(warnings) == 1
  assert "1 of 2 queries of this step" in warnings[0] and "injected" in warnings[0]
  assert "search.max_failure_frac=1.0" in warnings[0]
  r.new_step()
  r.search(["d"], 1)
  r.search(["e"], 1)                # call 4 succeeds: no warning in this step
  assert len(warnings) == 1
  r.new_step()
  r.search(["f"], 1)                # call 5 fails: the next step warns again
  assert len(warnings) == 2 and "1 of 1" in warnings[1]
  assert r.metrics()["failed_queries"] == 1 + 2 + 1   # repeats included


def test_on_failure_raise_ignores_the_bound():
  r = resilient.ResilientRetriever(Flaky({0}), on_failure="raise", max_failure_frac=0.0)
  with pytest.raises(base.SearchError) as e:
    r.search(["a"], 1)
  assert not isinstance(e.value, resilient.TooManySearchFailures)


def test_health_check_fails_on_a_dead_server_whatever_the_policy():
  sleeps = []
  r = resilient.ResilientRetriever(
      http_client.HttpRetriever(dead_url(), timeout_s=TIMEOUT_S), max_retries=2,
      backoff_s=0.01, on_failure="empty", sleep=sleeps.append)
  with pytest.raises(base.SearchError,
                     match=r"failed its health check \(3 attempts\): connection failed") as e:
    r.health_check()
  assert e.value.attempts == 3 and sleeps == [0.01, 0.02]
  assert set(r.metrics().values()) == {0}     # not counted


def test_health_check_passes_on_a_live_server():
  srv, url = server.serve_in_thread(bm25.BM25Retriever(CORPUS), "127.0.0.1", 0)
  try:
    r = wrap(url, "empty")
    r.health_check()
    assert set(r.metrics().values()) == {0}
  finally:
    srv.shutdown()
    srv.server_close()


def test_backend_none_is_closed_book():
  """search.backend='none' (the closed-book baseline): every query gets no passage, and the
  observation is an empty <information> block; no corpus is read."""
  from gigrl.search import config as search_config  # pylint: disable=g-import-not-at-top
  from gigrl.rollout import trajectory  # pylint: disable=g-import-not-at-top
  cfg = search_config.default_config()
  cfg.backend = "none"
  cfg.corpus = "/no/such/corpus.jsonl"          # never read
  r = search_config.make_retriever(cfg)
  assert r.search(["capital of Peru?", "currency of Peru?"], 3) == [[], []]

  class Chars:                                    # a character tokenizer
    def encode(self, text):
      return [ord(c) for c in text]
  ids, anchor = trajectory.observation_ids(Chars(), [], 64)
  assert "".join(map(chr, ids)) == "\n\n<information></information>\n\n" and anchor == ""
