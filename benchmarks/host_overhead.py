"""Host work of one RL step at Search-R1's batch, with a scripted instant policy.

Usage: ``python benchmarks/host_overhead.py [--quick] [--retriever bm25|http|both]``

Search-R1's batch: 512 prompts x 5 rollouts, ``max_turns`` 4, responses and
observations up to 500 tokens, three passages per search. The policy is a
script: each turn it "generates" (instantly, as token ids) a think paragraph
of a few hundred tokens and then ``<search> query </search>`` (a query built
from the question) or, at a random turn, ``<answer> .. </answer>``; a few
turns emit no tag (invalid action). Everything else is gigrl's real RL-step
host path, in the trainer's order:

* ``prompts``: chat template + tokenisation (``turns.encode_prompts``);
* ``decode text``: detokenising each generated turn;
* ``parse + record``: tag parsing and the trajectory records
  (``turns.dispatch_turn`` minus the other stages it calls);
* ``search``: the retriever (in-process BM25 over the bundled corpus, or HTTP
  to ``gigrl-serve-retriever`` on localhost);
* ``obs tokenize``: formatting and tokenising the passages;
* ``collate``: padding each turn's observations and ``trajectory.collate``;
* ``reward``: exact match (``reward_lib.rollout_rewards``);
* ``pool``: query pool sample/update and ``batch_lib.train_rows``;
* ``anchors + inputs``: ``adv_inputs.advantage_inputs`` with the GiGPO search
  recipe's similarity anchors (threshold 0.9);
* ``advantages``: the jitted ``compute_advantages`` (input transfer included);
* ``token gather``: ``batch_lib.train_batch`` (token advantages).

Times are wall seconds of one step (after an untimed warm-up step), with the
process-CPU total beside them. Budget: <= 10 s per 2,560 trajectories on this
machine, printed beside the accelerator step it overlaps with: ``ACCEL_FLOOR_S``,
the roofline floor that ``gigrl-compile`` gives for Qwen2.5-3B at this batch on
v5e-64 (docs/tpu.md), where the host path is also split over 16 hosts.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import socket
import subprocess
import sys
import time

# Host work only: the CPU backend, set before jax reads it (with the `tpu` extra installed, jax
# would otherwise probe for a TPU and print libtpu's start-up errors).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np

from gigrl.advantages import inputs as adv_inputs
from gigrl.rollout import reward as reward_lib
from gigrl.update import batch as batch_lib
from gigrl.advantages import compose as adv_compose
from gigrl.data import pool as pool_lib
from gigrl.data import qa
from gigrl.data import tokenizer as tok_lib
from gigrl.rollout import protocol
from gigrl.rollout import trajectory as traj_lib
from gigrl.rollout import turns
from gigrl.search import bm25

# Roofline floor of the Search-R1 3B step on v5e-64 (docs/tpu.md): two PPO mini-batch updates of
# >= 12 s each, and >= 4.4 s per 500-token decode turn, 4 turns. A floor, not a forecast.
ACCEL_FLOOR_S = 2 * 12.0 + 4 * 4.4
V5E_64_HOSTS = 16

STAGES = ("prompts", "decode text", "parse + record", "search",
          "obs tokenize", "collate", "reward", "pool", "anchors + inputs",
          "advantages", "token gather")


class Clock:
  """Accumulates wall and process-CPU seconds per stage (nested stages are
  subtracted from their parent)."""

  def __init__(self):
    self.wall = collections.defaultdict(float)
    self.cpu = collections.defaultdict(float)
    self._stack: list[list] = []

  @contextlib.contextmanager
  def stage(self, name):
    entry = [name, time.perf_counter(), time.process_time(), 0.0, 0.0]
    self._stack.append(entry)
    try:
      yield
    finally:
      self._stack.pop()
      dw = time.perf_counter() - entry[1]
      dc = time.process_time() - entry[2]
      self.wall[name] += dw - entry[3]
      self.cpu[name] += dc - entry[4]
      if self._stack:
        self._stack[-1][3] += dw
        self._stack[-1][4] += dc

  def clear(self):
    self.wall.clear()
    self.cpu.clear()


class TimedTokenizer:
  """The real tokenizer; decode and encode time go to the current stage."""

  def __init__(self, tok, clock):
    self._tok, self._clock = tok, clock
    self.encode_stage = "obs tokenize"

  def __getattr__(self, name):
    return getattr(self._tok, name)

  def decode(self, ids):
    with self._clock.stage("decode text"):
      return self._tok.decode(ids)

  def encode(self, text):
    with self._clock.stage(self.encode_stage):
      return self._tok.encode(text)


class TimedRetriever:
  def __init__(self, retriever, clock):
    self._r, self._clock = retriever, clock

  def search(self, queries, topk):
    with self._clock.stage("search"):
      return self._r.search(queries, topk)


class ScriptedPolicy:
  """Token ids of realistic Search-R1 turns, produced instantly."""

  def __init__(self, tok, max_new_tokens, seed=0):
    self.tok, self.max_new = tok, max_new_tokens
    self.rng = random.Random(seed)
    words = " ".join(d.contents for d in qa.load_bundled_corpus()[:300]).split()
    self.words = words

  def think(self, n_words):
    start = self.rng.randrange(len(self.words) - n_words)
    return "<think> " + " ".join(self.words[start:start + n_words]) + " </think>\n"

  def turn(self, question, golden, turn, max_turns):
    """One turn's text: think + search / answer / no tag (invalid)."""
    q_words = question.split()
    r = self.rng.random()
    if turn == max_turns or (turn >= 1 and r < 0.35):
      answer = golden if self.rng.random() < 0.4 else self.rng.choice(q_words)
      tail = f"<answer> {answer} </answer>"
    elif r > 0.95:
      tail = "I should look this up."                       # invalid action
    else:
      k = self.rng.randrange(3, len(q_words) + 1)
      tail = f"<search> {' '.join(self.rng.sample(q_words, min(k, len(q_words))))} </search>"
    text = self.think(self.rng.randrange(60, 300)) + tail
    ids = self.tok.encode(text)
    if len(ids) > self.max_new:                     # keep the tag at the end
      tail_ids = self.tok.encode(tail)
      ids = ids[:self.max_new - len(tail_ids)] + tail_ids
    return ids


