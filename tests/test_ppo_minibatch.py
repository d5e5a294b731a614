"""PPO as verl runs it: old log-probs once, mini-batches × epochs, gradient accumulation, the
verl learning-rate schedule, and the config checks of those fields."""
import jax
import numpy as np
import pytest
from flax import nnx

from gigrl import testing
from gigrl.training import build
from gigrl import config as config_lib
from gigrl.update import loss as loss_lib
from gigrl.update import step as update_lib
from gigrl.config_utils import ConfigError

B, S = 8, 16


def _cfg(**train):
  cfg = config_lib.base_config()
  cfg.data.prompts_per_step, cfg.data.group_size = 4, 2      # B = 8 rows
  cfg.rollout.max_turns = 1
  cfg.rollout.max_new_tokens = 8
  cfg.train.learning_rate = 1e-2
  cfg.loss.use_kl_loss = True
  cfg.loss.kl_loss_coef = 0.1
  cfg.loss.entropy_coeff = 0.01
  for k, v in train.items():
    cfg.train[k] = v
  return cfg


_policy = testing.tiny_policy   # (seed) -> build.Policy


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 64, (B, S)).astype(np.int32)
  mask = np.zeros((B, S), np.float32)
  spans = [(4, 10), (5, 16), (8, 12), (3, 3), (2, 15), (6, 9), (9, 16), (1, 5)]
  for b, (lo, hi) in enumerate(spans):   # row 3: no tokens
    mask[b, lo:hi] = 1.0
  adv = rng.normal(size=(B, 1)).astype(np.float32).repeat(S, axis=1) * mask
  return tokens, mask, adv


def _well_conditioned(cfg):
  """Adam ε = 1 for tests that compare the params after one update between two ways of
  computing the same gradient. Adam's first step moves a parameter by lr·g/(|g| + ε): with
  ε = 1e-8 a summation-order difference of 1e-10 in a gradient near 1e-8 becomes 1e-5 of the
  parameter (seen on an AVX-512 machine, 1 of 64 elements), and elsewhere the step is lr·sign(g)
  and says nothing of |g|. With ε = 1 the step is ≈ lr·g, so the params compare the gradients."""
  cfg.train.eps = 1.0
  return cfg


def _assert_same_update(got, want, init):
  """The updates (new − initial params) agree elementwise: median |update| here is ~4e-6, so
  atol 1e-8 is well below a typical element's step."""
  for a, b, w in zip(_leaves(got), _leaves(want), _leaves(init)):
    np.testing.assert_allclose(a - w, b - w, rtol=1e-4, atol=1e-8)


def _copy(tree):
  return jax.tree.map(lambda x: x.copy(), tree)


def _run(cfg, policy, ref, *, step=1):
  steps = build.build_steps(cfg, policy)
  opt_state = steps.init_opt(steps.rl_tx, policy.params)
  mini, micro = build.ppo_rows(cfg)
  tokens, mask, adv = _batch()
  return update_lib.ppo_update(
      steps, _copy(policy.params), opt_state, ref, tokens, mask, adv,
      put=lambda x: build.put_rows(policy.mesh, x), mini_batch_rows=mini,
      epochs=int(cfg.train.ppo_epochs), micro_batch_rows=micro, seed=0, step=step,
      shuffle=bool(cfg.train.shuffle))


def _leaves(params):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]


def test_one_minibatch_one_epoch_is_exactly_todays_update():
  cfg, policy, ref = _cfg(), _policy(0), _policy(1).params
  params, _, m = _run(cfg, policy, ref)
  steps = build.build_steps(cfg, policy)
  tokens, mask, adv = _batch()
  put = lambda x: build.put_rows(policy.mesh, x)
  want_p, _, want_m = steps.rl_step(_copy(policy.params), steps.init_opt(steps.rl_tx,
                                                                         policy.params),
                                    ref, put(tokens), put(mask), put(adv))
  assert m["train/updates"] == 1
  for a, b in zip(_leaves(params), _leaves(want_p)):
    np.testing.assert_array_equal(a, b)
  for k, v in jax.device_get(want_m).items():
    assert float(m[k]) == float(v), k


