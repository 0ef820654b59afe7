"""The folders are layers, and these tests keep them so, reading each module's syntax tree.

algorithm/ is the functional core: pure functions over arrays that a reader can check against the
paper, which must not start threads, touch files or sockets, log, or reach up into the runtime, the
model or the settings. Nothing below the entry point reads the raw experiment config: main.py hands
`settings.validate`'s typed tree down, so a field cannot skip validation or be read twice.
"""

import ast
import pathlib

import pytest

_PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "decoupled_diloco"

# Threads, processes, files, sockets, serialisation and logging: what a pure function never needs.
_NOT_PURE = ("threading", "_thread", "multiprocessing", "concurrent", "queue", "asyncio", "os",
             "io", "pathlib", "shutil", "tempfile", "glob", "socket", "subprocess", "json",
             "pickle", "logging", "absl.logging", "urllib", "http")
_IO_BUILTINS = ("open", "print", "input")
# The entry point and the validation it calls: the only modules that hold the raw ConfigDict.
# The entry point and its parts that run before settings.validate: the flags (--config,
# --help_config), the fields' descriptions, a replay's recorded config under the command line's.
_READ_THE_CONFIG = ("main.py", "settings.py", "command_line.py", "config_help.py",
                    "replay_config.py")


def _modules(*folders: str) -> list[pathlib.Path]:
  roots = [_PACKAGE / f for f in folders] if folders else [_PACKAGE]
  return sorted(p for root in roots for p in root.rglob("*.py"))


def _id(path: pathlib.Path) -> str:
  return str(path.relative_to(_PACKAGE))


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imports(path: pathlib.Path, root: pathlib.Path = _PACKAGE) -> list[tuple[int, str]]:
  """(line, dotted name) of every import, at any depth; `from a import b` gives `a.b`, whether b is a
  module (`from absl import logging`) or a name in a."""
  package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
  found = []
  for node in ast.walk(_tree(path)):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.rsplit(".", node.level - 1)[0]
        base = f"{parent}.{base}" if base else parent
      found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
  return found


def _within(module: str, names) -> bool:
  return any(module == name or module.startswith(name + ".") for name in names)


def _impurities(path: pathlib.Path, root: pathlib.Path = _PACKAGE) -> list[str]:
  """What makes a module of algorithm/ more than pure math."""
  found = [f"line {line}: imports {module}" for line, module in _imports(path, root)
           if _within(module, _NOT_PURE) or (_within(module, ("decoupled_diloco",)) and
                                             not _within(module, ("decoupled_diloco.algorithm",)))]
  found += [f"line {node.lineno}: calls {node.func.id}()" for node in ast.walk(_tree(path))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _IO_BUILTINS]
  return found


def _config_reads(path: pathlib.Path, root: pathlib.Path = _PACKAGE) -> list[str]:
  """Where a module could hold the raw config: ml_collections, ConfigDict, an argument `config`."""
  found = [f"line {line}: imports {module}" for line, module in _imports(path, root)
           if _within(module, ("ml_collections",))]
  for node in ast.walk(_tree(path)):
    if (isinstance(node, ast.Name) and node.id == "ConfigDict" or
        isinstance(node, ast.Attribute) and node.attr == "ConfigDict" or
        # A string annotation ("ml_collections.ConfigDict"); prose with spaces may mention it.
        isinstance(node, ast.Constant) and isinstance(node.value, str) and
        "ConfigDict" in node.value and " " not in node.value.strip()):
      found.append(f"line {node.lineno}: names ConfigDict")
    if isinstance(node, ast.arg) and node.arg == "config":
      found.append(f"line {node.lineno}: takes an argument named config")
  return found


@pytest.mark.parametrize("path", _modules("algorithm"), ids=_id)
def test_pure_layer_does_no_io_threads_or_upward_imports(path):
  found = _impurities(path)
  assert not found, (f"decoupled_diloco/{_id(path)} is in the pure layer: no threads, I/O or "
                     f"logging, nothing from runtime, lm or settings ({'; '.join(found)})")


@pytest.mark.parametrize("path", [p for p in _modules() if _id(p) not in _READ_THE_CONFIG],
                         ids=_id)
def test_nothing_below_the_entry_point_reads_the_raw_config(path):
  found = _config_reads(path)
  assert not found, (f"decoupled_diloco/{_id(path)} must take its values from the RunSettings that "
                     f"settings.validate returns, not from the experiment's ConfigDict "
                     f"({'; '.join(found)})")


def test_the_checks_find_what_they_look_for(tmp_path):
  """Each check above passes only because it would fail: here it finds planted violations."""
  root = tmp_path / "decoupled_diloco"
  planted = root / "algorithm" / "planted.py"
  planted.parent.mkdir(parents=True)
  planted.write_text("from __future__ import annotations\n"
                     "import os.path\n"
                     "from absl import logging\n"
                     "from ..runtime import syncer\n"
                     "from . import merge\n"
                     "def f(config: ml_collections.ConfigDict, x: 'ConfigDict'):\n"
                     "  import ml_collections\n"
                     "  print(x)\n", encoding="utf-8")
  impurities = " ".join(_impurities(planted, root))
  for needle in ("os.path", "absl.logging", "decoupled_diloco.runtime", "print()"):
    assert needle in impurities, impurities
  assert "decoupled_diloco.algorithm.merge" not in impurities  # its own layer is fine
  assert len(_config_reads(planted, root)) == 4  # the import, two ConfigDicts, the argument
