"""Text and ArrayRecord sources: bad records skipped and counted, prepared shards read back, and a
run trained end to end on shards made with a trained tokenizer."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import tiny_settings
from decoupled_diloco import settings
from decoupled_diloco.lm import array_records
from decoupled_diloco.lm import data
from decoupled_diloco.lm import documents
from decoupled_diloco.lm import tokenizers
from experiments import tiny_cpu

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# One of each bad record, among good ones.
_BAD_LINES = [
    b"",  # an empty line
    b'{"title": "no text"}',  # the text field is missing
    b'{"text": "caf\xe9"}',  # Latin-1, not UTF-8
    b'{"text": "broken',  # not JSON
    b'["a", "list"]',  # JSON, not an object
    b'{"text": "   "}',  # a document of nothing
]
_SKIPPED = {"empty": 2, "missing_field": 1, "invalid_utf8": 1, "bad_json": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
  """Two .jsonl files of Shakespeare's speeches (50 KB), the bad records in the first."""
  with open(data.default_corpus_path(), encoding="utf-8") as f:
    speeches = f.read()[:50_000].split("\n\n")
  directory = tmp_path_factory.mktemp("corpus")
  half = len(speeches) // 2
  for name, part, bad in (("a.jsonl", speeches[:half], _BAD_LINES), ("b.jsonl", speeches[half:], [])):
    lines = [json.dumps({"text": s}).encode() for s in part]
    lines[3:3] = bad
    (directory / name).write_bytes(b"\n".join(lines) + b"\n")
  return directory


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory) -> str:
  path = str(tmp_path_factory.mktemp("tok") / "bpe.json")
  skipped = documents.SkipCounter()
  texts = [t for p in documents.text_files(str(corpus))
           for t in documents.read_documents(p, "text", skipped)]
  tokenizers.train(texts, 320, path)
  return path


@pytest.fixture(scope="module")
def shards(corpus, bpe, tmp_path_factory) -> str:
  out = str(tmp_path_factory.mktemp("shards"))
  subprocess.run([sys.executable, str(_ROOT / "scripts" / "prepare_data.py"), f"--input={corpus}",
                  f"--tokenizer={bpe}", "--seq_len=32", f"--out_dir={out}", "--eval_fraction=0.1",
                  "--records_per_shard=100"], check=True, capture_output=True, cwd=_ROOT,
                 timeout=120)
  return out


def test_bad_jsonl_records_are_skipped_and_counted_by_reason(corpus):
  skipped = documents.SkipCounter()
  texts = list(documents.read_documents(str(corpus / "a.jsonl"), "text", skipped))
  assert skipped.as_dict() == _SKIPPED
  assert texts and all(t.strip() for t in texts) and "caf" not in "".join(texts)


def test_parquet_rows_without_text_are_skipped_and_a_missing_column_counts_every_row(tmp_path):
  path = str(tmp_path / "rows.parquet")
  pq.write_table(pa.table({"text": ["to be", None, "", "or not"], "id": [1, 2, 3, 4]}), path)
  skipped = documents.SkipCounter()
  assert list(documents.read_documents(path, "text", skipped)) == ["to be", "or not"]
  assert (skipped["missing_field"], skipped["empty"]) == (1, 1)
  skipped = documents.SkipCounter()
  assert list(documents.read_documents(path, "body", skipped)) == []
  assert skipped["missing_field"] == 4


def test_a_source_is_a_file_a_directory_or_a_glob_in_a_fixed_order(corpus, tmp_path):
  a, b = str(corpus / "a.jsonl"), str(corpus / "b.jsonl")
  assert documents.text_files(str(corpus)) == [a, b]
  assert documents.text_files(str(corpus / "*.jsonl")) == [a, b]
  assert documents.text_files(b) == [b]
  with pytest.raises(ValueError, match=r"config\.data\.source=.*no such file"):
    documents.text_files(str(tmp_path / "absent"))
  with pytest.raises(ValueError, match=r"config\.data\.source=.*holds no \.txt"):
    documents.text_files(str(tmp_path))


