"""Query pool with zero-variance recycling.

Coelho et al., "Effective RL for Agentic Search by Recycling Zero-Variance
Queries During Training" (arXiv 2606.10709), from secondary descriptions; the
golden ``recycling_*`` files come from an independent simulation
(``drivers/query_recycling_ref.py``) that this class reproduces exactly.

Every query has a weight ``w ∈ {0, 1}`` (all 1 at start). A step:

1. ``sample()``: Efraimidis–Spirakis keys ``u^(1/w)`` over the active queries
   (``w > 0``), the ``k·B`` largest in key order (all active ones if fewer);
   ``rule="grpo"`` samples ``B``. When no query is active, ``grpo`` and
   ``bounded_dapo`` refill the pool (all weights back to 1) before sampling;
   ``recycle`` does not (INFERRED §6.3 items 1, 3, 4).
2. the trainer rolls out K trajectories per candidate;
3. ``update()``: a group is signal-bearing iff ``0 < #successes < K``.
   ``recycle``: the first B signal groups (sampling order) are accepted and
   consumed (w := 0); zero-variance and surplus candidates stay active.
   ``bounded_dapo``: same acceptance, but every candidate is consumed.
   ``grpo``: every candidate is accepted and consumed.

The pool is host-side numpy. ``state_dict()`` is JSON-serialisable and
includes the generator state, so a resumed run samples the same candidates.
"""
from __future__ import annotations

import copy
from typing import Any

import ml_collections
import numpy as np

from gigrl import config_utils

RULES = ("recycle", "grpo", "bounded_dapo")


def pool_default_config() -> ml_collections.ConfigDict:
  """Defaults of the ``data.pool`` section.

  Returns:
    ConfigDict(rule="recycle", oversample=2, success_threshold=1.0): k = 2 is
    the paper's larger setting; a trajectory succeeds when its reward is
    >= 1.0, i.e. exact match (INFERRED §6.3 item 5).
  """
  return ml_collections.ConfigDict(dict(
      rule="recycle", oversample=2, success_threshold=1.0))


def validate_pool_config(cfg: Any) -> None:
  """Checks the ``data.pool`` section.

  Raises:
    gigrl.config_utils.ConfigError: field named ``"data.pool.<field>"``.
  """
  root = {"data": {"pool": cfg}}
  config_utils.check_choice(root, "data.pool.rule", RULES)
  config_utils.check_range(root, "data.pool.oversample", 1, integer=True)
  config_utils.check_range(root, "data.pool.success_threshold")


