"""scripts/prepare_code_corpus.py on a fake Python installation: deterministic whatever the
listing order, duplicates dropped, the standard library left out, and shards a run trains on."""

import hashlib
import json
import pathlib
import random
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from conftest import load_script
from conftest import tiny_settings
# Imported before the script: load_script takes back the absl flags defined while it imports, and
# grain's own would go with them.
from decoupled_diloco.lm import array_records  # pylint: disable=unused-import

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(name="corpus", scope="module")
def _corpus():
  return load_script("prepare_code_corpus")


def _python_text(seed: int, size: int) -> bytes:
  rng = random.Random(seed)
  words = ["def", "return", "self", "import", "numpy", "x", "y", "if", "else", "for", "in"]
  lines = []
  while sum(len(l) + 1 for l in lines) < size:
    lines.append("  " * rng.randint(0, 3) + " ".join(rng.choices(words, k=rng.randint(2, 8))))
  return ("\n".join(lines) + "\n").encode()


def _fake_install(prefix: pathlib.Path, reverse: bool = False) -> dict[str, pathlib.Path]:
  """lib/python3.11/ with a standard library, lib-dynload and site-packages holding 12 modules,
  a copy of one, an empty one, a .txt and a __pycache__, written in path order or its reverse."""
  lib = prefix / "lib" / "python3.11"
  site = lib / "site-packages"
  files = {f"pkg_{i % 3}/mod_{i}.py": _python_text(i, 2000) for i in range(12)}
  files["pkg_2/copy_of_mod_1.py"] = files["pkg_1/mod_1.py"]
  files["pkg_0/__init__.py"] = b""
  files["pkg_0/notes.txt"] = b"not python\n" * 100
  files["pkg_1/__pycache__/mod_1.cpython-311.py"] = b"compiled\n" * 100
  for name in sorted(files, reverse=reverse):
    path = site / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(files[name])
  (lib / "json").mkdir(parents=True)
  (lib / "json" / "__init__.py").write_bytes(b"STANDARD_LIBRARY = True\n" * 100)
  (lib / "lib-dynload").mkdir()
  return {"lib": lib, "site": site}


def test_the_roots_are_site_packages_and_never_the_standard_library(corpus, tmp_path):
  paths = _fake_install(tmp_path)
  entries = [str(paths["lib"]), str(paths["lib"] / "lib-dynload"), str(paths["site"]), ""]
  assert corpus.site_package_roots(entries, [str(paths["lib"])]) == [str(paths["site"].resolve())]
  chosen = corpus.select(corpus.source_files([str(paths["site"])]), max_bytes=0,
                         eval_fraction=0.2)
  assert not any("STANDARD_LIBRARY" in pathlib.Path(p).read_text() for p in
                 chosen["train"] + chosen["eval"])
  assert not any("__pycache__" in p or p.endswith(".txt") for p in chosen["train"] + chosen["eval"])
  # This interpreter's own: site-packages directories, none of them the standard library.
  stdlib = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
  own = corpus.site_package_roots()
  assert own and all(pathlib.Path(r).name in ("site-packages", "dist-packages") for r in own)
  assert not stdlib & set(own)


def test_the_fingerprint_is_the_same_whatever_order_the_files_were_listed_in(corpus, tmp_path):
  first = _fake_install(tmp_path / "a")
  second = _fake_install(tmp_path / "b", reverse=True)
  a = corpus.select(corpus.source_files([str(first["site"])]), max_bytes=0, eval_fraction=0.2)
  b = corpus.select(corpus.source_files([str(second["site"])]), max_bytes=0, eval_fraction=0.2)
  assert a["fingerprint"] == b["fingerprint"] and a["bytes"] == b["bytes"]
  # Shuffled listings and roots named in either order: the same files in the same order.
  files = corpus.source_files([str(first["site"])])
  shuffled = random.Random(0).sample(files, len(files))
  assert corpus.select(sorted(shuffled), max_bytes=0, eval_fraction=0.2) == a
  both = corpus.source_files([str(first["site"]), str(second["site"])])
  assert both == corpus.source_files([str(second["site"]), str(first["site"])])


