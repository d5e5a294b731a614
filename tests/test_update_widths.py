"""The RL update's shapes come from the trained rows (``train.trim_update_padding``): the width
W from the valid groups' rows only (filler rows cut to it), the LM-head positions K from their
generated tokens, both bucketed; the loss and gradients are those of the untrimmed shapes, and
the metrics line says when a step paid for compiling a new shape (``time/update_compile_s``).

The batch: P = 4 groups × G = 2 rollouts of a tiny model, S = 160. The three valid groups'
rows are short (a 20-token prompt, <= 21 generated tokens: W = 64, K = 32); the invalid
(filler) group's rows are long (150 tokens, 60 generated: W = 160 and K = 80, the generation
budget (max_turns + 1) × max_new_tokens, when they count).
"""
import dataclasses

import jax
import numpy as np
import pytest
from jax import monitoring

from gigrl import testing
from gigrl import config as config_lib
from gigrl.config_utils import ConfigError
from gigrl.rollout import trajectory as traj_lib
from gigrl.training import build
from gigrl.update import batch as batch_lib
from gigrl.update import step as update_lib

P, G, S, T = 4, 2, 160, 2
VALID = np.array([True, True, False, True])     # group 2 (rows 4, 5) is filler
ROWS = np.arange(P * G, dtype=np.int32).reshape(P, G)


def _cfg(**train):
  cfg = config_lib.base_config()
  cfg.data.prompts_per_step, cfg.data.group_size = P, G
  cfg.rollout.max_turns, cfg.rollout.max_new_tokens = 1, 40     # K bound 80
  cfg.train.learning_rate = 1e-2
  cfg.train.eps = 1.0     # Adam step ≈ lr·g: the params compare the gradients (test_ppo_minibatch)
  cfg.loss.use_kl_loss, cfg.loss.kl_loss_coef, cfg.loss.entropy_coeff = True, 0.1, 0.01
  for k, v in train.items():
    cfg.train[k] = v
  config_lib.validate(cfg)
  return cfg


_policy = testing.tiny_policy   # (seed) -> build.Policy