class QueryPool:
  """Weighted query pool with recycling of zero-variance queries.

  Args:
    num_queries: pool size Q (query ids are ``0..Q-1``).
    rule: ``"recycle"``, ``"grpo"`` or ``"bounded_dapo"``.
    batch_size: B, the number of groups used for an update.
    oversample: k >= 1; ``k·B`` candidates per step (``grpo`` uses B).
    success_threshold: a trajectory reward >= this counts as a success when
      ``update`` gets rewards.
    seed: seed of the pool's own ``np.random.Generator`` (PCG64).

  Raises:
    gigrl.config_utils.ConfigError: invalid argument (field
      ``"data.pool.<name>"``).
  """

  def __init__(self, num_queries: int, *, rule: str = "recycle",
               batch_size: int, oversample: int = 2,
               success_threshold: float = 1.0, seed: int = 0):
    validate_pool_config(dict(rule=rule, oversample=oversample,
                              success_threshold=success_threshold))
    root = {"data": {"pool": dict(num_queries=num_queries,
                                  batch_size=batch_size)}}
    config_utils.check_range(root, "data.pool.num_queries", 1, integer=True)
    config_utils.check_range(root, "data.pool.batch_size", 1, integer=True)
    self.num_queries, self.rule = num_queries, rule
    self.batch_size, self.oversample = batch_size, oversample
    self.success_threshold = float(success_threshold)
    self.seed = seed
    self._rng = np.random.default_rng(seed)
    self.weights = np.ones(num_queries, np.float64)
    self.seen_zero_variance = np.zeros(num_queries, bool)
    self.step = 0

  @property
  def num_candidates(self) -> int:
    """Candidates per step: B for ``grpo``, k·B otherwise."""
    k = 1 if self.rule == "grpo" else self.oversample
    return k * self.batch_size

  def sample(self, u: np.ndarray | None = None) -> np.ndarray:
    """Draws this step's candidates (without replacement).

    Args:
      u: optional f64[Q] uniforms in (0, 1) (e.g. the golden ``u_keys[t]``);
        drawn from the pool's generator when None.

    Returns:
      int64[C] query ids in decreasing key order, C = min(num_candidates,
      #active).

    Raises:
      ValueError: ``u`` has the wrong shape.
    """
    if self.rule != "recycle" and not (self.weights > 0).any():
      self.weights[:] = 1.0
    if u is None:
      u = self._rng.random(self.num_queries)
    u = np.asarray(u, np.float64)
    if u.shape != (self.num_queries,):
      raise ValueError(
          f"u must have shape ({self.num_queries},), got {u.shape}")
    active = self.weights > 0
    keys = np.full(self.num_queries, -np.inf)
    keys[active] = u[active] ** (1.0 / self.weights[active])
    order = np.argsort(-keys, kind="stable")
    return order[:min(self.num_candidates, int(active.sum()))]

  def update(self, candidates: np.ndarray, rewards: np.ndarray | None = None,
             *, successes: np.ndarray | None = None,
             group_size: int | None = None
             ) -> tuple[np.ndarray, dict[str, float]]:
    """Applies the rule to this step's rollouts.

    Args:
      candidates: int[C] ids returned by :func:`sample`, in that order.
      rewards: f32[C, K] trajectory rewards (success = reward >=
        success_threshold); or give ``successes`` instead.
      successes: int[C] success counts (needs ``group_size``) or bool[C, K].
      group_size: K when ``successes`` are counts.

    Returns:
      (accepted int64[<= B] ids used for the update, in candidate order;
      metrics: ``pool/accepted``, ``pool/signal_frac`` (signal candidates /
      candidates), ``pool/recycled_frac`` (accepted queries seen as
      zero-variance at an earlier step / accepted), ``pool/flips`` (signal
      candidates seen as zero-variance earlier), ``pool/size`` (active
      queries after the update), ``pool/active_frac``).

    Raises:
      ValueError: inconsistent arguments.
    """
    candidates = np.asarray(candidates, np.int64)
    count, k = self._success_counts(candidates, rewards, successes,
                                    group_size)
    signal = (count > 0) & (count < k)
    prev_zero = self.seen_zero_variance[candidates]
    if self.rule == "grpo":
      accepted_mask = np.ones_like(signal)
    else:
      accepted_mask = signal & (np.cumsum(signal) <= self.batch_size)
    accepted = candidates[accepted_mask]
    consumed = candidates if self.rule != "recycle" else accepted
    self.weights[consumed] = 0.0
    self.seen_zero_variance[candidates[~signal]] = True
    self.step += 1
    n_acc = max(len(accepted), 1)
    active = int((self.weights > 0).sum())
    metrics = {
        "pool/accepted": float(len(accepted)),
        "pool/signal_frac": float(signal.mean()) if len(signal) else 0.0,
        "pool/recycled_frac": float(prev_zero[accepted_mask].sum()) / n_acc,
        "pool/flips": float((prev_zero & signal).sum()),
        "pool/size": float(active),
        "pool/active_frac": active / self.num_queries,
    }
    return accepted, metrics

  def _success_counts(self, candidates, rewards, successes, group_size):
    if (rewards is None) == (successes is None):
      raise ValueError("give exactly one of rewards or successes")
    if rewards is not None:
      rewards = np.asarray(rewards)
      if rewards.ndim != 2 or rewards.shape[0] != len(candidates):
        raise ValueError(f"rewards must be [C={len(candidates)}, K], got "
                         f"{rewards.shape}")
      return (rewards >= self.success_threshold).sum(-1), rewards.shape[1]
    successes = np.asarray(successes)
    if successes.ndim == 2:
      return successes.astype(bool).sum(-1), successes.shape[1]
    if group_size is None or successes.shape != (len(candidates),):
      raise ValueError("success counts need shape [C] and group_size")
    return successes.astype(np.int64), int(group_size)

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state (weights, history, step, generator state)."""
    return {
        "num_queries": self.num_queries, "rule": self.rule,
        "batch_size": self.batch_size, "oversample": self.oversample,
        "success_threshold": self.success_threshold, "seed": self.seed,
        "step": self.step, "weights": self.weights.tolist(),
        "seen_zero_variance": self.seen_zero_variance.tolist(),
        "rng": copy.deepcopy(self._rng.bit_generator.state),
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores :func:`state_dict` output (e.g. after ``json.loads``).

    Raises:
      ValueError: the state belongs to a pool of another size or rule.
    """
    for key in ("num_queries", "rule"):
      if state[key] != getattr(self, key):
        raise ValueError(f"pool state has {key}={state[key]!r}, this pool "
                         f"has {getattr(self, key)!r}")
    self.batch_size, self.oversample = state["batch_size"], state["oversample"]
    self.success_threshold = state["success_threshold"]
    self.seed, self.step = state["seed"], state["step"]
    self.weights = np.asarray(state["weights"], np.float64)
    self.seen_zero_variance = np.asarray(state["seen_zero_variance"], bool)
    self._rng = np.random.default_rng()
    self._rng.bit_generator.state = copy.deepcopy(state["rng"])


def sample_prompts(pool: QueryPool, questions: list, log=None) -> tuple[np.ndarray, list, list]:
  """One RL step's prompts: the pool's candidates and their questions, padded to a fixed
  width.

  When fewer queries are active than a step needs, every query is re-activated first (a new
  pass over the data).

  Args:
    pool: the run's query pool over ``questions``.
    questions: the questions RL samples (one per pool id).
    log: ``log(message)`` for the re-activation notice.
  Returns:
    (candidate pool ids i64[C], their questions (C), the questions padded to
    ``pool.num_candidates`` by repeating the last: the jitted rollout's fixed k·P groups, whose
    filler groups are dropped before the pool update).
  """
  if int((pool.weights > 0).sum()) < pool.num_candidates:
    if log is not None:
      log(f"query pool has fewer than {pool.num_candidates} active queries; re-activating "
          f"all {pool.num_queries}")
    pool.weights[:] = 1.0
  cands = pool.sample()
  picked = [questions[int(i)] for i in cands]
  return cands, picked, picked + [picked[-1]] * (pool.num_candidates - len(picked))
