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
from typing import Any, Callable, Sequence

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
)


def rules_from_config(rules: Sequence | None) -> tuple:
    """The config's rule list (lists from ml_collections) as the tuple flax expects."""
    if not rules:
        return LOGICAL_AXIS_RULES
    return tuple((name, tuple(ax) if isinstance(ax, (list, tuple)) else ax) for name, ax in rules)


# ----------------------------------------------------------------------------- start-up

def maybe_initialize_distributed(cfg) -> None:
    """Start JAX's multi-host runtime when this is one process of many.

    ``cfg`` is ``config.distributed``: ``coordinator_address`` (``host:port``), ``num_processes``,
    ``process_id``, ``local_device_ids``. With no address, ``jax.distributed.initialize()`` is
    called without arguments on a Cloud TPU VM slice with several workers, under SLURM with
    several tasks, or when ``initialize='always'``; JAX then reads the cluster from the
    environment. ``initialize='never'`` turns it off.
    """
    mode = cfg.get("initialize", "auto")
    if mode == "never" or _distributed_is_initialized():
        return
    kwargs = {}
    if cfg.get("coordinator_address"):
        kwargs = dict(coordinator_address=cfg.coordinator_address, num_processes=int(cfg.num_processes),
                      process_id=int(cfg.process_id))
        if cfg.get("local_device_ids"):
            kwargs["local_device_ids"] = list(cfg.local_device_ids)
    elif mode != "always" and not _looks_multi_host():
        return
    # Cross-process collectives on CPU devices (tests, CPU clusters) go through gloo; TPU and GPU
    # backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed initialised: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def _distributed_is_initialized() -> bool:
    try:
        from jax._src import distributed
        return distributed.global_state.client is not None
    except Exception:  # private API moved: assume not initialised
        return False


def _looks_multi_host() -> bool:
    workers = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in workers:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


# ----------------------------------------------------------------------------- mesh

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


def init_sharded(init_fn: Callable[..., Any], mesh: Mesh, rules, *args) -> tuple[Any, Any]:
    """Run ``init_fn(*args)`` (which returns boxed params) already sharded: no host ever holds the
    full tree. Returns ``(unboxed params, their shardings)``."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(init_fn, *args)
        shardings = logical_shardings(abstract, mesh, rules)
        params = jax.jit(lambda *a: nn.meta.unbox(init_fn(*a)), out_shardings=shardings)(*args)
    return params, shardings


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
