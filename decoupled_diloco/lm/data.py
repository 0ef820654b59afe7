"""Language-modelling data: token streams, packed windows, one grain shard per learner.

`config.data.source` is text (a file, or a directory or glob of .txt / .jsonl / .parquet files,
tokenized here in memory) or a directory of pre-tokenized ArrayRecord shards (`array_records`,
written by scripts/prepare_data.py). With the byte tokenizer every byte of a text file is a token
(vocab 256), as before tokenizers came: that path reads the file's bytes as they are.

Each text file is split once, contiguously: the last `eval_fraction` of its tokens is held out, so
eval text never overlaps training text (a single file: the last 5% of it, as before). The training
windows are split into disjoint shards, one per learner (each learner of DiLoCo trains on its own
data shard), and shuffled by grain with a seed. The grain iterator state is small and
JSON-serialisable, so it goes into checkpoints with the model.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import os
from typing import Any

import grain
import numpy as np

from decoupled_diloco import errors
from decoupled_diloco.lm import array_records
from decoupled_diloco.lm import documents
from decoupled_diloco.lm import token_streams
from decoupled_diloco.lm import tokenizers as tokenizers_lib

# Only the input/target pairs of a window are used, so reading is a numpy slice of memory; grain's
# reader threads would only contend for the GIL with the learner threads.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def default_corpus_path() -> str:
  """Path of the bundled tiny-shakespeare corpus (1.1 MB of plain text)."""
  resource = importlib.resources.files("decoupled_diloco.lm") / "corpora" / "tinyshakespeare.txt"
  return os.fspath(resource)


def load_tokens(path: str) -> np.ndarray:
  """The bytes of the file at `path` as uint8 tokens."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config.data.source={path!r} is not a readable file")
  tokens = np.fromfile(path, dtype=np.uint8)
  if tokens.size == 0:
    raise errors.InputError(f"config.data.source={path!r} is empty")
  return tokens


