"""Setup of a run from its config: data, model on the mesh, optimizers, jitted steps, engine.

Each builder is a function of the config (and of what earlier builders returned), so the
trainer, the evaluation command and the tests assemble exactly the pieces they need:

  data = load_data(cfg, workdir)            questions (train / held-out eval), tokenizer
  policy = build_policy(cfg, vocab_size)    ModelConfig, mesh, graphdef, params + shardings
  steps = build_steps(cfg, policy)          SFT / RL optimizers and jitted train steps
  engine = build_engine(cfg, policy, tokenizer, retriever)

The train steps are lowered and run inside ``jax.set_mesh(mesh)``, so activations are
batch-sharded over the mesh's ``('data', 'fsdp')`` axes (``gigrl.models.transformer.
constrain_batch``); :func:`check_rows_fit_mesh` refuses row counts that the mesh does not divide.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gigrl import advantages as adv_lib
from gigrl import distributed
from gigrl.update import loss as loss_lib
from gigrl import models
from gigrl.update import step as update_lib
from gigrl.config_utils import ConfigError, get_field
from gigrl.data import pool as pool_lib
from gigrl.data import qa
from gigrl.data import tfds_qa
from gigrl.data import tokenizer as tok_lib
from gigrl.models import lora as lora_lib
from gigrl.models import sharding as sharding_lib
from gigrl.rollout import engine as engine_lib
from gigrl.rollout import demos as demos_lib
from gigrl.rollout import hosts
from gigrl.rollout import trajectory as traj_lib
from gigrl.rollout import turns as turns_lib


# ------------------------------------------------------------------------------------ data
@dataclasses.dataclass
class Data:
  """Questions and tokenizer of a run.

  Attributes:
    train: training questions, sorted by (data_source, id).
    eval: held-out questions (the fixed eval split), sorted the same way.
    tokenizer: the run's tokenizer (``data.tokenizer``).
  """
  train: list[qa.Question]
  eval: list[qa.Question]
  tokenizer: Any


def load_data(cfg: ml_collections.ConfigDict, workdir: str | epath.PathLike) -> Data:
  """Loads the ``data`` section's questions (TFDS split) and tokenizer.

  Raises:
    ConfigError: an unknown name in ``data.train_sources``; no training question left; a
      question in both the train and the eval split (a leak); a ``rollout`` token budget this
      tokenizer's texts do not fit (:func:`gigrl.rollout.turns.check_settings`).
  """
  d = cfg.data
  tokenizer = tok_lib.load(d.tokenizer)
  turns_lib.check_settings(tokenizer, rollout_settings(cfg))   # budgets vs this tokenizer
  tfds_dir = d.tfds_dir or str(epath.Path(workdir) / "tfds")
  files = [d.questions_file] if d.questions_file else None
  # Process 0 builds the TFDS dataset; the others wait, then open the finished build (two
  # processes preparing one directory at once race on its files).
  if distributed.is_main():
    builder = tfds_qa.build(tfds_dir, files, d.eval_percent)
  distributed.barrier("gigrl_tfds_build")
  if not distributed.is_main():
    builder = tfds_qa.build(tfds_dir, files, d.eval_percent)
  train = tfds_qa.read_split(builder, "train")
  if not d.questions_file:
    sources = [s.strip() for s in d.train_sources.split(",") if s.strip()]
    known = sorted({q.data_source for q in train})
    unknown = [s for s in sources if s not in known]
    if unknown:
      raise ConfigError("data.train_sources", d.train_sources,
                        f"bundled training sets among {', '.join(known)} "
                        f"(unknown: {', '.join(unknown)})")
    train = [q for q in train if q.data_source in set(sources)]
  # TFDS shuffles rows by key hash at build time; sort for a readable, stable order.
  train.sort(key=lambda q: (q.data_source, q.id))
  limit = int(cfg.rollout.max_prompt_tokens)
  train = drop_overlong_prompts(train, tokenizer, limit, "training")
  if d.max_train_questions:
    train = train[:d.max_train_questions]
  field = "data.questions_file" if d.questions_file else "data.train_sources"
  if not train:
    raise ConfigError(field, d.questions_file or d.train_sources,
                      "a set with training questions (check data.eval_percent, "
                      "rollout.max_prompt_tokens and "
                      "data.max_train_questions)")
  held_out = tfds_qa.read_split(builder, "eval")
  if not d.questions_file:   # the held-out rows of the trained sets, plus the eval-only sets
    keep = set(sources) | set(qa.EVAL_ONLY_SOURCES)
    held_out = [q for q in held_out if q.data_source in keep]
  held_out.sort(key=lambda q: (q.data_source, q.id))
  held_out = drop_overlong_prompts(held_out, tokenizer, limit, "held-out")
  check_no_leak(train, held_out, field, d.questions_file or d.train_sources)
  return Data(train=train, eval=held_out, tokenizer=tokenizer)


def rl_questions(t, train: list, seed: int = 0) -> list:
  """The questions RL samples: all training questions, or (``train.rl_skip_sft_questions``)
  those after the first ``train.sft_questions``, which the warm-start never demonstrated; then,
  with ``train.rl_pool_size = n``, a random n of them (numpy PCG64 seeded with ``seed``, kept
  in their order), a pool small enough to run out.

  Raises:
    ConfigError: naming ``train.rl_skip_sft_questions`` when that leaves no question, or
      ``train.rl_pool_size`` when it exceeds the questions there are.
  """
  rest = train
  if t.rl_skip_sft_questions:
    rest = train[int(t.sft_questions):]
    if not rest:
      raise ConfigError(
          "train.rl_skip_sft_questions", True,
          f"False, or train.sft_questions ({t.sft_questions}) below the {len(train)} training "
          "questions: no question is left for RL")
  n = int(t.get("rl_pool_size", 0))
  if not n:
    return rest
  if n > len(rest):
    raise ConfigError("train.rl_pool_size", n,
                      f"at most the {len(rest)} questions RL samples from (0 = all)")
  keep = np.sort(np.random.default_rng(seed).choice(len(rest), n, replace=False))
  return [rest[int(i)] for i in keep]


def drop_overlong_prompts(questions: Sequence[qa.Question], tokenizer, max_prompt_tokens: int,
                          split: str) -> list[qa.Question]:
  """Drops the questions whose Search-R1 prompt has more than ``max_prompt_tokens`` tokens.

  As verl's ``data.filter_overlong_prompts=True``: a rollout cannot start from a prompt that
  does not fit its prompt budget, so such questions never reach the engine (which would raise
  mid-run). The number dropped is printed once (process 0) naming ``rollout.max_prompt_tokens``.
  """
  kept = [q for q in questions
          if len(turns_lib.prompt_ids(tokenizer, q.question)) <= max_prompt_tokens]
  if len(kept) < len(questions) and distributed.is_main():
    print(f"[gigrl] data: dropped {len(questions) - len(kept)} of {len(questions)} {split} "
          f"questions whose prompt exceeds rollout.max_prompt_tokens={max_prompt_tokens}",
          file=sys.stderr)
  return kept


def check_no_leak(train: Sequence[qa.Question], held_out: Sequence[qa.Question], field: str,
                  value: Any) -> None:
  """Raises ConfigError (naming ``field``) when a normalised question is in both splits."""
  overlap = ({qa.normalize_answer(q.question) for q in train}
             & {qa.normalize_answer(q.question) for q in held_out})
  if overlap:
    raise ConfigError(field, value,
                      f"train and eval questions that differ; {len(overlap)} are in both "
                      f"splits, e.g. {sorted(overlap)[:3]} (deduplicate the questions)")


# ---------------------------------------------------------------------------------- policy
@dataclasses.dataclass
class Policy:
  """The policy on the training mesh.

  Attributes:
    model_cfg: the ``ModelConfig``; graphdef: its ``nnx.GraphDef``.
    mesh: the ``('data', 'fsdp', 'tp')`` mesh of ``model.mesh``.
    params: ``nnx.State`` in the ``model.train_sharding`` layout; param_sh: its shardings.
    train_preset, rollout_preset: ``model.train_sharding`` / ``model.rollout_sharding``.
    lora: ``model.lora`` (:class:`gigrl.models.lora.LoraSettings`); when enabled the params
      hold the adapters beside the frozen base, and only the adapters are trained.
    rollout_mesh: with ``rollout.devices = n``, the mesh of the first n devices, where the
      rollouts and evaluations run (the training mesh then holds the rest); else None (the
      training mesh: :attr:`sampler_mesh`).
  """
  model_cfg: Any
  graphdef: Any
  mesh: jax.sharding.Mesh
  params: Any
  param_sh: Any
  train_preset: str
  rollout_preset: str
  lora: Any = lora_lib.LoraSettings()
  rollout_mesh: jax.sharding.Mesh | None = None    # rollout.devices: the sampler's own devices
  # whether the training layout already is the rollout's (decided on first use)
  _rollout_layout_is_train: bool | None = dataclasses.field(default=None, repr=False)

  def trained(self, params: Any) -> Any:
    """The part of ``params`` the optimizer updates (the adapters with LoRA, else all)."""
    return lora_lib.split_trainable(params, self.lora.enabled)[0]

  @property
  def sampler_mesh(self) -> jax.sharding.Mesh:
    """The mesh rollouts run on: ``rollout_mesh``, or the training mesh."""
    return self.rollout_mesh or self.mesh

  def rollout_params(self, params: Any) -> Any:
    """``params`` in the rollout layout (``model.rollout_sharding``): ``params`` themselves
    when they already lie that way (one device, or the same layout for both), else a copy;
    with a ``rollout_mesh`` always a copy onto it (``jax.device_put`` across the meshes).

    The rollout programs never donate their params, so sharing the training arrays is safe;
    the copy (every weight, each RL step and evaluation) cost 0.27 s a step for SmolLM2 on
    2 CPU cores, 15% of a 2 x 4-row rollout."""
    if self.rollout_mesh is not None:   # other devices: a transfer (a jit cannot span meshes)
      return jax.device_put(params, sharding_lib.param_shardings(params, self.rollout_mesh,
                                                                 self.rollout_preset))
    if self._rollout_layout_is_train is None:
      want = jax.tree.leaves(sharding_lib.param_shardings(params, self.mesh,
                                                          self.rollout_preset))
      self._rollout_layout_is_train = all(
          x.sharding.is_equivalent_to(w, x.ndim) for x, w in zip(jax.tree.leaves(params), want))
    if self._rollout_layout_is_train:
      return params
    return sharding_lib.shard_state(params, self.mesh, self.rollout_preset)

  def describe(self) -> str:
    """One line: size, shape, dtype and layout."""
    c = self.model_cfg
    n = sum(x.size for x in jax.tree.leaves(self.params))
    line = (f"{n / 1e6:.2f}M params (L={c.num_layers}, D={c.hidden_size}, "
            f"heads {c.num_heads}/{c.num_kv_heads}, vocab {c.vocab_size}, {c.dtype}) on mesh "
            f"{dict(self.mesh.shape)}, {self.train_preset} for training")
    if self.lora.enabled:
      k = sum(x.size for x in jax.tree.leaves(self.trained(self.params)))
      line += f"; {self.lora.describe()}: {k / 1e6:.3f}M trained ({100 * k / n:.2f}%)"
    return line


def build_policy(cfg: ml_collections.ConfigDict, vocab_size: int, tokenizer: Any = None
                 ) -> Policy:
  """Builds (or loads from ``model.hf_path``) the policy straight onto the training mesh.

  Raises:
    ConfigError: with ``model.hf_path``, a ``tokenizer`` (when given) that is not the
      checkpoint's own (``models.check_tokenizer``, naming ``data.tokenizer``).
  """
  m = cfg.model
  model_cfg = models.model_config_from(m, vocab_size)
  mesh, rollout_mesh = meshes(cfg)
  if m.hf_path:   # each tensor goes straight to its shard (no full host copy)
    if tokenizer is not None:
      models.check_tokenizer(m.hf_path, tokenizer)
    # model_cfg already holds config.json with every `model.*` override applied.
    model, model_cfg = models.from_hf(m.hf_path, mesh=mesh, preset=m.train_sharding,
                                      config=model_cfg)
  else:
    model = models.Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed))
  lora = lora_lib.settings_from_config(m)
  if lora.enabled:   # adapters beside the loaded base; B = 0, so this is still the base
    lora_lib.add_adapters(model, lora, rngs=nnx.Rngs(params=cfg.seed + 1))
  graphdef, params = nnx.split(model)
  param_sh = sharding_lib.param_shardings(params, mesh, m.train_sharding)
  params = sharding_lib.shard_state(params, mesh, m.train_sharding)
  return Policy(model_cfg=model_cfg, graphdef=graphdef, mesh=mesh, params=params,
                param_sh=param_sh, train_preset=m.train_sharding,
                rollout_preset=m.rollout_sharding, lora=lora, rollout_mesh=rollout_mesh)


def meshes(cfg: ml_collections.ConfigDict) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
  """(training mesh, rollout mesh or None): ``rollout.devices = n`` puts the rollouts on this
  process's first n devices (all on ``fsdp``) and ``model.mesh`` on the rest; 0 = one mesh.

  Raises:
    ConfigError: naming ``rollout.devices`` when it leaves no device to train on, or on several
      processes (the split is within one process).
  """
  n = int(cfg.rollout.get("devices", 0))
  if not n:
    return sharding_lib.mesh_from_config(cfg.model), None
  devices = jax.devices()
  if jax.process_count() > 1 or n >= len(devices):
    raise ConfigError("rollout.devices", n, f"0, or fewer than this process's {len(devices)} "
                      "devices on one process (the rest train)")
  return (sharding_lib.mesh_from_config(cfg.model, devices[n:]),
          sharding_lib.make_mesh({"fsdp": -1}, devices[:n]))


def batch_axis_size(mesh: jax.sharding.Mesh) -> int:
  """Devices the batch dimension is split over (``data`` × ``fsdp``)."""
  return int(np.prod([mesh.shape[a] for a in sharding_lib.BATCH]))


def check_rows_fit_mesh(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
  """The trained rows of every step split evenly over the batch axes.

  Raises:
    ConfigError: ``data.prompts_per_step`` × ``data.group_size`` (RL) or
      ``train.sft_batch_size`` (SFT) is not a multiple of the mesh's data × fsdp size.
  """
  n = batch_axis_size(mesh)
  shape = dict(mesh.shape)
  p, g = int(cfg.data.prompts_per_step), int(cfg.data.group_size)
  if cfg.train.num_steps and (p * g) % n:
    raise ConfigError("data.prompts_per_step", p,
                      f"data.prompts_per_step × data.group_size (= {p} × {g} = {p * g} rows "
                      f"per RL step) divisible by the mesh's data × fsdp = {n} (mesh "
                      f"{shape}); change either field or model.mesh")
  mini, micro = ppo_rows(cfg)
  for field, rows in (("train.ppo_mini_batch_size", mini), ("train.micro_batch_size", micro)):
    if cfg.train.num_steps and rows % n:
      raise ConfigError(field, get_field(cfg, field),
                        f"a value whose rows ({rows}) are divisible by the mesh's data × fsdp "
                        f"= {n} (mesh {shape})")
  if cfg.train.sft_steps and int(cfg.train.sft_batch_size) % n:
    raise ConfigError("train.sft_batch_size", int(cfg.train.sft_batch_size),
                      f"a multiple of the mesh's data × fsdp = {n} (mesh {shape})")
  sft_micro = int(cfg.train.get("sft_micro_batch_size", 0))
  if cfg.train.sft_steps and sft_micro and sft_micro % n:
    raise ConfigError("train.sft_micro_batch_size", sft_micro,
                      f"a multiple of the mesh's data × fsdp = {n} (mesh {shape})")


def sft_micro_batches(t) -> int:
  """Gradient micro-batches of an SFT step: ``train.sft_batch_size`` /
  ``train.sft_micro_batch_size`` (0 = one, the whole batch)."""
  micro = int(t.get("sft_micro_batch_size", 0))
  return int(t.sft_batch_size) // micro if micro else 1


def ppo_rows(cfg: ml_collections.ConfigDict) -> tuple[int, int]:
  """(rows per PPO mini-batch, rows per gradient micro-batch) of an RL step:
  ``train.ppo_mini_batch_size`` prompts × ``data.group_size`` (0 = all ``data.prompts_per_step``)
  and ``train.micro_batch_size`` rows (0 = the whole mini-batch)."""
  g = int(cfg.data.group_size)
  mini = (int(cfg.train.ppo_mini_batch_size) or int(cfg.data.prompts_per_step)) * g
  return mini, int(cfg.train.micro_batch_size) or mini


def pack_width(cfg: ml_collections.ConfigDict, seq_len: int) -> int:
  """The update's packing (:func:`gigrl.update.step.rl_update`'s ``pack``): the widest packed
  row (:func:`gigrl.update.step.packed_width_cap` of ``train.pack_max_width`` and the rollout's
  ``seq_len``) when ``train.pack_update_rows`` is on and the loss allows it
  (:func:`gigrl.update.step.packing_allowed`), else 0 (no packing). On several processes each
  packs the same global rows (the update's batch is the same on every process,
  :func:`put_global_rows`; :func:`gigrl.update.batch.pack_rows` is deterministic), so all
  choose the same W' and run one collective program (``tests/test_multihost.py``)."""
  lora_dropout = float(cfg.model.lora.dropout) if int(cfg.model.lora.rank) else 0.0
  if not (bool(cfg.train.pack_update_rows) and bool(cfg.train.trim_update_padding)
          and update_lib.packing_allowed(cfg.loss.loss_agg_mode, lora_dropout)):
    return 0
  return update_lib.packed_width_cap(int(cfg.train.get("pack_max_width", 0)), seq_len)


