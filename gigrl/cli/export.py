"""``gigrl-export``: a run's checkpoint as a Hugging Face directory, or its LoRA adapters for peft.

  gigrl-export --workdir runs/smollm2_lora --out exported/        # merged: transformers loads it
  gigrl-export --workdir runs/smollm2_lora --out adapters/ --peft # peft.PeftModel loads it

A thin layer over :func:`gigrl.training.trained.export` (what it writes is said there): the
merged directory holds config.json, model.safetensors and the run's tokenizer files;
``--peft`` writes adapter_config.json and adapter_model.safetensors.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

PROG = "gigrl-export"


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


def main(argv: Sequence[str]) -> int:
  args = parse_args(argv)
  # pylint: disable=g-import-not-at-top
  from gigrl.cli import train as train_lib
  from gigrl.config_utils import UserError
  from gigrl.training.trained import export
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