def test_old_logprobs_from_the_rollout_policy_give_ratio_one_on_the_first_update():
  """The general step with the precomputed old log-probs equals the on-policy step."""
  cfg, policy, ref = _well_conditioned(_cfg()), _policy(0), _policy(1).params
  steps = build.build_steps(cfg, policy)
  tokens, mask, adv = _batch()
  put = lambda x: build.put_rows(policy.mesh, x)
  old = steps.logprob_step(policy.params, put(tokens), put(mask))
  p1, _, m1 = steps.ppo_step(1)(_copy(policy.params), steps.init_opt(steps.rl_tx, policy.params),
                                ref, put(tokens), put(mask), put(adv), old)
  p0, _, m0 = steps.rl_step(_copy(policy.params), steps.init_opt(steps.rl_tx, policy.params),
                            ref, put(tokens), put(mask), put(adv))
  assert float(m1["pg_clipfrac"]) == 0.0 and abs(float(m1["ppo_kl"])) < 1e-6
  for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
    np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, err_msg=k)
  _assert_same_update(p1, p0, policy.params)


def test_old_logprobs_come_one_micro_batch_at_a_time():
  """update.old_logprobs: the rollout policy's log-probs in calls of the micro-batch's rows (a
  pod's whole-batch forward pass does not fit), equal to one call over every row; ppo_update
  makes one call per micro-batch."""
  cfg, policy = _cfg(micro_batch_size=2, ppo_mini_batch_size=2), _policy(0)
  steps = build.build_steps(cfg, policy)
  tokens, mask, adv = _batch()
  put = lambda x: build.put_rows(policy.mesh, x)
  want = np.asarray(steps.logprob_step(policy.params, put(tokens), put(mask)))
  calls, real = [], steps.logprob_step

  def counted(params, tok, msk):
    calls.append(tok.shape[0])
    return real(params, tok, msk)

  got = update_lib.old_logprobs(counted, policy.params, tokens, mask, put=put, chunk_rows=2)
  assert calls == [2, 2, 2, 2] and got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert np.abs(want).max() > 0.1                           # not a trivial batch
  calls.clear()
  update_lib.old_logprobs(counted, policy.params, tokens, mask, put=put, chunk_rows=0)
  assert calls == [B]
  calls.clear()
  steps.logprob_step = counted
  mini, micro = build.ppo_rows(cfg)
  update_lib.ppo_update(steps, _copy(policy.params), steps.init_opt(steps.rl_tx, policy.params),
                        _policy(1).params, tokens, mask, adv, put=put, mini_batch_rows=mini,
                        epochs=1, micro_batch_rows=micro, seed=0, step=1)
  steps.logprob_step = real
  assert (mini, micro) == (4, 2) and calls == [2, 2, 2, 2]


