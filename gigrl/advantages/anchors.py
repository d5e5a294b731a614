"""Host-side anchor-state grouping for GiGPO -> ``anchor_ids int32[P, G, T]``.

Reference: verl-agent@2716b30b ``gigpo/core_gigpo.py::build_step_group`` and
``to_hashable`` (GiGPO Eq. 6). Groups are formed **within each prompt
group only**, across all time steps and trajectories of that prompt.

* exact grouping: the key is the observation made hashable (str/int/float/bool
  as is, arrays flattened to tuples, list/tuple/dict recursively to tuples);
  :func:`exact_anchor_ids` for Python objects, :func:`token_anchor_ids` for
  padded token-id arrays (vectorised 64-bit hashing);
* similarity grouping: rows of a prompt are scanned in batch order
  (trajectory by trajectory, steps in order); each row joins the first cluster
  whose representative (its first member, never updated) has
  ``difflib.SequenceMatcher(None, obs, rep).ratio() >= threshold``, otherwise
  it opens a new cluster (greedy, order-dependent, O(n^2) per prompt).

Ids are dense per prompt in order of first appearance; padded steps get -1.
The device kernels only compare ids for equality within a prompt.
"""
from __future__ import annotations

import difflib
import functools
from typing import Any, Callable, Sequence

import numpy as np

PAD_ID = -1


def to_hashable(obs: Any) -> Any:
  """Makes an observation hashable like verl-agent ``to_hashable``.

  Args:
    obs: str, number, bool, np.ndarray, list/tuple or dict (nested).

  Returns:
    A hashable equivalent (arrays -> flattened tuples, containers -> tuples).

  Raises:
    TypeError: for any other type.
  """
  if isinstance(obs, (str, int, float, bool, bytes)):
    return obs
  if isinstance(obs, np.ndarray):
    return tuple(obs.ravel().tolist())
  if isinstance(obs, (list, tuple)):
    return tuple(to_hashable(o) for o in obs)
  if isinstance(obs, dict):
    return tuple(sorted((k, to_hashable(v)) for k, v in obs.items()))
  if isinstance(obs, np.generic):
    return obs.item()
  raise TypeError(f"cannot hash anchor observation of type {type(obs)}")


def _ids(observations: Sequence[Sequence[Sequence[Any]]],
         assign: Callable[[list, Any], int]) -> np.ndarray:
  """Runs ``assign(state, obs)`` over each prompt's rows in batch order."""
  p_n = len(observations)
  g_n = max((len(g) for g in observations), default=0)
  t_n = max((len(t) for g in observations for t in g), default=0)
  out = np.full((p_n, g_n, t_n), PAD_ID, np.int32)
  for p, group in enumerate(observations):
    state: list = []
    for g, traj in enumerate(group):
      for t, obs in enumerate(traj):
        if obs is not None:
          out[p, g, t] = assign(state, obs)
  return out


def exact_anchor_ids(observations: Sequence[Sequence[Sequence[Any]]]
                     ) -> np.ndarray:
  """Exact anchor grouping (verl-agent default, ``enable_similarity=False``).

  Args:
    observations: nested ``[P][G][T]`` lists of anchor observations (text,
      token-id tuples/arrays, ...); ``None`` (or a shorter list) = padding.

  Returns:
    int32[P, G, T] ids, dense per prompt; -1 on padding.

  Raises:
    TypeError: an observation cannot be made hashable.
  """
  def assign(state, obs):
    if not state:
      state.append({})
    table = state[0]
    return table.setdefault(to_hashable(obs), len(table))

  return _ids(observations, assign)