def split_tokens(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval): the last `eval_fraction` of the tokens is held out for evaluation."""
  if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) \
      or not 0.0 < eval_fraction <= 0.5:
    raise errors.InputError(f"config.data.eval_fraction={eval_fraction!r} must be in (0, 0.5]")
  train, evals = token_streams.tail_split(tokens, eval_fraction)
  if len(evals) < 1:
    raise errors.InputError(
        f"config.data.eval_fraction={eval_fraction} holds out no token of the {len(tokens)} of "
        f"config.data.source: give it more text"
    )
  return train, evals


@dataclasses.dataclass(frozen=True)
class Dataset:
  """The windows a run trains and evaluates on, and what reading them skipped."""

  train: grain.sources.RandomAccessDataSource
  eval: grain.sources.RandomAccessDataSource
  tokenizer: tokenizers_lib.Tokenizer
  skipped: dict[str, int]  # bad records by reason (documents.SKIP_REASONS)
  # Carved from the training text (config.data.validation_fraction), never trained on: what
  # tuning reads, so that the eval split is never tuned on. None = no validation split.
  validation: grain.sources.RandomAccessDataSource | None = None


def load_dataset(source: str, *, tokenizer: tokenizers_lib.Tokenizer, text_field: str,
                 seq_len: int, eval_fraction: float, validation_fraction: float = 0.0,
                 min_train_windows: int = 1, min_eval_windows: int = 1) -> Dataset:
  """The train and eval windows of `config.data.source` (settings.validate resolved it).

  A directory of ArrayRecord shards is opened for random access, its eval split as prepared; text
  is read and tokenized here, whole, into memory. `validation_fraction` > 0 (text only): the last
  fraction of each file's training tokens (the part before its eval tail) is the validation split.
  A source with no text, or too little for `min_train_windows` training and `min_eval_windows`
  eval windows of seq_len + 1 tokens (what the run's batches need), is an InputError naming it.
  """
  if array_records.is_dataset_dir(source):
    if validation_fraction:
      raise errors.InputError(f"config.data.validation_fraction={validation_fraction} needs a "
                              f"text source; config.data.source={source!r} holds ArrayRecord "
                              f"shards")
    meta = array_records.read_meta(source)
    skipped = {r: int(meta["skipped_by_reason"].get(r, 0)) for r in documents.SKIP_REASONS}
    train_split = array_records.open_split(source, meta, "train")
    eval_split = array_records.open_split(source, meta, "eval")
    _check_size(source, tokenizer, seq_len, (len(train_split), len(eval_split)),
                (min_train_windows, min_eval_windows), eval_fraction)
    return Dataset(train_split, eval_split, tokenizer, skipped)
  files = documents.text_files(source)
  skipped = documents.SkipCounter()
  if len(files) == 1:
    tokens = token_streams.file_tokens(files[0], tokenizer, text_field, skipped)
    _check_text_found(source, tokens.size, skipped)
    train, evals = token_streams.tail_split(tokens, eval_fraction)  # too few tokens: _check_size names it
    train, validation = token_streams.tail_split(train, validation_fraction)
  else:
    parts = list(token_streams.split_files(files, tokenizer, text_field, eval_fraction, skipped))
    trains = [token_streams.tail_split(p[1], validation_fraction) for p in parts]
    train = np.concatenate([t for t, _ in trains])
    validation = np.concatenate([v for _, v in trains])
    evals = np.concatenate([p[2] for p in parts])
    _check_text_found(source, train.size + validation.size + evals.size, skipped)
  window = seq_len + 1
  _check_size(source, tokenizer, seq_len, (train.size // window, evals.size // window),
              (min_train_windows, min_eval_windows), eval_fraction)
  held = None
  if validation_fraction:
    if validation.size <= seq_len:
      raise errors.InputError(f"config.data.validation_fraction={validation_fraction} holds out "
                              f"{validation.size} tokens, not one window of "
                              f"data.seq_len={seq_len}")
    held = PackedSequences(validation, seq_len)
  return Dataset(PackedSequences(train, seq_len), PackedSequences(evals, seq_len), tokenizer,
                 skipped.as_dict(), held)


def _check_text_found(source: str, num_tokens: int, skipped: documents.SkipCounter) -> None:
  if num_tokens == 0:
    reasons = ", ".join(f"{n} {r}" for r, n in skipped.as_dict().items() if n)
    raise errors.InputError(
        f"config.data.source={source!r} is invalid: it holds no text ({skipped.total} records "
        f"skipped: {reasons or 'none'}; config.data.text_field names the text of a .jsonl line "
        f"or .parquet row)")


def _check_size(source: str, tokenizer: tokenizers_lib.Tokenizer, seq_len: int,
                windows: tuple[int, int], needed: tuple[int, int], eval_fraction: float) -> None:
  """(train, eval) windows against what the run needs: a corpus of a few bytes fails here, named,
  rather than deep in a loader on a batch size or a sequence length that are not the mistake."""
  if all(have >= need for have, need in zip(windows, needed)):
    return
  window = seq_len + 1
  tokens = math.ceil(max(needed[0] * window / (1 - eval_fraction),
                         needed[1] * window / eval_fraction))
  raise errors.InputError(
      f"config.data.source={source!r} is too small for this run: it makes {windows[0]} training "
      f"and {windows[1]} eval windows of config.data.seq_len+1={window} tokens "
      f"({tokenizer.name} tokens), and the run needs {needed[0]} and {needed[1]} (a batch for "
      f"every learner; one eval batch): about {tokens:,} tokens, with config.data.eval_fraction="
      f"{eval_fraction} held out")


def eval_bytes(batches: list[dict[str, np.ndarray]], tokenizer: tokenizers_lib.Tokenizer) -> int:
  """UTF-8 bytes of text the eval targets stand for: bits per byte = nats x targets / (bytes ln 2)."""
  return sum(tokenizer.num_bytes(b["targets"].reshape(-1)) for b in batches)


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise errors.InputError(f"config.data.{name}={value!r} must be a positive integer")


class PackedSequences(grain.sources.RandomAccessDataSource):
  """Non-overlapping windows of seq_len + 1 tokens as next-token prediction examples.

  Window i covers tokens[i * (L + 1) : (i + 1) * (L + 1)]; its first L tokens are the inputs and its
  last L the targets. The trailing partial window is dropped.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int):
    _check_positive("seq_len", seq_len)
    self._tokens = np.asarray(tokens)
    self._window = seq_len + 1
    self._num_windows = len(self._tokens) // self._window
    if self._num_windows < 1:
      raise errors.InputError(
          f"config.data.seq_len={seq_len} leaves no window of {self._window} tokens in a split "
          f"of {len(self._tokens)} tokens: lower it, or give config.data.source more text"
      )

  def __len__(self) -> int:
    return self._num_windows

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self._num_windows:
      raise IndexError(f"window {index} out of range [0, {self._num_windows})")
    start = index * self._window
    window_L1 = self._tokens[start:start + self._window].astype(np.int32)
    return {"inputs": window_L1[:-1], "targets": window_L1[1:]}

  def __repr__(self) -> str:
    return f"PackedSequences(num_windows={self._num_windows}, seq_len={self._window - 1})"


def _windows(data: np.ndarray | grain.sources.RandomAccessDataSource, seq_len: int
             ) -> grain.sources.RandomAccessDataSource:
  """Windows of a token stream (PackedSequences), or a source of windows as it is."""
  return PackedSequences(data, seq_len) if isinstance(data, np.ndarray) else data


