"""LoRA adapters (gigrl.models.lora): the base at step 0, only adapters trained, the reference
is the base with the adapters off, adapter-only checkpoints that resume exactly."""
import json
import os
import subprocess
import sys

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gigrl.training import build
from gigrl import config as config_lib
from gigrl import testing
from gigrl.update import loss as loss_lib
from gigrl.update import step as update_lib
from gigrl.config_utils import ConfigError
from gigrl.models import config as mcfg
from gigrl.models import lora as lora_lib
from gigrl.models import sharding as shd
from gigrl.models import transformer as tfm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = mcfg.PRESETS["tiny"].replace(vocab_size=64)


def _cfg(rank=4, **lora):
  cfg = config_lib.base_config()
  cfg.model.vocab_size = 64
  cfg.data.prompts_per_step, cfg.data.group_size = 2, 2
  cfg.rollout.max_turns, cfg.rollout.max_new_tokens = 1, 8
  cfg.train.learning_rate = cfg.train.sft_learning_rate = 1e-2
  cfg.loss.use_kl_loss, cfg.loss.kl_loss_coef = True, 0.1
  cfg.model.lora.rank = rank
  for k, v in lora.items():
    cfg.model.lora[k] = v
  return cfg


def _batch(b=4, s=12):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 64, (b, s)).astype(np.int32)
  mask = np.zeros((b, s), np.float32)
  mask[:, 4:] = 1.0
  adv = rng.normal(size=(b, 1)).astype(np.float32).repeat(s, axis=1) * mask
  return tokens, mask, adv


def test_adapters_start_as_the_base_in_every_forward_path():
  base = tfm.Transformer(MODEL, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(_batch()[0])
  want = np.asarray(base(tokens))
  cache = tfm.init_cache(MODEL, tokens.shape[0], 16)
  want_ext, _ = tfm.extend(base, cache, tokens, jnp.full((tokens.shape[0],), 12))
  lora_lib.add_adapters(base, lora_lib.LoraSettings(rank=8), rngs=nnx.Rngs(1))
  assert len(lora_lib.adapter_names(base.layers)) == 14
  np.testing.assert_array_equal(np.asarray(base(tokens)), want)
  got_ext, _ = tfm.extend(base, cache, tokens, jnp.full((tokens.shape[0],), 12))
  np.testing.assert_array_equal(np.asarray(got_ext), np.asarray(want_ext))
  # and a non-zero B changes the function (the adapters are on the forward path)
  base.layers.wq_lora_b[...] = jnp.ones_like(base.layers.wq_lora_b[...])
  assert np.abs(np.asarray(base(tokens)) - want).max() > 1e-3


def test_low_rank_term_is_alpha_over_r_times_xab():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5)), jnp.float32)
  a = jnp.ones((5, 2)) * 0.1
  b = jnp.ones((2, 4)) * 0.2
  got = lora_lib.low_rank(x, {"wq": None, "wq_lora_a": a, "wq_lora_b": b}, "wq", 16 / 2)
  np.testing.assert_allclose(np.asarray(got), 8 * np.asarray(x) @ np.asarray(a @ b), rtol=1e-6)
  assert lora_lib.low_rank(x, {"wk": None}, "wk", 1.0) is None


def test_only_the_adapters_are_trained_and_hold_optimizer_state():
  cfg = _cfg()
  policy = build.build_policy(cfg, 64)
  steps = build.build_steps(cfg, policy)
  opt = steps.init_opt(steps.sft_tx, policy.params)
  n_adapter = sum(x.size for x in jax.tree.leaves(policy.trained(policy.params)))
  n_all = sum(x.size for x in jax.tree.leaves(policy.params))
  n_opt = sum(x.size for x in jax.tree.leaves(opt) if x.ndim)
  assert n_adapter < n_all // 10 and n_opt == 2 * n_adapter      # Adam mu and nu, adapters only
  before = jax.tree.map(np.asarray, policy.params)
  tokens, mask, _ = _batch()
  params, _, m = steps.sft_step(jax.tree.map(jnp.copy, policy.params), opt, tokens, mask)
  after = jax.tree.map(np.asarray, params)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                          jax.tree.leaves(after)):
    name = jax.tree_util.keystr(path)
    if "_lora_b" in name:
      assert np.abs(x - y).max() > 0, name             # B moves on the first step
    elif "_lora_a" not in name:
      np.testing.assert_array_equal(x, y, err_msg=name)  # the base never does
  assert np.isfinite(float(m["loss"]))


