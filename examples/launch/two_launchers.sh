#!/bin/bash
# Two hosts with smp-fx run (torchrun underneath, c10d rendezvous): run this on each host
# with its node rank; both name the first host's address.
#
#   examples/launch/two_launchers.sh NODE_RANK HOST0_ADDR [script.py [args...]]
#
# On one machine, two shells (or `... 0 127.0.0.1 & ... 1 127.0.0.1`) stand for two hosts.
set -euo pipefail

NODE_RANK=$1
HOST0=$2
shift 2
SCRIPT=${1:-examples/launch/train_tiny.py}
shift || true
[ $# -gt 0 ] || set -- "out/two-launchers"

export SM_HP_MP_PARAMETERS=${SM_HP_MP_PARAMETERS:-'{"partitions": 2, "microbatches": 2, "ddp": true}'}
smp-fx run -n 2 --nnodes 2 --node-rank "$NODE_RANK" --rdzv-backend c10d \
  --rdzv-id "${RDZV_ID:-smp-fx-job}" --rdzv-endpoint "$HOST0:${RDZV_PORT:-29400}" \
  "$SCRIPT" "$@"
