"""Byte-level language-modelling data: a text file, packed windows, one grain shard per learner.

Every byte of the file is a token (vocab 256), so no tokenizer is needed and the loss is in nats per
byte. The file is split once, contiguously: the last `eval_fraction` is held out, so eval text never
overlaps training text. The training windows are split into disjoint shards, one per learner (each
learner of DiLoCo trains on its own data shard), and shuffled by grain with a seed. The grain iterator
state is small and JSON-serialisable, so it goes into checkpoints with the model.
"""

from __future__ import annotations

import importlib.resources
import os
from typing import Any

import grain
import numpy as np

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
    raise FileNotFoundError(f"config.data.path={path!r} is not a readable file")
  tokens = np.fromfile(path, dtype=np.uint8)
  if tokens.size == 0:
    raise ValueError(f"config.data.path={path!r} is empty")
  return tokens


def split_tokens(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval): the last `eval_fraction` of the tokens is held out for evaluation."""
  if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) \
      or not 0.0 < eval_fraction <= 0.5:
    raise ValueError(f"config.data.eval_fraction={eval_fraction!r} must be in (0, 0.5]")
  num_eval = int(round(len(tokens) * eval_fraction))
  if num_eval < 1:
    raise ValueError(
        f"config.data.eval_fraction={eval_fraction} holds out no token of the {len(tokens)}"
    )
  return tokens[:-num_eval], tokens[-num_eval:]


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"config.data.{name}={value!r} must be a positive integer")


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
      raise ValueError(
          f"config.data.seq_len={seq_len} leaves no window of {self._window} tokens in a split "
          f"of {len(self._tokens)} tokens"
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


def make_train_loader(tokens: np.ndarray, *, seq_len: int, batch_size: int, shard_index: int,
                      num_shards: int, seed: int, num_epochs: int | None = None
                      ) -> grain.DataLoader:
  """Shuffled batches {"inputs", "targets": int32[batch_size, seq_len]} of one learner's shard.

  The shard is a contiguous 1/num_shards of the windows (the remainder dropped), so the shards of
  different learners are disjoint; each epoch reshuffles within the shard. `num_epochs=None` repeats
  forever. `iter(loader)` gives an iterator with get_state()/set_state() for checkpoints.
  """
  _check_positive("batch_size", batch_size)
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards={num_shards!r} must be a positive integer")
  if not 0 <= shard_index < num_shards:
    raise ValueError(f"shard_index={shard_index!r} must be in [0, num_shards={num_shards})")
  source = PackedSequences(tokens, seq_len)
  per_shard = len(source) // num_shards
  if per_shard < batch_size:
    raise ValueError(
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


def make_eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, max_batches: int
                      ) -> list[dict[str, np.ndarray]]:
  """The first `max_batches` full batches of windows of `tokens` (the eval split), in order."""
  _check_positive("batch_size", batch_size)
  if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
    raise ValueError(f"max_batches={max_batches!r} must be a positive integer")
  source = PackedSequences(tokens, seq_len)
  if len(source) < batch_size:
    raise ValueError(
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

