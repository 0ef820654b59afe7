"""A text file as a stream of token ids, and its split into train and eval tails.

Shared by the in-memory loader (`data.load_dataset`) and the ArrayRecord preparation
(`array_records.prepare`), so that both split every file the same way.
"""

from __future__ import annotations

import numpy as np

from decoupled_diloco.lm import documents
from decoupled_diloco.lm import tokenizers as tokenizers_lib


def tail_split(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  num_eval = int(round(len(tokens) * eval_fraction))
  return tokens[:len(tokens) - num_eval], tokens[len(tokens) - num_eval:]


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest unsigned dtype that holds every id: a stream in memory is 1-4 bytes a token."""
  return np.dtype(np.uint8 if vocab_size <= 1 << 8 else
                  np.uint16 if vocab_size <= 1 << 16 else np.int32)


def file_tokens(path: str, tokenizer: tokenizers_lib.Tokenizer, text_field: str,
                skipped: documents.SkipCounter) -> np.ndarray:
  """The token stream of one text file: its documents encoded, each followed by the tokenizer's
  end-of-text id (if it has one). Bad records are counted in `skipped` and left out."""
  dtype = token_dtype(tokenizer.vocab_size)
  if tokenizer.name == "byte" and not path.endswith((".jsonl", ".parquet")):
    # The bytes of a text file are its byte tokens, UTF-8 or not: the path every run took before
    # tokenizers came, kept byte for byte so its windows, order and losses are unchanged.
    tokens = np.fromfile(path, dtype=np.uint8)
    if tokens.size == 0:
      skipped["empty"] += 1
    return tokens
  pieces = []
  eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
  for text in documents.read_documents(path, text_field, skipped):
    pieces += [tokenizer.encode(text), np.asarray(eos, np.int64)]
  return np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)


def split_files(paths: list[str], tokenizer: tokenizers_lib.Tokenizer, text_field: str,
                eval_fraction: float, skipped: documents.SkipCounter):
  """Yields (path, train tokens, eval tokens) per file: the last `eval_fraction` of each file's
  tokens is held out. Every file adds to both splits, so a directory of shards of a corpus is
  evaluated on all of them; one file at a time is in memory (scripts/prepare_data.py streams)."""
  for path in paths:
    tokens = file_tokens(path, tokenizer, text_field, skipped)
    yield (path, *tail_split(tokens, eval_fraction))
