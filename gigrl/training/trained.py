"""A trained policy back from its run directory: ``load_policy`` (behind ``gigrl-eval``) and
``export`` (behind ``gigrl-export``), library calls a notebook makes as the tools do.

``load_policy`` rebuilds the run's policy from the config its checkpoint saved and reads the
params alone (no optimizer state). A LoRA checkpoint holds the adapters alone: they are put
back on the base they belong to (``model.hf_path`` / the preset, or the full run that
``train.init_from`` named, as the checkpoint's ``lora_base`` records).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from typing import Any, Sequence

from flax import nnx

from gigrl import config as config_lib
from gigrl.config_utils import UserError
from gigrl.data import tokenizer as tok_lib
from gigrl.models import fetch
from gigrl.models import hf
from gigrl.models import lora as lora_lib
from gigrl.models import sharding as sharding_lib
from gigrl.training import build
from gigrl.training import checkpoint as ckpt_lib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model")
INIT_FROM_BASE = "train.init_from "   # how a checkpoint's lora_base names a full run's params


@dataclasses.dataclass
class TrainedPolicy:
  """What :func:`load_policy` returns.

  Attributes:
    cfg: the run's config (as its checkpoint saved it, then ``overrides``).
    policy: :class:`gigrl.models.policy.Policy` built from it (mesh, graphdef, LoRA spec).
    params: the full params (adapters on their base with LoRA), sharded on ``policy.mesh``.
    step: the checkpoint's step; None for a Hugging Face checkpoint.
    tokenizer: the run's tokenizer.
  """
  cfg: Any
  policy: Any
  params: Any
  step: int | None
  tokenizer: Any


def load_policy(workdir: str | None = None, *, step: int | None = None,
                hf_path: str | None = None, config_file: str | None = None,
                overrides: Sequence[str] = ()) -> TrainedPolicy:
  """The policy of a run's checkpoint (``workdir``) or of a Hugging Face checkpoint.

  Args:
    workdir: a ``gigrl-train`` run directory; its newest checkpoint unless ``step``.
    step: the checkpoint step to read.
    hf_path: instead of ``workdir``, a HF checkpoint directory or hub id (its tokenizer too,
      unless the config or ``overrides`` name another).
    config_file: ``FILE[:PRESET]``, the settings under the run's saved config (``workdir``) or
      the settings of an ``hf_path`` policy (default ``gigrl.config.base_config()``).
    overrides: ``section.field=value`` strings, applied last (``gigrl-eval --set``).
  Returns:
    :class:`TrainedPolicy`.
  Raises:
    UserError: no checkpoint there (or not ``step``), a missing ``hf_path``, config file or
      tokenizer; ConfigError naming a bad override.
  """
  if (workdir is None) == (hf_path is None):
    raise ValueError("load_policy: give one of workdir or hf_path")
  cfg = config_lib.load_file(config_file) if config_file else config_lib.base_config()
  meta: dict[str, Any] = {}
  if workdir is not None:
    step, meta = _checkpoint_meta(workdir, step)
    config_lib.merge_saved(cfg, meta.get("config") or {})
  else:
    hf_path = fetch.resolve_hf_path(hf_path, "--hf_path")
    fetch.check_hf_path(hf_path, "--hf_path")
    cfg.model.hf_path = hf_path
    if cfg.data.tokenizer == "bundled":
      cfg.data.tokenizer = hf_path
  config_lib.apply_overrides(cfg, list(overrides), what="--set")
  tok = cfg.data.tokenizer
  if tok != "bundled" and not os.path.exists(tok):
    raise UserError(f"data.tokenizer {tok}: no such file or directory")
  tokenizer = tok_lib.load(tok)
  policy = build.build_policy(cfg, tokenizer.vocab_size)
  params = policy.params
  if workdir is not None:
    params = _restore(workdir, step, policy, meta)
  return TrainedPolicy(cfg, policy, params, step, tokenizer)


def _checkpoint_meta(workdir: str, step: int | None) -> tuple[int, dict[str, Any]]:
  """(step, JSON metadata) of the run's newest checkpoint, or of ``step``."""
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise UserError(f"--workdir {workdir}: no checkpoints/ folder (not a gigrl-train "
                    "run directory, or no checkpoint written yet)")
  what = f"--step {step}" if step is not None else f"--workdir {workdir}"
  try:
    meta = ckpt_lib.restore_meta(workdir, step, field=what)
  except ckpt_lib.CheckpointError as e:
    raise UserError(str(e)) from None
  return int(meta["step"]), meta


