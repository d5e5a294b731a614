"""Small deterministic stand-ins shared by the tests and the benchmarks.

* :class:`FakeRetriever`: a thread-safe retriever whose passages name the query;
* :func:`chatty_model`: a tiny random policy whose greedy output uses the Search-R1 tags, so a
  rollout with it searches, answers and ends turns at different steps;
* :func:`write_bpe_tokenizer`: a small byte-level BPE ``tokenizer.json`` in the Qwen2 style
  (pre-tokenizer regex, ByteLevel, ``<|im_start|>``/``<|im_end|>`` chat template) in which the
  Search-R1 tags are several tokens each, as in the real Qwen2.5 and Llama 3 tokenizers.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gigrl import tags
from gigrl.models import PRESETS, Transformer
from gigrl.search.base import Passage


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
