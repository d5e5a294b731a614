"""The machine's micro-figures, printed beside a benchmark's ratio (issue #50).

A ratio against another framework measured on one machine need not hold on another of the
same kind: `benchmarks/vs_trl.py` printed 2.5x on one 2-core Xeon and 1.3x on another, where
XLA's decode-shaped matrix products were slower than torch's. So every run prints what decides
it: the CPU model, the decode step's shape of matrix product timed in XLA and in torch, and the
memory bandwidth (a copy of a 256 MiB array, counting bytes read and written).

And whether the second core adds arithmetic (`core_figures`): two single-threaded processes
multiplying matrices at once against one alone. On a 2-vCPU VM whose vCPUs share one physical
core that ratio is ~1.0 and no library gains from a second thread. Beside it, the decode
product on one thread in each library: what each gains from the second core at this shape.

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


def figures(rows: int = 8, d_in: int = 576, d_out: int = 1536, mib: int = 256,
            cores: bool = True) -> dict:
  """Micro-figures of this machine (seconds are the best of 20 calls).

  Returns:
    ``cpu``; ``gemm_xla_us`` / ``gemm_torch_us``: one f32[rows, d_in] @ f32[d_in, d_out] product
    (SmolLM2's decode shape: 8 rows, its MLP's up projection) in XLA and in torch (with its
    thread count), microseconds, and ``gemm_torch_1t_us`` on one torch thread;
    ``gemm_2048_torch_gflop_s``: a f32 2048^3 product's rate in torch (XLA's is
    ``_gemm_floor.gemm_peak_flops``, which the benchmarks print beside this line);
    with ``cores``, :func:`core_figures`' keys (~20 s); ``copy_gb_s``: GB/s of a jitted copy of ``mib`` MiB
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
      threads = torch.get_num_threads()
      torch.set_num_threads(1)
      try:
        out["gemm_torch_1t_us"] = 1e6 * _best(lambda: xt @ wt)
      finally:
        torch.set_num_threads(threads)
      # the large-GEMM rate torch (MKL) reaches here, beside XLA's: on the AMD EPYC MKL ran
      # at ~45% of XLA's rate, on the Xeon of issue #50 level with it
      big_t = torch.ones(2048, 2048)
      out["gemm_2048_torch_gflop_s"] = 2 * 2048 ** 3 / _best(lambda: big_t @ big_t, 5) / 1e9
    out["torch_threads"] = threads
  except ImportError:
    out["gemm_torch_us"] = None
  big = jnp.ones((mib << 20) // 4, jnp.float32)
  cp = jax.jit(lambda a: a + 0.0)
  out["copy_gb_s"] = 2 * big.nbytes / _best(lambda: cp(big).block_until_ready(), 5) / 1e9
  # a decode step reads its weights and writes little: the read rate is its bound (a copy's
  # writes into fresh pages run far slower than reads on these VMs: 5-8 against ~30 GB/s)
  total = jax.jit(jnp.sum)
  out["read_gb_s"] = big.nbytes / _best(lambda: total(big).block_until_ready(), 5) / 1e9
  if cores and hasattr(os, "sched_getaffinity"):
    try:
      out.update(core_figures(rows, d_in, d_out))
    except (RuntimeError, OSError, ValueError) as e:   # a figure, never the benchmark's failure
      out["core_figures_error"] = str(e)
  return out


# XLA on one thread (read at import), the process pinned to core CPU (set by each snippet)
_ONE_THREAD = r"""
import os, sys, time
os.sched_setaffinity(0, {CPU})
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
"""

_PINNED_GEMM = _ONE_THREAD.replace("{CPU}", "{int(sys.argv[1])}") + r"""
a = jnp.ones((512, 512), jnp.float32) * 1e-3
f = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda i, x: x @ a, a))
f(a).block_until_ready()
start = float(sys.argv[2])
while time.time() < start:
  time.sleep(0.001)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[3]):
  f(a).block_until_ready()
  n += 1
print(n * 20 * 2 * 512 ** 3 / (time.perf_counter() - t0) / 1e9)
"""

_ONE_THREAD_GEMM = _ONE_THREAD.replace("{CPU}", "{min(os.sched_getaffinity(0))}") + r"""
rows, d_in, d_out = (int(v) for v in sys.argv[1:4])
x = jnp.asarray(np.ones((rows, d_in), np.float32))
w = jnp.asarray(np.ones((d_in, d_out), np.float32) * 1e-3)
mm = jax.jit(lambda a, b: a @ b)
mm(x, w).block_until_ready()
best = float("inf")
for _ in range(20):
  t0 = time.perf_counter()
  mm(x, w).block_until_ready()
  best = min(best, time.perf_counter() - t0)
print(best * 1e6)
"""


def _python(code: str, *args, wait: bool = True):
  """Runs ``code`` in a fresh interpreter (XLA reads its flags once, at import); its last
  stdout line as a float, or the Popen when ``wait`` is False."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  return _last_float(proc) if wait else proc


def _last_float(proc) -> float:
  out, _ = proc.communicate()
  if proc.returncode:
    raise RuntimeError(f"micro-figure subprocess exited {proc.returncode}")
  return float(out.strip().splitlines()[-1])


def core_figures(rows: int = 8, d_in: int = 576, d_out: int = 1536,
                 seconds: float = 2.0) -> dict:
  """Does the second core add arithmetic, and does XLA's decode product use it?

  Returns:
    ``gemm_1core_gflop_s``: f32 512^3 products in XLA, one thread pinned to the first core,
    alone (GFLOP/s); ``core_scaling``: two such processes at once, one per core (the first
    two cores), their GFLOP/s summed over the one alone's (~1.0: the cores share their
    arithmetic, e.g. SMT siblings of one physical core, or another process holds one: with
    Linux's autogroups a `nice -n 19` job started from another session still takes its
    session's half of the CPU; ~2.0: two whole cores; None on one core); ``gemm_xla_1t_us``: the decode product (f32[rows, d_in] @ f32[d_in, d_out]) in XLA
    on one thread pinned to one core, microseconds (against ``gemm_xla_us``: what XLA gains
    from the second core at this shape).

  Splitting a decode's rows over 2 host devices (``--xla_force_host_platform_device_count=2``,
  the params on both) was measured on the 2-core AMD EPYC (core scaling 1.96x) and not taken:
  49.4 against 30.1 ms a SmolLM2 decode step at 8 rows, 112.0 against 101.5 at 64 (the same
  tokens).
  """
  import time as _time  # pylint: disable=import-outside-toplevel
  cpus = sorted(os.sched_getaffinity(0))
  alone = _python(_PINNED_GEMM, cpus[0], 0, seconds)
  out = {"gemm_1core_gflop_s": alone, "core_scaling": None}
  if len(cpus) >= 2:
    start = _time.time() + 8.0            # both have compiled by then
    procs = [_python(_PINNED_GEMM, c, start, seconds, wait=False) for c in cpus[:2]]
    out["core_scaling"] = sum(_last_float(p) for p in procs) / alone
  out["gemm_xla_1t_us"] = _python(_ONE_THREAD_GEMM, rows, d_in, d_out)
  return out


def line(f: dict) -> str:
  """The figures in one line."""
  torch_us = "n/a" if f.get("gemm_torch_us") is None else (
      f"{f['gemm_torch_us']:.0f} us ({f.get('torch_threads')} threads)")
  text = (f"machine: {f['cpu']}, {f['cores']} cores; {f['gemm_shape']}: XLA "
          f"{f['gemm_xla_us']:.0f} us, torch {torch_us}; copy bandwidth {f['copy_gb_s']:.1f} GB/s, "
          f"read {f.get('read_gb_s', float('nan')):.1f} GB/s")
  if f.get("gemm_2048_torch_gflop_s") is not None:
    text += f"; f32 2048^3 GEMM in torch {f['gemm_2048_torch_gflop_s']:.0f} GFLOP/s"
  if f.get("core_scaling") is not None:
    t1 = f.get("gemm_torch_1t_us")
    text += (f"; second core: {f['core_scaling']:.2f}x the arithmetic of one "
             f"({f['gemm_1core_gflop_s']:.0f} GFLOP/s a core); the product on 1 thread: XLA "
             f"{f['gemm_xla_1t_us']:.0f} us" + ("" if t1 is None else f", torch {t1:.0f} us"))
  return text


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from _gemm_floor import gemm_peak_flops  # pylint: disable=import-outside-toplevel
  print(line(figures()) + f"; f32 2048^3 GEMM in XLA {gemm_peak_flops() / 1e9:.0f} GFLOP/s")