def _restore(workdir: str, step: int, policy, meta: dict[str, Any]):
  """The checkpoint's params, sharded like the policy's; LoRA adapters on their base."""
  loaded, _ = ckpt_lib.restore_params(workdir, step, policy.trained(policy.params))
  if policy.lora.enabled:
    _, frozen = lora_lib.split_trainable(policy.params, True)
    base = str(meta.get("lora_base") or "")
    if base.startswith(INIT_FROM_BASE):   # adapters on a full run's params (its SFT, say)
      path, _, at = base[len(INIT_FROM_BASE):].rpartition("@")
      frozen, _ = ckpt_lib.restore_params(path, int(at), frozen)
    loaded = lora_lib.merge(loaded, frozen)
  return sharding_lib.shard_state(loaded, policy.mesh, policy.train_preset)


def export(workdir: str, out: str, *, step: int | None = None, peft: bool = False,
           dtype: str | None = None, log=None) -> list[str]:
  """Writes ``out`` from the checkpoint of ``workdir`` (the library call behind
  ``gigrl-export``): a HF directory (config.json, model.safetensors with LoRA adapters merged
  into the base, ``gigrl.models.hf.to_hf``, and the tokenizer files of ``data.tokenizer`` when
  that is a HF directory), or with ``peft`` the adapters alone in peft's format
  (adapter_config.json, adapter_model.safetensors, ``gigrl.models.hf.to_peft``). Written under
  a temporary name and renamed: a failed export leaves nothing behind.

  Args:
    dtype: safetensors dtype of the merged model, ``float32`` / ``bfloat16`` / ``float16``
      (default ``model.param_dtype``).
    log: a one-line report's sink (default stderr).
  Returns:
    the written files (under ``out``).
  Raises:
    UserError: no run or checkpoint there, ``out`` not empty, ``peft`` on a run without LoRA.
  """
  if not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir}: no such directory")
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise UserError(f"--out {out}: exists and is not an empty directory")
  run = load_policy(workdir, step=step)
  cfg, policy = run.cfg, run.policy
  if peft and not policy.lora.enabled:
    raise UserError(f"--peft: the run in {workdir} has no LoRA adapters (model.lora.rank = 0)")
  model = nnx.merge(policy.graphdef, run.params)
  with hf.atomic_directory(out, ".gigrl-export-") as tmp:
    if peft:
      base = cfg.model.hf_path or f"gigrl preset {cfg.model.preset} (seed {cfg.seed})"
      hf.to_peft(model, policy.lora, tmp, base=base)
    else:
      hf.to_hf(model, policy.model_cfg, tmp, dtype=dtype)
      tok = cfg.data.tokenizer
      for name in TOKENIZER_FILES if os.path.isdir(tok) else ():
        if os.path.exists(os.path.join(tok, name)):
          shutil.copy(os.path.join(tok, name), tmp)
  files = sorted(os.path.join(out, f) for f in os.listdir(out))
  what = "LoRA adapters (peft)" if peft else (
      "merged model" if policy.lora.enabled else "model")
  line = f"{what} of {workdir} step {run.step} -> {out} ({len(files)} files)"
  if log is None:
    print(f"[gigrl-export] {line}", file=sys.stderr, flush=True)
  else:
    log(line)
  return files

