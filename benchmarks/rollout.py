"""Rollout engines side by side: ``host_loop`` vs ``callback`` (one jitted program).

Same tiny random model, same bundled questions (``gigrl.data.qa.load_bundled_questions``), same
BM25 retriever over the bundled corpus (``BM25Retriever.from_corpus('bundled')``), same settings.
For each batch size, each engine is run once to compile (not timed) and then ``--repeats`` times.
The table gives generated tokens/s, the share of wall time spent in search (retriever call +
observation tokenisation; for the callback engine, the wall time during which at least one
shard's search was running) and each engine's throughput relative to the host loop. The
callback engine runs with each ``boundary`` mode in ``--boundaries`` (``turn``: host-loop
schedule per shard; ``step``: rows never wait).

The model is made "chatty" (its LM head only scores the Search-R1 tags, EOS and a few words, and
the layer weights are scaled up), so greedy rollouts really search and answer; a plain random
model almost never emits ``<search>``. Decoding is greedy by default, so both engines produce the
same trajectories and do the same work. The numbers say nothing about a real model on a TPU:
on a CPU the decode step of a tiny model is cheap, so fixed per-step and per-call costs weigh more.

Run:  python benchmarks/rollout.py --quick            (about a minute on 2 CPU cores)
      python benchmarks/rollout.py --devices 8 --batch-sizes 8,32,64
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="small settings: batch sizes 8,32; 2 turns; 16 tokens per turn; 1 repeat")
  p.add_argument("--batch-sizes", default="8,32,64")
  p.add_argument("--devices", type=int, default=1,
                 help="simulated CPU devices; the callback engine shards the batch over them")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--boundaries", default="turn,step",
                 help="callback-engine boundary modes to run (see gigrl.rollout.callback)")
  p.add_argument("--max-turns", type=int, default=4)
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--max-obs-tokens", type=int, default=128)
  p.add_argument("--topk", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--search-bias", type=float, default=1.6,
                 help="scale of the <search>/</search> LM-head columns (1.0: few searches)")
  p.add_argument("--search-latency-ms", type=float, default=0.0,
                 help="sleep added to every retriever call (a remote retriever stand-in)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="0 = greedy (default): both engines then produce identical rollouts, "
                      "so they do the same work")
  args = p.parse_args(argv)
  if args.quick:
    args.batch_sizes, args.max_turns, args.max_new_tokens, args.repeats = "8,32", 2, 16, 1
  return args


class SlowRetriever:
  """Adds a fixed latency to every ``search`` call (stand-in for an HTTP retriever)."""

  def __init__(self, inner, seconds: float):
    self.inner, self.seconds = inner, seconds

  def search(self, queries, topk):
    time.sleep(self.seconds)
    return self.inner.search(queries, topk)

  def new_step(self) -> None:
    self.inner.new_step()

  def metrics(self) -> dict[str, float]:
    return self.inner.metrics()


def time_engine(engine, state, questions, repeats: int, seed: int) -> dict[str, float]:
  """Compiles with one untimed run, then sums ``repeats`` timed runs."""
  import jax  # pylint: disable=import-outside-toplevel
  engine.run(state, questions, jax.random.key(seed))
  wall = tokens = search = searches = 0.0
  for r in range(repeats):
    t0 = time.perf_counter()
    batch, metrics = engine.run(state, questions, jax.random.key(seed + 1 + r))
    wall += time.perf_counter() - t0
    tokens += float(batch.num_generated_tokens)
    search += metrics["time/search_s"]
    searches += float(batch.search_calls.sum())
  return {"wall": wall, "tokens": tokens, "search": search, "searches": searches}


def main(argv=None) -> None:
  args = parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=import-outside-toplevel
  from gigrl.data import qa  # pylint: disable=import-outside-toplevel
  from gigrl.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import engine as engine_lib  # pylint: disable=import-outside-toplevel
  from gigrl import testing  # pylint: disable=import-outside-toplevel
  from gigrl.search import BM25Retriever  # pylint: disable=import-outside-toplevel

  tok = tok_lib.SentencePieceTokenizer()
  cfg, graphdef, state = testing.chatty_model(tok, args.seed, args.search_bias)
  retriever = BM25Retriever.from_corpus("bundled")
  if args.search_latency_ms:
    retriever = SlowRetriever(retriever, args.search_latency_ms / 1e3)
  all_q = [q.question for q in qa.load_bundled_questions()]
  settings = engine_lib.RolloutSettings(
      max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
      max_obs_tokens=args.max_obs_tokens, max_prompt_tokens=192, topk_docs=args.topk,
      temperature=args.temperature or 1.0, greedy=args.temperature == 0)
  args_ = (cfg, graphdef, tok, retriever, settings)
  engines = {"host_loop": engine_lib.make_engine("host_loop", *args_)}
  for boundary in args.boundaries.split(","):
    engines[f"cb:{boundary}"] = engine_lib.make_engine("callback", *args_, boundary=boundary)
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} device(s); "
        f"model {cfg.num_params:,} params; "
        f"max_turns={settings.max_turns} max_new_tokens={settings.max_new_tokens} "
        f"max_obs_tokens={settings.max_obs_tokens} topk={settings.topk_docs} "
        f"{'greedy' if settings.greedy else f'temperature={settings.temperature}'}; "
        f"retriever BM25 (bundled) + {args.search_latency_ms:g} ms/call; "
        f"{args.repeats} timed run(s) per cell, after one compile run", flush=True)
  header = (f"{'batch':>5} | {'engine':>9} | {'gen tok/s':>9} | {'search %':>8} | "
            f"{'searches':>8} | {'wall s':>7} | {'tok/s vs host_loop':>18}")
  rows = []
  for bs in [int(x) for x in args.batch_sizes.split(",")]:
    questions = [all_q[i % len(all_q)] for i in range(bs)]
    res = {name: time_engine(e, state, questions, args.repeats, args.seed)
           for name, e in engines.items()}
    tps = {k: v["tokens"] / v["wall"] for k, v in res.items()}
    for name, r in res.items():
      ratio = f"{tps[name] / tps['host_loop']:.2f}x"
      rows.append(f"{bs:>5} | {name:>9} | {tps[name]:>9.0f} | "
                  f"{100 * r['search'] / r['wall']:>7.1f}% | {r['searches']:>8.0f} | "
                  f"{r['wall']:>7.2f} | {ratio:>18}")
      print(rows[-1], flush=True)
  print("\n" + header + "\n" + "-" * len(header) + "\n" + "\n".join(rows))


if __name__ == "__main__":
  sys.exit(main())
