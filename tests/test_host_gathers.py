"""The host gathers of a run on several processes (gigrl/distributed.py) on 2 processes x 1 CPU
device (gloo): exact (every process gets every process's bytes, in order), and compile-free after
``warm_up_gathers``: a gather the size of a SmolLM2 rollout's token rows (64 x 1280 int32, 320 KiB)
compiles nothing once the warm-up has run, and compiles without it (jax's process_allgather builds
one program per shape; the gathers pad to a few sizes, which the warm-up runs before step 1).

Run as a script, this file is one process: ``python tests/test_host_gathers.py WARM_UP OUT``.
"""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(warm_up: bool, out: str) -> None:
  """One process: the gathers, with their compile events counted after the (optional) warm-up."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from gigrl import distributed  # pylint: disable=import-outside-toplevel
  distributed.initialize()
  me = jax.process_index()
  rows = np.full((64, 1280), me + 1, np.int32)
  distributed.gather_rows(np.zeros(3, np.int64))      # a small gather first, as a run's set-up
  n = distributed.warm_up_gathers(rows.nbytes) if warm_up else 0
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, **kw: compiles.append(kw.get("fun_name", "?"))
      if event == "/jax/core/compile/backend_compile_duration" else None)
  got = distributed.gather_rows(rows)
  objs = distributed.gather_objects([f"p{me}"] * (me + 1))
  flag = distributed.any_process(me == 1)
  with open(out, "w") as f:
    json.dump({"sizes": n, "compiles": compiles, "shape": list(got.shape),
               "firsts": [int(got[0, 0]), int(got[64, 0])], "sum": int(got.sum()),
               "objs": objs, "flag": flag}, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(tmp_path, warm_up: bool) -> list[dict]:
  port = _free_port()
  procs, outs = [], []
  for i in range(2):
    out = str(tmp_path / f"{int(warm_up)}_{i}.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", GIGRL_COORDINATOR=f"127.0.0.1:{port}",
               GIGRL_NUM_PROCESSES="2", GIGRL_PROCESS_ID=str(i))
    env.pop("XLA_FLAGS", None)
    procs.append(subprocess.Popen([sys.executable, __file__, str(int(warm_up)), out], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
    outs.append(out)
  for p in procs:
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
  return [json.load(open(o)) for o in outs]


def test_host_gathers_are_exact_and_compile_nothing_after_the_warm_up(tmp_path):
  warm = _run(tmp_path, True)
  for r in warm:
    assert r["shape"] == [128, 1280] and r["firsts"] == [1, 2]
    assert r["sum"] == 64 * 1280 * 3
    assert r["objs"] == ["p0", "p1", "p1"] and r["flag"] is True
    assert r["sizes"] == 8                  # 4 KiB ... 512 KiB
    assert r["compiles"] == [], r["compiles"]
  cold = _run(tmp_path, False)
  assert all(r["compiles"] for r in cold), cold    # the 512 KiB gather is first met here


if __name__ == "__main__":
  worker(sys.argv[1] == "1", sys.argv[2])
