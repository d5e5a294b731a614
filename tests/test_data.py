"""Data loaders: formats, errors naming file/line/field, the fixed split, TFDS round trip."""
import json

import pytest

from gigrl.data import qa
from gigrl.data import tfds_qa


def _write(tmp_path, name, lines):
  p = tmp_path / name
  p.write_text("\n".join(lines) + "\n")
  return str(p)


def test_bundled_data_loads():
  corpus = qa.load_bundled_corpus()
  questions = qa.load_bundled_questions()
  assert len(corpus) == 11103 + 457 + 1008          # + countries (4 per country)
  assert len({d.id for d in corpus}) == len(corpus)
  assert len(questions) == 500 + 500 + 125 + 89 + 4842
  assert all(q.golden_answers for q in questions)
  title, text = qa.split_title(corpus[0].contents)
  assert title == "1973 Pro Bowl" and text.startswith("The 1973 Pro Bowl")


@pytest.mark.parametrize("line,field", [
    ('{"question": "q?", "golden_answers": []}', "golden_answers"),
    ('{"question": "", "golden_answers": ["a"]}', "question"),
    ('{"golden_answers": ["a"]}', "question"),
    ('{"question": "q?"}', "golden_answers"),
    ('{"question": "q?", "golden_answers": "a"}', "golden_answers"),
    ('{"question": "q?", "golden_answers": [1]}', "golden_answers"),
    ('not json', "<json>"),
    ('[1, 2]', "<row>"),
])
def test_bad_question_row_names_file_line_field(tmp_path, line, field):
  good = '{"question": "Who?", "golden_answers": ["me"]}'
  path = _write(tmp_path, "q.jsonl", [good, good, line])
  with pytest.raises(qa.DataError) as e:
    qa.load_questions(path)
  assert e.value.path == path and e.value.line == 3 and e.value.field == field
  assert f"{path}:3" in str(e.value) and field in str(e.value)


def test_r1searcher_answer_format_accepted(tmp_path):
  path = _write(tmp_path, "r.jsonl", ['{"idx": 7, "question": "Q", "answer": "A"}'])
  (q,) = qa.load_questions(path)
  assert q.id == "7" and q.golden_answers == ("A",) and q.data_source == "r"


@pytest.mark.parametrize("line,field", [
    ('{"contents": "x"}', "id"),
    ('{"id": "1", "contents": ""}', "contents"),
    ('{"id": "0", "contents": "dup"}', "id"),
])
def test_bad_corpus_row(tmp_path, line, field):
  path = _write(tmp_path, "c.jsonl", ['{"id": "0", "contents": "\\"T\\"\\ntext"}', line])
  with pytest.raises(qa.DataError) as e:
    qa.load_corpus(path)
  assert e.value.line == 2 and e.value.field == field


def test_split_is_fixed_and_disjoint():
  qs = qa.load_bundled_questions()
  train, ev = qa.split_questions(qs, 10)
  train2, ev2 = qa.split_questions(list(reversed(qs)), 10)
  assert {q.id for q in ev} == {q.id for q in ev2}
  assert not ({qa.normalize_answer(q.question) for q in train}
              & {qa.normalize_answer(q.question) for q in ev})
  assert all(q.data_source != "bamboogle" for q in train)
  assert 0.05 < len([q for q in ev if q.data_source != "bamboogle"]) / len(qs) < 0.15


def test_tfds_round_trip_user_file(tmp_path):
  rows = [{"id": f"u{i}", "question": f"Question number {i}?", "golden_answers": [f"a{i}"],
           "data_source": "mine"} for i in range(40)]
  rows[3]["hop_queries"] = ["first hop?", "second hop?"]
  path = _write(tmp_path, "mine.jsonl", [json.dumps(r) for r in rows])
  builder = tfds_qa.build(str(tmp_path / "tfds"), [path], eval_percent=25)
  train = tfds_qa.read_split(builder, "train")
  ev = tfds_qa.read_split(builder, "eval")
  assert len(train) + len(ev) == 40 and ev
  assert {q.id for q in train + ev} == {r["id"] for r in rows}
  got = {q.id: q for q in train + ev}
  assert got["u3"].golden_answers == ("a3",) and got["u3"].question == "Question number 3?"
  assert got["u3"].hop_queries == ("first hop?", "second hop?") and got["u4"].hop_queries == ()
  assert builder.info.file_format.value == "array_record"


def test_tfds_build_reports_bad_row(tmp_path):
  path = _write(tmp_path, "bad.jsonl", ['{"question": "ok?", "golden_answers": ["a"]}',
                                        '{"question": "no answers"}'])
  with pytest.raises(qa.DataError, match=r"bad.jsonl:2: field 'golden_answers'"):
    tfds_qa.build(str(tmp_path / "tfds"), [path])


@pytest.mark.parametrize("loader,what", [(qa.load_questions, "no questions"),
                                         (qa.load_corpus, "no passages")])
def test_a_file_without_rows_names_the_file(tmp_path, loader, what):
  path = _write(tmp_path, "blank.jsonl", ["", "   "])
  with pytest.raises(qa.DataError) as e:
    loader(path)
  assert str(e.value).startswith(f"{path}: {what}")
  assert (e.value.path, e.value.line, e.value.field) == (path, 0, "<file>")


def test_bundled_sets_table():
  assert qa.BUNDLED_QUESTION_FILES == tuple(s.questions for s in qa.BUNDLED_SETS)
  assert [c for c, _ in qa.BUNDLED_CORPUS_FILES] == sorted(
      {s.corpus for s in qa.BUNDLED_SETS}, key=[s.corpus for s in qa.BUNDLED_SETS].index)
  assert qa.EVAL_ONLY_SOURCES == ("bamboogle",)
  assert set(qa.TRAIN_SOURCES) >= {"hotpotqa", "2wikimultihopqa", "musique", "iirc"}
  with pytest.raises(qa.ConfigError, match="unknown: nosuchset") as e:
    qa.check_train_sources("hotpotqa,nosuchset")
  assert e.value.field == "data.train_sources"
