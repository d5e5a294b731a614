"""Writes the committed warm-start of ``countries_agent.ipynb`` from a finished warm-start run.

  gigrl-train --config configs/countries.py --workdir /tmp/countries_ws \\
      --config.train.num_steps=0 --config.train.sft_eval_every=200 --config.train.eval_questions=48
  python notebooks/export_warm_start.py /tmp/countries_ws      # -> notebooks/assets/countries_warm_start

The export keeps only what ``train.init_from`` reads: the policy params of the checkpoint at the
end of the warm-start (an orbax checkpoint whose ``state`` item is ``{"params": ...}``, with the
run's JSON metadata), plus the run's ``metrics.jsonl`` up to that step: its held-out eval lines whole (the notebook
plots them as the warm-start curve), its SFT lines cut to step, phase and loss. The optimizer state, reference params and pool are left
out: an RL run started with ``train.init_from`` builds them fresh (``Trainer._init_from``).

The run is deterministic per seed on CPU, so the command above reproduces these params.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import orbax.checkpoint as ocp

from gigrl.training import checkpoint as ckpt_lib

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "countries_warm_start")


SFT_KEYS = ("step", "phase", "loss")


def slim(record: dict) -> dict:
  """An SFT line of ``metrics.jsonl`` cut to :data:`SFT_KEYS` (the eval lines are kept whole)."""
  return {k: record[k] for k in SFT_KEYS if k in record}


def export(run_dir: str, out: str = OUT) -> int:
  """Copies the params and metadata of ``run_dir``'s newest checkpoint to ``out``.

  Returns:
    The checkpoint step (the run's ``train.sft_steps``).
  Raises:
    ValueError: the newest checkpoint is not at the end of the warm-start (phase ``sft``).
  """
  src = ocp.CheckpointManager(ckpt_lib.checkpoint_dir(run_dir),
                              options=ocp.CheckpointManagerOptions(create=False),
                              item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                             "meta": ocp.JsonCheckpointHandler()})
  step = max(src.all_steps())
  restored = src.restore(step, args=ocp.args.Composite(
      meta=ocp.args.JsonRestore(), state=ocp.args.PyTreeRestore()))
  src.close()
  meta = dict(restored.meta)
  if meta.get("phase") != "sft" or meta.get("sft_steps_done") != step:
    raise ValueError(f"{run_dir}: checkpoint {step} is not the end of a warm-start ({meta})")
  if os.path.exists(out):
    shutil.rmtree(out)
  dst = ocp.CheckpointManager(ckpt_lib.checkpoint_dir(out),
                              options=ocp.CheckpointManagerOptions(create=True),
                              item_handlers={"state": ocp.StandardCheckpointHandler(),
                                             "meta": ocp.JsonCheckpointHandler()})
  meta["exported_from"] = "notebooks/export_warm_start.py (params only)"
  dst.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave({"params": restored.state["params"]}),
      meta=ocp.args.JsonSave(meta)))
  dst.wait_until_finished()
  dst.close()
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  with open(os.path.join(out, "metrics.jsonl"), "w") as f:
    for r in lines:
      if r["step"] <= step:
        f.write(json.dumps(r if r["phase"] == "eval" else slim(r)) + "\n")
  return step


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dir", help="workdir of a finished warm-start run (num_steps=0)")
  parser.add_argument("--out", default=OUT)
  args = parser.parse_args()
  step = export(args.run_dir, args.out)
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
  print(f"{args.out}: params of step {step}, {size / 1e6:.2f} MB")


if __name__ == "__main__":
  main()