def make_train_loader(tokens: np.ndarray | grain.sources.RandomAccessDataSource, *, seq_len: int, batch_size: int, shard_index: int,
                      num_shards: int, seed: int, num_epochs: int | None = None
                      ) -> grain.DataLoader:
  """Shuffled batches {"inputs", "targets": int32[batch_size, seq_len]} of one learner's shard.

  The shard is a contiguous 1/num_shards of the windows (the remainder dropped), so the shards of
  different learners are disjoint; each epoch reshuffles within the shard. `num_epochs=None` repeats
  forever. `iter(loader)` gives an iterator with get_state()/set_state() for checkpoints.
  `tokens` is a stream to cut into windows, or a source of windows (`Dataset.train`).
  """
  _check_positive("batch_size", batch_size)
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards={num_shards!r} must be a positive integer")
  if not 0 <= shard_index < num_shards:
    raise ValueError(f"shard_index={shard_index!r} must be in [0, num_shards={num_shards})")
  source = _windows(tokens, seq_len)
  per_shard = len(source) // num_shards
  if per_shard < batch_size:
    raise errors.InputError(
        f"config.data.batch_size={batch_size} exceeds the {per_shard} windows of one of "
        f"{num_shards} shards ({len(source)} windows of config.data.seq_len={seq_len})"
    )
  sampler = grain.samplers.IndexSampler(
      num_records=len(source),
      shard_options=grain.sharding.ShardOptions(
          shard_index=shard_index, shard_count=num_shards, drop_remainder=True
      ),
      shuffle=True,
      num_epochs=num_epochs,
      seed=seed,
  )
  return grain.DataLoader(
      data_source=source,
      sampler=sampler,
      operations=[grain.transforms.Batch(batch_size=batch_size, drop_remainder=True)],
      worker_count=0,
      read_options=_READ_OPTIONS,
  )


def reshard_position(state: bytes, *, shard_index: int, old_num_shards: int,
                     new_num_shards: int) -> bytes:
  """A train loader's iterator state (`get_state()` of `make_train_loader`'s iterator) moved from
  shard `shard_index` of `old_num_shards` to the same shard index of `new_num_shards`, keeping
  how many windows the learner has read (a job checkpoint restored onto another number of
  learners: runtime/records/elastic_restore.py).

  grain stores the position as the last global record index seen, which depends on the shard
  count (shard i of n reads records i, i + n, i + 2n, ...): its local count is recovered with the
  old count and written back with the new one. The learner then reads its new shard's shuffled
  order from the same count on.
  """
  values = json.loads(state)
  if values.get("worker_count", 0) != 0:
    raise ValueError(f"a loader state with worker_count={values['worker_count']} (this module's "
                     "loaders read in the learner's thread, worker_count=0)")
  last_seen = int(values["last_seen_indices"]["0"])
  read = (last_seen + old_num_shards - shard_index) // old_num_shards
  values["last_seen_indices"] = {"0": shard_index - new_num_shards + read * new_num_shards}
  # grain checks the state's sampler against the loader's by repr: it names the shard count.
  old_shards = f"shard_index={shard_index}, shard_count={old_num_shards},"
  if old_shards not in values["sampler"]:
    raise ValueError(f"the loader state's sampler {values['sampler']!r} is not shard "
                     f"{shard_index} of {old_num_shards}")
  values["sampler"] = values["sampler"].replace(
      old_shards, f"shard_index={shard_index}, shard_count={new_num_shards},")
  return json.dumps(values).encode()


def make_eval_batches(tokens: np.ndarray | grain.sources.RandomAccessDataSource, *, seq_len: int, batch_size: int, max_batches: int
                      ) -> list[dict[str, np.ndarray]]:
  """The first `max_batches` full batches of windows of `tokens` (the eval split), in order."""
  _check_positive("batch_size", batch_size)
  if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
    raise ValueError(f"max_batches={max_batches!r} must be a positive integer")
  source = _windows(tokens, seq_len)
  if len(source) < batch_size:
    raise errors.InputError(
        f"the eval split has {len(source)} windows, fewer than config.data.batch_size="
        f"{batch_size}; raise config.data.eval_fraction"
    )
  batches = grain.MapDataset.source(source).batch(batch_size, drop_remainder=True)
  return [batches[i] for i in range(min(max_batches, len(batches)))]


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy in nats of the byte frequencies of `tokens`: the loss of the best context-free model."""
  counts_V = np.bincount(np.asarray(tokens, np.uint8), minlength=256).astype(np.float64)
  probs_V = counts_V[counts_V > 0] / counts_V.sum()
  return float(-np.sum(probs_V * np.log(probs_V)))


def bigram_entropy(train_tokens: np.ndarray, eval_tokens: np.ndarray) -> float:
  """Cross-entropy in nats per byte on `eval_tokens` of a bigram model fitted on `train_tokens`.

  p(b | a) = (n(a, b) + 1) / (n(a) + 256) (add-one smoothing), so every eval byte pair has a finite
  loss; a model that learns nothing beyond the previous byte lands here.
  """
  train = np.asarray(train_tokens, np.int64)
  evals = np.asarray(eval_tokens, np.int64)
  if len(evals) < 2:
    raise ValueError("bigram_entropy needs at least two eval tokens")
  counts_VxV = np.bincount(train[:-1] * 256 + train[1:], minlength=256 * 256)
  counts_VxV = counts_VxV.reshape(256, 256).astype(np.float64) + 1.0
  log_probs_VxV = np.log(counts_VxV) - np.log(counts_VxV.sum(axis=1, keepdims=True))
  return float(-np.mean(log_probs_VxV[evals[:-1], evals[1:]]))

