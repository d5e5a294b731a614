"""The console scripts' entry points (setup.py): huge pages first, then the tool.

Each re-executes the process once with transparent huge pages on (`gigrl.cli.huge_pages`),
before the tool's module (and JAX) is imported, then runs that module's ``run()``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

from gigrl.cli import huge_pages


def _entry(tool: str) -> Callable[[], None]:
  """The console entry point that runs ``gigrl.cli.<tool>.run()`` after `huge_pages.reexec`."""
  def run() -> None:
    huge_pages.reexec()
    importlib.import_module(f"gigrl.cli.{tool}").run()
  run.__doc__ = f"Console entry point over `gigrl.cli.{tool}.run` (huge pages first)."
  return run


train = _entry("train")                       # gigrl-train
convert = _entry("convert")                   # gigrl-convert-hf
compile_ = _entry("compile")                  # gigrl-compile
serve_retriever = _entry("serve_retriever")   # gigrl-serve-retriever
eval_ = _entry("eval")                        # gigrl-eval
sweep = _entry("sweep")                       # gigrl-sweep
fetch = _entry("fetch")                       # gigrl-fetch
export = _entry("export")                     # gigrl-export
