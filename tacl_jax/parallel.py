"""Device mesh, logical-axis rules, sharded state creation, global batches, multi-host start-up.

The model names axes logically (``embed``, ``mlp``, ``activation_batch``, ...); ``LOGICAL_AXIS_RULES``
is the single table that maps those names onto the mesh axes ``data``, ``fsdp`` and ``tensor``:

* ``data``: pure data parallelism (parameters replicated);
* ``fsdp``: data parallelism with parameters and optimizer state sharded over the ``embed`` axis
  (ZeRO-3 style; XLA all-gathers weights per layer);
* ``tensor``: Megatron-style tensor parallelism over heads, the MLP and the vocabulary.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axes. Parameters: vocab/heads/mlp over tensor, embed over fsdp.
# Activations have names of their own so that the batch (over data+fsdp) never competes with
# the fsdp-sharded embed axis of the weights.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("embed_out", None),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("position", None),
    ("type", None),
    ("layers", None),                    # the stacked layer axis of a scanned encoder (scan_layers)
)


def rules_from_config(rules: Sequence | None) -> tuple:
    """The config's rule list (lists from ml_collections) as the tuple flax expects."""
    if not rules:
        return LOGICAL_AXIS_RULES
    return tuple((name, tuple(ax) if isinstance(ax, (list, tuple)) else ax) for name, ax in rules)


# ----------------------------------------------------------------------------- start-up

DISTRIBUTED_MODES = ("auto", "always", "never")


def distributed_decision(mode: str, env: Mapping[str, str], *, coordinator_address: str = "",
                         tpu_vm_processes: Callable[[], int | None] | None = None) -> tuple[bool, str]:
    """Whether this process should call ``jax.distributed.initialize``, and why (a pure function of
    the config, the environment and, last, the Cloud TPU metadata).

    ``mode`` is ``config.distributed.initialize``. ``'never'``: no. An explicit
    ``coordinator_address`` or ``'always'``: yes. ``'auto'`` (the default) says yes only when this
    is one process of several:

    * Multislice TPU: ``MEGASCALE_NUM_SLICES`` > 1 or ``MEGASCALE_COORDINATOR_ADDRESS`` set;
    * a TPU slice whose hosts (or processes) the environment lists: ``TPU_PROCESS_ADDRESSES`` /
      ``TPU_WORKER_HOSTNAMES`` with more than one entry (GKE, multi-process hosts; one entry = one
      host: no), or ``CLOUD_TPU_TASK_ID`` (one of several processes on a TPU host);
    * SLURM: ``SLURM_JOB_ID`` with ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``) > 1;
    * a Cloud TPU VM slice (GCE, ``launch/tpu_vm.sh``), whose environment names no peers:
      ``tpu_vm_processes()`` (hosts × slices from the metadata server, None off a TPU VM) > 1.

    Anything else (a laptop, one GPU host, a single-host TPU VM such as v4-8) runs alone.
    ``jax.distributed.initialize()`` is then called without arguments: JAX reads the same
    environment (or metadata) for the coordinator, the process count and this process's id.
    """
    if mode not in DISTRIBUTED_MODES:
        raise ValueError(f"config.distributed.initialize={mode!r}: use one of {DISTRIBUTED_MODES}")
    if mode == "never":
        return False, "config.distributed.initialize='never'"
    if coordinator_address:
        return True, f"config.distributed.coordinator_address={coordinator_address}"
    if mode == "always":
        return True, "config.distributed.initialize='always' (JAX finds the cluster in the environment)"
    slices = _int(env.get("MEGASCALE_NUM_SLICES"))
    if (slices or 0) > 1 or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True, f"Multislice TPU (MEGASCALE_NUM_SLICES={env.get('MEGASCALE_NUM_SLICES', '?')})"
    for var in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        if env.get(var, "").strip():
            n = len([w for w in env[var].split(",") if w.strip()])
            if n > 1:
                return True, f"TPU slice of {n} hosts/processes ({var})"
            return False, f"one TPU host ({var} lists one)"
    if env.get("CLOUD_TPU_TASK_ID", "").strip():
        return True, f"one of several processes on a TPU host (CLOUD_TPU_TASK_ID={env['CLOUD_TPU_TASK_ID']})"
    if "SLURM_JOB_ID" in env:
        var = next((v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if _int(env.get(v))), None)
        n = _int(env.get(var)) if var else 1
        if n > 1:
            return True, f"SLURM job step of {n} tasks ({var})"
        return False, "SLURM job with one task"
    n = tpu_vm_processes() if tpu_vm_processes is not None else None
    if n is not None:
        if n > 1:
            return True, f"Cloud TPU VM slice of {n} hosts (metadata)"
        return False, "single-host Cloud TPU VM (metadata)"
    return False, "one process (no TPU slice, Multislice or SLURM job in the environment)"


