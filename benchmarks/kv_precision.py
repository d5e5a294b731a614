"""What a bf16 KV cache changes in the sampled tokens' log-probs, against the f32 trainer (#50).

  python benchmarks/kv_precision.py --init_from runs/cold/after@30 --batches 2 \
      --out docs/results/rollout_efficiency/kv_precision.json

Builds the SmolLM2 countries run (``configs/countries.py:smollm2-135m``) from a warm-start
(``--init_from``, a run at the end of its SFT), then rolls out the same questions with the same
keys twice: with the KV cache in the model's f32 (``model.kv_cache_dtype`` unset) and in
bfloat16 (``model.kv_cache_dtype=bfloat16``). For each, every generated token's log-prob as the
sampler computed it (``TrajectoryBatch.behaviour_logprobs``: raw model, temperature 1, from its
own KV cache) is compared with the f32 trainer's log-prob of the same token (the update's
``masked_logprobs``, teacher-forced over the whole trajectory, no cache). It prints, per cache
dtype: the tokens compared, the mean and max of |Δ log p|, and the share of tokens whose
importance ratio exp(log p_trainer - log p_sampler) leaves [0.8, 1.25]; and the rollout's decode
seconds each way (its median per batch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "configs", "countries.py")


def compare(sampler_lp: np.ndarray, trainer_lp: np.ndarray) -> dict:
  """|Δ log p| and the importance ratio's spread over matched tokens (f32[n] each)."""
  d = trainer_lp.astype(np.float64) - sampler_lp.astype(np.float64)
  ratio = np.exp(d)
  return {"tokens": int(d.size), "mean_abs_dlogp": float(np.abs(d).mean()),
          "max_abs_dlogp": float(np.abs(d).max()),
          "ratio_outside_0.8_1.25": float(((ratio < 0.8) | (ratio > 1.25)).mean()),
          "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max())}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--init_from", required=True)
  p.add_argument("--preset", default="smollm2-135m")
  p.add_argument("--batches", type=int, default=2, help="RL batches rolled out each way")
  p.add_argument("--out", default="")
  a = p.parse_args(argv)

  from flax import nnx  # pylint: disable=import-outside-toplevel
  from gigrl import models  # pylint: disable=import-outside-toplevel
  from gigrl.rollout import engine as engine_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from gigrl.training import warmup  # pylint: disable=import-outside-toplevel
  from gigrl.update import step as update_lib  # pylint: disable=import-outside-toplevel
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("countries", CONFIG)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config(a.preset)
  cfg.train.init_from = a.init_from
  cfg.train.eval_questions = 0
  t = trainer_lib.Trainer(cfg, tempfile.mkdtemp(prefix="gigrl_kv_precision_"))
  t.state = t.checkpoints.restore(t.state)
  warmup.set_up_engines(t)
  pol, s = t.policy, t.settings
  params = t.state.params
  rparams = pol.rollout_params(params)
  engines = {"float32": t.engine.engine}
  bf_cfg = dataclasses.replace(pol.model_cfg, kv_cache_dtype="bfloat16")
  bf_graph, _ = nnx.split(nnx.eval_shape(lambda: models.Transformer(bf_cfg, rngs=nnx.Rngs(0))))
  bf = engine_lib.make_engine(cfg.rollout.engine, bf_cfg, bf_graph, t.tokenizer, t.retriever, s,
                              mesh=pol.mesh)
  bf.prompt_stats, bf.distinct_rows = t.engine.engine.prompt_stats, t.engine.engine.distinct_rows
  engines["bfloat16"] = bf
  k = int(cfg.data.group_size)
  n_q = int(cfg.data.prompts_per_step)
  logprob = jax.jit(update_lib.logprob_fn(pol.graphdef, max_tokens=t.settings.seq_len - 1,
                                          chunk_size=int(cfg.model.logprob_chunk_size)))
  res = {}
  for name, eng in engines.items():
    sampler, trainer, decode_s = [], [], []
    for i in range(a.batches):
      qs = [q.question for q in t.rl_questions[i * n_q:(i + 1) * n_q] for _ in range(k)]
      batch, m = eng.run(rparams, qs, jax.random.key(100 + i))
      decode_s.append(m["time/decode_s"])
      lp = np.asarray(logprob(params, t._put(batch.tokens), t._put(batch.loss_mask)))
      mask = batch.loss_mask > 0
      for r in range(len(qs)):
        beh = batch.behaviour_logprobs[r][mask[r]]
        sampler.append(beh)
        trainer.append(lp[r, :len(beh)])
      print(f"{name}: batch {i + 1}/{a.batches}: {int(mask.sum())} tokens, decode "
            f"{m['time/decode_s']:.1f} s", flush=True)
    res[name] = {**compare(np.concatenate(sampler), np.concatenate(trainer)),
                 "decode_s_median": statistics.median(decode_s)}
  print("| KV cache | tokens | mean abs dlogp | max abs dlogp | ratio outside [0.8, 1.25] | "
        "decode s (median/batch) |")
  print("|---|---|---|---|---|---|")
  for name, r in res.items():
    print(f"| {name} | {r['tokens']} | {r['mean_abs_dlogp']:.2e} | {r['max_abs_dlogp']:.2e} | "
          f"{r['ratio_outside_0.8_1.25']:.2%} | {r['decode_s_median']:.1f} |")
  out = {"command": "python benchmarks/kv_precision.py " + " ".join(argv or sys.argv[1:]),
         "device": f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores, jax {jax.__version__}",
         "config": f"configs/countries.py:{a.preset}", "temperature": s.temperature, **res}
  print(json.dumps(out))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
