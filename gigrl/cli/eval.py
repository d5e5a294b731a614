r"""``gigrl-eval``: held-out evaluation of a trained policy, as Search-R1 reports it.

Usage::

  # a run's latest checkpoint (or --step N) on its own held-out questions
  gigrl-eval --workdir runs/countries --datasets countries

  # the Search-R1 table (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle) from the
  # FlashRAG files and a running e5 retrieval server (gigrl-serve-retriever or Search-R1's)
  gigrl-eval --hf_path ckpt/qwen2.5-3b-grpo --datasets searchr1 \
      --data_dir FlashRAG_datasets --retriever http --retrieval_url http://127.0.0.1:8000/retrieve

  # sampled rollouts with pass@k, any jsonl by path
  gigrl-eval --workdir runs/x --datasets my_qa=data/my_qa.jsonl --mode sample --samples 8 --k 1,4,8

Inputs:
  * policy: ``--workdir`` (the run's config and params from its latest checkpoint, or
    ``--step``) or ``--hf_path`` (a Hugging Face checkpoint; settings from ``--config`` or
    the defaults, tokenizer from the checkpoint directory unless ``--set data.tokenizer=...``);
  * datasets (``--datasets``, comma-separated): ``run`` (the run's own held-out questions, as
    its trainer evaluates them: ``train.eval_questions`` spread over its eval split), a bundled set (``countries``, ``hotpotqa``,
    ``2wikimultihopqa``, ``musique``, ``iirc``: its held-out split; ``bamboogle``: all of it),
    a Search-R1 name (``nq``, ``triviaqa``, ``popqa``, ``hotpotqa``, ``2wikimultihopqa``,
    ``musique``, ``bamboogle``; ``searchr1`` = all seven) looked up in ``--data_dir`` as
    FlashRAG lays them out (``<name>/test.jsonl``, else ``<name>/dev.jsonl``, else
    ``<name>.jsonl``; 2Wiki is ``2wikimultihopqa``), or ``name=path`` / a ``.jsonl`` path;
  * retriever: the run's ``search`` section, or ``--retriever bm25 --corpus <jsonl|bundled>``
    (in process) / ``--retriever http --retrieval_url ...`` (a Search-R1 retrieval server).

Outputs (``--output``, default ``<workdir>/eval/step_<N>`` or ``./gigrl_eval``):
``results.json`` (every dataset's metrics, see :mod:`gigrl.training.evaluate`), ``results.md`` (one
table row per dataset: EM, F1, search calls, answered and invalid rates, EM per search-call
stratum with its share, pass@k when sampled) and ``samples_<dataset>.jsonl`` (one line per
question). The table is printed too.

Bad input (a missing checkpoint or file, an unknown dataset name, a malformed row) ends with
one line ``gigrl-eval: error: ...`` naming it, and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

# The seven sets of Search-R1's main table (Jin et al. 2025, Table 2), in its column order.
SEARCH_R1_SETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique",
                  "bamboogle")
PROG = "gigrl-eval"
RUN_SET = "run"     # the run's own held-out questions, as its trainer evaluates them


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="See the module docstring (python -m gigrl.cli.eval) "
                              "and README 'Evaluation'.")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a gigrl-train run directory (its checkpoints/)")
  src.add_argument("--hf_path", help="a Hugging Face checkpoint directory (config.json)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--config", default=None,
                 help="FILE[:PRESET] config for --hf_path runs (default: gigrl.config.base_config)")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                 help="override a config field (repeatable), e.g. --set rollout.max_turns=4")
  p.add_argument("--datasets", required=True,
                 help="comma-separated names, name=path pairs or .jsonl paths; 'searchr1' = "
                 + ",".join(SEARCH_R1_SETS))
  p.add_argument("--data_dir", default="", help="folder of the FlashRAG/Search-R1 files")
  p.add_argument("--split", default="", help="FlashRAG split file to prefer (test, dev, ...)")
  p.add_argument("--max_questions", type=int, default=0, help="per dataset (0 = all)")
  p.add_argument("--retriever", choices=("bm25", "http", "none"), default=None,
                 help="default: the run's search.backend; 'none': closed book (every search "
                 "returns no passage)")
  p.add_argument("--retrieval_url", default=None, help="Search-R1 /retrieve endpoint (http)")
  p.add_argument("--corpus", default=None, help="'bundled' or a corpus jsonl (bm25)")
  p.add_argument("--topk", type=int, default=None, help="passages per search (default: run's)")
  p.add_argument("--mode", choices=("greedy", "sample"), default="greedy")
  p.add_argument("--samples", type=int, default=1, help="rollouts per question (sample mode)")
  p.add_argument("--k", default="", help="pass@k values, e.g. 1,4 (sample mode; <= samples)")
  p.add_argument("--temperature", type=float, default=None, help="sample mode (default: run's)")
  p.add_argument("--batch_size", type=int, default=64, help="questions per rollout batch")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--output", default=None, help="output folder")
  return p.parse_args(list(argv))


# ------------------------------------------------------------------------------- datasets
@dataclasses.dataclass
class EvalSet:
  """A named list of questions and where they came from (for the report)."""
  name: str
  questions: list
  origin: str
  hops_files: list


def _flashrag_file(data_dir: str, name: str, split: str) -> str | None:
  candidates = [os.path.join(data_dir, name, f"{s}.jsonl")
                for s in ([split] if split else []) + ["test", "dev", "val", "train"]]
  candidates.append(os.path.join(data_dir, f"{name}.jsonl"))
  return next((c for c in candidates if os.path.isfile(c)), None)


def resolve_datasets(spec: str, *, data_dir: str = "", split: str = "",
                     eval_percent: int = 10, max_questions: int = 0) -> list[EvalSet]:
  """``--datasets`` -> question lists (see the module docstring for the names).

  Raises:
    ConfigError: naming ``--datasets`` for an unknown name or an empty list, or
      ``--data_dir`` for a Search-R1 name whose file is not there.
    DataError: a malformed row (file, line, field); a missing path names the file.
  """
  # pylint: disable=g-import-not-at-top
  from gigrl.training import evaluate as evaluate_lib
  from gigrl.config_utils import ConfigError, UserError
  from gigrl.data import qa
  # pylint: enable=g-import-not-at-top
  names = [n.strip() for n in spec.split(",") if n.strip()]
  names = [x for n in names for x in (SEARCH_R1_SETS if n == "searchr1" else (n,))]
  if not names:
    raise ConfigError("--datasets", spec, "a comma-separated list of dataset names or paths")
  bundled = {s for b in qa.BUNDLED_SETS for s in b.sources}
  out = []
  for item in dict.fromkeys(names):
    if item == RUN_SET:
      out.append(EvalSet(RUN_SET, [], "the run's held-out split", []))   # filled by main
      continue
    name, _, path = item.partition("=")
    if not path and (item.endswith(".jsonl") or os.sep in item):
      name, path = os.path.splitext(os.path.basename(item))[0], item
    if not path and data_dir:
      path = _flashrag_file(data_dir, name, split) or ""
      if not path and name in SEARCH_R1_SETS and name not in bundled:
        raise ConfigError("--data_dir", data_dir, f"a folder with {name}/test.jsonl, "
                          f"{name}/dev.jsonl or {name}.jsonl (FlashRAG layout) for dataset "
                          f"'{name}'")
    if path:
      if not os.path.isfile(path):
        raise UserError(f"--datasets {item}: no such file {path}")
      qs = qa.load_questions(path, data_source=name)
      origin, files = path, [path]
    elif name in bundled:
      files = [os.path.join(qa.bundled_dir(), b.questions) for b in qa.BUNDLED_SETS
               if name in b.sources]
      qs = [q for f in files for q in qa.load_questions(f) if q.data_source == name]
      qs = [q for q in qs if qa.is_eval_question(q, eval_percent)]
      qs.sort(key=lambda q: q.id)
      origin = f"bundled '{name}', held-out split"
    else:
      known = sorted(bundled | set(SEARCH_R1_SETS) | {"searchr1", RUN_SET})
      hint = (" (Search-R1 sets need --data_dir)" if name in SEARCH_R1_SETS else "")
      raise ConfigError("--datasets", name, f"a bundled set or Search-R1 name among "
                        f"{', '.join(known)}{hint}, name=path or a .jsonl path")
    if not qs:
      raise ConfigError("--datasets", name, "a dataset with held-out questions")
    out.append(EvalSet(name, evaluate_lib.select(qs, max_questions), origin, files))
  return out


def _fill_run_set(es: EvalSet, cfg, args) -> None:
  """The ``run`` set: the held-out split of the run's ``data`` section, the questions its
  trainer evaluates (``train.eval_questions`` of them unless ``--max_questions``)."""
  # pylint: disable=g-import-not-at-top
  from gigrl.training import build
  from gigrl.training import evaluate as evaluate_lib
  from gigrl.config_utils import ConfigError
  from gigrl.data import qa
  # pylint: enable=g-import-not-at-top
  workdir = args.workdir or args.output or "gigrl_eval"
  data = build.load_data(cfg, workdir)
  if not data.eval:
    raise ConfigError("--datasets", RUN_SET, "a run whose data section has held-out questions")
  es.questions = evaluate_lib.select(data.eval, args.max_questions or
                                     int(cfg.train.eval_questions))
  d = cfg.data
  es.hops_files = ([d.questions_file] if d.questions_file else
                   [os.path.join(qa.bundled_dir(), f) for f in qa.BUNDLED_QUESTION_FILES])
  es.origin = f"held-out split of {d.questions_file or 'data.train_sources=' + d.train_sources}"


def main(argv: Sequence[str]) -> int:
  args = parse_args(argv)
  # pylint: disable=g-import-not-at-top
  from gigrl.cli import train as train_lib
  from gigrl.config_utils import UserError
  from gigrl.search.base import SearchError
  # pylint: enable=g-import-not-at-top
  try:
    ks = [int(k) for k in args.k.split(",") if k.strip()] if args.k else []
  except ValueError:
    train_lib.fail(f"--k {args.k}: expected comma-separated integers, e.g. 1,4")
  samples = args.samples if args.mode == "sample" else 1
  if samples < 1 or any(not 1 <= k <= samples for k in ks):
    train_lib.fail(f"--k {args.k} / --samples {args.samples}: each k must be in [1, samples] "
                   "(pass@k needs --mode sample --samples >= k)")
  try:
    return _evaluate_all(args, ks, samples)
  except (UserError, SearchError) as e:
    train_lib.fail(str(e))
  except FileNotFoundError as e:
    train_lib.fail(f"{e.filename}: no such file")
  return 0


def _evaluate_all(args, ks, samples) -> int:
  # pylint: disable=g-import-not-at-top
  from gigrl.training import compile_cache
  from gigrl import config as config_lib
  from gigrl import search as search_lib
  from gigrl.config_utils import UserError
  from gigrl.training import build
  from gigrl.training import evaluate as evaluate_lib
  from gigrl.training import trained
  # pylint: enable=g-import-not-at-top
  if args.workdir and not os.path.isdir(args.workdir):
    raise UserError(f"--workdir {args.workdir}: no such directory")
  # Datasets first: a bad name or file fails before the model is built.
  eval_percent = 10
  sets = resolve_datasets(args.datasets, data_dir=args.data_dir, split=args.split,
                          eval_percent=eval_percent, max_questions=args.max_questions)
  run = trained.load_policy(args.workdir, step=args.step, hf_path=args.hf_path,
                            config_file=args.config, overrides=args.set)
  cfg, policy, step = run.cfg, run.policy, run.step
  compile_cache.enable(cfg.train.get("compile_cache", "auto"))
  _apply_search_args(cfg, args)
  if int(cfg.data.eval_percent) != eval_percent:        # the run's own split of bundled sets
    sets = resolve_datasets(args.datasets, data_dir=args.data_dir, split=args.split,
                            eval_percent=int(cfg.data.eval_percent),
                            max_questions=args.max_questions)
  config_lib.validate(cfg)
  for es in sets:
    if es.name == RUN_SET:
      _fill_run_set(es, cfg, args)
  retriever = evaluate_lib.RetrievalLog(search_lib.make_retriever(cfg.search))
  engine = build.build_engine(cfg, policy, run.tokenizer, retriever,
                              greedy=args.mode == "greedy")
  rollout_params = policy.rollout_params(run.params)
  out_dir = args.output or (os.path.join(args.workdir, "eval", f"step_{step}") if args.workdir
                            else "gigrl_eval")
  os.makedirs(out_dir, exist_ok=True)
  results, report = {}, {}
  for es in sets:
    m, rows = evaluate_lib.evaluate_set(
        engine, rollout_params, es.questions, samples=samples, ks=ks, seed=args.seed,
        batch_size=args.batch_size, rows_multiple=build.batch_axis_size(policy.mesh),
        hops=evaluate_lib.question_hops(es.hops_files), name=es.name, retrieval_log=retriever)
    results[es.name] = m
    report[es.name] = {"origin": es.origin, **m}
    with open(os.path.join(out_dir, f"samples_{es.name}.jsonl"), "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"[gigrl-eval] {es.name}: EM {m['eval/em']:.3f} on {int(m['eval/n'])} questions "
          f"({m['eval/time_s']:.0f} s)", file=sys.stderr, flush=True)
  source = (f"--workdir {args.workdir} (step {step})" if args.workdir
            else f"--hf_path {args.hf_path}")
  table = evaluate_lib.markdown_table(results, ks)
  header = (f"gigrl-eval of {source}: {args.mode}"
            + (f", {samples} samples" if samples > 1 else "")
            + f", retriever {cfg.search.backend} (top {cfg.search.topk})\n\n")
  with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
    json.dump({"policy": source, "step": step, "mode": args.mode, "samples": samples,
               "retriever": cfg.search.backend, "topk": int(cfg.search.topk),
               "datasets": report}, f, indent=1)
  with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
    f.write(header + table)
  print(header + table)
  print(f"[gigrl-eval] wrote {out_dir}/results.json and results.md", file=sys.stderr)
  return 0


def _apply_search_args(cfg, args) -> None:
  """``--retriever``, ``--retrieval_url``, ``--corpus``, ``--topk``, ``--temperature``: over
  the run's settings and ``--set``."""
  if args.retriever:
    cfg.search.backend = args.retriever
  if args.retrieval_url:
    cfg.search.url = args.retrieval_url
  if args.corpus:
    cfg.search.corpus = args.corpus
  if args.topk:
    cfg.search.topk = args.topk
  if args.temperature is not None:
    cfg.rollout.temperature = args.temperature


def run() -> None:
  """Console entry point (``gigrl-eval``)."""
  if not os.path.basename(sys.argv[0]).startswith("gigrl-"):
    sys.argv[0] = PROG            # gigrl.cli.train.fail names the program from argv[0]
  sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
  run()
