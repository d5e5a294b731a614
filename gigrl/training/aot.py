r"""Prove the TPU programs of a config fit, without a TPU: the library behind ``gigrl-compile``
(:func:`compile_programs`).

Usage::

  gigrl-compile --config configs/smoke.py --topology v5e-16 [--config.<section>.<field>=value ...]

Compiles ahead of time, for the named TPU topology, every program a run executes: the SFT
step, the RL step, and the rollout programs (prefill, decode, observation extend), at the
config's real batch and lengths and with the run's shardings (``model.mesh``,
``model.train_sharding``, ``model.rollout_sharding``), lowered inside ``jax.set_mesh`` as
the trainer runs them. It prints, per program, the per-device bytes (arguments,
temporaries, outputs) against the chip's HBM, the FLOPs and a roofline step-time
estimate, and exits 1 naming every program that does not fit (0 when all fit).

Mechanism (MaxText ``train_compile.py``, axlearn ``run_aot_compilation.py``): with libtpu
installed (``pip install -e .[tpu]``),
``jax.experimental.topologies.get_topology_desc`` describes the slice's devices and
``jax.jit(f, in_shardings=...).lower(<ShapeDtypeStructs>).compile()`` compiles for them
on a CPU host; ``memory_analysis()`` and ``cost_analysis()`` read the result. The model
is built with ``backend="accelerator"`` and ``attention`` resolved for TPU (the splash
kernel unless ``model.attention=xla``).

Topology names: ``v5e-16`` (Cloud accelerator type: v5e / v6e count chips, v5p counts
TensorCores, 2 per chip) or ``v5e:4x4`` (chip grid).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any, Sequence

import numpy as np

GiB = 1 << 30

# Per chip (one JAX device): HBM bytes, peak dense bf16 FLOP/s, HBM bytes/s.
# Sources: Cloud TPU documentation, "TPU v5e" / "TPU v5p" / "TPU v6e" system architecture
# pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e), chip specification tables.
CHIPS: dict[str, dict[str, Any]] = {
    "v5e": dict(hbm=16 * GiB, flops=197e12, hbm_bw=819e9,
                source="cloud.google.com/tpu/docs/v5e (16 GiB HBM2, 197 TFLOP/s bf16, "
                       "819 GB/s)"),
    "v5p": dict(hbm=96 * GiB, flops=459e12, hbm_bw=2765e9,
                source="cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 459 TFLOP/s bf16, "
                       "2765 GB/s; libtpu reports 95.74 GiB usable)"),
    "v6e": dict(hbm=32 * GiB, flops=918e12, hbm_bw=1640e9,
                source="cloud.google.com/tpu/docs/v6e (32 GiB HBM, 918 TFLOP/s bf16, "
                       "1640 GB/s)"),
}
# Cloud accelerator type -> chip grid (v5e / v6e: N chips; v5p: N TensorCores = N/2 chips).
_GRIDS = {
    "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
            256: "16x16"},
    "v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
            256: "16x16"},
    "v5p": {8: "2x2x1", 16: "2x2x2", 32: "2x4x2", 64: "4x4x2", 128: "4x4x4",
            256: "4x4x8", 512: "4x8x8"},
}
PROGRAMS = ("sft_step", "rl_step", "old_logprobs", "prefill", "decode", "obs_extend")


class CompileError(ValueError):
  """A bad --topology name (the message lists the accepted names)."""


def parse_topology(name: str) -> tuple[str, str]:
  """``'v5e-16'`` or ``'v5e:4x4'`` -> (chip generation, chip grid ``'4x4'``)."""
  name = name.strip().lower().replace("v5litepod", "v5e")
  if ":" in name:
    gen, grid = name.split(":", 1)
  elif "-" in name:
    gen, n = name.split("-", 1)
    if gen not in _GRIDS or not n.isdigit() or int(n) not in _GRIDS[gen]:
      raise CompileError(f"--topology {name}: unknown accelerator type; one of "
                         + ", ".join(f"{g}-{k}" for g in _GRIDS for k in _GRIDS[g]))
    grid = _GRIDS[gen][int(n)]
  else:
    raise CompileError(f"--topology {name}: expected e.g. v5e-16, v5p-8 or v5e:4x4")
  if gen not in CHIPS:
    raise CompileError(f"--topology {name}: chip {gen!r} not in {sorted(CHIPS)}")
  return gen, grid


def libtpu_env() -> None:
  """libtpu settings for a CPU host: a dummy slice type and host list quiet its start-up
  warnings; ALLOW_MULTIPLE_LIBTPU_LOAD lets several processes (tests, users) describe
  topologies at once instead of failing on /tmp/libtpu_lockfile."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-16")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(name: str) -> list:
  """The devices of a TPU slice, described without a TPU (libtpu must be installed)."""
  gen, grid = parse_topology(name)
  dims = [int(d) for d in grid.split("x")]
  per_host = tuple(min(d, b) for d, b in zip(dims + [1] * (3 - len(dims)), (2, 2, 1)))
  libtpu_env()
  from jax.experimental import topologies
  return list(topologies.get_topology_desc(
      topology_name=f"{gen}:{grid}", platform="tpu", chip_config_name="default",
      chips_per_host_bounds=per_host, num_slices=1,
      wrap=(False,) * len(per_host)).devices)


