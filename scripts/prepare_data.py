r"""Tokenizes text and packs it into ArrayRecord shards of seq_len + 1 ids that a run reads by index.

  python scripts/prepare_data.py --input='data/*.jsonl' --tokenizer=/tmp/tok.model --seq_len=128 \
      --out_dir=/tmp/shards
  scripts/train.sh --config.data.source=/tmp/shards   # the tokenizer comes from meta.json

--input is what config.data.source takes for text (a file, a directory or a glob of .txt / .jsonl /
.parquet files); --tokenizer is "byte" or a tokenizer file (scripts/train_tokenizer.py). The last
--eval_fraction of each input file's tokens goes to the eval shards, as the in-memory loader holds
it out. DIR/meta.json records the tokenizer (a copy sits next to the shards), vocabulary size,
sequences, tokens, bytes and the bad records skipped by reason. Progress goes to stderr. A mistake
is one line and exit 2, and a failed or interrupted run leaves --out_dir as it found it.
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags  # pylint: disable=g-import-not-at-top

from decoupled_diloco import errors  # pylint: disable=g-import-not-at-top
from decoupled_diloco.lm import array_records
from decoupled_diloco.lm import documents
from decoupled_diloco.lm import tokenizers

_INPUT = flags.DEFINE_string("input", None, "Text file, directory or glob of .txt/.jsonl/.parquet.",
                             required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "'byte', a .model or a .json file.",
                                 required=True)
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Tokens per training sequence (config.data.seq_len).",
                                required=True)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Empty directory for the shards and meta.json.",
                               required=True)
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.05,
                                    "Held out: the last this fraction of each file's tokens.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "Text field of .jsonl lines / .parquet rows.")
_RECORDS_PER_SHARD = flags.DEFINE_integer("records_per_shard", 1 << 16, "Windows per shard file.")


def main(argv):
  if len(argv) > 1:
    raise errors.InputError(f"Unexpected arguments {argv[1:]}: flags take the form --name=value")
  started = time.perf_counter()
  # Every argument is checked before a file is read or written.
  array_records.check_prepare_args(
      seq_len=_SEQ_LEN.value, out_dir=_OUT_DIR.value, eval_fraction=_EVAL_FRACTION.value,
      records_per_shard=_RECORDS_PER_SHARD.value, flag_prefix="--")
  paths = documents.text_files(_INPUT.value, field="--input")
  tokenizer = tokenizers.load(_TOKENIZER.value, field="--tokenizer")
  done = [0]

  def progress(path: str, meta: dict) -> None:
    done[0] += 1
    seconds = time.perf_counter() - started
    width = 30
    bar = "#" * (width * done[0] // len(paths))
    print(f"[{bar:<{width}}] {done[0]}/{len(paths)} files | {meta['sequences']:,} sequences | "
          f"{meta['tokens_read']:,} tokens | {meta['bytes'] / 1e6 / max(seconds, 1e-9):.1f} MB/s "
          f"| {meta['skipped']} skipped | {path}", file=sys.stderr, flush=True)

  meta = array_records.prepare(
      paths, tokenizer, tokenizer_spec=_TOKENIZER.value, seq_len=_SEQ_LEN.value,
      out_dir=_OUT_DIR.value, eval_fraction=_EVAL_FRACTION.value, text_field=_TEXT_FIELD.value,
      records_per_shard=_RECORDS_PER_SHARD.value, progress=progress, flag_prefix="--")
  print(f"{_OUT_DIR.value}: {meta['train']['sequences']:,} train + {meta['eval']['sequences']:,} "
        f"eval sequences of {meta['seq_len'] + 1} ids ({tokenizer.name}, vocab "
        f"{meta['vocab_size']}), {meta['bytes']:,} bytes of text, {meta['skipped']} bad record(s) "
        f"skipped {meta['skipped_by_reason']}, {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
  errors.run_main(main, interrupted="Interrupted (SIGINT): the shards written so far were removed")
