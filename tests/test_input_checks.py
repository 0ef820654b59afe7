"""Nothing accepted silently, and short runs just work: a source that is not text or too small, a
fault the run never reaches, a warmup longer than the run."""

import json
import os

import numpy as np
import pytest

from decoupled_diloco import errors
from decoupled_diloco import settings
from decoupled_diloco.lm import data
from decoupled_diloco.lm import documents
from decoupled_diloco.lm import inner
from decoupled_diloco.lm import tokenizers
from experiments import tiny_cpu


def _config(tmp_path, **fields):
  config = tiny_cpu.get_config()
  config.workdir = str(tmp_path / "run")
  config.update_from_flattened_dict(fields)
  return config


def test_a_binary_source_is_refused_with_the_share_of_bad_bytes(tmp_path):
  binary = tmp_path / "program"
  # An executable's start: headers, NUL padding, code bytes.
  binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(200) + bytes(range(256)) * 40)
  with pytest.raises(errors.InputError) as refused:
    settings.validate(_config(tmp_path, **{"data.source": str(binary)}))
  message = str(refused.value)
  assert message.startswith(f"config.data.source={str(binary)!r} is invalid: not text")
  share = documents.binary_share(binary.read_bytes())
  assert f"{share:.0%} of its first" in message
  assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not os.path.isfile("/bin/ls"), reason="no /bin/ls on this host")
def test_bin_ls_is_not_text():
  with open("/bin/ls", "rb") as f:
    assert documents.binary_share(f.read(documents.SNIFF_BYTES)) > documents.MAX_BINARY_SHARE


def test_text_in_a_legacy_encoding_still_trains(tmp_path):
  """Latin-1 French is a few percent non-UTF-8 bytes: the byte tokenizer reads it as it is."""
  latin1 = tmp_path / "roman.txt"
  latin1.write_bytes(("Il était une fois une élève qui aimait les châteaux. " * 400)
                     .encode("latin-1"))
  assert 0 < documents.binary_share(latin1.read_bytes()) < documents.MAX_BINARY_SHARE
  run = settings.validate(_config(tmp_path, **{"data.source": str(latin1)}))
  assert run.data.source == str(latin1)


def test_a_directory_names_the_file_that_is_not_text(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "a.txt").write_text("to be or not to be\n" * 100)
  (corpus / "b.txt").write_bytes(bytes(4096))
  with pytest.raises(errors.InputError, match=r"not text \(.*b\.txt\): 100% of"):
    settings.validate(_config(tmp_path, **{"data.source": str(corpus)}))


@pytest.mark.parametrize("size", [3, 2048])
def test_a_corpus_too_small_for_the_run_is_named_with_what_it_makes(tmp_path, size):
  corpus = tmp_path / "tiny.txt"
  corpus.write_bytes((b"to be or not to be, that is the question. " * 100)[:size])
  with pytest.raises(errors.InputError) as refused:
    data.load_dataset(str(corpus), tokenizer=tokenizers.load("byte"), text_field="text",
                      seq_len=128, eval_fraction=0.05, min_train_windows=64, min_eval_windows=16)
  message = str(refused.value)
  assert message.startswith(f"config.data.source={str(corpus)!r} is too small for this run")
  train_windows = (size - round(size * 0.05)) // 129
  assert f"makes {train_windows} training and 0 eval windows" in message
  assert "the run needs 64 and 16" in message
  # What it asks for is enough: that many tokens load.
  needed = int(message.split("about ")[1].split(" tokens")[0].replace(",", ""))
  corpus.write_bytes(np.random.default_rng(0).integers(32, 127, needed + 129).astype(
      np.uint8).tobytes())
  data.load_dataset(str(corpus), tokenizer=tokenizers.load("byte"), text_field="text",
                    seq_len=128, eval_fraction=0.05, min_train_windows=64, min_eval_windows=16)


def test_a_jsonl_whose_records_are_all_bad_is_named_with_the_skip_counts(tmp_path):
  corpus = tmp_path / "bad.jsonl"
  corpus.write_text("\n".join([json.dumps({"title": "no text"})] * 3 + ["{broken"] * 2) + "\n")
  with pytest.raises(errors.InputError) as refused:
    data.load_dataset(str(corpus), tokenizer=tokenizers.load("byte"), text_field="text",
                      seq_len=16, eval_fraction=0.05)
  message = str(refused.value)
  assert message.startswith(f"config.data.source={str(corpus)!r} is invalid: it holds no text")
  assert "5 records skipped: 3 missing_field, 2 bad_json" in message


def test_a_fault_the_run_never_reaches_is_refused_naming_the_last_step(tmp_path):
  config = _config(tmp_path, **{"num_steps": 4,
                                "chaos.schedule": "crash@learner=1,step=1000,down_s=1"})
  with pytest.raises(ValueError) as refused:
    settings.validate(config)
  message = str(refused.value)
  assert "config.chaos.schedule" in message and "step=1000 is never reached" in message
  assert "the run's last step is 3 (config.num_steps=4)" in message
  # The last step itself is reached.
  config.chaos.schedule = "crash@learner=1,step=3,down_s=1"
  assert settings.validate(config).chaos.faults[0].step == 3


def test_a_short_run_scales_its_warmup_and_the_default_keeps_its_own(tmp_path):
  default = settings.validate(_config(tmp_path))
  assert default.inner.warmup_steps == tiny_cpu.get_config().inner.warmup_steps == 40
  short = settings.validate(_config(tmp_path, num_steps=4))
  assert short.inner.warmup_steps == 2
  rates = inner.learning_rates(short.inner, 4)
  assert rates[0] == 0 and rates.max() == pytest.approx(short.inner.learning_rate)
  assert settings.validate(_config(tmp_path, num_steps=1)).inner.warmup_steps == 0


@pytest.mark.parametrize("warmup, steps, used", [(40, 400, 40), (40, 80, 40), (40, 79, 39),
                                                 (40, 10, 5), (0, 3, 0), (5, 1, 0)])
def test_the_warmup_is_at_most_half_the_run(warmup, steps, used):
  assert inner.warmup_for_run(warmup, steps) == used
