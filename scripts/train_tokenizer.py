r"""Trains a small tokenizer on text: a SentencePiece BPE `.model` or a `tokenizers` byte-level BPE
`.json` (the extension of --out chooses). Offline: the text is the only input.

  python scripts/train_tokenizer.py --input=decoupled_diloco/lm/corpora/tinyshakespeare.txt \
      --vocab_size=512 --out=/tmp/shakespeare_512.model

--input is what config.data.source takes for text: a file, a directory or a glob of .txt / .jsonl /
.parquet files (--text_field names the text of a .jsonl line or .parquet row). Bad records are
skipped and counted, as in training. Train on at most --max_bytes of text (tokenizers need far less
text than the model: a sample of the corpus gives the same merges).
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from decoupled_diloco.lm import documents  # pylint: disable=g-import-not-at-top
from decoupled_diloco.lm import tokenizers

_INPUT = flags.DEFINE_string("input", None, "Text file, directory or glob of .txt/.jsonl/.parquet.",
                             required=True)
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", None, "Ids in the vocabulary.", required=True)
_OUT = flags.DEFINE_string("out", None, "Writes a SentencePiece .model or a tokenizers .json.",
                           required=True)
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "Text field of .jsonl lines / .parquet rows.")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 100_000_000, "Train on at most this much text.")


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
  del argv
  started = time.perf_counter()
  paths = documents.text_files(_INPUT.value)
  skipped = documents.SkipCounter()
  tokenizer = tokenizers.train(_texts(paths, skipped, _MAX_BYTES.value), _VOCAB_SIZE.value,
                               _OUT.value)
  print(f"{_OUT.value}: {tokenizer.name}, {tokenizer.vocab_size} ids, from {len(paths)} file(s), "
        f"{skipped.total} bad record(s) skipped {skipped.as_dict()}, "
        f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
  app.run(main)
