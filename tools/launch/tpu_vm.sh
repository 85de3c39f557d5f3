#!/bin/bash
# alignax on a multi-host Cloud TPU VM slice: the same command on every worker at once.
#
#   tools/launch/tpu_vm.sh TPU_NAME ZONE CONFIG.yaml [key=value ...]
#   ALIGNAX_SETUP=1 tools/launch/tpu_vm.sh ...   # first: clone/update and `make install-tpu` on every worker
#
# jax.distributed finds the slice itself (TPU metadata); no distributed keys are needed.
# distributed.require_accelerator=true is set on every run: a worker whose jax came up on
# its CPUs (a CPU jaxlib, libtpu missing) stops at once, in one line, with exit 2.
# ALIGNAX_REPO (default: this repository's origin URL) and ALIGNAX_DIR (default: ~/alignax)
# say where the code comes from and lives on the workers. output_dir must be on storage
# every worker sees (a shared mount); checkpoints are written by all workers together.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 TPU_NAME ZONE CONFIG.yaml [key=value ...]" >&2
  exit 2
fi
tpu=$1 zone=$2
shift 2
dir=${ALIGNAX_DIR:-alignax}
repo=${ALIGNAX_REPO:-$(git -C "$(dirname "$0")" remote get-url origin 2>/dev/null || true)}
quoted=$(printf '%q ' "$@")
run() {
  gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "$1"
}
if [ "${ALIGNAX_SETUP:-0}" = 1 ]; then
  [ -n "$repo" ] || { echo "set ALIGNAX_REPO to the repository URL" >&2; exit 2; }
  run "set -e; if [ -d $dir ]; then git -C $dir pull --ff-only; else git clone $repo $dir; fi; make -C $dir install-tpu"
fi
run "cd $dir && HF_HUB_OFFLINE=1 .venv/bin/alignax train $quoted distributed.require_accelerator=true"
