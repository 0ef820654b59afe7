"""The optimised HLO text of a compiled XLA program (`compiled.as_text()`), read back: its
computations and instructions, array shapes and bytes, and how many times each computation runs
per call of the program, a while loop's body as many times as the loop runs.

XLA writes the trip count of a loop it knows (`known_trip_count`); otherwise it is read off the
loop's counter: its first value in the loop's initial tuple, its step in the body and the bound its
condition compares it with (JAX's scans count from 0 by 1; XLA:TPU's windowed einsums, which
overlap a matmul with the collective-permutes of its operand, by 2). A loop of any other shape is
counted once and reported. No JAX here.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1,
          "f8e5m2fnuz": 1}
# dtype[dims]{layout}: the layout's S(n) is the array's memory space (0, unprinted: HBM; on TPU
# 1 is VMEM, where the compiler keeps or prefetches buffers, 2 and above small scalar memories).
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True))
                    + r")\[([\d,]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an instruction's result."""

  dtype: str
  dims: tuple[int, ...]
  memory_space: int = 0

  @property
  def nbytes(self) -> float:
    return _BYTES[self.dtype] * math.prod(self.dims)

  @property
  def hbm_nbytes(self) -> float:
    """Its bytes if it lives in HBM (memory space 0), else none."""
    return self.nbytes if self.memory_space == 0 else 0.0


@dataclasses.dataclass
class Instruction:
  """One line of a computation: `%name = type opcode(operands), attributes`."""

  name: str
  opcode: str
  arrays: list[Array]  # of its result (a tuple's elements in order)
  operands: list[str]
  attributes: str
  arguments: str  # the text between the opcode's parentheses (a constant's value)


def _split_type(rest: str) -> tuple[str, str]:
  """'(f32[2]{0}, s32[]) tuple(%a, %b), x=y' -> the type and what follows it."""
  if rest.startswith("("):
    depth = 0
    for i, char in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _balanced(text: str) -> tuple[str, str]:
  """'(a, (b)), c' -> 'a, (b)' and ', c'."""
  depth = 0
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return text[1:i], text[i + 1:]
  return text[1:], ""


def _parse_instruction(line: str) -> Instruction | None:
  line = line.strip()
  if line.startswith("ROOT "):
    line = line[5:]
  if not line.startswith("%") or " = " not in line:
    return None
  name, rest = line[1:].split(" = ", 1)
  type_text, rest = _split_type(rest)
  opcode, paren, rest = rest.partition("(")
  if not paren:
    return None
  operands, attributes = _balanced("(" + rest)
  return Instruction(name=name, opcode=opcode.strip(),
                      arrays=[Array(d, tuple(int(x) for x in dims.split(",") if x),
                                    _memory_space(layout))
                              for d, dims, layout in _ARRAY.findall(type_text)],
                      operands=NAME.findall(operands), attributes=attributes,
                      arguments=operands.strip())


def _memory_space(layout: str) -> int:
  found = re.search(r"S\((\d+)\)", layout)
  return int(found.group(1)) if found else 0


