"""The text of an optimized XLA HLO module, read: its computations and instructions, the arrays of a
shape and their bytes, which instructions are collectives. What the cost model and the ruler walk
(bench/predict/hlo_walk.py) is built from these."""
from __future__ import annotations

import dataclasses
import re

BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8,
        "f8e8m0fnu": 8, "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "bf16": 16, "f16": 16, "s16": 16,
        "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64, "c64": 64,
        "c128": 128, "token": 0}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_NAME = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Instr:
  name: str
  shape: str             # the result shape text, a tuple "(...)" or one array
  opcode: str
  operands: list[str]
  attrs: str             # everything after the operand list
  root: bool = False
  args: str = ""         # the operand list as written (a constant's value)

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
    return m.group(1) if m else None

  @property
  def op_name(self) -> str:
    m = _OP_NAME.search(self.attrs)
    return m.group(1) if m else ""


def _balanced(text: str, start: int) -> int:
  """Index just past the parenthesis group opening at text[start] == '('."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c == "(":
      depth += 1
    elif c == ")":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def parse_instr(line: str) -> Instr | None:
  m = _NAME.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    sp = rest.find(" ")
    if sp < 0:
      return None
    shape, rest = rest[:sp], rest[sp + 1:].lstrip()
  paren = rest.find("(")
  if paren < 0:
    return None
  opcode = rest[:paren].strip()
  end = _balanced(rest, paren)
  operands = OPERAND.findall(rest[paren + 1:end - 1])
  return Instr(m.group(2), shape, opcode, operands, rest[end:], root=bool(m.group(1)),
               args=rest[paren + 1:end - 1].strip())


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str | None]:
  """``({computation: instructions}, entry name)`` of HLO module text."""
  comps, entry, name = {}, None, None
  for line in text.splitlines():
    if line and not line[0].isspace():
      header = _HEADER.match(line)
      if header and not line.startswith("HloModule"):
        name = header.group(2)
        comps[name] = []
        if header.group(1):
          entry = name
        continue
      if line.startswith("}"):
        name = None
        continue
    if name is not None:
      ins = parse_instr(line)
      if ins is not None:
        comps[name].append(ins)
  return comps, entry


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
  total = 0
  for dtype, dims in arrays(shape):
    n = 1
    for d in dims:
      n *= d
    total += n * BITS.get(dtype, 32) // 8
  return total


def prod(dims) -> int:
  n = 1
  for d in dims:
    n *= d
  return n


def collective(ins: Instr) -> str | None:
  """The collective an instruction is (its ``-start`` form counted as the collective), or None."""
  op = ins.opcode[:-6] if ins.opcode.endswith("-start") else ins.opcode
  return op if op in COLLECTIVES else None
