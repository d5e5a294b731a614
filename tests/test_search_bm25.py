"""In-process BM25 retriever, the retriever interface and the ``search`` config."""
import json
import os
import threading
import time

import numpy as np
import pytest

from gigrl.config_utils import ConfigError
from gigrl.data import qa
from gigrl.search import base, bm25, config, resilient
from gigrl.search.base import SearchError

TINY = [
    qa.Document("a", '"Paris"\nParis is the capital of France.'),
    qa.Document("b", '"Berlin"\nBerlin is the capital of Germany. Berlin Berlin.'),
    qa.Document("c", '"Twin one"\nA twin passage about zebras.'),
    qa.Document("d", '"Twin two"\nA twin passage about zebras.'),
    qa.Document("e", '"Rome"\nRome is in Italy.'),
]


@pytest.fixture(scope="module")
def bundled():
  docs = qa.load_bundled_corpus()
  t0 = time.perf_counter()
  retriever = bm25.BM25Retriever(docs)
  return docs, retriever, time.perf_counter() - t0


@pytest.fixture(scope="module")
def tiny():
  return bm25.BM25Retriever(TINY)


def test_bundled_index_builds_quickly(bundled):
  docs, retriever, seconds = bundled
  assert retriever.num_docs == len(docs) > 10_000
  assert seconds < 20.0, f"index build took {seconds:.1f} s"


def test_passage_contents_find_their_own_passage(bundled):
  docs, retriever, _ = bundled
  picks = [docs[i] for i in range(0, len(docs), len(docs) // 16)][:16]
  results = retriever.search([d.contents for d in picks], 3)
  assert len(results) == len(picks)
  for doc, res in zip(picks, results):
    assert len(res) == 3
    assert res[0].contents == doc.contents  # the passage itself (or an identical copy)
    assert [p.score for p in res] == sorted((p.score for p in res), reverse=True)
    assert all(isinstance(p, base.Passage) and isinstance(p.score, float) for p in res)


def test_bundled_questions_retrieve_positive_scores_in_order(bundled):
  _, retriever, _ = bundled
  questions = [q.question for q in qa.load_bundled_questions()[:32]]
  results = retriever.search(questions, 3)
  assert len(results) == 32
  for res in results:
    assert 1 <= len(res) <= 3 and all(p.score > 0 for p in res)
  # Query order is kept: searching one by one gives the same lists.
  assert [retriever.search([q], 3)[0] for q in questions[:5]] == results[:5]


def test_ranking_on_tiny_corpus(tiny):
  [paris], [berlin] = tiny.search(["capital of France"], 2), tiny.search(["Berlin"], 5)
  assert [p.id for p in paris] == ["a", "b"]  # France only in a; capital in a and b
  assert [p.id for p in berlin] == ["b"]  # only b mentions Berlin
  assert paris[0].score > paris[1].score > 0


def test_ties_break_by_corpus_order_deterministically(tiny):
  res = tiny.search(["zebras"], 2)[0]
  assert [p.id for p in res] == ["c", "d"] and res[0].score == res[1].score
  assert tiny.search(["zebras"], 1)[0] == res[:1]
  reordered = bm25.BM25Retriever([TINY[3], TINY[2]] + TINY[:2])
  assert [p.id for p in reordered.search(["zebras"], 2)[0]] == ["d", "c"]


def test_top_indices_keeps_boundary_ties_by_index():
  scores = np.array([0.0, 2.0, 1.0, 2.0, 1.0, 1.0, 3.0], np.float32)
  assert top_list(scores, 3) == [6, 1, 3]
  assert top_list(scores, 4) == [6, 1, 3, 2]
  assert top_list(scores, 10) == [6, 1, 3, 2, 4, 5]  # zero scores are dropped
  assert top_list(np.zeros(4, np.float32), 2) == []


def top_list(scores, k):
  return bm25.top_indices(scores, k).tolist()


@pytest.mark.parametrize("query", ["", "   ", "\n\t", "the of and", "qqqzzzunknown"])
def test_empty_stopword_and_unknown_queries_give_empty_lists(tiny, query):
  res = tiny.search([query, "Rome"], 3)
  assert res[0] == [] and [p.id for p in res[1]] == ["e"]


def test_empty_batch_and_bad_arguments(tiny):
  assert tiny.search([], 3) == []
  for topk in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="topk"):
      tiny.search(["Rome"], topk)
  with pytest.raises(ValueError, match="strings"):
    tiny.search([None], 3)
  with pytest.raises(ValueError, match="non-empty"):
    bm25.BM25Retriever([])


def test_concurrent_searches_match_sequential(bundled):
  _, retriever, _ = bundled
  questions = [q.question for q in qa.load_bundled_questions()[:24]]
  expected = retriever.search(questions, 3)
  got = [None] * len(questions)

  def worker(i):
    got[i] = retriever.search([questions[i]], 3)[0]

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(questions))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert got == expected