@dataclasses.dataclass
class Report:
  """One compiled program's per-device figures.

  Attributes:
    name: program name (one of PROGRAMS); shapes: a short description of its batch.
    argument_bytes, output_bytes, temp_bytes, alias_bytes: per device, from
      ``memory_analysis()`` (outputs aliased to donated arguments counted once).
    flops, bytes_accessed: per device, from ``cost_analysis()`` (a while loop's body
      is counted once, and Pallas kernels count 0 FLOPs: decode and splash are
      under-estimated).
    hbm, peak_flops, hbm_bw: the chip's figures (CHIPS).
    compile_s: compile time (s); kernels: Pallas (Mosaic) kernel calls in the program.
    error: the compiler's out-of-memory message when it refused the program (then
      temp_bytes is the requirement it states and the other figures are 0).
    model_flops: per device, the analytic count (2 N FLOPs per token forward, 6 N with
      the backward, 8 N with full remat; N = non-embedding parameters + LM head), since
      `cost_analysis` counts each while-loop body (layer scan, micro-batches) once.
    steps: sequential steps the program runs (decode: max_new_tokens); each reads the
      arguments (weights, cache) once.
  """
  name: str
  shapes: str
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  flops: float
  bytes_accessed: float
  hbm: int
  peak_flops: float
  hbm_bw: float
  compile_s: float
  kernels: int = 0
  error: str = ""
  model_flops: float = 0.0
  steps: int = 1

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  @property
  def fits(self) -> bool:
    return not self.error and self.total_bytes <= self.hbm

  @property
  def roofline_s(self) -> float:
    """Lower bound, seconds: max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth) with
    FLOPs = max(XLA's, analytic) and bytes = max(XLA's, steps x argument bytes)."""
    flops = max(self.flops, self.model_flops)
    moved = max(self.bytes_accessed, self.steps * self.argument_bytes)
    return max(flops / self.peak_flops, moved / self.hbm_bw)

  def line(self) -> str:
    g = lambda b: f"{b / GiB:7.2f}"  # noqa: E731
    if self.error:
      return f"{self.name:<11} OVER: {self.error}  {self.shapes}"
    return (f"{self.name:<11} {g(self.argument_bytes)} {g(self.temp_bytes)} "
            f"{g(self.output_bytes)} {g(self.total_bytes)} / {self.hbm / GiB:5.1f} "
            f"{'fits' if self.fits else 'OVER':<5} "
            f"{max(self.flops, self.model_flops) / 1e12:9.2f} "
            f"{self.roofline_s * 1e3:9.1f}  {self.shapes}")


HEADER = (f"{'program':<11} {'args':>7} {'temps':>7} {'outs':>7} {'total':>7} / "
          f"{'HBM':>5} {'':<5} {'TFLOP/dev':>9} {'roofl. ms':>9}  shapes (GiB per device; roofline = lower bound)")


