"""Reading a compiled program: XLA's optimized HLO text and the traced step, for ``tacl_jax.aot``.

Compiler figures, not measurements. What is read:

* **Estimated time** (TPU): XLA:TPU annotates each scheduled instruction's ``backend_config`` with
  its own ``estimated_cycles``. Summed over the entry computation, with every ``while`` body
  counted ``known_trip_count`` times (a scanned encoder, gradient accumulation) and called
  computations followed, then divided by the chip's clock, it estimates the step. Fusions carry
  the estimate of their whole body, so fused computations are not descended into. It is a
  pessimistic, rough estimate (element-wise work is over-estimated, see docs/performance.md): good for
  comparing two programs on the same topology.
* **Collectives** (``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``,
  ``collective-permute``, their async ``-start`` forms, and fusions built around one) per step,
  with the bytes of their results, times trip counts.
* **Relayout copies**: ``copy`` and ``transpose`` instructions and fusions whose root is one
  (bytes written), times trip counts. ``copy-start``/``copy-done`` (prefetches between memory
  spaces) are not relayouts and are not counted.
* **CPU-only kernels**: ops traced under the ``tacl_cpu_kernel`` name scope
  (``tacl_jax.models.layers.CPU_KERNEL_SCOPE``) keep it in their metadata.
* **Matmul FLOPs** of the traced step (``jaxpr_matmul_flops``): every ``dot_general`` of its jaxpr,
  scans counted ``length`` times: what ``tacl_jax.flops`` models, independent of XLA's fusion or
  its cost model (which counts a ``while`` body once).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import numpy as np

from tacl_jax.models.layers import CPU_KERNEL_SCOPE

_COMP_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_SHAPE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|c64|c128|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
UNKNOWN_CYCLES = 1 << 60   # an estimate this large is XLA's "no estimate" sentinel, not a cost
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type (``bf16[8,128]{...}`` or a tuple of them)."""
    return int(sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
                   for t, dims in _SHAPE.findall(type_text)))


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    type_text: str
    rest: str
    root: bool

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.rest)
        return m.group(1) if m else None

    @property
    def backend_config(self) -> dict:
        i = self.rest.find("backend_config=")
        if i < 0:
            return {}
        text = self.rest[i + len("backend_config="):]
        try:
            return json.JSONDecoder().raw_decode(text)[0]
        except ValueError:
            return {}

    @property
    def estimated_cycles(self) -> int:
        """XLA:TPU's estimate; 0 when absent or a sentinel (values near 2**63 mean "unknown")."""
        m = re.search(r'"estimated_cycles":"(\d+)"', self.rest)
        n = int(m.group(1)) if m else 0
        return 0 if n >= UNKNOWN_CYCLES else n

    @property
    def unknown_cycles(self) -> bool:
        m = re.search(r'"estimated_cycles":"(\d+)"', self.rest)
        return bool(m) and int(m.group(1)) >= UNKNOWN_CYCLES

    @property
    def trip_count(self) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.rest)
        return int(m.group(1)) if m else None


def parse(hlo: str) -> tuple[dict[str, list[Instr]], str]:
    """``({computation name: its instructions}, entry name)`` of compiled HLO text."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = _COMP_HEADER.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(Instr(m.group(2), m.group(4), m.group(3), m.group(5), bool(m.group(1))))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


@dataclasses.dataclass
class Summary:
    """Per-step totals of one compiled program (one device's share)."""

    estimated_cycles: float = 0.0
    collectives: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)   # kind -> count, bytes
    relayout_count: float = 0.0
    relayout_bytes: float = 0.0
    relayout_cycles: float = 0.0
    cpu_kernel_ops: int = 0
    loops: list[tuple[str, int]] = dataclasses.field(default_factory=list)   # (body, trip count)
    top_relayouts: list[tuple[float, str]] = dataclasses.field(default_factory=list)   # (bytes/step, op_name)
    # Estimated cycles by what the instruction does: 'matmul' (a convolution/dot, fused or not),
    # 'collective', 'relayout', 'other' (element-wise, reductions, gathers, RNG...).
    cycles_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)
    unknown_cost_ops: list[str] = dataclasses.field(default_factory=list)   # sentinel estimates, left out
    # The costliest ops by their estimate (times trip counts), summed per (kind, op_name).
    top_ops: list[tuple[float, str, str]] = dataclasses.field(default_factory=list)   # (cycles, kind, op_name)

    @property
    def collective_bytes(self) -> float:
        return float(sum(c["bytes"] for c in self.collectives.values()))


