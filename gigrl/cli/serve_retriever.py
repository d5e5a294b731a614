"""``gigrl-serve-retriever``: BM25 over a Search-R1 corpus behind Search-R1's HTTP protocol,
over :func:`gigrl.search.server.serve_in_thread` (the protocol is described there).

  gigrl-serve-retriever --corpus FILE|bundled --port 8000 [--host 127.0.0.1] [--topk 3]
"""
from __future__ import annotations

import argparse
import sys
import threading

from gigrl.data import qa
from gigrl.search import server
from gigrl.search.bm25 import BM25Retriever, resolve_cache_dir

PROG = "gigrl-serve-retriever"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog=PROG,
      description="Serve BM25 over a Search-R1 corpus with the Search-R1 HTTP protocol.")
  p.add_argument("--corpus", default="bundled",
                 help="Search-R1 corpus jsonl ({id, contents} per line) or 'bundled'")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
  p.add_argument("--topk", type=int, default=3, help="default topk per query")
  p.add_argument("--index_cache", default="auto",
                 help="BM25 index cache: 'auto' ($GIGRL_CACHE_DIR/bm25, else "
                      "~/.cache/gigrl/bm25), a directory, or '' to build every time")
  args = p.parse_args(argv)
  if args.topk < 1:
    p.error("--topk must be >= 1")
  if not 0 <= args.port <= 65535:
    p.error("--port must be in 0..65535")
  return args


def run(argv: list[str] | None = None) -> None:
  """Entry point of ``gigrl-serve-retriever``; serves until interrupted.

  Prints ``serving N docs on http://host:port/retrieve`` once ready.
  Exits with status 2 and one line on a bad corpus (DataError/missing file), bad flags or
  an address it cannot listen on.
  """
  args = parse_args(argv)
  try:
    retriever = BM25Retriever.from_corpus(args.corpus,
                                          cache_dir=resolve_cache_dir(args.index_cache))
  except (qa.DataError, OSError, ValueError) as e:
    print(f"{PROG}: error: cannot load corpus: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    httpd, url = server.serve_in_thread(retriever, args.host, args.port, topk=args.topk)
  except OSError as e:                 # port in use, address not available, ...
    print(f"{PROG}: error: cannot listen on {args.host}:{args.port}: "
          f"{e.strerror or e}", file=sys.stderr)
    sys.exit(2)
  print(f"serving {retriever.num_docs} docs on {url}", flush=True)
  try:
    threading.Event().wait()
  except KeyboardInterrupt:
    pass
  finally:
    httpd.shutdown()
    httpd.server_close()


if __name__ == "__main__":
  run()
