"""`--help_config`: every config field with its value and a one-line description.

The descriptions are the comments of experiments/tiny_cpu.py, the file where every field is set
once: a field's own trailing comment, else the comment block just above it (its first sentence).
Reading them from there keeps one source of truth; a field added without a comment shows up in
tests/test_bad_inputs.py, which asks for a description of every field.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import ml_collections

DEFAULT_EXPERIMENT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "tiny_cpu.py"


def _comments(source: str) -> dict[int, tuple[str, bool]]:
  """Line number -> (comment text, whether the comment is the whole line)."""
  comments = {}
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      whole_line = not token.line[:token.start[1]].strip()
      comments[token.start[0]] = (token.string.lstrip("#").strip(), whole_line)
  return comments


def _dotted(target: ast.expr) -> str | None:
  """"a.b" for the target `config.a.b`, else None."""
  parts = []
  while isinstance(target, ast.Attribute):
    parts.append(target.attr)
    target = target.value
  if isinstance(target, ast.Name) and target.id == "config" and parts:
    return ".".join(reversed(parts))
  return None


def _first_sentence(text: str) -> str:
  # A sentence ends at ". " before a capital letter or a digit; "e.g. " and "x.y" do not end one.
  match = re.search(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z0-9(])", text)
  return text[:match.start() + 1] if match else text


def descriptions(path: str | pathlib.Path = DEFAULT_EXPERIMENT) -> dict[str, str]:
  """Dotted field (and section) name -> its one-line description, from the comments of `path`."""
  source = pathlib.Path(path).read_text(encoding="utf-8")
  comments = _comments(source)
  found = {}
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Assign) or len(node.targets) != 1:
      continue
    name = _dotted(node.targets[0])
    if name is None:
      continue
    trailing = comments.get(node.end_lineno)
    if trailing is not None and not trailing[1]:
      text = trailing[0]
    else:
      block, line = [], node.lineno - 1
      while line in comments and comments[line][1]:
        block.insert(0, comments[line][0])
        line -= 1
      text = " ".join(block)
    found[name] = _first_sentence(" ".join(text.split()))
  return found


def describe_fields(config: ml_collections.ConfigDict, fields: tuple[str, ...],
                    path: str | pathlib.Path = DEFAULT_EXPERIMENT) -> str:
  """The listing `--help_config` prints: one line per field, `config.FIELD=VALUE  description`,
  in the order of `fields`; values from `config`, descriptions from the comments of `path`."""
  described = descriptions(path)
  lines = [f"Config fields: override any with --config.FIELD=VALUE (values of this experiment; "
           f"{pathlib.Path(path).name} says more about each)"]
  for name in fields:
    value = config
    for part in name.split("."):
      value = value[part]
    lines.append(f"  config.{name}={value!r}  {described.get(name, '')}".rstrip())
  return "\n".join(lines)
