"""Tokenizers: bytes, and SentencePiece / tokenizers BPE trained offline on the bundled corpus."""

import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from decoupled_diloco import errors
from decoupled_diloco.lm import data
from decoupled_diloco.lm import tokenizers

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Newlines, runs of spaces, digits, accents and a character the training text never had.
_SAMPLE = "First Citizen:\n  Before we proceed any further, hear me speak.\n\n1603 héllo ✓ end\n"


@pytest.fixture(scope="module")
def corpus_slice() -> str:
  with open(data.default_corpus_path(), encoding="utf-8") as f:
    return f.read()[:60_000]


def test_byte_tokenizer_is_the_utf8_bytes():
  tok = tokenizers.load("byte")
  ids = tok.encode("hé")
  assert (tok.name, tok.vocab_size, tok.eos_id) == ("byte", 256, None)
  assert ids.tolist() == [104, 0xC3, 0xA9]
  assert tok.decode(ids) == "hé" and tok.num_bytes(ids) == 3
  # A window that cuts a character decodes with a replacement mark, never an error.
  assert tok.decode(ids[:2]) == "h\ufffd"


@pytest.mark.parametrize("extension", [".model", ".json"])
def test_trained_tokenizer_round_trips_text_and_counts_its_bytes(tmp_path, corpus_slice, extension):
  out = str(tmp_path / f"tiny{extension}")
  tok = tokenizers.train([corpus_slice], 384, out)
  again = tokenizers.load(out)
  assert again.vocab_size == tok.vocab_size == 384 and again.fingerprint == tok.fingerprint
  assert tok.eos_id is not None and tok.num_bytes([tok.eos_id]) == 0
  ids = again.encode(_SAMPLE)
  assert again.decode(ids) == _SAMPLE
  assert again.num_bytes(ids) == len(_SAMPLE.encode("utf-8"))
  # Merges learnt on Shakespeare compress Shakespeare: fewer tokens than bytes.
  held_out = corpus_slice[-5000:]
  assert len(again.encode(held_out)) < 0.8 * len(held_out.encode("utf-8"))


def test_load_errors_name_config_data_tokenizer(tmp_path):
  with pytest.raises(errors.InputError, match=r"config\.data\.tokenizer='.*absent\.model': no such"):
    tokenizers.load(str(tmp_path / "absent.model"))
  with pytest.raises(ValueError, match=r"config\.data\.tokenizer='gpt2': unknown kind"):
    tokenizers.load("gpt2")
  (tmp_path / "broken.json").write_text("{not json", encoding="utf-8")
  with pytest.raises(ValueError, match=r"config\.data\.tokenizer=.*not a Hugging Face"):
    tokenizers.load(str(tmp_path / "broken.json"))
  (tmp_path / "broken.model").write_bytes(b"\x00garbage")
  with pytest.raises(ValueError, match=r"config\.data\.tokenizer=.*not a SentencePiece"):
    tokenizers.load(str(tmp_path / "broken.model"))


def test_eval_bytes_of_the_byte_tokenizer_are_its_targets_so_bpb_is_loss_over_ln2():
  tokens = np.frombuffer(b"abcdefghij" * 40, np.uint8)
  batches = data.make_eval_batches(tokens, seq_len=8, batch_size=4, max_batches=2)
  targets = sum(b["targets"].size for b in batches)
  assert data.eval_bytes(batches, tokenizers.load("byte")) == targets
  loss = 1.7
  assert loss * targets / (data.eval_bytes(batches, tokenizers.load("byte")) * math.log(2)) == (
      pytest.approx(loss / math.log(2)))


def test_train_tokenizer_script_writes_the_file_its_extension_names(tmp_path, corpus_slice):
  text = tmp_path / "slice.txt"
  text.write_text(corpus_slice, encoding="utf-8")
  out = tmp_path / "bpe.json"
  subprocess.run([sys.executable, str(_ROOT / "scripts" / "train_tokenizer.py"), f"--input={text}",
                  "--vocab_size=300", f"--out={out}"], check=True, capture_output=True,
                 cwd=_ROOT, timeout=120)
  assert os.path.isfile(out) and tokenizers.load(str(out)).vocab_size == 300
