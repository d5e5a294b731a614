"""GGUF (llama.cpp) checkpoints of Llama-architecture models -> HF directories gigrl loads.

A GGUF file holds the tensors (often block-quantized: Q4_1, Q8_0, ...), the architecture as
`llama.*` metadata and the tokenizer (`tokenizer.ggml.*`: vocabulary, merges, token types,
special ids, `tokenizer.chat_template`). :func:`gguf_to_hf` turns one into the directory
`model.hf_path` and `data.tokenizer` read: `config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json` (with the chat template) and
`generation_config.json`.

Reading and dequantizing is the `gguf` library's (`gguf.GGUFReader`,
`gguf.quants.dequantize`); the tokenizer is assembled with the `tokenizers` library. Two
conversions undo what llama.cpp's `convert_hf_to_gguf.py` did:

* `attn_q` / `attn_k` rows were permuted for llama.cpp's interleaved RoPE
  (`LlamaModel.permute`: rows `[head, 2, head_dim/2]` -> `[head, head_dim/2, 2]`);
  :func:`unpermute_qk` restores HF's rotate-half layout.
* GGUF shapes list the fastest axis first; the dequantized arrays are already `[out, in]`,
  HF's Linear layout.

The BPE pre-tokenizer is picked from `tokenizer.ggml.pre` the way llama.cpp's
`llama-vocab.cpp` does: `smollm` (and the StarCoder family) split digits one by one before
GPT-2's byte-level regex; `gpt2` and unknown values use the byte-level regex alone.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

from gigrl.models.config import HFImportError

# llama.cpp tensor names -> HF names ({i} = layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
# tokenizer.ggml.pre values whose pre-tokenizer splits digits individually first
# (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_STARCODER / REFACT / SMOLLM / CODESHELL / ...).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                    "minerva-7b")
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values of special tokens


class GGUFError(HFImportError):
  """A GGUF file that cannot be read or converted (names the file and what is wrong)."""


def _reader(path: str):
  import gguf  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    raise GGUFError(f"{path}: no such GGUF file")
  try:
    return gguf.GGUFReader(path, "r")
  except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
    raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default: Any = KeyError) -> Any:
  f = reader.fields.get(key)
  if f is None:
    if default is KeyError:
      raise GGUFError(f"{reader.path}: metadata key {key!r} is missing")
    return default
  return f.contents()


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's RoPE row permutation of a Q or K projection.

  Args:
    w: f32[n_heads * head_dim, d_model], the GGUF tensor dequantized (HF's [out, in]).
    n_heads: query heads for `attn_q`, KV heads for `attn_k`.
  Returns:
    f32[n_heads * head_dim, d_model] in HF's rotate-half row order: the inverse of
    `convert_hf_to_gguf.LlamaModel.permute` (reshape `[h, 2, hd/2, ...]`, swap axes 1 and 2).
  """
  rows = w.shape[0]
  hd = rows // n_heads
  return (w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_config(reader) -> dict[str, Any]:
  """config.json (LlamaForCausalLM) from a GGUF file's `llama.*` metadata.

  Raises:
    GGUFError: the architecture is not `llama`, or a required key is missing.
  """
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise GGUFError(f"{reader.path}: general.architecture is {arch!r}; only 'llama' "
                    "GGUF files are supported")
  d = int(_field(reader, "llama.embedding_length"))
  heads = int(_field(reader, "llama.attention.head_count"))
  names = {t.name for t in reader.tensors}
  vocab = int(_field(reader, "llama.vocab_size", 0)) or len(
      _field(reader, "tokenizer.ggml.tokens"))
  theta = float(_field(reader, "llama.rope.freq_base", 10000.0))
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
      "vocab_size": vocab, "hidden_size": d,
      "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
      "num_hidden_layers": int(_field(reader, "llama.block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
      "head_dim": int(_field(reader, "llama.rope.dimension_count", d // heads)),
      "rms_norm_eps": float(np.float32(_field(reader,
                                              "llama.attention.layer_norm_rms_epsilon"))),
      "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
      "rope_theta": theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": theta},
      "tie_word_embeddings": "output.weight" not in names,
      "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
      "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
      "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
      "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
  }


def hf_tensors(reader, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, f32 array) for every tensor of the file, dequantized and un-permuted.

  Raises:
    GGUFError: a tensor name that is not a Llama tensor, or data that cannot be dequantized
      (a truncated file).
  """
  from gguf import quants  # pylint: disable=g-import-not-at-top
  for t in reader.tensors:
    parts = t.name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
      base = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    elif len(parts) == 2 and parts[0] in _TOP_NAMES:
      base = _TOP_NAMES[parts[0]]
    else:
      raise GGUFError(f"{reader.path}: tensor {t.name!r} is not a Llama tensor")
    try:
      w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
      w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
    except Exception as e:
      raise GGUFError(f"{reader.path}: tensor {t.name!r} cannot be read "
                      f"({type(e).__name__}: {e})") from None
    if parts[-2] == "attn_q":
      w = unpermute_qk(w, config["num_attention_heads"])
    elif parts[-2] == "attn_k":
      w = unpermute_qk(w, config["num_key_value_heads"])
    yield f"{base}.{parts[-1]}", np.ascontiguousarray(w)


def tokenizer_json(reader) -> dict[str, Any]:
  """A `tokenizers` byte-level BPE tokenizer from `tokenizer.ggml.*` (as JSON).

  Raises:
    GGUFError: the tokenizer model is not `gpt2` (byte-level BPE).
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top,g-multiple-import
  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(f"{reader.path}: tokenizer.ggml.model is {kind!r}; only byte-level "
                    "BPE ('gpt2') tokenizers are supported")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  vocab = {tok: i for i, tok in enumerate(tokens)}
  unk = _field(reader, "tokenizer.ggml.unknown_token_id", None)
  tok = Tokenizer(models.BPE(vocab, merges, unk_token=None if unk is None else tokens[unk],
                             fuse_unk=False, byte_fallback=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                        use_regex=True)
  pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
  if pre in _DIGIT_SPLIT_PRE:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  special = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
  tok.add_special_tokens(special)
  return json.loads(tok.to_str())


def tokenizer_config(reader) -> dict[str, Any]:
  """tokenizer_config.json: special tokens and the chat template from the GGUF metadata."""
  tokens = _field(reader, "tokenizer.ggml.tokens")

  def tok(key):
    i = _field(reader, key, None)
    return None if i is None else tokens[int(i)]

  out = {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": bool(
      _field(reader, "tokenizer.ggml.add_bos_token", False)),
         "bos_token": tok("tokenizer.ggml.bos_token_id"),
         "eos_token": tok("tokenizer.ggml.eos_token_id"),
         "pad_token": tok("tokenizer.ggml.padding_token_id"),
         "unk_token": tok("tokenizer.ggml.unknown_token_id"),
         "model_max_length": int(_field(reader, "llama.context_length", 2048))}
  template = _field(reader, "tokenizer.chat_template", None)
  if template:
    out["chat_template"] = template
  return out


MARKER = "gigrl_fetch.json"
"""Written last into a converted directory (with the conversion's facts): its presence means
the directory is complete."""


def gguf_to_hf(gguf_path: str, out_dir: str, meta: dict[str, Any] | None = None
               ) -> dict[str, Any]:
  """Converts a Llama GGUF file into an HF checkpoint directory (float32 safetensors).

  The directory is written under a temporary name beside `out_dir` and renamed into place
  only when every file is complete, so a failed conversion leaves nothing that looks whole.

  Args:
    gguf_path: a `.gguf` file (any quantization the `gguf` library dequantizes).
    out_dir: the directory to create; it must not exist, or be empty.
    meta: extra facts for the directory's :data:`MARKER` file (e.g. the fetched name).
  Returns:
    `{"dir", "num_params", "files", "config"}`; `files` lists what was written, the
    :data:`MARKER` file (`{"source", "num_params", **meta}`) included.
  Raises:
    GGUFError: unreadable, truncated or unsupported file (names the file and the tensor or
      key); OSError subclasses for an out_dir that cannot be written.
  """
  from gigrl.models.hf import atomic_directory, write_safetensors  # pylint: disable=g-import-not-at-top
  reader = _reader(gguf_path)
  config = hf_config(reader)
  tensors = dict(hf_tensors(reader, config))
  want = {"model.embed_tokens.weight", "model.norm.weight"}
  missing = sorted(want - set(tensors))
  if missing:
    raise GGUFError(f"{gguf_path}: tensors {missing} are missing")
  tok_json, tok_cfg = tokenizer_json(reader), tokenizer_config(reader)
  num_params = int(sum(a.size for a in tensors.values()))
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise FileExistsError(f"{out_dir} exists and is not an empty directory")
  with atomic_directory(out_dir, ".gigrl-fetch-") as tmp:
    write_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
    files = {"config.json": config, "tokenizer.json": tok_json,
             "tokenizer_config.json": tok_cfg,
             "generation_config.json": {"bos_token_id": config["bos_token_id"],
                                        "eos_token_id": config["eos_token_id"],
                                        "pad_token_id": _field(
                                            reader, "tokenizer.ggml.padding_token_id",
                                            None)}}
    files[MARKER] = {"source": os.path.basename(gguf_path), "num_params": num_params,
                     **(meta or {})}
    for name, obj in files.items():
      with open(os.path.join(tmp, name), "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
  return {"dir": out_dir, "num_params": num_params,
          "files": sorted(["model.safetensors", *files]), "config": config}