def _int(value) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def local_device_ids_decision(env: Mapping[str, str], explicit: Sequence[int] = ()
                              ) -> tuple[tuple[int, ...] | None, str]:
    """The GPUs this process drives (``local_device_ids`` for ``jax.distributed.initialize``), and
    why: a pure function of ``config.distributed.local_device_ids`` (``explicit``) and the
    environment. None leaves the choice to JAX.

    Why not JAX's own choice: inside a SLURM task JAX takes ``[SLURM_LOCALID]``
    (``jax/_src/clusters``), which is right only when every task of a node sees all of the node's
    GPUs and drives one. With one task per node it drives GPU 0 alone; with ``--gpus-per-task=1``
    the task sees a single GPU, numbered 0 in its process, and GPU ``SLURM_LOCALID`` does not exist.

    * an explicit list wins; then ``JAX_LOCAL_DEVICE_IDS`` (JAX reads it itself): None;
    * outside a SLURM task (no ``SLURM_JOB_ID`` / ``SLURM_LOCALID``: TPU VMs, one GPU host): None;
    * the GPUs this process sees: ``CUDA_VISIBLE_DEVICES`` with N entries is GPUs 0..N-1 (CUDA
      renumbers them from 0 in the process, whatever the physical ids); without it
      ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS`` (the node's ids, which the process then sees as
      they are), else ``SLURM_GPUS_ON_NODE`` = N (0..N-1); none of these: None (no GPUs known);
    * the tasks on this node: ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``8(x2)``, indexed by
      ``SLURM_NODEID``), else ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``;
    * one task on the node, a task that sees one GPU, or as many as ``SLURM_GPUS_PER_TASK``, or
      fewer GPUs than the node has tasks (SLURM bound them to it): all the GPUs it sees; several
      tasks sharing the node's GPUs: an equal block each, task ``SLURM_LOCALID`` the
      ``SLURM_LOCALID``-th (8 GPUs, 8 tasks: GPU ``SLURM_LOCALID``); a share that does not divide
      evenly is a ValueError that says how to fix it.
    """
    if explicit:
        return tuple(int(i) for i in explicit), "config.distributed.local_device_ids"
    if env.get("JAX_LOCAL_DEVICE_IDS", "").strip():
        return None, f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']} (read by JAX)"
    local_id = _int(env.get("SLURM_LOCALID"))
    if "SLURM_JOB_ID" not in env or local_id is None:
        return None, "not an srun task (no SLURM_JOB_ID and SLURM_LOCALID): JAX's default"
    visible, source = _visible_gpus(env)
    if not visible:
        return None, f"no GPUs listed for this SLURM task ({source}): JAX's default"
    tasks, tasks_source = _slurm_tasks_on_node(env)
    n = len(visible)
    gpus = f"{n} GPU{'s' if n > 1 else ''} ({source})"
    if tasks == 1:
        return visible, f"one task on this node ({tasks_source}): all of its {gpus}"
    if n == 1:
        return visible, f"task {local_id} sees one GPU, bound to it by SLURM ({source})"
    per_task = _int(env.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2])
    if per_task == n:
        return visible, f"task {local_id} sees its {gpus}, bound to it by SLURM_GPUS_PER_TASK={per_task}"
    if tasks is None:
        return None, f"{gpus} and an unknown number of tasks on this node: JAX's default [SLURM_LOCALID]"
    if n < tasks:
        return visible, f"task {local_id} sees {gpus}, fewer than the node's {tasks} tasks: bound to it by SLURM"
    if not 0 <= local_id < tasks:
        raise ValueError(f"SLURM_LOCALID={local_id} is not one of the {tasks} tasks on this node "
                         f"({tasks_source}); set config.distributed.local_device_ids")
    if n % tasks:
        raise ValueError(
            f"SLURM task {local_id} of {tasks} on this node ({tasks_source}) shares {gpus}: they do not "
            f"split evenly between the tasks. Bind GPUs to tasks (srun --gpus-per-task=N), run a "
            f"multiple of the GPU count per node, or set config.distributed.local_device_ids")
    k = n // tasks
    ids = visible[local_id * k:(local_id + 1) * k]
    return ids, (f"task {local_id} of {tasks} on this node ({tasks_source}) takes GPU"
                 f"{'s' if k > 1 else ''} {','.join(map(str, ids))} of the {gpus} they share")


