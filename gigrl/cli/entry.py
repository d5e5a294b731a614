"""The console scripts' entry points (setup.py): huge pages first, then the tool.

Each re-executes the process once with transparent huge pages on (`gigrl.cli.huge_pages`),
before the tool's module (and JAX) is imported, then runs the tool's ``run()``.
"""
from __future__ import annotations

import importlib

from gigrl.cli import huge_pages


def _run(tool: str) -> None:
  huge_pages.reexec()
  importlib.import_module(f"gigrl.cli.{tool}").run()


def train() -> None:
  """``gigrl-train`` (`gigrl.cli.train`)."""
  _run("train")


def convert() -> None:
  """``gigrl-convert-hf`` (`gigrl.cli.convert`)."""
  _run("convert")


def compile_() -> None:
  """``gigrl-compile`` (`gigrl.cli.compile`)."""
  _run("compile")


def serve_retriever() -> None:
  """``gigrl-serve-retriever`` (`gigrl.cli.serve_retriever`)."""
  _run("serve_retriever")


def eval_() -> None:
  """``gigrl-eval`` (`gigrl.cli.eval`)."""
  _run("eval")


def sweep() -> None:
  """``gigrl-sweep`` (`gigrl.cli.sweep`)."""
  _run("sweep")


def fetch() -> None:
  """``gigrl-fetch`` (`gigrl.cli.fetch`)."""
  _run("fetch")


def export() -> None:
  """``gigrl-export`` (`gigrl.cli.export`)."""
  _run("export")
