"""Small deterministic stand-ins shared by the tests and the benchmarks.

* :class:`FakeRetriever`: a thread-safe retriever whose passages name the query;
* :func:`chatty_model`: a tiny random policy whose greedy output uses the Search-R1 tags, so a
  rollout with it searches, answers and ends turns at different steps.
"""
from __future__ import annotations

import threading
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gigrl.models import PRESETS, Transformer
from gigrl.search.base import Passage


class FakeRetriever:
  """Deterministic, thread-safe: ``topk`` passages ``'"T{i}"\\nabout {query} number {i}'``.

  ``calls`` records every batch of queries, in call order.
  """

  def __init__(self):
    self.calls, self._lock = [], threading.Lock()

  def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
    with self._lock:
      self.calls.append(list(queries))
    return [[Passage(f"{q}-{i}", f'"T{i}"\nabout {q} number {i}', 1.0) for i in range(topk)]
            for q in queries]


def chatty_model(tok, seed: int = 0, search_bias: float = 1.0):
  """(cfg, graphdef, state): tiny random model whose greedy output uses the protocol tags.

  The LM head keeps only the tag columns and a few common words (scaled ×10), and the layer
  weights are scaled ×5 so the output depends on the context. ``search_bias`` further scales the
  ``<search>`` / ``</search>`` columns (more searches).
  """
  cfg = PRESETS["tiny"].replace(vocab_size=tok.vocab_size, hidden_size=64,
                                intermediate_size=128, head_dim=16, tie_embeddings=False)
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  keep = [tok.token_id(t) for t in ("<search>", "</search>", "<answer>", "</answer>",
                                    "<think>")] + [tok.eos_id]
  keep += [i for w in (" paris", " river", " john", " the", " king", " born", " city", " war")
           for i in tok.encode(w)]
  cols = np.zeros((cfg.vocab_size,), bool)
  cols[keep] = True
  head = np.where(cols[None], np.asarray(model.lm_head[...]) * 10, 0)
  for tag in ("<search>", "</search>"):
    head[:, tok.token_id(tag)] *= search_bias
  model.lm_head[...] = jnp.asarray(head, jnp.float32)
  for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
    p = getattr(model.layers, name)
    p[...] = p[...] * 5
  graphdef, state = nnx.split(model)
  return cfg, graphdef, state