def scripted_rollout(questions, golden, policy, tok, retriever, settings,
                     clock):
  """HostLoopEngine.run's host work with the decode replaced by the script."""
  b = len(questions)
  records = [traj_lib.TrajectoryBuilder() for _ in range(b)]
  tok.encode_stage = "prompts"
  with clock.stage("prompts"):
    prompts = turns.encode_prompts(tok, questions, settings.max_prompt_tokens)
    for rec, ids, q in zip(records, prompts, questions):
      rec.add_prompt(ids, anchor=q)
  with clock.stage("collate"):
    turns.pad_rows(prompts, b, settings.max_prompt_tokens, tok.pad_id)
  invalid_ids = traj_lib.invalid_observation_ids(tok._tok)
  active = np.ones(b, bool)
  for turn in range(settings.max_turns + 1):
    rows = np.flatnonzero(active)
    tok.encode_stage = "untimed"                    # the script's own encoding
    gens = [policy.turn(questions[i], golden[i], turn, settings.max_turns)
            for i in rows]
    tok.encode_stage = "obs tokenize"
    with clock.stage("parse + record"):
      outcome = turns.dispatch_turn(
          [records[i] for i in rows], gens, tokenizer=tok, retriever=retriever,
          settings=settings, invalid_ids=invalid_ids)
    obs = [[] for _ in range(b)]
    for i, ids, done in zip(rows, outcome.observations, outcome.done):
      obs[i], active[i] = ids, not done
    if turn == settings.max_turns or not active.any():
      break
    with clock.stage("collate"):
      turns.pad_rows(obs, b, settings.obs_width, tok.pad_id)
  with clock.stage("collate"):
    return traj_lib.collate(records, settings.seq_len, tok.pad_id)


