"""The machine's micro-figures, printed beside a benchmark's ratio (issue #50).

A ratio against another framework measured on one machine need not hold on another of the
same kind: `benchmarks/vs_trl.py` printed 2.5x on one 2-core Xeon and 1.3x on another, where
XLA's decode-shaped matrix products were slower than torch's. So every run prints what decides
it: the CPU model, the decode step's shape of matrix product timed in XLA and in torch, and the
memory bandwidth (a copy of a 256 MiB array, counting bytes read and written).

  python benchmarks/_machine.py          # the figures alone
"""
from __future__ import annotations

import json
import os
import platform
import time


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def write_record(path: str | None, script: str, argv: list[str], *, machine_key: str = "machine",
                 **fields) -> None:
  """Writes a benchmark's JSON record to ``path`` (nothing when it is empty): the command that
  made it (``python benchmarks/<script> <argv>``), this machine (CPU model and core count, under
  ``machine_key``), then ``fields``."""
  if not path:
    return
  doc = {"command": " ".join(["python", f"benchmarks/{script}", *argv]),
         machine_key: f"{cpu_model()}, {os.cpu_count()} cores", **fields}
  with open(path, "w") as f:
    json.dump(doc, f, indent=1)


def _best(fn, repeats: int = 20) -> float:
  fn()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def figures(rows: int = 8, d_in: int = 576, d_out: int = 1536, mib: int = 256) -> dict:
  """Micro-figures of this machine (seconds are the best of 20 calls).

  Returns:
    ``cpu``; ``gemm_xla_us`` / ``gemm_torch_us``: one f32[rows, d_in] @ f32[d_in, d_out] product
    (SmolLM2's decode shape: 8 rows, its MLP's up projection) in XLA and in torch (with its
    thread count), microseconds; ``copy_gb_s``: GB/s of a jitted copy of ``mib`` MiB
    (read + write) in XLA; ``read_gb_s``: GB/s of a jitted sum of it (read only); ``cores``.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  x = np.random.default_rng(0).standard_normal((rows, d_in)).astype(np.float32)
  w = np.random.default_rng(1).standard_normal((d_in, d_out)).astype(np.float32)
  xj, wj = jnp.asarray(x), jnp.asarray(w)
  mm = jax.jit(lambda a, b: a @ b)
  out = {"cpu": cpu_model(), "cores": os.cpu_count(),
         "gemm_shape": f"f32[{rows},{d_in}] @ f32[{d_in},{d_out}]",
         "gemm_xla_us": 1e6 * _best(lambda: mm(xj, wj).block_until_ready())}
  try:
    import torch  # pylint: disable=import-outside-toplevel
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    with torch.no_grad():
      out["gemm_torch_us"] = 1e6 * _best(lambda: xt @ wt)
    out["torch_threads"] = torch.get_num_threads()
  except ImportError:
    out["gemm_torch_us"] = None
  big = jnp.ones((mib << 20) // 4, jnp.float32)
  cp = jax.jit(lambda a: a + 0.0)
  out["copy_gb_s"] = 2 * big.nbytes / _best(lambda: cp(big).block_until_ready(), 5) / 1e9
  # a decode step reads its weights and writes little: the read rate is its bound (a copy's
  # writes into fresh pages run far slower than reads on these VMs: 5-8 against ~30 GB/s)
  total = jax.jit(jnp.sum)
  out["read_gb_s"] = big.nbytes / _best(lambda: total(big).block_until_ready(), 5) / 1e9
  return out


def line(f: dict) -> str:
  """The figures in one line."""
  torch_us = "n/a" if f.get("gemm_torch_us") is None else (
      f"{f['gemm_torch_us']:.0f} us ({f.get('torch_threads')} threads)")
  return (f"machine: {f['cpu']}, {f['cores']} cores; {f['gemm_shape']}: XLA "
          f"{f['gemm_xla_us']:.0f} us, torch {torch_us}; copy bandwidth {f['copy_gb_s']:.1f} GB/s, "
          f"read {f.get('read_gb_s', float('nan')):.1f} GB/s")


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  print(line(figures()))