def put_rows(mesh: jax.sharding.Mesh, x: np.ndarray) -> jax.Array:
  """Process-local host rows -> a global array, rows over ``('data', 'fsdp')``.

  On one process the local rows are all rows. Rows must divide the batch axes
  (:func:`check_rows_fit_mesh`); there is no replicated fallback.
  """
  spec = P(sharding_lib.BATCH, *([None] * (x.ndim - 1)))
  return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(x))


def put_global_rows(mesh: jax.sharding.Mesh, x: np.ndarray) -> jax.Array:
  """Global host rows (the same ``x`` on every process) -> a global array, rows over
  ``('data', 'fsdp')``; each process copies only the rows of its own devices
  (``jax.make_array_from_callback``: no cross-process equality check, no full copy per chip).
  """
  x = np.asarray(x)
  spec = P(sharding_lib.BATCH, *([None] * (x.ndim - 1)))
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def replicated(mesh: jax.sharding.Mesh, tree: Any) -> Any:
  """Every array leaf of ``tree`` (host or single-device, the same on every process) as a
  global array replicated over ``mesh``: what orbax saves on several processes."""
  sh = NamedSharding(mesh, P())

  def put(x):
    x = np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
  return jax.tree.map(put, tree)


def local_copy(tree: Any) -> Any:
  """Inverse of :func:`replicated`: each (replicated) leaf as a host numpy array."""
  return jax.tree.map(
      lambda x: np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x), tree)