@pytest.mark.parametrize("mode", loss_lib.AGG_MODES)
def test_gradient_accumulation_equals_one_big_batch(mode):
  cfg, policy, ref = _cfg(), _policy(0), _policy(1).params
  cfg.loss.loss_agg_mode = mode
  opts = loss_lib.kwargs_from_config(cfg.loss)
  tokens, mask, adv = _batch()
  k = build.max_generated_tokens(cfg)
  kw = dict(max_tokens=k, chunk_size=int(cfg.model.logprob_chunk_size), loss_options=opts)
  g = policy.graphdef
  old = update_lib.logprob_fn(g, max_tokens=k, chunk_size=kw["chunk_size"])(
      policy.params, tokens, mask) - 0.3          # ratio != 1: the clip is exercised
  whole = lambda p: update_lib.rl_loss(p, g, ref, tokens, mask, adv, old, **kw)[0]
  (want_loss, want_grad) = jax.value_and_grad(whole)(policy.params)
  # The mini-batch's divisor, then 4 micro-batches of 2 rows each, gradients summed.
  compact = np.take_along_axis(mask[:, 1:], np.asarray(update_lib.compact_positions(
      mask[:, 1:], old.shape[1])), axis=1)
  denom = loss_lib.agg_denominator(compact, mode, opts["loss_scale_factor"])
  total_loss, total_grad = 0.0, None
  for i in range(0, B, 2):
    sl = slice(i, i + 2)
    fn = lambda p: update_lib.rl_loss(p, g, ref, tokens[sl], mask[sl], adv[sl], old[sl],
                                      denom, **kw)[0]
    loss, grad = jax.value_and_grad(fn)(policy.params)
    total_loss += float(loss)
    total_grad = grad if total_grad is None else jax.tree.map(np.add, total_grad, grad)
  np.testing.assert_allclose(total_loss, float(want_loss), rtol=1e-5, atol=1e-6)
  for a, b in zip(_leaves(total_grad), _leaves(want_grad)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_ppo_step_with_micro_batches_equals_one_micro_batch():
  cfg, policy, ref = _well_conditioned(_cfg()), _policy(0), _policy(1).params
  steps = build.build_steps(cfg, policy)
  tokens, mask, adv = _batch()
  put = lambda x: build.put_rows(policy.mesh, x)
  old = np.asarray(steps.logprob_step(policy.params, put(tokens), put(mask))) - 0.3
  out = {}
  for n in (1, 4):
    p, _, m = steps.ppo_step(n)(_copy(policy.params), steps.init_opt(steps.rl_tx,
                                                                      policy.params),
                                ref, put(tokens), put(mask), put(adv), put(old))
    out[n] = (p, jax.device_get(m))
  assert sorted(out[1][1]) == sorted(out[4][1])
  for k, v in out[1][1].items():
    np.testing.assert_allclose(float(out[4][1][k]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)
  assert float(out[1][1]["pg_clipfrac"]) > 0
  _assert_same_update(out[4][0], out[1][0], policy.params)


def test_sft_step_with_micro_batches_equals_the_whole_batch():
  """``train.sft_micro_batch_size``: an SFT step over 4 micro-batches of 2 rows (rows with 0 to
  13 loss tokens, one with none) gives the whole batch's metrics and update: each micro-batch
  is weighted by its share of the loss tokens."""
  out = {}
  for micro in (0, 2):
    cfg = _well_conditioned(_cfg(sft_batch_size=B, sft_micro_batch_size=micro,
                                 sft_learning_rate=1e-2))
    policy = _policy(0)
    steps = build.build_steps(cfg, policy)
    tokens, mask, _ = _batch()
    put = lambda x, policy=policy: build.put_rows(policy.mesh, x)
    p, _, m = steps.sft_step(_copy(policy.params), steps.init_opt(steps.sft_tx, policy.params),
                             put(tokens), put(mask))
    out[micro] = (p, jax.device_get(m), policy.params)
  assert build.sft_micro_batches(_cfg(sft_batch_size=B, sft_micro_batch_size=2).train) == 4
  assert sorted(out[0][1]) == sorted(out[2][1])
  for k, v in out[0][1].items():
    np.testing.assert_allclose(float(out[2][1][k]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)
  _assert_same_update(out[2][0], out[0][0], out[0][2])
  bad = _cfg(sft_batch_size=B, sft_micro_batch_size=3)
  with pytest.raises(ConfigError, match="a divisor of train.sft_batch_size") as e:
    config_lib.validate(bad)
  assert e.value.field == "train.sft_micro_batch_size"


def test_one_update_with_micro_batches_is_on_policy_without_an_old_logprob_pass():
  """One mini-batch, one epoch, micro-batches (the SmolLM2 and query-recycling recipes): the
  step's only update is on-policy, so ppo_update makes no old log-prob pass; the update equals
  the un-micro-batched rl_step's (ratio 1, gradients accumulated over 4 micro-batches)."""
  cfg, policy, ref = _well_conditioned(_cfg(micro_batch_size=2)), _policy(0), _policy(1).params
  steps = build.build_steps(cfg, policy)
  tokens, mask, adv = _batch()
  put = lambda x: build.put_rows(policy.mesh, x)
  calls, real = [], steps.logprob_step
  steps.logprob_step = lambda *a: calls.append(1) or real(*a)
  mini, micro = build.ppo_rows(cfg)
  assert (mini, micro) == (B, 2)
  p1, _, m1 = update_lib.ppo_update(
      steps, _copy(policy.params), steps.init_opt(steps.rl_tx, policy.params), ref, tokens,
      mask, adv, put=put, mini_batch_rows=mini, epochs=1, micro_batch_rows=micro, seed=0,
      step=1)
  assert calls == [] and m1["train/updates"] == 1
  p0, _, m0 = steps.rl_step(_copy(policy.params), steps.init_opt(steps.rl_tx, policy.params),
                            ref, put(tokens), put(mask), put(adv))
  assert float(m1["pg_clipfrac"]) == 0.0 and abs(float(m1["ppo_kl"])) < 1e-6
  for k in ("loss", "pg_loss", "entropy", "grad_norm"):
    np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, err_msg=k)
  _assert_same_update(p1, p0, policy.params)


def test_micro_batches_of_untrained_rows_are_skipped():
  """Rows without loss tokens (groups the step does not train) are sorted last and fill whole
  micro-batches, which the step skips: NaN advantages on those rows never reach the gradient,
  and the update equals the one with finite values there."""
  cfg, policy, ref = _well_conditioned(_cfg(micro_batch_size=2)), _policy(0), _policy(1).params
  steps = build.build_steps(cfg, policy)
  tokens, mask, adv = _batch()
  mask[[0, 6]] = 0.0    # rows 0, 3, 6 untrained; sorted last: micro-batches [1 2] [4 5] [7 0] [3 6]
  adv = adv * mask
  poisoned = adv.copy()
  poisoned[[3, 6]] = np.nan            # in the unsorted order rows 3 and 6 share micro-batches
  put = lambda x: build.put_rows(policy.mesh, x)
  out = []
  for a in (adv, poisoned):
    p, _, m = update_lib.ppo_update(
        steps, _copy(policy.params), steps.init_opt(steps.rl_tx, policy.params), ref, tokens,
        mask, a, put=put, mini_batch_rows=B, epochs=1, micro_batch_rows=2, seed=0, step=1)
    out.append((p, m))
  assert np.isfinite(float(out[1][1]["loss"])) and float(out[1][1]["grad_norm"]) > 0
  for a, b in zip(_leaves(out[1][0]), _leaves(out[0][0])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("train", [dict(ppo_mini_batch_size=2), dict(ppo_epochs=2),
                                   dict(ppo_mini_batch_size=2, micro_batch_size=2)])
def test_several_updates_per_step_clip(train):
  cfg, policy, ref = _cfg(**train), _policy(0), _policy(1).params
  config_lib.validate(cfg)
  params, _, m = _run(cfg, policy, ref)
  assert m["train/updates"] == 2
  assert m["pg_clipfrac"] > 0, m       # the second update sees ratio != 1
  assert m["ppo_kl"] != 0
  assert all(np.isfinite(v) for v in m.values())


def test_minibatch_order_is_seeded_by_seed_step_epoch():
  a = update_lib.minibatch_order(8, 4, 2, seed=0, step=3)
  b = update_lib.minibatch_order(8, 4, 2, seed=0, step=3)
  c = update_lib.minibatch_order(8, 4, 2, seed=0, step=4)
  assert len(a) == 4 and all(len(r) == 4 for r in a)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert sorted(np.concatenate(a[:2])) == list(range(8))        # an epoch covers every row
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))
  assert not np.array_equal(np.concatenate(a[:2]), np.concatenate(a[2:]))  # epochs differ
  one = update_lib.minibatch_order(8, 8, 2, seed=0, step=3)        # one mini-batch: in order
  assert all(np.array_equal(r, np.arange(8)) for r in one)
  fixed = update_lib.minibatch_order(8, 4, 1, seed=0, step=3, shuffle=False)
  np.testing.assert_array_equal(np.concatenate(fixed), np.arange(8))


@pytest.mark.parametrize("field,value,other", [
    ("ppo_mini_batch_size", 3, None), ("micro_batch_size", 3, None),
    ("micro_batch_size", 4, ("ppo_mini_batch_size", 1))])
def test_a_size_that_does_not_divide_is_a_config_error(field, value, other):
  cfg = _cfg(**{field: value})                     # P = 4 prompts, G = 2
  if other:
    cfg.train[other[0]] = other[1]
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg)
  assert f"train.{field}" in str(e.value)
  assert "data.prompts_per_step" in str(e.value) or "data.group_size" in str(e.value)


