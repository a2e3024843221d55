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


@pytest.mark.parametrize("env,calls", [
    ({}, []),
    ({"TPU_WORKER_HOSTNAMES": "w-0,w-1"}, [{}]),
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"}, [{}]),
])
def test_startup_calls_initialize_with_no_arguments_when_decided(monkeypatch, env, calls):
    for var in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID", "MEGASCALE_NUM_SLICES",
                "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = []
    monkeypatch.setattr(parallel, "_DECIDED", False)
    monkeypatch.setattr(parallel, "cloud_tpu_vm_process_count", lambda: None)
    monkeypatch.setattr(parallel.jax.distributed, "initialize", lambda **kw: got.append(kw))
    monkeypatch.setattr(parallel.jax.config, "update", lambda *a: None)
    monkeypatch.setattr(parallel.jax, "process_index", lambda: 0)
    monkeypatch.setattr(parallel.jax, "process_count", lambda: 2)
    cfg = ml_collections.ConfigDict(dict(initialize="auto", coordinator_address="", num_processes=1,
                                         process_id=0, local_device_ids=()))
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