def _batch(gen=(5, 9, 14, 3, 60, 60, 21, 8), obs=10, shared_prompts=False):
  """Row r: a 20-token prompt, gen[r] // 2 generated, an observation, the rest generated (two
  turns); filler rows 4 and 5 also carry 60 generated tokens of padding-length.
  ``shared_prompts``: the rows of a group have the same prompt (as in RL), else each its own."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 64, 20) for _ in range(P)]
  builders = []
  for r, n in enumerate(gen):
    tb = traj_lib.TrajectoryBuilder()
    own = rng.integers(1, 64, 20)
    tb.add_prompt(prompts[r // G] if shared_prompts else own, anchor=f"q{r // G}")
    tb.add_generation(rng.integers(1, 64, n // 2), "<search> x </search>")
    tb.add_observation(rng.integers(1, 64, obs if n < 60 else 70), anchor="o")
    tb.add_generation(rng.integers(1, 64, n - n // 2), "<answer> a </answer>")
    builders.append(tb)
  return traj_lib.collate(builders, S, 0)


def _advantages():
  return np.random.default_rng(1).normal(size=(P, G, T)).astype(np.float32)


def _leaves(params):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]


_REF = {}


def _update(cfg, policy, steps, batch, *, trim, valid=VALID, step=1, pack=False,
            behaviour=False):
  mini, micro = build.ppo_rows(cfg)
  copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
  if id(steps) not in _REF:    # init_opt jits anew on each call: one state per steps, copied
    _REF[id(steps)] = steps, steps.init_opt(steps.rl_tx, policy.params), _policy(1).params
  _, opt, ref = _REF[id(steps)]
  return update_lib.rl_update(
      steps, copy(policy.params), copy(opt), ref, batch,
      ROWS, valid, _advantages(), put=lambda x: build.put_rows(policy.mesh, x),
      mini_batch_rows=mini, micro_batch_rows=micro, epochs=int(cfg.train.ppo_epochs),
      seed=0, step=step, shuffle=True, trim_padding=trim,
      max_lm_positions=build.max_generated_tokens(cfg), pack=pack, behaviour=behaviour)


def _assert_same_update(on, off, params):
  """Two rl_update results agree: loss metrics, and each parameter's change."""
  (p_on, _, m_on, _), (p_off, _, m_off, _) = on, off
  for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "pg_clipfrac", "ppo_kl"):
    np.testing.assert_allclose(m_on[k], m_off[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert abs(m_on["kl"]) > 0 and m_on["grad_norm"] > 0
  for a, c, w in zip(_leaves(p_on), _leaves(p_off), _leaves(params)):
    np.testing.assert_allclose(a - w, c - w, rtol=1e-4, atol=1e-8)


def test_width_comes_from_the_valid_groups_rows_only():
  b = _batch()
  assert b.lengths.tolist() == [35, 39, 44, 33, 150, 150, 51, 38]
  adv = _advantages()
  tokens, mask, tok_adv = batch_lib.train_batch(b, ROWS, VALID, adv)
  assert tokens.shape == mask.shape == tok_adv.shape == (P * G, 64)   # bucket(51), not 150
  np.testing.assert_array_equal(tokens, b.tokens[:, :64])              # filler rows cut to W
  assert mask[4:6].sum() == 0 and mask[[0, 1, 2, 3, 6, 7]].sum() == 5 + 9 + 14 + 3 + 21 + 8
  full, full_mask, full_adv = batch_lib.train_batch(b, ROWS, VALID, adv, trained_width=False)
  assert full.shape == (P * G, S)                                      # min(bucket(150), S)
  np.testing.assert_array_equal(full_mask[:, :64], mask)
  np.testing.assert_array_equal(full_adv[:, :64], tok_adv)
  assert full_mask[:, 64:].sum() == 0
  # no valid group: one bucket
  none, none_mask, _ = batch_lib.train_batch(b, ROWS, np.zeros(P, bool), adv)
  assert none.shape == (P * G, 64) and none_mask.sum() == 0


def test_lm_positions_are_the_budget_at_most_w_minus_1():
  """K is a function of W alone (one program per width of the grid, issue #50); a packed row's
  is W' - 1, every target it holds (several rows' generations may exceed the budget)."""
  b = _batch()
  _, mask, _ = batch_lib.train_batch(b, ROWS, VALID, _advantages())
  assert batch_lib.lm_positions(mask, 80) == 63          # the budget, at most W - 1 = 63
  assert batch_lib.lm_positions(np.zeros((2, 160), np.float32), 80) == 80
  assert batch_lib.lm_positions(np.ones((2, 40), np.float32), 80) == 39
  assert update_lib.packed_lm_positions(128) == 127 and update_lib.packed_lm_positions(1) == 1


def test_update_widths_are_a_grid_of_four():
  assert batch_lib.width_grid(160) == [64, 128, 160]
  assert batch_lib.width_grid(656) == [192, 384, 512, 656]
  assert [batch_lib.grid_width(w, 656) for w in (1, 192, 193, 400, 513, 900)] == [
      192, 192, 384, 512, 656, 656]


@pytest.mark.parametrize("train,mode", [
    ({}, "token-mean"),                                  # one rl_step
    ({}, "seq-mean-token-sum-norm"),                     # its divisor stays the budget
    ({"micro_batch_size": 2}, "token-mean"),             # one on-policy ppo_step
    ({"ppo_mini_batch_size": 2}, "token-mean"),          # old log-probs + 2 updates
    ({"ppo_epochs": 2, "micro_batch_size": 4}, "seq-mean-token-sum-norm"),
])
def test_trimmed_update_equals_the_untrimmed_one(train, mode):
  cfg, policy = _cfg(**train), _policy(0)
  cfg.loss.loss_agg_mode = mode
  steps = build.build_steps(cfg, policy)
  b = _batch()
  on = _update(cfg, policy, steps, b, trim=True)
  off = _update(cfg, policy, steps, b, trim=False)
  m_on, m_off = on[2], off[2]
  assert (m_on["update/width"], m_on["update/lm_positions"]) == (64, 63)
  assert (m_off["update/width"], m_off["update/lm_positions"]) == (S, 80)
  assert m_on["train/updates"] == m_off["train/updates"] == update_lib.updates_per_step(
      cfg.train, P)
  _assert_same_update(on, off, policy.params)


def test_a_step_that_compiles_says_so():
  """``time/update_compile_s`` > 0 exactly on a step whose (program, W, K) is new, and it agrees
  with the XLA compiles jax reports during the update."""
  cfg, policy = _cfg(), _policy(0)
  steps = build.build_steps(cfg, policy)
  compiled = []
  listener = lambda name, *_, **__: compiled.append(
      name == "/jax/core/compile/backend_compile_duration")
  monitoring.register_event_duration_secs_listener(listener)
  got = []
  try:
    for trim, batch in ((True, _batch()), (True, _batch()),
                        (True, _batch(gen=(5, 9, 40, 3, 60, 60, 21, 8))), (True, _batch()),
                        (False, _batch()), (False, _batch())):
      compiled.clear()
      m = _update(cfg, policy, steps, batch, trim=trim)[2]
      got.append((m["update/width"], m["update/lm_positions"], m["time/update_compile_s"] > 0,
                  any(compiled)))
  finally:
    getattr(monitoring, "unregister_event_duration_listener", lambda _: None)(listener)
  # the third batch has a row of 40 generated tokens (70 in all): W = 128, K = 80, new programs
  assert got == [(64, 63, True, True), (64, 63, False, False), (128, 80, True, True),
                 (64, 63, False, False), (S, 80, True, True), (S, 80, False, False)]
  m = _update(cfg, policy, steps, _batch(), trim=True, valid=np.zeros(P, bool))[2]
  assert (m["time/update_compile_s"], m["loss"]) == (0.0, 0.0)


def test_the_switch_is_on_by_default_and_validated():
  cfg = config_lib.base_config()
  assert cfg.train.trim_update_padding is True
  cfg.train.trim_update_padding = False
  config_lib.validate(cfg)
  del cfg.train["trim_update_padding"]      # past the ConfigDict's own type check
  cfg.train.trim_update_padding = "yes"
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg)
  assert e.value.field == "train.trim_update_padding" and "True, False" in str(e.value)


# ---------------------------------------------------------------- packing (train.pack_update_rows)


def test_pack_rows_puts_whole_trajectories_first_fit_decreasing():
  b = _batch()
  tokens, mask, adv = batch_lib.train_batch(b, ROWS, VALID, _advantages())
  packed = batch_lib.pack_rows(tokens, mask, adv, b.lengths[ROWS.reshape(-1)])
  # the valid rows' lengths 35, 39, 44, 33, 51, 38 into W = 64: no two fit one row
  assert packed.trajectories == 6 and packed.rows == 6
  wide, wmask, wadv = (np.pad(x, ((0, 0), (0, 64))) for x in (tokens, mask, adv))
  packed = batch_lib.pack_rows(wide, wmask, wadv, b.lengths[ROWS.reshape(-1)],
                               multiple=128)                 # W' = 128
  assert packed.rows == 2 and packed.trajectories == 6       # 51+44+33, 39+38+35 (FFD)
  seen = set()
  for r in range(wide.shape[0]):
    for sid in range(1, int(packed.segment_ids[r].max(initial=0)) + 1):
      cols = np.flatnonzero(packed.segment_ids[r] == sid)
      assert (np.diff(cols) == 1).all()                      # contiguous
      n = len(cols)
      np.testing.assert_array_equal(packed.positions[r, cols], np.arange(n))
      src = [i for i in range(wide.shape[0]) if b.lengths[i] == n and i not in seen
             and (wide[i, :n] == packed.tokens[r, cols]).all()]
      assert src, (r, sid)
      i = src[0]
      seen.add(i)
      np.testing.assert_array_equal(packed.loss_mask[r, cols], wmask[i, :n])
      np.testing.assert_array_equal(packed.token_advantages[r, cols], wadv[i, :n])
  assert seen == {0, 1, 2, 3, 6, 7}                          # every trained row, once
  assert packed.loss_mask[2:].sum() == 0 and packed.segment_ids[2:].sum() == 0
  assert packed.loss_mask.sum() == wmask.sum() and (packed.prefix_ids == -1).all()


def test_pack_rows_writes_a_groups_prompt_once():
  """Groups of 2 rows with one prompt (20 tokens): each unit is the prompt's first 19 tokens,
  then each row from its last prompt token on; positions continue from the prompt's."""
  b = _batch(gen=(5, 9, 14, 3, 60, 60, 50, 8), shared_prompts=True)   # lengths 35 39 44 33 . . 80 38
  tokens, mask, adv = batch_lib.train_batch(b, ROWS, VALID, _advantages())
  groups = np.repeat(np.arange(P), G)
  packed = batch_lib.pack_rows(tokens, mask, adv, b.lengths[ROWS.reshape(-1)], groups)
  # units 19 + 16 + 20 = 55, 19 + 25 + 14 = 58, 19 + 61 + 19 = 99: W' = 128, FFD: 99 | 58 + 55
  assert (packed.width, packed.rows, packed.trajectories) == (128, 2, 6)
  assert packed.loss_mask.sum() == mask.sum()
  r, seg, pre, pos = 1, packed.segment_ids[1], packed.prefix_ids[1], packed.positions[1]
  # row 1: group 1's prompt (segment 1), rows 2 and 3 (segments 2, 3), then group 0's
  assert (seg[:19] == 1).all() and (pre[:19] == -1).all()
  np.testing.assert_array_equal(packed.tokens[r, :19], tokens[2, :19])
  np.testing.assert_array_equal(pos[19:19 + 25], np.arange(19, 44))
  assert (seg[19:44] == 2).all() and (pre[19:44] == 1).all()
  np.testing.assert_array_equal(packed.tokens[r, 19:44], tokens[2, 19:44])
  np.testing.assert_array_equal(packed.loss_mask[r, 19:44], mask[2, 19:44])
  assert (seg[44:58] == 3).all() and (pre[44:58] == 1).all() and (seg[58:77] == 4).all()
  assert (pre[77:113] == 4).all() and (seg[113:] == 0).all()
  # behaviour log-probs, packed in the same call, land where the advantages do
  behav = -np.arange(1, mask.size + 1, dtype=np.float32).reshape(mask.shape) * mask
  again = batch_lib.pack_rows(tokens, mask, adv, b.lengths[ROWS.reshape(-1)], groups,
                              behaviour=behav)
  assert packed.behaviour is None
  np.testing.assert_array_equal(again.token_advantages, packed.token_advantages)
  np.testing.assert_array_equal(again.behaviour, batch_lib.pack_rows(
      tokens, mask, behav, b.lengths[ROWS.reshape(-1)], groups).token_advantages)
  np.testing.assert_array_equal(again.behaviour[r, 19:44], behav[2, 19:44])


@pytest.mark.parametrize("mode,shared,rows,micro", [
    ("token-mean", False, 3, 2), ("seq-mean-token-sum-norm", False, 3, 2),
    ("token-mean", True, 2, 2), ("seq-mean-token-sum-norm", True, 2, 2),
    ("token-mean", True, 2, 0), ("seq-mean-token-sum-norm", False, 3, 0)])
def test_packed_update_equals_the_unpacked_one(mode, shared, rows, micro):
  """Six trained rows (lengths 35, 39, 44, 33, 80, 38: W = 128) in micro-batches of 2 rows (3
  micro-batches) pack into 3 rows (80+44, 39+38+35, 33), or with each group's prompt shared
  into 2 (test_pack_rows_writes_a_groups_prompt_once): 2 micro-batches, and 1 of them computed
  when shared; the loss, metrics and updated params are those of the unpacked update. Without
  micro-batches (``micro`` 0: one ``rl_step`` of all rows unpacked) the packed rows run one to
  a micro-batch, K = W' - 1 (several rows' generations in one packed row)."""
  cfg, policy = _cfg(micro_batch_size=micro), _policy(0)
  cfg.loss.loss_agg_mode = mode
  steps = build.build_steps(cfg, policy)
  b = _batch(gen=(5, 9, 14, 3, 60, 60, 50, 8), shared_prompts=shared)
  on = _update(cfg, policy, steps, b, trim=True, pack=True)
  off = _update(cfg, policy, steps, b, trim=True, pack=False)
  m_on, m_off = on[2], off[2]
  assert m_off["update/width"] == 128
  assert m_on["update/width"] == 128 and m_on["update/lm_positions"] == 127
  assert (m_on["update/rows"], m_on["update/rows_computed"]) == (6, rows)
  assert (m_off["update/rows"], m_off["update/rows_computed"]) == (6, 6)
  _assert_same_update(on, off, policy.params)


def test_packed_update_with_behaviour_logprobs_equals_the_unpacked_one():
  """The off-policy correction (``tis``) reads the sampler's log-probs, which the packed update
  takes packed in the same layout as the advantages (one :func:`pack_rows` call): the loss,
  metrics (the importance ratios' too) and updated params are those of the unpacked update.
  Try it: pack them in another layout (e.g. left unpacked, or packed without the groups) and
  they differ."""
  cfg, policy = _cfg(micro_batch_size=2), _policy(0)
  cfg.loss.off_policy_correction = "tis"
  steps = build.build_steps(cfg, policy)
  assert steps.behaviour
  b = _batch(gen=(5, 9, 14, 3, 60, 60, 50, 8), shared_prompts=True)
  rng = np.random.default_rng(1)
  b = dataclasses.replace(b, behaviour_logprobs=rng.uniform(
      -6.0, -3.0, b.tokens.shape).astype(np.float32))
  on = _update(cfg, policy, steps, b, trim=True, pack=True, behaviour=True)
  off = _update(cfg, policy, steps, b, trim=True, pack=False, behaviour=True)
  assert (on[2]["update/rows_computed"], off[2]["update/rows_computed"]) == (2, 6)
  for k in ("is_ratio_mean", "is_ratio_max", "is_capped_frac", "behaviour_abs_dlogp"):
    np.testing.assert_allclose(on[2][k], off[2][k], rtol=1e-5, err_msg=k)
  assert 0 < on[2]["is_capped_frac"] < 1
  _assert_same_update(on, off, policy.params)


def test_packing_only_where_it_pays_and_the_loss_allows():
  cfg, policy = _cfg(micro_batch_size=2), _policy(0)
  steps = build.build_steps(cfg, policy)
  m = _update(cfg, policy, steps, _batch(), trim=True, pack=True)[2]  # W = 64: no two fit
  assert m["update/rows_computed"] == m["update/rows"] == 6
  # shared prompts pack into 2 rows of W' = 128, but in micro-batches of 4 rows that is one
  # micro-batch of 128 against two of 64: no fewer token rows, so it does not pack
  cfg4 = _cfg(micro_batch_size=4)
  m = _update(cfg4, policy, build.build_steps(cfg4, policy), _batch(shared_prompts=True),
              trim=True, pack=True)[2]
  assert m["update/rows_computed"] == m["update/rows"] == 6
  assert update_lib.packing_allowed("token-mean")
  assert update_lib.packing_allowed("seq-mean-token-sum-norm")
  assert not update_lib.packing_allowed("seq-mean-token-mean")
  assert not update_lib.packing_allowed("seq-mean-token-sum")
  assert not update_lib.packing_allowed("token-mean", lora_dropout=0.1)
  assert config_lib.base_config().train.pack_update_rows is False    # opt-in: slower on CPU


def test_micro_batches_of_zero_advantage_rows_run_forward_only():
  """Without a KL loss or an entropy bonus a token with advantage 0 adds exactly zero gradient,
  so a micro-batch of a zero-variance group's rows (trained under the ``grpo`` rule) runs its
  forward pass only, for the metrics: the same update and metrics as computing its gradient,
  and ``update/micro_batches_forward_only`` counts it. Micro-batches of 4 rows: group 1's rows
  share one with group 0's unless ``ppo_update`` orders the zero-advantage rows last. Try it:
  order them as before (the count is 0), or let the step see no advantage as non-zero (the
  params and losses differ). ``train.skip_zero_advantage = False`` computes the backward anyway
  (the count is 0, the update the same)."""
  cfg, policy = _cfg(micro_batch_size=4), _policy(0)
  cfg.loss.use_kl_loss, cfg.loss.entropy_coeff = False, 0.0
  adv = _advantages()
  adv[1] = 0.0                              # group 1: zero variance, trained (VALID)
  b = _batch()

  def update(steps):
    mini, micro = build.ppo_rows(cfg)
    opt = steps.init_opt(steps.rl_tx, policy.params)
    copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
    return update_lib.rl_update(
        steps, copy(policy.params), opt, _policy(1).params, b, ROWS, VALID, adv,
        put=lambda x: build.put_rows(policy.mesh, x), mini_batch_rows=mini,
        micro_batch_rows=micro, epochs=1, seed=0, step=1, trim_padding=True,
        max_lm_positions=build.max_generated_tokens(cfg))

  on = update(build.build_steps(cfg, policy))
  cfg.train.skip_zero_advantage = False     # the backward anyway (vs_trl.py --no_skip)
  off = update(build.build_steps(cfg, policy))
  cfg.train.skip_zero_advantage = True
  assert on[2]["update/micro_batches_forward_only"] == 1
  assert off[2]["update/micro_batches_forward_only"] == 0
  assert (on[2]["update/micro_batches_backward"], off[2]["update/micro_batches_backward"]) == (1, 2)
  for k in ("loss", "pg_loss", "entropy", "grad_norm", "pg_clipfrac", "ppo_kl"):
    np.testing.assert_allclose(on[2][k], off[2][k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert on[2]["grad_norm"] > 0 and on[2]["entropy"] > 0
  for a, c, w in zip(_leaves(on[0]), _leaves(off[0]), _leaves(policy.params)):
    np.testing.assert_allclose(a - w, c - w, rtol=1e-4, atol=1e-8)
  # with an entropy bonus a zero advantage still has a gradient: nothing runs forward only
  cfg.loss.entropy_coeff = 0.01
  assert update(build.build_steps(cfg, policy))[2]["update/micro_batches_forward_only"] == 0
