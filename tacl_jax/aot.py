"""Compile the real train step for a Cloud TPU topology or 8×H100 on any machine, and report.

    python -m tacl_jax.aot --config=configs/tpu_v4_8.py --topology=v4-8 [--json=PATH] [--config.x=v]

The program is the one the training loop runs (``tacl_jax.train.setup.build_program``), built for
compile-only devices of the topology (``tacl_jax.topology``): nothing runs, no accelerator is
needed. It prints the mesh and hosts, the rows each host feeds, memory per device against usable
HBM, XLA's FLOPs against ``tacl_jax.flops``, an **estimated** step time (XLA:TPU's own
per-instruction cycle estimates; ``tacl_jax.hlo``) with tokens/s per chip and MFU, collectives
and relayout copies per step, compile time, and whether any CPU-only kernel is in the program.
Exit status 2 when the program does not fit the topology's HBM (or XLA refuses it as too large),
1 for a config or topology error.

``init.hf_path`` names a checkpoint that need not be on this machine: when it is not a local
folder, the architecture is ``init.scratch`` (bert-base-uncased's by default) and the special
token ids BERT's, as the report says.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

EXIT_DOES_NOT_FIT = 2


class DoesNotFit(RuntimeError):
    """The program is larger than the topology's HBM (at compile time or by its memory analysis)."""


def _architecture(config):
    """``(architecture, special ids, note)`` for a config whose checkpoint may be absent here."""
    from tacl_jax import hf, tokens
    from tacl_jax.models import BertConfig

    path = config.init.hf_path
    # A folder, or a Hub id already in the Hugging Face cache: never a download from here.
    folder = hf.local_folder(path) if path else None
    if folder:
        arch = hf.read_config(folder)
        tok = hf.local_folder(config.init.tokenizer_path) if config.init.tokenizer_path else folder
        special = tokens.run_special_ids(tok, arch.vocab_size) if tok else tokens.default_special_ids(arch.vocab_size)
        return arch, special, f"architecture from {path} ({folder}/config.json)"
    arch = BertConfig(**dict(config.init.scratch))
    tok = config.init.tokenizer_path or path
    special = None if tok and os.path.isdir(tok) else tokens.default_special_ids(arch.vocab_size)
    note = (f"init.hf_path={path!r} is not on this machine: architecture from init.scratch "
            f"({arch.num_hidden_layers} layers, hidden {arch.hidden_size}, vocab {arch.vocab_size})" if path
            else "architecture from init.scratch")
    return arch, special, note


def _local_teacher(config):
    """``config`` with ``tacl.teacher_hf_path`` (a teacher of its own) pointing at a local folder:
    the architecture is read from its config.json, never downloaded. Raises ``ConfigError`` with
    the fix when it is not on this machine."""
    from tacl_jax import hf
    from tacl_jax.errors import ConfigError

    path = config.tacl.get("teacher_hf_path", "") if config.objective == "tacl" else ""
    if not path:
        return config
    folder = hf.local_folder(path)
    if folder is None:
        raise ConfigError(f"tacl.teacher_hf_path={path!r} is not on this machine: the compile needs its "
                          f"config.json (its architecture). Run `hf download {path} config.json` on a machine "
                          "with access, or point --config.tacl.teacher_hf_path at a folder holding it")
    config = config.copy_and_resolve_references()
    config.tacl.teacher_hf_path = folder
    return config


