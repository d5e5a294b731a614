"""Every notebook runs top to bottom through a real Jupyter kernel (nbclient + ipykernel) at CI size.

``GIGRL_NOTEBOOK_CI=1`` shrinks each notebook's runs to a few steps; a cell that raises fails the
test with the cell's traceback. The notebooks share one work directory (the advantage and claims
notebooks reuse the tiny run's checkpoint), so the first one to run trains it.
"""
import os

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("notebooks"))


def test_notebooks_found():
  assert {"advantage_estimators.ipynb", "paper_claims.ipynb",
          "countries_agent.ipynb"} <= set(NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, workdir, monkeypatch):
  monkeypatch.setenv("GIGRL_NOTEBOOK_CI", "1")
  monkeypatch.setenv("GIGRL_NOTEBOOK_WORKDIR", workdir)
  monkeypatch.setenv("GIGRL_REPO_DIR", ROOT)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": NB_DIR}})
  try:
    client.execute()
  except CellExecutionError as e:
    pytest.fail(f"{name}: a cell raised\n{e}", pytrace=False)


def test_readme_figures_are_the_notebooks_headline_figures():
  """docs/figures/<notebook>.png (shown in the README) is the committed notebook's figure of its
  cell tagged ``headline`` (notebooks/execute.py writes both; --figures re-exports)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("nb_execute", os.path.join(NB_DIR, "execute.py"))
  execute = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(execute)
  for name in NOTEBOOKS:
    png = execute.headline_png(nbformat.read(os.path.join(NB_DIR, name), as_version=4))
    assert png is not None, f"{name}: no cell tagged 'headline' with a figure"
    path = execute.figure_path(name)
    with open(path, "rb") as f:
      assert f.read() == png, f"{path} differs from {name}'s headline figure: " \
                              "python notebooks/execute.py --figures"
