#!/usr/bin/env bash
# Train on one machine with torchrun: NPROC_PER_NODE processes (one per GPU, or CPU ranks).
#
#   ./torchrun_one_node.sh --epochs 4
#   NPROC_PER_NODE=4 ./torchrun_one_node.sh --backend nccl --out runs/one-node
#
# --standalone starts a private rendezvous on a free port: no MASTER_ADDR or MASTER_PORT
# to choose, and two jobs on one machine never collide. Arguments go to ddplab.train.
set -euo pipefail
exec torchrun --standalone --nproc_per_node="${NPROC_PER_NODE:-2}" -m ddplab.train "$@"
