"""The run config: one ml_collections ConfigDict with a section per stage.

Sections: ``data``, ``model``, ``rollout``, ``search``, ``advantage``, ``loss``, ``train``,
``checkpoint`` and a top-level ``seed``. Each stage's module owns its section's defaults and
validation; this module composes them (``base_config``) and validates the whole
(``validate``). Config files in ``configs/`` start from ``base_config()`` and override fields;
``load_file`` reads one, ``apply_overrides`` sets ``section.field=value`` assignments.
"""
from __future__ import annotations

import ast
import os
import runpy
from typing import Any, Sequence

import ml_collections

from gigrl import advantages
from gigrl import models
from gigrl import search
from gigrl.config_utils import ConfigError, UserError, check_choice, check_file, check_range
from gigrl.config_utils import get_field, host_port
from gigrl.data import pool as pool_lib
from gigrl.data import qa
from gigrl.update import loss


def data_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.train_sources = "hotpotqa,2wikimultihopqa,musique,iirc"   # bundled data_source names
  c.questions_file = ""        # a user's Search-R1 jsonl instead of the bundled sets
  c.eval_percent = 10          # fixed hash split; bamboogle is always eval
  c.max_train_questions = 0    # 0 = all
  c.tfds_dir = ""              # "" = <workdir>/tfds
  c.tokenizer = "bundled"      # 'bundled' | path to .model | HF tokenizer dir
  c.prompts_per_step = 8       # P (after recycling: the number of trained groups)
  c.group_size = 4             # G rollouts per prompt
  c.pool = pool_lib.pool_default_config()
  return c


def rollout_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.engine = "host_loop"       # the one rollout core ('callback' was retired in #50)
  c.max_turns = 4
  c.max_new_tokens = 64        # per turn
  c.max_obs_tokens = 128
  c.max_prompt_tokens = 256
  c.temperature = 1.0          # sampling; the RL loss scores tokens at the same temperature
  c.top_p = 1.0
  c.top_k = 0
  c.greedy = False
  # What a rollout computes (each a switch, so a run or benchmark compares it on and off; every
  # one on gives the same trajectories as every one off, up to float rounding; docs/architecture.md):
  c.prefill_once_per_group = True   # identical prompts (a group's G samples) prefilled once, KV rows copied
  c.shared_prefix = True       # the batch's common prompt prefix (system turn, instruction) prefilled once
  c.compact_rows = True        # observation extends and decode turns compute only the rows that need them
  c.slot_bucket = 16           # attention and cache copies read only the slots a call can have written, rounded up to this; 0 = all
  c.width_bucket = 32          # prompt widths from the prompts' lengths, rounded up to this (observations: half or all of max_obs_tokens); 0 = the budgets
  c.row_buckets = 2            # compacted calls compute a multiple of B / row_buckets rows (fewer: fewer programs, more padding)
  c.devices = 0                # n > 0: the first n devices sample (rollouts, evaluation) and the rest
                               # train, two meshes of one process (asynchronous RL, #52); 0 = all share
  c.decode_row_buckets = 0     # the same for decode turns (most of a rollout's time, so finer buckets pay most there); 0 = row_buckets
  c.decode_chunk = 0           # decode steps per call (0 = a whole turn): rows that ended their turn leave between calls
  return c


