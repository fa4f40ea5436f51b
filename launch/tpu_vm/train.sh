#!/bin/bash
# Multi-host TPU VM (no Kubernetes): run the same jaxagent program on every worker of a TPU VM slice.
#
#   TPU_NAME=my-v5e-16 ZONE=us-east5-b PROJECT=my-project launch/tpu_vm/train.sh jaxagent/configs/tiny_cpu.yaml \
#     --set train.iterations=100
#
# SETUP=1 first copies this checkout to every worker and installs it with jax[tpu]. jaxagent.distributed detects
# the TPU VM (mode auto -> tpu) and calls jax.distributed.initialize() without arguments; JAX reads the workers
# from the TPU metadata server. Checkpoints (run.root) should be on a bucket or disk every worker sees.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: TPU_NAME=... ZONE=... [PROJECT=...] [SETUP=1] launch/tpu_vm/train.sh <config> [--set key=value ...]" >&2
  exit 2
fi
: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE}"
PROJECT_FLAG=()
if [[ -n "${PROJECT:-}" ]]; then
  PROJECT_FLAG=(--project "${PROJECT}")
fi
REMOTE_DIR="${REMOTE_DIR:-jaxagent}"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

tpu_ssh() {
  gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --zone "${ZONE}" "${PROJECT_FLAG[@]}" --worker=all --command "$1"
}

if [[ "${SETUP:-0}" == "1" ]]; then
  ARCHIVE="$(mktemp --suffix=.tar.gz)"
  git -C "${REPO_DIR}" archive --format=tar.gz -o "${ARCHIVE}" HEAD
  gcloud compute tpus tpu-vm scp "${ARCHIVE}" "${TPU_NAME}:jaxagent.tar.gz" --zone "${ZONE}" "${PROJECT_FLAG[@]}" \
    --worker=all
  rm -f "${ARCHIVE}"
  tpu_ssh "mkdir -p ${REMOTE_DIR} && tar -xzf jaxagent.tar.gz -C ${REMOTE_DIR} && cd ${REMOTE_DIR} && \
python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'"
fi

ARGS=""
for arg in "$@"; do
  ARGS+=" $(printf '%q' "${arg}")"
done
# Every worker must start: a worker that is missing holds the others in jax.distributed.initialize.
tpu_ssh "cd ${REMOTE_DIR} && PYTHONUNBUFFERED=1 .venv/bin/python -m jaxagent train${ARGS}"
