#!/usr/bin/env bash
# tacl_jax on Cloud TPU VMs: single hosts and pod slices (v4, v5e, v5p, v6e).
#
#   launch/tpu_vm.sh SUBCOMMAND [SUBCOMMAND ...] [-- EXTRA TRAIN FLAGS]
#
# Subcommands (run in the order given):
#   create    create the TPU VM (QUEUED=1: as a queued resource, waits until ACTIVE; SPOT=1: spot)
#   setup     copy this checkout to every worker, pip install "jax[tpu]" and the package,
#             download the Hugging Face model, then `stage`
#   stage     copy the prepared dataset DATA (gs://) to every worker's disk (gcloud storage rsync)
#   train     start `python3 -m tacl_jax.main --config=$CONFIG --workdir=$WORKDIR` on all workers
#             at once, in the background (nohup), logging to ~/tacl/train.log on each worker;
#             starts none if a process holds the TPU on any worker (naming it), and removes a
#             stale /tmp/libtpu_lockfile (one that no process holds) with a message
#   resume    = train: the run continues from the latest complete checkpoint in $WORKDIR
#   logs      follow the log of worker $WORKER (default 0)
#   fetch-logs  copy every worker's ~/tacl/train.log here, to $LOG_DIR/worker-N.log
#   status    the VM's state, and on every worker whether training runs plus its last log line
#   stop      SIGTERM the training process on every worker: it saves a checkpoint and exits;
#             one still running STOP_TIMEOUT seconds later is killed (SIGKILL: a rerun resumes
#             from the latest complete checkpoint). Then fetch-logs.
#   delete    delete the VM (or the queued resource and its VM)
#   ssh CMD   run CMD on worker $WORKER (default all)
#
# Everything is set by environment variables (defaults in brackets):
#   TPU_NAME [tacl-tpu]          ACCELERATOR_TYPE [v4-8]: v4-N, v5litepod-N, v5p-N, v6e-N
#   ZONE [by type: v4 us-central2-b, v5e us-west4-a, v5p us-east5-a, v6e us-east5-b]
#   RUNTIME_VERSION [by type: tpu-ubuntu2204-base, v2-alpha-tpuv5-lite, v2-alpha-tpuv5,
#                    v2-alpha-tpuv6e]
#   PROJECT [gcloud's default]   QUEUED [0]  QR_ID [$TPU_NAME-qr]  SPOT [0]
#   BUCKET (gs://..., needed by train unless WORKDIR is set)   RUN_NAME [tacl_base]
#   WORKDIR [$BUCKET/runs/$RUN_NAME]   CONFIG [by type: configs/tpu_v4_8.py for v4-8,
#                                               configs/tpu_v5e_16.py for v5litepod-16, else configs/base.py]
#   DATA: a prepared dataset (`tacl_jax.data.prepare` output); gs://... is staged to each worker,
#         a path is used as is on the workers; unset: the config's data.source
#   HF_MODEL [bert-base-uncased]: Hub id downloaded on every worker (or HF_MODEL_GCS=gs://... folder)
#   REPO_URL [unset: this checkout's files are copied]  REPO_REF [main]
#   PYTHON_VERSION [3.12]: the workers' venv (~/tacl/venv, made with uv; jax needs >= 3.11)
#   JAX_SPEC [jax[tpu]]   TRAIN_ARGS: extra flags for tacl_jax.main (also accepted after `--`)
#   WORKER [0 for logs, all for ssh]   STOP_TIMEOUT [900] seconds   YES [0]: 1 = no delete prompt
#   SSH_FLAGS: flags for every `gcloud compute tpus tpu-vm ssh` and `scp`, split on blanks, e.g.
#              "--internal-ip --strict-host-key-checking=no" (from a VM in the same network)
#   LOG_DIR [runs/tpu_logs/$TPU_NAME in this checkout]: where fetch-logs puts the workers' logs
#   LIBTPU_LOCKFILE [/tmp/libtpu_lockfile]: libtpu's lock file on the workers
#   DRY_RUN [0]: 1 = print every command, run none
#
# One slice per VM: Multislice (queued resources with --node-count, driven with
# `queued-resources ssh --node=all`) is not supported (see launch/README.md).
# Every command is printed (prefixed with '+') before it runs. See launch/README.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