def test_reference_is_the_base_with_the_adapters_off():
  cfg = _cfg()
  policy = build.build_policy(cfg, 64)
  params = policy.params
  params["layers"]["wv_lora_b"].value = jnp.full_like(params["layers"]["wv_lora_b"][...], 0.05)
  tokens, mask, adv = _batch()
  kw = dict(max_tokens=8, chunk_size=512, loss_options=loss_lib.kwargs_from_config(cfg.loss))
  g = policy.graphdef
  _, m_none = update_lib.rl_loss(params, g, None, tokens, mask, adv, **kw)
  base = lora_lib.adapters_off(params)
  _, m_base = update_lib.rl_loss(params, g, base, tokens, mask, adv, **kw)
  assert float(m_none["kl"]) > 1e-6
  np.testing.assert_allclose(float(m_none["kl"]), float(m_base["kl"]), rtol=1e-6)
  # the base leaves of the reference are the policy's own arrays (no copy)
  lora, rest = nnx.split_state(base, nnx.LoRAParam, ...)
  _, rest0 = nnx.split_state(params, nnx.LoRAParam, ...)
  assert all(a is b for a, b in zip(jax.tree.leaves(rest), jax.tree.leaves(rest0)))
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(lora))


def test_adapters_follow_their_base_matrix_sharding():
  """A splits its base's in dimension, B its out dimension, over both axes the base uses;
  a preset drops the axes it drops from the base."""
  P = jax.sharding.PartitionSpec
  spec = shd._adapter_spec
  assert spec("wq_lora_a") == (None, ("fsdp", "tp"), None)
  assert spec("wq_lora_b") == (None, None, ("tp", "fsdp"))
  assert spec("w_down_lora_a") == (None, ("tp", "fsdp"), None)
  assert spec("w_down_lora_b") == (None, None, ("fsdp", "tp"))
  mesh = shd.make_mesh({"data": 1, "fsdp": 1, "tp": 1}, devices=jax.devices()[:1])
  assert shd.param_spec("wo_lora_b", (2, 4, 128), mesh, "fsdp_tp") == P(None, None,
                                                                           ("fsdp", "tp"))
  assert shd.param_spec("wo_lora_b", (2, 4, 128), mesh, "fsdp") == P(None, None, "fsdp")
  assert shd.param_spec("wq_lora_b", (2, 4, 128), mesh, "fsdp") == P(None, None, "fsdp")
  assert shd.param_spec("wq_lora_a", (2, 128, 4), mesh, "replicated") == P(None, None, None)
  with pytest.raises(KeyError):
    shd.param_spec("nosuch_lora_a", (2, 4, 4), mesh, "fsdp")


@pytest.mark.parametrize("field,value,message", [
    ("rank", -1, "an integer and >= 0"),
    ("rank", 1.5, "an integer"),
    ("alpha", 0.0, "> 0"),
    ("targets", "q_proj,nosuch", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    ("targets", "", "a comma-separated subset"),
    ("dropout", 1.0, "< 1.0"),
    ("dropout", -0.1, ">= 0.0"),
])
def test_bad_lora_settings_name_the_field(field, value, message):
  cfg = _cfg()
  lora = cfg.model.lora.to_dict()
  lora[field] = value
  cfg.model.lora = ml_collections.ConfigDict(lora)    # type-free (a config file's own dict)
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg)
  assert e.value.field == f"model.lora.{field}" and message in str(e.value)


def test_rank_zero_is_full_fine_tuning_unchanged():
  cfg = _cfg(rank=0)
  policy = build.build_policy(cfg, 64)
  assert not policy.lora.enabled and not lora_lib.is_lora(policy.params)
  assert "LoRA" not in policy.describe()


# ----------------------------------------------------------------- end to end (subprocesses)
ARGS = ["--config.train.sft_steps=3", "--config.train.num_steps=4",
        "--config.data.max_train_questions=8", "--config.data.prompts_per_step=2",
        "--config.data.group_size=2", "--config.rollout.max_new_tokens=16",
        "--config.rollout.max_obs_tokens=64", "--config.train.sft_batch_size=4",
        "--config.train.eval_questions=0", "--config.checkpoint.every_steps=2",
        "--config.checkpoint.keep=2", "--config.data.pool.rule=grpo",
        "--config.loss.use_kl_loss=True", "--config.loss.kl_loss_coef=0.1"]
