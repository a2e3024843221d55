#!/usr/bin/env bash
# tacl_jax on one GPU host: one process driving all local GPUs (a data-parallel mesh over them).
#
#   WORKDIR=/data/runs/tacl DATA=/data/wiki_l256 HF_PATH=/data/bert-base-uncased \
#       launch/gpu_single_host.sh [extra flags for tacl_jax.main]
#
# Run from anywhere; the job runs in the repository root. Environment variables (defaults in brackets):
#   CONFIG [configs/gpu_8xh100.py]   WORKDIR [runs/tacl_gpu]   HF_PATH (the config's init.hf_path)
#   DATA: a prepared dataset folder (`tacl_jax.data.prepare` output; the config's data.source otherwise)
#   GPUS: CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3 (default: all)   PYTHON [python]
#   DRY_RUN [0]: 1 = print the command, run nothing
# XLA_FLAGS gets --xla_gpu_enable_latency_hiding_scheduler=true (after any value of yours; one of
# yours for that flag is kept).
# Install first: pip install -e ".[gpu]"  (jax[cuda12]). Resume = rerun the same command.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
CONFIG=${CONFIG:-configs/gpu_8xh100.py}
WORKDIR=${WORKDIR:-runs/tacl_gpu}
HF_PATH=${HF_PATH:-}
DATA=${DATA:-}
PYTHON=${PYTHON:-python}
DRY_RUN=${DRY_RUN:-0}

if [ -n "${GPUS:-}" ]; then export CUDA_VISIBLE_DEVICES=$GPUS; fi
export PYTHONUNBUFFERED=1
# JAX preallocates 75% of each GPU by default; the teacher and the student share it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
# XLA's latency-hiding scheduler overlaps the gradient all-reduces with the backward pass; it is
# off by default on GPUs. A setting of the flag already in XLA_FLAGS is the user's and stays.
case " ${XLA_FLAGS:-} " in
  *" --xla_gpu_enable_latency_hiding_scheduler="*) ;;
  *) XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_latency_hiding_scheduler=true" ;;
esac
export XLA_FLAGS

# One process: never start jax.distributed, even inside a multi-task SLURM allocation.
ARGS=(--config="$CONFIG" --workdir="$WORKDIR" --config.distributed.initialize=never)
if [ -n "$HF_PATH" ]; then ARGS+=(--config.init.hf_path="$HF_PATH"); fi
if [ -n "$DATA" ]; then ARGS+=(--config.data.source="prepared:$DATA"); fi
ARGS+=("$@")

CMD=("$PYTHON" -m tacl_jax.main "${ARGS[@]}")
printf '+%s XLA_FLAGS=%q' "${CUDA_VISIBLE_DEVICES:+ CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}" "$XLA_FLAGS"
printf ' %q' "${CMD[@]}"
printf '\n'
if [ "$DRY_RUN" != 1 ]; then exec "${CMD[@]}"; fi