TPU_NAME=${TPU_NAME:-tacl-tpu}
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v4-8}
DRY_RUN=${DRY_RUN:-0}

case "$ACCELERATOR_TYPE" in
  v4-*)        family=v4;  default_zone=us-central2-b; default_runtime=tpu-ubuntu2204-base ;;
  v5litepod-*) family=v5e; default_zone=us-west4-a;    default_runtime=v2-alpha-tpuv5-lite ;;
  v5p-*)       family=v5p; default_zone=us-east5-a;    default_runtime=v2-alpha-tpuv5 ;;
  v6e-*)       family=v6e; default_zone=us-east5-b;    default_runtime=v2-alpha-tpuv6e ;;
  *) echo "ACCELERATOR_TYPE=$ACCELERATOR_TYPE: use v4-N, v5litepod-N, v5p-N or v6e-N" >&2; exit 2 ;;
esac
ZONE=${ZONE:-$default_zone}
RUNTIME_VERSION=${RUNTIME_VERSION:-$default_runtime}
PROJECT=${PROJECT:-}
QUEUED=${QUEUED:-0}
QR_ID=${QR_ID:-${TPU_NAME}-qr}
SPOT=${SPOT:-0}
BUCKET=${BUCKET:-}
BUCKET=${BUCKET%/}
RUN_NAME=${RUN_NAME:-tacl_base}
WORKDIR=${WORKDIR:-${BUCKET:+$BUCKET/runs/$RUN_NAME}}
case "$ACCELERATOR_TYPE" in
  v4-8)         default_config=configs/tpu_v4_8.py ;;
  v5litepod-16) default_config=configs/tpu_v5e_16.py ;;
  *)            default_config=configs/base.py ;;
esac
CONFIG=${CONFIG:-$default_config}
DATA=${DATA:-}
DATA=${DATA%/}
HF_MODEL=${HF_MODEL:-bert-base-uncased}
HF_MODEL_GCS=${HF_MODEL_GCS:-}
HF_MODEL_GCS=${HF_MODEL_GCS%/}
REPO_URL=${REPO_URL:-}
REPO_REF=${REPO_REF:-main}
JAX_SPEC=${JAX_SPEC:-jax[tpu]}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
TRAIN_ARGS=${TRAIN_ARGS:-}
STOP_TIMEOUT=${STOP_TIMEOUT:-900}
YES=${YES:-0}
SSH_FLAGS=${SSH_FLAGS:-}
LOG_DIR=${LOG_DIR:-$ROOT/runs/tpu_logs/$TPU_NAME}   # runs/ is git-ignored: setup does not ship it
LIBTPU_LOCKFILE=${LIBTPU_LOCKFILE:-/tmp/libtpu_lockfile}
if [[ ! "$STOP_TIMEOUT" =~ ^[0-9]+$ ]]; then echo "STOP_TIMEOUT=$STOP_TIMEOUT: a whole number of seconds" >&2; exit 2; fi

# Chips per accelerator type and hosts (= JAX processes) per slice. v4 and v5p count
# TensorCores (2 per chip), v5e and v6e count chips; a host has 4 chips, or up to 8 on the
# single-host v5e/v6e shapes.
num_hosts() {
  local n=${ACCELERATOR_TYPE##*-} chips
  case "$family" in
    v4|v5p) chips=$((n / 2)) ;;
    *)      chips=$n ;;
  esac
  if [ "$chips" -le 4 ] || { [ "$family" != v4 ] && [ "$family" != v5p ] && [ "$chips" -le 8 ]; }; then
    echo 1
  else
    echo $((chips / 4))
  fi
}

