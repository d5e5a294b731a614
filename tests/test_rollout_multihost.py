"""Both rollout engines on 2 processes x 2 CPU devices (gloo collectives) against 1 process x 4.

Each process passes its own 4 of the 8 questions and searches through the HTTP backend
(``HttpRetriever``) of one Search-R1 server that the test runs. Checked: the rows each process
gets back equal the matching rows of a 1-process x 4-device run (greedy decoding, so the two
runs must agree token for token); each process sent only its own rows' queries, and the server
received exactly the reference run's queries.

The host loop runs with every rollout saving on and with every one off (a group's prompt
prefilled once, the common prefix once, compacted rows, bucketed widths and slot spans):
both equal the reference.

Run as a script, this file is the worker: ``python tests/test_rollout_multihost.py OUT NPROC
PROC_ID PORT URL`` (NPROC=1: the single-process reference on 4 devices).
"""
import json
import os
import socket
import subprocess
import sys

import pytest

GLOBAL_ROWS = 8
# host_loop with every rollout saving on (the default) and off (rollout.* switches): the same rows.
ENGINES = ("host_loop", "host_loop_off")


class _Counting:
  """Records the queries a process sends through its retriever."""

  def __init__(self, inner):
    self.inner, self.queries = inner, []

  def search(self, queries, topk):
    self.queries += list(queries)
    return self.inner.search(queries, topk)

  def new_step(self):
    self.inner.new_step()

  def metrics(self):
    return self.inner.metrics()


def worker(out: str, nproc: int, proc_id: int, port: int, url: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  if nproc > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=proc_id)
  import numpy as np  # pylint: disable=import-outside-toplevel
  from gigrl import testing  # pylint: disable=import-outside-toplevel
  testing.cache_compiles_on_every_process()
  from gigrl.data import qa  # pylint: disable=import-outside-toplevel
  from gigrl.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  from gigrl.models import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import engine as engine_lib  # pylint: disable=import-outside-toplevel
  from gigrl.search import HttpRetriever  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == 4 and jax.process_count() == nproc
  tok = tok_lib.SentencePieceTokenizer()
  cfg, graphdef, state = testing.chatty_model(tok, seed=0, search_bias=3.0)
  mesh = sharding_lib.make_mesh({"fsdp": 4})
  params = sharding_lib.shard_state(jax.tree.map(np.asarray, state), mesh, "fsdp")
  settings = engine_lib.RolloutSettings(max_turns=2, max_new_tokens=12, max_obs_tokens=64,
                                        max_prompt_tokens=192, topk_docs=2, greedy=True)
  # Groups of 2 (a group's prompt is prefilled once) and 4 distinct questions.
  qs = [q.question for q in qa.load_bundled_questions()[:6]]
  questions = [qs[0], qs[0], qs[1], qs[1], qs[2], qs[3], qs[4], qs[5]]
  per = GLOBAL_ROWS // nproc
  mine = questions[proc_id * per:(proc_id + 1) * per]
  result = {}
  for kind in ENGINES:
    retriever = _Counting(HttpRetriever(url, timeout_s=60))
    engine = engine_lib.make_engine(kind.removesuffix("_off"), cfg, graphdef, tok, retriever,
                                    settings.all_off() if kind.endswith("_off") else settings,
                                    mesh=mesh)
    batch, metrics = engine.run(params, mine, jax.random.key(0))   # no ambient mesh needed
    result[kind] = {
        "tokens": batch.tokens.tolist(), "loss_mask": batch.loss_mask.tolist(),
        "step_ids": batch.step_ids.tolist(), "lengths": batch.lengths.tolist(),
        "search_calls": batch.search_calls.tolist(), "generated_text": batch.generated_text,
        "anchors": batch.anchors, "queries": retriever.queries,
        "generated_tokens": metrics["rollout/generated_tokens"]}
  with open(out, "w") as f:
    json.dump(result, f)
  if nproc > 1:
    jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(tmp_path, nproc: int, url: str) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // nproc}")
  port = _free_port()
  outs = [str(tmp_path / f"n{nproc}_p{i}.json") for i in range(nproc)]
  procs = [subprocess.Popen(
      [sys.executable, __file__, outs[i], str(nproc), str(i), str(port), url], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(nproc)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} of {nproc} failed:\n{logs[i][-4000:]}"
  results = []
  for o in outs:
    with open(o) as f:
      results.append(json.load(f))
  return results


@pytest.fixture()
def server():
  from gigrl.search import server as server_lib  # pylint: disable=import-outside-toplevel
  from gigrl.testing import FakeRetriever  # pylint: disable=import-outside-toplevel
  backend = FakeRetriever()
  srv, url = server_lib.serve_in_thread(backend)
  yield backend, url
  srv.shutdown()
  srv.server_close()


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path, server):
  backend, url = server
  (ref,) = _launch(tmp_path, 1, url)
  assert sorted(sum(backend.calls, [])) == sorted(
      q for kind in ENGINES for q in ref[kind]["queries"])
  backend.calls.clear()
  parts = _launch(tmp_path, 2, url)
  per = GLOBAL_ROWS // 2
  for kind in ENGINES:
    r = ref[kind]
    assert sum(r["search_calls"]) >= 2, "the reference must search for the check to bite"
    for p, part in enumerate(parts):
      got = part[kind]
      rows = slice(p * per, (p + 1) * per)
      for field in ("tokens", "loss_mask", "step_ids", "lengths", "search_calls",
                    "generated_text", "anchors"):
        assert got[field] == r[field][rows], (kind, p, field)
      # This process sent exactly its rows' queries.
      own = sorted(q for texts in r["generated_text"][rows] for q in _queries(texts))
      assert sorted(got["queries"]) == own, (kind, p)
    assert sorted(parts[0][kind]["queries"] + parts[1][kind]["queries"]) == sorted(r["queries"])
  # The server got each query once, from the process that owns its row.
  assert sorted(sum(backend.calls, [])) == sorted(
      q for part in parts for kind in ENGINES for q in part[kind]["queries"])
  assert ref["host_loop"]["tokens"] == ref["host_loop_off"]["tokens"]


def _queries(texts: list[str], max_turns: int = 2) -> list[str]:
  """Queries of a row's executed searches (a search in the final turn is not run)."""
  from gigrl.rollout import protocol  # pylint: disable=import-outside-toplevel
  actions = [protocol.parse_action(text) for text in texts[:max_turns]]
  return [q for kind, q in actions if kind == "search"]


if __name__ == "__main__":
  worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
