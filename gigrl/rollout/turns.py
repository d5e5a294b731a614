"""The rollout core's shared pieces: settings, prompts, stop sequences and the turn dispatch.

Protocol: Search-R1 ``search_r1/llm_agent/generation.py``: ``max_turns`` turns with search, then
one final turn in which a search gets no observation.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from gigrl.data import tags
from gigrl.config_utils import ConfigError
from gigrl.rollout import protocol
from gigrl.rollout.trajectory import (TrajectoryBuilder, invalid_observation_ids,
                                     search_observations)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """Python-valued rollout options (from the ``rollout`` config section)."""
  max_turns: int = 4
  max_new_tokens: int = 64        # per turn
  max_obs_tokens: int = 128
  max_prompt_tokens: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  topk_docs: int = 3
  # What is computed (config ``rollout.*``; the trajectories do not depend on them):
  prefill_once_per_group: bool = True
  shared_prefix: bool = True
  compact_rows: bool = True
  slot_bucket: int = 16
  width_bucket: int = 32
  decode_chunk: int = 0
  row_buckets: int = 2
  decode_row_buckets: int = 0     # decode turns' row counts; 0 = row_buckets

  @property
  def obs_width(self) -> int:
    return self.max_obs_tokens

  def all_off(self) -> "RolloutSettings":
    """These settings with every saving off: today's full-width, full-batch computation."""
    return dataclasses.replace(self, prefill_once_per_group=False, shared_prefix=False,
                               compact_rows=False, slot_bucket=0, width_bucket=0,
                               decode_chunk=0)

  @property
  def seq_len(self) -> int:
    """Tokens a trajectory can hold: prompt + (turns+1) generations + turns observations."""
    return (self.max_prompt_tokens + (self.max_turns + 1) * self.max_new_tokens
            + self.max_turns * self.obs_width)


def settings_from_config(cfg_rollout: Any, topk_docs: int) -> RolloutSettings:
  """The ``rollout`` config section (and ``search.topk``) as :class:`RolloutSettings`."""
  return RolloutSettings(
      max_turns=int(cfg_rollout.max_turns), max_new_tokens=int(cfg_rollout.max_new_tokens),
      max_obs_tokens=int(cfg_rollout.max_obs_tokens),
      max_prompt_tokens=int(cfg_rollout.max_prompt_tokens),
      temperature=float(cfg_rollout.temperature), top_p=float(cfg_rollout.top_p),
      top_k=int(cfg_rollout.top_k), greedy=bool(cfg_rollout.greedy), topk_docs=int(topk_docs),
      prefill_once_per_group=bool(cfg_rollout.get("prefill_once_per_group", True)),
      shared_prefix=bool(cfg_rollout.get("shared_prefix", True)),
      compact_rows=bool(cfg_rollout.get("compact_rows", True)),
      slot_bucket=int(cfg_rollout.get("slot_bucket", 16)),
      width_bucket=int(cfg_rollout.get("width_bucket", 32)),
      decode_chunk=int(cfg_rollout.get("decode_chunk", 0)),
      row_buckets=int(cfg_rollout.get("row_buckets", 2)),
      decode_row_buckets=int(cfg_rollout.get("decode_row_buckets", 0)))


# Left and right contexts in which a stop tag is encoded: a byte-level BPE (Qwen2, Llama 3)
# merges a tag's first or last bytes with its neighbours (" </", "?</", ">\n"), so the tag's
# tokens depend on them.
_LEFT_CONTEXTS = ("", " ", "  ", "\n", "a", "a ", " a", ".", "?", "!", ",", ")", "'", '"', ">",
                  "1")
_RIGHT_CONTEXTS = ("", "\n", "\n\n", " ", "a", ".")


def tag_token_variants(tokenizer, tag: str) -> list[list[int]]:
  """The token sequences with which a generation can end ``tag``, in the usual contexts.

  For each (left, right) context pair the text ``left + tag + right`` is encoded and the
  shortest token suffix whose text contains ``tag`` is kept. With the bundled sentencepiece
  model (tags are single pieces) this is ``[[id]]``; with a byte-level BPE it is several
  multi-token sequences (``['</', 'search', '>']``, ``[' </', 'search', '>']``, ...).

  Returns:
    Distinct token-id lists, shortest first. The first is ``tokenizer.encode(tag)``'s
    minimal form when that contains the tag.
  """
  out: list[list[int]] = []
  for left in _LEFT_CONTEXTS:
    for right in _RIGHT_CONTEXTS:
      ids = tokenizer.encode(left + tag + right)
      cut = None
      for k in range(len(ids) - 1, -1, -1):
        text = tokenizer.decode(ids[k:])
        if tag in text:
          cut = k
          break
      if cut is None:
        continue
      # Drop the tokens after the tag's end (the right context) when they stand alone.
      seq = ids[cut:]
      while len(seq) > 1 and tag in tokenizer.decode(seq[:-1]):
        seq = seq[:-1]
      if seq not in out:
        out.append(seq)
  return sorted(out, key=len)