def train_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.num_steps = 100            # RL steps
  c.learning_rate = 1e-6
  # Learning-rate schedule, verl actor ``optim.*`` names (gigrl.update.step.lr_schedule), in RL steps:
  c.lr_warmup_steps = 0        # > 0: warm-up steps; 0: int(lr_warmup_steps_ratio * num_steps)
  c.lr_warmup_steps_ratio = 0.0
  c.lr_scheduler_type = "constant"   # constant | cosine (after the warm-up)
  c.min_lr_ratio = 0.0         # cosine floor, as a fraction of learning_rate
  c.num_cycles = 0.5           # cosine cycles over the decay (0.5 = half a cosine, to the floor)
  # PPO updates per RL step as verl runs them (gigrl.update.step.ppo_update):
  c.ppo_mini_batch_size = 0    # prompts (groups) per mini-batch, verl's unit; 0 = all P
  c.ppo_epochs = 1             # passes over the step's rows
  c.micro_batch_size = 0       # rows per gradient-accumulation micro-batch; 0 = the mini-batch
  c.shuffle = True             # permute rows each epoch (seed, step, epoch) with > 1 mini-batch
  c.trim_update_padding = True  # the update's width W and LM-head positions K from the trained
                               # rows (bucketed), not the filler rows / generation budget; the
                               # same loss (gigrl.update.step.rl_update); False = the old shapes
  c.pack_update_rows = False   # trained rows packed several to a row, a group's prompt once
                               # (segment ids, positions), when that computes fewer token rows;
                               # token-summed losses only (update.step.packing_allowed); same loss.
                               # Off: slower on 2 CPU cores (docs/results/update_packing/)
  c.pack_max_width = 0          # widest packed row in tokens, at least (0 = exactly) the rollout's
                               # width: a group's prompt and continuations wider than it go row by row
  c.skip_zero_advantage = True  # a micro-batch whose loss tokens all have advantage 0 runs
                               # forward only where that adds exactly no gradient (no KL loss,
                               # no entropy bonus: update.step.zero_advantage_adds_nothing);
                               # False computes its backward anyway, to time a step with a
                               # learning signal (benchmarks/vs_trl.py --no_skip)
  c.weight_decay = 0.01
  c.b1, c.b2 = 0.9, 0.999
  c.eps = 1e-8                 # AdamW epsilon (optax's and torch's default)
  c.grad_clip = 1.0
  # Non-finite loss/gradients: the update is skipped (optax.apply_if_finite) and counted in
  # `train/nonfinite_updates`; this many in a row stop the run (last good checkpoint kept).
  c.max_consecutive_nonfinite = 5
  c.sft_steps = 0              # supervised warm-start steps before RL
  c.sft_learning_rate = 1e-3
  c.sft_batch_size = 16
  c.sft_questions = 0          # 0 = all training questions
  c.sft_micro_batch_size = 0   # rows per gradient micro-batch of an SFT step (0 = the whole batch)
  c.sft_on_rl_pool = False     # SFT demonstrates the questions RL samples (rl_pool_size's pool):
                               # a continued-SFT control on RL's data (#51)
  c.sft_only_answer_in_obs = False
  c.sft_counterfactuals = 0    # n > 0: each demonstration -> n with the answer swapped (rollout/demos)
  c.rl_skip_sft_questions = False  # RL samples only the questions after the first sft_questions
  c.max_staleness = 0          # k >= 1: rollouts of the next k steps are sampled while a step
                               # trains, by params exactly k versions old (training.overlap, #52)
  c.sampler_address = ""       # "host:port" (k >= 1): a second process, `gigrl-train --sampler`
                               # with the same config, listens there and samples on its own
                               # devices; the trainer's processes connect (training.
                               # sampler_process); "" = a thread of this process
  c.rl_pool_size = 0           # n > 0: RL samples a random n of those questions (drawn with `seed`),
                               # a pool small enough to run out (query recycling's regime, #51)
  c.init_from = ""             # "<workdir>[@step]": a new run starts RL from the params of that
                               # run's checkpoint at the end of its SFT (step = sft_steps)
  c.copy_steps = 0             # first SFT steps on synthetic copying sequences (data/copy_task)
  c.copy_width = 48            # tokens per copying sequence
  c.copy_batch_size = 64       # copying sequences per step
  c.sample_every = 5           # write readable trajectories every N RL steps
  c.eval_every = 0             # 0 = no periodic eval
  c.sft_eval_every = 0         # also evaluate every N SFT steps (step 0 and the end of SFT
                               # included): held-out EM during the warm-start; 0 = off
  c.eval_questions = 32
  c.compile_cache = "auto"     # compiled programs kept on disk for later runs, resumes and
                               # gigrl-eval (gigrl.training.compile_cache): 'auto' = $JAX_COMPILATION_CACHE_DIR,
                               # else <cache>/jax (~/.cache/gigrl/jax); '' = off; or a directory
  c.warmup = True              # compile every program of the run before step 1 (gigrl.training.warmup)
  c.eval_batch_size = 0        # held-out rollouts per call (0 = all at once; the KV cache grows
                               # with the rows: 300 rows of a 135M model in f32 take ~9 GB)
  return c


