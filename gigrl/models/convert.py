"""HF Qwen2/Llama safetensors -> orbax checkpoint (``gigrl-convert-hf``'s library call).

:func:`convert` writes `<out>/state` (orbax StandardCheckpointer of the parameters as a pure dict,
the layout of `nnx.to_pure_dict(nnx.state(Transformer))`) and
`<out>/model_config.json` (the ModelConfig fields). `load_converted` reads it back
onto any mesh / sharding preset (orbax reshards on restore).
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from gigrl.models import hf
from gigrl.models.config import ModelConfig
from gigrl.models.transformer import Transformer


def convert(hf_dir: str, out: str, *, dtype: str = "float32",
            param_dtype: str | None = None) -> ModelConfig:
  """Converts `hf_dir` into an orbax checkpoint at `out`; returns the ModelConfig."""
  model, cfg = hf.from_hf(hf_dir, dtype=dtype, param_dtype=param_dtype)
  out = os.path.abspath(out)
  os.makedirs(out, exist_ok=True)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(out, "state"), nnx.to_pure_dict(nnx.state(model)), force=True)
  ckptr.wait_until_finished()
  with open(os.path.join(out, "model_config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  return cfg


def load_converted(out: str, *, mesh=None, preset: str = "replicated"
                   ) -> tuple[Transformer, ModelConfig]:
  """Restores a converted checkpoint, optionally sharded with `preset` on `mesh`."""
  out = os.path.abspath(out)
  with open(os.path.join(out, "model_config.json")) as f:
    cfg = ModelConfig(**json.load(f))
  graphdef, abs_state, pure, shardings = hf.abstract_with_shardings(cfg, mesh, preset)
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        pure, shardings)
  restored = ocp.StandardCheckpointer().restore(os.path.join(out, "state"), target)
  nnx.replace_by_pure_dict(abs_state, restored)
  return nnx.merge(graphdef, abs_state), cfg