def compile_report(config, topology_name: str, config_name: str = "config") -> dict[str, Any]:
    """Build, lower and compile the step of ``config`` for the named topology; the report (a
    dict of the JSON keys). Raises ``DoesNotFit`` when XLA refuses the program as too large."""
    import jax

    from tacl_jax import hlo, topology
    from tacl_jax.train import setup

    topo = topology.TOPOLOGIES.get(topology_name)
    if topo is None:
        raise ValueError(f"unknown topology {topology_name!r}; known: {', '.join(topology.TOPOLOGIES)}")
    devices = topology.compile_only_devices(topology_name)
    arch, special, arch_note = _architecture(config)
    config = _local_teacher(config)
    t0 = time.perf_counter()
    prog = setup.build_program(config, devices, architecture=arch, special_ids=special)
    lowered = prog.lower()
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED / "Ran out of memory" for a too-large program
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
            first = next((ln for ln in text.splitlines() if ln.strip()), text)[:400]
            raise DoesNotFit(f"{config_name} does not fit {topology_name} ({topo.accelerator_type}, "
                             f"{topo.usable_hbm_bytes / 2**30:.2f} GiB usable HBM per device): XLA says: "
                             f"{first}") from e
        raise
    t2 = time.perf_counter()
    n = prog.target.num_devices
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    text = compiled.as_text()
    summary = hlo.summarize(text)
    with jax.set_mesh(prog.mesh):
        jaxpr = jax.make_jaxpr(prog.train_step)(prog.abstract_state, prog.abstract_teacher, prog.abstract_batch,
                                                prog.abstract_rng)
    traced = hlo.jaxpr_matmul_flops(jaxpr)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_flops = None
    if cost and cost.get("flops") is not None:
        # XLA counts each while body once: add the loop bodies' other trips (their matmuls).
        xla_flops = float(cost["flops"]) * n + hlo.jaxpr_loop_extra_flops(jaxpr)
    tokens_per_step = config.global_batch_size * config.max_len
    est_s = summary.estimated_cycles / topo.clock_hz if summary.estimated_cycles else None
    floor_s = prog.flops_per_step / (n * topo.peak_flops)
    c = prog.model.config
    report = {
        "config": config_name, "topology": topology_name, "accelerator_type": topo.accelerator_type,
        "platform": prog.target.platform, "device_kind": prog.target.device_kind, "devices": n,
        "hosts": prog.target.num_processes, "mesh": {k: int(v) for k, v in prog.mesh.shape.items()},
        "architecture": arch_note,
        "teacher": None if prog.teacher_model is None or prog.teacher_from_student else
        f"{config.tacl.teacher_hf_path}: {prog.teacher_model.config.num_hidden_layers} layers, hidden "
        f"{prog.teacher_model.config.hidden_size}",
        "compute_dtype": c.dtype, "kernels": c.kernels, "scan_layers": c.scan_layers,
        "remat_policy": c.remat_policy, "global_batch_size": config.global_batch_size, "max_len": config.max_len,
        "grad_accum_steps": config.grad_accum_steps,
        "rows_per_host": {str(p): len(r) for p, r in setup.host_rows(prog.mesh, config.global_batch_size).items()},
        "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
        "code_bytes": mem.generated_code_size_in_bytes, "peak_bytes": peak,
        "usable_hbm_bytes": topo.usable_hbm_bytes, "hbm_fraction": peak / topo.usable_hbm_bytes,
        "fits": peak <= topo.usable_hbm_bytes,
        "model_flops_per_step": prog.flops_per_step, "traced_matmul_flops": traced,
        "matmul_flops_ratio": traced / prog.flops_per_step,
        "xla_flops_per_step": xla_flops,
        "flops_ratio": None if xla_flops is None else xla_flops / prog.flops_per_step,
        "flops_floor_s": floor_s, "estimated_step_s": est_s,
        "estimated_tokens_per_s_per_chip": None if not est_s else tokens_per_step / est_s / n,
        "estimated_mfu": None if not est_s else floor_s / est_s,
        "collectives": summary.collectives, "collective_bytes": summary.collective_bytes,
        "relayout_copies": summary.relayout_count, "relayout_bytes": summary.relayout_bytes,
        "relayout_estimated_s": summary.relayout_cycles / topo.clock_hz if summary.estimated_cycles else None,
        "top_relayouts": [{"bytes": b, "op": op} for b, op in summary.top_relayouts],
        "estimated_s_by_kind": ({k: v / topo.clock_hz for k, v in summary.cycles_by_kind.items()}
                                if summary.estimated_cycles else None),
        "loops": [{"body": b, "trip_count": t} for b, t in summary.loops],
        "unknown_cost_ops": summary.unknown_cost_ops[:20],
        "top_estimated_ops": ([{"s": c / topo.clock_hz, "kind": k, "op": op} for c, k, op in summary.top_ops]
                              if summary.estimated_cycles else []),
        "cpu_kernels_in_program": summary.cpu_kernel_ops > 0, "cpu_kernel_ops": summary.cpu_kernel_ops,
        "lower_s": t1 - t0, "compile_s": t2 - t1,
        "peak_flops_per_device": topo.peak_flops, "clock_hz": topo.clock_hz,
    }
    return report


