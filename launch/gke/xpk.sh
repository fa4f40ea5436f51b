#!/bin/bash
# TPU pod training through xpk (https://github.com/AI-Hypercomputer/xpk), which creates the JobSet for us.
#
#   CLUSTER=my-cluster PROJECT=my-project ZONE=us-east5-b IMAGE=us-docker.pkg.dev/my-project/jaxagent/trainer:tpu \
#     launch/gke/xpk.sh jaxagent/configs/tiny_cpu.yaml --set train.iterations=100
#
# TPU_TYPE (default v5litepod-16) and NUM_SLICES (default 1) pick the hardware; with NUM_SLICES > 1 the config's
# mesh.dcn.* sizes span the slices. jaxagent.distributed auto-detects the TPU pod (jax.distributed.initialize()).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: CLUSTER=... PROJECT=... ZONE=... IMAGE=... launch/gke/xpk.sh <config> [--set key=value ...]" >&2
  exit 2
fi
: "${CLUSTER:?set CLUSTER to the GKE cluster name}"
: "${PROJECT:?set PROJECT}"
: "${ZONE:?set ZONE}"
: "${IMAGE:?set IMAGE to the trainer image (docker build --build-arg JAX_VARIANT=tpu)}"
TPU_TYPE="${TPU_TYPE:-v5litepod-16}"
NUM_SLICES="${NUM_SLICES:-1}"
WORKLOAD="${WORKLOAD:-jaxagent-$(date +%Y%m%d-%H%M%S)}"

CMD="python -m jaxagent train --run-dir /runs/${WORKLOAD}"  # a restart (--max-restarts) resumes there
for arg in "$@"; do
  CMD+=" $(printf '%q' "${arg}")"
done

xpk workload create \
  --project "${PROJECT}" --zone "${ZONE}" --cluster "${CLUSTER}" \
  --workload "${WORKLOAD}" \
  --tpu-type "${TPU_TYPE}" --num-slices "${NUM_SLICES}" \
  --docker-image "${IMAGE}" \
  --max-restarts 3 \
  --command "${CMD}"

echo "follow with: xpk workload list --cluster ${CLUSTER} --project ${PROJECT} --zone ${ZONE}"
