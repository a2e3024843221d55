"""Reading XLA's compiled HLO text in tests: its dot instructions, with operand dtypes and shapes."""

from __future__ import annotations

import dataclasses
import math
import re

_VALUE = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)(.*)")


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


@dataclasses.dataclass(frozen=True)
class Dot:
    out_dtype: str
    out_shape: tuple[int, ...]
    lhs_dtype: str
    lhs_shape: tuple[int, ...]
    rhs_dtype: str
    rhs_shape: tuple[int, ...]
    lhs_contracting: tuple[int, ...]

    @property
    def flops(self) -> int:
        """``2·|out|·|contracted|``."""
        return 2 * math.prod(self.out_shape) * math.prod(self.lhs_shape[i] for i in self.lhs_contracting)


def dots(hlo: str) -> list[Dot]:
    """Every ``dot`` of compiled HLO text (fused computations included)."""
    values = {m.group(1): (m.group(2), _dims(m.group(3))) for m in _VALUE.finditer(hlo)}
    out = []
    for m in _DOT.finditer(hlo):
        (lt, ls), (rt, rs) = values[m.group(4)], values[m.group(5)]
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", m.group(6))
        out.append(Dot(m.group(2), _dims(m.group(3)), lt, ls, rt, rs, _dims(contracting.group(1))))
    return out
