"""QA sets as TFDS datasets (array_record), read with ``tfds.data_source`` (no TensorFlow).

``build(data_dir, questions_files, eval_percent)`` writes the dataset once (a few hundred ms),
with splits ``train`` and ``eval`` fixed by :func:`gigrl.data.qa.is_eval_question`; later runs
reuse it. The bundled sets and a user's own Search-R1/FlashRAG jsonl files go through the same
builder (the config name encodes the files' content hash, so edited files rebuild).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Sequence

import numpy as np
import tensorflow_datasets as tfds
from absl import logging as absl_logging

from gigrl.data import qa

tfds.disable_progress_bar()


class _DropCustomConfigWarning(logging.Filter):
  """Every gigrl QA config is a custom (content-hashed) one; TFDS warns about each."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using custom data configuration")


absl_logging.get_absl_logger().addFilter(_DropCustomConfigWarning())

_FEATURES = tfds.features.FeaturesDict({
    "id": tfds.features.Text(),
    "question": tfds.features.Text(),
    "golden_answers": tfds.features.Sequence(tfds.features.Text()),
    "data_source": tfds.features.Text(),
    "hop_queries": tfds.features.Sequence(tfds.features.Text()),
})


@dataclasses.dataclass
class QaConfig(tfds.core.BuilderConfig):
  files: tuple[str, ...] = ()
  eval_percent: int = 10


class GigrlQa(tfds.core.GeneratorBasedBuilder):
  """Search-R1-format QA questions with a fixed train/eval split."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "hop_queries (multi-hop demonstration queries)."}

  # TFDS prints "Downloading and preparing dataset Unknown size ..." and "... downloaded and
  # prepared" to stdout; nothing is downloaded here (local files), so both stay quiet.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, features=_FEATURES,
                                 description="Search-R1 format QA (gigrl)")

  def _split_generators(self, dl_manager):
    del dl_manager
    questions = []
    for path in self.builder_config.files:
      questions.extend(qa.load_questions(path))   # DataError names file and line
    train, ev = qa.split_questions(questions, self.builder_config.eval_percent)
    # TFDS refuses a split without examples; an empty split is left out (read_split -> []).
    return {name: self._generate_examples(qs) for name, qs in (("train", train), ("eval", ev))
            if qs}

  def _generate_examples(self, questions: Sequence[qa.Question]):
    seen = set()
    for q in questions:
      key = f"{q.data_source}/{q.id}"
      while key in seen:          # ids repeat across user files: keep both rows
        key += "+"
      seen.add(key)
      yield key, {"id": q.id, "question": q.question,
                  "golden_answers": list(q.golden_answers), "data_source": q.data_source,
                  "hop_queries": list(q.hop_queries)}


def _config_name(files: Sequence[str], eval_percent: int) -> str:
  h = hashlib.sha256()
  for path in files:
    h.update(os.path.basename(path).encode())
    with open(path, "rb") as f:
      h.update(hashlib.sha256(f.read()).digest())
  return f"qa_{h.hexdigest()[:12]}_e{eval_percent}"


def bundled_files() -> tuple[str, ...]:
  return tuple(os.path.join(qa.bundled_dir(), rel) for rel in qa.BUNDLED_QUESTION_FILES)


def build(data_dir: str, files: Sequence[str] | None = None, eval_percent: int = 10
          ) -> GigrlQa:
  """Builds (once) and returns the TFDS builder for ``files`` (default: bundled sets).

  Raises:
    DataError: a malformed question row (file, line and field named).
    FileNotFoundError: a file does not exist.
  """
  files = tuple(files or bundled_files())
  for path in files:
    if not os.path.exists(path):
      raise FileNotFoundError(f"data.questions_file: {path} does not exist")
  config = QaConfig(name=_config_name(files, eval_percent), files=files,
                    eval_percent=eval_percent, version=GigrlQa.VERSION)
  builder = GigrlQa(config=config, data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  return builder


def _to_str(x) -> str:
  return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def read_split(builder: GigrlQa, split: str) -> list[qa.Question]:
  """All rows of ``split`` through ``builder.as_data_source`` (array_record random access).

  A split without questions (e.g. ``eval`` with ``eval_percent=0``) gives ``[]``.
  """
  if split not in builder.info.splits:
    return []
  source = builder.as_data_source(split=split)
  out = []
  for i in range(len(source)):
    row = source[i]
    answers, hops = (tuple(_to_str(a) for a in (v.tolist() if isinstance(v, np.ndarray) else v))
                     for v in (row["golden_answers"], row["hop_queries"]))
    out.append(qa.Question(_to_str(row["id"]), _to_str(row["question"]), answers,
                           _to_str(row["data_source"]), hop_queries=hops))
  return out
