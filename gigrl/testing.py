"""Small deterministic stand-ins shared by the tests and the benchmarks.

* :class:`FakeRetriever`: a thread-safe retriever whose passages name the query;
* :func:`chatty_model`: a tiny random policy whose greedy output uses the Search-R1 tags, so a
  rollout with it searches, answers and ends turns at different steps;
* :func:`write_bpe_tokenizer`: a small byte-level BPE ``tokenizer.json`` in the Qwen2 style
  (pre-tokenizer regex, ByteLevel, ``<|im_start|>``/``<|im_end|>`` chat template) in which the
  Search-R1 tags are several tokens each, as in the real Qwen2.5 and Llama 3 tokenizers;
* :func:`write_tiny_gguf`: a tiny llama.cpp GGUF file (Llama architecture, block-quantized
  tensors, RoPE-permuted Q/K rows, byte-level BPE vocabulary and ChatML template in the
  metadata), laid out as `convert_hf_to_gguf.py` writes SmolLM2;
* :func:`train_command`, :func:`run_train`: ``gigrl-train`` as a subprocess of a test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gigrl.data import tags
from gigrl.models import PRESETS, Transformer
from gigrl.search.base import Passage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # an editable install's


class FakeRetriever:
  """Deterministic, thread-safe: ``topk`` passages ``'"T{i}"\\nabout {query} number {i}'``.

  ``calls`` records every batch of queries, in call order. A :class:`gigrl.search.Retriever`:
  ``metrics()`` counts ``queries`` and ``requests`` (batches) and ``new_steps``.
  """

  def __init__(self):
    self.calls, self._lock = [], threading.Lock()
    self._steps = 0

  def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
    with self._lock:
      self.calls.append(list(queries))
    return [[Passage(f"{q}-{i}", f'"T{i}"\nabout {q} number {i}', 1.0) for i in range(topk)]
            for q in queries]

  def new_step(self) -> None:
    with self._lock:
      self._steps += 1

  def metrics(self) -> dict[str, float]:
    with self._lock:
      return {"queries": float(sum(len(c) for c in self.calls)),
              "requests": float(len(self.calls)), "new_steps": float(self._steps)}


def _tag_ids(tok, text: str) -> list[int]:
  return list(tok.encode(text))


def chatty_model(tok, seed: int = 0, search_bias: float = 1.0):
  """(cfg, graphdef, state): tiny random model whose greedy output uses the protocol tags.

  The LM head keeps only the columns of the tags' tokens, EOS and a few common words
  (scaled ×10), and the layer weights are scaled ×5 so the output depends on the context.
  ``search_bias`` further scales the columns of the ``<search>`` / ``</search>`` tokens (more
  searches). Works with any tokenizer (tags of one or several tokens).
  """
  cfg = PRESETS["tiny"].replace(vocab_size=tok.vocab_size, hidden_size=64,
                                intermediate_size=128, head_dim=16, tie_embeddings=False)
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  keep = [i for t in (tags.SEARCH_START, tags.SEARCH_END, tags.ANSWER_START, tags.ANSWER_END,
                      tags.THINK_START) for i in _tag_ids(tok, t)] + [tok.eos_id]
  keep += [i for w in (" paris", " river", " john", " the", " king", " born", " city", " war")
           for i in tok.encode(w)]
  cols = np.zeros((cfg.vocab_size,), bool)
  cols[keep] = True
  head = np.where(cols[None], np.asarray(model.lm_head[...]) * 10, 0)
  for tag in (tags.SEARCH_START, tags.SEARCH_END):
    for i in set(_tag_ids(tok, tag)):
      head[:, i] *= search_bias
  model.lm_head[...] = jnp.asarray(head, jnp.float32)
  for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
    p = getattr(model.layers, name)
    p[...] = p[...] * 5
  graphdef, state = nnx.split(model)
  return cfg, graphdef, state


# --------------------------------------------------------------------------- BPE tokenizer

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2.5-*): contractions, letter runs with
# one leading non-letter, single digits, punctuation runs with trailing newlines, whitespace.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _bpe_texts() -> list[str]:
  from gigrl.data import qa  # pylint: disable=import-outside-toplevel
  texts = [tags.INSTRUCTION, tags.INVALID_ACTION_MSG] * 20
  for q in qa.load_bundled_questions()[:400]:
    texts.append(q.question + "? " + " ".join(q.golden_answers))
    texts.append(f"<think> I need to find more information. </think>\n<search> {q.question} "
                 f"</search>\n\n<information>Doc 1(Title: x) y</information>\n\n<think> The "
                 f"documents answer the question. </think>\n<answer> {q.golden_answers[0]} "
                 "</answer>")
  texts += [d.contents for d in qa.load_bundled_corpus()[:300]]
  return texts


def write_bpe_tokenizer(directory: str, vocab_size: int = 1024,
                        texts: Sequence[str] | None = None) -> str:
  """Trains a byte-level BPE and writes a Qwen2-style HF tokenizer into ``directory``.

  Files: ``tokenizer.json`` (Qwen2 split regex + ByteLevel pre-tokenizer, ByteLevel decoder,
  special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos)),
  ``tokenizer_config.json`` (eos/pad tokens and a ChatML ``chat_template``) and
  ``generation_config.json``. No Search-R1 tag is added as a token: the split regex cuts
  ``</search>`` into ``</``, ``search``, ``>``, so every tag is several tokens.

  Args:
    directory: created if missing.
    vocab_size: BPE vocabulary size (special tokens included).
    texts: training texts; default the protocol texts, bundled questions and some passages.
  Returns:
    ``directory`` (loadable with ``gigrl.data.tokenizer.load``).
  Raises:
    AssertionError: a tag came out as one token (the tokenizer would not test multi-token
      stops).
  """
  from tokenizers import (Regex, Tokenizer, decoders, models,  # pylint: disable=import-outside-toplevel
                          pre_tokenizers, trainers)
  os.makedirs(directory, exist_ok=True)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(list(texts if texts is not None else _bpe_texts()), trainer)
  for t in tags.TAGS:
    assert len(tok.encode(t, add_special_tokens=False).ids) > 1, t
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
               "chat_template": CHAT_TEMPLATE}, f)
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                tok.token_to_id("<|endoftext|>")]}, f)
  return directory


# --------------------------------------------------------------------------- tiny GGUF file

_GGUF_TEXTS = (
    "Who wrote Hamlet in 1603? <search> hamlet author </search> <answer> Shakespeare </answer>",
    "The river flows 6,650 km through 11 countries; it was mapped in 1858 and 1899.",
    "<think> I need to find more information. </think> The city had 2024 people in 2019.",
    "Paris is the capital of France, and 42 is the answer to everything 0123456789.",
)


def _permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp `convert_hf_to_gguf.LlamaModel.permute`: HF rotate-half rows -> interleaved."""
  return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path: str, *, pre: str = "smollm", split_digits: bool = True,
                    vocab_size: int = 384, seed: int = 0) -> dict:
  """Writes a tiny Llama GGUF file the way llama.cpp's converter writes SmolLM2.

  2 layers, d_model 64, 4 query / 2 KV heads of 16, FFN 128, tied embeddings (no
  `output.weight`), RoPE base 1e5. `attn_q` / `attn_k` rows are permuted as
  `convert_hf_to_gguf.py` does; the 2-D tensors are stored as Q8_0, Q4_1, F16 or F32 (both
  Q and K of each kind), the norms F32. The tokenizer is a byte-level BPE trained here
  (`tokenizer.ggml.model` "gpt2", `tokenizer.ggml.pre` = `pre`) with `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>` as ids 0-2 (CONTROL; unk, bos, eos = pad) and the ChatML
  :data:`CHAT_TEMPLATE`.

  Args:
    path: the `.gguf` file to write.
    pre: `tokenizer.ggml.pre`.
    split_digits: train the BPE on digits split one by one (as SmolLM2's was), so no merge
      joins digits; False learns multi-digit merges.
    vocab_size: BPE vocabulary size (special tokens included).
    seed: the random weights.
  Returns:
    `{"path", "tensors": {HF name: f32 array in HF layout, as the file's values dequantize
    (computed without llama.cpp's permutation, so a wrong un-permutation differs)},
    "tokenizer": the trained `tokenizers.Tokenizer`, "tokens": the vocabulary by id}`.
  """
  import gguf  # pylint: disable=import-outside-toplevel
  from gguf import quants  # pylint: disable=import-outside-toplevel
  from tokenizers import (Regex, Tokenizer, decoders, models,  # pylint: disable=import-outside-toplevel
                          pre_tokenizers, trainers)
  d, layers, heads, kv_heads, head_dim, ffn = 64, 2, 4, 2, 16, 128
  tok = Tokenizer(models.BPE())
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
                       if split_digits else byte_level)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(list(_GGUF_TEXTS) * 20 + _bpe_texts()[:200], trainer)
  n_vocab = tok.get_vocab_size(with_added_tokens=True)
  tokens = [tok.id_to_token(i) for i in range(n_vocab)]
  merges = [m if isinstance(m, str) else " ".join(m)
            for m in json.loads(tok.to_str())["model"]["merges"]]

  rng = np.random.RandomState(seed)
  q_types = [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0]
  other = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1,
           gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32]
  shapes = {"attn_q": (heads * head_dim, d), "attn_k": (kv_heads * head_dim, d),
            "attn_v": (kv_heads * head_dim, d), "attn_output": (d, heads * head_dim),
            "ffn_gate": (ffn, d), "ffn_up": (ffn, d), "ffn_down": (d, ffn)}
  hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
  entries = [("token_embd.weight", "model.embed_tokens.weight",
              0.5 * rng.randn(n_vocab, d), gguf.GGMLQuantizationType.Q8_0, None),
             ("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.randn(d),
              gguf.GGMLQuantizationType.F32, None)]
  for i in range(layers):
    hf = f"model.layers.{i}"
    entries.append((f"blk.{i}.attn_norm.weight", f"{hf}.input_layernorm.weight",
                    1 + 0.1 * rng.randn(d), gguf.GGMLQuantizationType.F32, None))
    entries.append((f"blk.{i}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight",
                    1 + 0.1 * rng.randn(d), gguf.GGMLQuantizationType.F32, None))
    for j, (name, shape) in enumerate(shapes.items()):
      scale = 0.3 if name in ("attn_q", "attn_k") else 0.15
      qtype = (q_types[(i + j) % 2] if i == 0 else gguf.GGMLQuantizationType.F32
               ) if name in ("attn_q", "attn_k") else other[(i + j) % len(other)]
      perm = heads if name == "attn_q" else kv_heads if name == "attn_k" else None
      entries.append((f"blk.{i}.{name}.weight", f"{hf}.{hf_names[name]}.weight",
                      scale * rng.randn(*shape), qtype, perm))

  writer = gguf.GGUFWriter(path, "llama")
  writer.add_name("tiny-llama")
  writer.add_context_length(256)
  writer.add_embedding_length(d)
  writer.add_block_count(layers)
  writer.add_feed_forward_length(ffn)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_rope_freq_base(1e5)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
  writer.add_vocab_size(n_vocab)
  writer.add_rope_dimension_count(head_dim)
  writer.add_add_space_prefix(False)
  writer.add_add_bos_token(False)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types([gguf.TokenType.CONTROL if t in CHAT_SPECIAL else
                          gguf.TokenType.NORMAL for t in tokens])
  writer.add_token_merges(merges)
  writer.add_bos_token_id(tok.token_to_id("<|im_start|>"))
  writer.add_eos_token_id(tok.token_to_id("<|im_end|>"))
  writer.add_unk_token_id(tok.token_to_id("<|endoftext|>"))
  writer.add_pad_token_id(tok.token_to_id("<|im_end|>"))
  writer.add_chat_template(CHAT_TEMPLATE)
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  expected = {}
  for name, hf_name, w, qtype, perm in entries:
    w = w.astype(np.float32)
    stored = w if perm is None else _permute_qk(w, perm)
    if qtype == gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, stored)
      expected[hf_name] = w
    elif qtype == gguf.GGMLQuantizationType.F16:
      writer.add_tensor(name, stored.astype(np.float16))
      expected[hf_name] = w.astype(np.float16).astype(np.float32)
    else:  # blocks of 32 along each row: quantizing commutes with permuting rows
      writer.add_tensor(name, quants.quantize(stored, qtype), raw_dtype=qtype)
      expected[hf_name] = quants.dequantize(quants.quantize(w, qtype), qtype).reshape(w.shape)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return {"path": path, "tensors": expected, "tokenizer": tok, "tokens": tokens}