def test_prepare_data_writes_shards_and_meta_that_the_loader_reads(corpus, bpe, shards):
  meta = json.loads((pathlib.Path(shards) / "meta.json").read_text(encoding="utf-8"))
  assert meta["tokenizer"] == "tokenizer.json" and meta["vocab_size"] == 320
  assert meta["skipped"] == sum(_SKIPPED.values()) and meta["skipped_by_reason"] == _SKIPPED
  assert len(meta["train"]["shards"]) > 1  # 100 windows a shard
  assert meta["tokens"] + meta["tokens_dropped"] == meta["tokens_read"]
  assert meta["sequences"] == meta["train"]["sequences"] + meta["eval"]["sequences"]
  tok = tokenizers.load(os.path.join(shards, "tokenizer.json"))
  prepared = data.load_dataset(shards, tokenizer=tok, text_field="text", seq_len=32,
                               eval_fraction=0.1)
  # The same windows, in the same order, as the in-memory loader cuts from the same text.
  in_memory = data.load_dataset(str(corpus), tokenizer=tok, text_field="text", seq_len=32,
                                eval_fraction=0.1)
  assert prepared.skipped == in_memory.skipped == _SKIPPED
  for split in ("train", "eval"):
    a, b = getattr(prepared, split), getattr(in_memory, split)
    assert len(a) == len(b) == meta[split]["sequences"]
    for i in (0, 1, len(a) // 2, len(a) - 1):
      np.testing.assert_array_equal(a[i]["inputs"], b[i]["inputs"])
      np.testing.assert_array_equal(a[i]["targets"], b[i]["targets"])
  skipped = documents.SkipCounter()
  assert meta["bytes"] == sum(len(t.encode("utf-8")) for p in documents.text_files(str(corpus))
                              for t in documents.read_documents(p, "text", skipped))


def test_learners_read_disjoint_shards_of_the_records_and_resume_from_the_iterator_state(shards):
  tok = tokenizers.load(os.path.join(shards, "tokenizer.json"))
  dataset = data.load_dataset(shards, tokenizer=tok, text_field="text", seq_len=32,
                              eval_fraction=0.1)
  seen = []
  for shard in range(2):
    loader = data.make_train_loader(dataset.train, seq_len=32, batch_size=1, shard_index=shard,
                                    num_shards=2, seed=0, num_epochs=1)
    seen.append({b["inputs"].tobytes() + b["targets"][:, -1:].tobytes() for b in loader})
  assert seen[0] and seen[1] and not seen[0] & seen[1]
  # Held out: no eval window's text occurs anywhere in the training text (windows are consecutive
  # pieces of the stream, so their text joined is the training text).
  train_text = tok.decode(np.concatenate([dataset.train[i]["inputs"]
                                          for i in range(len(dataset.train))]))
  for i in range(len(dataset.eval)):
    assert tok.decode(dataset.eval[i]["inputs"]) not in train_text, i
  iterator = iter(data.make_train_loader(dataset.train, seq_len=32, batch_size=4, shard_index=1,
                                         num_shards=2, seed=3))
  for _ in range(5):
    next(iterator)
  state = iterator.get_state()
  expected = next(iterator)
  restored = iter(data.make_train_loader(dataset.train, seq_len=32, batch_size=4, shard_index=1,
                                         num_shards=2, seed=3))
  restored.set_state(state)
  np.testing.assert_array_equal(next(restored)["inputs"], expected["inputs"])


def test_settings_take_the_tokenizer_from_meta_and_refuse_another(shards, tmp_path):
  config = tiny_cpu.get_config()
  config.data.source = shards
  config.data.seq_len = 32
  run = settings.validate(config)
  assert run.data.tokenizer == os.path.join(shards, "tokenizer.json")
  assert run.model.vocab_size == 320  # 0 = the tokenizer's
  config.data.tokenizer = "byte"
  with pytest.raises(ValueError, match=r"config\.data\.tokenizer='byte' is invalid: is not the "
                                       r"tokenizer the ArrayRecord shards"):
    settings.validate(config)
  config.data.tokenizer = os.path.join(shards, "tokenizer.json")  # the same file: accepted
  settings.validate(config)
  config.data.seq_len = 64
  with pytest.raises(ValueError, match=r"config\.data\.seq_len=64 is invalid: must be 32"):
    settings.validate(config)


def test_a_run_trains_on_prepared_shards_with_a_trained_tokenizer(shards, tmp_path):
  from decoupled_diloco.runtime import train  # pylint: disable=g-import-not-at-top
  # dp mode on one device: one learner and no syncer to compile keep this test to seconds; the data
  # path is the same in every mode.
  run = train.build(tiny_settings(tmp_path, data__source=shards, num_steps=8, eval_batches=1,
                                  mode="dp", num_learners=1, learner_mesh_shapes=((1, 1),)))
  summary = train.execute(run, progress=False)
  assert summary["learner_steps"] == [8] and summary["learner_errors"] == [None]
  assert summary["tokenizer"] == "tokenizers tokenizer.json"
  assert summary["data_records_skipped"] == sum(_SKIPPED.values())
  assert summary["data_records_skipped_by_reason"] == _SKIPPED
  # Bits per byte: nats over the eval targets' text bytes; BPE tokens cover > 1 byte each.
  info = run.data_info
  assert info["eval_bytes"] > info["eval_tokens"]
  assert summary["final_eval_bits_per_byte"] == pytest.approx(
      summary["final_eval_loss"] * info["eval_tokens"] / info["eval_bytes"] / np.log(2))
  assert np.isfinite(summary["final_eval_loss"]) and summary["final_eval_loss"] < np.log(320) + 1
