r"""Trains a small tokenizer on text: a SentencePiece BPE `.model` or a `tokenizers` byte-level BPE
`.json` (the extension of --out chooses). Offline: the text is the only input.

  python scripts/train_tokenizer.py --input=decoupled_diloco/lm/corpora/tinyshakespeare.txt \
      --vocab_size=512 --out=/tmp/shakespeare_512.model

--input is what config.data.source takes for text: a file, a directory or a glob of .txt / .jsonl /
.parquet files (--text_field names the text of a .jsonl line or .parquet row). Bad records are
skipped and counted, as in training. Train on at most --max_bytes of text (tokenizers need far less
text than the model: a sample of the corpus gives the same merges). A text too small for
--vocab_size is refused, naming the size it supports (--allow_smaller_vocab writes that smaller
vocabulary instead); an existing --out is kept unless --force. A mistake is one line, exit 2.
"""

import itertools
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags  # pylint: disable=g-import-not-at-top

from decoupled_diloco import errors  # pylint: disable=g-import-not-at-top
from decoupled_diloco.lm import documents
from decoupled_diloco.lm import tokenizers

_INPUT = flags.DEFINE_string("input", None, "Text file, directory or glob of .txt/.jsonl/.parquet.",
                             required=True)
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", None, "Ids in the vocabulary.", required=True)
_OUT = flags.DEFINE_string("out", None, "Writes a SentencePiece .model or a tokenizers .json.",
                           required=True)
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "Text field of .jsonl lines / .parquet rows.")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 100_000_000, "Train on at most this much text.")
_FORCE = flags.DEFINE_bool("force", False, "Overwrite an existing --out.")
_ALLOW_SMALLER_VOCAB = flags.DEFINE_bool(
    "allow_smaller_vocab", False, "Write the tokenizer even when the text supports fewer ids than "
    "--vocab_size (the merges run out of pairs on a small text).")


def _texts(paths: list[str], skipped: documents.SkipCounter, budget: int):
  """The documents of `paths` until `budget` UTF-8 bytes were given."""
  for path in paths:
    for text in documents.read_documents(path, _TEXT_FIELD.value, skipped):
      if budget <= 0:
        return
      text = text[:budget]  # characters >= bytes: a cut by characters never gives too little
      budget -= len(text.encode("utf-8"))
      yield text


def main(argv):
  if len(argv) > 1:
    raise errors.InputError(f"Unexpected arguments {argv[1:]}: flags take the form --name=value")
  started = time.perf_counter()
  out = _OUT.value
  # Every argument is checked before the text is read: a mistake costs no training.
  tokenizers.check_train_args(_VOCAB_SIZE.value, out, flag_prefix="--")
  if os.path.exists(out) and not _FORCE.value:
    raise errors.InputError(f"--out={out} already exists; pass --force to overwrite it, or "
                            f"choose another path")
  if _MAX_BYTES.value < 1:
    raise errors.InputError(f"--max_bytes={_MAX_BYTES.value} must be >= 1")
  paths = documents.text_files(_INPUT.value, field="--input")
  skipped = documents.SkipCounter()
  texts = _texts(paths, skipped, _MAX_BYTES.value)
  first = next(texts, None)
  if first is None:
    raise errors.InputError(f"--input={_INPUT.value} holds no text to train on ({skipped.total} "
                            f"bad record(s) skipped {skipped.as_dict()})")
  try:
    tokenizer = tokenizers.train(itertools.chain([first], texts), _VOCAB_SIZE.value, out,
                                 allow_smaller=_ALLOW_SMALLER_VOCAB.value, flag_prefix="--")
  except tokenizers.VocabularyNotReached as err:
    raise errors.InputError(str(err), hint=f"--allow_smaller_vocab writes the {err.reached}-id "
                                           f"tokenizer instead") from err
  note = (f" (asked for {_VOCAB_SIZE.value}: the text supports no more)"
          if tokenizer.vocab_size < _VOCAB_SIZE.value else "")
  print(f"{out}: {tokenizer.name}, {tokenizer.vocab_size} ids{note}, from {len(paths)} file(s), "
        f"{skipped.total} bad record(s) skipped {skipped.as_dict()}, "
        f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
  errors.run_main(main)