# Remote layout (on every worker): ~/tacl/{repo,models,data,train.log,train.pid}.
# Names embedded in remote commands must be plain (no quoting needed on the remote side).
model_name=${HF_MODEL_GCS:-$HF_MODEL}
model_name=${model_name##*/}
data_name=${DATA##*/}
for name in "$model_name" "$data_name" "$PYTHON_VERSION"; do
  if [[ -n "$name" && ! "$name" =~ ^[A-Za-z0-9._-]+$ ]]; then
    echo "'$name' (model/data folder name, PYTHON_VERSION) may use only letters, digits and . _ -" >&2; exit 2
  fi
done
if [[ ! "$LIBTPU_LOCKFILE" =~ ^/[A-Za-z0-9._/-]+$ ]]; then
  echo "LIBTPU_LOCKFILE=$LIBTPU_LOCKFILE: an absolute path of letters, digits and . _ - /" >&2; exit 2
fi
if [[ ! "$HF_MODEL" =~ ^[A-Za-z0-9._/-]+$ ]]; then echo "HF_MODEL=$HF_MODEL: not a Hub id" >&2; exit 2; fi
# shellcheck disable=SC2016  # $HOME is expanded by the remote shell, on each worker
R='$HOME/tacl'
LOG="$R/train.log"
PY="$R/venv/bin/python"
PIDFILE="$R/train.pid"

GFLAGS=(--zone="$ZONE")
if [ -n "$PROJECT" ]; then GFLAGS+=(--project="$PROJECT"); fi
# Flags for ssh and scp only (create, describe and delete refuse them).
SSHFLAGS=()
if [ -n "$SSH_FLAGS" ]; then read -r -a SSHFLAGS <<< "$SSH_FLAGS"; fi

say() { printf '\n== %s\n' "$*"; }

# quote, run: print each command, run it unless DRY_RUN=1.
# shellcheck source=launch/commands.sh disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/commands.sh"

ssh_workers() {  # ssh_workers WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GFLAGS[@]}" ${SSHFLAGS[@]+"${SSHFLAGS[@]}"} \
    --worker="$1" --command="$2"
}

scp_workers() {  # scp_workers WORKER SRC... DEST (a worker's path as $TPU_NAME:PATH)
  local worker=$1
  shift
  run gcloud compute tpus tpu-vm scp "$@" "${GFLAGS[@]}" ${SSHFLAGS[@]+"${SSHFLAGS[@]}"} --worker="$worker"
}

# ----------------------------------------------------------------------------- subcommands

cmd_create() {
  local spot=() kind=on-demand
  if [ "$SPOT" = 1 ]; then spot=(--spot); kind=spot; fi
  if [ "$QUEUED" = 1 ]; then kind="$kind, queued resource $QR_ID"; fi
  say "create $ACCELERATOR_TYPE '$TPU_NAME' in $ZONE (runtime $RUNTIME_VERSION, $(num_hosts) host(s), $kind)"
  if [ "$QUEUED" = 1 ]; then
    run gcloud compute tpus queued-resources create "$QR_ID" "${GFLAGS[@]}" --node-id="$TPU_NAME" \
      --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" ${spot[@]+"${spot[@]}"}
    wait_active
  else
    run gcloud compute tpus tpu-vm create "$TPU_NAME" "${GFLAGS[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" ${spot[@]+"${spot[@]}"}
  fi
}

wait_active() {
  local state
  echo "# waiting for queued resource $QR_ID to become ACTIVE (polls every 60 s; Ctrl-C is safe)"
  if [ "$DRY_RUN" = 1 ]; then return 0; fi
  while :; do
    state=$(gcloud compute tpus queued-resources describe "$QR_ID" "${GFLAGS[@]}" --format='value(state.state)')
    echo "$(date '+%F %T') $QR_ID: $state"
    case "$state" in
      ACTIVE) return 0 ;;
      FAILED|SUSPENDED|SUSPENDING) echo "queued resource $QR_ID is $state: delete and recreate it" >&2; return 1 ;;
    esac
    sleep 60
  done
}

