"""Transparent huge pages for XLA:CPU's large host buffers: one re-exec at start-up.

On the CPU backend every program execution allocates its large buffers afresh: the KV cache's
row and span copies around each decode call, the update's activations and gradients, the
optimizer's outputs. glibc serves an allocation above its mmap threshold (at most 32 MiB) with a
new ``mmap`` and returns it with ``munmap``, so each 4 KiB page of those buffers faults (and is
zeroed by the kernel) on first touch, at every step. glibc >= 2.35 can ask the kernel for
transparent huge pages on the memory it maps (the ``glibc.malloc.hugetlb=1`` tunable, an
``madvise(MADV_HUGEPAGE)``, which THP's usual ``madvise`` mode honours): the same bytes in
2 MiB pages, far fewer faults. Measured on the vs_trl --quick gigrl run (2 prompts x 4 rows, 4 RL
steps, SmolLM2-135M, 2-core Xeon): 4.57M minor page faults -> 1.19M; ``benchmarks/huge_pages.py``
times the steps side by side.

glibc reads its tunables once, when the dynamic loader starts the process, so the console
scripts (``gigrl.cli.entry``) and the benchmarks re-execute themselves once with the tunable
added to ``GLIBC_TUNABLES``, before anything heavy is imported. Nothing changes where the tunable
is unknown (an older glibc ignores it) or THP is off. ``GIGRL_HUGE_PAGES=0`` opts out. A Python
process started otherwise (a notebook, ``python -m``) runs as it was started; set
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` before starting it to get the same.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

TUNABLES = ("glibc.malloc.hugetlb=1",)
OPT_OUT = "GIGRL_HUGE_PAGES"


def environment(env: Mapping[str, str], platform: str = sys.platform) -> dict[str, str] | None:
  """The environment to re-execute with, or None when there is nothing to do.

  Args:
    env: the current environment (``os.environ``).
    platform: ``sys.platform``; only "linux" has glibc tunables.
  Returns:
    A copy of ``env`` with each of ``TUNABLES`` that ``GLIBC_TUNABLES`` does not set yet appended
    (colon-separated, the glibc syntax), or None on another platform, with
    ``GIGRL_HUGE_PAGES=0``, or when ``GLIBC_TUNABLES`` already sets every one of them (to the
    user's values, or by this process's own re-exec: it never loops).
  """
  if not platform.startswith("linux") or env.get(OPT_OUT, "1") == "0":
    return None
  current = env.get("GLIBC_TUNABLES", "")
  names = {t.split("=", 1)[0] for t in current.split(":") if t}
  missing = [t for t in TUNABLES if t.split("=", 1)[0] not in names]
  if not missing:
    return None
  out = dict(env)
  out["GLIBC_TUNABLES"] = ":".join(([current] if current else []) + missing)
  return out


def reexec(argv: Sequence[str] | None = None) -> None:
  """Replaces this process by itself with huge pages on (see the module docstring).

  Returns only when there is nothing to do (`environment` is None) or the process cannot be
  re-executed (no ``sys.executable``, or ``exec`` failed: it then runs on as it was).

  Args:
    argv: the full command line to run again, interpreter first; default
      ``sys.orig_argv`` (keeps ``-c``, ``-m`` and interpreter options).
  """
  env = environment(os.environ)
  if env is None or not sys.executable:
    return
  argv = list(argv if argv is not None else sys.orig_argv)
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable] + argv[1:], env)
  except OSError:
    return
