"""``gigrl-export``: a run's checkpoint as a Hugging Face directory, or its LoRA adapters for peft.

  gigrl-export --workdir runs/smollm2_lora --out exported/        # merged: transformers loads it
  gigrl-export --workdir runs/smollm2_lora --out adapters/ --peft # peft.PeftModel loads it

The merged directory holds config.json, model.safetensors (adapters folded into the base,
``gigrl.models.hf.to_hf``) and the tokenizer files of ``data.tokenizer`` when that is a HF
directory (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...). ``--peft`` writes
adapter_config.json and adapter_model.safetensors (``gigrl.models.hf.to_peft``). The directory
is written under a temporary name and renamed, so a failed export leaves nothing behind.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Sequence

PROG = "gigrl-export"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="a gigrl-train run directory")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument("--out", required=True, help="output directory (new or empty)")
  p.add_argument("--peft", action="store_true",
                 help="write the LoRA adapters alone in peft's format, not the merged model")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="safetensors dtype of the merged model (default: model.param_dtype)")
  return p.parse_args(argv)


def export(workdir: str, out: str, *, step: int | None = None, peft: bool = False,
           dtype: str | None = None) -> list[str]:
  """Writes ``out`` from the checkpoint of ``workdir`` (library call behind ``gigrl-export``).

  Returns:
    the written files (under ``out``).
  Raises:
    UserError: no run or checkpoint there, ``out`` not empty, ``peft`` on a run without LoRA.
  """
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  from gigrl.cli import eval as eval_cli
  from gigrl.config_utils import UserError
  from gigrl.models import hf
  # pylint: enable=g-import-not-at-top
  if not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir}: no such directory")
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise UserError(f"--out {out}: exists and is not an empty directory")
  args = argparse.Namespace(workdir=workdir, step=step, config=None, set=[], hf_path=None,
                            retriever=None, retrieval_url=None, corpus=None, topk=None,
                            temperature=None)
  cfg, policy, params, step, _ = eval_cli.load_policy(args)
  if peft and not policy.lora.enabled:
    raise UserError(f"--peft: the run in {workdir} has no LoRA adapters (model.lora.rank = 0)")
  model = nnx.merge(policy.graphdef, params)
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
  print(f"[{PROG}] {what} of {workdir} step {step} -> {out} ({len(files)} files)",
        file=sys.stderr, flush=True)
  return files


def main(argv: Sequence[str]) -> int:
  args = parse_args(argv)
  # pylint: disable=g-import-not-at-top
  from gigrl.cli import train as train_lib
  from gigrl.config_utils import UserError
  # pylint: enable=g-import-not-at-top
  try:
    export(args.workdir, args.out, step=args.step, peft=args.peft, dtype=args.dtype)
  except UserError as e:
    train_lib.fail(str(e))
  return 0


def run() -> None:
  """Console entry point (``gigrl-export``)."""
  if not os.path.basename(sys.argv[0]).startswith("gigrl-"):
    sys.argv[0] = PROG
  sys.exit(main(sys.argv[1:]))
