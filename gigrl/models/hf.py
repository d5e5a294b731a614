"""Hugging Face checkpoint import / export for Qwen2(.5) and Llama 3.x.

Import reads `config.json` and the `*.safetensors` files (single file or sharded with
`model.safetensors.index.json`) through read-only memory maps of the safetensors
format (8-byte little-endian header length, JSON header, raw little-endian data). Each
parameter is built with `jax.make_array_from_callback`, so every device reads only
its own slice of each tensor straight from the mapped file: the model is never
copied whole into host memory.

Tensor names follow HF `modeling_qwen2.py` / `modeling_llama.py`:
`model.embed_tokens.weight`, `model.layers.{i}.{input_layernorm, post_attention_layernorm}.weight`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`,
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.norm.weight`, `lm_head.weight`.
HF Linear weights are [out, in]; gigrl kernels are [in, out] and stacked over layers.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import struct
import tempfile
from typing import Any, Iterator

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from gigrl.models.config import (SUPPORTED, HFImportError, ModelConfig,  # noqa: F401
                                 config_from_hf, read_hf_config)
from gigrl.models.transformer import Transformer
from gigrl.models import lora as lora_lib

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}

# gigrl layer param -> (HF per-layer suffix, transpose)
_LAYER_MAP = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
_TOP_MAP = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


# --------------------------------------------------------------------------- safetensors


class SafetensorsReader:
  """Memory-mapped, read-only view of the tensors in a checkpoint directory."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
      files = [os.path.join(path, f) for f in files]
    else:
      files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
      raise HFImportError(f"no *.safetensors files in {path}")
    self.entries: dict[str, tuple[str, dict, int]] = {}
    for fn in files:
      for name, meta, base in _read_header(fn):
        self.entries[name] = (fn, meta, base)
    self._maps: dict[str, np.memmap] = {}

  def __contains__(self, name: str) -> bool:
    return name in self.entries

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entry(name)[1]["shape"])

  def _entry(self, name):
    if name not in self.entries:
      raise HFImportError(f"tensor {name!r} is missing from the checkpoint {self.path}")
    return self.entries[name]

  def get(self, name: str) -> np.ndarray:
    """Zero-copy ndarray view of tensor `name` (native dtype)."""
    fn, meta, base = self._entry(name)
    if meta["dtype"] not in _ST_DTYPES:
      raise HFImportError(f"tensor {name!r} has unsupported dtype {meta['dtype']}")
    if fn not in self._maps:
      self._maps[fn] = np.memmap(fn, dtype=np.uint8, mode="r")
    start, end = meta["data_offsets"]
    raw = self._maps[fn][base + start:base + end]
    return raw.view(_ST_DTYPES[meta["dtype"]]).reshape(meta["shape"])


