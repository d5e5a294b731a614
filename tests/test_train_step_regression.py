"""Pinned one-step regressions of the SFT and RL train steps (nanodo ``train_test.py`` style).

A tiny policy (fixed seed) on a one-device mesh takes one step of each kind, built exactly as the
trainer builds them (:func:`gigrl.training.build.build_steps`, so the RL step runs
:func:`gigrl.update.loss.ppo_loss`); its metrics and a checksum of the updated params must equal the
stored values. A change in the loss, the masking, the log-probs, the optimizer or the model
numerics moves them. If a change is intended, rerun with ``GIGRL_PRINT_PINNED=1`` and paste
the printed dicts after checking that the change explains them.
"""
import os

import jax
import numpy as np
import pytest

from gigrl import testing
from gigrl.training import build
from gigrl import config as config_lib

B, S = 4, 16

# pg_loss checks by hand: the ratio is 1, so token-mean of -A over the 6 + 11 + 4 scored
# tokens = -(6·1 + 11·(-0.5) + 4·2) / 21 = -0.404762; loss = pg + 0.1·kl - 0.01·entropy.
PINNED_SFT = {
    "grad_norm": 4.217231750488281, "loss": 4.253995418548584, "nonfinite_consecutive": 0.0,
    "nonfinite_updates": 0.0, "params_abs_sum": 3179.8566949571905,
    "sft/nll": 4.253995418548584, "sft/p>0.5_frac": 0.0}
PINNED_RL = {
    "entropy": 4.044013023376465, "grad_norm": 4.407796859741211, "kl": 0.0450812503695488,
    "loss": -0.4406939148902893, "nonfinite_consecutive": 0.0, "nonfinite_updates": 0.0,
    "params_abs_sum": 3184.9331039470344, "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0,
    "pg_loss": -0.4047619104385376, "ppo_kl": 0.0}


def _cfg():
  cfg = config_lib.base_config()
  cfg.rollout.max_turns = 1
  cfg.rollout.max_new_tokens = 8          # K = 16 generated tokens at most per row
  cfg.train.sft_learning_rate = 1e-2
  cfg.train.learning_rate = 1e-2
  cfg.loss.use_kl_loss = True
  cfg.loss.kl_loss_coef = 0.1
  cfg.loss.entropy_coeff = 0.01
  cfg.loss.clip_ratio_c = 3.0
  return cfg


_policy = testing.tiny_policy   # (seed) -> build.Policy


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 64, (B, S)).astype(np.int32)
  mask = np.zeros((B, S), np.float32)
  for b, (lo, hi) in enumerate([(4, 10), (5, 16), (8, 12), (3, 3)]):   # row 3: no tokens
    mask[b, lo:hi] = 1.0
  adv = np.repeat(np.array([[1.0], [-0.5], [2.0], [0.7]], np.float32), S, axis=1) * mask
  return tokens, mask, adv


def _summary(params, metrics):
  leaves = jax.tree.leaves(params)
  out = {k: float(v) for k, v in jax.device_get(metrics).items()}
  out["params_abs_sum"] = float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in leaves))
  return out


def _check(got, pinned, name):
  if os.environ.get("GIGRL_PRINT_PINNED") or not pinned:
    print(f"{name} = {dict(sorted(got.items()))!r}")
  assert pinned, f"{name} is empty: run with GIGRL_PRINT_PINNED=1 -s and paste the dict"
  assert sorted(got) == sorted(pinned)
  for k, want in pinned.items():
    np.testing.assert_allclose(got[k], want, rtol=2e-5, atol=1e-6, err_msg=k)


def test_sft_step_matches_pinned_metrics():
  cfg, policy = _cfg(), _policy(0)
  steps = build.build_steps(cfg, policy)
  opt_state = steps.init_opt(steps.sft_tx, policy.params)
  tokens, mask, _ = _batch()
  put = lambda x: build.put_rows(policy.mesh, x)
  params, _, m = steps.sft_step(policy.params, opt_state, put(tokens), put(mask))
  _check(_summary(params, m), PINNED_SFT, "PINNED_SFT")


def test_rl_step_matches_pinned_metrics():
  cfg, policy = _cfg(), _policy(0)
  ref = _policy(1).params                   # another init: a non-zero KL term
  steps = build.build_steps(cfg, policy)
  opt_state = steps.init_opt(steps.rl_tx, policy.params)
  tokens, mask, adv = _batch()
  put = lambda x: build.put_rows(policy.mesh, x)
  params, _, m = steps.rl_step(policy.params, opt_state, ref, put(tokens), put(mask),
                               put(adv))
  got = _summary(params, m)
  _check(got, PINNED_RL, "PINNED_RL")
  assert got["pg_loss"] == pytest.approx(-8.5 / 21, rel=1e-6)
  assert got["loss"] == pytest.approx(got["pg_loss"] + 0.1 * got["kl"] - 0.01 * got["entropy"],
                                      rel=1e-6)


def test_rl_step_skips_a_non_finite_update():
  cfg, policy = _cfg(), _policy(0)
  steps = build.build_steps(cfg, policy)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(policy.params)]
  opt_state = steps.init_opt(steps.rl_tx, policy.params)
  tokens, mask, adv = _batch()
  adv[0, 5] = np.nan
  put = lambda x: build.put_rows(policy.mesh, x)
  params, opt_state, m = steps.rl_step(policy.params, opt_state, _policy(1).params,
                                       put(tokens), put(mask), put(adv))
  assert not np.isfinite(float(m["loss"]))
  assert int(m["nonfinite_updates"]) == 1 and int(m["nonfinite_consecutive"]) == 1
  for a, b in zip(before, jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))      # params unchanged
