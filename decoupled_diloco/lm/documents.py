"""Text documents of `config.data.source`: .txt, .jsonl and .parquet files, bad records counted.

A source is a file, a directory (its .txt / .jsonl / .parquet files, sorted) or a glob. A `.txt`
file is one document; each line of a `.jsonl` file and each row of a `.parquet` file is one, its text
in `config.data.text_field`. A record that cannot give text is skipped and counted by reason, never
fatal: a crawl of a billion documents always holds a few broken ones, and a run that dies on the
first wastes the pod. The counts reach meta.json (scripts/prepare_data.py) and summary.json.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
from collections.abc import Iterator

from decoupled_diloco import errors

TEXT_EXTENSIONS = (".txt", ".jsonl", ".parquet")
# Why a record was skipped: no text in it, no text_field (or not a string), bytes that are not
# UTF-8, a line that is not JSON (or not a JSON object).
SKIP_REASONS = ("empty", "missing_field", "invalid_utf8", "bad_json")
FIELD = "config.data.source"

# A file whose sampled bytes are more than this share NUL, other control or non-UTF-8 bytes is not
# text, and is refused before a run trains on it. Measured (first 64 KiB, 2026-11-26): text in
# UTF-8 0%, French in Latin-1 a few % (26% for a sample dense with accents); UTF-16 text 50%,
# gzip 53%, /bin/ls 74%, libc 81%. 30% lies between: a legacy encoding still trains (byte tokens
# are bytes), an executable or an archive never does.
MAX_BINARY_SHARE = 0.3
SNIFF_BYTES = 64 << 10  # read from the start of each file
SNIFF_FILES = 64  # the first files of a large directory: a check at start-up, not a scan of the corpus
# Control characters that are not text (tab, newline, vertical tab, form feed and carriage return,
# 9-13, are), and the U+DC80-U+DCFF that surrogateescape decodes a byte of no UTF-8 sequence to.
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\udc80-\udcff]")


class SkipCounter(collections.Counter):
  """Skipped records by reason (SKIP_REASONS)."""

  @property
  def total(self) -> int:
    return sum(self.values())

  def as_dict(self) -> dict[str, int]:
    return {reason: int(self.get(reason, 0)) for reason in SKIP_REASONS}


def is_glob(source: str) -> bool:
  return any(c in source for c in "*?[")


def text_files(source: str, field: str = FIELD) -> list[str]:
  """The text files a source names, in a fixed order (learners' shards and the eval split depend
  on it). Raises InputError naming `field` (config.data.source, or a script's --input) when there
  are none."""
  if is_glob(source):
    files = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
  elif os.path.isdir(source):
    files = sorted(os.path.join(source, n) for n in os.listdir(source)
                   if n.endswith(TEXT_EXTENSIONS) and os.path.isfile(os.path.join(source, n)))
  elif os.path.isfile(source):
    return [source]  # one file: text whatever its extension, as before .jsonl / .parquet came
  else:
    raise errors.InputError(f"{field}={source!r}: no such file, directory or glob match")
  files = [p for p in files if p.endswith(TEXT_EXTENSIONS)]
  if not files:
    raise errors.InputError(f"{field}={source!r} holds no {' / '.join(TEXT_EXTENSIONS)} file")
  return files


def binary_share(raw: bytes) -> float:
  """The share of `raw` that no text holds: NUL and other control bytes (tab, newline, carriage
  return, form feed and vertical tab are text), and bytes of no valid UTF-8 sequence."""
  if not raw:
    return 0.0
  return len(_NOT_TEXT.findall(raw.decode("utf-8", errors="surrogateescape"))) / len(raw)


def check_text(source: str, files: list[str]) -> None:
  """Raises InputError naming config.data.source when one of the first SNIFF_FILES files does not
  hold text (MAX_BINARY_SHARE of its first SNIFF_BYTES). Parquet is a binary container; its text
  column is checked record by record as it is read."""
  for path in [p for p in files if not p.endswith(".parquet")][:SNIFF_FILES]:
    with open(path, "rb") as f:
      raw = f.read(SNIFF_BYTES)
    share = binary_share(raw)
    if share > MAX_BINARY_SHARE:
      where = "" if path == source else f" ({path})"
      raise errors.InputError(
          f"{FIELD}={source!r} is invalid: not text{where}: {share:.0%} of its first "
          f"{len(raw):,} bytes are NUL, control or non-UTF-8 bytes (at most "
          f"{MAX_BINARY_SHARE:.0%}); give text (.txt, .jsonl, .parquet) or the ArrayRecord shards "
          f"of scripts/prepare_data.py")


def read_documents(path: str, text_field: str, skipped: SkipCounter) -> Iterator[str]:
  """The documents of one file, in order; bad records are counted in `skipped` and left out."""
  if path.endswith(".jsonl"):
    yield from _jsonl(path, text_field, skipped)
  elif path.endswith(".parquet"):
    yield from _parquet(path, text_field, skipped)
  else:
    with open(path, "rb") as f:
      text = _decode(f.read(), skipped)
    if text is not None:
      yield text


def _decode(raw: bytes, skipped: SkipCounter) -> str | None:
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError:
    skipped["invalid_utf8"] += 1
    return None
  if not text.strip():
    skipped["empty"] += 1
    return None
  return text


def _jsonl(path: str, text_field: str, skipped: SkipCounter) -> Iterator[str]:
  with open(path, "rb") as f:
    for raw in f:
      if not raw.strip():
        skipped["empty"] += 1
        continue
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError:
        skipped["invalid_utf8"] += 1
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        skipped["bad_json"] += 1
        continue
      if not isinstance(record, dict):
        skipped["bad_json"] += 1
        continue
      text = record.get(text_field)
      if not isinstance(text, str):
        skipped["missing_field"] += 1
      elif not text.strip():
        skipped["empty"] += 1
      else:
        yield text


def _parquet(path: str, text_field: str, skipped: SkipCounter) -> Iterator[str]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  parquet = pq.ParquetFile(path)
  if text_field not in parquet.schema_arrow.names:
    skipped["missing_field"] += parquet.metadata.num_rows
    return
  for batch in parquet.iter_batches(columns=[text_field], batch_size=4096):
    for value in batch.column(0).to_pylist():
      if isinstance(value, bytes):  # a binary column: its bytes may not be UTF-8
        value = _decode(value, skipped)
        if value is not None:
          yield value
      elif not isinstance(value, str):
        skipped["missing_field"] += 1  # null, or not text
      elif not value.strip():
        skipped["empty"] += 1
      else:
        yield value