def checkpoint_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.every_steps = 10
  c.keep = 3
  c.async_save = True
  return c


def base_config() -> ml_collections.ConfigDict:
  """All sections with their defaults (a full-size run's settings)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data = data_config()
  c.model = models.default_config()
  c.rollout = rollout_config()
  c.search = search.default_config()
  c.advantage = advantages.default_config()
  c.loss = loss.default_config()         # PPO-clip / KL / entropy: gigrl.update.loss.ppo_loss's options
  c.train = train_config()
  c.checkpoint = checkpoint_config()
  return c


SECTIONS = ("data", "model", "rollout", "search", "advantage", "loss", "train", "checkpoint")


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Validates every section.

  Raises:
    ConfigError: naming the first bad field, its value and what is allowed.
  """
  for section in SECTIONS:
    get_field(cfg, section)
  check_range(cfg, "seed", 0, integer=True)
  _validate_data(cfg)
  _validate_rollout(cfg)
  _validate_train(cfg)
  check_range(cfg, "checkpoint.every_steps", 1, integer=True)
  check_range(cfg, "checkpoint.keep", 1, integer=True)
  models.validate(cfg.model)
  search.validate(cfg.search)
  advantages.validate(cfg.advantage)
  loss.validate(cfg.loss)
  if get_field(cfg, "loss.off_policy_correction") != "none" and float(
      get_field(cfg, "rollout.temperature")) != 1.0:
    # the sampler records temperature-1 log-probs (rollout.trajectory); the trainer's are tempered
    raise ConfigError("loss.off_policy_correction", cfg.loss.off_policy_correction,
                      "'none' when rollout.temperature != 1 (the behaviour log-probs are "
                      "recorded at temperature 1)")
  pool_lib.validate_pool_config(cfg.data.pool)


def _validate_data(cfg):
  check_range(cfg, "data.eval_percent", 0, 100, integer=True)
  check_range(cfg, "data.max_train_questions", 0, integer=True)
  check_range(cfg, "data.prompts_per_step", 1, integer=True)
  check_range(cfg, "data.group_size", 1, integer=True)
  if get_field(cfg, "data.questions_file"):   # rows are parsed when the split is built
    check_file(cfg, "data.questions_file", "a Search-R1 questions jsonl")
  else:
    qa.check_train_sources(get_field(cfg, "data.train_sources"))
  tok = get_field(cfg, "data.tokenizer")
  if tok != "bundled" and not (isinstance(tok, str) and os.path.exists(tok)):
    raise ConfigError("data.tokenizer", tok, "'bundled', a sentencepiece .model file or a "
                      "Hugging Face tokenizer directory that exists")


def _validate_rollout(cfg):
  if get_field(cfg, "rollout.engine") == "callback":
    raise ConfigError("rollout.engine", "callback", "'host_loop' (the callback engine was retired "
                      "in issue #50: host_loop is the one rollout core, with every saving)")
  check_choice(cfg, "rollout.engine", ("host_loop",))
  check_range(cfg, "rollout.row_buckets", 1, integer=True)
  check_range(cfg, "rollout.decode_row_buckets", 0, integer=True)
  check_range(cfg, "rollout.devices", 0, integer=True)
  if get_field(cfg, "rollout.decode_chunk") and not get_field(cfg, "rollout.compact_rows"):
    raise ConfigError("rollout.decode_chunk", get_field(cfg, "rollout.decode_chunk"),
                      "0 when rollout.compact_rows is off (a turn decoded in chunks saves only "
                      "by dropping the rows that ended; without compaction it saves nothing)")
  check_range(cfg, "rollout.max_turns", 0, integer=True)
  for f in ("max_new_tokens", "max_obs_tokens", "max_prompt_tokens"):
    check_range(cfg, f"rollout.{f}", 1, integer=True)
  check_range(cfg, "rollout.temperature", 0.0, lo_open=True)
  check_range(cfg, "rollout.top_p", 0.0, 1.0, lo_open=True)
  check_range(cfg, "rollout.top_k", 0, integer=True)
  check_range(cfg, "rollout.slot_bucket", 0, integer=True)
  check_range(cfg, "rollout.width_bucket", 0, integer=True)
  check_range(cfg, "rollout.decode_chunk", 0, integer=True)


