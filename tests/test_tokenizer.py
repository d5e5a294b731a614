"""The bundled sentencepiece tokenizer: tags are single pieces, round trips are lossless."""
import pytest

from gigrl.data import tokenizer as tok_lib
from gigrl.data import tags
from gigrl.rollout import protocol


@pytest.fixture(scope="module")
def tok():
  return tok_lib.SentencePieceTokenizer()


@pytest.mark.parametrize("tag", tok_lib.TAGS)
def test_tags_are_single_pieces(tok, tag):
  ids = tok.encode(tag)
  assert len(ids) == 1 and tok.decode(ids) == tag
  # ... also inside running text
  text = f"before{tag}after"
  assert tok.token_id(tag) in tok.encode(text)


@pytest.mark.parametrize("text", [
    protocol.make_prompt("Who wrote Nobody Loves You"),
    protocol.INVALID_ACTION_MSG,
    protocol.format_observation('Doc 1(Title: "Zürich") Ünïcödé — 東京 text\n'),
    "<think> a\n\n b </think>\n<answer>  x </answer>",
])
def test_round_trip_is_lossless(tok, text):
  assert tok.decode(tok.encode(text)) == text


def test_special_ids(tok):
  assert (tok.pad_id, tok.eos_id) == (0, 3)
  assert tok.vocab_size == 8192


def test_retrain_small(tmp_path):
  path = tok_lib.train(str(tmp_path / "t.model"), vocab_size=2048)
  t = tok_lib.SentencePieceTokenizer(path)
  assert t.vocab_size == 2048 and len(t.encode("</search>")) == 1


def test_data_imports_nothing_from_rollout():
  """gigrl.data is below gigrl.rollout: the tags come from the leaf module gigrl.data.tags."""
  import subprocess
  import sys
  code = ("import sys, gigrl.data.tokenizer, gigrl.data.hf_tokenizer, gigrl.data.qa, "
          "gigrl.data.pool; bad = sorted(m for m in sys.modules if m.startswith('gigrl.rollout'))"
          "; assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)
  assert tok_lib.TAGS == tags.TAGS