def cache_compiles_on_every_process() -> bool:
  """Lets every process of a multi-process CPU test write its own persistent-cache entries.

  jax (0.10) writes persistent compilation-cache entries from process 0 only, and on CPU a
  program's cache key includes the process's own topology fingerprint, so the other processes
  never hit the cache: they recompile every program at every launch (process 0 then waits for
  them at the first collective). The multi-process end-to-end tests relaunch the same programs
  several times (reference, SIGTERM, kill -9, resume); with this, each process's entries are
  written under its own keys and later launches load them. Test speed only: a loaded executable
  is the one XLA compiled. Returns False (changes nothing) if jax's internals moved.
  """
  try:
    from jax._src import compilation_cache  # pylint: disable=import-outside-toplevel
    from jax._src import compiler  # pylint: disable=import-outside-toplevel
    original = compiler._cache_write  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    return False
  import jax  # pylint: disable=import-outside-toplevel

  def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if jax.process_index() == 0 or host_callbacks:
      return original(cache_key, compile_time_secs, module_name, backend, executable,
                      host_callbacks)
    try:
      compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                int(compile_time_secs))
    except Exception:  # pylint: disable=broad-except
      pass              # a cache write is an optimisation; jax itself only warns
    return None

  compiler._cache_write = write  # pylint: disable=protected-access
  return True


