"""``train``: ``gigrl-train`` as a library call, for notebooks and scripts (as
``gigrl.training.sweep.run_sweep`` is ``gigrl-sweep``'s and
``gigrl.training.aot.compile_programs`` ``gigrl-compile``'s).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import ml_collections
import tqdm

from gigrl.training import compile_cache
from gigrl import config as config_lib
from gigrl import search as search_lib
from gigrl.config_utils import check_writable_dir
from gigrl.models import fetch
from gigrl.training import sampler_process
from gigrl.training import trainer as trainer_lib


@dataclasses.dataclass
class RunResult:
  """What :func:`train` did.

  Attributes:
    workdir: the run's directory.
    step: updates done (SFT and RL steps).
    total: ``train.sft_steps + train.num_steps``.
    complete: the run reached ``total`` (False when SIGTERM / Ctrl-C stopped it earlier; rerun
      to resume).
    eval: the final held-out ``eval/*`` metrics (``eval.json``), None when there are none.
  """
  workdir: str
  step: int
  total: int
  complete: bool
  eval: dict[str, Any] | None = None


def check_startup(cfg: ml_collections.ConfigDict, workdir: str) -> None:
  """The start-up checks of a run, before anything is built: a writable ``workdir``, hub ids
  resolved to local snapshots (huggingface_hub), the config's fields, ``data.tfds_dir``,
  ``model.hf_path``, and a reachable retrieval server (``search.backend = http``).

  Raises:
    UserError (ConfigError naming the field) or SearchError: the first problem found.
  """
  check_writable_dir(workdir, "--workdir")
  fetch.resolve_hub_ids(cfg)
  config_lib.validate(cfg)
  if cfg.data.tfds_dir:
    check_writable_dir(cfg.data.tfds_dir, "data.tfds_dir")
  fetch.check_hf_path(cfg.model.hf_path)
  if cfg.search.backend == "http":         # a server that is down: stop before the build
    search_lib.make_retriever(cfg.search)  # health check (the trainer builds its own)


def train(cfg: ml_collections.ConfigDict, workdir: str) -> RunResult:
  """Runs (or resumes) one training run: SFT warm-start, RL steps, held-out evaluation.

  Args:
    cfg: a full config (``gigrl.config.base_config()`` or a config file's, see
      ``gigrl.config.load_file`` and ``apply_overrides``).
    workdir: the run's directory (created; resumed from when it holds checkpoints).
  Returns:
    :class:`RunResult`.
  Raises:
    UserError / ConfigError / SearchError: a bad config or input (see :func:`check_startup`).
    CheckpointError, NonFiniteError: the run failed; the message says what to do.
  """
  check_startup(cfg, workdir)
  compile_cache.enable(cfg.train.compile_cache)
  trainer = trainer_lib.Trainer(cfg, workdir)
  trainer.run()
  total = int(cfg.train.sft_steps) + int(cfg.train.num_steps)
  step = int(trainer.state.step)
  path = os.path.join(workdir, "eval.json")
  metrics = None
  if step == total and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      metrics = json.load(f)
  return RunResult(workdir=str(workdir), step=step, total=total,
                   complete=step == total and not trainer.stopped, eval=metrics)


def sample(cfg: ml_collections.ConfigDict, workdir: str) -> int:
  """``gigrl-train --sampler``: the sampler process, listening at ``train.sampler_address`` for
  the trainer's processes (:func:`gigrl.training.sampler_process.serve`; the same config).

  Returns:
    the number of RL steps' rollouts sent.
  Raises:
    UserError / ConfigError / SearchError (:func:`check_startup`), SamplerError.
  """
  check_startup(cfg, workdir)
  compile_cache.enable(cfg.train.compile_cache)
  return sampler_process.serve(
      cfg, workdir, lambda msg: tqdm.tqdm.write(f"[gigrl-sampler] {msg}", file=sys.stderr))