def _visible_gpus(env: Mapping[str, str]) -> tuple[tuple[int, ...], str]:
    """The GPU ordinals this process sees, and the variable that says so (see
    :func:`local_device_ids_decision`); () when no variable lists any."""
    if "CUDA_VISIBLE_DEVICES" in env:
        value = env["CUDA_VISIBLE_DEVICES"]
        # SLURM writes NoDevFiles for a task without GPUs; CUDA ignores the entries from a
        # negative one on (-1 hides every GPU).
        n = 0
        for entry in value.split(",") if value.strip() != "NoDevFiles" else ():
            if not entry.strip() or entry.strip().startswith("-"):
                break
            n += 1
        return tuple(range(n)), f"CUDA_VISIBLE_DEVICES={value}"
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = [_int(e) for e in env.get(var, "").split(",") if e.strip()]
        if ids and None not in ids:
            return tuple(ids), f"{var}={env[var]}"
    n = _int(env.get("SLURM_GPUS_ON_NODE"))
    if n:
        return tuple(range(n)), f"SLURM_GPUS_ON_NODE={n}"
    return (), "no CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, SLURM_JOB_GPUS or SLURM_GPUS_ON_NODE"


def _slurm_tasks_on_node(env: Mapping[str, str]) -> tuple[int | None, str]:
    """Tasks of this SLURM step on this node, and the variable that says so; None if unknown.
    SLURM writes per-node counts compressed: ``8(x2),4`` is 8, 8, 4 for nodes 0, 1, 2."""
    node = _int(env.get("SLURM_NODEID"))
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = []
        for part in env.get(var, "").split(","):
            m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
            if not m:
                counts = []
                break
            counts += [int(m[1])] * int(m[2] or 1)
        if len(set(counts)) == 1:
            return counts[0], f"{var}={env[var]}"
        if counts and node is not None and 0 <= node < len(counts):
            return counts[node], f"{var}={env[var]}, node {node}"
    return None, "no SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE"


def maybe_initialize_distributed(cfg) -> None:
    """Start JAX's multi-host runtime when this is one process of many (see
    :func:`distributed_decision`); once per process.

    ``cfg`` is ``config.distributed``: ``initialize`` (``'auto'`` | ``'always'`` | ``'never'``),
    ``coordinator_address`` (``host:port``), ``num_processes``, ``process_id``,
    ``local_device_ids``. ``num_processes`` and ``process_id`` are used only with an address;
    the GPUs this process drives come from :func:`local_device_ids_decision` (an explicit
    ``local_device_ids`` first, else the SLURM environment) in both cases.
    """
    global _DECIDED
    if _DECIDED or _distributed_is_initialized():
        return
    initialize, reason = distributed_decision(cfg.get("initialize", "auto"), os.environ,
                                              coordinator_address=cfg.get("coordinator_address", ""),
                                              tpu_vm_processes=cloud_tpu_vm_process_count)
    _DECIDED = True
    if not initialize:
        log.info("jax.distributed not initialised: %s", reason)
        return
    kwargs = {}
    if cfg.get("coordinator_address"):
        kwargs = dict(coordinator_address=cfg.coordinator_address, num_processes=int(cfg.num_processes),
                      process_id=int(cfg.process_id))
    device_ids, device_reason = local_device_ids_decision(os.environ, cfg.get("local_device_ids") or ())
    if device_ids is not None:
        kwargs["local_device_ids"] = list(device_ids)
    log.info("jax.distributed local devices: %s (%s)",
             list(device_ids) if device_ids is not None else "JAX's choice", device_reason)
    # Cross-process collectives on CPU devices (tests, CPU clusters) go through gloo; TPU and GPU
    # backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed initialised (%s): process %d of %d, %d local / %d global devices", reason,
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


_DECIDED = False


def _distributed_is_initialized() -> bool:
    try:
        from jax._src import distributed
        return distributed.global_state.client is not None
    except Exception:  # private API moved: assume not initialised
        return False


