"""When a process starts jax.distributed: the decision is a pure function of the config, the
environment and (last) the Cloud TPU metadata; the start-up calls jax.distributed.initialize()
with no arguments exactly when it says so."""

import pathlib

import ml_collections
import pytest

from tacl_jax import parallel
from tacl_jax.config import load_config_file

ROOT = pathlib.Path(__file__).resolve().parents[1]


def decide(env, mode="auto", address="", tpu_vm=None):
    return parallel.distributed_decision(mode, env, coordinator_address=address,
                                         tpu_vm_processes=(lambda: tpu_vm))


@pytest.mark.parametrize("env,tpu_vm,expected,reason", [
    # Single host: a laptop, a GPU box, a single-host TPU VM (v4-8: the metadata lists one worker).
    ({}, None, False, "one process"),
    ({"HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, None, False, "one process"),
    ({}, 1, False, "single-host Cloud TPU VM"),
    ({"TPU_WORKER_HOSTNAMES": "t1v-n-0"}, None, False, "one TPU host"),
    ({"TPU_WORKER_HOSTNAMES": "t1v-n-0", "TPU_WORKER_ID": "0"}, 4, False, "one TPU host"),  # env wins
    # TPU pods: GKE lists the workers; a GCE TPU VM slice (v5e-16: 4 hosts) only in its metadata.
    ({"TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-3", "TPU_WORKER_ID": "2"}, None, True, "4 hosts"),
    ({"TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477", "CLOUD_TPU_TASK_ID": "1"}, None, True, "2 hosts"),
    ({"CLOUD_TPU_TASK_ID": "0"}, None, True, "CLOUD_TPU_TASK_ID"),
    ({}, 4, True, "Cloud TPU VM slice of 4 hosts"),
    ({"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"}, None, True, "Multislice"),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080"}, None, True, "Multislice"),
    ({"MEGASCALE_NUM_SLICES": "1"}, None, False, "one process"),
    # SLURM: tasks of this step (else of the job).
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_PROCID": "3"}, None, True, "16 tasks (SLURM_NTASKS)"),
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "1"}, None, False, "one task"),
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"}, None, False, "one task"),
    ({"SLURM_NTASKS": "8"}, None, False, "one process"),       # not inside a SLURM job
])
def test_auto_decides_from_the_environment(env, tpu_vm, expected, reason):
    initialize, why = decide(env, tpu_vm=tpu_vm)
    assert initialize is expected and reason in why, why


def test_explicit_settings_win_and_metadata_is_asked_last():
    asked = []

    def tpu_vm():
        asked.append(1)
        return 4

    multi = {"TPU_WORKER_HOSTNAMES": "a,b"}
    assert decide(multi, mode="never") == (False, "config.distributed.initialize='never'")
    assert decide({}, mode="always")[0] is True
    assert decide({}, address="10.0.0.1:1234") == (True, "config.distributed.coordinator_address=10.0.0.1:1234")
    assert decide(multi, mode="never", address="10.0.0.1:1234")[0] is False
    for env in ({"TPU_WORKER_HOSTNAMES": "a"}, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"}):
        parallel.distributed_decision("auto", env, tpu_vm_processes=tpu_vm)
    assert not asked            # the environment decided: no metadata query
    assert parallel.distributed_decision("auto", {}, tpu_vm_processes=tpu_vm)[0] is True and asked
    with pytest.raises(ValueError, match="initialize='sometimes'"):
        decide({}, mode="sometimes")


# A SLURM task of a 2-node job, as srun sets it up (the tests add the GPU and per-node variables).
SLURM_TASK = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_PROCID": "11", "SLURM_NODEID": "1",
              "SLURM_STEP_NODELIST": "gpu[01-02]"}


