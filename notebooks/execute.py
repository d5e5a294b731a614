"""Executes notebooks through a Jupyter kernel and saves them with their outputs.

  python notebooks/execute.py                       # every notebook, full size, in place
  GIGRL_NOTEBOOK_CI=1 python notebooks/execute.py paper_claims.ipynb   # CI size
  python notebooks/execute.py --figures             # only re-export the headline figures

Used to refresh the committed outputs (full size, once) after a change; tests/test_notebooks.py
runs the same kernel at CI size without saving. Each notebook's cell tagged ``headline`` has its
figure written to ``docs/figures/<notebook>.png`` (shown in the README; tests/test_notebooks.py
checks the two agree).
"""
from __future__ import annotations

import base64
import glob
import os
import sys
import time

import nbformat
from nbclient import NotebookClient

NB_DIR = os.path.dirname(os.path.abspath(__file__))
FIGURE_DIR = os.path.join(os.path.dirname(NB_DIR), "docs", "figures")
HEADLINE_TAG = "headline"


def headline_png(nb) -> bytes | None:
  """PNG bytes of the first image output of the notebook's cell tagged ``headline``, or None."""
  for cell in nb.cells:
    if HEADLINE_TAG in cell.get("metadata", {}).get("tags", []):
      for out in cell.get("outputs", []):
        if "image/png" in out.get("data", {}):
          return base64.b64decode(out["data"]["image/png"])
  return None


def figure_path(name: str) -> str:
  """``docs/figures/<stem>.png`` for notebook ``name`` (e.g. ``paper_claims.ipynb``)."""
  return os.path.join(FIGURE_DIR, os.path.splitext(name)[0] + ".png")


def export_figure(name: str, nb=None) -> None:
  """Writes :func:`figure_path` from the notebook's headline cell (if it has one); ``nb`` is the
  notebook in memory, else the saved file is read."""
  if nb is None:
    nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
  png = headline_png(nb)
  if png is not None:
    os.makedirs(FIGURE_DIR, exist_ok=True)
    with open(figure_path(name), "wb") as f:
      f.write(png)


def execute(name: str, timeout: int = 3600) -> None:
  """Runs ``notebooks/<name>`` top to bottom (cwd = notebooks/) and writes it back with outputs.

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised (the notebook is still saved, with the
      error in that cell's output).
  """
  path = os.path.join(NB_DIR, name)
  nb = nbformat.read(path, as_version=4)
  t0 = time.time()
  try:
    # coalesce_streams: a cell's stdout/stderr pieces are merged and \r-overwritten as Jupyter
    # shows them, so a progress bar is saved as its final line, not one output per update.
    NotebookClient(nb, timeout=timeout, kernel_name="python3", coalesce_streams=True,
                   resources={"metadata": {"path": NB_DIR}}).execute()
  finally:
    nbformat.write(nb, path)
    print(f"{name}: {time.time() - t0:.0f} s", file=sys.stderr)
  if os.environ.get("GIGRL_NOTEBOOK_CI") != "1":      # CI-size figures are not the README's
    export_figure(name, nb)


def _cpu_only_without_a_tpu() -> None:
  """On a host with no TPU device (/dev/accel*, /dev/vfio/N), run the kernels with
  JAX_PLATFORMS=cpu: with the ``tpu`` extra installed, jax's TPU probe otherwise writes libtpu's
  start-up errors into the saved outputs."""
  if "JAX_PLATFORMS" not in os.environ and not (
      glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
    os.environ["JAX_PLATFORMS"] = "cpu"


if __name__ == "__main__":
  figures_only = "--figures" in sys.argv[1:]
  names = [a for a in sys.argv[1:] if a != "--figures"]
  _cpu_only_without_a_tpu()
  for n in names or sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb")):
    if figures_only:
      export_figure(os.path.basename(n))
    else:
      execute(os.path.basename(n))