def stop_sequences(tokenizer) -> np.ndarray:
  """i32[K, L]: the turn-ending token sequences, right-aligned and left-padded with -1.

  Every variant (:func:`tag_token_variants`) of ``</search>`` and ``</answer>``, and each EOS id
  (``tokenizer.eos_ids`` if it has them, else ``eos_id``). For the sampler's stop check
  (:func:`gigrl.models.sampler.stop_hit`). The tags are then parsed in the decoded text
  (:func:`gigrl.rollout.protocol.parse_action`), so a tag generated with other tokens than
  these still counts as an action; the turn just does not end at it.

  Raises:
    ValueError: a stop tag cannot be encoded so that its text round-trips.
  """
  seqs: list[list[int]] = []
  for tag in tags.ACTION_ENDS:
    variants = tag_token_variants(tokenizer, tag)
    if not variants:
      raise ValueError(f"stop tag {tag!r} does not round-trip through this tokenizer "
                       "(decode(encode(tag)) lacks the tag)")
    seqs += variants
  eos = getattr(tokenizer, "eos_ids", None) or [tokenizer.eos_id]
  seqs += [[int(i)] for i in eos]
  width = max(len(q) for q in seqs)
  return np.array([[-1] * (width - len(q)) + q for q in seqs], np.int32)


def check_settings(tokenizer, settings: RolloutSettings) -> None:
  """Start-up check that the rollout's token budgets fit this tokenizer's texts.

  Raises:
    ConfigError: naming ``rollout.max_obs_tokens`` when the invalid-action message does not fit
      one observation; ``rollout.max_new_tokens`` when a turn cannot hold a stop tag (the
      ``</search>`` / ``</answer>`` tokens); ``rollout.max_prompt_tokens`` when the prompt of an
      empty question (chat template and Search-R1 instruction alone) does not fit;
      ``rollout.decode_chunk`` > 0 without ``rollout.compact_rows`` (chunks save only by
      dropping the rows that ended, so the switch would be ignored).
  """
  if settings.decode_chunk and not settings.compact_rows:
    raise ConfigError("rollout.decode_chunk", settings.decode_chunk,
                      "0 when rollout.compact_rows is off (a turn decoded in chunks saves only by "
                      "dropping the rows that ended; without compaction it saves nothing)")
  n = len(invalid_observation_ids(tokenizer))
  if n > settings.max_obs_tokens:
    raise ConfigError("rollout.max_obs_tokens", settings.max_obs_tokens,
                      f"at least {n}: the invalid-action message is {n} tokens with this "
                      "tokenizer")
  for tag in tags.ACTION_ENDS:
    need = min((len(v) for v in tag_token_variants(tokenizer, tag)), default=0)
    if need >= settings.max_new_tokens:
      raise ConfigError("rollout.max_new_tokens", settings.max_new_tokens,
                        f"more than {need}: the stop tag {tag!r} is {need} tokens with this "
                        "tokenizer")
  n = len(prompt_ids(tokenizer, ""))
  if n >= settings.max_prompt_tokens:
    raise ConfigError("rollout.max_prompt_tokens", settings.max_prompt_tokens,
                      f"more than {n}: the chat template and instruction alone are {n} "
                      "tokens with this tokenizer")


def tag_tail_length(tokenizer, ids: Sequence[int], tag: str) -> int:
  """Number of final tokens of ``ids`` that hold ``tag`` (0 if the text does not end with it).

  Used to cap a demonstration turn to the rollout's token budget without cutting its end tag.
  """
  ids = list(ids)
  if not tokenizer.decode(ids).rstrip().endswith(tag):
    return 0
  for k in range(len(ids) - 1, -1, -1):
    if tag in tokenizer.decode(ids[k:]):
      return len(ids) - k
  return 0


def prompt_ids(tokenizer, question: str) -> list[int]:
  """The token ids of one question's Search-R1 prompt (chat template applied)."""
  return list(tokenizer.encode(tokenizer.apply_chat_template(protocol.make_prompt(question))))


def encode_prompts(tokenizer, questions: Sequence[str], max_prompt_tokens: int
                   ) -> list[list[int]]:
  """Search-R1 prompts (chat template applied), one token list per question.

  Raises:
    ValueError: a prompt is longer than ``max_prompt_tokens`` (names the question).
  """
  out = []
  for q in questions:
    ids = prompt_ids(tokenizer, q)
    if len(ids) > max_prompt_tokens:
      raise ValueError(f"prompt of question {q[:60]!r} has {len(ids)} tokens > "
                       f"rollout.max_prompt_tokens={max_prompt_tokens}")
    out.append(ids)
  return out


