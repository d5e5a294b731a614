"""The persistent compilation cache (``train.compile_cache``): compiled programs kept on disk.

A program jax compiled once (a rollout's prefill, extend or decode at one bucketed shape, the
PPO step at one width) is written to the cache; a later process that meets the same program
(a resumed run, the next run of a sweep, ``gigrl-eval``, another seed) loads it instead of
compiling it again. On 2 CPU cores a SmolLM2 program costs 2-5 s to compile, and a savings-on
rollout meets a few dozen of them over a run. The cache key covers the program, the jax and
XLA versions, the backend and the devices, so a loaded executable is the one XLA would
compile: results do not change. jax's persistent cache (``jax_compilation_cache_dir``);
programs with host callbacks are never cached, and on several processes only process 0
writes entries.
"""
from __future__ import annotations

import os

import jax

from gigrl.config_utils import ConfigError, cache_root

ENV = "JAX_COMPILATION_CACHE_DIR"


def default_dir() -> str:
  """``<cache_root>/jax`` (:func:`gigrl.config_utils.cache_root`)."""
  return os.path.join(cache_root(), "jax")


def resolve(setting: str) -> str | None:
  """``train.compile_cache`` as a directory: 'auto' -> ``$JAX_COMPILATION_CACHE_DIR`` if set,
  else :func:`default_dir`; '' -> None (no cache); else the path (``~`` expanded; a ``gs://``
  URL as it is, for the hosts of a pod to share)."""
  if not setting:
    return None
  if setting == "auto":
    return os.environ.get(ENV) or default_dir()
  return os.path.expanduser(setting)


def enable(setting: str) -> str | None:
  """Points jax's persistent compilation cache at ``resolve(setting)``, or turns it off.

  Call it before the first compile of the process (a cache jax has already opened keeps its
  directory). Returns the directory, or None when the cache is off.

  Raises:
    ConfigError: naming ``train.compile_cache`` when its directory cannot be created.
  """
  path = resolve(setting)
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  try:
    if "://" not in path:          # gs://... : jax opens it through etils.epath
      os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError("train.compile_cache", setting,
                      f"'auto', '' (off) or a directory that can be created ({e.strerror})"
                      ) from e
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  return path
