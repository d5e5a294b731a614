"""The console scripts re-execute once with glibc's transparent-huge-page tunable (gigrl.cli.huge_pages)."""
from __future__ import annotations

import os
import subprocess
import sys

from gigrl.cli import huge_pages

_PRINT = ("from gigrl.cli import huge_pages; huge_pages.reexec(); import os; "
          "print(os.environ.get('GLIBC_TUNABLES'), os.getpid())")


ALL = ":".join(huge_pages.TUNABLES)


def test_the_tunables_are_appended_once_and_never_on_other_platforms_or_when_opted_out():
  assert huge_pages.environment({}, "linux")["GLIBC_TUNABLES"] == ALL
  env = huge_pages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "b"}, "linux")
  assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:" + ALL, "A": "b"}
  assert huge_pages.environment(env, "linux") is None                 # the re-exec'd process
  users = ":".join(t.split("=")[0] + "=0" for t in huge_pages.TUNABLES)   # the user's values win
  assert huge_pages.environment({"GLIBC_TUNABLES": users}, "linux") is None
  assert huge_pages.environment({"GIGRL_HUGE_PAGES": "0"}, "linux") is None
  assert huge_pages.environment({}, "darwin") is None


def _run(env):
  out = subprocess.run([sys.executable, "-c", _PRINT], env=env, capture_output=True, text=True,
                       check=True, timeout=60)
  return out.stdout.split()


def test_reexec_replaces_the_process_with_the_tunable_set():
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "GIGRL_HUGE_PAGES")}
  tunables, _ = _run(env)
  assert tunables == ALL
  tunables, _ = _run(dict(env, GIGRL_HUGE_PAGES="0"))
  assert tunables == "None"


def test_every_console_script_goes_through_the_entry_module():
  import pathlib, re  # pylint: disable=g-import-not-at-top,multiple-imports
  setup = (pathlib.Path(__file__).resolve().parents[1] / "setup.py").read_text()
  scripts = re.findall(r'"(gigrl-[\w-]+)=([\w.]+):(\w+)"', setup)
  assert len(scripts) == 8
  from gigrl.cli import entry  # pylint: disable=g-import-not-at-top
  for name, module, fn in scripts:
    assert module == "gigrl.cli.entry" and callable(getattr(entry, fn)), name
