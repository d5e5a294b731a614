"""pytest setup: 8 simulated CPU devices for the sharding tests, and one JAX compilation cache.

XLA reads the flag once, when the backend starts, so it is set here before any
test module imports jax.

The persistent compilation cache (a fresh directory per session, removed at exit; set
``JAX_COMPILATION_CACHE_DIR`` to keep one across sessions) is inherited by the subprocesses
that the end-to-end tests start: every ``gigrl-train`` run of the tiny config compiles the
same programs, and all runs after the first load them instead (a tiny smoke run: ~29 s of CPU
cold, ~11 s warm). A cached executable is the one XLA compiled, so results are unchanged;
programs with host callbacks are never cached (jax skips them).
"""
import atexit
import os
import shutil
import tempfile


_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile hundreds of tiny programs whose run time is negligible: most of the suite's
# CPU goes to XLA's compiler. jax_disable_most_optimizations sets only XLA's *backend* (LLVM)
# optimization level to 0 (jax/_src/compiler.py): the HLO programs, and so what is computed, are
# those a user runs; only the generated machine code is less optimised. It cuts the CPU time of
# the compile-bound files by ~30% (test_model + test_sampler: 85 -> 57 CPU-s). Inherited by the
# subprocesses (gigrl-train runs, notebook kernels); the TPU compile tests turn it off, so their
# memory figures are those of a real `gigrl-compile`.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")



def _session_dir(var: str, prefix: str) -> None:
  """Sets ``var`` (unless set) to a fresh directory removed at exit; subprocesses inherit it."""
  if var not in os.environ:
    os.environ[var] = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, os.environ[var], ignore_errors=True)


_session_dir("JAX_COMPILATION_CACHE_DIR", "gigrl-test-jax-cache-")
# gigrl's own caches (the BM25 index of the bundled corpus, built once per session instead of
# once per gigrl-train run): a fresh directory too, so ~/.cache is never touched by the tests.
_session_dir("GIGRL_CACHE_DIR", "gigrl-test-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# The slowest test files, longest first (seconds of test time per file in a whole-suite run on 2
# cores, 2026-11-29, d60cc0f, `--durations=0`). `--dist loadfile --no-loadscope-reorder`
# (pytest.ini) hands files to the workers in collection order, so starting these first lets the
# many short files fill the end instead of one long file running alone at the tail (xdist's
# default order is by test count, which put the 3-test test_multihost.py last).
SLOWEST_FIRST = (
    "test_async.py",            # 602 s: sampler processes, killed processes, pinned k = 0
    "test_rollout_compute.py",  # 428 s: SmolLM2 greedy on = off, its SFT fixture
    "test_multihost.py",        # 289 s: 2-process runs, SIGTERM, kill -9, resume
    "test_resume.py",           # 286 s: SIGKILL at random points, SIGTERM, Ctrl-C, corrupt
    "test_lora.py",             # 268 s
    "test_sign_check.py",       # 196 s
    "test_warmup.py",           # 143 s
    "test_notebooks.py",        # 124 s: three notebooks through a kernel
    "test_recipes.py",          # 120 s
    "test_sweep.py",            # 113 s
    "test_tpu_aot.py",          # 109 s
    "test_smollm2_recipe.py",   # 102 s
    "test_eval.py",             # 97 s
    "test_ppo_minibatch.py",    # 83 s
    "test_update_widths.py",    # 80 s
)


def pytest_collection_modifyitems(items):
  """Longest test files first (a stable sort: the rest keep their order)."""
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))



# --dist loadfile with a worker that dies: its test reruns once, the run never hangs, and a run
# stopped by dead workers fails (tests/_xdist_crash_retry.py; pytest.ini).
from _xdist_crash_retry import pytest_sessionfinish, pytest_xdist_make_scheduler  # noqa: E402,F401
