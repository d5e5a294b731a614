"""``gigrl-convert-hf``: a HF Qwen2/Llama checkpoint as an orbax checkpoint, over
:func:`gigrl.models.convert.convert`.

  gigrl-convert-hf --hf_dir /ckpt/Qwen2.5-0.5B --out /ckpt/qwen05_gigrl [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

from gigrl.models import convert as convert_lib


def run(argv: Sequence[str] | None = None) -> None:
  """Console entry point ``gigrl-convert-hf``."""
  p = argparse.ArgumentParser(prog="gigrl-convert-hf", description=__doc__.splitlines()[0])
  p.add_argument("--hf_dir", required=True, help="HF checkpoint directory")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="activation dtype recorded in the config")
  p.add_argument("--param_dtype", default=None, choices=("float32", "bfloat16"),
                 help="storage dtype (default: --dtype)")
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  cfg = convert_lib.convert(args.hf_dir, args.out, dtype=args.dtype,
                            param_dtype=args.param_dtype)
  print(f"converted {args.hf_dir} -> {args.out}: {cfg.num_params / 1e6:.1f}M params "
        f"in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
  run()
