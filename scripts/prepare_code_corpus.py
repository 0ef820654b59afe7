r"""A byte-level corpus of the third-party Python source installed here, as ArrayRecord shards.

  python scripts/prepare_code_corpus.py --out_dir=/tmp/code_corpus
  scripts/train.sh --config.data.source=/tmp/code_corpus       # seq_len 128, the byte tokenizer

Why: the bundled corpus (1.1 MB) is seen many times over by any model past ~0.3M parameters; the
site-packages of a machine with JAX, PyTorch or SciPy installed hold 100+ MB of text that no run
repeats at 20 tokens per parameter up to ~5M parameters, and every machine can build it offline.

What it holds: every `.py` file under the site-packages (or dist-packages) directories of the
interpreter that runs this (`--roots` names others), never the standard library. The files are
sorted by their path inside their root, a file whose bytes equal an earlier one's is dropped
(sha256 of its content), the rest is kept up to `--max_bytes` (whole files, in that order), and
the last files holding `--eval_fraction` of the bytes are the held-out eval split (whole files:
no file is in both). The bytes are the tokens (config.data.tokenizer 'byte'), files concatenated
as they are. DIR/meta.json is the dataset's record (scripts/prepare_data.py's layout, read by
`config.data.source=DIR`) plus `code_corpus`: the fingerprint (sha256 over the kept bytes in
their order: two machines with the same packages get the same one), the roots, the byte and file
counts of each split and the duplicates dropped. `--text_out=FILE` also writes the kept bytes in
order to one file, whose sha256 is the fingerprint: a text source for the in-memory loader, which
carves a validation split from text (scripts/study_scaling.py needs one); its eval split is then
the loader's, the last config.data.eval_fraction of the file. A mistake is one line and exit 2,
and a failed run leaves --out_dir (and --text_out) as it found them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import site
import sys
import sysconfig
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from decoupled_diloco import errors  # pylint: disable=g-import-not-at-top
from decoupled_diloco.lm import array_records
from decoupled_diloco.lm import tokenizers

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Empty directory for the shards and meta.json.",
                               required=True)
_ROOTS = flags.DEFINE_list("roots", None, "Directories to read .py files from (default: this "
                                          "interpreter's site-packages).")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 0, "Keep at most this many bytes (whole files in "
                                                  "path order); 0 = all.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128,
                                "Tokens per training sequence (config.data.seq_len).")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.01,
                                    "Held out: the last files holding this fraction of the bytes.")
_RECORDS_PER_SHARD = flags.DEFINE_integer("records_per_shard", 1 << 16, "Windows per shard file.")
_TEXT_OUT = flags.DEFINE_string("text_out", None, "Also write the kept bytes, in order, to this "
                                                  "new file (a text config.data.source).")

_PACKAGE_DIRS = ("site-packages", "dist-packages")


def site_package_roots(entries: list[str] | None = None,
                       stdlib_dirs: list[str] | None = None) -> list[str]:
  """The third-party package directories among `entries` (default: this interpreter's site
  directories and sys.path), never a standard-library directory, each once, sorted."""
  if entries is None:
    entries = list(site.getsitepackages()) + [site.getusersitepackages()] + list(sys.path)
  if stdlib_dirs is None:
    paths = sysconfig.get_paths()
    stdlib_dirs = [paths["stdlib"], paths["platstdlib"]]
  stdlib = {os.path.realpath(d) for d in stdlib_dirs}
  roots = {os.path.realpath(e) for e in entries
           if e and os.path.basename(os.path.normpath(e)) in _PACKAGE_DIRS and os.path.isdir(e)}
  return sorted(roots - stdlib)


def source_files(roots: list[str]) -> list[tuple[str, str]]:
  """(path inside its root, full path) of every .py file under `roots`, sorted by the first: the
  order a directory lists its files in, or the roots are named in, changes nothing."""
  found = []
  for root in roots:
    for directory, subdirs, names in os.walk(root):
      subdirs[:] = [d for d in subdirs if d != "__pycache__"]
      for name in names:
        if name.endswith(".py"):
          path = os.path.join(directory, name)
          if os.path.isfile(path):
            found.append((os.path.relpath(path, root), path))
  return sorted(found)


def select(files: list[tuple[str, str]], *, max_bytes: int, eval_fraction: float) -> dict:
  """The kept files of `files` (in order, duplicates by content dropped, at most `max_bytes` in
  all when > 0), split into train and the eval tail, with the fingerprint and counts; the
  `available_` counts are of every distinct file, the cap ignored."""
  seen, kept, duplicates, empty, total, available = set(), [], 0, 0, 0, 0
  fingerprint = hashlib.sha256()
  full = False
  for relative, path in files:
    with open(path, "rb") as f:
      content = f.read()
    if not content:
      empty += 1
      continue
    digest = hashlib.sha256(content).digest()
    if digest in seen:
      duplicates += 1
      continue
    seen.add(digest)
    available += len(content)
    # Past the cap the files are still counted: what this machine holds, beside what was kept.
    full = full or bool(max_bytes and total + len(content) > max_bytes)
    if not full:
      kept.append((relative, path, len(content)))
      fingerprint.update(content)
      total += len(content)
  # The eval tail: the last files until they hold eval_fraction of the bytes (at least one file).
  eval_bytes, cut = 0, len(kept)
  while cut > 1 and eval_bytes < eval_fraction * total:
    cut -= 1
    eval_bytes += kept[cut][2]
  return {"train": [p for _, p, _ in kept[:cut]], "eval": [p for _, p, _ in kept[cut:]],
          "fingerprint": fingerprint.hexdigest(), "bytes": total,
          "train_bytes": total - eval_bytes, "eval_bytes": eval_bytes,
          "files": len(kept), "duplicate_files": duplicates, "empty_files": empty,
          "files_found": len(files), "available_bytes": available,
          "available_files": len(seen),
          "first_eval_file": kept[cut][0] if cut < len(kept) else None}


def build(out_dir: str, roots: list[str], *, seq_len: int = 128, max_bytes: int = 0,
          eval_fraction: float = 0.01, records_per_shard: int = 1 << 16,
          text_out: str | None = None, flag_prefix: str = "--") -> dict:
  """Writes the corpus of `roots` to `out_dir` as ArrayRecord shards, and with `text_out` the
  same bytes in the same order to that one file (its sha256 is the fingerprint); returns the
  shards' meta.json."""
  array_records.check_prepare_args(seq_len=seq_len, out_dir=out_dir, eval_fraction=eval_fraction,
                                   records_per_shard=records_per_shard, flag_prefix=flag_prefix)
  if max_bytes < 0:
    raise errors.InputError(f"{flag_prefix}max_bytes={max_bytes} must be >= 0 (0 = all)")
  missing = [r for r in roots if not os.path.isdir(r)]
  if missing:
    raise errors.InputError(f"{flag_prefix}roots: {missing[0]!r} is not a directory")
  chosen = select(source_files(roots), max_bytes=max_bytes, eval_fraction=eval_fraction)
  if not chosen["files"]:
    raise errors.InputError(f"{flag_prefix}roots={','.join(roots)!r} hold no .py file")
  tokenizer = tokenizers.load("byte")
  dtype = array_records.record_dtype(tokenizer.vocab_size)
  if text_out and os.path.exists(text_out):
    raise errors.InputError(f"{flag_prefix}text_out={text_out!r} exists; name a new file")
  with array_records.removed_on_failure(out_dir), _text_file(text_out) as text:
    writers = {s: array_records.ShardWriter(out_dir, s, dtype, records_per_shard)
               for s in ("train", "eval")}
    dropped = 0
    for split, writer in writers.items():
      packer = array_records.Packer(writer, seq_len + 1)
      for path in chosen[split]:
        content = np.fromfile(path, dtype=np.uint8)
        packer.add(content)
        if text is not None:
          text.write(content.tobytes())
      writer.close()
      dropped += packer.dropped
    splits = array_records.splits_meta(writers, seq_len)
    for split in ("train", "eval"):
      if splits[split]["sequences"] == 0:
        raise errors.InputError(
            f"{flag_prefix}seq_len={seq_len} leaves no window in the {split} split of "
            f"{chosen[split + '_bytes']:,} bytes: lower it, or give more files")
    meta = {
        "format": array_records.FORMAT, "tokenizer": "byte", "tokenizer_name": tokenizer.name,
        "tokenizer_source": "byte", "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "seq_len": seq_len,
        "dtype": dtype.str, "eval_fraction": eval_fraction,
        "eval_split": "the last files (in path order) holding eval_fraction of the bytes",
        "train": splits["train"], "eval": splits["eval"],
        "sequences": splits["train"]["sequences"] + splits["eval"]["sequences"],
        "tokens": splits["train"]["tokens"] + splits["eval"]["tokens"],
        "tokens_read": chosen["bytes"], "tokens_dropped": dropped, "bytes": chosen["bytes"],
        "skipped": 0, "skipped_by_reason": {},
        "code_corpus": {"roots": roots, "max_bytes": max_bytes, "python": sys.version.split()[0],
                        **{k: v for k, v in chosen.items() if k not in ("train", "eval")},
                        "train_files": len(chosen["train"]), "eval_files": len(chosen["eval"])},
    }
    array_records.write_meta(out_dir, meta)
  return meta