def _write_corpus(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)


def test_from_corpus_file_and_bad_rows(tmp_path):
  good = _write_corpus(tmp_path / "c.jsonl", [
      {"id": 7, "contents": '"Oslo"\nOslo is in Norway.'},
      {"id": "8", "contents": '"Lima"\nLima is in Peru.'}])
  r = bm25.BM25Retriever.from_corpus(good)
  assert r.num_docs == 2 and r.search(["Peru"], 3)[0][0].id == "8"
  bad = _write_corpus(tmp_path / "bad.jsonl", [{"id": "1", "text": "no contents"}])
  with pytest.raises(qa.DataError, match=r"bad.jsonl:1: field 'contents'"):
    bm25.BM25Retriever.from_corpus(bad)


def test_index_cache_saves_then_loads_the_same_index(tmp_path, monkeypatch):
  """A first build saves the index under a key of the text; a second build of the same corpus
  loads it (indexing is not called) and ranks identically; other text or parameters get another
  key; a broken entry is rebuilt; no cache dir means no files."""
  cache = str(tmp_path / "cache")
  first = bm25.BM25Retriever(TINY, cache_dir=cache)
  assert not first.loaded_from_cache
  (key,) = os.listdir(cache)
  assert key == bm25.index_key([d.contents for d in TINY], 0.9, 0.4)

  def no_indexing(*a, **k):
    raise AssertionError("indexed again instead of loading the cache")

  with monkeypatch.context() as m:
    m.setattr(bm25.bm25s.BM25, "index", no_indexing)
    second = bm25.BM25Retriever(TINY, cache_dir=cache)
  assert second.loaded_from_cache
  for q in ("capital", "zebras twin", "Berlin Italy", "nothing here"):
    assert second.search([q], 5) == first.search([q], 5), q
  other = TINY[:-1] + [qa.Document("e", '"Rome"\nRome is in Lazio.')]
  assert bm25.index_key([d.contents for d in other], 0.9, 0.4) != key
  assert bm25.index_key([d.contents for d in TINY], 1.2, 0.4) != key
  # a broken entry (a missing array) is rebuilt and replaced
  os.remove(os.path.join(cache, key, "data.csc.index.npy"))
  third = bm25.BM25Retriever(TINY, cache_dir=cache)
  assert not third.loaded_from_cache and third.search(["capital"], 5) == first.search(["capital"], 5)
  assert bm25.BM25Retriever(TINY, cache_dir=cache).loaded_from_cache
  assert os.listdir(cache) == [key]                  # no temporary directories left behind
  before = set(os.listdir(tmp_path))
  bm25.BM25Retriever(TINY)
  assert set(os.listdir(tmp_path)) == before
  assert bm25.resolve_cache_dir("") is None
  monkeypatch.setenv("GIGRL_CACHE_DIR", str(tmp_path / "g"))
  assert bm25.resolve_cache_dir("auto") == str(tmp_path / "g" / "bm25")
  assert bm25.resolve_cache_dir("~/x") == os.path.expanduser("~/x")


