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


# ---- the runtime's folders are layers too ------------------------------------------------------
#
# settings.py at the bottom, then runtime/core/ (the learner, the syncer, their messages), then
# records/, faults/ and hardware/ over core/, then assembly.py (the one build recipe), then
# transport/ and control/, and the two entries on top: runtime/train.py (a run) and
# runtime/tpu_aot.py (a run's learners compiled for a TPU topology, through the same recipe). Ray is a transport: core/ and
# control/ run the same with threads. An import points down, never up and never around a circle.

_RUNTIME = "decoupled_diloco.runtime"
_CORE = f"{_RUNTIME}.core"
_TRAIN = f"{_RUNTIME}.train"
_ENTRIES = (_TRAIN, f"{_RUNTIME}.tpu_aot")
_TRANSPORT = f"{_RUNTIME}.transport"
_SIDE_LAYERS = tuple(f"{_RUNTIME}.{folder}" for folder in ("records", "faults", "hardware"))

# Pairs (importer, imported) the layer and circle checks let pass: none. A new entry needs a reason.
_KNOWN: set[tuple[str, str]] = set()


def _module(path: pathlib.Path, root: pathlib.Path = _PACKAGE) -> str:
  """decoupled_diloco/runtime/core/syncer.py -> decoupled_diloco.runtime.core.syncer; a package's
  __init__.py -> the package."""
  parts = path.relative_to(root.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_imports(path: pathlib.Path, root: pathlib.Path = _PACKAGE
                     ) -> list[tuple[int, str]]:
  """(line, module) of every import of a module of the package, at any depth: `from a import b`
  resolves to the module a.b when there is one, else to a (b is a name in it)."""
  known = {_module(p, root) for p in root.rglob("*.py")}
  found = []
  for line, name in _imports(path, root):
    while name and name not in known:
      name = name.rpartition(".")[0]
    if name:
      found.append((line, name))
  return found


def _layer_breaches(path: pathlib.Path, root: pathlib.Path = _PACKAGE) -> list[str]:
  """The imports of one module that break the layering above (all but the `_KNOWN` ones)."""
  me = _module(path, root)
  found = []
  if me == "decoupled_diloco.settings":
    found += [f"line {line}: imports {name} (settings.py sits below the runtime)"
              for line, name in _imports(path, root) if _within(name, (_RUNTIME,))]
  if _within(me, (_CORE, f"{_RUNTIME}.control")):
    found += [f"line {line}: imports {name} (only transport/ knows Ray)"
              for line, name in _imports(path, root) if _within(name, ("ray", _TRANSPORT))]
  for line, name in _package_imports(path, root):
    if (me, name) in _KNOWN or not _within(name, (_RUNTIME,)) or name == _RUNTIME:
      continue
    if name in _ENTRIES and me != name:
      found.append(f"line {line}: imports {name} (runtime/train.py and runtime/tpu_aot.py are "
                   f"entries: nothing in the package imports them)")
    elif _within(me, (_CORE,)) and not _within(name, (_CORE,)):
      found.append(f"line {line}: imports {name} (core/ imports no other runtime folder)")
    elif _within(me, _SIDE_LAYERS) and not _within(name, (_CORE, *_SIDE_LAYERS)):
      found.append(f"line {line}: imports {name} (records/, faults/ and hardware/ import only "
                   f"core/ and each other)")
  return found


def _circles(root: pathlib.Path = _PACKAGE) -> list[list[str]]:
  """The import circles of the package: its strongly connected components (Tarjan's algorithm) of
  more than one module, or of one that imports itself, every import counted, wherever it stands;
  the `_KNOWN` edges left out."""
  graph = {_module(p, root): {name for _, name in _package_imports(p, root)}
           for p in root.rglob("*.py")}
  graph = {m: {n for n in names if (m, n) not in _KNOWN} for m, names in graph.items()}
  index: dict[str, int] = {}
  lowlink: dict[str, int] = {}
  stack: list[str] = []
  circles = []

  def visit(module: str) -> None:  # recursion depth <= the number of modules
    index[module] = lowlink[module] = len(index)
    stack.append(module)
    for name in sorted(graph.get(module, ())):
      if name not in index:
        visit(name)
        lowlink[module] = min(lowlink[module], lowlink[name])
      elif name in stack:
        lowlink[module] = min(lowlink[module], index[name])
    if lowlink[module] == index[module]:
      component = []
      while True:
        name = stack.pop()
        component.append(name)
        if name == module:
          break
      if len(component) > 1 or module in graph.get(module, ()):
        circles.append(sorted(component))

  for module in sorted(graph):
    if module not in index:
      visit(module)
  return circles


@pytest.mark.parametrize("path", [_PACKAGE / "settings.py", *_modules("runtime")], ids=_id)
def test_imports_point_down_the_layers(path):
  found = _layer_breaches(path)
  assert not found, f"decoupled_diloco/{_id(path)} reaches up a layer ({'; '.join(found)})"


def test_no_import_circles():
  circles = _circles()
  assert not circles, "import circles (every import counts, in a function too): " + "; ".join(
      " <-> ".join(circle) for circle in circles)


def test_the_layer_checks_find_what_they_look_for(tmp_path):
  """Each layer check passes only because it would fail: here it finds planted violations."""
  root = tmp_path / "decoupled_diloco"
  files = {
      "settings.py": "from decoupled_diloco.runtime.core import syncer\n",
      "runtime/train.py": "",
      "runtime/core/syncer.py": ("import ray\n"
                                 "from decoupled_diloco.runtime.core import learner\n"),
      "runtime/core/learner.py": ("from decoupled_diloco.runtime.records import tape\n"
                                  "def f():\n"
                                  "  from decoupled_diloco.runtime.core import syncer\n"),
      "runtime/core/messages.py": "",
      "runtime/records/tape.py": ("from decoupled_diloco.runtime.control import supervisor\n"
                                  "from decoupled_diloco.runtime.faults import injector\n"
                                  "from decoupled_diloco.runtime.core.messages import Offer\n"),
      "runtime/faults/injector.py": "",
      "runtime/control/supervisor.py": ("from decoupled_diloco.runtime.transport import ray_x\n"
                                        "from decoupled_diloco.runtime.core import messages\n"),
      "runtime/transport/ray_x.py": "from decoupled_diloco.runtime import train\n",
  }
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding="utf-8")
  breaches = {name: " ".join(_layer_breaches(root / name, root)) for name in files}
  assert "imports decoupled_diloco.runtime.core.syncer" in breaches["settings.py"]
  assert "imports ray " in breaches["runtime/core/syncer.py"]
  assert "runtime.core.learner" not in breaches["runtime/core/syncer.py"]  # its own layer: fine
  assert "imports decoupled_diloco.runtime.records.tape" in breaches["runtime/core/learner.py"]
  assert "runtime.control.supervisor (records/" in breaches["runtime/records/tape.py"]
  assert "runtime.faults" not in breaches["runtime/records/tape.py"]  # a side layer beside it: fine
  assert "core.messages" not in breaches["runtime/records/tape.py"]  # a name in a module below
  assert "runtime.transport.ray_x (only transport/" in breaches["runtime/control/supervisor.py"]
  assert "runtime.train (runtime/train.py and runtime/tpu_aot.py are entries" in breaches["runtime/transport/ray_x.py"]
  assert _circles(root) == [["decoupled_diloco.runtime.core.learner",
                             "decoupled_diloco.runtime.core.syncer"]]