def similarity_anchor_ids(observations: Sequence[Sequence[Sequence[str]]],
                          threshold: float = 0.9) -> np.ndarray:
  """Greedy similarity grouping (verl-agent ``enable_similarity=True``).

  Args:
    observations: nested ``[P][G][T]`` lists of text observations; ``None``
      = padding.
    threshold: minimum ``SequenceMatcher.ratio()`` to join a cluster, in
      (0, 1) (verl-agent search script: 0.9).

  Returns:
    int32[P, G, T] cluster ids, dense per prompt; -1 on padding.

  Raises:
    ValueError: threshold not in (0, 1).
  """
  _check_threshold(threshold)
  return _ids(observations, functools.partial(_join_cluster,
                                              threshold=threshold))


def _check_threshold(threshold: float) -> None:
  if not 0.0 < threshold < 1.0:
    raise ValueError(f"similarity threshold must be in (0, 1), got {threshold}")


def _join_cluster(reps: list, obs: str, threshold: float) -> int:
  """Index of the first cluster whose representative is similar enough."""
  for cid, rep in enumerate(reps):
    if difflib.SequenceMatcher(None, obs, rep).ratio() >= threshold:
      return cid
  reps.append(obs)
  return len(reps) - 1


def similarity_clusters(rows: Sequence[str], threshold: float = 0.9
                        ) -> list[int]:
  """Greedy similarity clusters of one prompt's rows, in the given order.

  Use this when rows are not trajectory-major (e.g. verl-agent batches after
  ``_balance_batch``); :func:`similarity_anchor_ids` scans trajectory by
  trajectory.

  Args:
    rows: the prompt's text observations in scan order.
    threshold: as in :func:`similarity_anchor_ids`.

  Returns:
    Cluster id of each row (0.., in order of creation).

  Raises:
    ValueError: threshold not in (0, 1).
  """
  _check_threshold(threshold)
  reps: list = []
  return [_join_cluster(reps, obs, threshold) for obs in rows]


def token_anchor_ids(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Vectorised exact grouping of token-id observations.

  Two steps of one prompt share an id iff their first ``lengths`` tokens are
  equal, up to 64-bit hash collisions (probability about n^2 / 2^65 per
  prompt with n = G*T rows). The tokens are read as int32 pairs packed into
  64-bit words and hashed with one multiply-add per word, then each prompt's
  n hashes are sorted (about 25 ms at 1024 x 16 x 30 x 16 tokens on an idle
  2-core CPU).

  Args:
    tokens: int[P, G, T, L] observation token ids, each < 2^31 (entries at
      positions >= length are ignored).
    lengths: int[P, G, T] observation lengths; a negative length marks a
      padded step.

  Returns:
    int32[P, G, T] ids in ``[0, G*T)`` (dense rank of the group's hash within
    its prompt), -1 on padded steps.
  """
  tokens = np.asarray(tokens)
  lengths = np.asarray(lengths)
  p_n, g_n, t_n, l_n = tokens.shape
  if ((lengths >= 0) & (lengths < l_n)).any():   # skip masking full rows
    tokens = np.where(np.arange(l_n) < lengths[..., None], tokens, 0)
  tok = np.ascontiguousarray(tokens.reshape(-1, l_n), dtype=np.int32)
  if l_n % 2:
    tok = np.pad(tok, ((0, 0), (0, 1)))
  words = tok.view(np.uint64)                      # [M, ceil(L/2)]
  coef = np.cumprod(np.full(words.shape[1], 0x9E3779B97F4A7C15, np.uint64),
                    dtype=np.uint64)
  with np.errstate(over="ignore"):
    h = np.einsum("ij,j->i", words, coef)
    h ^= lengths.reshape(-1).astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(31)
  h = h.reshape(p_n, -1)
  order = np.argsort(h, axis=-1)
  sh = np.take_along_axis(h, order, axis=-1)
  new = np.ones(sh.shape, np.int32)
  new[:, 1:] = sh[:, 1:] != sh[:, :-1]
  ids = np.empty(order.shape, np.int32)
  np.put_along_axis(ids, order, np.cumsum(new, axis=-1, dtype=np.int32) - 1,
                    axis=-1)
  return np.where(lengths >= 0, ids.reshape(p_n, g_n, t_n), PAD_ID).astype(
      np.int32)
