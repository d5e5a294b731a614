"""Thread setup shared by the model benchmarks; import it before jax.

``--threads N`` (default 1) must act before jax is imported, because XLA reads XLA_FLAGS once.
With one thread the process is pinned to one core and XLA:CPU runs single-threaded, to match
``torch.set_num_threads(1)`` in the same run.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def threads_from_argv() -> int:
  """The value of --threads in sys.argv (default 1)."""
  for i, a in enumerate(sys.argv):
    if a.startswith("--threads="):
      return int(a.split("=", 1)[1])
    if a == "--threads" and i + 1 < len(sys.argv):
      return int(sys.argv[i + 1])
  return 1


THREADS = threads_from_argv()
if THREADS == 1:
  # Pin to one core too: XLA:CPU may still run independent ops concurrently.
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_cpu_multi_thread_eigen=false"
                             " intra_op_parallelism_threads=1").strip()
