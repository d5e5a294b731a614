"""The rollout's static shapes: a bounded set, known before the first step (issue #50).

Every jitted call compiles one program per static shape. The host loop's shapes therefore come
from a grid fixed by the settings, the rows per process and the prompts' lengths
(:class:`PromptStats`, measured once over every question a run can roll out), never from a
step's data:

* **rows** computed by a compacted call: a multiple of ``B / rollout.row_buckets`` (decode turns:
  ``rollout.decode_row_buckets``) and of the process's row shards, so a kind of call has at
  most that many row counts; all B rows is a call computing every row in place. On a mesh the
  rows are split into shards, one per device of its ('data', 'fsdp') axes, and a compacted
  call takes the same count from every shard (indices local to it: no row crosses a device);
* **prompt widths**: the shared prefix on one row a shard at exactly its length (the prompts' common
  head: system turn, instruction), then each distinct prompt's tail at the longest tail,
  rounded up to ``rollout.width_bucket`` (0: the whole ``max_prompt_tokens`` budget);
  observations at a half, three quarters or all of the longest one the corpus can give (at
  most the ``max_obs_tokens`` budget), each rounded up to ``width_bucket``;
* **slot spans** (the cache slots attention reads and copies touch): the most any row can
  have written by the end of the call, from the budgets: ``P + t·(N + O) + (k+1)·n`` for chunk
  ``k`` (of ``n`` steps) of decode turn ``t``, and ``P + T·(N + O)`` for every observation extend
  (P the longest prompt, N = ``max_new_tokens``, O the observation width), rounded up to
  ``rollout.slot_bucket`` (0: the whole cache).

:meth:`Grid.programs` lists every program the engine can execute; the engine's calls take their
shapes from the same methods, so a shape outside the list cannot be met (a test counts compiles
after warm-up). The spans are upper bounds of the slots written, so they never cut a row short;
they cost attention over slots a short turn did not write, as a bucket of the data's own maximum
did before (docs/results/rollout_efficiency/).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence


def round_up(x: int, m: int) -> int:
  """``x`` rounded up to a multiple of ``m`` (> 0)."""
  return -(-int(x) // int(m)) * int(m)


@dataclasses.dataclass(frozen=True)
class PromptStats:
  """What the prompts a run can roll out share.

  Attributes:
    max_len: tokens of the longest prompt.
    prefix: tokens every prompt starts with (their common prefix); at most ``min_len - 1``, so
      every prompt keeps one token of its own (its next-token logits come from it).
    obs_len: tokens of the longest observation the retriever can return (its corpus measured:
      :func:`gigrl.rollout.trajectory.observation_cap`), or None: the ``max_obs_tokens`` budget.
  """
  max_len: int
  prefix: int
  obs_len: int | None = None

  def covers(self, prompts: Sequence[Sequence[int]]) -> bool:
    """Whether ``prompts`` fit these stats (none longer, all sharing the first ``prefix``
    tokens of the first one, each with a token after them)."""
    if not prompts:
      return True
    head = list(prompts[0][:self.prefix])
    return all(len(p) <= self.max_len and len(p) > self.prefix and list(p[:self.prefix]) == head
               for p in prompts)

  def merge(self, other: "PromptStats") -> "PromptStats":
    """Stats covering both: the longer prompts, the shorter prefix (a batch only needs its
    own prompts to share the prefix: it is prefilled from the batch's first prompt)."""
    return PromptStats(max(self.max_len, other.max_len), min(self.prefix, other.prefix),
                       self.obs_len)


def prompt_stats(prompts: Sequence[Sequence[int]]) -> PromptStats:
  """:class:`PromptStats` of token-id prompts (at least one)."""
  if not prompts:
    raise ValueError("prompt_stats: no prompts")
  first = prompts[0]
  n = min(len(p) for p in prompts) - 1
  for p in prompts[1:]:
    k = 0
    while k < n and p[k] == first[k]:
      k += 1
    n = k
  return PromptStats(max(len(p) for p in prompts), max(0, n))


@dataclasses.dataclass(frozen=True, order=True)
class Program:
  """One static shape of a rollout call.

  Attributes:
    kind: ``prefill`` (an extend of prompt tokens), ``extend`` (observations), ``decode`` (a
      turn, or a chunk of one), ``copy_rows`` (KV rows copied to others).
    rows: rows computed (``copy_rows``: rows written), or 0 for all B rows uncompacted.
    width: tokens per row (``decode``: steps; ``copy_rows``: 0).
    span: cache slots the call reads and writes, 0 = all.
  """
  kind: str
  rows: int
  width: int
  span: int
  resume: bool = False   # decode: continues a turn (takes the previous chunk's stop window)

  def label(self) -> str:
    rows = self.rows or "all"
    span = self.span or "all"
    if self.kind == "copy_rows":
      return f"copy_rows[{rows} rows, {span} slots]"
    unit = "steps" if self.kind == "decode" else "tokens"
    more = ", resumed" if self.resume else ""
    return f"{self.kind}[{rows} rows x {self.width} {unit}, {span} slots{more}]"


class Grid:
  """The rollout's shapes for ``batch_rows`` rows per process (see the module docstring).

  Args:
    settings: :class:`gigrl.rollout.turns.RolloutSettings`.
    batch_rows: B, rows per process in every ``engine.run`` call.
    devices: the row shards of the process's rows (its devices on the mesh's ('data', 'fsdp')
      axes): row counts are multiples of it, and a compacted call's rows are ``devices``
      blocks of equal size, one a shard.
    stats: the prompts' :class:`PromptStats`.
    distinct_rows: the most distinct prompts a batch holds (a step's candidate prompts, whose
      G samples are the other rows); the prompt tails are prefilled on that many rows. None:
      any number (bucketed as other rows).
  """

  def __init__(self, settings, batch_rows: int, devices: int, stats: PromptStats,
               distinct_rows: int | None = None):
    self.s, self.b, self.d, self.stats = settings, int(batch_rows), max(1, int(devices)), stats
    self.distinct_rows = distinct_rows
    self.distinct = None if distinct_rows is None else self.d * self._distinct_per_shard(
        int(distinct_rows))

  def _distinct_per_shard(self, distinct: int) -> int:
    """The most distinct prompts one of the ``d`` row shards (``B / d`` contiguous rows) can
    hold: a prompt's rows are a contiguous group of ``B / distinct`` rows, and a shard holds
    each group it meets (its prompt is prefilled once per shard: copies stay on a device)."""
    m = self.b // self.d
    if self.d == 1:
      return min(self.b, distinct)
    if distinct <= 0 or self.b % distinct:
      return m
    g = self.b // distinct
    return min(m, max(-(-((j * m) % g + m) // g) for j in range(self.d)))

  # ---- axes -----------------------------------------------------------------------------
  def row_step(self, decode: bool = False) -> int:
    """The row quantum: B / row_buckets (``decode``: ``decode_row_buckets``, 0 = the same),
    rounded up to a multiple of the row shards."""
    k = max(1, int((decode and self.s.decode_row_buckets) or self.s.row_buckets))
    return self.d * max(1, -(-self.b // (k * self.d)))

  def rows(self, n: int, decode: bool = False) -> int:
    """Rows computed when ``n`` are needed: ``n`` rounded up to :meth:`row_step`, at most B."""
    q = self.row_step(decode)
    return min(self.b, max(q, round_up(n, q)))

  def tail_rows(self, n: int) -> int:
    """Rows the prompt tails of ``n`` distinct prompts are prefilled on: ``distinct_rows``
    when they fit, else :meth:`rows`."""
    return self.distinct if self.distinct is not None and n <= self.distinct else self.rows(n)

  def call_rows(self, r: int) -> int:
    """A compacted call's ``rows`` as its :class:`Program` has them: 0 (every row, computed in
    place) when ``r`` is all B."""
    return 0 if r >= self.b else r

  def row_choices(self, decode: bool = False) -> list[int]:
    q = self.row_step(decode)
    return sorted({min(self.b, q * i) for i in range(1, -(-self.b // q) + 1)})

  @property
  def s_max(self) -> int:
    """Cache slots per row (the trajectory budget plus one)."""
    return self.s.seq_len + 1

  def prompt_cap(self) -> int:
    """P: the prompt length the spans and widths assume."""
    return self.stats.max_len if self.s.width_bucket > 0 else self.s.max_prompt_tokens

  def prefix(self) -> int:
    """Tokens of the shared prefix prefilled once on one row (0: off)."""
    if not self.s.shared_prefix or self.stats.prefix <= 0:
      return 0
    return self.stats.prefix

  def tail_width(self) -> int:
    """Width of the prompt extend after the prefix (each distinct prompt's own tokens)."""
    cut = self.prefix()
    if self.s.width_bucket <= 0:
      return self.s.max_prompt_tokens - cut
    wb = self.s.width_bucket
    return min(self.s.max_prompt_tokens - cut, round_up(self.stats.max_len - cut, wb))

  def obs_cap(self) -> int:
    """O: the observation length the widths and spans assume: the longest observation the
    corpus can give (``stats.obs_len``) rounded up to ``width_bucket``, at most the
    ``max_obs_tokens`` budget (the budget itself when that is unknown or bucketing is off)."""
    o, wb = self.s.obs_width, self.s.width_bucket
    if wb <= 0 or self.stats.obs_len is None:
      return o
    return min(o, round_up(self.stats.obs_len, wb))

  def obs_widths(self) -> list[int]:
    """Observation extend widths: a half, three quarters and all of :meth:`obs_cap`, each
    rounded up to ``width_bucket`` (64, 96, 128 for a 128 cap; 256, 384, 500 for Search-R1's
    500), so a turn whose observations are short extends them at less than the longest the
    corpus can give, with at most three programs per row count; the cap alone with
    ``width_bucket`` 0."""
    o, wb = self.obs_cap(), self.s.width_bucket
    if wb <= 0:
      return [o]
    return sorted({min(o, round_up(-(-o * k // 4), wb)) for k in (2, 3, 4)})

  def obs_width(self, longest: int) -> int:
    """The narrowest of :meth:`obs_widths` that holds ``longest`` tokens."""
    return next(w for w in self.obs_widths() if w >= longest)

  def span(self, needed: int) -> int:
    """Slots a call that writes up to slot ``needed`` reads: rounded up to ``slot_bucket``;
    0 = the whole cache (bucketing off, or the bound reaches it)."""
    sb = self.s.slot_bucket
    if sb <= 0:
      return 0
    span = round_up(max(int(needed), 1), sb)
    return 0 if span >= self.s_max else span

  def turn_calls(self) -> list[tuple[int, int]]:
    """(first step, steps) of each decode call of a turn: chunks of ``decode_chunk`` steps
    (with ``compact_rows``; a start-up check refuses chunks without it), else one call."""
    n = self.s.max_new_tokens
    c = min(n, self.s.decode_chunk) if self.s.decode_chunk > 0 and self.s.compact_rows else n
    return [(k, min(c, n - k)) for k in range(0, n, c)]

  def decode_span(self, turn: int, step0: int, steps: int) -> int:
    s, p = self.s, self.prompt_cap()
    return self.span(p + turn * (s.max_new_tokens + self.obs_cap()) + step0 + steps)

  def obs_span(self) -> int:
    """One span for every observation extend: the bound after the last one,
    ``P + T·(N + O)`` (an extend's attention is a small part of its cost, so per-turn spans
    would buy little for twice the programs)."""
    s, p = self.s, self.prompt_cap()
    return self.span(p + s.max_turns * (s.max_new_tokens + self.obs_cap()))

  def prompt_span(self) -> int:
    return self.span(self.prompt_cap())

  # ---- the programs ---------------------------------------------------------------------
  def programs(self) -> list[Program]:
    """Every program a rollout of B rows can execute (with ``distinct_rows`` below B, a batch
    can hold a prompt more than once, so its KV rows are copied)."""
    s, out = self.s, []
    cut = self.prefix()
    grouped = s.prefill_once_per_group
    compact = s.compact_rows or grouped or s.shared_prefix
    if cut:   # one row per row shard
      out.append(Program("prefill", self.call_rows(self.d), cut, self.span(cut)))
      out.append(Program("copy_rows", self.b, 0, self.span(cut)))
    if grouped and self.distinct is not None:
      tails = [self.distinct]
    else:
      tails = sorted({self.rows(n) for n in range(1, self.b + 1)})
    for r in tails if compact else [0]:
      out.append(Program("prefill", self.call_rows(r), self.tail_width(), self.prompt_span()))
    if grouped and (self.distinct_rows is None or self.distinct_rows < self.b):
      out.append(Program("copy_rows", self.b, 0, self.prompt_span()))
    live = self.row_choices() if s.compact_rows else [0]
    for turn in range(s.max_turns + 1):
      for step0, n in self.turn_calls():
        for r in self.row_choices(decode=True) if s.compact_rows else [0]:
          out.append(Program("decode", self.call_rows(r), n, self.decode_span(turn, step0, n),
                             step0 > 0))
    for r in live:
      for w in self.obs_widths() if s.max_turns else []:
        out.append(Program("extend", self.call_rows(r), w, self.obs_span()))
    return sorted(set(out), key=out.index)