def _validate_train(cfg):
  check_range(cfg, "train.num_steps", 0, integer=True)
  check_range(cfg, "train.learning_rate", 0.0, lo_open=True)
  check_range(cfg, "train.sft_learning_rate", 0.0, lo_open=True)
  check_range(cfg, "train.lr_warmup_steps", 0, integer=True)
  check_range(cfg, "train.lr_warmup_steps_ratio", 0.0, 1.0)
  check_choice(cfg, "train.lr_scheduler_type", ("constant", "cosine"))
  check_range(cfg, "train.min_lr_ratio", 0.0, 1.0)
  check_range(cfg, "train.num_cycles", 0.0, lo_open=True)
  check_range(cfg, "train.ppo_mini_batch_size", 0, integer=True)
  check_range(cfg, "train.ppo_epochs", 1, integer=True)
  check_range(cfg, "train.micro_batch_size", 0, integer=True)
  check_choice(cfg, "train.shuffle", (True, False))
  check_choice(cfg, "train.trim_update_padding", (True, False))
  check_choice(cfg, "train.pack_update_rows", (True, False))
  check_choice(cfg, "train.skip_zero_advantage", (True, False))
  check_range(cfg, "train.pack_max_width", 0, integer=True)
  if not isinstance(get_field(cfg, "train.compile_cache"), str):
    raise ConfigError("train.compile_cache", cfg.train.compile_cache,
                      "'auto', '' (off) or a directory")
  p, g = int(get_field(cfg, "data.prompts_per_step")), int(get_field(cfg, "data.group_size"))
  mini = int(get_field(cfg, "train.ppo_mini_batch_size")) or p
  if p % mini:
    raise ConfigError("train.ppo_mini_batch_size", mini,
                      f"a divisor of data.prompts_per_step = {p} (prompts per PPO mini-batch; "
                      "0 = all)")
  micro = int(get_field(cfg, "train.micro_batch_size"))
  if micro and (mini * g) % micro:
    raise ConfigError("train.micro_batch_size", micro,
                      f"a divisor of the mini-batch's rows = train.ppo_mini_batch_size × "
                      f"data.group_size = {mini} × {g} = {mini * g} (0 = no accumulation)")
  check_range(cfg, "train.grad_clip", 0.0, lo_open=True)
  check_range(cfg, "train.weight_decay", 0.0)
  check_range(cfg, "train.b1", 0.0, 1.0, hi_open=True)
  check_range(cfg, "train.b2", 0.0, 1.0, hi_open=True)
  check_range(cfg, "train.eps", 0.0, lo_open=True)
  check_range(cfg, "train.max_consecutive_nonfinite", 1, integer=True)
  check_range(cfg, "train.sft_steps", 0, integer=True)
  check_range(cfg, "train.sft_batch_size", 1, integer=True)
  check_range(cfg, "train.sft_questions", 0, integer=True)
  check_range(cfg, "train.rl_pool_size", 0, integer=True)
  check_range(cfg, "train.max_staleness", 0, integer=True)
  address = str(cfg.train.get("sampler_address", ""))
  if address:
    host_port("train.sampler_address", address)
    if not int(cfg.train.max_staleness):
      raise ConfigError("train.sampler_address", address, "'' with train.max_staleness = 0 (a "
                        "sampler process samples ahead: set train.max_staleness >= 1)")
    if int(cfg.rollout.get("devices", 0)):
      raise ConfigError("train.sampler_address", address, "'' with rollout.devices > 0 (the "
                        "sampler process has its own devices)")
  check_range(cfg, "train.sft_micro_batch_size", 0, integer=True)
  sft_micro = int(cfg.train.sft_micro_batch_size)
  if sft_micro and int(cfg.train.sft_batch_size) % sft_micro:
    raise ConfigError("train.sft_micro_batch_size", sft_micro,
                      f"a divisor of train.sft_batch_size ({cfg.train.sft_batch_size}), or 0")
  check_range(cfg, "train.sft_counterfactuals", 0, integer=True)
  check_range(cfg, "train.copy_steps", 0, integer=True, hi=int(cfg.train.sft_steps))
  if get_field(cfg, "train.rl_skip_sft_questions") and not int(cfg.train.sft_questions):
    raise ConfigError("train.rl_skip_sft_questions", True,
                      "False when train.sft_questions = 0 (every question is an SFT one)")
  check_range(cfg, "train.copy_width", 40, integer=True)
  check_range(cfg, "train.copy_batch_size", 1, integer=True)
  check_range(cfg, "train.eval_questions", 0, integer=True)
  check_range(cfg, "train.eval_batch_size", 0, integer=True)
  check_range(cfg, "train.sample_every", 1, integer=True)
  check_range(cfg, "train.eval_every", 0, integer=True)
  check_range(cfg, "train.sft_eval_every", 0, integer=True)