def _fused_root(comps, instr: Instr) -> Instr | None:
    called = instr.attr("calls")
    body = comps.get(called or "", [])
    return next((i for i in body if i.root), None)


def _collective_kind(comps, instr: Instr) -> str | None:
    op = instr.opcode.removesuffix("-start")
    if op in COLLECTIVES:
        return op
    if instr.opcode == "fusion":
        for inner in comps.get(instr.attr("calls") or "", []):
            inner_op = inner.opcode.removesuffix("-start")
            if inner_op in COLLECTIVES:
                return inner_op
    return None


def _has_matmul(comps, instr: Instr) -> bool:
    if instr.opcode in ("convolution", "dot"):
        return True
    if instr.opcode == "fusion":
        return any(i.opcode in ("convolution", "dot") for i in comps.get(instr.attr("calls") or "", []))
    return False


def _relayout(comps, instr: Instr) -> bool:
    if instr.opcode in ("copy", "transpose"):
        return True
    if instr.opcode == "fusion":
        root = _fused_root(comps, instr)
        return root is not None and root.opcode in ("copy", "transpose")
    return False


def summarize(hlo: str) -> Summary:
    """Walk the entry computation (loops times their trip counts, called computations followed,
    fusions as one instruction) and total the figures of the module doc."""
    comps, entry = parse(hlo)
    s = Summary()
    s.cpu_kernel_ops = hlo.count(CPU_KERNEL_SCOPE)
    relayouts: dict[str, float] = {}
    by_op: dict[tuple[str, str], float] = {}

    def walk(name: str, times: float, depth: int = 0):
        if depth > 50:
            raise ValueError("HLO call depth over 50: a cycle?")
        for ins in comps.get(name, []):
            if ins.opcode == "while":
                body, cond = ins.attr("body"), ins.attr("condition")
                n = ins.trip_count if ins.trip_count is not None else _counter_bound(comps.get(cond or "", []))
                trips = n if n is not None else 1
                s.loops.append((body or "?", n if n is not None else -1))
                walk(body, times * trips, depth + 1)
                if cond:
                    walk(cond, times * (trips + 1), depth + 1)
                continue
            if ins.opcode in ("call", "conditional", "async-start"):
                for key in ("to_apply", "calls"):
                    target = ins.attr(key)
                    if target:
                        walk(target, times, depth + 1)
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
                if m:   # the estimate of a conditional: its most expensive branch
                    branches = [b.strip().lstrip("%") for b in m.group(1).split(",")]
                    costs = [(_cycles_of(comps, b), b) for b in branches]
                    walk(max(costs)[1], times, depth + 1)
                continue
            s.estimated_cycles += times * ins.estimated_cycles
            if ins.unknown_cycles:
                s.unknown_cost_ops.append(f"{ins.opcode} {ins.name}")
            kind = _collective_kind(comps, ins)
            what = ("collective" if kind else "relayout" if _relayout(comps, ins)
                    else "matmul" if _has_matmul(comps, ins) else "other")
            s.cycles_by_kind[what] = s.cycles_by_kind.get(what, 0.0) + times * ins.estimated_cycles
            if ins.estimated_cycles:
                m = re.search(r'op_name="([^"]*)"', ins.rest)
                op = re.sub(r"layer_\d+", "layer_*", m.group(1) if m else ins.opcode)
                by_op[(what, op)] = by_op.get((what, op), 0.0) + times * ins.estimated_cycles
            if kind:
                c = s.collectives.setdefault(kind, {"count": 0.0, "bytes": 0.0})
                c["count"] += times
                c["bytes"] += times * shape_bytes(ins.type_text)
            elif _relayout(comps, ins):
                nbytes = shape_bytes(ins.type_text)
                s.relayout_count += times
                s.relayout_bytes += times * nbytes
                s.relayout_cycles += times * ins.estimated_cycles
                m = re.search(r'op_name="([^"]*)"', ins.rest)
                key = m.group(1) if m else ins.name
                relayouts[key] = relayouts.get(key, 0.0) + times * nbytes

    walk(entry, 1.0)
    s.top_relayouts = sorted(((b, k) for k, b in relayouts.items()), reverse=True)[:8]
    s.top_ops = sorted(((c, kind, op) for (kind, op), c in by_op.items()), reverse=True)[:12]
    return s