def format_report(r: dict[str, Any]) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"   # noqa: E731
    lines = [
        f"{r['config']} on {r['topology']} ({r['accelerator_type']}: {r['devices']} × {r['device_kind']}, "
        f"{r['hosts']} host(s)); mesh {r['mesh']}",
        f"  model: {r['architecture']}; compute {r['compute_dtype']}, kernels {r['kernels']}, "
        f"scan_layers {r['scan_layers']}, remat {r['remat_policy']}",
        *([f"  teacher: {r['teacher']}"] if r.get("teacher") else []),
        f"  batch {r['global_batch_size']} × L {r['max_len']} ({r['grad_accum_steps']} micro-batch(es)); rows per "
        f"host: {r['rows_per_host']}",
        f"  memory per device: arguments {gib(r['argument_bytes'])}, outputs {gib(r['output_bytes'])} "
        f"(aliased {gib(r['alias_bytes'])}), temporaries {gib(r['temp_bytes'])}, code {gib(r['code_bytes'])}",
        f"  peak {gib(r['peak_bytes'])} of {gib(r['usable_hbm_bytes'])} usable HBM "
        f"({r['hbm_fraction']:.0%}): {'fits' if r['fits'] else 'DOES NOT FIT'}",
        f"  FLOPs per step: model (tacl_jax.flops) {r['model_flops_per_step']:.4g}; traced matmuls "
        f"{r['matmul_flops_ratio']:.3f}×"
        + (f"; XLA (loops × trip counts) {r['flops_ratio']:.3f}×" if r["flops_ratio"] else "; XLA: n/a"),
    ]
    if r["estimated_step_s"]:
        lines.append(
            f"  ESTIMATE (XLA:TPU cycle estimates ÷ {r['clock_hz'] / 1e9:.2f} GHz, not a measurement): step "
            f"{r['estimated_step_s'] * 1e3:.1f} ms vs FLOPs floor {r['flops_floor_s'] * 1e3:.1f} ms -> "
            f"{r['estimated_tokens_per_s_per_chip']:,.0f} tokens/s/chip, MFU {r['estimated_mfu']:.1%}")
        lines.append("    of which " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                             sorted(r["estimated_s_by_kind"].items(), key=lambda kv: -kv[1])))
        for t in r["top_estimated_ops"][:6]:
            lines.append(f"    {t['s'] * 1e3:7.2f} ms  {t['kind']:8s} {t['op'][:100]}")
    else:
        lines.append(f"  no cycle estimate on this platform; FLOPs floor {r['flops_floor_s'] * 1e3:.1f} ms")
    coll = ", ".join(f"{k} {v['count']:.0f}× {v['bytes'] / 1e6:,.1f} MB" for k, v in sorted(r["collectives"].items()))
    lines.append(f"  collectives per step: {coll or 'none'} (total {r['collective_bytes'] / 1e9:.3f} GB)")
    est = f", est. {r['relayout_estimated_s'] * 1e3:.1f} ms" if r.get("relayout_estimated_s") else ""
    lines.append(f"  relayout copies per step: {r['relayout_copies']:.0f}, {r['relayout_bytes'] / 1e9:.3f} GB{est}")
    for t in r["top_relayouts"][:5]:
        lines.append(f"    {t['bytes'] / 1e6:9,.1f} MB  {t['op'][:110]}")
    lines.append(f"  CPU-only kernels in the program: {'YES (' + str(r['cpu_kernel_ops']) + ' ops)' if r['cpu_kernels_in_program'] else 'none'}")
    lines.append(f"  lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s")
    return "\n".join(lines)


def main(argv) -> int:
    from absl import flags

    flags_ = flags.FLAGS
    if len(argv) > 1:
        print(f"unexpected arguments {argv[1:]}; overrides look like --config.x.y=v", file=sys.stderr)
        return 1
    config = flags_.config
    name = os.path.relpath(flags_["config"].config_filename) if flags_["config"].config_filename else "config"
    try:
        report = compile_report(config, flags_.topology, name)
    except DoesNotFit as e:
        print(f"error: {e}", file=sys.stderr)
        _write_json(flags_.json, {"config": name, "topology": flags_.topology, "fits": False, "error": str(e)})
        return EXIT_DOES_NOT_FIT
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    _write_json(flags_.json, report)
    if not report["fits"]:
        print(f"error: {name} does not fit {flags_.topology}: peak {report['peak_bytes']:,} bytes per device > "
              f"{report['usable_hbm_bytes']:,} usable", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def _write_json(path: str, obj: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=float)


def _run():
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
    flags.DEFINE_string("topology", None, "Target topology (tacl_jax.topology.TOPOLOGIES), e.g. v4-8, v5e-16, h100x8.")
    flags.DEFINE_string("json", "", "Write the report as one JSON object here.")
    flags.mark_flags_as_required(["config", "topology"])
    logging.basicConfig(level=logging.WARNING)
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    # Compile-only: no TPU/GPU is used, and the host's CPU backend must not claim a TPU it lacks.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _run()
