"""The countries task generator: deterministic, answers findable, split by country, 2-hop unique."""
import collections
import json
import os

import pytest

from gigrl.data import countries
from gigrl.data import qa

ROOT = countries.default_dir()
SOURCE = os.path.join(ROOT, countries.SOURCE_FILE)


@pytest.fixture(scope="module")
def generated():
  return countries.generate(SOURCE)


def _read(name):
  with open(os.path.join(ROOT, name), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_deterministic_and_matches_shipped_files(generated):
  corpus, questions = generated
  assert countries.generate(SOURCE) == (corpus, questions)
  assert _read(countries.CORPUS_FILE) == corpus
  assert _read(countries.QUESTIONS_FILE) == questions
  assert countries.main(["--check"]) == 0


def test_shipped_files_load_as_search_r1(generated):
  docs = qa.load_corpus(os.path.join(ROOT, countries.CORPUS_FILE))
  qs = qa.load_questions(os.path.join(ROOT, countries.QUESTIONS_FILE))
  assert len(docs) == len(generated[0]) and len(qs) == len(generated[1])
  assert {q.data_source for q in qs} == {"countries"}
  assert {q.split for q in qs} == {"train", "eval"}
  train, ev = qa.split_questions(qs, eval_percent=50)   # pinned: eval_percent is ignored
  assert {q.id for q in ev} == {r["id"] for r in generated[1] if r["split"] == "eval"}


def test_every_golden_answer_is_in_a_passage_of_the_questions_entity(generated):
  corpus, questions = generated
  by_iso = collections.defaultdict(list)
  for d in corpus:
    by_iso[d["id"].split("-")[1]].append(qa.split_title(d["contents"])[1])
  for q in questions:
    # The final answer is a fact of the chain's last country (the entity the last hop is
    # about), or the name of that country, which titles its passages.
    texts = [t for iso in q["countries"] for t in by_iso[iso]]
    for a in q["golden_answers"]:
      assert any(f" {qa.normalize_answer(a)} " in f" {qa.normalize_answer(t)} " for t in texts), q


def test_heldout_split_shares_no_country_with_training(generated):
  _, questions = generated
  train = {c for q in questions if q["split"] == "train" for c in q["countries"]}
  held = {c for q in questions if q["split"] == "eval" for c in q["countries"]}
  assert train and held and not train & held
  assert all(countries.is_heldout(c) for c in held)
  # No held-out answer is a training answer: memorising training answers scores 0.
  train_answers = {qa.normalize_answer(a) for q in questions if q["split"] == "train"
                   for a in q["golden_answers"]}
  held_answers = {qa.normalize_answer(a) for q in questions if q["split"] == "eval"
                  for a in q["golden_answers"]}
  assert held_answers and not held_answers & train_answers


def test_questions_are_unambiguous(generated):
  _, questions = generated
  by_text = collections.defaultdict(set)
  for q in questions:
    by_text[qa.normalize_answer(q["question"])].add(tuple(q["golden_answers"]))
    for a in q["golden_answers"]:
      assert f" {qa.normalize_answer(a)} " not in f" {qa.normalize_answer(q['question'])} "
  assert all(len(v) == 1 for v in by_text.values())


def test_two_hop_first_answer_is_unique(generated):
  _, questions = generated
  recs = countries.load_countries(SOURCE)
  capitals = collections.Counter(qa.normalize_answer(c.capital) for c in recs.values())
  currencies = collections.Counter(qa.normalize_answer(c.currency_name) for c in recs.values())
  two = [q for q in questions if q["hops"] == 2]
  assert two and {q["hops"] for q in questions} == {1, 2}
  for q in two:
    pivot = q["relation"].split(">")[0]
    first = recs[q["countries"][0]]
    if pivot == "country_of_capital":      # the capital names exactly one country
      assert capitals[qa.normalize_answer(first.capital)] == 1 and first.capital in q["question"]
    elif pivot == "country_of_currency":
      assert currencies[qa.normalize_answer(first.currency_name)] == 1
    else:                                  # the only neighbour: exactly one
      assert pivot == "neighbour" and len(first.neighbours) == 1
      assert q["countries"][1] == first.neighbours[0]


def test_sft_prefix_is_one_hop_and_eval_ids_mix_hops(generated):
  _, questions = generated
  train = sorted((q for q in questions if q["split"] == "train"), key=lambda q: q["id"])
  n1 = sum(q["hops"] == 1 for q in train)
  assert all(q["hops"] == 1 for q in train[:n1]) and all(q["hops"] == 2 for q in train[n1:])
  ev = sorted((q for q in questions if q["split"] == "eval"), key=lambda q: q["id"])
  assert {q["hops"] for q in ev[:50]} == {1, 2}


def test_task_tokenizer_covers_the_task():
  from gigrl.data import tags
  from gigrl.data import tokenizer as tok_lib
  tok = tok_lib.load(os.path.join(ROOT, countries.TOKENIZER_FILE))
  assert tok.vocab_size == countries.TOKENIZER_VOCAB
  assert all(len(tok.encode(t)) == 1 for t in tags.TAGS)
  for d in _read(countries.CORPUS_FILE)[:200]:
    assert tok.decode(tok.encode(d["contents"])) == d["contents"]
  assert len(tok.encode(tags.INSTRUCTION)) < 128


def test_two_hop_queries_name_the_pivot_entity_then_the_bridge_country(generated):
  _, questions = generated
  src = countries.load_countries(SOURCE)
  two_hop = [q for q in questions if q["hops"] == 2]
  assert two_hop and all(len(q["hop_queries"]) == 2 for q in two_hop)
  assert all("hop_queries" not in q for q in questions if q["hops"] == 1)
  for q in two_hop:
    pivot, second = q["relation"].split(">")
    first, then = q["hop_queries"]
    # The first hop's answer is the bridge country: the pivot's own country for
    # capital/currency -> country, the only neighbour for neighbour.
    bridge = src[q["countries"][1] if pivot == "neighbour" else q["countries"][0]]
    assert bridge.name in then, q
    assert first in {t.format(e=e) for t in countries.ONE_HOP_TEMPLATES[pivot]
                     for e in (bridge.capital, bridge.currency_name,
                               src[q["countries"][0]].name)}, q
    assert then in {t.format(e=bridge.name) for t in countries.ONE_HOP_TEMPLATES[second]}, q


# ------------------------------------------------------------------ the validation split (#39)
def test_validation_split_matches_shipped_files(generated):
  _, questions = generated
  trainval, test = countries.validation_split(questions)
  assert _read(countries.TRAINVAL_FILE) == trainval
  assert _read(countries.TEST_FILE) == test
  assert test == [q for q in questions if q["split"] == "eval"]        # test is unchanged


def test_validation_split_is_disjoint_in_countries_and_answers(generated):
  _, questions = generated
  trainval, test = countries.validation_split(questions)
  train = [q for q in trainval if q["split"] == "train"]
  val = [q for q in trainval if q["split"] == "eval"]
  assert all(q["role"] == "validation" and q["id"].startswith("countries-val-") for q in val)
  hops = collections.Counter(q["hops"] for q in val)
  assert len(val) >= 150 and hops[1] >= 50 and hops[2] >= 50, hops
  country = lambda rows: {c for q in rows for c in q["countries"]}
  answers = lambda rows: {qa.normalize_answer(a) for q in rows for a in q["golden_answers"]}
  assert not country(val) & country(train) and not country(val) & country(test)
  assert not answers(val) & answers(train) and not answers(val) & answers(test)
  assert not {qa.normalize_answer(q["question"]) for q in val} & {
      qa.normalize_answer(q["question"]) for q in train + test}
  # one phrasing per question about the same facts, as test has
  facts = collections.Counter((q["relation"], tuple(q["countries"])) for q in val)
  assert max(facts.values()) == 1
  # the training ids keep their order: 1-hop first, so train.sft_questions still picks a prefix
  assert [q["hops"] for q in train] == sorted(q["hops"] for q in train)
  assert len(train) == countries.count_train_questions(
      1, os.path.join(ROOT, countries.TRAINVAL_FILE)) + countries.count_train_questions(
      2, os.path.join(ROOT, countries.TRAINVAL_FILE))


def test_validation_split_rules_each_hold_on_their_own():
  """Each rule of :func:`countries.validation_split` acts alone on rows built to need it (on the
  shipped data the chain rule and the answer rule mask each other: a mixed chain's answer is a
  training answer, so the real-data test above cannot tell when one of them breaks)."""
  val_c, train_c = ["AT", "AV"], ["AA", "AC"]
  assert all(map(countries.is_validation, val_c)) and not any(map(countries.is_validation, train_c))

  def row(n, cs, answer, split="train"):
    return {"id": f"q{n}", "question": f"question {n}?", "golden_answers": [answer],
            "relation": "capital", "countries": cs, "hops": len(cs), "split": split}
  rows = [row(0, ["AA"], "Train City"), row(1, ["AT"], "Val City"),
          row(2, ["AC", "AV"], "Fresh Answer"),            # a mixed chain, unseen answer
          row(3, ["AV"], "train city"),                    # a validation chain, a train answer
          row(4, ["AB"], "Test City", split="eval")]
  trainval, test = countries.validation_split(rows)
  assert [r["id"] for r in test] == ["q4"]
  assert [r["id"] for r in trainval if r["split"] == "train"] == ["q0"]
  val = [r for r in trainval if r["split"] == "eval"]
  assert [r["question"] for r in val] == ["question 1?"], val
