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
import re
from collections.abc import Iterable, Sequence

import numpy as np

from decoupled_diloco import errors

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

  def __init__(self, path: str, field: str = FIELD):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.Load(path)
    except (OSError, RuntimeError) as err:
      raise errors.InputError(f"{field}={path!r} is not a SentencePiece model: {err}") from err
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

  def __init__(self, path: str, field: str = FIELD):
    import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
    try:
      self._tok = hf_tokenizers.Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises a bare Exception for a malformed file
      raise errors.InputError(f"{field}={path!r} is not a Hugging Face tokenizers file: "
                              f"{err}") from err
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


def load(spec: str, field: str = FIELD) -> Tokenizer:
  """The tokenizer `spec` names: "byte", a SentencePiece `.model` or a `tokenizers` `.json` file.
  A bad spec is an InputError naming `field` (config.data.tokenizer, or a script's flag)."""
  if spec == "byte":
    return ByteTokenizer()
  if not isinstance(spec, str) or not spec:
    raise errors.InputError(f"{field}={spec!r} must be 'byte' or the path of a SentencePiece "
                            f".model or a tokenizers .json file")
  if not spec.endswith(EXTENSIONS):
    raise errors.InputError(f"{field}={spec!r}: unknown kind of tokenizer; use 'byte', a "
                            f"SentencePiece .model or a tokenizers .json file "
                            f"(scripts/train_tokenizer.py makes either)")
  if not os.path.isfile(spec):
    raise errors.InputError(f"{field}={spec!r}: no such file (nothing is fetched from a hub; "
                            f"scripts/train_tokenizer.py makes one)")
  if spec.endswith(".model"):
    return SentencePieceTokenizer(spec, field)
  return HuggingFaceTokenizer(spec, field)


# Ids that come before any merge, by the extension of the file `train` writes: SentencePiece's 256
# byte-fallback pieces and its unk, bos and eos; byte-level BPE's 256 byte symbols and end-of-text.
MIN_VOCAB_SIZE = {".model": 260, ".json": 257}
_KINDS = {".model": "SentencePiece model", ".json": "byte-level BPE tokenizers file"}


class VocabularyNotReached(errors.InputError):
  """The text has too few distinct pairs to merge into the vocabulary size asked for."""

  def __init__(self, message: str, reached: int):
    super().__init__(message)
    self.reached = reached


def check_train_args(vocab_size: int, out: str, flag_prefix: str = "") -> None:
  """InputError unless `train` can make a tokenizer of `vocab_size` ids at `out` (its extension,
  its directory); `flag_prefix` spells the arguments as the caller takes them ("--" for flags)."""
  extension = os.path.splitext(out)[1]
  if extension not in MIN_VOCAB_SIZE:
    raise errors.InputError(f"{flag_prefix}out={out!r} must end in .model (a SentencePiece BPE "
                            f"model) or .json (a byte-level BPE tokenizers file): the extension "
                            f"chooses the kind")
  directory = os.path.dirname(out) or "."
  if not os.path.isdir(directory):
    raise errors.InputError(f"{flag_prefix}out={out!r}: no such directory {directory!r}")
  minimum = MIN_VOCAB_SIZE[extension]
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
    raise errors.InputError(
        f"{flag_prefix}vocab_size={vocab_size!r} must be an integer >= {minimum} for a "
        f"{_KINDS[extension]}: its {minimum - 1} byte and control ids come before any merge")


def train(texts: Iterable[str], vocab_size: int, out: str, *, allow_smaller: bool = False,
          flag_prefix: str = "") -> Tokenizer:
  """Trains a tokenizer of `vocab_size` ids on `texts` and writes it to `out`: a SentencePiece BPE
  model for `.model`, a byte-level BPE `tokenizers` file for `.json`. Both cover every byte (byte
  fallback; a byte-level alphabet), so no text is ever unknown, and decode(encode(text)) == text.

  A text too small for `vocab_size` raises VocabularyNotReached, naming the size it reached,
  unless `allow_smaller`. `out` is written whole or not at all (a failure leaves an earlier file
  there as it was). Errors spell the arguments with `flag_prefix` ("--" for a script's flags).
  """
  check_train_args(vocab_size, out, flag_prefix)
  extension = os.path.splitext(out)[1]
  partial = os.path.join(os.path.dirname(out) or ".",
                         f".{os.path.basename(out)}.partial-{os.getpid()}{extension}")
  try:
    if extension == ".model":
      _train_sentencepiece(texts, vocab_size, partial, flag_prefix)
    else:
      _train_bpe(texts, vocab_size, partial)
    reached = load(partial).vocab_size
    if reached < vocab_size and not allow_smaller:
      raise VocabularyNotReached(
          f"{flag_prefix}vocab_size={vocab_size}: the text gives a {_KINDS[extension]} of only "
          f"{reached} ids (the merges ran out of pairs); ask for at most {reached}, or give more "
          f"text", reached)
    os.replace(partial, out)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return load(out)


def _train_sentencepiece(texts: Iterable[str], vocab_size: int, out: str,
                         flag_prefix: str) -> None:
  import sentencepiece  # pylint: disable=g-import-not-at-top
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
      # A vocabulary smaller than the 259 byte and control pieces plus the text's characters:
      # SentencePiece's own message suggests an option (--character_coverage) no caller has.
      needed = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)",
                         str(err))
      if needed:
        raise errors.InputError(
            f"{flag_prefix}vocab_size={vocab_size} must be >= {needed.group(1)} for a "
            f"SentencePiece model of this text: its byte and control pieces and one piece for "
            f"each of the text's characters come first") from err
      if "sentences_.empty()" in str(err):
        raise errors.InputError("the text has no non-blank line to train a SentencePiece model "
                                "on") from err
      raise


def _train_bpe(texts: Iterable[str], vocab_size: int, out: str) -> None:
  import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
  alphabet = hf_tokenizers.pre_tokenizers.ByteLevel.alphabet()
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
