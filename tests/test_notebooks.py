"""The notebooks run top to bottom (code cells executed in order, plots to a null backend)."""
import json
import os

import matplotlib
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(plt, "show", lambda *a, **k: plt.close("all"))
  with open(os.path.join(ROOT, "notebooks", name)) as f:
    nb = json.load(f)
  scope = {"__name__": "__notebook__"}
  for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
    src = "".join(cell["source"])
    exec(compile(src, f"{name}[cell {i}]", "exec"), scope)  # pylint: disable=exec-used
