"""Model configuration: a frozen `ModelConfig`, named presets, the `model` section.

The architecture covers the Qwen2 / Qwen2.5 family (QKV bias, tied embeddings on the
small sizes) and Llama 3.x (no bias, llama3 RoPE frequency scaling). References:
Qwen2 technical report (arXiv:2407.10671), Llama 3 herd paper (arXiv:2407.21783) and
the HF `Qwen2Config` / `LlamaConfig` field meanings.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections as mlc

from gigrl.config_utils import ConfigError, UserError, check_choice, check_range, get_field
from gigrl.models import lora as lora_lib

DTYPES = ("float32", "bfloat16", "float16")
TRAIN_SHARDINGS = ("replicated", "fsdp", "fsdp_tp", "tp")
ROLLOUT_SHARDINGS = ("auto", "replicated", "tp", "fsdp_tp", "fsdp")
REMAT = ("none", "full", "dots")
# "cpu": XLA:CPU paths (Python layer loop, per-layer decode buffers, row-major decode
# attention); "accelerator": lax.scan over stacked layers and the stacked KV cache (what
# a TPU runs). "auto" is resolved from `jax.default_backend()` when the model is built.
BACKENDS = ("auto", "cpu", "accelerator")
# Training (cache-free causal) attention: "xla" = dense / block-causal XLA attention,
# "splash" = the Pallas TPU splash-attention kernel, "dot_product" =
# `jax.nn.dot_product_attention` (cuDNN's fused attention on a GPU where it applies, else its
# XLA path). "auto": splash on TPU, dot_product on GPU, else xla.
ATTENTION = ("auto", "xla", "splash", "dot_product")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer hyper-parameters (hashable: usable as a static arg).

  `rope_scaling` accepts the HF llama3 dict
  (`{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
  "original_max_position_embeddings"}`) and is stored as a sorted tuple of
  `(key, value)` pairs so the dataclass stays hashable; read it back with
  `rope_scaling_dict`.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1e6
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = True
  tie_embeddings: bool = True
  rope_scaling: Any = None
  param_dtype: str = "float32"
  dtype: str = "float32"
  kv_cache_dtype: str = ""  # the KV cache's dtype ("" = dtype)
  max_position: int = 32768
  remat: str = "none"  # none | full | dots (save the weight-matmul outputs)
  scan_unroll: int = 1  # lax.scan unroll over layers (>= num_layers = fully unrolled)
  causal_block: int = 32  # query block of the cache-free causal attention (0 = dense)
  backend: str = "auto"  # one of BACKENDS; resolved by `resolve` in Transformer()
  attention: str = "auto"  # one of ATTENTION; resolved by `resolve`
  cache_block: int = 512  # accelerator KV-cache attention: slots per block read (0 = all)
  extend_chunk: int = 0  # tokens per KV-cache extend pass (prefill, observations); 0 = all
  kernel_interpret: bool = False  # run Pallas kernels in interpret mode (CPU tests)

  def __post_init__(self):
    if isinstance(self.rope_scaling, Mapping):
      items = tuple(sorted((str(k), _freeze(v)) for k, v in self.rope_scaling.items()))
      object.__setattr__(self, "rope_scaling", items)
    elif isinstance(self.rope_scaling, (list, tuple)):  # e.g. from asdict -> JSON
      items = tuple(sorted((str(k), _freeze(v)) for k, v in self.rope_scaling))
      object.__setattr__(self, "rope_scaling", items)
    if self.num_heads % max(self.num_kv_heads, 1):
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    for name in ("dtype", "param_dtype"):
      value = getattr(self, name)
      if not isinstance(value, str):  # a jnp / numpy dtype, e.g. jnp.bfloat16
        try:
          value = jnp.dtype(value).name
        except TypeError:
          pass
        object.__setattr__(self, name, value)
      if value not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} not in {DTYPES}")
    for name, allowed in (("remat", REMAT), ("backend", BACKENDS),
                          ("attention", ATTENTION), ("kv_cache_dtype", ("",) + DTYPES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} not in {allowed}")

  @property
  def rope_scaling_dict(self) -> dict[str, Any] | None:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  @property
  def cache_dtype(self) -> str:
    """The KV cache's dtype: ``kv_cache_dtype``, or the compute ``dtype``."""
    return self.kv_cache_dtype or self.dtype

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings included once when tied)."""
    d, f, h, kv, hd = (self.hidden_size, self.intermediate_size, self.num_heads,
                       self.num_kv_heads, self.head_dim)
    attn = d * h * hd * 2 + d * kv * hd * 2
    if self.qkv_bias:
      attn += h * hd + 2 * kv * hd
    per_layer = attn + 3 * d * f + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * per_layer + emb + d

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def resolve(self, platform: str | None = None) -> "ModelConfig":
    """This config with `backend` and `attention` "auto" replaced by concrete paths.

    Args:
      platform: a JAX platform name ("cpu", "tpu", "gpu"); default
        `jax.default_backend()`. `backend="auto"` -> "cpu" on cpu, else "accelerator";
        `attention="auto"` -> "splash" on tpu, "dot_product" on gpu, else "xla".
    """
    platform = platform or jax.default_backend()
    kw = {}
    if self.backend == "auto":
      kw["backend"] = "cpu" if platform == "cpu" else "accelerator"
    if self.attention == "auto":
      kw["attention"] = {"tpu": "splash", "gpu": "dot_product"}.get(platform, "xla")
    return dataclasses.replace(self, **kw) if kw else self


def _freeze(v):
  return tuple(v) if isinstance(v, list) else v


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _qwen(vocab, d, f, layers, heads, kv, hd=128, tie=True):
  return ModelConfig(vocab, d, f, layers, heads, kv, hd, rope_theta=1e6,
                     rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=tie,
                     max_position=32768)


def _llama(d, f, layers, heads, kv, hd):
  return ModelConfig(128256, d, f, layers, heads, kv, hd, rope_theta=5e5,
                     rms_norm_eps=1e-5, qkv_bias=False, tie_embeddings=True,
                     rope_scaling=_LLAMA3_ROPE, max_position=131072)


# Sizes from the HF config.json of each checkpoint.
PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen(151936, 896, 4864, 24, 14, 2, hd=64),
    "qwen2.5-1.5b": _qwen(151936, 1536, 8960, 28, 12, 2),
    "qwen2.5-3b": _qwen(151936, 2048, 11008, 36, 16, 2),
    "qwen2.5-7b": _qwen(152064, 3584, 18944, 28, 28, 4, tie=False),
    "llama-3.2-1b": _llama(2048, 8192, 16, 32, 8, 64),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 8, 128),
    # Tiny random models for tests and CPU smoke runs. Dense causal attention: at
    # 4 heads x 32 dims the block-causal split costs more (op count, compile time)
    # than the triangle it skips.
    "tiny": ModelConfig(512, 128, 256, 2, 4, 2, 32, max_position=4096, causal_block=0),
    "tiny-4l": ModelConfig(512, 128, 256, 4, 4, 2, 32, max_position=4096,
                           causal_block=0),
    "small": ModelConfig(1024, 256, 768, 4, 4, 2, 64, max_position=4096),
    "medium": ModelConfig(1024, 512, 1536, 8, 8, 2, 64, max_position=4096),
}

# ConfigDict override fields: 0 (or 0.0) means "use the preset's value".
_INT_OVERRIDES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position")


def default_config() -> mlc.ConfigDict:
  """The `model` config section (see `validate` for the allowed values)."""
  c = mlc.ConfigDict()
  c.preset = "tiny"           # a key of PRESETS; ignored for sizes when hf_path is set
  c.hf_path = ""              # HF checkpoint dir (config.json + *.safetensors)
  for name in _INT_OVERRIDES:
    setattr(c, name, 0)       # 0 = preset value
  c.rope_theta = 0.0          # 0 = preset value
  c.tie_embeddings = ""       # "" = preset value, else "true" / "false"
  c.dtype = "float32"         # activation / compute dtype
  c.param_dtype = "float32"   # parameter storage dtype
  c.kv_cache_dtype = ""        # the rollout's KV cache ("" = model.dtype; bfloat16: half the
                               # cache, keys and values rounded: docs/architecture.md)
  c.remat = "none"            # none | full (rematerialise each block in backward) |
                              # dots (keep the weight-matmul outputs, recompute the rest)
  c.backend = "auto"          # auto | cpu | accelerator (which model code paths run)
  c.attention = "auto"        # auto | xla | splash | dot_product (training attention; auto =
                              # splash on TPU, dot_product (cuDNN) on GPU, xla on CPU)
  c.logprob_chunk_size = 512  # sequence chunk for token_logprobs
  c.extend_chunk = 0          # chunked prefill: KV-cache extends (prompts, observations) in
                              # passes of this many tokens, a fraction of the activations; 0 = one
  c.causal_block = -1         # training causal-attention query block: -1 = preset's
                              # value (32; tiny presets 0), 0 = dense masked attention
  # Mesh axis sizes; -1 on at most one axis = all remaining devices.
  c.mesh = mlc.ConfigDict(dict(data=1, fsdp=-1, tp=1))
  c.train_sharding = "fsdp"   # one of TRAIN_SHARDINGS
  c.rollout_sharding = "auto"  # one of ROLLOUT_SHARDINGS; auto = tp up to 2 GiB of
                               # parameters, else fsdp_tp (no full copy per chip)
  c.lora = lora_lib.default_config()  # LoRA adapters on a frozen base (rank 0 = off)
  return c


def validate(cfg_model: Any) -> None:
  """Raises ConfigError naming `model.<field>` for the first bad value."""
  c = {"model": cfg_model}
  if not get_field(c, "model.hf_path"):
    check_choice(c, "model.preset", sorted(PRESETS))
  elif not isinstance(cfg_model.hf_path, str):
    raise ConfigError("model.hf_path", cfg_model.hf_path, "a directory path string")
  for name in _INT_OVERRIDES:
    check_range(c, f"model.{name}", 0, integer=True)
  check_range(c, "model.rope_theta", 0.0)
  check_choice(c, "model.tie_embeddings", ("", "true", "false"))
  check_choice(c, "model.dtype", DTYPES)
  check_choice(c, "model.param_dtype", DTYPES)
  check_choice(c, "model.kv_cache_dtype", ("",) + DTYPES)
  check_choice(c, "model.remat", REMAT)
  check_choice(c, "model.backend", BACKENDS)
  check_choice(c, "model.attention", ATTENTION)
  check_range(c, "model.logprob_chunk_size", 1, integer=True)
  check_range(c, "model.causal_block", -1, integer=True)
  check_range(c, "model.extend_chunk", 0, integer=True)
  sizes = [check_range_mesh(c, f"model.mesh.{a}") for a in ("data", "fsdp", "tp")]
  if sum(s == -1 for s in sizes) > 1:
    raise ConfigError("model.mesh", dict(zip(("data", "fsdp", "tp"), sizes)),
                      "at most one axis may be -1")
  check_choice(c, "model.train_sharding", TRAIN_SHARDINGS)
  check_choice(c, "model.rollout_sharding", ROLLOUT_SHARDINGS)
  lora_lib.settings_from_config(cfg_model)
  if not cfg_model.hf_path:
    mc = _apply_overrides(PRESETS[cfg_model.preset], cfg_model, None)
    if mc.num_heads % mc.num_kv_heads:
      raise ConfigError("model.num_kv_heads", mc.num_kv_heads,
                        f"a divisor of num_heads={mc.num_heads}")


def check_range_mesh(c, field):
  """Mesh axis size: an int >= 1 or -1; returns it."""
  value = get_field(c, field)
  ok = isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= 1)
  if not ok:
    raise ConfigError(field, value, "an integer >= 1, or -1 for all remaining devices")
  return value


def _apply_overrides(base: ModelConfig, cfg_model: Any,
                     vocab_size: int | None) -> ModelConfig:
  kw = {}
  for name in _INT_OVERRIDES:
    v = cfg_model.get(name, 0)
    if v:
      kw[name] = int(v)
  if cfg_model.get("rope_theta", 0.0):
    kw["rope_theta"] = float(cfg_model.rope_theta)
  if cfg_model.get("tie_embeddings", ""):
    kw["tie_embeddings"] = cfg_model.tie_embeddings == "true"
  if vocab_size and not cfg_model.get("vocab_size", 0):
    kw["vocab_size"] = int(vocab_size)
  return dataclasses.replace(base, **kw, **_compute_overrides(cfg_model, base))


def _compute_overrides(cfg_model: Any, base: ModelConfig) -> dict[str, Any]:
  """The fields the section sets for presets and HF checkpoints alike."""
  kw = {k: cfg_model.get(k, getattr(base, k))
        for k in ("dtype", "param_dtype", "remat", "backend", "attention")}
  if cfg_model.get("causal_block", -1) >= 0:       # -1 = the preset's value
    kw["causal_block"] = int(cfg_model.causal_block)
  kw["extend_chunk"] = int(cfg_model.get("extend_chunk", 0))
  kw["kv_cache_dtype"] = str(cfg_model.get("kv_cache_dtype", ""))
  return kw


def model_config_from(cfg_model: Any, vocab_size: int | None = None) -> ModelConfig:
  """Builds the ModelConfig of the `model` section.

  Args:
    cfg_model: the `model` ConfigDict (validated here).
    vocab_size: the tokenizer's vocabulary size, or None. For a preset it replaces
      the preset vocab unless `model.vocab_size` is set. With `hf_path` the
      checkpoint's vocab wins; a larger tokenizer vocab raises ConfigError.
  """
  validate(cfg_model)
  if cfg_model.hf_path:
    base = config_from_hf(cfg_model.hf_path)
    if vocab_size and vocab_size > base.vocab_size:
      raise ConfigError("model.hf_path", cfg_model.hf_path,
                        f"a checkpoint whose vocab ({base.vocab_size}) covers the "
                        f"tokenizer's {vocab_size} ids")
    return dataclasses.replace(base, **_compute_overrides(cfg_model, base))
  return _apply_overrides(PRESETS[cfg_model.preset], cfg_model, vocab_size)


# --------------------------------------------------------------------------- HF config.json

SUPPORTED = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


class HFImportError(UserError, ValueError):
  """A checkpoint cannot be imported; the message names the tensor or field."""


def read_hf_config(path: str) -> dict[str, Any]:
  """The parsed `<path>/config.json`; HFImportError when it is missing."""
  fn = os.path.join(path, "config.json")
  if not os.path.exists(fn):
    raise HFImportError(f"{fn} not found (expected a HF checkpoint directory)")
  with open(fn) as f:
    return json.load(f)


def _rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
  """(rope_theta, llama3 scaling dict or None) from old or new (v5) config fields."""
  params = dict(hf.get("rope_parameters") or {})
  theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
  scaling = params or hf.get("rope_scaling") or None
  if scaling:
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
      return float(theta), None
    if kind != "llama3":
      raise HFImportError(f"config field rope_scaling.rope_type={kind!r} is not "
                          "supported (only 'default' and 'llama3')")
    scaling = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings")}
    scaling["rope_type"] = "llama3"
  return float(theta), scaling


def config_from_hf(path_or_config: str | dict, *, dtype: Any = "float32",
                   param_dtype: Any = None) -> ModelConfig:
  """ModelConfig of a HF Qwen2 / Llama checkpoint directory or config dict.

  `dtype` / `param_dtype` (default: dtype) are names or jnp / numpy dtypes. Raises
  HFImportError naming the config.json field that gigrl does not support.
  """
  hf = (read_hf_config(path_or_config) if isinstance(path_or_config, str)
        else path_or_config)
  mt = hf.get("model_type")
  if mt not in SUPPORTED:
    raise HFImportError(f"config field model_type={mt!r} (architectures="
                        f"{hf.get('architectures')}) is not supported; supported: "
                        f"{sorted(SUPPORTED)}")
  if hf.get("hidden_act", "silu") != "silu":
    raise HFImportError(f"config field hidden_act={hf['hidden_act']!r}: only 'silu'")
  if hf.get("mlp_bias"):
    raise HFImportError("config field mlp_bias=true is not supported")
  if mt == "qwen2" and hf.get("use_sliding_window"):
    raise HFImportError("config field use_sliding_window=true is not supported")
  if mt == "llama" and hf.get("attention_bias"):
    raise HFImportError("config field attention_bias=true (o_proj bias) is not "
                        "supported for llama")
  heads = hf["num_attention_heads"]
  theta, scaling = _rope(hf)
  return ModelConfig(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      rope_theta=theta, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      qkv_bias=(mt == "qwen2"),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_scaling=scaling, dtype=dtype, param_dtype=param_dtype or dtype,
      max_position=hf.get("max_position_embeddings", 32768))


# Embedding rows beyond the tokenizer's ids that HF checkpoints carry as padding
# (Qwen2.5: 151,665 tokenizer ids, 151,936 / 152,064 embedding rows).
VOCAB_PADDING_SLACK = 1024


def check_tokenizer(hf_path_or_model_cfg: str | ModelConfig, tokenizer: Any, *,
                    field: str = "data.tokenizer") -> None:
  """Checks that `tokenizer` is the vocabulary the model was trained with.

  With an HF checkpoint directory that ships `tokenizer.json`, the tokenizer must have
  that file's vocabulary size and encode a probe text to the same ids. Otherwise (a
  ModelConfig, or a checkpoint without tokenizer files) its vocabulary must cover the
  embedding up to VOCAB_PADDING_SLACK padding rows: e.g. the bundled 8k sentencepiece
  model with a Qwen2.5 checkpoint (151,936 rows) is refused, since every id would map
  to an unrelated embedding.

  Args:
    hf_path_or_model_cfg: an HF checkpoint directory, or the model's ModelConfig.
    tokenizer: has `vocab_size` and `encode(text) -> list[int]`.
    field: the config field named in the error.
  Raises:
    ConfigError naming `field` when the tokenizer does not belong to the model.
  """
  if isinstance(hf_path_or_model_cfg, ModelConfig):
    model_vocab, tok_json, where = hf_path_or_model_cfg.vocab_size, None, "the model"
  else:
    path = str(hf_path_or_model_cfg)
    model_vocab = int(read_hf_config(path)["vocab_size"])
    tok_json = os.path.join(path, "tokenizer.json")
    tok_json = tok_json if os.path.exists(tok_json) else None
    where = f"the checkpoint {path}"
  n = int(tokenizer.vocab_size)
  value = getattr(tokenizer, "path", None) or type(tokenizer).__name__
  if n > model_vocab:
    raise ConfigError(field, value, f"a tokenizer with at most the {model_vocab} ids of "
                      f"{where}'s embedding (this one has {n})")
  if tok_json is not None:
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    own = Tokenizer.from_file(tok_json)
    probe = "Who wrote <search> the Iliad? </search> Answer: Homer, 1984."
    own_n = int(own.get_vocab_size(with_added_tokens=True))
    same = own_n == n and (list(own.encode(probe, add_special_tokens=False).ids)
                           == list(tokenizer.encode(probe)))
    if not same:
      raise ConfigError(field, value, f"the checkpoint's own tokenizer {tok_json} "
                        f"({own_n} ids; this one has {n} ids or encodes differently): "
                        f"set {field} to {os.path.dirname(tok_json)}")
  elif n < model_vocab - VOCAB_PADDING_SLACK:
    raise ConfigError(field, value, f"the tokenizer {where} was trained with (this one "
                      f"has {n} ids for a {model_vocab}-row embedding)")