cmd_setup() {
  say "setup: this code on every worker"
  if [ -n "$REPO_URL" ]; then
    ssh_workers all "set -e; mkdir -p $R; rm -rf $R/repo; git clone --quiet $(printf %q "$REPO_URL") $R/repo; git -C $R/repo checkout --quiet $(printf %q "$REPO_REF")"
  else
    local tarball=/tmp/tacl_src_$$.tar.gz
    # This checkout's tracked and untracked (not ignored) files, local edits included.
    echo "+ (cd $(printf %q "$ROOT") && git ls-files -z --cached --others --exclude-standard | tar -czf $tarball --null -T -)"
    if [ "$DRY_RUN" != 1 ]; then
      (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
        | tar -czf "$tarball" --null -T -)
    fi
    scp_workers all "$tarball" "$TPU_NAME:tacl_src.tar.gz"
    if [ "$DRY_RUN" != 1 ]; then rm -f "$tarball"; fi
    ssh_workers all "set -e; mkdir -p $R; rm -rf $R/repo; mkdir -p $R/repo; tar -xzf \$HOME/tacl_src.tar.gz -C $R/repo"
  fi
  # The images' python3 is 3.10 and jax needs >= 3.11: a venv with its own Python, made by uv.
  say "setup: Python $PYTHON_VERSION venv (~/tacl/venv), '$JAX_SPEC' and the package on every worker"
  ssh_workers all "set -e; python3 -m pip install -q --user -U uv
if [ ! -x $PY ]; then python3 -m uv venv -q --python $PYTHON_VERSION $R/venv; fi
python3 -m uv pip install -q --python $PY -U $(printf %q "$JAX_SPEC") $R/repo
echo \"\$(hostname): jax \$($PY -c 'import jax, tacl_jax; print(jax.__version__)') installed\""
  fetch_model
  cmd_stage
}

fetch_model() {
  if [ -n "$HF_MODEL_GCS" ]; then
    say "model: $HF_MODEL_GCS -> ~/tacl/models/$model_name on every worker"
    ssh_workers all "set -e; mkdir -p $R/models/$model_name; gcloud storage rsync --recursive $(printf %q "$HF_MODEL_GCS") $R/models/$model_name"
  else
    say "model: Hugging Face '$HF_MODEL' -> ~/tacl/models/$model_name on every worker"
    local py
    py="from huggingface_hub import snapshot_download; snapshot_download('$HF_MODEL', local_dir='$R/models/$model_name', allow_patterns=['*.json', '*.txt', '*.safetensors'])"
    ssh_workers all "set -e; mkdir -p $R/models; $PY -c \"$py\"; ls $R/models/$model_name"
  fi
}

cmd_stage() {
  case "$DATA" in
    gs://*)
      say "data: $DATA -> ~/tacl/data/$data_name on every worker"
      ssh_workers all "set -e; mkdir -p $R/data/$data_name; gcloud storage rsync --recursive $(printf %q "$DATA") $R/data/$data_name; du -sh $R/data/$data_name"
      ;;
    "") echo "# DATA unset: nothing to stage (the run uses the config's data.source)" ;;
    *)  echo "# DATA=$DATA is a path on the workers: nothing to stage" ;;
  esac
}

cmd_train() {
  if [ -z "$WORKDIR" ]; then
    echo "set BUCKET=gs://... (or WORKDIR=gs://...): checkpoints must outlive the VM" >&2; exit 2
  fi
  case "$WORKDIR" in
    gs://*) ;;
    *) echo "# warning: WORKDIR=$WORKDIR is not on gs://: a deleted or preempted VM loses it" >&2 ;;
  esac
  local args extra=()
  args="--config=$(printf %q "$CONFIG") --workdir=$(printf %q "$WORKDIR")"
  args+=" --config.init.hf_path=$R/models/$model_name"
  case "$DATA" in
    gs://*) args+=" --config.data.source=prepared:$R/data/$data_name" ;;
    "") echo "# warning: DATA unset: the run uses $CONFIG's data.source" >&2 ;;
    *) args+=" --config.data.source=$(printf %q "prepared:$DATA")" ;;
  esac
  if [ "$(num_hosts)" -gt 1 ]; then
    # Several hosts: jax.distributed from the Cloud TPU metadata (every worker runs this).
    args+=" --config.distributed.initialize=always"
  fi
  if [ -n "$TRAIN_ARGS" ]; then read -r -a extra <<< "$TRAIN_ARGS"; fi
  extra+=(${EXTRA[@]+"${EXTRA[@]}"})
  if [ "${#extra[@]}" -gt 0 ]; then args+=$(printf ' %q' "${extra[@]}"); fi
  say "train: $CONFIG on $ACCELERATOR_TYPE ($(num_hosts) host(s)), workdir $WORKDIR"
  # Every worker checks first, and none starts unless all can: a slice's workers that started
  # without the others would wait for them in jax.distributed until its timeout.
  ssh_workers all "set -e
