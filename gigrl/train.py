r"""``gigrl-train``: supervised warm-start, then RL of a Search-R1 agent.

Usage::

  gigrl-train --config configs/smoke.py --workdir /tmp/run --config.train.num_steps=3

Rerunning the same command with the same workdir resumes from the latest complete checkpoint.
SIGTERM (TPU preemption) writes a checkpoint and exits cleanly.

Per RL step (the data flow of docs/architecture.md):
  pool.sample -> rollout (policy + search) -> reward (EM) -> pool.update
  -> advantages (outcome ⊕ step ⊕ reweight) -> loss (PPO-clip + KL) -> AdamW update.
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Output/resume directory.")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.config is None:
    raise app.UsageError("--config is required, e.g. --config configs/smoke.py")
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
  if os.environ.get("GIGRL_DISTRIBUTED"):  # multi-host TPU pods (launch/tpu_pod.sh)
    import jax  # pylint: disable=g-import-not-at-top
    jax.distributed.initialize()
  from gigrl import config as config_lib  # pylint: disable=g-import-not-at-top
  from gigrl.config_utils import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    config_lib.validate(FLAGS.config)
  except ConfigError as e:
    print(f"gigrl-train: {e}", file=sys.stderr)
    sys.exit(2)
  from gigrl import trainer  # pylint: disable=g-import-not-at-top
  trainer.Trainer(FLAGS.config, FLAGS.workdir).run()


def run() -> None:
  """Console entry point (``gigrl-train``)."""
  app.run(main)


if __name__ == "__main__":
  run()
