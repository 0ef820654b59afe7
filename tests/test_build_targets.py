"""BUILD mirrors the tree: every module, script and test file is named by a Bazel target."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources_in_build():
  with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
    text = f.read()
  return set(re.findall(r'"([\w/]+\.py)"', text))


def _python_files():
  files = []
  for pattern in ("decoupled_diloco/**/*.py", "tests/*.py", "scripts/*.py", "experiments/*.py"):
    files += glob.glob(os.path.join(ROOT, pattern), recursive=True)
  return {os.path.relpath(f, ROOT) for f in files}


def test_every_python_file_has_a_bazel_target():
  missing = _python_files() - _sources_in_build()
  assert not missing, f"add BUILD targets for: {sorted(missing)}"


def test_build_names_no_file_that_does_not_exist():
  stale = _sources_in_build() - _python_files()
  assert not stale, f"BUILD names files that do not exist: {sorted(stale)}"


def test_every_test_file_is_a_py_test():
  with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
    text = f.read()
  tests = set(re.findall(r'py_test\(\s*name = "(\w+)"', text))
  on_disk = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))}
  assert on_disk <= tests, sorted(on_disk - tests)


def test_build_is_what_the_generator_writes():
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      "update_build", os.path.join(ROOT, "scripts", "update_build.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
    assert f.read() == module.render(), "run: python scripts/update_build.py"