def _counter_bound(cond: list[Instr]) -> int | None:
    """The trip count of a ``lax.scan``-shaped loop from its condition ``i < N`` (a counter from 0;
    what XLA leaves when it does not annotate ``known_trip_count``, e.g. without optimizations)."""
    consts = {i.name: i.rest.split(")")[0] for i in cond if i.opcode == "constant"}
    for i in cond:
        if i.opcode == "compare" and "direction=LT" in i.rest:
            operands = re.findall(r"%([\w.\-]+)", i.rest.split(")")[0])
            if len(operands) == 2 and operands[1] in consts and consts[operands[1]].lstrip("-").isdigit():
                return int(consts[operands[1]])
    return None


def _cycles_of(comps, name: str) -> int:
    return sum(i.estimated_cycles for i in comps.get(name, []))


# ----------------------------------------------------------------------------- traced FLOPs

def jaxpr_matmul_flops(closed_jaxpr) -> float:
    """``2·|out|·|contracted|`` summed over every ``dot_general`` of a (closed) jaxpr, sub-jaxprs
    included (jit, custom VJPs, remat), a ``scan`` body ``length`` times, a ``cond`` at its
    costliest branch. Global (unpartitioned) FLOPs."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * float(np.prod(out)) * float(np.prod([lhs[i] for i in lc]))
            continue
        subs = _sub_jaxprs(eqn)
        if name == "scan":
            total += eqn.params["length"] * sum(jaxpr_matmul_flops(j) for j in subs)
        elif name == "shard_map":   # the body has one device's shapes: times the manual devices
            total += _manual_devices(eqn) * sum(jaxpr_matmul_flops(j) for j in subs)
        elif name == "cond":
            total += max((jaxpr_matmul_flops(j) for j in subs), default=0.0)
        elif name == "while":
            raise ValueError("a while loop in the step: its trip count is unknown to the FLOPs count")
        else:
            total += sum(jaxpr_matmul_flops(j) for j in subs)
    return total


def jaxpr_loop_extra_flops(closed_jaxpr) -> float:
    """Matmul FLOPs that a count visiting every loop body once misses: each ``scan``'s body
    FLOPs times ``length - 1`` (nested scans included). Added to XLA's ``cost_analysis()`` FLOPs,
    which count a ``while`` body once, it gives the step's."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    extra = 0.0
    for eqn in jaxpr.eqns:
        subs = _sub_jaxprs(eqn)
        if eqn.primitive.name == "scan":
            body = sum(jaxpr_matmul_flops(j) for j in subs)
            inner = sum(jaxpr_loop_extra_flops(j) for j in subs)
            # XLA visits the body once (and, in it, each inner loop's body once): the other
            # trips in full, plus what that one visit missed of the inner loops.
            extra += (eqn.params["length"] - 1) * body + inner
        elif eqn.primitive.name == "shard_map":
            extra += _manual_devices(eqn) * sum(jaxpr_loop_extra_flops(j) for j in subs)
        else:
            extra += sum(jaxpr_loop_extra_flops(j) for j in subs)
    return extra


def _manual_devices(eqn) -> int:
    """How many devices a ``shard_map`` body runs on in parallel: the product of its manual axes."""
    mesh = eqn.params["mesh"]
    axes = eqn.params.get("manual_axes") or eqn.params.get("newly_manual_axes") or tuple(mesh.shape)
    return int(np.prod([mesh.shape[a] for a in axes]))


def _sub_jaxprs(eqn) -> list[Any]:
    out = []
    for key, val in eqn.params.items():
        if key in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "bwd", "fwd_jaxpr_thunk"):
            continue   # custom rules not part of the traced computation
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for v in vals:
            if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                out.append(v)
    return out
