"""Tokenizers behind one interface: bytes, a SentencePiece model, or a Hugging Face `tokenizers` file.

`load(spec)` takes `config.data.tokenizer`'s resolved value: "byte" (every UTF-8 byte a token, vocab
256, today's path), a SentencePiece `.model` file or a `tokenizers` `.json` file. Nothing is fetched
from a hub: a run on a pod has no network to count on, and a file is what a run can record.

Every tokenizer also knows how many bytes of text each token id stands for (`token_bytes`), so a
loss in nats per token converts to bits per byte, the unit that compares across tokenizers
(a 512-piece vocabulary covers ~2.5 bytes a token on English text; its nats per token are not
comparable with a byte model's).

`train(texts, vocab_size, out)` makes a small tokenizer from text (scripts/train_tokenizer.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np

# Documents are separated by this token in a packed stream, so the model sees where one ends.
EOS_PIECE = "<|endoftext|>"
FIELD = "config.data.tokenizer"
EXTENSIONS = (".model", ".json")


class Tokenizer:
  """What the data pipeline, the evaluation and sampling need of a tokenizer."""

  name: str  # "byte", or the kind and file name ("sentencepiece tiny.model")
  vocab_size: int
  eos_id: int | None  # appended after each document of a packed stream; None: nothing appended
  # sha256 of the tokenizer file ("byte" for bytes): matches a dataset's meta.json to its tokenizer
  # whatever the path it is read from.
  fingerprint: str

  def encode(self, text: str) -> np.ndarray:
    raise NotImplementedError

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    raise NotImplementedError

  def token_bytes(self) -> np.ndarray:
    """int64[vocab_size]: UTF-8 bytes of text each id stands for (0 for control tokens)."""
    raise NotImplementedError

  def num_bytes(self, ids: Sequence[int] | np.ndarray) -> int:
    """Bytes of text `ids` cover: the denominator of bits per byte."""
    return int(self.token_bytes()[np.asarray(ids, np.int64)].sum())

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
  """Every UTF-8 byte is a token: no file, no unknown text, and bits per byte = nats / ln 2."""

  name = "byte"
  vocab_size = 256
  eos_id = None  # no spare id in 256: documents are concatenated as they are
  fingerprint = "byte"

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    # A window may cut a multi-byte character: show it as U+FFFD rather than fail.
    return bytes(np.asarray(ids, np.uint8).tolist()).decode("utf-8", errors="replace")

  def token_bytes(self) -> np.ndarray:
    return np.ones(256, np.int64)


class SentencePieceTokenizer(Tokenizer):

  def __init__(self, path: str):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.Load(path)
    except (OSError, RuntimeError) as err:
      raise ValueError(f"{FIELD}={path!r} is not a SentencePiece model: {err}") from err
    self.name = f"sentencepiece {os.path.basename(path)}"
    self.vocab_size = int(self._sp.GetPieceSize())
    self.eos_id = int(self._sp.eos_id()) if self._sp.eos_id() >= 0 else None
    self.fingerprint = _sha256(path)
    self._bytes = None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.EncodeAsIds(text), np.int32)

  def decode(self, ids) -> str:
    return self._sp.DecodeIds([int(i) for i in np.asarray(ids).reshape(-1)])

  def token_bytes(self) -> np.ndarray:
    if self._bytes is None:
      sp = self._sp
      # "▁" is SentencePiece's space; a byte-fallback piece <0xNN> is one byte; control and unknown
      # pieces stand for no text. Exact for models trained by `train` (identity normalisation, no
      # dummy prefix); a model with a dummy prefix counts one extra space per encoded document.
      self._bytes = np.array([
          0 if sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i) else
          1 if sp.IsByte(i) else len(sp.IdToPiece(i).replace("\u2581", " ").encode("utf-8"))
          for i in range(self.vocab_size)], np.int64)
    return self._bytes


class HuggingFaceTokenizer(Tokenizer):

  def __init__(self, path: str):
    import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
    try:
      self._tok = hf_tokenizers.Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises a bare Exception for a malformed file
      raise ValueError(f"{FIELD}={path!r} is not a Hugging Face tokenizers file: {err}") from err
    self._byte_level = isinstance(self._tok.decoder, hf_tokenizers.decoders.ByteLevel)
    self.name = f"tokenizers {os.path.basename(path)}"
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    self.eos_id = self._tok.token_to_id(EOS_PIECE)
    self.fingerprint = _sha256(path)
    self._bytes = None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                            skip_special_tokens=True)

  def token_bytes(self) -> np.ndarray:
    if self._bytes is None:
      special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
      counts = []
      for i in range(self.vocab_size):
        if i in special:
          counts.append(0)
        elif self._byte_level:
          # Byte-level BPE (GPT-2's scheme): each character of a piece maps to exactly one byte.
          counts.append(len(self._tok.id_to_token(i) or ""))
        else:
          counts.append(len(self._tok.decode([i]).encode("utf-8")))
      self._bytes = np.array(counts, np.int64)
    return self._bytes


def load(spec: str) -> Tokenizer:
  """The tokenizer `spec` names: "byte", a SentencePiece `.model` or a `tokenizers` `.json` file."""
  if spec == "byte":
    return ByteTokenizer()
  if not isinstance(spec, str) or not spec:
    raise ValueError(f"{FIELD}={spec!r} must be 'byte' or the path of a SentencePiece .model or a "
                     f"tokenizers .json file")
  if not spec.endswith(EXTENSIONS):
    raise ValueError(f"{FIELD}={spec!r}: unknown kind of tokenizer; use 'byte', a SentencePiece "
                     f".model or a tokenizers .json file (scripts/train_tokenizer.py makes either)")
  if not os.path.isfile(spec):
    raise FileNotFoundError(f"{FIELD}={spec!r}: no such file (nothing is fetched from a hub; "
                            f"scripts/train_tokenizer.py makes one)")
  if spec.endswith(".model"):
    return SentencePieceTokenizer(spec)
  return HuggingFaceTokenizer(spec)


def train(texts: Iterable[str], vocab_size: int, out: str) -> Tokenizer:
  """Trains a tokenizer of `vocab_size` ids on `texts` and writes it to `out`: a SentencePiece BPE
  model for `.model`, a byte-level BPE `tokenizers` file for `.json`. Both cover every byte (byte
  fallback; a byte-level alphabet), so no text is ever unknown, and decode(encode(text)) == text."""
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
    raise ValueError(f"vocab_size={vocab_size!r} must be a positive integer")
  if out.endswith(".model"):
    _train_sentencepiece(texts, vocab_size, out)
  elif out.endswith(".json"):
    _train_bpe(texts, vocab_size, out)
  else:
    raise ValueError(f"out={out!r} must end in .model (SentencePiece) or .json (tokenizers)")
  return load(out)


def _train_sentencepiece(texts: Iterable[str], vocab_size: int, out: str) -> None:
  import sentencepiece  # pylint: disable=g-import-not-at-top
  # 256 byte pieces + unk, bos, eos come first: below that there is no room for a merge.
  if vocab_size < 260:
    raise ValueError(f"vocab_size={vocab_size} must be >= 260 for a SentencePiece model: 256 "
                     f"byte-fallback pieces and 3 control pieces come first")
  # SentencePiece learns from "sentences" of at most max_sentence_length bytes: feed lines.
  lines = (line for text in texts for line in text.splitlines() if line.strip())
  with open(out, "wb") as model:
    try:
      sentencepiece.SentencePieceTrainer.Train(
          sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type="bpe",
          # Text as it is (no NFKC, no whitespace folding) and no dummy leading space: decoding
          # gives the text back byte for byte and token_bytes counts are exact.
          normalization_rule_name="identity", remove_extra_whitespaces=False,
          add_dummy_prefix=False, byte_fallback=True, split_digits=True, eos_piece=EOS_PIECE,
          hard_vocab_limit=False, minloglevel=2)
    except RuntimeError as err:
      # E.g. a vocabulary smaller than the 259 byte and control pieces plus the text's characters.
      raise ValueError(f"vocab_size={vocab_size}: SentencePiece cannot train it: {err}") from err


def _train_bpe(texts: Iterable[str], vocab_size: int, out: str) -> None:
  import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
  alphabet = hf_tokenizers.pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise ValueError(f"vocab_size={vocab_size} must be >= {len(alphabet) + 1} for byte-level BPE: "
                     f"its {len(alphabet)} byte symbols and the end-of-text token come first")
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf_tokenizers.decoders.ByteLevel()
  trainer = hf_tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[EOS_PIECE], initial_alphabet=alphabet,
      show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.save(out)


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()