def _report(name, shapes, compiled, chip, compile_s) -> Report:
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  return Report(name=name, shapes=shapes,
                argument_bytes=int(mem.argument_size_in_bytes),
                output_bytes=int(mem.output_size_in_bytes),
                temp_bytes=int(mem.temp_size_in_bytes),
                alias_bytes=int(mem.alias_size_in_bytes),
                flops=float(cost.get("flops", 0.0)),
                bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                hbm=int(chip["hbm"]), peak_flops=float(chip["flops"]),
                hbm_bw=float(chip["hbm_bw"]), compile_s=compile_s,
                kernels=compiled.as_text().count("tpu_custom_call"))


def _oom_report(name, shapes, message, chip, compile_s) -> Report:
  """Report of a program the compiler refused: 'Ran out of memory in memory space hbm
  ... required for HLO temporaries (37.45G) exceeds available HBM (15.75G)'."""
  msg = message.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]
  sizes = re.findall(r"\((\d+(?:\.\d+)?)([KMGT])\)", msg)
  unit = {"K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}
  need = int(float(sizes[0][0]) * unit[sizes[0][1]]) if sizes else 0
  return Report(name=name, shapes=shapes, argument_bytes=0, output_bytes=0,
                temp_bytes=need, alias_bytes=0, flops=0.0, bytes_accessed=0.0,
                hbm=int(chip["hbm"]), peak_flops=float(chip["flops"]),
                hbm_bw=float(chip["hbm_bw"]), compile_s=compile_s, error=msg)


def _abstract(tree, shardings):
  import jax
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _vocab_size(cfg) -> int | None:
  """The tokenizer's vocabulary size (as the trainer builds the model), or None."""
  if cfg.model.hf_path:
    return None
  try:
    from gigrl.data import tokenizer as tok_lib
    return int(tok_lib.load(cfg.data.tokenizer).vocab_size)
  except Exception:  # pylint: disable=broad-except  # compile needs shapes only
    return None


def compile_programs(cfg, topology: str, programs: Sequence[str] = PROGRAMS,
                     *, log=print) -> list[Report]:
  """Compiles `programs` of config `cfg` for `topology`; returns their reports.

  Args:
    cfg: a full gigrl config (``gigrl.config.base_config()`` layout), validated here.
    topology: e.g. ``'v5e-16'`` or ``'v5e:4x4'`` (see :func:`parse_topology`).
    programs: a subset of PROGRAMS.
    log: called with one progress line per program (None = quiet).
  Raises:
    CompileError for a bad topology or program name; ConfigError for a mesh that does
    not match the topology's device count; the compiler's error for a program that
    cannot be compiled.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from gigrl.training import build
  from gigrl import config as config_lib
  from gigrl import models
  from gigrl.models import lora as lora_lib
  from gigrl.models import sampler
  from gigrl.models import sharding as shd
  from gigrl.models.transformer import KVCache

  bad = sorted(set(programs) - set(PROGRAMS))
  if bad:
    raise CompileError(f"unknown programs {bad}; one of {PROGRAMS}")
  config_lib.validate(cfg)
  gen, _ = parse_topology(topology)
  chip = CHIPS[gen]
  devices = topology_devices(topology)
  mesh = shd.mesh_from_config(cfg.model, devices)
  build.check_rows_fit_mesh(cfg, mesh)
  model_cfg = models.model_config_from(cfg.model, _vocab_size(cfg)).resolve("tpu")
  model_cfg = model_cfg.replace(kernel_interpret=False)
  lora = lora_lib.settings_from_config(cfg.model)

  def make_model():
    model = models.Transformer(model_cfg, rngs=nnx.Rngs(0))
    return lora_lib.add_adapters(model, lora, rngs=nnx.Rngs(1)) if lora.enabled else model

  abstract = nnx.eval_shape(make_model)
  graphdef, abs_state = nnx.split(abstract)
  train_preset, rollout_preset = cfg.model.train_sharding, cfg.model.rollout_sharding
  param_sh = shd.param_shardings(abs_state, mesh, train_preset)
  params = _abstract(abs_state, param_sh)
  settings = build.rollout_settings(cfg)
  p, g = int(cfg.data.prompts_per_step), int(cfg.data.group_size)
  reports = []

  n_dev = len(devices)
  # Matmul parameters: the LM head counts, the embedding lookup does not.
  n_flop = model_cfg.num_params - (0 if model_cfg.tie_embeddings
                                   else model_cfg.vocab_size * model_cfg.hidden_size)
  train_factor = 8 if model_cfg.remat == "full" else 6

  def flops(tokens, per_token):
    return per_token * n_flop * tokens / n_dev

  def run(name, shapes, fn, model_flops=0.0, steps=1):
    t0 = time.perf_counter()
    try:
      with jax.set_mesh(mesh):
        compiled = fn().compile()
      rep = _report(name, shapes, compiled, chip, time.perf_counter() - t0)
    except jax.errors.JaxRuntimeError as e:   # the TPU compiler refuses what cannot fit
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      rep = _oom_report(name, shapes, str(e), chip, time.perf_counter() - t0)
    rep.model_flops, rep.steps = model_flops, steps
    if log:
      log(rep.line())
    reports.append(rep)

  def rows_spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=shd.batch_sharding(mesh, shape))

  if {"sft_step", "rl_step", "old_logprobs"} & set(programs):
    policy = build.Policy(model_cfg=model_cfg, graphdef=graphdef, mesh=mesh, params=params,
                          param_sh=param_sh, train_preset=train_preset,
                          rollout_preset=rollout_preset, lora=lora)
    steps = build.build_steps(cfg, policy)
    opt_state = _abstract(jax.eval_shape(steps.rl_tx.init, policy.trained(params)),
                          steps.opt_sh)
    ref = None if lora.enabled else params     # LoRA: the reference is the adapters off
    if log:
      trained = policy.trained(params)
      gib = lambda tree: f"{(0 if tree is None else per_device_bytes(tree)) / GiB:.4g} GiB"
      log(f"state per chip: params {gib(params)} ({gib(trained)} trained, "
          + (lora.describe() if lora.enabled else "full fine-tuning")
          + f"), optimizer {gib(opt_state)}, reference {gib(ref)}")
    s_len = settings.seq_len
    if "sft_step" in programs:
      rows = int(cfg.train.sft_batch_size)
      toks, mask = rows_spec((rows, s_len), jnp.int32), rows_spec((rows, s_len), jnp.float32)
      run("sft_step", f"{rows} rows x {s_len} tokens",
          lambda: _jitted(steps.sft_step).lower(params, opt_state, toks, mask),
          flops(rows * s_len, train_factor))
    # The RL update as `update.ppo_update` runs it: one `rl_step` on all rows; one on-policy
    # `ppo_step` with micro-batches when that is the step's only update; or (PPO mini-batches)
    # the old log-probs once plus one `ppo_step` per mini-batch.
    rows = p * g
    mini, micro = build.ppo_rows(cfg)
    single = mini >= rows and int(cfg.train.ppo_epochs) == 1
    whole = single and micro >= rows
    toks, mask, adv = (rows_spec((mini, s_len), dt) for dt in
                       (jnp.int32, jnp.float32, jnp.float32))
    behav = (rows_spec((mini, s_len), jnp.float32),) if steps.behaviour else ()
    if "rl_step" in programs and whole:
      run("rl_step", f"{rows} rows x {s_len} tokens",
          lambda: _jitted(steps.rl_step).lower(params, opt_state, ref, toks, mask, adv, *behav),
          flops(rows * s_len, train_factor))
    elif "rl_step" in programs:
      n_micro = mini // min(micro, mini)
      k = min(build.max_generated_tokens(cfg), s_len - 1)
      old = None if single else rows_spec((mini, k), jnp.float32)
      run("rl_step", f"{mini} rows ({n_micro} x {mini // n_micro}) x {s_len} tokens",
          lambda: _jitted(steps.ppo_step(n_micro, on_policy=single)).lower(
              params, opt_state, ref, toks, mask, adv, old, *behav),
          flops(mini * s_len, train_factor))
    if "old_logprobs" in programs and not single:
      # update.old_logprobs: one PPO micro-batch of rows per call
      chunk = min(micro, mini)
      all_toks = rows_spec((chunk, s_len), jnp.int32)
      all_mask = rows_spec((chunk, s_len), jnp.float32)
      run("old_logprobs", f"{rows} rows ({rows // chunk} x {chunk}) x {s_len} tokens",
          lambda: _jitted(steps.logprob_step).lower(params, all_toks, all_mask),
          flops(chunk * s_len, 2))

  b = p * g
  cache_len = settings.seq_len + 1
  roll_params = _abstract(abs_state, shd.param_shardings(abs_state, mesh, rollout_preset))
  cache = _abstract(jax.eval_shape(lambda: models.init_cache(model_cfg, b, cache_len)),
                    shd.cache_shardings(model_cfg, mesh, b, cache_len))
  cache = KVCache(*cache)
  logits = rows_spec((b, model_cfg.vocab_size), jnp.float32)
  lens = rows_spec((b,), jnp.int32)

  def extend_program(width):
    toks = rows_spec((b, width), jnp.int32)
    fn = jax.jit(lambda st, c, t, n, prev: sampler.extend_last(graphdef, st, c, t, n, prev),
                 donate_argnums=(1,))
    return lambda: fn.lower(roll_params, cache, toks, lens, logits)

  if "prefill" in programs:
    run("prefill", f"{b} rows x {settings.max_prompt_tokens} tokens, cache {cache_len}",
        extend_program(settings.max_prompt_tokens),
        flops(b * settings.max_prompt_tokens, 2))
  if "decode" in programs:
    key = jax.eval_shape(lambda: jax.random.key(0))
    stops = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    active = rows_spec((b,), jnp.bool_)

    def decode(st, c, lg, k, act, budget, stop):
      return sampler.decode(graphdef, st, c, lg, k, act, budget,
                            max_new_tokens=settings.max_new_tokens, stop_sequences=stop,
                            temperature=settings.temperature, top_p=settings.top_p,
                            top_k=settings.top_k, greedy=settings.greedy)

    fn = jax.jit(decode, donate_argnums=(1,))
    run("decode", f"{b} rows x {settings.max_new_tokens} new tokens, cache {cache_len}",
        lambda: fn.lower(roll_params, cache, logits, key, active, lens, stops),
        flops(b * settings.max_new_tokens, 2), steps=settings.max_new_tokens)
  if "obs_extend" in programs:
    run("obs_extend", f"{b} rows x {settings.obs_width} tokens, cache {cache_len}",
        extend_program(settings.obs_width), flops(b * settings.obs_width, 2))
  return reports


def per_device_bytes(tree) -> int:
  """Bytes one device holds of an abstract array tree (each leaf's shard under its sharding)."""
  import jax  # pylint: disable=g-import-not-at-top
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return total


def _jitted(step):
  """The jitted function under a ``build.in_mesh`` wrapper (it keeps ``__wrapped__``)."""
  while not hasattr(step, "lower") and hasattr(step, "__wrapped__"):
    step = step.__wrapped__
  return step


def summary(reports: Sequence[Report], topology: str) -> str:
  """The table of `reports` under the chip's figures (with their source) and a header."""
  gen, grid = parse_topology(topology)
  chip = CHIPS[gen]
  n_devices = math.prod(int(d) for d in grid.split("x"))
  lines = [f"gigrl-compile: {topology} ({gen} {grid}, {n_devices} chips); "
           f"per chip {chip['hbm'] / GiB:.1f} GiB HBM, {chip['flops'] / 1e12:.0f} TFLOP/s "
           f"bf16, {chip['hbm_bw'] / 1e9:.0f} GB/s [{chip['source']}]", HEADER]
  lines += [r.line() for r in reports]
  return "\n".join(lines)


# ------------------------------------------------------------------------------ the run's set
RUN_STAGES = ("sft", "rollout", "update", "logprobs", "eval", "other")
TEMPLATE_QUESTIONS = ("What is the capital of France?", "Who wrote the novel War and Peace?")


@dataclasses.dataclass
class RunReport:
  """One program of a run's set, compiled for a topology.

  Attributes:
    stage: ``sft``, ``rollout``, ``update``, ``logprobs``, ``eval`` or ``other``
      (:class:`gigrl.training.warmup.RunProgram`); label: its kind and static shape.
    bytes: per device, arguments + temporaries + outputs (donated buffers once), from
      ``memory_analysis()``; 0 with ``error``.
    compile_s: the host's seconds to lower and compile it.
    hbm: the chip's HBM bytes; error: the compiler's out-of-memory message, if it refused it.
  """
  stage: str
  label: str
  bytes: int
  compile_s: float
  hbm: int
  error: str = ""

  @property
  def fits(self) -> bool:
    return not self.error and self.bytes <= self.hbm

  def line(self) -> str:
    mem = f"OVER ({self.error})" if self.error else (
        f"{self.bytes / GiB:8.3f} {'fits' if self.fits else 'OVER':<4}")
    return f"{self.stage:<8} {mem} {self.compile_s:8.1f}  {self.label}"


RUN_HEADER = f"{'stage':<8} {'GiB/dev':>8} {'':<4} {'compile s':>8}  program"


class _AbstractEngine:
  """Mixin for :class:`gigrl.rollout.host_loop.HostLoopEngine`: the rollout's inputs as
  ``jax.ShapeDtypeStruct`` on a topology's mesh (no device memory, no process but this one):
  one process holding every row, split over all the slice's devices."""

  def _devices(self, b: int) -> int:
    from gigrl.models import sharding as shd  # pylint: disable=import-outside-toplevel
    axis = int(np.prod([self.mesh.shape[a] for a in shd.BATCH]))
    return axis if b % axis == 0 else 1

  def _rows(self, local):
    local = np.asarray(local)
    return self._rows_shape(local.shape, local.dtype)

  def _index(self, idx):
    return self._rows(idx)

  def _logits0(self, b):
    return self._rows_shape((b, self.model_cfg.vocab_size), np.float32)

  def _rows_shape(self, shape, dtype):
    from gigrl.models import sharding as shd  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    return jax.ShapeDtypeStruct(shape, dtype, sharding=shd.batch_sharding(self.mesh, shape))

  def _init_cache(self, batch, max_len):
    import jax  # pylint: disable=import-outside-toplevel
    from gigrl import models  # pylint: disable=import-outside-toplevel
    from gigrl.models import sharding as shd  # pylint: disable=import-outside-toplevel
    from gigrl.models.transformer import KVCache  # pylint: disable=import-outside-toplevel
    shapes_ = jax.eval_shape(lambda: models.init_cache(self.model_cfg, batch, max_len))
    return KVCache(*_abstract(shapes_, shd.cache_shardings(self.model_cfg, self.mesh, batch,
                                                          max_len)))


def template_stats(tokenizer, settings):
  """The prompts' :class:`gigrl.rollout.shapes.PromptStats` at the budgets: the longest
  prompt ``max_prompt_tokens`` and observations ``max_obs_tokens`` (a run measures its own,
  which can only narrow the widths), the shared prefix the chat template's (exact)."""
  from gigrl.rollout import shapes  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import turns  # pylint: disable=import-outside-toplevel
  ids = [turns.prompt_ids(tokenizer, q) for q in TEMPLATE_QUESTIONS]
  prefix = shapes.prompt_stats(ids).prefix
  return shapes.PromptStats(int(settings.max_prompt_tokens), prefix, None)


def run_set(cfg, topology: str, stages: Sequence[str] = RUN_STAGES):
  """Every program a run of ``cfg`` executes (:func:`gigrl.training.warmup.plan_run`'s set),
  lowered for ``topology``: ``(programs, chip)``, programs a list of
  :class:`gigrl.training.warmup.RunProgram` whose ``lower()`` traces and lowers it with
  abstract inputs on the slice's mesh.

  As a run on the slice, with its rows all on one process: the rollout's grid
  (:class:`gigrl.rollout.shapes.Grid`) for the step's candidates and for the evaluation's
  batch, at the budgets' prompt and observation widths (:func:`template_stats`); the update
  and its old log-probs at each width of :func:`gigrl.update.batch.width_grid`; the SFT step at
  each of those widths (a run compiles those its batches need); the RL optimizer's init, the
  reference and checkpoint copies and the advantage estimator.

  Raises:
    CompileError: a bad topology or stage name. ConfigError: a mesh that does not match the
    topology, or budgets the tokenizer's texts do not fit.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from gigrl import config as config_lib  # pylint: disable=import-outside-toplevel
  from gigrl import models  # pylint: disable=import-outside-toplevel
  from gigrl.advantages import compose  # pylint: disable=import-outside-toplevel
  from gigrl.data import tokenizer as tok_lib  # pylint: disable=import-outside-toplevel
  from gigrl.models import lora as lora_lib  # pylint: disable=import-outside-toplevel
  from gigrl.models import sharding as shd  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import host_loop  # pylint: disable=import-outside-toplevel
  from gigrl.training import build  # pylint: disable=import-outside-toplevel
  from gigrl.training import state as state_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  from gigrl.update import batch as batch_lib  # pylint: disable=import-outside-toplevel

  bad = sorted(set(stages) - set(RUN_STAGES))
  if bad:
    raise CompileError(f"unknown stages {bad}; one of {RUN_STAGES}")
  config_lib.validate(cfg)
  gen, _ = parse_topology(topology)
  devices = topology_devices(topology)
  mesh = shd.mesh_from_config(cfg.model, devices)
  build.check_rows_fit_mesh(cfg, mesh)
  tokenizer = tok_lib.load(cfg.data.tokenizer)
  vocab = None if cfg.model.hf_path else int(tokenizer.vocab_size)
  model_cfg = models.model_config_from(cfg.model, vocab).resolve("tpu")
  model_cfg = model_cfg.replace(kernel_interpret=False)
  lora = lora_lib.settings_from_config(cfg.model)

  def make_model():
    model = models.Transformer(model_cfg, rngs=nnx.Rngs(0))
    return lora_lib.add_adapters(model, lora, rngs=nnx.Rngs(1)) if lora.enabled else model

  graphdef, abs_state = nnx.split(nnx.eval_shape(make_model))
  param_sh = shd.param_shardings(abs_state, mesh, cfg.model.train_sharding)
  params = _abstract(abs_state, param_sh)
  rparams = params if cfg.model.rollout_sharding == cfg.model.train_sharding else _abstract(
      abs_state, shd.param_shardings(abs_state, mesh, cfg.model.rollout_sharding))
  policy = build.Policy(model_cfg=model_cfg, graphdef=graphdef, mesh=mesh, params=params,
                        param_sh=param_sh, train_preset=cfg.model.train_sharding,
                        rollout_preset=cfg.model.rollout_sharding, lora=lora)
  steps = build.build_steps(cfg, policy)
  sft_opt = _abstract(jax.eval_shape(steps.sft_tx.init, policy.trained(params)), steps.opt_sh)
  rl_opt = _abstract(jax.eval_shape(steps.rl_tx.init, policy.trained(params)), steps.opt_sh)
  ref = None if lora.enabled else params
  settings = build.rollout_settings(cfg)
  seq_len = settings.seq_len
  stats = template_stats(tokenizer, settings)

  def put(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shd.batch_sharding(mesh, x.shape))

  def replicated(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))

  class Engine(_AbstractEngine, host_loop.HostLoopEngine):
    pass

  t = cfg.train
  p, g = int(cfg.data.prompts_per_step), int(cfg.data.group_size)
  k = 1 if cfg.data.pool.rule == "grpo" else int(cfg.data.pool.oversample)
  rows = p * g * k
  out = []
  if "sft" in stages and int(t.sft_steps):
    out += warmup.sft_programs(cfg, steps, mesh, params, sft_opt, put,
                               batch_lib.width_grid(seq_len))
  if int(t.num_steps):
    if "rollout" in stages:
      eng = Engine(model_cfg, graphdef, tokenizer, None, settings, mesh=mesh,
                   prompt_stats=stats, distinct_rows=-(-rows // g))
      out += warmup.engine_programs(eng, rparams, rows, "rollout")
    if {"update", "logprobs"} & set(stages):
      out += [q for q in warmup.update_programs(cfg, steps, mesh, params, rl_opt, ref, put,
                                                 seq_len, build.max_generated_tokens(cfg))
              if q.stage in stages]
  n_eval = int(t.eval_questions)
  if "eval" in stages and n_eval:
    b = min(int(t.eval_batch_size) or n_eval, n_eval)
    b += -b % build.batch_axis_size(mesh)
    eng = Engine(model_cfg, graphdef, tokenizer, None, build.rollout_settings(cfg, greedy=True),
                 mesh=mesh, prompt_stats=stats, distinct_rows=b)
    out += warmup.engine_programs(eng, rparams, b, "eval")
  if "other" in stages:
    if int(t.num_steps):
      out.append(warmup.RunProgram("other", "init_opt[rl]",
                                   lambda: steps.init_opt(steps.rl_tx, params, lower=True)))
      if not lora.enabled:
        out.append(warmup.RunProgram("other", "copy[reference params]",
                                     lambda: state_lib.copy_program(params)))
      published = warmup.published_copy(cfg, params, lora.enabled, reference_listed=True)
      if published:
        out.append(published)
      _, adv_fn, adv_state = build.build_advantages(cfg)
      c, tt = rows // g, settings.max_turns + 1
      z = lambda shape, dt: replicated(np.zeros(shape, dt))  # noqa: E731
      inputs = compose.AdvantageInputs(
          rewards=z((p, g), np.float32), valid=z((p, g), bool), strata=z((p, g), np.int32),
          step_rewards=z((p, g, tt), np.float32), step_valid=z((p, g, tt), bool),
          anchor_ids=z((p, g, tt), np.int32), action_valid=z((p, g, tt), bool),
          batch_rewards=z((c, g), np.float32), batch_valid=z((c, g), bool))
      adv_abs = jax.tree.map(lambda x: replicated(np.asarray(x)), adv_state)
      out.append(warmup.RunProgram("other", f"advantages[{p} x {g} x {tt}]",
                                   lambda: adv_fn.lower(inputs, adv_abs)))
    saved = (policy.trained(params) if lora.enabled else params,
             rl_opt if int(t.num_steps) else sft_opt, ref)
    out.append(warmup.RunProgram("other", "copy[checkpoint]",
                                 lambda: state_lib.copy_program(saved)))
  seen, unique = set(), []
  for q in out:
    if q.label not in seen:
      seen.add(q.label)
      unique.append(q)
  return unique, CHIPS[gen]


def compile_run(cfg, topology: str, stages: Sequence[str] = RUN_STAGES, *, log=print,
                results: str = "") -> list[RunReport]:
  """Compiles :func:`run_set` of ``cfg`` for ``topology``, one program after another; returns
  a :class:`RunReport` each.

  Args:
    results: a JSON-lines file: each program's report is appended as it is compiled, and a
      program whose label is already there is not compiled again (a long set resumes).
    log: called with a header, one line per program (:meth:`RunReport.line`) and the totals.
  """
  import json  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  programs, chip = run_set(cfg, topology, stages)
  done = {}
  if results and os.path.exists(results):
    with open(results) as f:
      for line in f:
        if line.strip():
          r = RunReport(**json.loads(line))
          done[(r.stage, r.label)] = r
  if log:
    counts = {}
    for q in programs:
      counts[q.stage] = counts.get(q.stage, 0) + 1
    log(f"{len(programs)} programs: " + ", ".join(f"{k} {v}" for k, v in counts.items())
        + (f" ({len(done)} already in {results})" if done else ""))
    log(RUN_HEADER)
  reports = []
  for q in programs:
    if (q.stage, q.label) in done:
      rep = done[(q.stage, q.label)]
    else:
      t0 = time.perf_counter()
      try:
        compiled = q.lower().compile()
        mem = compiled.memory_analysis()
        total = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                    + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
        rep = RunReport(q.stage, q.label, total, time.perf_counter() - t0, int(chip["hbm"]))
      except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        o = _oom_report(q.label, "", str(e), chip, time.perf_counter() - t0)
        rep = RunReport(q.stage, q.label, o.temp_bytes, o.compile_s, int(chip["hbm"]),
                        error=f"{o.temp_bytes / GiB:.2f} GiB")
      if results:
        with open(results, "a") as f:
          f.write(json.dumps(dataclasses.asdict(rep)) + "\n")
    if log:
      log(rep.line())
    reports.append(rep)
  if log and reports:
    peak = max(reports, key=lambda r: r.bytes)
    log(f"total: {len(reports)} programs, {sum(r.compile_s for r in reports):.0f} s compiling; "
        f"largest {peak.bytes / GiB:.2f} GiB per device ({peak.stage} {peak.label}) of "
        f"{chip['hbm'] / GiB:.0f}; {sum(not r.fits for r in reports)} do not fit")
  return reports
