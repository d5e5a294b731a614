"""Search-R1 / FlashRAG data loaders: QA questions and retrieval corpora.

Formats (Search-R1 `scripts/data_process/*.py`, FlashRAG_datasets):
  * questions: one JSON object per line, ``{"question": str, "golden_answers": [str, ...], ...}``
    (``id`` optional; R1-Searcher's ``{"question", "answer": str}`` is accepted too);
  * corpus: one JSON object per line, ``{"id": str, "contents": "\\"Title\\"\\ntext"}``.

An optional ``"split": "train" | "eval"`` pins a question's side of the train/eval split (the
``countries`` set splits by country this way); rows without it are split by hash.

A malformed row raises :class:`DataError` naming the file, the 1-based line and the field; a
file without rows raises it naming the file.

The bundled sets are one table, :data:`BUNDLED_SETS` (question file, corpus file, the
``data_source`` names in it); ``data.train_sources`` is checked against it at start-up
(:func:`check_train_sources`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import string
from importlib import resources
from typing import Iterator, Sequence

from gigrl.config_utils import ConfigError, UserError


class DataError(UserError, ValueError):
  """A data file has a malformed row (or none). Message names file, line and field.

  Attributes:
    path: the file; line: 1-based line number (0 when the whole file is at fault);
    field: the JSON field (``"<json>"``, ``"<row>"``, ``"<file>"`` for non-field problems).
  """

  def __init__(self, path: str, line: int, field: str, problem: str):
    self.path, self.line, self.field = path, line, field
    where = f"{path}:{line}: field '{field}'" if line else path
    super().__init__(f"{where}: {problem}")


@dataclasses.dataclass(frozen=True)
class Question:
  """One QA example. ``golden_answers`` is a non-empty tuple of strings; ``split`` is '' (hash
  split) or a pinned 'train' / 'eval'. ``hop_queries`` (optional jsonl field) are the search
  queries of a multi-hop demonstration, one per hop (e.g. "Which country has Lima as its
  capital?", "What is the currency of Peru?"); empty = search with the question itself."""
  id: str
  question: str
  golden_answers: tuple[str, ...]
  data_source: str
  split: str = ""
  hop_queries: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Document:
  """One corpus passage in Search-R1 format (``contents`` = '"Title"\\ntext')."""
  id: str
  contents: str


def bundled_dir() -> str:
  """Path of the data files shipped inside the package (see DATA_LICENSE.md)."""
  return str(resources.files("gigrl.data") / "files")


@dataclasses.dataclass(frozen=True)
class BundledSet:
  """One bundled question file (paths relative to :func:`bundled_dir`).

  Attributes:
    questions: the question jsonl.
    corpus: the corpus its questions' passages are in (merged into the bundled corpus).
    id_prefix: namespace of that corpus's ids in the merged corpus ('' = as stored).
    sources: the ``data_source`` names of its rows (the names ``data.train_sources`` takes).
    eval_only: the whole set is held out for evaluation (never trained on).
  """
  questions: str
  corpus: str
  id_prefix: str
  sources: tuple[str, ...]
  eval_only: bool = False


# The bundled sets: one row each (DATA_LICENSE.md gives origin and licence). Bamboogle is
# held out whole (out-of-domain, as in Search-R1's tables).
BUNDLED_SETS = (
    BundledSet("r1searcher_retrieved/hotpotqa_questions.jsonl", "r1searcher_retrieved/corpus.jsonl",
               "", ("hotpotqa",)),
    BundledSet("r1searcher_retrieved/2wikimultihopqa_questions.jsonl",
               "r1searcher_retrieved/corpus.jsonl", "", ("2wikimultihopqa",)),
    BundledSet("r1searcher_retrieved/bamboogle_questions.jsonl",
               "r1searcher_retrieved/corpus.jsonl", "", ("bamboogle",), eval_only=True),
    BundledSet("ircot_fewshot/questions.jsonl", "ircot_fewshot/corpus.jsonl", "ircot-",
               ("hotpotqa", "2wikimultihopqa", "musique", "iirc")),
    # gigrl.data.countries (GeoNames); split pinned by country; corpus ids 'countries-<ISO2>-<kind>'
    BundledSet("countries/questions.jsonl", "countries/corpus.jsonl", "", ("countries",)),
)
BUNDLED_QUESTION_FILES = tuple(s.questions for s in BUNDLED_SETS)
# Corpus files and the id namespace each gets when merged (ids collide otherwise).
BUNDLED_CORPUS_FILES = tuple(dict.fromkeys((s.corpus, s.id_prefix) for s in BUNDLED_SETS))
EVAL_ONLY_SOURCES = tuple(dict.fromkeys(
    src for s in BUNDLED_SETS if s.eval_only for src in s.sources))
TRAIN_SOURCES = tuple(sorted({src for s in BUNDLED_SETS if not s.eval_only for src in s.sources}))


def check_train_sources(value: str, field: str = "data.train_sources") -> list[str]:
  """Parses a comma-separated list of bundled training sets (``data.train_sources``).

  Returns:
    The names, in order, without blanks and repeats.
  Raises:
    ConfigError: naming ``field`` when a name is not a bundled set (the message lists the
      known ones), a set is eval-only, or the list is empty.
  """
  known = ", ".join(TRAIN_SOURCES)
  if not isinstance(value, str):
    raise ConfigError(field, value, f"a comma-separated list of bundled sets among {known}")
  names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
  unknown = [n for n in names if n not in TRAIN_SOURCES and n not in EVAL_ONLY_SOURCES]
  if unknown:
    raise ConfigError(field, value, f"bundled sets among {known} (unknown: "
                      f"{', '.join(unknown)}); your own file goes in data.questions_file")
  held_out = [n for n in names if n in EVAL_ONLY_SOURCES]
  if held_out:
    raise ConfigError(field, value, f"bundled training sets among {known} "
                      f"({', '.join(held_out)} is held out for evaluation only)")
  if not names:
    raise ConfigError(field, value, f"a comma-separated list of bundled sets among {known}, "
                      "or set data.questions_file")
  return names


def _iter_json_lines(path: str) -> Iterator[tuple[int, dict]]:
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(path, lineno, "<json>", f"not valid JSON ({e.msg})") from None
      if not isinstance(row, dict):
        raise DataError(path, lineno, "<row>", "expected a JSON object")
      yield lineno, row


def _parse_question(path: str, lineno: int, row: dict, default_source: str) -> Question:
  q = row.get("question")
  if not isinstance(q, str) or not q.strip():
    raise DataError(path, lineno, "question", f"expected a non-empty string, got {q!r}")
  if "golden_answers" in row:
    answers, field = row["golden_answers"], "golden_answers"
  elif "answer" in row:
    answers, field = row["answer"], "answer"
    answers = [answers] if isinstance(answers, str) else answers
  else:
    raise DataError(path, lineno, "golden_answers", "missing")
  if (not isinstance(answers, list) or not answers
      or not all(isinstance(a, str) and a.strip() for a in answers)):
    raise DataError(path, lineno, field,
                    f"expected a non-empty list of non-empty strings, got {answers!r}")
  qid = row.get("id", row.get("idx", f"{os.path.basename(path)}:{lineno}"))
  source = row.get("data_source", default_source)
  if not isinstance(source, str):
    raise DataError(path, lineno, "data_source", f"expected a string, got {source!r}")
  split = row.get("split", "")
  if split not in ("", "train", "eval"):
    raise DataError(path, lineno, "split", f"expected 'train' or 'eval', got {split!r}")
  hop_queries = row.get("hop_queries", [])
  if (not isinstance(hop_queries, list)
      or not all(isinstance(h, str) and h.strip() for h in hop_queries)):
    raise DataError(path, lineno, "hop_queries",
                    f"expected a list of non-empty strings, got {hop_queries!r}")
  return Question(str(qid), q.strip(), tuple(a.strip() for a in answers), source, split,
                  tuple(h.strip() for h in hop_queries))


def load_questions(path: str, data_source: str | None = None) -> list[Question]:
  """Loads a Search-R1/FlashRAG question file.

  Args:
    path: jsonl file with ``question`` and ``golden_answers`` (or ``answer``).
    data_source: used when a row has no ``data_source`` (default: file stem).
  Returns:
    The questions in file order.
  Raises:
    DataError: a row is not JSON, ``question``/``golden_answers`` is malformed, or the file
      has no rows.
    FileNotFoundError: ``path`` does not exist.
  """
  default = data_source or os.path.splitext(os.path.basename(path))[0]
  out = [_parse_question(path, n, row, default) for n, row in _iter_json_lines(path)]
  if not out:
    raise DataError(path, 0, "<file>", "no questions (the file is empty)")
  return out


def load_corpus(path: str, id_prefix: str = "") -> list[Document]:
  """Loads a Search-R1 corpus jsonl (``{"id", "contents"}`` per line).

  Raises:
    DataError: a row is not JSON, ``id`` is missing/not a string or int, ``contents``
      is not a non-empty string, an id repeats (the message names both lines), or the file
      has no rows.
  """
  docs, seen = [], {}
  for lineno, row in _iter_json_lines(path):
    did = row.get("id")
    if isinstance(did, bool) or not isinstance(did, (str, int)):
      raise DataError(path, lineno, "id", f"expected a string id, got {did!r}")
    contents = row.get("contents")
    if not isinstance(contents, str) or not contents.strip():
      raise DataError(path, lineno, "contents", f"expected a non-empty string, got {contents!r}")
    did = id_prefix + str(did)
    if did in seen:
      raise DataError(path, lineno, "id", f"duplicate id {did!r} (first on line {seen[did]})")
    seen[did] = lineno
    docs.append(Document(did, contents))
  if not docs:
    raise DataError(path, 0, "<file>", "no passages (the corpus is empty)")
  return docs


def load_bundled_corpus() -> list[Document]:
  """The bundled Wikipedia passages (R1-Searcher retrieved + IRCoT paragraphs)."""
  root = bundled_dir()
  docs: list[Document] = []
  for rel, prefix in BUNDLED_CORPUS_FILES:
    docs.extend(load_corpus(os.path.join(root, rel), prefix))
  return docs


def split_title(contents: str) -> tuple[str, str]:
  """Splits Search-R1 ``contents`` into (title without quotes, text).

  Follows Search-R1 ``_passages2string``: the title is the first line, the text the rest.
  """
  title, _, text = contents.partition("\n")
  return title.strip().strip('"'), text.strip()


# --- SQuAD answer normalisation (shared by the reward and the split) -------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
  """SQuAD normalisation: lower, drop punctuation, drop a/an/the, squeeze spaces.

  Reference: Search-R1 ``verl/utils/reward_score/qa_em.py::normalize_answer``.
  """
  s = s.lower()
  s = "".join(ch for ch in s if ch not in _PUNCT)
  s = _ARTICLES.sub(" ", s)
  return " ".join(s.split())


def is_eval_question(q: Question, eval_percent: int) -> bool:
  """Fixed split rule: a pinned ``q.split`` wins; else eval iff the set is eval-only or
  hash(question) % 100 < eval_percent.

  The key is the normalised question text, so a question duplicated across sets lands on
  the same side (no eval question is ever trained on).
  """
  if q.split:
    return q.split == "eval"
  if q.data_source in EVAL_ONLY_SOURCES:
    return True
  digest = hashlib.sha256(normalize_answer(q.question).encode()).digest()
  return int.from_bytes(digest[:4], "big") % 100 < eval_percent


def split_questions(questions: Sequence[Question], eval_percent: int
                    ) -> tuple[list[Question], list[Question]]:
  """Returns (train, eval) by :func:`is_eval_question`; order is preserved."""
  train, ev = [], []
  for q in questions:
    (ev if is_eval_question(q, eval_percent) else train).append(q)
  return train, ev


def load_bundled_questions(sources: Sequence[str] | None = None) -> list[Question]:
  """All bundled questions, optionally filtered to the given ``data_source`` names."""
  root = bundled_dir()
  out: list[Question] = []
  for rel in BUNDLED_QUESTION_FILES:
    out.extend(load_questions(os.path.join(root, rel)))
  if sources:
    out = [q for q in out if q.data_source in set(sources)]
  return out
