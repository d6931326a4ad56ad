#!/bin/bash
# SMP script under Open MPI's mpirun: the ranks from OMPI_COMM_WORLD_RANK / _SIZE /
# _LOCAL_RANK / _LOCAL_SIZE, as SageMaker launched SMP jobs.
#
#   examples/launch/mpirun.sh [-np N] [-H host1:2,host2:2] [script.py [args...]]
#
# On one host MASTER_ADDR defaults to 127.0.0.1; across hosts it must name rank 0's host
# (the first of -H), which this script sets from -H.
set -euo pipefail

NP=4
HOSTS=""
while [ $# -gt 0 ]; do
  case "$1" in
    -np) NP=$2; shift 2 ;;
    -H) HOSTS=$2; shift 2 ;;
    *) break ;;
  esac
done
SCRIPT=${1:-examples/launch/train_tiny.py}
shift || true
[ $# -gt 0 ] || set -- "out/mpirun"

export SM_HP_MP_PARAMETERS=${SM_HP_MP_PARAMETERS:-'{"partitions": 2, "microbatches": 2, "ddp": true}'}
export MASTER_PORT=${MASTER_PORT:-29500}
PYTHONPATH="$(python -c 'import smp_fx._compat as c; print(c.SHIM_DIR)')${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
HOST_ARGS=()
if [ -n "$HOSTS" ]; then
  export MASTER_ADDR=${MASTER_ADDR:-${HOSTS%%[:,]*}}
  HOST_ARGS=(-H "$HOSTS")
fi

# -x passes each variable to every rank, on every host
mpirun -np "$NP" "${HOST_ARGS[@]}" --bind-to none \
  -x SM_HP_MP_PARAMETERS -x MASTER_PORT -x PYTHONPATH ${MASTER_ADDR:+-x MASTER_ADDR} \
  -x PATH \
  python "$SCRIPT" "$@"
