#!/usr/bin/env bash
# Runs every notebook as a fresh Colab runtime would: a new venv that has jax and Jupyter but no
# gigrl, the notebook copied alone into an empty directory, and its install cell pointed at a
# bare clone of this checkout's HEAD (GIGRL_REPO is the only line changed). The install cell then
# clones and pip-installs gigrl; the notebooks run at CI size (GIGRL_NOTEBOOK_CI=1) through a real
# kernel. Prints jax's version before and after the install (it must not change).
#
#   notebooks/check_install.sh [JAX_SPEC]     # default JAX_SPEC: jax==0.10.2
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
jax_spec="${1:-jax==0.10.2}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/gigrl-colab.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$jax_spec" ipykernel nbclient nbformat matplotlib
before="$("$tmp/venv/bin/python" -c 'import jax; print(jax.__version__)')"
git clone -q --bare "$src" "$tmp/origin.git"
mkdir "$tmp/work"
cd "$tmp/work"
for nb in $(git -C "$tmp/origin.git" ls-tree --name-only HEAD notebooks/ | grep '\.ipynb$'); do
  git -C "$tmp/origin.git" show "HEAD:$nb" > "$(basename "$nb")"
done
GIGRL_NOTEBOOK_CI=1 JAX_PLATFORMS=cpu MPLBACKEND=Agg GIGRL_NOTEBOOK_WORKDIR="$tmp/nbwork" \
ORIGIN="file://$tmp/origin.git" "$tmp/venv/bin/python" - <<'PY'
import glob, os, time
import nbformat
from nbclient import NotebookClient
for path in sorted(glob.glob("*.ipynb")):
  nb = nbformat.read(path, as_version=4)
  cell = next(c for c in nb.cells if c.cell_type == "code")
  lines = [l for l in cell.source.splitlines() if l.startswith("GIGRL_REPO = ")]
  assert len(lines) == 1, f"{path}: the install cell sets GIGRL_REPO once"
  cell.source = cell.source.replace(lines[0], f'GIGRL_REPO = "{os.environ["ORIGIN"]}"')
  t0 = time.time()
  NotebookClient(nb, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": "."}}).execute()
  said = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout").strip()
  print(f"{path}: ran in {time.time() - t0:.0f} s; install cell: {said.splitlines()[-1]}")
PY
after="$("$tmp/venv/bin/python" -c 'import jax; print(jax.__version__)')"
echo "jax before the install cell: $before; after: $after"
[[ "$before" == "$after" ]]
