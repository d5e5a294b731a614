"""Logit parity with HF transformers (torch CPU) for tiny random Qwen2 / Llama models.

Skips cleanly when torch or transformers is not importable.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is needed for HF parity tests")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is needed for HF parity tests")

from gigrl.models import extend, from_hf, init_cache, to_hf  # noqa: E402
from gigrl.cli import convert as convert_cli  # noqa: E402
from gigrl.models import convert, hf  # noqa: E402

F32_TOL = 1e-4
# bf16 params + activations vs the f32 HF model: ~3 significant digits per op; the
# tiny models' logits are O(1), and 2 layers accumulate a few bf16 ulps.
BF16_TOL = 0.05  # measured 0.025 on logits of magnitude ~2.2 (about 1%)

_SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _qwen_cfg():
  return transformers.Qwen2Config(tie_word_embeddings=True, **_SIZES)


def _llama_cfg():
  return transformers.LlamaConfig(
      tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5,
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
      **_SIZES)


def _save(cfg, path):
  torch.manual_seed(0)
  m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():  # non-trivial biases / norm scales
    for p in m.parameters():
      p.add_(0.05 * torch.randn_like(p))
  m.save_pretrained(path)
  return m


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def pair(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp(request.param))
  hf_model = _save(_qwen_cfg() if request.param == "qwen2" else _llama_cfg(), path)
  return request.param, path, hf_model


def _tokens():
  # 40 tokens > original_max_position_embeddings=16, so llama3 scaling matters.
  return np.random.RandomState(0).randint(0, 96, (2, 40)).astype(np.int32)


def _hf_logits(hf_model, toks):
  with torch.no_grad():
    return hf_model(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()


def test_prefill_logits_match(pair):
  name, path, hf_model = pair
  model, cfg = from_hf(path)
  assert cfg.qkv_bias == (name == "qwen2")
  assert (cfg.rope_scaling is not None) == (name == "llama")
  toks = _tokens()
  np.testing.assert_allclose(model(jnp.asarray(toks)), _hf_logits(hf_model, toks),
                             atol=F32_TOL, rtol=F32_TOL)


def test_cache_steps_match(pair):
  """Prefill 30 tokens, then 10 single-token extends, against HF's full forward."""
  _, path, hf_model = pair
  model, cfg = from_hf(path)
  toks = _tokens()
  ref = _hf_logits(hf_model, toks)
  cache = init_cache(cfg, 2, 48)
  logits, cache = extend(model, cache, jnp.asarray(toks[:, :30]), jnp.array([30, 30]))
  np.testing.assert_allclose(logits, ref[:, :30], atol=F32_TOL, rtol=F32_TOL)
  step = jax.jit(lambda c, t: extend(model, c, t, jnp.array([1, 1])))
  for i in range(30, 40):
    logits, cache = step(cache, jnp.asarray(toks[:, i:i + 1]))
    np.testing.assert_allclose(logits[:, 0], ref[:, i], atol=F32_TOL, rtol=F32_TOL)


def test_bf16_within_documented_tolerance(pair):
  _, path, hf_model = pair
  model, _ = from_hf(path, dtype="bfloat16")
  toks = _tokens()
  err = np.abs(np.asarray(model(jnp.asarray(toks))) - _hf_logits(hf_model, toks)).max()
  assert err < BF16_TOL


def test_export_round_trip_loads_in_transformers(pair, tmp_path):
  _, path, hf_model = pair
  model, cfg = from_hf(path)
  out = str(tmp_path / "export")
  to_hf(model, cfg, out, max_shard_bytes=40_000)   # forces a sharded index
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  toks = _tokens()
  np.testing.assert_allclose(_hf_logits(back, toks), _hf_logits(hf_model, toks),
                             atol=1e-6)
  model2, cfg2 = from_hf(out)                       # and our own sharded import
  assert cfg2 == cfg
  np.testing.assert_allclose(model2(jnp.asarray(toks)), model(jnp.asarray(toks)),
                             atol=1e-6)


def test_bf16_export_loads_in_transformers(pair, tmp_path):
  _, path, hf_model = pair
  model, cfg = from_hf(path)
  to_hf(model, cfg, str(tmp_path), dtype="bfloat16")
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  back = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), dtype=torch.float32).eval()
  toks = _tokens()
  err = np.abs(_hf_logits(back, toks) - _hf_logits(hf_model, toks)).max()
  assert err < BF16_TOL


def test_convert_cli_round_trip(pair, tmp_path):
  _, path, _ = pair
  out = str(tmp_path / "orbax")
  convert_cli.run(["--hf_dir", path, "--out", out])
  model, cfg = convert.load_converted(out)
  ref, _ = from_hf(path)
  toks = jnp.asarray(_tokens())
  np.testing.assert_allclose(model(toks), ref(toks), atol=1e-6)


def _edit_config(path, dst, **changes):
  import shutil
  shutil.copytree(path, dst)
  with open(os.path.join(dst, "config.json")) as f:
    c = json.load(f)
  c.update(changes)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(c, f)
  return str(dst)


def test_clear_errors(pair, tmp_path):
  name, path, _ = pair
  bad = _edit_config(path, tmp_path / "arch", model_type="mistral")
  with pytest.raises(hf.HFImportError, match="model_type='mistral'"):
    from_hf(bad)
  bad = _edit_config(path, tmp_path / "shape", intermediate_size=100)
  with pytest.raises(hf.HFImportError, match=r"mlp\.\w+_proj\.weight.*has shape"):
    from_hf(bad)
  bad = _edit_config(path, tmp_path / "missing", num_hidden_layers=3)
  with pytest.raises(hf.HFImportError, match=r"model\.layers\.2\..*missing"):
    from_hf(bad)


def test_from_hf_accepts_jnp_dtypes_and_a_model_config(pair):
  import jax.numpy as jnp
  name, path, hf_model = pair
  model, cfg = from_hf(path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
  assert model.embed[...].dtype == jnp.float32
  same, cfg2 = from_hf(path, config=cfg.replace(remat="full"), backend="accelerator")
  assert (cfg2.remat, cfg2.backend, same.cfg.backend) == ("full", "accelerator",
                                                          "accelerator")
  toks = _tokens()
  np.testing.assert_allclose(model(toks), same(toks), atol=BF16_TOL)  # bf16, 2 paths