@dataclasses.dataclass
class TurnOutcome:
  """What :func:`dispatch_turn` decided for the rows whose turn ended.

  Attributes:
    observations: per ended row, the observation token ids to feed next ([] for none).
    done: per ended row, True if the trajectory is over (answered, or its final turn).
    queries: number of search queries sent to the retriever (0 or 1 batched call).
    search_s: wall seconds spent in the retriever call and observation tokenisation.
  """
  observations: list[list[int]]
  done: list[bool]
  queries: int = 0
  search_s: float = 0.0


def dispatch_turn(records: Sequence[TrajectoryBuilder], generations: Sequence[Sequence[int]], *,
                  tokenizer, retriever, settings: RolloutSettings,
                  invalid_ids: Sequence[int],
                  logprobs: Sequence[Sequence[float]] | None = None) -> TurnOutcome:
  """Records one ended turn per row and decides each row's next observation.

  For each row j (``records[j]`` gets the turn ``generations[j]``, whose index is the number of
  turns it already has), the generated text is parsed (:func:`protocol.parse_action`) and:

    * ``answer``: the trajectory ends (``answer_turn`` set);
    * the final turn (index ``settings.max_turns``): it ends, a search gets no observation;
    * ``search``: the query joins one batched retriever call; the observation is the
      retrieved passages (:func:`trajectory.observation_ids`);
    * invalid: the observation is Search-R1's invalid-action message.

  Observations are added to the records too. Search-R1 ``generation.py``
  (``execute_predictions``, ``_passages2string``).

  Args:
    records: one builder per ended row (host-side trajectory records).
    generations: the turn's generated token ids per row (stop tokens included).
    tokenizer, retriever: as for the engine.
    settings: rollout settings (``max_turns``, ``topk_docs``, ``max_obs_tokens``).
    invalid_ids: token ids of the invalid-action message.
    logprobs: the sampler's log-prob of each generated token per row (kept in the records as
      the behaviour log-probs), or None.
  Returns:
    TurnOutcome, aligned with ``records``.
  Raises:
    ValueError: the retriever returned a different number of result lists than queries.
  """
  n = len(records)
  obs: list[list[int]] = [[] for _ in range(n)]
  done = [False] * n
  queries, query_rows = [], []
  for j, (rec, ids) in enumerate(zip(records, generations)):
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids)
    turn = rec.add_generation(ids, text, None if logprobs is None else logprobs[j])
    kind, payload = protocol.parse_action(text)
    if kind == "answer":
      rec.answer_turn, done[j] = turn, True
    elif turn >= settings.max_turns:       # final turn: no more observations
      done[j] = True
    elif kind == "search":
      rec.search_calls += 1
      queries.append(payload)
      query_rows.append(j)
    else:
      obs[j] = list(invalid_ids)
      rec.add_observation(obs[j], anchor=protocol.INVALID_ACTION_MSG.strip())
  if not queries:
    return TurnOutcome(obs, done)
  t0 = time.perf_counter()
  found = search_observations(retriever, tokenizer, queries, settings.topk_docs,
                              settings.max_obs_tokens)
  for j, (ids, anchor) in zip(query_rows, found):
    obs[j] = ids
    records[j].add_observation(ids, anchor=anchor)
  return TurnOutcome(obs, done, len(queries), time.perf_counter() - t0)


# --------------------------------------------------------------------------- process-local rows


def pad_rows(rows: Sequence[Sequence[int]], n: int, width: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists into (i32[n, width], i32[n] lengths); rows past len(rows) are empty.

  Raises:
    ValueError: a row is longer than ``width``.
  """
  toks = np.full((n, width), pad_id, np.int32)
  lens = np.zeros((n,), np.int32)
  for i, r in enumerate(rows):
    if len(r) > width:
      raise ValueError(f"row {i} has {len(r)} tokens > width {width}")
    toks[i, :len(r)], lens[i] = r, len(r)
  return toks, lens


def global_rows(local: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array whose rows on this process's devices are ``local`` (rows = dim 0).

  ``jax.make_array_from_process_local_data``: every process passes its own rows, in order.

  Raises:
    ValueError: on several processes, ``sharding`` does not split dim 0 over the processes
      (the rows would have to be equal on every process).
  """
  if jax.process_count() > 1 and sharding.is_fully_replicated:
    raise ValueError(f"rollout rows {local.shape[0]} per process cannot be split over the mesh "
                     f"{sharding}; make the rows per process divisible by the local devices "
                     "on the mesh's ('data', 'fsdp') axes")
  return jax.make_array_from_process_local_data(sharding, local)


def local_rows(x: jax.Array | np.ndarray) -> np.ndarray:
  """The rows (dim 0) of ``x`` held by this process's devices, in global order (numpy).

  On one process this is ``np.asarray(x)``. On several, only addressable shards are read
  (``np.asarray`` of an array spanning other hosts' devices raises); replicas are read once.
  """
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  parts: dict[int, jax.Array] = {}
  for shard in x.addressable_shards:
    parts.setdefault(shard.index[0].start or 0, shard.data)
  return np.concatenate([np.asarray(parts[k]) for k in sorted(parts)], axis=0)
