"""Times similarity anchor grouping: plain greedy difflib vs gigrl.

Usage: ``python benchmarks/similarity.py [--quick] [--threshold 0.9]``

The batch imitates Search-R1 rollouts on the bundled data: each prompt is a
bundled multi-hop question with the passages R1-Searcher retrieved for it;
step 0's anchor is the question, every later step's anchor is three passages
formatted as Search-R1 does (``Doc i(Title: T) text``), drawn rank-weighted
from the question's pool. Half the searches repeat an earlier search of the
same prompt (rollouts of one prompt often issue the same query).

Rows:

* ``plain``: verl-agent's greedy scan written plainly (``build_step_group``
  with ``enable_similarity=True``): each row against each cluster's first
  member with ``difflib.SequenceMatcher(None, row, rep).ratio()``;
* ``gigrl``: :func:`gigrl.advantages.anchors.similarity_anchor_ids`.

Times are process-CPU seconds (robust on a shared machine; both sides are
single-threaded), wall seconds in brackets. ``identical`` compares the ids.
Target: >= 20x and <= 2 s at 512 x 5 x 5.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import random

import numpy as np
from _timing import timed_runs

from gigrl.advantages import anchors
from gigrl.data import qa
from gigrl.rollout import protocol

SIZES = ((64, 5, 5), (512, 5, 5))
REPEAT_SEARCH = 0.5      # probability that a search repeats an earlier one


def question_pools() -> list[tuple[str, list[str]]]:
  """(question, retrieved passages) of the bundled R1-Searcher questions."""
  root = os.path.join(qa.bundled_dir(), "r1searcher_retrieved")
  corpus = {d.id: d.contents
            for d in qa.load_corpus(os.path.join(root, "corpus.jsonl"))}
  out = []
  for name in ("hotpotqa", "2wikimultihopqa", "bamboogle"):
    with open(os.path.join(root, f"{name}_questions.jsonl")) as f:
      for line in f:
        row = json.loads(line)
        docs = [corpus[i] for i in row.get("retrieved_doc_ids", [])
                if i in corpus]
        if len(docs) >= 6:
          out.append((row["question"], docs))
  return out


def make_observations(pools, p_n, g_n, t_n, seed=0):
  """Nested [P][G][T] anchor texts (every trajectory runs all T steps)."""
  rng = random.Random(seed)
  out = []
  for p in range(p_n):
    question, pool = pools[p % len(pools)]
    weights = [1.0 / (r + 1) for r in range(len(pool))]
    searches, group = [], []
    for _ in range(g_n):
      traj = [question]
      for _ in range(1, t_n):
        if searches and rng.random() < REPEAT_SEARCH:
          traj.append(rng.choice(searches))
          continue
        picked = []
        while len(picked) < 3:
          k = rng.choices(range(len(pool)), weights)[0]
          if k not in picked:
            picked.append(k)
        text = protocol.format_passages([pool[k] for k in picked]).strip()
        searches.append(text)
        traj.append(text)
      group.append(traj)
    out.append(group)
  return out


def plain_anchor_ids(observations, threshold):
  """The greedy scan without shortcuts (the reference being timed)."""
  p_n, g_n = len(observations), max(len(g) for g in observations)
  t_n = max(len(t) for g in observations for t in g)
  out = np.full((p_n, g_n, t_n), -1, np.int32)
  for p, group in enumerate(observations):
    reps = []
    for g, traj in enumerate(group):
      for t, obs in enumerate(traj):
        for cid, rep in enumerate(reps):
          if difflib.SequenceMatcher(None, obs, rep).ratio() >= threshold:
            out[p, g, t] = cid
            break
        else:
          out[p, g, t] = len(reps)
          reps.append(obs)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="only the smallest size")
  parser.add_argument("--threshold", type=float, default=0.9)
  parser.add_argument("--reps", type=int, default=3,
                      help="timed repetitions of the gigrl call")
  args = parser.parse_args()
  pools = question_pools()
  sizes = SIZES[:1] if args.quick else SIZES
  print(f"similarity threshold {args.threshold}; CPU seconds (wall); plain "
        f"runs once, gigrl median of {args.reps}")
  header = (f"{'P x G x T':>11}{'rows':>7}{'distinct':>9}{'clusters':>9}"
            f"{'plain s':>16}{'gigrl s':>16}{'identical':>10}{'ratio':>8}")
  print(header)
  print("-" * len(header))
  for p, g, t in sizes:
    obs = make_observations(pools, p, g, t)
    distinct = sum(len({o for traj in grp for o in traj}) for grp in obs)
    wall, cpu, want = timed_runs(
        lambda: plain_anchor_ids(obs, args.threshold), 1, warmup=0)
    p_cpu, p_wall = cpu[0], wall[0]
    wall, cpu, got = timed_runs(
        lambda: anchors.similarity_anchor_ids(obs, args.threshold), args.reps,
        warmup=1)
    g_cpu, g_wall = float(np.median(cpu)), float(np.median(wall))
    clusters = int((got.max(axis=(1, 2)) + 1).sum())
    same = "yes" if np.array_equal(got, want) else "NO"
    print(f"{f'{p}x{g}x{t}':>11}{p * g * t:>7}{distinct:>9}{clusters:>9}"
          f"{f'{p_cpu:.2f} ({p_wall:.2f})':>16}"
          f"{f'{g_cpu:.3f} ({g_wall:.3f})':>16}{same:>10}"
          f"{p_cpu / g_cpu:>7.0f}x")


if __name__ == "__main__":
  main()
