"""Pre-tokenized datasets: packed windows of token ids in ArrayRecord shards, read with random access.

scripts/prepare_data.py writes a directory of this layout; `config.data.source` may name it:

  DIR/meta.json                   what the shards hold (see `write_meta`)
  DIR/train-00000.array_record    training windows, one record each
  DIR/eval-00000.array_record     the held-out windows
  DIR/tokenizer.model | .json     a copy of the tokenizer (absent for "byte")

A record is one window of seq_len + 1 token ids (little-endian uint16, or int32 above 65,536 ids):
its first seq_len ids are the inputs and its last seq_len the targets, as `data.PackedSequences`
cuts them from an in-memory stream. Eval windows are in their own shards, so no learner's shard
can reach them. grain reads the records by index (`grain.sources.ArrayRecordDataSource`), so each
learner samples its own disjoint shard of indices and the iterator state stays a position.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import grain
import numpy as np

from decoupled_diloco import errors

META = "meta.json"
FORMAT = "decoupled_diloco packed token windows"
FIELD = "config.data.source"


def is_dataset_dir(source: str) -> bool:
  """Whether `source` is a directory written by scripts/prepare_data.py."""
  return os.path.isdir(source) and os.path.isfile(os.path.join(source, META))


def record_dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def read_meta(directory: str) -> dict:
  path = os.path.join(directory, META)
  try:
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as err:
    raise errors.InputError(f"{FIELD}={directory!r}: cannot read {META}: {err}") from err
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise errors.InputError(f"{FIELD}={directory!r}: {META} was not written by "
                            f"scripts/prepare_data.py")
  for split in ("train", "eval"):
    for shard in meta[split]["shards"]:
      if not os.path.isfile(os.path.join(directory, shard)):
        raise errors.InputError(f"{FIELD}={directory!r}: shard {shard} named in {META} is "
                                f"missing")
  return meta


def tokenizer_spec(directory: str, meta: dict) -> str:
  """The tokenizer the dataset was made with, as `tokenizers.load` takes it."""
  name = meta["tokenizer"]
  return name if name == "byte" else os.path.join(directory, name)


class ShardWriter:
  """Writes windows to shards `<prefix>-NNNNN.array_record`, a new shard every `per_shard`."""

  def __init__(self, directory: str, prefix: str, dtype: np.dtype, per_shard: int):
    self._directory, self._prefix, self._dtype, self._per_shard = directory, prefix, dtype, per_shard
    self._writer = None
    self._in_shard = 0
    self.shards: list[str] = []
    self.records = 0

  def write(self, window: np.ndarray) -> None:
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    if self._writer is None or self._in_shard == self._per_shard:
      self.close()
      name = f"{self._prefix}-{len(self.shards):05d}.array_record"
      # group_size:1 makes every record its own chunk: a random read decodes one window only.
      self._writer = array_record_module.ArrayRecordWriter(
          os.path.join(self._directory, name), "group_size:1")
      self.shards.append(name)
      self._in_shard = 0
    self._writer.write(np.asarray(window, self._dtype).tobytes())
    self._in_shard += 1
    self.records += 1

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


class Packer:
  """Cuts a stream of token arrays into windows of `window` ids, carrying the remainder along."""

  def __init__(self, writer: ShardWriter, window: int):
    self._writer, self._window = writer, window
    self._pending = np.zeros(0, np.int64)

  def add(self, tokens: np.ndarray) -> None:
    stream = np.concatenate([self._pending, np.asarray(tokens, np.int64)])
    full = len(stream) // self._window
    for i in range(full):
      self._writer.write(stream[i * self._window:(i + 1) * self._window])
    self._pending = stream[full * self._window:]

  @property
  def dropped(self) -> int:
    """Tokens left over after the last full window (dropped, as PackedSequences drops them)."""
    return len(self._pending)


class TokenRecords(grain.sources.RandomAccessDataSource):
  """The windows of some shards as {"inputs", "targets": int32[seq_len]} examples, by index."""

  def __init__(self, directory: str, shards: list[str], dtype: str, seq_len: int):
    self._source = grain.sources.ArrayRecordDataSource(
        [os.path.join(directory, s) for s in shards])
    self._dtype = np.dtype(dtype)
    self._seq_len = seq_len

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    window_L1 = np.frombuffer(self._source[int(index)], self._dtype).astype(np.int32)
    if window_L1.shape != (self._seq_len + 1,):
      raise ValueError(f"record {index} holds {window_L1.size} ids, not seq_len + 1 = "
                       f"{self._seq_len + 1}")
    return {"inputs": window_L1[:-1], "targets": window_L1[1:]}

  def __repr__(self) -> str:
    return f"TokenRecords(num_windows={len(self)}, seq_len={self._seq_len})"


def open_split(directory: str, meta: dict, split: str) -> TokenRecords:
  """The train or eval windows of a prepared dataset."""
  if not meta[split]["shards"]:
    raise errors.InputError(f"{FIELD}={directory!r} holds no {split} window (meta.json); prepare "
                            f"it again with more text, a smaller --seq_len or a larger "
                            f"--eval_fraction")
  return TokenRecords(directory, meta[split]["shards"], meta["dtype"], meta["seq_len"])


def check_prepare_args(*, seq_len: int, out_dir: str, eval_fraction: float,
                       records_per_shard: int, flag_prefix: str = "") -> None:
  """InputError unless `prepare` can take these; `flag_prefix` spells the arguments as the caller
  takes them ("--" for a script's flags)."""
  for name, value in (("seq_len", seq_len), ("records_per_shard", records_per_shard)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise errors.InputError(f"{flag_prefix}{name}={value!r} must be a positive integer")
  if not 0.0 < eval_fraction <= 0.5:
    raise errors.InputError(f"{flag_prefix}eval_fraction={eval_fraction!r} must be in (0, 0.5]")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise errors.InputError(f"{flag_prefix}out_dir={out_dir!r} is a file, not a directory")
  if os.path.isdir(out_dir):
    stale = [n for n in os.listdir(out_dir) if n == META or n.endswith(".array_record")]
    if stale:
      raise errors.InputError(f"{flag_prefix}out_dir={out_dir!r} already holds a dataset "
                              f"({', '.join(sorted(stale))}); choose an empty directory")


def prepare(paths: list[str], tokenizer, *, tokenizer_spec: str, seq_len: int, out_dir: str,
            eval_fraction: float, text_field: str, records_per_shard: int = 1 << 16,
            progress=None, flag_prefix: str = "") -> dict:
  """Tokenizes the text files `paths` and packs them into shards under `out_dir`; returns meta.

  The split is the in-memory loader's (`token_streams.split_files`): the last `eval_fraction` of each
  file's tokens goes to the eval shards, the rest to the train shards, each stream cut into windows
  of seq_len + 1 ids that carry over from file to file. One file is in memory at a time.
  `progress(path, meta_so_far)` is called after each file. A split left without a window is an
  InputError. On any failure (Ctrl-C too) the files written here are removed again, and `out_dir`
  if this made it: half a dataset would look like one to the next try.
  """
  check_prepare_args(seq_len=seq_len, out_dir=out_dir, eval_fraction=eval_fraction,
                     records_per_shard=records_per_shard, flag_prefix=flag_prefix)
  with removed_on_failure(out_dir):
    return _prepare(paths, tokenizer, tokenizer_spec=tokenizer_spec, seq_len=seq_len,
                    out_dir=out_dir, eval_fraction=eval_fraction, text_field=text_field,
                    records_per_shard=records_per_shard, progress=progress,
                    flag_prefix=flag_prefix)


@contextlib.contextmanager
def removed_on_failure(out_dir: str):
  """Makes `out_dir` if absent; on any failure (Ctrl-C too) removes the files written inside the
  block again, and `out_dir` if this made it: half a dataset would look like one to the next try."""
  made_dir = not os.path.isdir(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  before = set(os.listdir(out_dir))
  try:
    yield
  except BaseException:
    if made_dir:
      shutil.rmtree(out_dir, ignore_errors=True)
    else:
      for name in set(os.listdir(out_dir)) - before:
        os.remove(os.path.join(out_dir, name))
    raise


def splits_meta(writers: dict[str, ShardWriter], seq_len: int) -> dict:
  """The "train" and "eval" entries of meta.json: each split's shards, windows and tokens."""
  return {s: {"shards": list(w.shards), "sequences": w.records, "tokens": w.records * (seq_len + 1)}
          for s, w in writers.items()}


def write_meta(out_dir: str, meta: dict) -> None:
  """Writes meta.json, last: a directory is a dataset (`is_dataset_dir`) only once every shard is
  closed. `meta` must hold what `read_meta` and the loader read (FORMAT, the splits, the
  tokenizer, seq_len, dtype, skipped_by_reason)."""
  with open(os.path.join(out_dir, META), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=2)


def _prepare(paths, tokenizer, *, tokenizer_spec, seq_len, out_dir, eval_fraction, text_field,
             records_per_shard, progress, flag_prefix) -> dict:
  from decoupled_diloco.lm import token_streams  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.lm import documents  # pylint: disable=g-import-not-at-top
  dtype = record_dtype(tokenizer.vocab_size)
  writers = {s: ShardWriter(out_dir, s, dtype, records_per_shard) for s in ("train", "eval")}
  packers = {s: Packer(w, seq_len + 1) for s, w in writers.items()}
  skipped = documents.SkipCounter()
  totals = {"tokens_read": 0, "bytes": 0, "files": 0}
  meta = {}
  for path, train, evals in token_streams.split_files(paths, tokenizer, text_field, eval_fraction, skipped):
    packers["train"].add(train)
    packers["eval"].add(evals)
    totals["tokens_read"] += len(train) + len(evals)
    totals["bytes"] += tokenizer.num_bytes(train) + tokenizer.num_bytes(evals)
    totals["files"] += 1
    meta = _meta(tokenizer, tokenizer_spec, seq_len, dtype, text_field, eval_fraction, paths,
                 writers, packers, skipped, totals)
    if progress is not None:
      progress(path, meta)
  for writer in writers.values():
    writer.close()
  meta = _meta(tokenizer, tokenizer_spec, seq_len, dtype, text_field, eval_fraction, paths,
               writers, packers, skipped, totals)
  for split in ("train", "eval"):
    if meta[split]["sequences"] == 0:
      raise errors.InputError(
          f"{flag_prefix}seq_len={seq_len} leaves no window of {seq_len + 1} ids in the {split} "
          f"split of the {totals['tokens_read']:,} tokens read ({skipped.total} bad record(s) "
          f"skipped {skipped.as_dict()}): lower it, or give more text")
  if tokenizer_spec != "byte":
    # A copy travels with the shards, so the dataset alone says how to decode it.
    shutil.copyfile(tokenizer_spec, os.path.join(out_dir, meta["tokenizer"]))
  write_meta(out_dir, meta)
  return meta


def _meta(tokenizer, tokenizer_spec, seq_len, dtype, text_field, eval_fraction, paths, writers,
          packers, skipped, totals) -> dict:
  splits = splits_meta(writers, seq_len)
  return {
      "format": FORMAT,
      "tokenizer": "byte" if tokenizer_spec == "byte" else "tokenizer" + os.path.splitext(
          tokenizer_spec)[1],
      "tokenizer_name": tokenizer.name,
      "tokenizer_source": tokenizer_spec,
      "tokenizer_fingerprint": tokenizer.fingerprint,
      "vocab_size": tokenizer.vocab_size,
      "eos_id": tokenizer.eos_id,
      "seq_len": seq_len,
      "dtype": dtype.str,
      "text_field": text_field,
      "eval_fraction": eval_fraction,
      "eval_split": "the last eval_fraction of each input file's tokens, in the eval shards",
      "inputs": [os.path.abspath(p) for p in paths],
      "files_read": totals["files"],
      "train": splits["train"],
      "eval": splits["eval"],
      "sequences": splits["train"]["sequences"] + splits["eval"]["sequences"],
      "tokens": splits["train"]["tokens"] + splits["eval"]["tokens"],
      "tokens_read": totals["tokens_read"],
      # Tokens read but in no window: each split's tail shorter than seq_len + 1.
      "tokens_dropped": packers["train"].dropped + packers["eval"].dropped,
      "bytes": totals["bytes"],  # UTF-8 bytes of the text read (the tokens' own count)
      "skipped": skipped.total,
      "skipped_by_reason": skipped.as_dict(),
  }