def _lr(cfg_train, count, num_prompts=4):
  tx_sched = update_lib.lr_schedule(
      float(cfg_train.learning_rate), total_steps=int(cfg_train.num_steps),
      lr_warmup_steps=int(cfg_train.lr_warmup_steps),
      lr_warmup_steps_ratio=float(cfg_train.lr_warmup_steps_ratio),
      lr_scheduler_type=cfg_train.lr_scheduler_type, min_lr_ratio=float(cfg_train.min_lr_ratio),
      num_cycles=float(cfg_train.num_cycles),
      updates_per_step=update_lib.updates_per_step(cfg_train, num_prompts))
  return float(tx_sched(np.int32(count)))


def test_lr_schedule_warmup_ratio_cosine_and_updates_per_step():
  t = _cfg(num_steps=100, lr_warmup_steps_ratio=0.2, lr_scheduler_type="cosine",
           min_lr_ratio=0.1, learning_rate=1.0, ppo_mini_batch_size=2).train   # 2 updates/step
  assert _lr(t, 0) == 0.0
  assert _lr(t, 1) == 0.0                                  # same RL step as count 0
  assert _lr(t, 20) == pytest.approx(10 / 20)              # RL step 10 of a 20-step warm-up
  assert _lr(t, 40) == pytest.approx(1.0)                  # warm-up done
  assert _lr(t, 40 + 80) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)   # half-way: cos = 0
  assert _lr(t, 200) == pytest.approx(0.1, rel=1e-5)       # the floor at the end
  c = _cfg(num_steps=100, lr_warmup_steps=5, learning_rate=2.0).train
  assert _lr(c, 0) == 0.0 and _lr(c, 1) == pytest.approx(0.4) and _lr(c, 50) == 2.0
  assert _lr(_cfg(learning_rate=3.0).train, 7) == 3.0      # default: constant, no warm-up