LORA = ["--config.model.lora.rank=8"]


def _train(workdir, *extra, ok=True):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "gigrl.cli.train", "--config",
                         os.path.join(ROOT, "configs/smoke.py"), "--workdir", str(workdir), *testing.TEST_DEFAULTS,
                         *ARGS, *extra], capture_output=True, text=True, timeout=600, cwd=ROOT,
                        env=env)
  if ok:
    assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if not k.endswith(("_s", "tokens_per_s"))} for r in rows]


def _bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """An uninterrupted LoRA run of 3 SFT + 4 RL steps (with the KL loss)."""
  whole = tmp_path_factory.mktemp("lora") / "whole"
  _train(whole, *LORA)
  return whole


@pytest.mark.slow
def test_lora_run_resumes_exactly_with_adapter_only_checkpoints(tmp_path, lora_run):
  """SFT and RL (with the KL loss) train adapters; a run stopped after step 4 and continued
  equals the uninterrupted run; its checkpoints hold the adapters and name their base; a
  checkpoint of another base is refused with one line."""
  part = tmp_path / "part"
  want = _metrics(lora_run)
  assert [r["step"] for r in want] == list(range(1, 8))
  assert all(np.isfinite(r["loss"]) for r in want)
  assert any(r.get("kl", 0) > 0 for r in want if r.get("phase") == "rl")
  _train(part, *LORA, "--config.train.num_steps=1")
  _train(part, *LORA)
  assert _metrics(part) == want
  meta = json.load(open(part / "checkpoints" / "7" / "meta" / "metadata"))
  assert meta["lora_base"] == "preset tiny, seed 0"
  proc = _train(part, *LORA, "--config.seed=1", "--config.train.num_steps=6", ok=False)
  lines = [l for l in proc.stderr.splitlines() if l.startswith("gigrl-train: error")]
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert "model.hf_path" in lines[-1] and "preset tiny, seed 0" in lines[-1]


@pytest.mark.slow
def test_lora_checkpoint_is_at_most_a_quarter_of_a_full_one(tmp_path):
  """With the ``small`` preset (the issue's yardstick): the end-of-SFT checkpoint of a LoRA
  run against a full fine-tuning run's."""
  small = ["--config.model.preset=small", "--config.train.num_steps=0",
           "--config.train.sft_steps=1"]
  _train(tmp_path / "full", *small)
  _train(tmp_path / "lora", *small, "--config.model.lora.rank=16")
  full = _bytes(tmp_path / "full" / "checkpoints" / "1")
  lora = _bytes(tmp_path / "lora" / "checkpoints" / "1")
  assert lora * 4 <= full, (lora, full)


