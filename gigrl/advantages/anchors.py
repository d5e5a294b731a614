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
  Repeated strings and pairs whose exact upper bounds (length, character
  multiset, longest common subsequence) are below the threshold skip
  ``ratio()``: same clusters, about 100x faster on Search-R1 observations.

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

  Same clusters as the plain greedy scan (see :func:`similarity_clusters` for
  the exact shortcuts that make it fast): about 0.7 CPU seconds at
  512 x 5 x 5 Search-R1 observations of three passages, where the plain scan
  takes 73 s (``benchmarks/similarity.py``).

  Args:
    observations: nested ``[P][G][T]`` lists of text observations; ``None``
      (or a shorter list) = padding.
    threshold: minimum ``SequenceMatcher.ratio()`` to join a cluster, in
      (0, 1) (verl-agent search script: 0.9).

  Returns:
    int32[P, G, T] cluster ids, dense per prompt; -1 on padding.

  Raises:
    ValueError: threshold not in (0, 1).
    TypeError: an observation is not a str (verl-agent supports only text
      for similarity grouping).
  """
  _check_threshold(threshold)
  p_n = len(observations)
  g_n = max((len(g) for g in observations), default=0)
  t_n = max((len(t) for g in observations for t in g), default=0)
  out = np.full((p_n, g_n, t_n), PAD_ID, np.int32)
  for p, group in enumerate(observations):
    pos, rows = [], []
    for g, traj in enumerate(group):
      for t, obs in enumerate(traj):
        if obs is not None:
          pos.append((g, t))
          rows.append(obs)
    if rows:
      g_i, t_i = np.array(pos).T
      out[p, g_i, t_i] = _greedy_clusters(rows, threshold, where=f"[{p}]")
  return out


def _check_threshold(threshold: float) -> None:
  if not 0.0 < threshold < 1.0:
    raise ValueError(f"similarity threshold must be in (0, 1), got {threshold}")


def similarity_clusters(rows: Sequence[str], threshold: float = 0.9
                        ) -> list[int]:
  """Greedy similarity clusters of one prompt's rows, in the given order.

  verl-agent ``build_step_group`` with ``enable_similarity=True``: each row
  joins the first cluster whose representative (its first member, never
  updated) has ``difflib.SequenceMatcher(None, row, rep).ratio() >=
  threshold``, otherwise it opens a new cluster. The result is the same as
  that plain scan; only calls whose outcome is already decided are skipped:

  * identical rows: a repeated string gets the cluster of its first
    occurrence (the clusters it was compared against before, and their
    representatives, have not changed);
  * exact upper bounds on ``ratio() = 2 M / (len(a) + len(b))``, where the
    ``M`` matched characters form a common subsequence of the two strings:
    ``M <= min(len)`` (``real_quick_ratio``), ``M <=`` the character-multiset
    intersection (``quick_ratio``, vectorised per prompt), ``M <=`` the
    longest common subsequence (``rapidfuzz`` LCS in C++, or a bit-parallel
    Python fallback). A pair whose bound is below the threshold cannot match;
    ``ratio()`` runs only on the rest, with the representative's
    ``SequenceMatcher`` (its ``b`` index) reused.

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
    TypeError: a row is not a str.
  """
  _check_threshold(threshold)
  return _greedy_clusters(rows, threshold).tolist()


def _greedy_clusters(rows: Sequence[str], threshold: float, where: str = ""
                     ) -> np.ndarray:
  """int64[len(rows)] greedy cluster ids (see :func:`similarity_clusters`)."""
  first: dict[str, int] = {}
  inv = np.empty(len(rows), np.int64)
  for i, obs in enumerate(rows):
    if not isinstance(obs, str):
      raise TypeError(f"similarity grouping needs str observations, got "
                      f"{type(obs).__name__} at prompt{where} row {i}")
    inv[i] = first.setdefault(obs, len(first))
  uniq = list(first)
  k = len(uniq)
  if k == 1:
    return np.zeros(len(rows), np.int64)
  lens, hist = _char_histograms(uniq)
  cluster = np.empty(k, np.int64)
  reps: list[int] = []                             # unique-row index of reps
  matchers: dict[int, difflib.SequenceMatcher] = {}   # built on first use
  for i, obs in enumerate(uniq):
    cluster[i] = -1
    if reps:
      for c in _candidates(i, reps, lens, hist, threshold):
        rep = uniq[reps[c]]
        if 2.0 * _lcs(obs, rep) / (len(obs) + len(rep)) < threshold:
          continue
        m = matchers.get(c)
        if m is None:
          m = matchers[c] = difflib.SequenceMatcher(None, "", rep)
        m.set_seq1(obs)
        if m.ratio() >= threshold:
          cluster[i] = c
          break
    if cluster[i] < 0:
      cluster[i] = len(reps)
      reps.append(i)
  return cluster[inv]


_BUCKETS = 256


def _char_histograms(uniq: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """(int64[k] lengths, int64[k, 256] character counts).

  ASCII characters get their own bucket, the others share 128 buckets by code
  point modulo 128. Merging characters only raises the multiset intersection,
  so the bound stays an upper bound (exact for ASCII text).
  """
  lens = np.fromiter(map(len, uniq), np.int64, len(uniq))
  codes = np.frombuffer("".join(uniq).encode("utf-32-le"), np.uint32)
  codes = np.where(codes < 128, codes, 128 + codes % 128)
  owner = np.repeat(np.arange(len(uniq)) * _BUCKETS, lens)
  hist = np.bincount(owner + codes, minlength=len(uniq) * _BUCKETS)
  return lens, hist.reshape(len(uniq), _BUCKETS)


def _candidates(i: int, reps: list[int], lens: np.ndarray, hist: np.ndarray,
                threshold: float) -> list[int]:
  """Clusters (in order) whose representative may reach the threshold.

  The bound is ``min(real_quick_ratio, quick_ratio)``, computed like difflib
  (``2.0 * bound / (len(a) + len(b))``), so comparing it with the threshold
  decides as ``quick_ratio() < threshold`` would. Row ``i`` is never empty
  here unless every representative is non-empty (rows are distinct), so the
  denominator is positive.
  """
  r = np.asarray(reps)
  inter = np.minimum(hist[i], hist[r]).sum(-1)
  inter = np.minimum(inter, np.minimum(lens[i], lens[r]))
  return np.flatnonzero(2.0 * inter / (lens[i] + lens[r]) >= threshold
                        ).tolist()


def _lcs_python(a: str, b: str) -> int:
  """Longest-common-subsequence length, bit-parallel (Allison & Dix 1986)."""
  if len(a) < len(b):
    a, b = b, a
  if not b:
    return 0
  masks: dict[str, int] = {}
  for j, ch in enumerate(b):
    masks[ch] = masks.get(ch, 0) | (1 << j)
  full = (1 << len(b)) - 1
  v = full
  get = masks.get
  for ch in a:
    u = v & get(ch, 0)
    v = ((v + u) | (v - u)) & full
  return len(b) - bin(v).count("1")


try:   # C++ LCS (bit-parallel, about 100x the Python fallback)
  from rapidfuzz.distance import LCSseq as _rf_lcs
  _lcs: Callable[[str, str], int] = functools.partial(_rf_lcs.similarity,
                                                      processor=None)
except ImportError:      # pragma: no cover - exercised by monkeypatching
  _lcs = _lcs_python


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