def cloud_tpu_vm_process_count(timeout_s: float = 10.0) -> int | None:
    """Processes of this Cloud TPU VM slice (hosts × Multislice slices) from the GCE metadata
    server; None off a Cloud TPU VM (no TPU chips, as ``import jax`` found them) or when the
    server does not answer."""
    if os.environ.get("TPU_SKIP_MDS_QUERY") is not None:   # set by JAX itself where there are no chips
        return None
    try:
        from jax._src import cloud_tpu_init
        if not cloud_tpu_init.running_in_cloud_tpu_vm:
            return None
    except Exception:  # private API moved: the environment checks above still apply
        return None
    endpoints = _gce_metadata("worker-network-endpoints", timeout_s)
    if endpoints is None:
        log.warning("Cloud TPU VM without an answer from the metadata server: assuming one host; set "
                    "--config.distributed.initialize=always on a multi-host slice")
        return None
    hosts = max(1, len([w for w in endpoints.split(",") if w.strip()]))
    match = re.search(r"^\s*MEGASCALE_NUM_SLICES\s*:\s*'?(\d+)", _gce_metadata("tpu-env", timeout_s) or "", re.M)
    return hosts * (int(match.group(1)) if match else 1)


def _gce_metadata(key: str, timeout_s: float) -> str | None:
    import urllib.request

    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    req = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/attributes/{key}",
                                 headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.read().decode()
    except Exception:  # pylint: disable=broad-except  # no server, no key: unknown
        return None


# ----------------------------------------------------------------------------- mesh

def process0_decides(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (itself with one process): for a decision each host
    makes from its own view (a lock, a local file) that leads into a collective."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def mesh_shape(sizes: dict[str, int], num_devices: int) -> tuple[int, ...]:
    """Resolve ``{'data': -1, 'fsdp': 2, 'tensor': 1}`` (one ``-1`` fills the rest) to a shape
    whose product is ``num_devices``, or raise a ValueError that says how to fix the config."""
    shape = [int(sizes[a]) for a in MESH_AXES]
    fill = [i for i, s in enumerate(shape) if s == -1]
    if len(fill) > 1:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))}: sizes must be positive or -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if fill:
        if num_devices % known:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))}: the fixed axes' product {known} does not "
                             f"divide the {num_devices} devices; change config.mesh")
        shape[fill[0]] = num_devices // known
    if int(np.prod(shape)) != num_devices:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} has {int(np.prod(shape))} devices but "
                         f"{num_devices} are available; set config.mesh sizes whose product is "
                         f"{num_devices}, or one of them to -1")
    return tuple(shape)


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with axes ``('data', 'fsdp', 'tensor')``, laid out for the interconnect."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(sizes, len(devices))
    try:
        from jax.experimental import mesh_utils
        arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    except Exception:  # e.g. CPU or unusual topologies: the plain order is fine there
        arr = np.asarray(devices).reshape(shape)
    # jax.sharding.Mesh defaults to Auto axis types: XLA propagates shardings between the
    # constraints we place (jax.make_mesh would default to Explicit axes in jax >= 0.10).
    return Mesh(arr, MESH_AXES)


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def rules_without(rules: Sequence, axes: Sequence[str]) -> tuple:
    """``rules`` with the mesh ``axes`` dropped from every target (a target left empty maps to
    None). Inside a ``shard_map`` that is manual over ``axes`` the model's logical constraints
    may name only the remaining (automatic) axes: the manual ones are already split."""
    drop = set(axes)

    def strip(target):
        if target is None:
            return None
        names = (target,) if isinstance(target, str) else tuple(target)
        kept = tuple(a for a in names if a not in drop)
        if not kept:
            return None
        return kept[0] if len(kept) == 1 else kept
    return tuple((name, strip(target)) for name, target in rules)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over ``data`` × ``fsdp``, everything else replicated."""
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ----------------------------------------------------------------------------- state

def logical_shardings(abstract_boxed: Any, mesh: Mesh, rules) -> Any:
    """Shardings for a tree of (possibly ``LogicallyPartitioned``) abstract values."""
    specs = nn.get_partition_spec(abstract_boxed)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def place(tree: Any, shardings: Any) -> Any:
    """Host (numpy) arrays -> global arrays with ``shardings``. Every process passes the full
    values (e.g. a checkpoint each host read); each keeps only its shards."""
    def put(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
    return jax.tree.map(put, tree, shardings)


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows -> global ``jax.Array``s sharded over ``data`` × ``fsdp``.

    Every process passes ``global_batch / process_count`` rows, in process order.
    """
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v)
            for k, v in local.items()}
