"""Import structure of the package, read from the source with ``ast`` (nothing is imported).

* No import cycles among gigrl modules (function-level imports count too).
* Imports go downward only, in the order of the data flow: data -> rollout (models, search,
  reward) -> advantages -> update (loss, step) -> training -> cli (docs/architecture.md). A
  module imports modules of its own layer or lower ones.
* The estimators (``gigrl.advantages``) import nothing of gigrl but ``gigrl.config_utils``;
  ``gigrl.advantages.inputs`` alone reads rollout batches.
* ``gigrl.data`` imports nothing from ``gigrl.rollout`` (the Search-R1 tags are in
  ``gigrl.data.tags``); ``gigrl.models`` and ``gigrl.search`` do not import each other; no package
  module imports ``gigrl.testing`` (it is for tests and benchmarks).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "gigrl"

# Layers, lowest first; a module's layer is that of its longest matching prefix (the root
# package "gigrl" matches only itself, so a new top-level module must be given a layer here).
LAYERS = (
    ("base", ("gigrl", "gigrl.config_utils", "gigrl.distributed")),
    ("data", ("gigrl.data",)),
    ("models/search", ("gigrl.models", "gigrl.search")),
    ("rollout", ("gigrl.rollout",)),
    ("advantages", ("gigrl.advantages",)),
    ("update", ("gigrl.update",)),
    ("training", ("gigrl.training", "gigrl.config", "gigrl.testing")),
    ("cli", ("gigrl.cli",)),
)


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PKG.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str) -> str | None:
  """``gigrl.a.b.attr`` -> the longest prefix that is a gigrl module (None if outside)."""
  parts = name.split(".")
  for n in range(len(parts), 0, -1):
    candidate = ".".join(parts[:n])
    if candidate in MODULES:
      return candidate
  return None


def imports_of(module: str) -> dict[str, int]:
  """gigrl modules ``module`` imports (anywhere in the file) -> first line number."""
  path = MODULES[module]
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  out: dict[str, int] = {}
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
    names: list[str] = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      names = [f"{base}.{a.name}" for a in node.names]
    for name in names:
      target = _resolve(name)
      if target and target != module:
        out.setdefault(target, node.lineno)
  return out


GRAPH = {m: imports_of(m) for m in MODULES}


def layer_of(module: str) -> int:
  best, rank = -1, None
  for i, (_, prefixes) in enumerate(LAYERS):
    for prefix in prefixes:
      covers = module == prefix or (prefix != "gigrl" and module.startswith(prefix + "."))
      if covers and len(prefix) > best:
        best, rank = len(prefix), i
  assert rank is not None, f"{module} has no layer: add it to LAYERS in tests/test_imports.py"
  return rank


def test_every_module_has_a_layer():
  for m in MODULES:
    layer_of(m)


def _cycles() -> list[list[str]]:
  """The cycles found by a DFS (each reported once, as a path that returns to its start)."""
  found, state, stack = [], {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for dep in sorted(GRAPH[m]):
      if state.get(dep) == "open":
        found.append(stack[stack.index(dep):] + [dep])
      elif dep not in state:
        visit(dep)
    stack.pop()
    state[m] = "done"

  for m in sorted(GRAPH):
    if m not in state:
      visit(m)
  return found


def test_no_import_cycles():
  cycles = _cycles()
  assert not cycles, "import cycles:\n" + "\n".join(
      " -> ".join(f"{a} (line {GRAPH[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
      for c in cycles)


def test_imports_go_downward():
  bad = [f"{m}:{line} imports {dep} ({LAYERS[layer_of(dep)][0]} is above "
         f"{LAYERS[layer_of(m)][0]})"
         for m, deps in sorted(GRAPH.items()) for dep, line in sorted(deps.items())
         if layer_of(dep) > layer_of(m)]
  assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("package,allowed", [
    # the estimators; gigrl.advantages.inputs, the bridge from a rollout batch, is checked below
    ("gigrl.advantages", ("gigrl.advantages", "gigrl.config_utils")),
    ("gigrl.advantages.inputs", ("gigrl.advantages", "gigrl.rollout")),
    ("gigrl.data", ("gigrl.data", "gigrl.config_utils")),
    ("gigrl.models", ("gigrl.models", "gigrl.config_utils")),
    ("gigrl.search", ("gigrl.search", "gigrl.config_utils", "gigrl.data")),
    ("gigrl.update.loss", ("gigrl.config_utils",)),
])
def test_package_imports_only(package, allowed):
  exempt = "gigrl.advantages.inputs" if package == "gigrl.advantages" else None
  bad = [f"{m}:{line} imports {dep}"
         for m, deps in sorted(GRAPH.items())
         if (m == package or m.startswith(package + ".")) and m != exempt
         for dep, line in sorted(deps.items())
         if not any(dep == a or dep.startswith(a + ".") for a in allowed)]
  assert not bad, f"{package} may import only {allowed}:\n" + "\n".join(bad)


def test_nothing_in_the_package_imports_testing():
  bad = [f"{m}:{deps['gigrl.testing']}" for m, deps in GRAPH.items() if "gigrl.testing" in deps]
  assert not bad, bad


def test_the_checker_sees_imports():
  # Guards against a checker that passes because it finds nothing.
  assert "gigrl.data.qa" in GRAPH["gigrl.search.bm25"]
  assert "gigrl.advantages.grpo" in GRAPH["gigrl.advantages.gigpo"]
  assert sum(len(d) for d in GRAPH.values()) > 50


def test_layout_four_loose_modules_and_a_short_trainer():
  """The layout of issue #31 (kept in #50): at most 4 loose modules in ``gigrl/`` (every other
  module sits in the stage package it serves) and the Trainer under 250 lines."""
  loose = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
  assert len(loose) <= 4, loose
  lines = (PKG / "training" / "trainer.py").read_text(encoding="utf-8").count("\n")
  assert lines < 250, f"gigrl/training/trainer.py has {lines} lines"
