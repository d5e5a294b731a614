r"""``gigrl-train``: supervised warm-start, then RL of a Search-R1 agent.

Usage::

  gigrl-train --config configs/smoke.py --workdir runs/smoke [--config.<section>.<field>=value ...]

  e.g. --config.train.num_steps=3 --config.advantage.outcome=stratified

Rerunning the same command with the same workdir resumes from the latest complete checkpoint.
SIGTERM (TPU preemption) and Ctrl-C write a checkpoint and exit cleanly.

Per RL step (the data flow of docs/architecture.md):
  pool.sample -> rollout (policy + search) -> reward (EM) -> pool.update
  -> advantages (outcome ⊕ step ⊕ reweight) -> loss (PPO-clip + KL) -> AdamW update.

Errors a user can cause (a bad flag or config field, a missing or empty data file, a workdir
that cannot be written, a retrieval server that is down) are checked at start-up where they
can be and end the run with one line, ``gigrl-train: error: ...``, and exit status 2.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from gigrl import config_utils
from gigrl.config_utils import UserError

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Config file (e.g. configs/smoke.py); override any field with "
    "--config.<section>.<field>=value.", lock_config=True)
flags.DEFINE_string("workdir", None, "Output and resume directory (created if missing).")
flags.DEFINE_string("coordinator_address", None, "Multi-process runs: host:port of process 0 "
                    "(else $GIGRL_COORDINATOR; multi-host TPU VMs need none).")
flags.DEFINE_integer("num_processes", None, "Multi-process runs: number of processes "
                     "(else $GIGRL_NUM_PROCESSES).")
flags.DEFINE_bool("sampler", False, "Run as the sampler process: listen at "
                  "train.sampler_address for the trainer's processes (asynchronous RL across "
                  "processes: the same --config, overrides and --workdir as the trainer's "
                  "command).")
flags.DEFINE_integer("process_id", None, "Multi-process runs: this process's id, 0 .. "
                     "num_processes - 1 (else $GIGRL_PROCESS_ID).")

PROG = "gigrl-train"
SECTIONS = ("data", "model", "rollout", "search", "advantage", "loss", "train", "checkpoint")
_HELP_FLAGS = ("-h", "-help", "--help", "--helpshort", "-?")


class UsageError(UserError):
  """A bad command line (flags, --config file, --workdir)."""


check_writable_dir = config_utils.check_writable_dir


def usage() -> str:
  """The text of ``gigrl-train --help``: usage, this module's flags, config sections."""
  # The module that defined --workdir: 'gigrl.cli.train', or the script path under `python -m`.
  module = next((m for m, fl in FLAGS.flags_by_module_dict().items()
                 if any(f.name == "workdir" for f in fl)), None)
  flag_help = FLAGS.module_help(module) if module else ""
  return "\n".join([
      (__doc__ or "").strip().replace("``", ""), "", "Flags:", flag_help.strip(), "",
      "Config sections (each field settable as --config.<section>.<field>=value): "
      + ", ".join(SECTIONS) + ", and seed.",
      "Print a config's fields and values: python -c \"import runpy; "
      "print(runpy.run_path('configs/smoke.py')['get_config']())\"",
      "All absl flags (logging, ...): --helpfull", ""])


def fail(message: str, status: int = 2) -> None:
  """Prints ``<program>: error: <message>`` as one line on stderr and exits.

  ``<program>`` is the console script (``gigrl-train``, ``gigrl-compile``, ...).
  """
  one_line = " | ".join(part.strip() for part in str(message).splitlines() if part.strip())
  script = os.path.basename(sys.argv[0]) if sys.argv else ""
  prog = script if script.startswith("gigrl-") else PROG
  print(f"{prog}: error: {one_line}", file=sys.stderr, flush=True)
  distributed = sys.modules.get("gigrl.distributed")   # (not imported: no cluster to leave)
  if distributed is not None:
    distributed.exit_if_peer_lost(status)   # no shutdown barrier with a process that is gone
  sys.exit(status)


# ----------------------------------------------------------------------------- flags
def _flag_value(argv: list[str], name: str) -> str | None:
  """The value of ``--name=v`` / ``--name v`` in argv (last one wins), else None."""
  value = None
  for i, arg in enumerate(argv):
    for prefix in (f"--{name}", f"-{name}"):
      if arg.startswith(prefix + "="):
        value = arg[len(prefix) + 1:]
      elif arg == prefix and i + 1 < len(argv):
        value = argv[i + 1]
  return value


def _config_file(spec: str) -> str:
  """``path[:arg]`` -> path (ml_collections passes ``arg`` to ``get_config``)."""
  return spec if os.path.isfile(spec) or ":" not in spec else spec.rsplit(":", 1)[0]