# ------------------------------------------------------------------- files and overrides
def load_file(spec: str) -> ml_collections.ConfigDict:
  """The config of a config file, ``FILE[:PRESET]`` as ``gigrl-train --config`` takes it
  (``get_config(PRESET)``, or ``get_config()`` without one).

  Raises:
    UserError: naming ``--config`` when the file does not exist.
  """
  path, _, preset = spec.partition(":")
  if not os.path.isfile(path):
    raise UserError(f"--config {path}: no such file")
  get_config = runpy.run_path(path)["get_config"]
  return get_config(preset) if preset else get_config()


def merge_saved(cfg: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
  """Writes ``values`` (a saved config's JSON, e.g. a checkpoint's) into ``cfg``, field by
  field (fields the saved config has but this version does not are skipped)."""
  for k, v in values.items():
    if k not in cfg:
      continue
    if isinstance(v, dict) and hasattr(cfg[k], "keys"):
      merge_saved(cfg[k], v)
    else:
      try:
        cfg[k] = type(cfg[k])(v) if isinstance(cfg[k], tuple) else v
      except (TypeError, ValueError):
        pass


def apply_overrides(cfg: ml_collections.ConfigDict, assignments: Sequence[str], *,
                    what: str = "--config") -> None:
  """Sets ``section.field=value`` assignments (a leading ``--config.`` is dropped), the value
  read as a Python literal (else a string; ``true``/``false`` on bool fields; an int on a
  float field becomes a float).

  Raises:
    ConfigError: naming ``<what> <field>`` when the field does not exist or an assignment has
      no ``=``.
  """
  for a in assignments:
    path, eq, raw = a.removeprefix("--config.").partition("=")
    node, parts = cfg, path.split(".")
    try:
      for part in parts[:-1]:
        node = node[part]
      old = node[parts[-1]]
    except (KeyError, AttributeError, TypeError):
      raise ConfigError(f"{what} {path}", raw, "an existing config field") from None
    if not eq:
      raise ConfigError(f"{what} {path}", raw, "SECTION.FIELD=VALUE")
    if isinstance(old, bool) and raw.lower() in ("true", "false"):
      value = raw.lower() == "true"
    else:
      try:
        value = ast.literal_eval(raw)
      except (ValueError, SyntaxError):
        value = raw
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if isinstance(old, tuple) and isinstance(value, (list, tuple)):
      value = tuple(value)
    node[parts[-1]] = value