def _read_header(fn: str) -> Iterator[tuple[str, dict, int]]:
  with open(fn, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  for name, meta in header.items():
    if name != "__metadata__":
      yield name, meta, 8 + n


@contextlib.contextmanager
def atomic_directory(out_dir: str, prefix: str = ".gigrl-"):
  """Yields a new temporary directory beside ``out_dir`` (mode 755) that becomes ``out_dir``
  (new or empty) when the block ends; on any error it is removed, so nothing half-written is
  left where a complete directory is expected."""
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
  os.chmod(tmp, 0o755)
  try:
    yield tmp
    if os.path.isdir(out_dir):
      os.rmdir(out_dir)
    os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def write_safetensors(fn: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes a safetensors file (metadata format 'pt', as transformers expects)."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, arr in tensors.items():
    header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(fn, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in tensors.values():
      f.write(np.ascontiguousarray(arr).tobytes())


# --------------------------------------------------------------------------- import


def _hf_names(name: str, num_layers: int) -> tuple[list[str], bool, bool]:
  """(HF tensor names, transpose, stacked) of gigrl parameter `name`."""
  if name in _LAYER_MAP:
    suffix, tr = _LAYER_MAP[name]
    return [f"model.layers.{i}.{suffix}" for i in range(num_layers)], tr, True
  hf_name, tr = _TOP_MAP[name]
  return [hf_name], tr, False


def _load_param(reader: SafetensorsReader, name: str, abstract: jax.ShapeDtypeStruct,
                sharding, cfg: ModelConfig) -> jax.Array:
  names, transpose, stacked = _hf_names(name, cfg.num_layers)
  want = abstract.shape[1:] if stacked else abstract.shape
  want_hf = tuple(reversed(want)) if transpose else tuple(want)
  for n in names:
    got = reader.shape(n)
    if got != want_hf:
      raise HFImportError(f"tensor {n!r} has shape {got}, expected {want_hf} "
                          f"from config.json (gigrl param {name!r})")
  dtype = abstract.dtype

  def one(n, idx):
    arr = reader.get(n)
    if transpose:
      return arr[tuple(reversed(idx))].T.astype(dtype)
    return arr[idx].astype(dtype)

  def callback(index):
    if not stacked:
      return one(names[0], tuple(index))
    layers = range(cfg.num_layers)[index[0]]
    return np.stack([one(names[i], tuple(index[1:])) for i in layers])

  return jax.make_array_from_callback(abstract.shape, sharding, callback)


def abstract_with_shardings(cfg: ModelConfig, mesh: Mesh | None, preset: str):
  """(graphdef, abstract state, its pure dict, pure dict of target shardings) of a model.

  With a mesh the shardings follow `sharding.param_shardings(.., mesh, preset)`; without
  one everything goes to the first device.
  """
  from gigrl.models import sharding as shd

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  pure = nnx.to_pure_dict(abs_state)
  if mesh is not None:
    shardings = nnx.to_pure_dict(shd.param_shardings(abs_state, mesh, preset))
  else:
    dev = SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: dev, pure)
  return graphdef, abs_state, pure, shardings


def from_hf(path: str, *, dtype: Any = "float32", param_dtype: Any = None,
            mesh: Mesh | None = None, preset: str = "replicated",
            config: ModelConfig | None = None,
            **overrides) -> tuple[Transformer, ModelConfig]:
  """Loads a HF Qwen2 / Llama checkpoint into a Transformer.

  Args:
    path: directory with config.json and *.safetensors.
    dtype: activation dtype; param_dtype: storage dtype (default = dtype). Either a
      name ("bfloat16") or a jnp / numpy dtype (`jnp.bfloat16`).
    mesh, preset: place each parameter on `sharding.param_shardings(.., mesh,
      preset)`; without a mesh everything goes to the first device.
    config: the ModelConfig to build (e.g. `model_config_from(cfg.model)`, which
      already read config.json and applied the `model` section); default
      `config_from_hf(path, dtype=dtype, param_dtype=param_dtype)`.
    **overrides: other ModelConfig fields (remat, backend, attention, ...).
  Returns:
    (model, cfg); `model.cfg` is `cfg` with backend / attention resolved.
  Raises:
    HFImportError naming the field / tensor for an unsupported architecture, a missing
    tensor or a shape mismatch.
  """
  cfg = config or config_from_hf(path, dtype=dtype, param_dtype=param_dtype)
  cfg = cfg.replace(**overrides)
  reader = SafetensorsReader(path)
  graphdef, abs_state, pure, shardings = abstract_with_shardings(cfg, mesh, preset)

  def load(path_keys, x):
    name = path_keys[-1].key
    return _load_param(reader, name, x, _get(shardings, path_keys), cfg)

  loaded = jax.tree_util.tree_map_with_path(load, pure)
  nnx.replace_by_pure_dict(abs_state, loaded)
  return nnx.merge(graphdef, abs_state), cfg


def _get(tree, path_keys):
  for k in path_keys:
    tree = tree[k.key]
  return tree


# --------------------------------------------------------------------------- export


def hf_config_dict(cfg: ModelConfig, torch_dtype: str) -> dict[str, Any]:
  """config.json contents for `cfg` (Qwen2 when qkv_bias, else Llama)."""
  mt = "qwen2" if cfg.qkv_bias else "llama"
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    rope = dict(cfg.rope_scaling_dict, rope_theta=cfg.rope_theta)
  out = {
      "architectures": [SUPPORTED[mt]], "model_type": mt, "hidden_act": "silu",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_position, "rope_parameters": rope,
      "rope_theta": cfg.rope_theta, "dtype": torch_dtype, "torch_dtype": torch_dtype,
      "initializer_range": 0.02, "use_cache": True,
  }
  if mt == "qwen2":
    out.update(use_sliding_window=False, sliding_window=None,
               max_window_layers=cfg.num_layers)
  else:
    out.update(attention_bias=False, mlp_bias=False)
    if cfg.rope_scaling is not None:
      out["rope_scaling"] = cfg.rope_scaling_dict
  return out


def to_hf(model: Transformer, cfg: ModelConfig, out_dir: str, *,
          dtype: str | None = None, max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes config.json + safetensors (sharded with an index past max_shard_bytes).

  A model with LoRA adapters is written merged (:func:`gigrl.models.lora.merge_into_base`):
  the directory is a plain HF checkpoint of the fine-tuned model.

  Arrays are gathered to host one parameter at a time. Returns the written files.
  """
  os.makedirs(out_dir, exist_ok=True)
  np_dtype = np.dtype(ml_dtypes.bfloat16 if (dtype or cfg.param_dtype) == "bfloat16"
                      else (dtype or cfg.param_dtype))
  pure = nnx.to_pure_dict(nnx.state(model))
  if lora_lib.adapter_names(model.layers):    # LoRA: write the merged model, W + (alpha/r) A B
    pure["layers"] = lora_lib.merge_into_base(pure["layers"], model.layers.lora_scale)
  flat = {"embed": pure["embed"], "final_norm": pure["final_norm"], **pure["layers"]}
  if "lm_head" in pure:
    flat["lm_head"] = pure["lm_head"]
  shards, cur, size = [], {}, 0
  for name, arr in flat.items():
    host = np.asarray(jax.device_get(arr)).astype(np_dtype)
    names, transpose, stacked = _hf_names(name, cfg.num_layers)
    parts = list(host) if stacked else [host]
    for n, p in zip(names, parts):
      p = np.ascontiguousarray(p.T if transpose else p)
      if cur and size + p.nbytes > max_shard_bytes:
        shards.append(cur)
        cur, size = {}, 0
      cur[n], size = p, size + p.nbytes
  shards.append(cur)
  files = []
  if len(shards) == 1:
    files.append(os.path.join(out_dir, "model.safetensors"))
    write_safetensors(files[0], shards[0])
  else:
    weight_map = {}
    for i, sh in enumerate(shards):
      fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      write_safetensors(os.path.join(out_dir, fn), sh)
      files.append(os.path.join(out_dir, fn))
      weight_map.update({n: fn for n in sh})
    total = sum(a.nbytes for sh in shards for a in sh.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                indent=2)
  torch_dtype = {"float32": "float32", "bfloat16": "bfloat16",
                 "float16": "float16"}[str(np_dtype)]
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config_dict(cfg, torch_dtype), f, indent=2)
  return files


def to_peft(model: Transformer, settings: "lora_lib.LoraSettings", out_dir: str, *,
            base: str) -> list[str]:
  """Writes the LoRA adapters alone in peft's format (``adapter_config.json``,
  ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(base_model, out_dir)``
  loads on the base.

  Args:
    model: a Transformer with adapters (``lora.add_adapters``); settings: its ``model.lora``.
    base: the base checkpoint's path or hub id (``base_model_name_or_path``).
  Returns:
    the written files.
  Raises:
    ValueError: the model has no adapters.
  """
  pure = nnx.to_pure_dict(nnx.state(model))["layers"]
  if not lora_lib.adapter_names(model.layers):
    raise ValueError("the model has no LoRA adapters (model.lora.rank is 0)")
  host = {k: np.asarray(jax.device_get(v), np.float32) for k, v in pure.items()}
  tensors = {k: np.ascontiguousarray(v) for k, v in lora_lib.peft_tensors(host).items()}
  os.makedirs(out_dir, exist_ok=True)
  files = [os.path.join(out_dir, "adapter_model.safetensors"),
           os.path.join(out_dir, "adapter_config.json")]
  write_safetensors(files[0], tensors)
  with open(files[1], "w") as f:
    json.dump(lora_lib.peft_config(settings, base), f, indent=2)
  return files
