"""Golden-vector tests: every ``*.json`` in tests/golden and $GIGRL_GOLDEN_DIR.

``GIGRL_GOLDEN_DIR`` lists more folders (``os.pathsep``-separated) of cases of
the same methods; provenance of the bundled files: tests/golden/README.md.

One test per file. The file's ``method`` picks a checker; every parameter,
input and output key must be known to that checker, otherwise the test fails
(never skips). Values must match to 1e-5 relative (atol 1e-6 for zeros).
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from gigrl import advantages as adv_api
from gigrl.update import loss as loss_lib
from gigrl.advantages import anchors, gigpo, grpo, hadw, stratified
from gigrl.data import pool as pool_lib

RTOL, ATOL = 1e-5, 1e-6
GOLDEN = Path(__file__).resolve().parent / "golden"


def _golden_files():
  dirs = [GOLDEN] + [Path(d) for d in
                     os.environ.get("GIGRL_GOLDEN_DIR", "").split(os.pathsep)
                     if d]
  files = []
  for d in dirs:
    found = sorted(d.glob("*.json")) if d.is_dir() else []
    if not found:       # a missing or empty folder fails, never skips
      files.append(pytest.param(d, id=f"MISSING:{d}"))
    files += [pytest.param(f, id=f"{d.name}/{f.name}") for f in found]
  return files


def close(got, want, what):
  np.testing.assert_allclose(np.asarray(got, np.float64),
                             np.asarray(want, np.float64), rtol=RTOL,
                             atol=ATOL, err_msg=what)


def check_keys(what, got, allowed):
  unknown = set(got) - set(allowed)
  assert not unknown, f"unknown {what} {sorted(unknown)}: extend the checker"


def to_groups(index, values):
  """Flat rows with a group uid -> padded f32[P, G] + bool valid + positions."""
  p, g, _, shape = gigpo.rows_to_padded(index, range(len(index)))
  out = np.zeros(shape[:2], np.float32)
  valid = np.zeros(shape[:2], bool)
  out[p, g] = values
  valid[p, g] = True
  return out, valid, (p, g)


# ----------------------------------------------------------------- GRPO
def check_grpo(case):
  prm, inp, out = case["params"], case["inputs"], case["outputs"]
  check_keys("params", prm, {"epsilon", "seed"})
  check_keys("inputs", inp, {"index", "scores", "response_mask",
                             "token_level_rewards"})
  mask = np.asarray(inp["response_mask"])
  scores = np.asarray(inp["token_level_rewards"]).sum(-1)
  close(scores, inp["scores"], "scores = token_level_rewards.sum(-1)")
  r, v, pos = to_groups(inp["index"], scores)
  seen = set()
  for norm in (True, False):
    a = np.asarray(grpo.grpo_advantages(r, v, eps=prm["epsilon"],
                                        norm_by_std=norm))[pos]
    for key, want in ((f"grpo_norm_std_{norm}_row", a),
                      (f"grpo_vectorized_norm_std_{norm}_row", a),
                      (f"grpo_norm_std_{norm}", a[:, None] * mask)):
      if key in out:
        close(want, out[key], key)
        seen.add(key)
  check_keys("outputs", out, seen)
  assert seen, "no GRPO output checked"


# ----------------------------------------------------------- Stratified
def check_stratified(case):
  prm, inp, out = case["params"], case["inputs"], case["outputs"]
  check_keys("params", prm, {"eps", "ddof", "alphas", "seed"})
  check_keys("inputs", inp, {"index", "strata_search_calls", "scores"})
  r, v, pos = to_groups(inp["index"], inp["scores"])
  s, _, _ = to_groups(inp["index"], inp["strata_search_calls"])
  s = s.astype(np.int32)
  kw = dict(eps=prm["eps"], ddof=prm["ddof"])
  checked = set()
  for key, want in out.items():
    m = re.fullmatch(r"A_blend\[alpha=(.*)\]", key)
    if m:
      got = stratified.stratified_advantages(r, v, s, alpha=float(m[1]), **kw)
    elif key == "A_SAN":
      got = stratified.san_advantages(r, v, s, **kw)
    elif key == "A_GN":
      got = stratified.gn_advantages(r, v, **kw)
    else:
      continue
    close(np.asarray(got)[pos], want, key)
    checked.add(key)
  check_keys("outputs", out, checked)
  alphas = {float(re.fullmatch(r"A_blend\[alpha=(.*)\]", k)[1])
            for k in checked if k.startswith("A_blend")}
  assert alphas == {float(a) for a in prm["alphas"]}, "alphas not all covered"
  cross = case.get("crosscheck_verl", {})
  if cross.get("available"):
    check_keys("crosscheck_verl", cross, {"available", "note",
                                          "verl_grpo_gn_row",
                                          "verl_grpo_composite_uid_row"})
    gn = grpo.grpo_advantages(r, v, eps=prm["eps"])
    close(np.asarray(gn)[pos], cross["verl_grpo_gn_row"], "verl GN")
    san = stratified.san_advantages(r, v, s, singleton_stratum="raw", **kw)
    close(np.asarray(san)[pos], cross["verl_grpo_composite_uid_row"],
          "verl composite uid (singleton stratum = raw)")
  # Composition path: outcome=stratified gives the alpha=default blend.
  cfg = adv_api.default_config()
  cfg.outcome = "stratified"
  cfg.stratified.eps, cfg.stratified.ddof = prm["eps"], prm["ddof"]
  for a in prm["alphas"]:
    cfg.stratified.alpha = float(a)
    x = _outcome_inputs(r, v, s)
    got, _, metrics = adv_api.compute_advantages(cfg, x,
                                                 adv_api.init_state(cfg))
    close(np.asarray(got)[pos][:, 0], out[f"A_blend[alpha={a}]"],
          f"compose alpha={a}")
    assert "strat/cross_stratum_bias" in metrics


def _outcome_inputs(r, v, s=None, t=1):
  p, g = r.shape
  return adv_api.AdvantageInputs(
      rewards=r, valid=v,
      strata=np.zeros((p, g), np.int32) if s is None else s,
      step_rewards=np.zeros((p, g, t), np.float32),
      step_valid=np.ones((p, g, t), bool),
      anchor_ids=np.zeros((p, g, t), np.int32))


# ---------------------------------------------------------------- GiGPO
GIGPO_PARAMS = {"gamma", "mode", "step_advantage_w", "enable_similarity",
                "similarity_thresh", "epsilon", "invalid_action_penalty_coef",
                "seed"}
GIGPO_INPUTS = {"index", "traj_index", "step", "anchor_obs", "env_rewards",
                "is_action_valid", "episode_rewards", "response_mask",
                "token_level_rewards"}


def canonical(ids):
  """Relabels ids 0.. by first appearance."""
  table = {}
  return np.array([table.setdefault(i, len(table)) for i in ids])


def check_gigpo(case):
  prm, inp, out = case["params"], case["inputs"], case["outputs"]
  check_keys("params", prm, GIGPO_PARAMS)
  check_keys("inputs", inp, GIGPO_INPUTS)
  coef = prm["invalid_action_penalty_coef"]
  p, g, t, shape = gigpo.rows_to_padded(inp["index"], inp["traj_index"])
  assert (t == np.asarray(inp["step"])).all(), "rows not in time order"
  rew = np.zeros(shape[:2], np.float32)
  valid = np.zeros(shape[:2], bool)
  rew[p, g], valid[p, g] = inp["episode_rewards"], True
  step_r = np.zeros(shape, np.float32)
  step_v = np.zeros(shape, bool)
  act = np.ones(shape, bool)
  step_r[p, g, t], step_v[p, g, t] = inp["env_rewards"], True
  act[p, g, t] = np.asarray(inp["is_action_valid"]) > 0.5
  penalty = coef * (1 - np.asarray(inp["is_action_valid"]))
  close(np.asarray(inp["token_level_rewards"]).sum(-1),
        np.asarray(inp["episode_rewards"]) - penalty, "row score layout")
  obs = [[[None] * shape[2] for _ in range(shape[1])] for _ in range(shape[0])]
  for row, o in enumerate(inp["anchor_obs"]):
    obs[p[row]][g[row]][t[row]] = o
  if prm["enable_similarity"]:          # verl-agent scans rows in batch order
    ids = np.full(shape, -1, np.int32)
    for q in range(shape[0]):
      rows = np.flatnonzero(p == q)
      ids[p[rows], g[rows], t[rows]] = anchors.similarity_clusters(
          [inp["anchor_obs"][i] for i in rows], prm["similarity_thresh"])
  else:
    ids = anchors.exact_anchor_ids(obs)
  kw = dict(gamma=prm["gamma"], omega=prm["step_advantage_w"],
            mode=prm["mode"], eps=prm["epsilon"],
            invalid_action_penalty_coef=coef)
  a, a_e, a_s = (np.asarray(z)[p, g, t] for z in gigpo.gigpo_advantages(
      rew, valid, step_r, step_v, ids, act, **kw))
  _, a_e_traj, _ = gigpo.gigpo_advantages(rew, valid, step_r, step_v, ids,
                                          act, episode_stats="per_traj", **kw)
  returns = np.asarray(gigpo.discounted_returns(step_r, step_v,
                                                prm["gamma"]))[p, g, t]
  mask = np.asarray(inp["response_mask"])
  got = {
      "step_discounted_returns": returns,
      "step_rewards": returns - penalty,
      "episode_advantages_row": a_e,
      "episode_advantages_row_per_traj": np.asarray(a_e_traj)[p, g, t],
      "step_advantages_row": a_s,
      "advantages_row": a,
      "advantages": a[:, None] * mask,
  }
  check_keys("outputs", out, set(got) | {"step_group_ids"})
  for key, want in out.items():
    if key == "step_group_ids":
      key_ids = canonical(zip(p, ids[p, g, t]))
      np.testing.assert_array_equal(key_ids, want, err_msg=key)
    else:
      close(got[key], want, key)
  # The same numbers through the config-driven composition.
  cfg = adv_api.default_config()
  cfg.outcome = "grpo" if prm["mode"] == "mean_std_norm" else "drgrpo"
  cfg.step = "gigpo"
  cfg.gigpo.update(dict(omega=prm["step_advantage_w"], gamma=prm["gamma"],
                        mode=prm["mode"], eps=prm["epsilon"],
                        invalid_action_penalty_coef=coef))
  x = adv_api.AdvantageInputs(rew, valid, np.zeros(shape[:2], np.int32),
                              step_r, step_v, ids, act)
  comp, _, _ = adv_api.compute_advantages(cfg, x, adv_api.init_state(cfg))
  close(np.asarray(comp)[p, g, t], out["advantages_row"], "compose")


# ---------------------------------------------------------------- HA-DW
def check_hadw_trl(case):
  prm = case["params"]
  check_keys("params", prm, {"eta", "lambda_scale", "history_window",
                             "num_generations", "num_prompts_per_step",
                             "seed"})
  n_gen, window = prm["num_generations"], prm["history_window"]
  cfg = adv_api.default_config()
  cfg.reweight = "hadw"
  cfg.grpo.eps = 1e-4                      # TRL scale_rewards="group"
  cfg.hadw.update(dict(variant="trl", eta=prm["eta"],
                       lambda_scale=float(prm["lambda_scale"]),
                       window=window))
  fn = functools.partial(adv_api.compute_advantages,
                         adv_api.AdvantageConfig.from_config(cfg))
  state = hadw.init_state(window)
  cstate = adv_api.init_state(cfg)
  for st in case["steps"]:
    check_keys("step fields", st, {"step", "rewards", "advantages", "phi",
                                   "reweighted_advantages", "state_before",
                                   "state_after", "logged"})
    r = np.asarray(st["rewards"], np.float32).reshape(-1, n_gen)
    assert r.shape[0] == prm["num_prompts_per_step"]
    v = np.ones_like(r, bool)
    a = grpo.grpo_advantages(r, v, eps=1e-4)
    close(np.ravel(a), st["advantages"], f"step {st['step']} advantages")
    phi, state, m = hadw.hadw_update("trl", state, r, v, a, eta=prm["eta"],
                                     lambda_scale=prm["lambda_scale"])
    phi = np.ravel(phi)
    close(phi, st["phi"], f"step {st['step']} phi")
    close(np.ravel(a) * phi, st["reweighted_advantages"], "reweighted")
    buf = np.asarray(state.buffer)[window - int(state.count):]
    close(buf, st["state_after"]["buffer"], "buffer")
    close(state.anchor, st["state_after"]["prior"], "prior")
    logged = st["logged"] or {}
    want = {"hadw/capability_prior": m["anchor"],
            "hadw/capability_posterior": m["anchor_after"],
            "hadw/batch_accuracy": m["batch_mean"], "hadw/eta_t": m["eta_t"],
            "hadw/reweighting_mean": phi.mean(),
            "hadw/reweighting_std": phi.std(ddof=1)}
    check_keys("logged", logged, want)
    for key, val in logged.items():
      close(want[key], val, key)
    got, cstate, _ = fn(_outcome_inputs(r, v), cstate)
    close(np.ravel(got), st["reweighted_advantages"], "compose")


def check_hadw_repo(case):
  prm = case["params"]
  check_keys("params", prm, {"reward_window_k", "norm_adv_by_std_in_grpo",
                             "epsilon", "G", "P", "seed"})
  norm = prm["norm_adv_by_std_in_grpo"]
  cfg = adv_api.default_config()
  cfg.outcome = "grpo" if norm else "drgrpo"
  cfg.reweight = "hadw"
  cfg.grpo.eps = prm["epsilon"]
  cfg.hadw.update(dict(variant="repo", window=prm["reward_window_k"]))
  state = adv_api.init_state(cfg)
  for st in case["steps"]:
    check_keys("step fields", st, {"step", "index", "rewards",
                                   "response_mask", "batch_reward_history",
                                   "advantages_row"})
    scores = np.asarray(st["rewards"], np.float32)
    r, v, pos = to_groups(st["index"], scores)
    assert r.shape == (prm["P"], prm["G"]), r.shape
    got, state, m = adv_api.compute_advantages(cfg, _outcome_inputs(r, v),
                                               state)
    close(np.asarray(got)[pos][:, 0], st["advantages_row"],
          f"step {st['step']}")
    k = int(state.hadw.count)
    close(np.asarray(state.hadw.buffer)[len(state.hadw.buffer) - k:],
          st["batch_reward_history"], "history")
    close(m["hadw/anchor"], np.mean(st["batch_reward_history"]), "anchor")


# ----------------------------------------------------------------- loss
def check_ppo_loss(case):
  prm, inp, out = case["params"], case["inputs"], case["outputs"]
  check_keys("params", prm, {"clip_ratio", "clip_ratio_low",
                             "clip_ratio_high", "clip_ratio_c",
                             "kl_loss_coef", "seed"})
  check_keys("inputs", inp, {"old_log_prob", "log_prob", "ref_log_prob",
                             "advantages", "response_mask"})
  x = {k: jnp.asarray(v, jnp.float32) for k, v in inp.items()}
  low = prm.get("clip_ratio_low", prm.get("clip_ratio", 0.2))
  high = prm.get("clip_ratio_high", prm.get("clip_ratio", 0.2))
  kw = dict(clip_ratio_low=low, clip_ratio_high=high,
            clip_ratio_c=prm["clip_ratio_c"], kl_loss_coef=prm["kl_loss_coef"])

  def run(mode, kind):
    return loss_lib.ppo_loss(x["log_prob"], x["old_log_prob"],
                             x["ref_log_prob"], x["advantages"],
                             x["response_mask"], loss_agg_mode=mode,
                             kl_loss_type=kind, use_kl_loss=True, **kw)

  for key, want in out.items():
    m = re.fullmatch(r"(\w+)\[([\w-]+)\](?:\[([\w-]+)\])?", key)
    assert m, f"unknown output {key}"
    name, a, b = m.groups()
    if name == "pg_loss":
      close(run(a, "low_var_kl")[1]["pg_loss"], want, key)
    elif name == "metrics":
      metrics = run(a, "low_var_kl")[1]
      check_keys("metrics", want, {"actor/pg_clipfrac", "actor/ppo_kl",
                                   "actor/pg_clipfrac_lower"})
      for mk, mv in want.items():
        close(metrics[mk.split("/")[1]], mv, key + mk)
    elif name == "kl_loss":
      close(run(b, a)[1]["kl"], want, key)
    elif name == "total_loss_pg_plus_kl":    # verl actor default low_var_kl
      close(run(a, "low_var_kl")[0], want, key)
    elif name == "kl_matrix":
      close(loss_lib.kl_penalty(x["log_prob"], x["ref_log_prob"], a), want,
            key)
    else:
      raise AssertionError(f"unknown output {key}")


# ------------------------------------------------------------------ pool
RULE_NAMES = {"recycle": "recycle", "dapo": "bounded_dapo", "grpo": "grpo"}


def check_recycling(case):
  prm, inp, out = case["params"], case["inputs"], case["outputs"]
  check_keys("params", prm, {"Q", "T", "B", "K", "k", "seed"})
  check_keys("inputs", inp, {"u_keys", "successes", "p_latent"})
  check_keys("outputs", out, RULE_NAMES)
  for name, steps in out.items():
    pool = pool_lib.QueryPool(prm["Q"], rule=RULE_NAMES[name],
                              batch_size=prm["B"], oversample=prm["k"],
                              seed=prm["seed"])
    assert len(steps) == prm["T"]
    for st in steps:
      t = st["t"]
      check_keys("step fields", st, {
          "t", "candidates", "successes", "signal", "accepted",
          "accepted_signal_groups", "accepted_previously_zero_variance",
          "weights_after", "n_active_after"})
      cand = pool.sample(np.asarray(inp["u_keys"][t]))
      what = f"{name} step {t}"
      np.testing.assert_array_equal(cand, st["candidates"], what)
      succ = np.asarray(inp["successes"][t])[cand]
      np.testing.assert_array_equal(succ, st["successes"], what)
      acc, m = pool.update(cand, successes=succ, group_size=prm["K"])
      np.testing.assert_array_equal(acc, st["accepted"], what)
      np.testing.assert_array_equal(pool.weights, st["weights_after"], what)
      signal = (succ > 0) & (succ < prm["K"])
      np.testing.assert_array_equal(signal, st["signal"], what)
      assert int(signal[np.isin(cand, acc)].sum()) == (
          st["accepted_signal_groups"]), what
      assert m["pool/size"] == st["n_active_after"], what
      n_prev = len(st["accepted_previously_zero_variance"])
      assert math.isclose(m["pool/recycled_frac"] * max(len(acc), 1),
                          n_prev), what


CHECKERS = (
    ("GRPO (", check_grpo),
    ("Stratified GRPO", check_stratified),
    ("GiGPO (", check_gigpo),
    ("HA-DW, TRL PR #4872", check_hadw_trl),
    ("HA-DW, authors' repository", check_hadw_repo),
    ("PPO-clip", check_ppo_loss),
    ("Query recycling pool", check_recycling),
)


@pytest.mark.parametrize("path", _golden_files())
def test_golden(path):
  assert path.is_file(), (
      f"golden directory {path} is missing or has no *.json: {GOLDEN} ships "
      "with the repo and every GIGRL_GOLDEN_DIR entry must hold cases")
  case = json.loads(path.read_text())
  method = case.get("method", "<no method field>")
  checkers = [fn for prefix, fn in CHECKERS if method.startswith(prefix)]
  assert len(checkers) == 1, f"unknown golden method {method!r} in {path}"
  checkers[0](case)
