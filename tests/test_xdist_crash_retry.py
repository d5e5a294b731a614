"""tests/_xdist_crash_retry.py: under `-n 2 --dist loadfile`, a test whose worker dies runs once
more on a replacement worker and the rest of its file still runs; an ordinary failure is not
rerun; a test that kills every worker it runs on fails the run instead of hanging it or leaving
it green. Each case is a small pytest run in a subprocess (no jax)."""
import os
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytest_plugins = ["pytester"]

_CRASHES_ONCE = """
import os
def test_a_before():
  pass
def test_b_aborts_once():
  flag = os.path.join(os.path.dirname(__file__), "crashed")
  if not os.path.exists(flag):
    open(flag, "w").close()
    os.abort()
def test_c_after():
  pass
def test_d_fails():
  assert False, "an ordinary failure"
"""

_CRASHES_ALWAYS = """
import os
def test_aborts():
  os.abort()
def test_after():
  pass
"""

_OTHER = """
def test_x():
  pass
def test_y():
  pass
"""


def _run(pytester, files, *args):
  shutil.copy(os.path.join(HERE, "_xdist_crash_retry.py"), pytester.path)
  pytester.makeconftest("from _xdist_crash_retry import pytest_sessionfinish, "
                        "pytest_xdist_make_scheduler  # noqa: F401\n")
  pytester.makepyfile(**files)
  # the repository's pytest.ini is not read here: only what these arguments say
  return pytester.runpytest_subprocess(
      "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
      "--reruns", "1", "--only-rerun", "(?!)never-an-error", *args, timeout=120)


def test_a_crashed_test_reruns_and_its_file_finishes(pytester):
  result = _run(pytester, {"test_one": _CRASHES_ONCE, "test_two": _OTHER},
                "--max-worker-restart=2")
  outcomes = result.parseoutcomes()
  assert (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("rerun")) == (5, 1, 1), \
      result.stdout.str()
  assert "test_d_fails" in result.stdout.str()                   # the ordinary failure
  assert "test_b_aborts_once" not in "".join(
      line for line in result.stdout.lines if line.startswith("FAILED"))


@pytest.mark.parametrize("restarts", [0, 2])
def test_a_test_that_always_crashes_fails_the_run(pytester, restarts):
  result = _run(pytester, {"test_one": _CRASHES_ALWAYS, "test_two": _OTHER},
                f"--max-worker-restart={restarts}")
  assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
  assert "test_aborts" in result.stdout.str()