if [ -f $PIDFILE ] && kill -0 \"\$(cat $PIDFILE)\" 2>/dev/null; then echo \"\$(hostname): already training (pid \$(cat $PIDFILE)); stop it first\"; exit 1; fi
$(tpu_free_check)"
  ssh_workers all "set -e; cd $R/repo
echo \"=== \$(date '+%F %T') \$(hostname) start:\" $PY -m tacl_jax.main $args >> $LOG
PYTHONUNBUFFERED=1 nohup $PY -m tacl_jax.main $args >> $LOG 2>&1 < /dev/null &
echo \$! > $PIDFILE
echo \"\$(hostname): started pid \$!, log $LOG\""
  echo "# follow it with: TPU_NAME=$TPU_NAME ZONE=$ZONE $0 logs"
}

cmd_resume() {
  say "resume: the same command again; the run restores the latest complete checkpoint in $WORKDIR"
  cmd_train
}

# Remote shell code for `train`. libtpu lets one process at a time open the TPU; a run that finds
# it taken dies at start-up with an error deep in its log. Say who holds it, and start nothing.
# A lock file that no process holds is left by a killed run: remove it, saying so. lsof sees other
# users' processes only as root: through sudo when that needs no password.
tpu_free_check() {
  printf 'lock=%s\n' "$LIBTPU_LOCKFILE"
  cat <<'REMOTE'
if command -v lsof >/dev/null 2>&1; then
  lsof_=lsof
  if sudo -n true 2>/dev/null; then lsof_='sudo -n lsof'; fi
  holders=$($lsof_ -t "$lock" /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | sort -un | tr '\n' ' ')
  holders=${holders% }
  if [ -n "$holders" ]; then
    echo "$(hostname): not starting: the TPU is in use by pid(s) $holders (open: /dev/accel*, /dev/vfio/* or $lock):"
    ps -o pid=,etime=,args= -p "$holders" || true
    echo "$(hostname): stop them first (launch/tpu_vm.sh stop, or launch/tpu_vm.sh ssh 'kill PID')"
    exit 1
  fi
else
  echo "$(hostname): lsof is not installed: cannot check whether another process holds the TPU"
fi
if [ -e "$lock" ]; then
  echo "$(hostname): removing the stale $lock (no process holds it: a killed run left it behind)"
  rm -f "$lock" 2>/dev/null || sudo -n rm -f "$lock" 2>/dev/null || true
  if [ -e "$lock" ]; then echo "$(hostname): cannot remove $lock: run sudo rm -f $lock on it"; exit 1; fi
fi
REMOTE
}

cmd_logs() {
  ssh_workers "${WORKER:-0}" "tail -n 200 -F $LOG"
}

# The logs live on the workers, which a delete or a preemption takes with them: keep a copy here.
cmd_fetch_logs() {
  local i n
  n=$(num_hosts)
  say "fetch-logs: ~/tacl/train.log of $n worker(s) -> $LOG_DIR/worker-N.log"
  run mkdir -p "$LOG_DIR"
  for ((i = 0; i < n; i++)); do
    # A worker without a log (it never trained) must not keep the others' logs from coming back.
    scp_workers "$i" "$TPU_NAME:tacl/train.log" "$LOG_DIR/worker-$i.log" \
      || echo "# worker $i: no log copied (see the error above)" >&2
  done
}