@pytest.mark.slow
def test_export_merged_loads_in_transformers_and_adapters_in_peft(tmp_path, lora_run):
  """gigrl-export: the merged directory's logits in transformers equal gigrl's LoRA model's;
  ``--peft`` adapters loaded by peft on the base give the same logits; gigrl-eval reads the
  adapter-only checkpoint."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from gigrl.models import hf
  from gigrl.training import trained
  merged, adapters, base_dir = tmp_path / "merged", tmp_path / "adapters", tmp_path / "base"
  files = trained.export(str(lora_run), str(merged))
  assert {"config.json", "model.safetensors"} <= {os.path.basename(f) for f in files}
  trained.export(str(lora_run), str(adapters), peft=True)
  assert json.load(open(adapters / "adapter_config.json"))["r"] == 8
  run = trained.load_policy(str(lora_run))
  policy, params, step = run.policy, run.params, run.step
  assert step == 7 and lora_lib.is_lora(params)
  tokens = np.random.default_rng(0).integers(1, 500, (2, 10))
  want = np.asarray(nnx.merge(policy.graphdef, params)(jnp.asarray(tokens)))
  base_model = nnx.merge(policy.graphdef, lora_lib.adapters_off(params))
  hf.to_hf(base_model, policy.model_cfg, str(base_dir))
  with torch.no_grad():
    ids = torch.tensor(tokens, dtype=torch.long)
    got = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).eval()(ids).logits
    np.testing.assert_allclose(got.numpy(), want, atol=2e-4)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
    base_logits = base(ids).logits.numpy()
    with_peft = peft.PeftModel.from_pretrained(base, str(adapters)).eval()
    np.testing.assert_allclose(with_peft(ids).logits.numpy(), want, atol=2e-4)
  assert np.abs(base_logits - want).max() > 1e-4      # the adapters changed the function
  with pytest.raises(Exception, match="not an empty directory"):
    trained.export(str(lora_run), str(merged))


@pytest.mark.slow
def test_lora_rl_on_a_full_fine_tuning_warm_start(tmp_path):
  """``train.init_from`` naming a full SFT run: its params are the frozen base under fresh
  adapters, so the first RL step's rollouts are exactly the full run's (same policy); the run
  resumes exactly, and its checkpoints name that base."""
  sft, full, whole, part = (tmp_path / n for n in ("sft", "full", "whole", "part"))
  _train(sft, "--config.train.num_steps=0")
  init = f"--config.train.init_from={sft}"
  _train(full, init)
  _train(whole, *LORA, init)
  want = _metrics(whole)
  assert [r["step"] for r in want] == [4, 5, 6, 7]
  first_full = _metrics(full)[0]
  for key in ("reward_mean", "search_calls_mean", "turns_mean"):
    assert want[0][key] == first_full[key], key
  _train(part, *LORA, init, "--config.train.num_steps=1")
  _train(part, *LORA, init)
  assert _metrics(part) == want
  meta = json.load(open(part / "checkpoints" / "7" / "meta" / "metadata"))
  assert meta["lora_base"] == f"train.init_from {sft}@3"
  # gigrl-eval / gigrl-export put the adapters back on that base, not on the preset's
  from gigrl.training import trained  # pylint: disable=g-import-not-at-top
  lora, warm = trained.load_policy(str(part)), trained.load_policy(str(sft))
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 60, (2, 8)))
  base_logits = nnx.merge(lora.policy.graphdef, lora_lib.adapters_off(lora.params))(tokens)
  warm_logits = nnx.merge(warm.policy.graphdef, warm.params)(tokens)
  np.testing.assert_allclose(np.asarray(base_logits), np.asarray(warm_logits), atol=1e-6)


def test_adapter_dropout_in_training_forwards_only():
  """model.lora.dropout: the SFT loss sees dropped adapter inputs (the loss changes with the
  rate once B != 0), deterministically per batch; the log-probs a rollout or the old / reference
  pass uses do not drop; rate 0 is exactly the no-dropout forward."""
  tokens, mask, _ = _batch()
  losses = {}
  for rate in (0.0, 0.5):
    cfg = _cfg(dropout=rate)
    policy = build.build_policy(cfg, 64)
    params = policy.params
    params["layers"]["wq_lora_b"].value = jnp.full_like(params["layers"]["wq_lora_b"][...], 0.3)
    params["layers"]["w_up_lora_b"].value = jnp.full_like(params["layers"]["w_up_lora_b"][...],
                                                          0.3)
    g = policy.graphdef
    # both jitted, as the trainer runs them: run op by op, the forwards' hundreds of small
    # 8-device all-reduces left one of XLA CPU's device threads out of a rendezvous (abort after
    # 40 s; 1 in 8 runs alone on 2 loaded cores, and in 2 suite runs)
    sft = jax.jit(lambda p, t, m: update_lib.sft_loss(p, g, t, m, max_tokens=8,
                                                      chunk_size=512)[0])
    loss = lambda: float(sft(params, tokens, mask))
    losses[rate] = loss()
    assert loss() == losses[rate]                                  # same batch, same mask
    old = jax.jit(update_lib.logprob_fn(g, max_tokens=8, chunk_size=512))(params, tokens, mask)
    losses[f"old{rate}"] = np.asarray(old)
  assert abs(losses[0.5] - losses[0.0]) > 1e-4
  np.testing.assert_array_equal(losses["old0.5"], losses["old0.0"])   # no dropout there
  k1 = lora_lib.dropout_key(jnp.asarray(tokens))
  k2 = lora_lib.dropout_key(jnp.asarray(tokens[::-1]))
  assert not np.array_equal(jax.random.key_data(k1), jax.random.key_data(k2))