@contextlib.contextmanager
def _text_file(path: str | None):
  """`path` open for writing (None: no file); removed again if the block fails."""
  if path is None:
    yield None
    return
  try:
    with open(path, "wb") as f:
      yield f
  except BaseException:
    if os.path.exists(path):
      os.remove(path)
    raise


def main(argv):
  if len(argv) > 1:
    raise errors.InputError(f"Unexpected arguments {argv[1:]}: flags take the form --name=value")
  started = time.perf_counter()
  roots = _ROOTS.value or site_package_roots()
  if not roots:
    raise errors.InputError("--roots: this interpreter has no site-packages directory; name one")
  meta = build(_OUT_DIR.value, roots, seq_len=_SEQ_LEN.value, max_bytes=_MAX_BYTES.value,
               eval_fraction=_EVAL_FRACTION.value, records_per_shard=_RECORDS_PER_SHARD.value,
               text_out=_TEXT_OUT.value)
  c = meta["code_corpus"]
  print(f"{_OUT_DIR.value}: {c['bytes']:,} bytes of Python ({c['train_bytes']:,} train, "
        f"{c['eval_bytes']:,} eval) from {c['files']:,} files ({c['duplicate_files']:,} duplicates "
        f"dropped; {c['available_bytes']:,} bytes in all without --max_bytes) under "
        f"{', '.join(roots)}; {meta['train']['sequences']:,} train + "
        f"{meta['eval']['sequences']:,} eval windows of {meta['seq_len'] + 1} bytes; fingerprint "
        f"{c['fingerprint']}; {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
  errors.run_main(main, interrupted="Interrupted (SIGINT): the shards written so far were removed")
