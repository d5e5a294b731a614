"""Per-phase floors of an RL step: the FLOPs and the bytes the phase cannot avoid (issue #50).

For each phase of the step (the rollout's ``prefill``, observation ``extend`` and ``decode``,
then the ``update``), from the work counters the engine logs per step
(``rollout/<phase>/{real_tokens, weight_reads, kv_slots, attn_pairs}``,
:func:`gigrl.rollout.host_loop._phase`) and the model's shapes:

* **FLOP floor** = FLOPs of the tokens actually needed / the measured GEMM peak. A group's
  prompt counts once and the shared prefix once (``real_tokens``, not the trajectories'
  tokens). Forward: ``2·N`` per token (N = the matmul parameters: the LM head counts, the
  embedding lookup does not) plus ``4·L·H·Dh`` per (query token, key slot) pair of attention;
  the update ``6·N`` per trained token (forward and backward).
* **Bandwidth floor** = bytes that must be read / the measured copy bandwidth: the weights once
  per pass over them (a prefill or extend call, a decode step) and the KV slots the real rows
  attend over (decode: every step reads its rows' slots again); the update reads the weights
  twice per micro-batch (forward, backward), reads and writes the gradient accumulator, and the
  optimizer reads params, gradient and both Adam moments and writes three of them.
* **ratio** = time / the larger floor: 1.0 would be a program at the machine's limit.

The peak and the bandwidth are measured in the same run (``smollm2_steps.py --phases``):
``gemm_peak_flops`` (a 2048³ f32 GEMM in XLA, all cores) and ``_machine.figures``'s copy.
"""
from __future__ import annotations

import statistics

PHASES = ("prefill", "extend", "decode")


def model_figures(cfg) -> dict:
  """Per-token and per-slot constants of a :class:`gigrl.models.config.ModelConfig`."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  n_mm = cfg.num_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)
  item = np.dtype(cfg.dtype).itemsize
  return {"n_matmul": n_mm,
          "weight_bytes": cfg.num_params * np.dtype(cfg.param_dtype).itemsize,
          "slot_bytes": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item,
          "attn_flops_per_pair": 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim}


def step_floors(m: dict, mf: dict, peak: float, bw: float, micro_batches: int) -> dict:
  """{phase: (time_s, flop_floor_s, bandwidth_floor_s)} of one RL step's metrics ``m``."""
  out = {}
  for ph in PHASES:
    g = lambda k, ph=ph: float(m.get(f"rollout/{ph}/{k}", 0.0))  # noqa: E731
    flops = 2 * mf["n_matmul"] * g("real_tokens") + mf["attn_flops_per_pair"] * g("attn_pairs")
    moved = g("weight_reads") * mf["weight_bytes"] + g("kv_slots") * mf["slot_bytes"]
    out[ph] = (float(m[f"time/{ph}_s"]), flops / peak, moved / bw)
  tokens = float(m.get("train/tokens_per_s", 0.0)) * float(m["time/update_s"])
  moved = (4 * micro_batches + 7) * mf["weight_bytes"]
  out["update"] = (float(m["time/update_s"]), 6 * mf["n_matmul"] * tokens / peak, moved / bw)
  return out


def phases(rows: list[dict], mf: dict, peak: float, bw: float, micro_batches: int) -> dict:
  """Medians over RL steps ``rows``: {phase: {time_s, flop_floor_s, bandwidth_floor_s, ratio,
  bound}} (``bound``: which floor is the larger)."""
  per = [step_floors(m, mf, peak, bw, micro_batches) for m in rows]
  out = {}
  for ph in PHASES + ("update",):
    t, f, b = (statistics.median(s[ph][i] for s in per) for i in range(3))
    out[ph] = {"time_s": t, "flop_floor_s": f, "bandwidth_floor_s": b,
               "ratio": t / max(f, b) if max(f, b) else None,
               "bound": "flops" if f >= b else "bandwidth"}
  return out


def table(ph: dict) -> str:
  """A markdown table of :func:`phases`."""
  lines = ["| phase | time s | FLOP floor s | bandwidth floor s | time / larger floor | bound |",
           "|---|---|---|---|---|---|"]
  for k, r in ph.items():
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
    lines.append(f"| {k} | {r['time_s']:.2f} | {r['flop_floor_s']:.2f} | "
                 f"{r['bandwidth_floor_s']:.2f} | {ratio} | {r['bound']} |")
  return "\n".join(lines)