def test_empty_corpus_names_the_file(tmp_path):
  empty = _write_corpus(tmp_path / "empty.jsonl", [])
  with pytest.raises(qa.DataError, match=r"empty.jsonl: no passages \(the corpus is empty\)"):
    bm25.BM25Retriever.from_corpus(empty)
  cfg = config.default_config()
  cfg.corpus = empty
  with pytest.raises(ConfigError, match="empty.jsonl") as e:
    config.validate(cfg)          # caught at start-up, before the index is built
  assert e.value.field == "search.corpus"


def test_retriever_protocol_and_search_error_message():
  assert isinstance(bm25.BM25Retriever(TINY[:1]), base.Retriever)
  e = base.SearchError("http://127.0.0.1:1/retrieve", "timed out after 0.2 s", attempts=3)
  assert str(e) == ("search request at http://127.0.0.1:1/retrieve failed after 3 "
                    "attempts: timed out after 0.2 s")


# --- config ---------------------------------------------------------------------------


def test_default_config_validates_and_has_search_r1_defaults():
  cfg = config.default_config()
  config.validate(cfg)
  assert (cfg.backend, cfg.topk, cfg.on_failure, cfg.cache, cfg.corpus) == (
      "bm25", 3, "raise", True, "bundled")
  assert cfg.url == "http://127.0.0.1:8000/retrieve"


@pytest.mark.parametrize("field,value", [
    ("backend", "faiss"), ("topk", 0), ("topk", 2.5), ("timeout_s", 0.0),
    ("max_retries", -1), ("max_retries", 100), ("backoff_s", -0.1),
    ("on_failure", "ignore"), ("cache", "yes"), ("corpus", "/nonexistent/c.jsonl"),
    ("corpus", ""), ("corpus", "/tmp"), ("max_failure_frac", 1.5), ("max_failure_frac", -0.1),
])
def test_validate_names_the_bad_field(field, value):
  cfg = config.default_config().to_dict()  # a plain dict: ConfigDict refuses type changes
  config.validate(cfg)
  cfg[field] = value
  with pytest.raises(ConfigError) as e:
    config.validate(cfg)
  assert e.value.field == f"search.{field}"


@pytest.mark.parametrize("url", ["", "127.0.0.1:8000/retrieve", "ftp://x/retrieve"])
def test_validate_http_backend_needs_an_http_url(url):
  cfg = config.default_config()
  cfg.backend, cfg.url, cfg.corpus = "http", url, "/not/checked/for/http"
  with pytest.raises(ConfigError) as e:
    config.validate(cfg)
  assert e.value.field == "search.url"
  cfg.url = "http://127.0.0.1:8000/retrieve"
  config.validate(cfg)


def test_make_retriever_builds_each_backend(tmp_path):
  cfg = config.default_config()
  cfg.corpus = _write_corpus(tmp_path / "c.jsonl", [{"id": "1", "contents": '"X"\nzebra'}])
  cfg.max_retries, cfg.on_failure, cfg.cache = 1, "empty", False
  r = config.make_retriever(cfg)
  assert isinstance(r, resilient.ResilientRetriever)
  assert isinstance(r.inner, bm25.BM25Retriever)
  assert (r.max_retries, r.on_failure, r.use_cache) == (1, "empty", False)
  assert r.search(["zebra"], 3)[0][0].id == "1"
  cfg.backend, cfg.url, cfg.timeout_s = "http", "http://127.0.0.1:9/retrieve", 0.5
  cfg.max_failure_frac = 0.25
  h = config.make_retriever(cfg, health_check=False)
  assert type(h.inner).__name__ == "HttpRetriever"
  assert (h.inner.url, h.inner.timeout_s) == ("http://127.0.0.1:9/retrieve", 0.5)
  assert h.max_failure_frac == 0.25
  with pytest.raises(SearchError, match="127.0.0.1:9/retrieve failed its health check"):
    config.make_retriever(cfg)    # nobody listens on port 9: stop before anything is built
  cfg.topk = 0
  with pytest.raises(ConfigError, match="search.topk"):
    config.make_retriever(cfg)