def test_rl_logprobs_are_of_the_rollout_temperature():
  """verl divides the actor's logits by ``rollout.temperature``: the built RL steps score the
  tokens under the distribution the rollout sampled from, SFT stays at temperature 1."""
  cfg, policy = _cfg(), _policy(0)
  cfg.rollout.temperature = 1.7
  tokens, mask, _ = _batch()
  steps = build.build_steps(cfg, policy)
  got = np.asarray(steps.logprob_step(policy.params, tokens, mask))
  logits = np.asarray(nnx.merge(policy.graphdef, policy.params)(tokens), np.float64) / 1.7
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=2)[..., 0]
  pos = np.asarray(update_lib.compact_positions(mask[:, 1:], got.shape[1]))
  m = np.take_along_axis(mask[:, 1:], pos, axis=1)
  np.testing.assert_allclose(got * m, np.take_along_axis(want, pos, axis=1) * m, atol=1e-4)
  raw = update_lib.logprob_fn(policy.graphdef, max_tokens=got.shape[1],
                              chunk_size=int(cfg.model.logprob_chunk_size))(
                                  policy.params, tokens, mask)
  assert np.abs((np.asarray(raw) - got) * m).max() > 1e-2     # temperature 1 differs


def _behaviour(steps, params, tokens, mask, put, shift):
  """The sampler's log-probs aligned with ``tokens`` (f32[B, S], as
  ``TrajectoryBatch.behaviour_logprobs``): the trainer's own at these params, minus ``shift``."""
  lp = np.asarray(steps.logprob_step(params, put(tokens), put(mask)))
  pos = np.asarray(update_lib.compact_positions(mask[:, 1:], lp.shape[1]))
  out = np.zeros(tokens.shape, np.float32)
  np.put_along_axis(out[:, 1:], pos, lp - shift, axis=1)
  return out * mask


@pytest.mark.parametrize("micro", [0, 2])
@pytest.mark.parametrize("correction,shift,weight", [
    ("tis", 0.3, np.exp(0.3)), ("tis", 1.0, 2.0), ("decoupled", 0.3, np.exp(0.3)),
    ("decoupled", 1.0, 0.0)])