# ----------------------------------------------------------------------------------- steps
@dataclasses.dataclass
class Steps:
  """Optimizers and jitted train steps (each ``(params, opt_state, ...) -> (params,
  opt_state, metrics)``, params and optimizer state donated, run inside the mesh).

  Attributes:
    sft_tx, rl_tx: the SFT and RL optimizers (one state structure).
    opt_sh: shardings of the optimizer state.
    sft_step: ``(params, opt_state, tokens, loss_mask)``.
    rl_step: ``(params, opt_state, ref_params, tokens, loss_mask, token_advantages)``: one
      on-policy update (old log-probs = current).
    init_opt: ``(tx, params, lower=False) -> opt_state`` on ``opt_sh`` (``lower=True``: its
      program, traced and lowered, for the warm-up).
    ppo_step: ``(micro_batches, on_policy=False, packed=False) -> step(params, opt_state,
      ref_params, tokens, loss_mask, token_advantages, old_logprobs)`` (one mini-batch update,
      gradient accumulation; ``on_policy``: the step's only update, ``old_logprobs`` None;
      ``packed``: three more arguments, positions, segment and prefix ids of packed rows;
      :func:`gigrl.update.step.make_ppo_step`), compiled once per (count, on_policy, packed).
    logprob_step: ``(params, tokens, loss_mask) -> old log-probs f32[B, K]``.
    behaviour: the RL steps take the sampler's log-probs (f32[R, W], after
      ``token_advantages`` in ``rl_step``, after ``old_logprobs`` in ``ppo_step``): the
      off-policy correction is on (:func:`uses_behaviour`).
    skip_zero_advantage: a micro-batch whose loss tokens all have advantage 0 runs forward only
      in ``ppo_step`` (``train.skip_zero_advantage`` and
      :func:`gigrl.update.step.zero_advantage_adds_nothing`); the update orders such rows after
      the others.
  """
  sft_tx: optax.GradientTransformation
  rl_tx: optax.GradientTransformation
  opt_sh: Any
  sft_step: Callable
  rl_step: Callable
  init_opt: Callable
  ppo_step: Callable = None
  logprob_step: Callable = None
  behaviour: bool = False
  skip_zero_advantage: bool = False


