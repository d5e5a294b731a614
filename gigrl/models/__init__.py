"""Policy model: NNX Qwen2/Llama decoder, KV-cache extend, sampler, chunked log-probs.

Public API (see each module for shapes):
  ModelConfig, PRESETS, default_config, validate, model_config_from,  (config)
  check_tokenizer
  Transformer, KVCache, init_cache, extend                            (transformer)
  extend_last, decode, generate, DecodeOut                            (sampler)
  token_logprobs, logprobs_from_hidden                                (logprobs)
  from_hf, to_hf                                                      (hf, lazy)
"""
from gigrl.models.config import (PRESETS, ModelConfig, check_tokenizer, default_config,
                                 model_config_from, validate)
from gigrl.models.logprobs import logprobs_from_hidden, token_logprobs
from gigrl.models.sampler import DecodeOut, decode, extend_last, generate
from gigrl.models.transformer import KVCache, Transformer, extend, init_cache


def from_hf(*args, **kwargs):
  """See `gigrl.models.hf.from_hf` (imported lazily: needs safetensors)."""
  from gigrl.models import hf
  return hf.from_hf(*args, **kwargs)


def to_hf(*args, **kwargs):
  """See `gigrl.models.hf.to_hf`."""
  from gigrl.models import hf
  return hf.to_hf(*args, **kwargs)