def test_a_file_whose_bytes_came_earlier_is_dropped_and_the_cap_keeps_whole_files(corpus,
                                                                                  tmp_path):
  site = _fake_install(tmp_path)["site"]
  chosen = corpus.select(corpus.source_files([str(site)]), max_bytes=0, eval_fraction=0.2)
  kept = chosen["train"] + chosen["eval"]
  contents = [pathlib.Path(p).read_bytes() for p in kept]
  assert len(set(contents)) == len(contents) == chosen["files"] == 12
  assert chosen["duplicate_files"] == 1 and chosen["empty_files"] == 1
  assert sum(map(len, contents)) == chosen["bytes"] == chosen["train_bytes"] + chosen["eval_bytes"]
  assert 0.2 * chosen["bytes"] <= chosen["eval_bytes"] < 0.2 * chosen["bytes"] + 2100
  capped = corpus.select(corpus.source_files([str(site)]), max_bytes=chosen["bytes"] // 2,
                         eval_fraction=0.2)
  assert capped["bytes"] <= chosen["bytes"] // 2 and capped["files"] < chosen["files"]
  assert capped["available_bytes"] == chosen["available_bytes"] == chosen["bytes"]
  assert capped["train"] + capped["eval"] == kept[:capped["files"]]


def test_a_run_trains_on_the_shards_it_writes_and_the_text_file_holds_the_same_bytes(tmp_path):
  from decoupled_diloco.lm import data  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.lm import tokenizers  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import train  # pylint: disable=g-import-not-at-top
  site = _fake_install(tmp_path / "prefix")["site"]
  out = tmp_path / "shards"
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "scripts" / "prepare_code_corpus.py"), f"--out_dir={out}",
       f"--roots={site}", "--seq_len=32", "--eval_fraction=0.2", "--records_per_shard=200",
       f"--text_out={tmp_path / 'corpus.txt'}"],
      capture_output=True, text=True, cwd=_ROOT, timeout=120, check=True)
  meta = json.loads((out / "meta.json").read_text())
  assert meta["code_corpus"]["fingerprint"] in proc.stdout
  assert meta["bytes"] == meta["code_corpus"]["bytes"] == meta["tokens"] + meta["tokens_dropped"]
  assert len(meta["train"]["shards"]) > 1
  text = (tmp_path / "corpus.txt").read_bytes()
  assert hashlib.sha256(text).hexdigest() == meta["code_corpus"]["fingerprint"]
  assert len(text) == meta["bytes"]
  # The text file is a source the in-memory loader takes, with a validation split carved out.
  held = data.load_dataset(str(tmp_path / "corpus.txt"), tokenizer=tokenizers.load("byte"),
                           text_field="text", seq_len=32, eval_fraction=0.05,
                           validation_fraction=0.05)
  assert len(held.train) and len(held.validation) and len(held.eval)
  dataset = data.load_dataset(str(out), tokenizer=tokenizers.load("byte"), text_field="text",
                              seq_len=32, eval_fraction=0.2)
  assert len(dataset.train) == meta["train"]["sequences"]
  first = pathlib.Path(sorted(str(p) for p in site.rglob("*.py") if p.stat().st_size)[0])
  np.testing.assert_array_equal(dataset.train[0]["inputs"],
                                np.frombuffer(first.read_bytes()[:32], np.uint8))
  run = train.build(tiny_settings(tmp_path / "run", data__source=str(out), num_steps=4,
                                  eval_batches=1, mode="dp", num_learners=1,
                                  learner_mesh_shapes=((1, 1),)))
  summary = train.execute(run, progress=False)
  assert summary["learner_steps"] == [4] and np.isfinite(summary["final_eval_loss"])
