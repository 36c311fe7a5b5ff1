#!/usr/bin/env bash
# Train with OpenMPI's mpirun: it starts the processes on the hosts of the hostfile and
# tells each its place in OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK (ddplab.launch
# reads them). torch has no MPI backend in its wheels, so the ranks talk gloo (or NCCL),
# and mpirun only starts them: MASTER_ADDR/MASTER_PORT say where rank 0 listens, and -x
# passes them to every rank.
#
#   ./mpirun.sh --epochs 4                 # NP=2 processes, hosts from ./hostfile
#   NP=8 HOSTFILE=my_hosts MASTER_ADDR=node02 ./mpirun.sh --backend nccl
#
# As root (containers), OpenMPI also needs --allow-run-as-root; --oversubscribe lets it
# start more processes than cores, as on a laptop. --bind-to none: by default OpenMPI binds
# each process to one core (to one socket when it starts more than two), and every thread
# of it, torch's too, would then share that core (man mpirun, "Mapping, Ranking, and
# Binding"); ddplab.train picks its own thread count instead.
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500}
extra=()
[[ $(id -u) == 0 ]] && extra+=(--allow-run-as-root)
exec mpirun -np "${NP:-2}" --hostfile "${HOSTFILE:-$here/hostfile}" --oversubscribe \
    --bind-to none "${extra[@]}" \
    -x MASTER_ADDR -x MASTER_PORT -x PATH \
    python -m ddplab.train "$@"
