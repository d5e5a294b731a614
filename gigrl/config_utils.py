"""Validation helpers shared by every config section.

Every section of the ml_collections config (``data``, ``model``, ``rollout``,
``search``, ``advantage``, ``loss``, ``train``, ``checkpoint``) is validated at
start-up by the module that owns it. A bad value raises :class:`ConfigError`,
whose message names the dotted field, the bad value and what is allowed. Every
error a user can cause derives from :class:`UserError`.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Iterable


class UserError(Exception):
  """An error the user can fix (a config value, a data file, a server, a path).

  ``gigrl-train`` prints its message as one line (no traceback) and exits with
  status 2. Subclasses: :class:`ConfigError`, ``gigrl.data.qa.DataError``.
  """


class ConfigError(UserError, ValueError):
  """A config field holds a value that is not allowed.

  Attributes:
    field: dotted path of the field, e.g. ``"advantage.outcome"``.
    value: the offending value.
    allowed: human-readable description of what is allowed.
  """

  def __init__(self, field: str, value: Any, allowed: str):
    self.field, self.value, self.allowed = field, value, allowed
    super().__init__(
        f"config field '{field}' has bad value {value!r}; allowed: {allowed}")


def get_field(cfg: Any, field: str) -> Any:
  """Returns ``cfg.a.b.c`` for ``field='a.b.c'``; ConfigError if missing."""
  node = cfg
  for part in field.split("."):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise ConfigError(field, "<missing>", "the field must exist") from None
  return node


def check_choice(cfg: Any, field: str, choices: Iterable[Any]) -> Any:
  """Checks that ``cfg.<field>`` is one of ``choices``; returns the value."""
  choices = tuple(choices)
  value = get_field(cfg, field)
  if value not in choices:
    raise ConfigError(field, value, "one of " + ", ".join(map(repr, choices)))
  return value


def check_range(cfg: Any, field: str, lo: float | None = None,
                hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False, integer: bool = False) -> Any:
  """Checks ``lo <= cfg.<field> <= hi`` (open ends if asked); returns it."""
  value = get_field(cfg, field)
  lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
  hi_s = "" if hi is None else (f"< {hi}" if hi_open else f"<= {hi}")
  kind = "an integer" if integer else "a number"
  desc = " and ".join(s for s in (kind, lo_s, hi_s) if s)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ConfigError(field, value, desc)
  if integer and not isinstance(value, int):
    raise ConfigError(field, value, desc)
  if lo is not None and (value <= lo if lo_open else value < lo):
    raise ConfigError(field, value, desc)
  if hi is not None and (value >= hi if hi_open else value > hi):
    raise ConfigError(field, value, desc)
  return value


def host_port(field: str, value: str) -> tuple[str, int]:
  """Reads ``value``, the config field ``field``, as ``host:port`` (the host may hold colons, as
  an IPv6 address does).

  Returns:
    ``(host, port)``, the port an int in [1, 65535].
  Raises:
    ConfigError: naming the field when the value is not of that form.
  """
  host, _, port = value.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(field, value, "host:port, e.g. localhost:5557")
  return host, int(port)


def check_file(cfg: Any, field: str, what: str) -> str:
  """Checks that ``cfg.<field>`` names a readable file with a non-blank line.

  Args:
    cfg: the config (or a dict holding the section).
    field: dotted field name, e.g. ``"data.questions_file"``.
    what: what the file should be, for the message (e.g. "a Search-R1 corpus jsonl").
  Returns:
    The path.
  Raises:
    ConfigError: naming the field when the path is not a string, does not
      exist, is not a file, cannot be read or holds only blank lines.
  """
  path = get_field(cfg, field)
  if not isinstance(path, str) or not path:
    raise ConfigError(field, path, f"the path of {what}")
  if not os.path.isfile(path):
    problem = "is a directory" if os.path.isdir(path) else "does not exist"
    raise ConfigError(field, path, f"the path of {what} ({path} {problem})")
  try:
    with open(path, "rb") as f:
      has_content = any(line.strip() for line in f)
  except OSError as e:
    raise ConfigError(field, path, f"a readable file ({e.strerror})") from None
  if not has_content:
    raise ConfigError(field, path, f"{what} with at least one row (the file is empty)")
  return path


def check_writable_dir(path: str, what: str) -> None:
  """Creates ``path`` if needed and checks a file can be written in it (local paths).

  Raises:
    UserError: naming ``what`` (e.g. ``--workdir``), the path and the OS error.
  """
  if "://" in path:          # gs://... (pods): created and checked by its writers
    return
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f"{what} {path}: exists and is not a directory")
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".gigrl-write-test-{uuid.uuid4().hex}")
    with open(probe, "w", encoding="utf-8"):
      pass
    os.remove(probe)
  except OSError as e:
    raise UserError(f"{what} {path}: cannot write there ({e.strerror or e})") from None


def cache_root() -> str:
  """gigrl's cache directory (model snapshots, BM25 indexes, compiled programs):
  ``$GIGRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/gigrl``, else ``~/.cache/gigrl``."""
  root = os.environ.get("GIGRL_CACHE_DIR")
  if root:
    return root
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or
                      os.path.join(os.path.expanduser("~"), ".cache"), "gigrl")