def rl_step(data, pool, policy, tok, retriever, settings, adv, clock, g, p):
  adv_cfg, adv_fn, adv_state = adv
  with clock.stage("pool"):
    cands = pool.sample()
  questions = [data[int(i)] for i in cands]
  padded = questions + [questions[-1]] * (pool.num_candidates - len(questions))
  batch = scripted_rollout(
      [q.question for q in padded for _ in range(g)],
      [q.golden_answers[0] for q in padded for _ in range(g)],
      policy, tok, retriever, settings, clock)
  with clock.stage("reward"):
    rewards = reward_lib.rollout_rewards(batch, [q.golden_answers
                                               for q in questions], g)
  with clock.stage("pool"):
    accepted, _ = pool.update(cands, rewards)
    rows, valid = batch_lib.train_rows(cands, accepted, p, g)
  with clock.stage("anchors + inputs"):
    inputs = adv_inputs.advantage_inputs(
        batch, rewards, rows, valid, settings.max_turns + 1,
        anchor_grouping="similarity",
        similarity_thresh=adv_cfg.gigpo_similarity_thresh)
  with clock.stage("advantages"):
    a, _, _ = adv_fn(inputs, adv_state)
    a = np.asarray(a)
  with clock.stage("token gather"):
    batch_lib.train_batch(batch, rows, valid, a)
  return batch


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def http_retriever():
  from gigrl.search import http_client  # pylint: disable=import-outside-toplevel
  port = free_port()
  server = subprocess.Popen(
      [sys.executable, "-m", "gigrl.cli.serve_retriever", "--port", str(port)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    url = f"http://127.0.0.1:{port}/retrieve"
    client = http_client.HttpRetriever(url)
    for _ in range(120):
      try:
        client.search(["warm up"], 3)
        break
      except Exception:  # pylint: disable=broad-except
        time.sleep(1.0)
    yield client
  finally:
    server.terminate()
    server.wait(timeout=30)


def run(name, retriever, args):
  settings = turns.RolloutSettings(
      max_turns=args.max_turns, max_new_tokens=args.tokens,
      max_obs_tokens=args.tokens, max_prompt_tokens=512, topk_docs=3)
  tok_raw = tok_lib.load("bundled")
  clock = Clock()
  tok = TimedTokenizer(tok_raw, clock)
  policy = ScriptedPolicy(tok_raw, args.tokens)
  data = qa.load_bundled_questions()
  g, p = args.group_size, args.prompts
  pool = pool_lib.QueryPool(len(data), rule="grpo", batch_size=p)
  cfg = adv_compose.default_config()
  cfg.step = "gigpo"
  acfg = adv_compose.AdvantageConfig.from_config(cfg)
  adv = (acfg, jax.jit(lambda x, s: adv_compose.compute_advantages(acfg, x, s)),
         adv_compose.init_state(acfg))
  timed = TimedRetriever(retriever, clock)
  rl_step(data, pool, policy, tok, timed, settings, adv, clock, g, p)  # warm
  clock.clear()
  t0, c0 = time.perf_counter(), time.process_time()
  batch = rl_step(data, pool, policy, tok, timed, settings, adv, clock, g, p)
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  for d in (clock.wall, clock.cpu):
    d.pop("untimed", None)
  total_w, total_c = sum(clock.wall.values()), sum(clock.cpu.values())
  n = p * g
  print(f"\n{name}: {p} x {g} = {n} trajectories, max_turns {args.max_turns}, "
        f"{args.tokens}-token responses/observations; "
        f"{int(batch.search_calls.sum())} searches, "
        f"{int(batch.num_generated_tokens)} generated tokens")
  print(f"{'stage':<20}{'CPU s':>8}{'share':>8}{'wall s':>9}")
  print("-" * 45)
  for st in sorted(clock.cpu, key=lambda k: -clock.cpu[k]):
    print(f"{st:<20}{clock.cpu[st]:>8.2f}{clock.cpu[st] / total_c:>8.0%}"
          f"{clock.wall[st]:>9.2f}")
  print("-" * 45)
  print(f"{'host path':<20}{total_c:>8.2f}{'':>8}{total_w:>9.2f}")
  print(f"(whole step incl. the script: CPU {cpu:.2f} s, wall {wall:.2f} s; "
        f"budget 10 s per 2,560 trajectories = {10 * n / 2560:.1f} s here; "
        "CPU time is the robust figure on a shared machine)")
  if (n, args.max_turns, args.tokens) == (2560, 4, 500):   # the batch and lengths of that floor
    print(f"(beside the accelerator: the Search-R1 3B step on v5e-64 takes >= {ACCEL_FLOOR_S:.1f} s "
          f"(roofline floor, docs/tpu.md); this host path is {total_c / ACCEL_FLOOR_S:.0%} of it on "
          f"one host, ~{total_c / V5E_64_HOSTS:.2f} s per host split over its {V5E_64_HOSTS} hosts)")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="64 x 5 instead of 512 x 5")
  parser.add_argument("--retriever", default="bm25",
                      choices=("bm25", "http", "both"))
  parser.add_argument("--prompts", type=int, default=None)
  parser.add_argument("--group-size", type=int, default=5)
  parser.add_argument("--max-turns", type=int, default=4)
  parser.add_argument("--tokens", type=int, default=500,
                      help="max tokens per response turn and per observation")
  args = parser.parse_args()
  args.prompts = args.prompts or (64 if args.quick else 512)
  if args.retriever in ("bm25", "both"):
    run("in-process BM25", bm25.BM25Retriever.from_corpus("bundled"), args)
  if args.retriever in ("http", "both"):
    with http_retriever() as client:
      run("HTTP gigrl-serve-retriever", client, args)


if __name__ == "__main__":
  main()