def computations_of(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """Instructions of every computation, and the entry computation's name."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in _instruction_lines(text):
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    if current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  return computations, entry


def _instruction_lines(text: str) -> list[str]:
  """The text's lines, an instruction that spans several made one: a Pallas kernel's metadata
  (`frontend_attributes={kernel_metadata={` and a JSON object on lines of its own) breaks its
  custom call's line, and the rest of it (`}}, metadata=...`) must neither end the computation
  nor be lost."""
  lines: list[str] = []
  for line in text.splitlines():
    stripped = line.strip()
    starts = (not stripped or stripped == "}" or _HEADER.match(line)
              or stripped.startswith(("%", "ROOT ", "ENTRY ", "HloModule", "//")))
    if lines and not starts and lines[-1].lstrip().startswith(("%", "ROOT ")):
      lines[-1] += " " + stripped
    else:
      lines.append(line)
  return lines


def attribute(attributes: str, key: str) -> str | None:
  match = re.search(rf"\b{key}=(%[\w.\-]+|\{{[^}}]*\}})", attributes)
  return match.group(1) if match else None


def trip_count(instruction: Instruction, computation: list[Instruction],
                computations: dict[str, list[Instruction]]) -> int | None:
  """How many times a while loop runs: XLA's `known_trip_count`, else read off a counted loop,
  counter < N in its condition, counter += c in its body, the counter's first value in the
  loop's initial tuple (JAX's loops count from 0 by 1; XLA:TPU's windowed einsum loops, which
  overlap a matmul with the collective-permutes of its operand, by 2). None for any other."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
  if known:
    return int(known.group(1))
  condition = computations.get((attribute(instruction.attributes, "condition") or "").lstrip("%"))
  body = computations.get((attribute(instruction.attributes, "body") or "").lstrip("%"))
  if not condition or not body:
    return None
  index, bound = _compared_counter(condition)
  if index is None:
    return None
  step = _counter_step(body, index)
  start = _initial_value(instruction, computation, index)
  if step is None or step <= 0 or start is None:
    return None
  return max(0, -(-(bound - start) // step))


def integer_constants(instructions: list[Instruction]) -> dict[str, int]:
  return {ins.name: int(ins.arguments) for ins in instructions
          if ins.opcode == "constant" and re.fullmatch(r"-?\d+", ins.arguments)}


def _tuple_index(ins: Instruction | None) -> int | None:
  if ins is None or ins.opcode != "get-tuple-element":
    return None
  found = re.search(r"\bindex=(\d+)", ins.attributes)
  return int(found.group(1)) if found else None


def _compared_counter(condition: list[Instruction]) -> tuple[int | None, int]:
  """(tuple index of the counter, bound) of a condition `counter < bound`."""
  constants, by_name = integer_constants(condition), {ins.name: ins for ins in condition}
  for ins in condition:
    if ins.opcode != "compare" or len(ins.operands) != 2:
      continue
    left, right = ins.operands
    if "direction=LT" in ins.attributes and right in constants:
      counter, bound = left, constants[right]
    elif "direction=GT" in ins.attributes and left in constants:
      counter, bound = right, constants[left]
    else:
      continue
    index = _tuple_index(_through_copies(by_name, counter))
    if index is not None:
      return index, bound
  return None, 0


def _counter_step(body: list[Instruction], index: int) -> int | None:
  """c of `counter + c`, the body's new value of tuple element `index`."""
  constants, by_name = integer_constants(body), {ins.name: ins for ins in body}
  root = body[-1] if body else None
  if root is None or root.opcode != "tuple" or index >= len(root.operands):
    return None
  update = by_name.get(root.operands[index])
  if update is None or update.opcode != "add" or len(update.operands) != 2:
    return None
  for operand, other in (update.operands, update.operands[::-1]):
    if operand in constants and _tuple_index(_through_copies(by_name, other)) == index:
      return constants[operand]
  return None


def _through_copies(by_name: dict[str, Instruction], name: str) -> Instruction | None:
  """The instruction `name` copies or bitcasts, through any chain of them (XLA:TPU copies loop
  counters and constants between memory spaces)."""
  ins = by_name.get(name)
  while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
    ins = by_name.get(ins.operands[0])
  return ins


def _initial_value(instruction: Instruction, computation: list[Instruction],
                   index: int) -> int | None:
  """The counter's value in the tuple the loop starts from."""
  constants, by_name = integer_constants(computation), {ins.name: ins for ins in computation}
  init = by_name.get(instruction.operands[0]) if instruction.operands else None
  if init is None or init.opcode != "tuple" or index >= len(init.operands):
    return None
  value = _through_copies(by_name, init.operands[index])
  return constants.get(value.name) if value is not None else None


def multiplicities(computations: dict[str, list[Instruction]], entry: str
                    ) -> tuple[dict[str, float], int]:
  """How many times each computation runs per call of the entry one, and the loops whose trip
  count was not found."""
  edges: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
  unknown = 0
  for caller, instructions in computations.items():
    for ins in instructions:
      if ins.opcode == "while":
        trips = trip_count(ins, instructions, computations)
        if trips is None:
          unknown += 1
        body = attribute(ins.attributes, "body")
        if body:
          edges[caller].append((body.lstrip("%"), float(trips or 1)))
        continue
      for key in ("calls", "true_computation", "false_computation"):
        callee = attribute(ins.attributes, key)
        if callee:
          edges[caller].append((callee.lstrip("%"), 1.0))
      branches = attribute(ins.attributes, "branch_computations")
      if branches:
        edges[caller] += [(name, 1.0) for name in NAME.findall(branches)]
  # The call graph is a DAG: visit callers before callees.
  order, seen = [], set()

  def visit(name: str) -> None:
    if name in seen:
      return
    seen.add(name)
    for callee, _ in edges.get(name, ()):
      visit(callee)
    order.append(name)

  visit(entry)
  times = collections.defaultdict(float)
  times[entry] = 1.0
  for name in reversed(order):
    for callee, factor in edges.get(name, ()):
      times[callee] += times[name] * factor
  return times, unknown
