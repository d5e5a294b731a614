"""gigrl.advantages.verl: GiGPO on verl-agent's flat step rows.

Checked against the golden ``gigpo_*`` files (verl-agent's own outputs, in its
row layout) and against a plain per-row re-derivation of verl-agent's
``compute_gigpo_outcome_advantage`` semantics on shuffled uuid batches.
"""
from __future__ import annotations

import json
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from gigrl.advantages import verl
from test_anchors import plain_clusters  # the plain greedy difflib reference

GOLDEN = Path(__file__).resolve().parent / "golden"
RTOL, ATOL = 1e-5, 1e-6


def close(got, want, what):
  np.testing.assert_allclose(np.asarray(got, np.float64),
                             np.asarray(want, np.float64), rtol=RTOL,
                             atol=ATOL, err_msg=what)


def canonical(prompts, ids):
  table = {}
  return [table.setdefault((p, i), len(table)) for p, i in zip(prompts, ids)]


def golden_files():
  files = sorted(GOLDEN.glob("gigpo_*.json"))
  assert files, f"no gigpo_*.json in {GOLDEN}"
  return files


def keep_time_order_shuffle(traj, rng):
  """A row permutation that interleaves trajectories but keeps each one's
  rows in time order."""
  order = list(rng.permutation(len(traj)))
  slots = defaultdict(list)
  for pos, row in enumerate(order):
    slots[traj[row]].append(pos)
  out = [0] * len(order)
  for tr, pos in slots.items():
    rows = [i for i in range(len(traj)) if traj[i] == tr]
    for p, r in zip(pos, rows):
      out[p] = r
  return np.array(out)


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: p.name)
@pytest.mark.parametrize("returns_from", ["step_rewards", "env_rewards"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_golden(path, returns_from, shuffle):
  case = json.loads(path.read_text())
  prm, inp, out = case["params"], case["inputs"], case["outputs"]
  n = len(inp["index"])
  perm = np.arange(n)
  if shuffle:
    perm = keep_time_order_shuffle(inp["traj_index"],
                                   np.random.default_rng(0))
  take = lambda x, dtype=None: np.asarray(x, dtype)[perm]
  kw = dict(epsilon=prm["epsilon"], step_advantage_w=prm["step_advantage_w"],
            mode=prm["mode"], enable_similarity=prm["enable_similarity"],
            similarity_thresh=prm["similarity_thresh"])
  if returns_from == "step_rewards":
    step_rewards = take(out["step_rewards"], np.float32)
  else:
    step_rewards = None
    kw.update(gamma=prm["gamma"], env_rewards=take(inp["env_rewards"]),
              is_action_valid=take(inp["is_action_valid"]),
              invalid_action_penalty_coef=prm["invalid_action_penalty_coef"])
  got = verl.gigpo_row_advantages(
      take(inp["token_level_rewards"], np.float32), step_rewards,
      take(inp["response_mask"], np.float32), take(inp["anchor_obs"], object),
      take(inp["index"], object), take(inp["traj_index"], object), **kw)
  close(got.token_advantages, take(out["advantages"]), "advantages")
  close(got.row_scores, take(out["advantages_row"]), "advantages_row")
  close(got.episode_advantages, take(out["episode_advantages_row"]),
        "episode_advantages_row")
  close(got.step_advantages, take(out["step_advantages_row"]),
        "step_advantages_row")
  if not shuffle:
    assert canonical(inp["index"], got.step_group_ids) == \
        out["step_group_ids"]


# ---------------------------------------------- plain verl-agent semantics
# plain_clusters: the greedy difflib scan, shared with tests/test_anchors.py
def norm(x, remove_std, eps, singleton_raw):
  """verl-agent: a lone row keeps its raw score (episode) or gets 0 (step)."""
  x = np.asarray(x, np.float64)
  if len(x) == 1:
    if not singleton_raw:
      return np.zeros(1)
    mean, std = 0.0, 1.0
  else:
    mean, std = x.mean(), x.std(ddof=1)
  return x - mean if remove_std else (x - mean) / (std + eps)


def plain_gigpo(tlr, step_r, mask, obs, index, *, eps, w, mode, sim, thr):
  """One row at a time with dicts, as verl-agent's core_gigpo does."""
  remove_std = mode == "mean_norm"
  scores = np.asarray(tlr, np.float64).sum(-1)
  by_prompt = defaultdict(list)
  for i, u in enumerate(index):
    by_prompt[u].append(i)
  a_e, a_s = np.zeros(len(index)), np.zeros(len(index))
  for rows in by_prompt.values():
    a_e[rows] = norm(scores[rows], remove_std, eps, singleton_raw=True)
    groups = defaultdict(list)
    keys = plain_clusters([obs[i] for i in rows], thr) if sim else \
        [obs[i] for i in rows]
    for i, k in zip(rows, keys):
      groups[k].append(i)
    for members in groups.values():
      a_s[members] = norm(np.asarray(step_r)[members], remove_std, eps,
                          singleton_raw=False)
  row = a_e + w * a_s
  return row[:, None] * np.asarray(mask), row


def plain_returns(env, valid, traj, gamma, coef):
  out = np.zeros(len(env))
  acc = {}
  for i in reversed(range(len(env))):
    acc[traj[i]] = env[i] + gamma * acc.get(traj[i], 0.0)
    out[i] = acc[traj[i]] - coef * (1 - valid[i])
  return out


def random_batch(seed, p_n=6, g_n=4, t_max=4, length=7, texts=5):
  """Shuffled verl-agent rows with uuid uids; variable trajectory lengths."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(p_n):
    pu = str(uuid.UUID(int=int(rng.integers(2**62))))
    for _ in range(int(rng.integers(1, g_n + 1))):
      tu = str(uuid.UUID(int=int(rng.integers(2**62))))
      reward = float(rng.random() < 0.5)
      steps = int(rng.integers(1, t_max + 1))
      for t in range(steps):
        doc = int(rng.integers(texts))
        rows.append(dict(index=pu, traj=tu, t=t, reward=reward,
                         env=reward * (t == steps - 1),
                         valid=float(rng.random() < 0.85),
                         obs=f"Doc {doc}: the passage about item {doc}." +
                         (" x" if rng.random() < 0.3 else "")))
  traj = [r["traj"] for r in rows]
  perm = keep_time_order_shuffle(traj, rng)
  rows = [rows[i] for i in perm]
  n = len(rows)
  lengths = rng.integers(1, length + 1, n)
  mask = (np.arange(length) < lengths[:, None]).astype(np.float32)
  coef = 0.01
  tlr = np.zeros((n, length), np.float32)
  tlr[np.arange(n), lengths - 1] = [r["reward"] - coef * (1 - r["valid"])
                                    for r in rows]
  col = lambda k, dtype=object: np.array([r[k] for r in rows], dtype)
  return dict(tlr=tlr, mask=mask, index=col("index"), traj=col("traj"),
              obs=col("obs"), env=col("env", np.float32),
              valid=col("valid", np.float32), coef=coef)


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("sim", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_plain_rows(mode, sim, seed):
  b = random_batch(seed)
  step_r = plain_returns(b["env"], b["valid"], b["traj"], 0.9, b["coef"])
  kw = dict(epsilon=1e-6, step_advantage_w=0.7, mode=mode,
            enable_similarity=sim, similarity_thresh=0.9)
  want_tok, want_row = plain_gigpo(
      b["tlr"], step_r, b["mask"], b["obs"], b["index"], eps=1e-6, w=0.7,
      mode=mode, sim=sim, thr=0.9)
  got = verl.gigpo_row_advantages(b["tlr"], step_r.astype(np.float32),
                                  b["mask"], b["obs"], b["index"], b["traj"],
                                  **kw)
  close(got.row_scores, want_row, "row scores")
  close(got.token_advantages, want_tok, "token advantages")
  env = verl.gigpo_row_advantages(
      b["tlr"], None, b["mask"], b["obs"], b["index"], b["traj"], **kw,
      gamma=0.9, env_rewards=b["env"], is_action_valid=b["valid"],
      invalid_action_penalty_coef=b["coef"])
  close(env.row_scores, want_row, "row scores from env rewards")


def test_integer_anchor_ids_and_lists_give_the_same_groups():
  b = random_batch(3)
  step_r = np.random.default_rng(0).random(len(b["index"])).astype(np.float32)
  args = (b["tlr"], step_r, b["mask"])
  ref = verl.gigpo_row_advantages(*args, b["obs"], b["index"], b["traj"])
  ints = np.unique(b["obs"], return_inverse=True)[1].reshape(-1) * 7 - 3
  as_ids = verl.gigpo_row_advantages(*args, ints, b["index"], b["traj"])
  lists = verl.gigpo_row_advantages(*args, list(b["obs"]), list(b["index"]),
                                    list(b["traj"]))
  for other in (as_ids, lists):
    assert canonical(b["index"], other.step_group_ids) == canonical(
        b["index"], ref.step_group_ids)
    close(other.row_scores, ref.row_scores, "row scores")


def test_torch_in_torch_out_like_verl_agent():
  torch = pytest.importorskip("torch")
  b = random_batch(4)
  # Seeded: some draws put a row's f32 advantage near a cancellation, off the
  # f64 reference by > RTOL (~6% of unseeded runs failed).
  step_r = torch.rand(len(b["index"]),
                      generator=torch.Generator().manual_seed(0))
  adv, returns = verl.compute_gigpo_outcome_advantage(
      token_level_rewards=torch.from_numpy(b["tlr"]), step_rewards=step_r,
      response_mask=torch.from_numpy(b["mask"]), anchor_obs=b["obs"],
      index=b["index"], traj_index=b["traj"], step_advantage_w=1.0,
      mode="mean_std_norm", enable_similarity=False, similarity_thresh=0.95)
  assert isinstance(adv, torch.Tensor) and adv.dtype == torch.float32
  assert returns is adv and tuple(adv.shape) == b["tlr"].shape
  want, _ = plain_gigpo(b["tlr"], step_r.numpy(), b["mask"], b["obs"],
                        b["index"], eps=1e-6, w=1.0, mode="mean_std_norm",
                        sim=False, thr=0.95)
  close(adv.numpy(), want, "torch advantages")
  for mask in (torch.from_numpy(b["mask"]).long(),
               torch.from_numpy(b["mask"]).bool()):
    adv2, _ = verl.compute_gigpo_outcome_advantage(
        torch.from_numpy(b["tlr"]).double(), step_r, mask, b["obs"],
        b["index"], b["traj"], mode="mean_std_norm")
    assert adv2.dtype == torch.float32
    close(adv2.numpy(), want, f"{mask.dtype} mask, f64 rewards")


def test_row_layout():
  lay = verl.row_layout(["a", "a", "a", "a", "b", "b"],
                        ["x", "x", "y", "y", "z", "z"])
  assert lay.shape == (2, 2, 2) and not lay.dense
  np.testing.assert_array_equal(lay.traj, [0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(lay.step, [0, 1, 0, 1, 0, 1])
  lay = verl.row_layout(["a", "b", "a", "b"], ["x", "z", "x", "w"])
  np.testing.assert_array_equal(lay.prompt, [0, 1, 0, 1])
  np.testing.assert_array_equal(lay.traj, [0, 0, 0, 1])
  np.testing.assert_array_equal(lay.step, [0, 0, 1, 0])
  dense = verl.row_layout(np.repeat(["p", "q"], 4),
                          np.repeat(["t0", "t1", "t2", "t3"], 2))
  assert dense.dense and dense.shape == (2, 2, 2)
  flat = verl.row_layout(["a", "b", "a"])
  assert flat.shape == (2, 1, 2)
  np.testing.assert_array_equal(flat.step, [0, 0, 1])


def test_errors():
  tlr, mask = np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)
  args = (tlr, np.zeros(2, np.float32), mask, ["o", "o"])
  with pytest.raises(ValueError, match="mode"):
    verl.gigpo_row_advantages(*args, ["a", "a"], ["x", "x"], mode="std")
  with pytest.raises(ValueError, match="gamma"):
    verl.gigpo_row_advantages(tlr, None, mask, ["o", "o"], ["a", "a"],
                              ["x", "x"])
  with pytest.raises(ValueError, match="two prompt uids"):
    verl.row_layout(["a", "b"], ["x", "x"])
  with pytest.raises(ValueError, match="rows"):
    verl.gigpo_row_advantages(*args, ["a"], ["x"])


def test_bucketed_shapes_reuse_the_compiled_kernel():
  """Batches whose per-prompt row counts differ within one bucket (here 17..20 rows per
  prompt -> T = 20) run one compiled kernel; the padded cells change nothing."""
  assert [verl.bucket(x) for x in (7, 8, 9, 17, 20, 21, 80, 81)] == \
      [7, 8, 10, 20, 20, 24, 80, 96]
  kernel = verl._grid_kernel             # pylint: disable=protected-access
  sizes = []
  for rows_per_prompt in (17, 18, 19):
    n = 3 * rows_per_prompt
    index = np.repeat(np.array(["a", "b", "c"], object), rows_per_prompt)
    obs = np.array([f"obs {i % 5}" for i in range(n)], object)
    rng = np.random.default_rng(rows_per_prompt)
    step_r = rng.random(n).astype(np.float32)
    tlr = rng.random((n, 3)).astype(np.float32)
    mask = np.ones((n, 3), np.float32)
    got = verl.gigpo_row_advantages(tlr, step_r, mask, obs, index, None,
                                    mode="mean_std_norm", epsilon=1e-6)
    want, _ = plain_gigpo(tlr, step_r, mask, obs, index, eps=1e-6, w=1.0,
                          mode="mean_std_norm", sim=False, thr=0.95)
    close(got.token_advantages, want, f"{rows_per_prompt} rows per prompt")
    sizes.append(kernel._cache_size())   # pylint: disable=protected-access
  assert sizes[0] == sizes[1] == sizes[2], sizes


@pytest.mark.parametrize("returns_from", ["step_rewards", "env_rewards"])
def test_pipelined_blocks_equal_the_serial_pass(monkeypatch, returns_from):
  """Large batches run in blocks of whole prompts on two threads (verl._pipelined): the same
  bits as the one-pass path, with observations shared across blocks' prompts; rows whose
  prompts are interleaved take the one-pass path."""
  b = random_batch(5, p_n=23, g_n=5, t_max=5, texts=4)
  prompt = verl.factorize(b["index"])[0]
  order = np.argsort(prompt, kind="stable")        # prompts contiguous, steps in time order
  b = {k: v[order] if isinstance(v, np.ndarray) else v for k, v in b.items()}
  step_r = plain_returns(b["env"], b["valid"], b["traj"], 0.9, b["coef"]).astype(np.float32)
  kw = dict(epsilon=1e-6, step_advantage_w=0.7, mode="mean_std_norm")
  if returns_from == "env_rewards":
    args = (b["tlr"], None, b["mask"], b["obs"], b["index"], b["traj"])
    kw.update(gamma=0.9, env_rewards=b["env"], is_action_valid=b["valid"],
              invalid_action_penalty_coef=b["coef"])
  else:
    args = (b["tlr"], step_r, b["mask"], b["obs"], b["index"], b["traj"])
  serial = verl.gigpo_row_advantages(*args, **kw)
  calls, real = [], verl._pipelined
  monkeypatch.setattr(verl, "PIPELINE_MIN_ROWS", 0)
  monkeypatch.setattr(verl, "_pipelined", lambda *a: calls.append(a[-2]) or real(*a))
  got = verl.gigpo_row_advantages(*args, **kw)
  assert len(calls) == 1 and len(calls[0]) == verl.PIPELINE_CHUNKS
  for name in got._fields:
    assert np.array_equal(getattr(got, name), getattr(serial, name)), name
  assert np.count_nonzero(got.step_advantages) > len(step_r) // 2    # not a trivial case
  shuffled = np.random.default_rng(0).permutation(len(step_r))
  verl.gigpo_row_advantages(b["tlr"][shuffled], step_r[shuffled], b["mask"][shuffled],
                            b["obs"][shuffled], b["index"][shuffled], None, **{
                                k: v for k, v in kw.items() if k in ("epsilon", "mode")})
  assert len(calls) == 1                         # interleaved prompts: the one-pass path