def tiny_policy(seed: int = 0):
  """A 1-layer ``tiny`` policy (vocab 64) on a one-device ``fsdp`` mesh, as the trainer builds
  it (:class:`gigrl.training.build.Policy`): for update tests on the real PPO step."""
  # pylint: disable=import-outside-toplevel
  import jax
  from gigrl.models import sharding as shd
  from gigrl.training import build
  # pylint: enable=import-outside-toplevel
  model_cfg = PRESETS["tiny"].replace(vocab_size=64, num_layers=1)
  mesh = shd.make_mesh({"data": 1, "fsdp": 1, "tp": 1}, devices=jax.devices()[:1])
  graphdef, params = nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(seed)))
  param_sh = shd.param_shardings(params, mesh, "fsdp")
  params = shd.shard_state(params, mesh, "fsdp")
  return build.Policy(model_cfg=model_cfg, graphdef=graphdef, mesh=mesh, params=params,
                      param_sh=param_sh, train_preset="fsdp", rollout_preset="fsdp")


# ------------------------------------------------------------------ gigrl-train in a subprocess
# A tiny test run executes few of the programs its warm-up would compile first (the smoke config
# with test_resume's overrides: 23 programs; 28.8 s cold and 11.2 s with a warm compilation cache,
# against 15.8 s and 8.4 s without the warm-up, on 2 cores). So test runs start without it, and a
# test of the warm-up (no compile after it) passes ``--config.train.warmup=true``: of repeated
# flags, the last wins.
TEST_DEFAULTS = ("--config.train.warmup=false",)


def train_command(workdir, *args: str, config: str = "configs/smoke.py") -> list[str]:
  """``python -m gigrl.cli.train --config <repo>/<config> --workdir <workdir>
  --config.train.warmup=false <args>`` (:data:`TEST_DEFAULTS`; ``args`` override them)."""
  return [sys.executable, "-m", "gigrl.cli.train", "--config", os.path.join(REPO, config),
          "--workdir", str(workdir), *TEST_DEFAULTS, *args]


def single_process_env(**extra: str) -> dict[str, str]:
  """This environment without ``XLA_FLAGS`` (the tests' 8 simulated devices), plus ``extra``."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(extra)
  return env


def run_train(workdir, *args: str, ok: bool = True, env: dict | None = None,
              timeout: float = 600):
  """Runs :func:`train_command` to the end (repo root, :func:`single_process_env`).

  Returns:
    ``ok``: its stdout + stderr (asserting exit 0, with the stderr's end on failure); else the
    ``subprocess.CompletedProcess``.
  """
  proc = subprocess.run(train_command(workdir, *args), capture_output=True, text=True,
                        timeout=timeout, cwd=REPO, env=env or single_process_env())
  if ok:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr
  return proc