cmd_status() {
  if [ "$QUEUED" = 1 ]; then
    run gcloud compute tpus queued-resources describe "$QR_ID" "${GFLAGS[@]}" --format='value(state.state)'
  fi
  run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GFLAGS[@]}" --format='value(state,acceleratorType,runtimeVersion)'
  ssh_workers all "if [ -f $PIDFILE ] && kill -0 \"\$(cat $PIDFILE)\" 2>/dev/null; then s=\"training (pid \$(cat $PIDFILE))\"; else s='not training'; fi; echo \"\$(hostname): \$s | \$(tail -n 1 $LOG 2>/dev/null)\""
}

# A run that does not exit within STOP_TIMEOUT of the SIGTERM (stuck in a collective, a hung save)
# keeps the TPU, and the next `train` cannot start: SIGKILL it. The latest complete checkpoint
# stays the one a rerun resumes from. A zombie has exited (its parent has yet to reap it).
cmd_stop() {
  local rc=0
  say "stop: SIGTERM to the training process on every worker; it checkpoints and exits (SIGKILL after ${STOP_TIMEOUT}s)"
  ssh_workers all "alive() { kill -0 \$1 2>/dev/null && [ \"\$(ps -o stat= -p \$1 | cut -c1)\" != Z ]; }
if [ -f $PIDFILE ] && alive \"\$(cat $PIDFILE)\"; then
  p=\$(cat $PIDFILE); kill -TERM \$p
  for _ in \$(seq $STOP_TIMEOUT); do alive \$p || break; sleep 1; done
  if alive \$p; then
    echo \"\$(hostname): pid \$p still running ${STOP_TIMEOUT}s after SIGTERM: SIGKILL (a rerun resumes from the latest complete checkpoint)\"
    kill -KILL \$p 2>/dev/null || true
    for _ in \$(seq 30); do alive \$p || break; sleep 1; done
    if alive \$p; then echo \"\$(hostname): pid \$p survives SIGKILL (stuck in the TPU driver?): reboot this worker\"; exit 1; fi
    echo \"\$(hostname): killed\"
  else
    echo \"\$(hostname): stopped\"
  fi
  rm -f $PIDFILE
else
  echo \"\$(hostname): not training\"
fi" || rc=$?
  # The logs tell why a worker would not stop: fetch them in any case.
  cmd_fetch_logs
  return "$rc"
}

cmd_delete() {
  local quiet=()
  if [ "$YES" = 1 ]; then quiet=(--quiet); fi
  if [ "$QUEUED" = 1 ]; then
    say "delete queued resource $QR_ID and its TPU VM $TPU_NAME"
    run gcloud compute tpus queued-resources delete "$QR_ID" "${GFLAGS[@]}" --force ${quiet[@]+"${quiet[@]}"}
  else
    say "delete TPU VM $TPU_NAME"
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${GFLAGS[@]}" ${quiet[@]+"${quiet[@]}"}
  fi
}

cmd_ssh() {
  ssh_workers "${WORKER:-all}" "$1"
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

# ----------------------------------------------------------------------------- main

if [ $# -eq 0 ]; then usage; exit 2; fi
COMMANDS=()
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; EXTRA=("$@"); break ;;
    create|setup|stage|train|resume|logs|status|stop|delete) COMMANDS+=("$1"); shift ;;
    fetch-logs) COMMANDS+=(fetch_logs); shift ;;
    ssh) if [ $# -lt 2 ]; then echo "ssh needs a command" >&2; exit 2; fi
         COMMANDS+=("ssh"); SSH_COMMAND=$2; shift 2 ;;
    -h|--help|help) usage; exit 0 ;;
    *) echo "unknown subcommand '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

if [ "${#COMMANDS[@]}" -eq 0 ]; then echo "no subcommand given" >&2; usage >&2; exit 2; fi
dry=""
if [ "$DRY_RUN" = 1 ]; then dry=" (DRY_RUN=1: printed, not run)"; fi
echo "# TPU_NAME=$TPU_NAME ACCELERATOR_TYPE=$ACCELERATOR_TYPE ZONE=$ZONE RUNTIME_VERSION=$RUNTIME_VERSION${PROJECT:+ PROJECT=$PROJECT}$dry"
for c in "${COMMANDS[@]}"; do
  case "$c" in
    ssh) cmd_ssh "$SSH_COMMAND" ;;
    *) "cmd_$c" ;;
  esac
done