def test_off_policy_correction_weights_the_policy_gradient(micro, correction, shift, weight):
  """``loss.off_policy_correction`` through ``ppo_update`` (one update: ``rl_step``, or the
  on-policy micro-batched ``ppo_step``): with the behaviour log-probs ``shift`` nats below the
  proximal policy's (the params at the start of the update), every token's ratio is
  ρ = e^shift; ``tis`` weights the policy-gradient loss by min(ρ, 2), ``decoupled`` by ρ, or
  drops every token when ρ > 2. The KL and entropy terms are not weighted. By hand:
  pg_loss = weight × pg_loss without correction."""
  out = {}
  for corr in ("none", correction):
    cfg = _cfg(micro_batch_size=micro)
    cfg.loss.off_policy_correction = corr
    policy, ref = _policy(0), _policy(1).params
    steps = build.build_steps(cfg, policy)
    assert steps.behaviour == (corr != "none")
    tokens, mask, adv = _batch()
    put = lambda x, policy=policy: build.put_rows(policy.mesh, x)
    behav = _behaviour(steps, policy.params, tokens, mask, put, shift)
    _, _, m = update_lib.ppo_update(
        steps, _copy(policy.params), steps.init_opt(steps.rl_tx, policy.params), ref, tokens,
        mask, adv, put=put, mini_batch_rows=B, epochs=1, micro_batch_rows=micro, seed=0,
        step=1, behaviour=behav if steps.behaviour else None)
    out[corr] = m
  m0, m1 = out["none"], out[correction]
  assert "is_ratio_mean" not in m0
  np.testing.assert_allclose(m1["pg_loss"], weight * m0["pg_loss"], rtol=2e-4, atol=1e-7)
  np.testing.assert_allclose(m1["kl"], m0["kl"], rtol=1e-5)
  np.testing.assert_allclose(m1["is_ratio_mean"], np.exp(shift), rtol=1e-4)
  np.testing.assert_allclose(m1["is_ratio_max"], np.exp(shift), rtol=1e-4)
  np.testing.assert_allclose(m1["behaviour_abs_dlogp"], shift, rtol=1e-4)
  np.testing.assert_allclose(m1["is_capped_frac"], 1.0 if np.exp(shift) > 2 else 0.0, atol=1e-6)


def test_off_policy_correction_with_ppo_mini_batches_uses_the_proximal_logprobs():
  """The mini-batch path: the old log-probs (π_prox, computed once before the updates) and the
  behaviour log-probs both reach ``ppo_step``; its first update's pg_loss is weighted by
  ρ = π_prox / π_behav = e^0.3 (``tis``)."""
  out = {}
  for corr in ("none", "tis"):
    cfg = _cfg()
    cfg.loss.off_policy_correction = corr
    policy, ref = _policy(0), _policy(1).params
    steps = build.build_steps(cfg, policy)
    tokens, mask, adv = _batch()
    put = lambda x, policy=policy: build.put_rows(policy.mesh, x)
    old = steps.logprob_step(policy.params, put(tokens), put(mask))
    extra = (put(_behaviour(steps, policy.params, tokens, mask, put, 0.3)),) * steps.behaviour
    _, _, m = steps.ppo_step(1)(_copy(policy.params), steps.init_opt(steps.rl_tx, policy.params),
                                ref, put(tokens), put(mask), put(adv), old, *extra)
    out[corr] = jax.device_get(m)
  np.testing.assert_allclose(float(out["tis"]["pg_loss"]), np.exp(0.3) * float(
      out["none"]["pg_loss"]), rtol=2e-4)
  np.testing.assert_allclose(float(out["tis"]["is_ratio_mean"]), np.exp(0.3), rtol=1e-4)


def test_off_policy_correction_needs_temperature_one():
  cfg = _cfg()
  cfg.loss.off_policy_correction = "tis"
  config_lib.validate(cfg)
  cfg.rollout.temperature = 0.7
  with pytest.raises(ConfigError, match="recorded at temperature 1") as e:
    config_lib.validate(cfg)
  assert e.value.field == "loss.off_policy_correction"


def test_a_micro_batch_without_loss_tokens_adds_nothing_wherever_it_stands():
  """The step visits only the micro-batches with loss tokens (each visit costs a gradient-sized
  add), in order, wherever the empty ones stand: the same rows with the empty micro-batch
  first or last give the same update, to the bit. Fails if the step visits the first n
  micro-batches instead of the n with loss tokens (the update is then the empty one's: none)."""
  cfg, policy, ref = _cfg(micro_batch_size=4), _policy(0), _policy(1).params
  steps = build.build_steps(cfg, policy)
  tokens, mask, adv = _batch()
  mask[:4] = 0.0                           # micro-batch [0 1 2 3] holds no loss token
  adv = adv * mask
  put = lambda x: build.put_rows(policy.mesh, x)
  out = []
  for order in (np.arange(B), np.r_[4:B, 0:4]):     # the empty micro-batch first, then last
    p, _, m = steps.ppo_step(2, on_policy=True)(
        _copy(policy.params), steps.init_opt(steps.rl_tx, policy.params), ref,
        put(tokens[order]), put(mask[order]), put(adv[order]), None)
    out.append((_leaves(p), jax.device_get(m)))
  assert float(out[0][1]["grad_norm"]) > 0
  assert float(out[0][1]["loss"]) == float(out[1][1]["loss"])
  for a, b in zip(out[0][0], out[1][0]):
    np.testing.assert_array_equal(a, b)