def _load_user_config(spec: str):
  """Loads ``path[:arg]``'s ``get_config`` (only to name fields in an error message)."""
  path = _config_file(spec)
  arg = spec[len(path) + 1:] or None
  module_spec = importlib.util.spec_from_file_location("_gigrl_user_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


def _unknown_field_message(argv: list[str], spec: str, err: Exception) -> str:
  """Names the ``--config.<path>`` override that has no field, and the fields it could be."""
  text = str(err.args[0]) if err.args else str(err)
  found = re.search(r"['\"]([\w-]+)['\"]", text)
  key = found.group(1) if found else text.strip("'\" ")
  hint = re.search(r"Did you mean [^?]*\?", text)
  hint = f" ({hint.group(0)})" if hint else ""
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config."):].split("=", 1)[0]
    parts = path.split(".")
    if key not in parts:
      continue
    parent = ".".join(parts[:parts.index(key)])
    msg = f"--config.{path}: the config has no field '{path}'{hint}"
    try:
      node = _load_user_config(spec)
      for part in parent.split(".") if parent else ():
        node = node[part]
      msg += f"; the fields of {parent or 'the config'} are {', '.join(sorted(node.keys()))}"
    except Exception:  # pylint: disable=broad-except
      pass            # the message already names the field
    return msg
  return f"the config has no field {key!r}{hint} (set by a --config.<section>.<field> flag)"


def _raised_in(err: BaseException, path: str) -> bool:
  """True if ``err`` (or an exception it was raised from) passed through file ``path``."""
  path = os.path.abspath(path)
  while err is not None:
    tb = err.__traceback__
    while tb is not None:
      if os.path.abspath(tb.tb_frame.f_code.co_filename) == path:
        return True
      tb = tb.tb_next
    err = err.__cause__ or err.__context__
  return False


def _config_load_message(spec: str, err: BaseException) -> str:
  """One line for a config file that failed to load: the file, line and error."""
  root = err
  while root.__cause__ is not None:
    root = root.__cause__
  path = os.path.abspath(_config_file(spec))
  where = spec
  if isinstance(root, SyntaxError):
    where = f"{spec}:{root.lineno}"
  else:
    tb = root.__traceback__
    while tb is not None:
      if os.path.abspath(tb.tb_frame.f_code.co_filename) == path:
        where = f"{spec}:{tb.tb_lineno}"
      tb = tb.tb_next
  text = root.msg if isinstance(root, SyntaxError) else str(root)
  return f"--config {where}: the config file failed to load: {type(root).__name__}: {text}"


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing with one-line errors (``app.run``'s ``flags_parser``).

  Handles ``--help`` (prints :func:`usage`), a missing or unloadable ``--config`` file, an
  override naming no config field, and a bad flag value.
  """
  if any(arg in _HELP_FLAGS for arg in argv[1:]):
    print(usage())
    sys.exit(0)
  try:
    spec = _flag_value(argv, "config")
    if not spec:
      raise UsageError("--config is required, e.g. --config configs/smoke.py (see --help)")
    if not os.path.isfile(_config_file(spec)):
      raise UsageError(f"--config {spec}: no such file")
    try:
      rest = FLAGS(argv)
    except flags.Error as e:                  # unknown flag, bad value for a field's type
      raise UsageError(f"{e} (see --help)") from None
    except Exception as e:  # pylint: disable=broad-except
      if isinstance(e, (AttributeError, KeyError)) and not _raised_in(e, _config_file(spec)):
        raise UsageError(_unknown_field_message(argv, spec, e)) from None  # --config.<path>
      raise UsageError(_config_load_message(spec, e)) from None  # the config file's own code
    try:
      FLAGS.config.keys()                     # a file that failed to load fails here
    except Exception as e:  # pylint: disable=broad-except
      raise UsageError(_config_load_message(spec, e)) from None
  except UsageError as e:
    fail(str(e))
  return rest


# --------------------------------------------------------------------------- start-up
def _cause_of_type(err: BaseException, types: tuple[type, ...]) -> BaseException | None:
  """The first exception of ``types`` in ``err``'s ``__cause__`` / ``__context__`` chain."""
  seen = set()
  while err is not None and id(err) not in seen:
    if isinstance(err, types):
      return err
    seen.add(id(err))
    err = err.__cause__ or err.__context__
  return None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])} (config fields are set with "
         "--config.<section>.<field>=value; see --help)")
  if not FLAGS.workdir:
    fail("--workdir is required, e.g. --workdir runs/smoke (see --help)")
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
  # Multi-process (one per host): explicit coordinator flags / env, or a multi-host TPU VM.
  from gigrl import distributed  # pylint: disable=g-import-not-at-top
  try:
    distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  except ValueError as e:
    fail(str(e))
  from gigrl.search.base import SearchError  # pylint: disable=g-import-not-at-top
  cfg = FLAGS.config
  try:
    # pylint: disable=g-import-not-at-top
    from gigrl.training import api
    from gigrl.training import checkpoint as ckpt_lib
    from gigrl.training import trainer
    # pylint: enable=g-import-not-at-top
    try:
      if FLAGS.sampler:
        api.sample(cfg, FLAGS.workdir)
      else:
        api.train(cfg, FLAGS.workdir)
    except (ckpt_lib.CheckpointError, trainer.NonFiniteError) as e:
      fail(str(e), status=1)                 # the run failed; the message says what to do
    except Exception as e:  # pylint: disable=broad-except
      if isinstance(e, (UserError, SearchError)):
        raise
      cause = _cause_of_type(e, (UserError, SearchError))
      if cause is None and distributed.lost_process(e):
        fail(f"{distributed.lost_process_message(e)}: rerun every process to resume from the "
             "last checkpoint")
      if cause is None:
        raise
      fail(str(cause))   # e.g. a SearchError raised inside a rollout
  except (UsageError, UserError, SearchError) as e:
    fail(str(e))
  except KeyboardInterrupt:                  # before the trainer's own Ctrl-C handling
    fail("interrupted", status=130)


def run() -> None:
  """Console entry point (``gigrl-train``)."""
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