def uses_behaviour(cfg: ml_collections.ConfigDict) -> bool:
  """Whether the RL update reads the rollout's behaviour log-probs: ``loss.off_policy_correction``
  is ``tis`` or ``decoupled`` (:func:`gigrl.update.loss.off_policy_weights`)."""
  return str(cfg.loss.get("off_policy_correction", "none")) != "none"


def in_mesh(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
  """``fn`` called (and so traced, lowered and run) inside ``jax.set_mesh(mesh)``."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.set_mesh(mesh):
      return fn(*args, **kwargs)
  return wrapped


def max_generated_tokens(cfg: ml_collections.ConfigDict) -> int:
  """Upper bound on a trajectory's generated tokens: (max_turns + 1) × max_new_tokens."""
  return (int(cfg.rollout.max_turns) + 1) * int(cfg.rollout.max_new_tokens)


def build_steps(cfg: ml_collections.ConfigDict, policy: Policy) -> Steps:
  """The SFT and RL optimizers and jitted steps (RL: :func:`gigrl.update.step.rl_loss`, i.e.
  :func:`gigrl.update.loss.ppo_loss` with the ``loss`` section's options)."""
  sft_tx = update_lib.optimizer_from_config(cfg.train, "sft")
  rl_tx = update_lib.optimizer_from_config(cfg.train, "rl",
                                           num_prompts=int(cfg.data.prompts_per_step))
  lora = policy.lora.enabled
  trained = policy.trained(policy.params)    # with LoRA the optimizer state is the adapters'
  opt_sh = sharding_lib.opt_state_shardings(jax.eval_shape(sft_tx.init, trained),
                                            trained, policy.mesh, policy.train_preset)
  ref_sh = None if lora else policy.param_sh   # LoRA: no reference params (adapters off)
  repl = NamedSharding(policy.mesh, P())
  out_sh = (policy.param_sh, opt_sh, repl)
  kw = dict(max_tokens=max_generated_tokens(cfg), chunk_size=int(cfg.model.logprob_chunk_size))
  sft_step = update_lib.make_step(
      update_lib.sft_loss_fn(policy.graphdef, **kw), sft_tx, lora=lora,
      in_shardings=(policy.param_sh, opt_sh, None, None), out_shardings=out_sh,
      micro_batches=sft_micro_batches(cfg.train))
  # RL log-probs are those of the tempered distribution the rollout samples from (verl).
  rl_kw = dict(kw, temperature=float(cfg.rollout.temperature))
  behaviour = uses_behaviour(cfg)
  skip_zero = bool(cfg.train.skip_zero_advantage) and update_lib.zero_advantage_adds_nothing(
      loss_lib.kwargs_from_config(cfg.loss))
  rl_step = update_lib.make_step(
      update_lib.rl_loss_fn(policy.graphdef, loss_options=loss_lib.kwargs_from_config(cfg.loss),
                            **rl_kw), rl_tx, lora=lora,
      in_shardings=(policy.param_sh, opt_sh, ref_sh, None, None, None) + (None,) * behaviour,
      out_shardings=out_sh)

  inits = {}      # one jitted init per optimizer (compiled once; the warm-up lowers it)

  def init_opt(tx, params, lower: bool = False):
    if id(tx) not in inits:
      inits[id(tx)] = jax.jit(tx.init, out_shardings=opt_sh)
    with jax.set_mesh(policy.mesh):
      fn = inits[id(tx)]
      return (fn.lower if lower else fn)(policy.trained(params))

  @functools.lru_cache(maxsize=None)
  def ppo_step(micro_batches: int, on_policy: bool = False, packed: bool = False):
    return in_mesh(update_lib.make_ppo_step(
        policy.graphdef, rl_tx, micro_batches=micro_batches, on_policy=on_policy, lora=lora,
        loss_options=loss_lib.kwargs_from_config(cfg.loss), packed=packed, behaviour=behaviour,
        skip_zero_advantage=skip_zero,
        in_shardings=(policy.param_sh, opt_sh, ref_sh)
        + (None,) * (4 + behaviour + (3 if packed else 0)),
        out_shardings=out_sh, **rl_kw), policy.mesh)

  logprob_step = in_mesh(jax.jit(update_lib.logprob_fn(policy.graphdef, **rl_kw),
                                 in_shardings=(policy.param_sh, None, None)), policy.mesh)
  return Steps(sft_tx=sft_tx, rl_tx=rl_tx, opt_sh=opt_sh,
               sft_step=in_mesh(sft_step, policy.mesh), rl_step=in_mesh(rl_step, policy.mesh),
               init_opt=init_opt, ppo_step=ppo_step, logprob_step=logprob_step,
               behaviour=behaviour, skip_zero_advantage=skip_zero)


# ------------------------------------------------------------------------------ advantages
def build_advantages(cfg: ml_collections.ConfigDict):
  """(AdvantageConfig, jitted ``fn(inputs, state) -> (adv, state, metrics)``, initial state)."""
  adv_cfg = adv_lib.AdvantageConfig.from_config(cfg.advantage)
  fn = jax.jit(functools.partial(adv_lib.compute_advantages, adv_cfg))
  return adv_cfg, fn, adv_lib.init_state(adv_cfg)


# ---------------------------------------------------------------------------------- engine
def rollout_settings(cfg: ml_collections.ConfigDict, *, greedy: bool | None = None
                     ) -> engine_lib.RolloutSettings:
  """The ``rollout`` section as engine settings (``greedy`` overrides ``rollout.greedy``)."""
  s = engine_lib.settings_from_config(cfg.rollout, cfg.search.topk)
  return s if greedy is None else dataclasses.replace(s, greedy=bool(greedy))


def build_engine(cfg: ml_collections.ConfigDict, policy: Policy, tokenizer, retriever, *,
                 greedy: bool | None = None) -> engine_lib.RolloutEngine:
  """The ``rollout.engine`` engine on the policy's mesh (``greedy=True`` for evaluation); its
  prompt stats and distinct rows are set by :func:`gigrl.training.warmup.set_up_engines`."""
  return engine_lib.make_engine(cfg.rollout.engine, policy.model_cfg, policy.graphdef,
                                tokenizer, retriever, rollout_settings(cfg, greedy=greedy),
                                mesh=policy.sampler_mesh)


def rl_engine(cfg: ml_collections.ConfigDict, policy: Policy, tokenizer, retriever
              ) -> hosts.ProcessShare:
  """The RL rollout engine, each process rolling out its share of a step's rows
  (:class:`gigrl.rollout.hosts.ProcessShare` over :func:`build_engine`)."""
  return hosts.ProcessShare(build_engine(cfg, policy, tokenizer, retriever),
                            batch_axis_size(policy.sampler_mesh))


def query_pool(cfg: ml_collections.ConfigDict, num_questions: int) -> pool_lib.QueryPool:
  """The RL query pool over ``num_questions`` (:func:`rl_questions`) under ``data.pool``."""
  p = cfg.data.pool
  return pool_lib.QueryPool(num_questions, rule=p.rule, batch_size=cfg.data.prompts_per_step,
                            oversample=p.oversample, success_threshold=p.success_threshold,
                            seed=cfg.seed)


def sft_demonstrations(cfg: ml_collections.ConfigDict, train_questions, tokenizer, retriever,
                       settings, log: Callable[[str], None]):
  """The SFT demonstrations (:func:`gigrl.rollout.demos.build_demonstrations`) of the first
  ``train.sft_questions`` training questions (0: all), or with ``train.sft_on_rl_pool`` of the
  questions RL samples (:func:`rl_questions`), collated.

  Raises:
    ValueError: no demonstration is left (``train.sft_only_answer_in_obs`` filtered all).
  """
  t = cfg.train
  qs = train_questions[:t.sft_questions] if t.sft_questions else train_questions
  if t.get("sft_on_rl_pool", False):    # the questions RL samples (a matched SFT control)
    qs = rl_questions(t, train_questions, int(cfg.seed))
  builders = demos_lib.build_demonstrations(
      qs, tokenizer, retriever, settings, only_answer_in_obs=t.sft_only_answer_in_obs,
      counterfactuals=t.sft_counterfactuals, seed=cfg.seed)
  if not builders:
    raise ValueError("no SFT demonstrations (train.sft_only_answer_in_obs filtered all)")
  log(f"SFT: {len(builders)} demonstrations")
  return traj_lib.collate(builders, settings.seq_len, tokenizer.pad_id)