def slurm_task(tasks_per_node, local_id, **gpu_env):
    return {**SLURM_TASK, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_LOCALID": str(local_id), **gpu_env}


@pytest.mark.parametrize("env,expected,reason", [
    # One task per node driving the node's 8 GPUs (JAX alone would take [SLURM_LOCALID] = [0]).
    (slurm_task("1(x2)", 0, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), (0, 1, 2, 3, 4, 5, 6, 7), "one task on this node"),
    (slurm_task("1(x2)", 0, CUDA_VISIBLE_DEVICES="4,5,6,7"), (0, 1, 2, 3), "all of its 4 GPUs"),  # renumbered
    # 8 tasks per node, --gpus-per-task=1: each task sees one GPU, numbered 0 in its process.
    (slurm_task("8(x2)", 3, CUDA_VISIBLE_DEVICES="3", SLURM_GPUS_PER_TASK="1"), (0,), "sees one GPU"),
    (slurm_task("8(x2)", 7, CUDA_VISIBLE_DEVICES="7"), (0,), "sees one GPU"),
    # --gpus-per-task=2 with 4 tasks per node: each sees its own two.
    (slurm_task("4(x2)", 1, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_PER_TASK="h100:2"), (0, 1), "SLURM_GPUS_PER_TASK=2"),
    (slurm_task("4(x2)", 3, CUDA_VISIBLE_DEVICES="6,7"), (0, 1), "fewer than the node's 4 tasks"),
    # 8 tasks per node, no binding: all see the 8 GPUs, task SLURM_LOCALID takes GPU SLURM_LOCALID.
    (slurm_task("8(x2)", 3, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), (3,), "task 3 of 8"),
    ({**SLURM_TASK, "SLURM_NTASKS_PER_NODE": "8", "SLURM_LOCALID": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
     (5,), "SLURM_NTASKS_PER_NODE=8"),
    # 2 tasks per node sharing 8 GPUs: 4 each.
    (slurm_task("2(x2)", 1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), (4, 5, 6, 7), "takes GPUs 4,5,6,7"),
    # Uneven nodes ("8,4"): this is node 1, with 4 tasks.
    (slurm_task("8,4", 2, CUDA_VISIBLE_DEVICES="0,1,2,3"), (2,), "SLURM_STEP_TASKS_PER_NODE=8,4, node 1"),
    # Without CUDA_VISIBLE_DEVICES: SLURM's node-local ids as they are, or a count.
    (slurm_task("1", 0, SLURM_STEP_GPUS="4,5", SLURM_JOB_GPUS="0,1,2,3,4,5"), (4, 5), "SLURM_STEP_GPUS=4,5"),
    (slurm_task("1", 0, SLURM_JOB_GPUS="0,1"), (0, 1), "SLURM_JOB_GPUS"),
    (slurm_task("8", 6, SLURM_GPUS_ON_NODE="8"), (6,), "SLURM_GPUS_ON_NODE=8"),
    # No GPUs known (a CPU cluster), a GPU-less task, a step of unknown shape: JAX decides.
    (slurm_task("8(x2)", 3), None, "no GPUs listed"),
    (slurm_task("1", 0, CUDA_VISIBLE_DEVICES="NoDevFiles"), None, "no GPUs listed"),
    (slurm_task("1", 0, CUDA_VISIBLE_DEVICES=""), None, "no GPUs listed"),
    ({**SLURM_TASK, "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, None, "unknown number of tasks"),
    # TPU VMs, one GPU host, the batch script itself (no srun task): JAX decides.
    ({"TPU_WORKER_HOSTNAMES": "w-0,w-1", "TPU_WORKER_ID": "1"}, None, "not an srun task"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, None, "not an srun task"),
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "CUDA_VISIBLE_DEVICES": "0,1"}, None, "not an srun task"),
    (slurm_task("1", 0, CUDA_VISIBLE_DEVICES="0,1", JAX_LOCAL_DEVICE_IDS="1"), None, "JAX_LOCAL_DEVICE_IDS=1"),
])
def test_local_device_ids_from_the_environment(env, expected, reason):
    ids, why = parallel.local_device_ids_decision(env)
    assert ids == expected and reason in why, why


def test_explicit_local_device_ids_win_and_uneven_shares_are_refused():
    env = slurm_task("8(x2)", 3, CUDA_VISIBLE_DEVICES="3")
    assert parallel.local_device_ids_decision(env, (0, 1)) == ((0, 1), "config.distributed.local_device_ids")
    assert parallel.local_device_ids_decision({}, [2])[0] == (2,)
    with pytest.raises(ValueError, match=r"shares 8 GPUs .*do not split evenly.*--gpus-per-task"):
        parallel.local_device_ids_decision(slurm_task("3", 1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))
    with pytest.raises(ValueError, match="SLURM_LOCALID=9 is not one of the 8 tasks"):
        parallel.local_device_ids_decision(slurm_task("8", 9, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))


@pytest.mark.parametrize("env,cfg,calls", [
    ({}, {}, []),
    ({"TPU_WORKER_HOSTNAMES": "w-0,w-1"}, {}, [{}]),
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"}, {}, [{}]),
    # srun without an address: JAX finds the cluster, tacl_jax names the GPUs.
    (slurm_task("1(x2)", 0, CUDA_VISIBLE_DEVICES="0,1,2,3"), {}, [{"local_device_ids": [0, 1, 2, 3]}]),
    # launch/slurm_gpu.sbatch: an address, and the GPUs from the task's environment ...
    (slurm_task("8(x2)", 5, CUDA_VISIBLE_DEVICES="5"),
     dict(coordinator_address="gpu01:20077", num_processes=16, process_id=13),
     [dict(coordinator_address="gpu01:20077", num_processes=16, process_id=13, local_device_ids=[0])]),
    # ... unless the config names them.
    (slurm_task("8(x2)", 5, CUDA_VISIBLE_DEVICES="5"),
     dict(coordinator_address="gpu01:20077", num_processes=16, process_id=13, local_device_ids=(2,)),
     [dict(coordinator_address="gpu01:20077", num_processes=16, process_id=13, local_device_ids=[2])]),
])
def test_startup_calls_initialize_with_what_was_decided(monkeypatch, env, cfg, calls):
    import os

    for var in list(os.environ):
        if var.startswith(("TPU_", "CLOUD_TPU_", "MEGASCALE_", "SLURM_", "JAX_")) or var == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = []
    monkeypatch.setattr(parallel, "_DECIDED", False)
    monkeypatch.setattr(parallel, "cloud_tpu_vm_process_count", lambda: None)
    monkeypatch.setattr(parallel.jax.distributed, "initialize", lambda **kw: got.append(kw))
    monkeypatch.setattr(parallel.jax.config, "update", lambda *a: None)
    monkeypatch.setattr(parallel.jax, "process_index", lambda: 0)
    monkeypatch.setattr(parallel.jax, "process_count", lambda: 2)
    cfg = ml_collections.ConfigDict(dict(dict(initialize="auto", coordinator_address="", num_processes=1,
                                              process_id=0, local_device_ids=()), **cfg))
    parallel.maybe_initialize_distributed(cfg)
    parallel.maybe_initialize_distributed(cfg)     # decided once per process
    assert got == calls


def test_cloud_tpu_vm_query_is_skipped_off_tpu(monkeypatch):
    monkeypatch.setattr(parallel, "_gce_metadata", lambda *a: pytest.fail("metadata queried off a TPU VM"))
    assert parallel.cloud_tpu_vm_process_count() is None    # this CPU host: no chips


def test_cloud_tpu_vm_hosts_times_slices_from_metadata(monkeypatch):
    from jax._src import cloud_tpu_init

    meta = {"worker-network-endpoints": "t1v-n-0,t1v-n-1,t1v-n-2,t1v-n-3",
            "tpu-env": "ACCELERATOR_TYPE: 'v5litepod-16'\nMEGASCALE_NUM_SLICES: '2'\n"}
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)
    monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(parallel, "_gce_metadata", lambda key, timeout: meta.get(key))
    assert parallel.cloud_tpu_vm_process_count() == 8
    meta = {"worker-network-endpoints": "t1v-n-0", "tpu-env": "ACCELERATOR_TYPE: 'v4-8'\n"}
    assert parallel.cloud_tpu_vm_process_count() == 1
    meta = {}
    assert parallel.cloud_tpu_vm_process_count() is None     # no answer: unknown, not multi-host


@pytest.mark.parametrize("preset", ["tpu_v4_8.py", "tpu_v5e_16.py", "gpu_8xh100.py"])
def test_hardware_presets_leave_the_decision_to_auto(preset):
    assert load_config_file(str(ROOT / "configs" / preset)).distributed.initialize == "auto"
