#!/usr/bin/env bash
# One node's part of a multi-node torchrun job. Run it on every node, each with its own
# NODE_RANK (0 on the master), the same MASTER_ADDR (the master's address) and port:
#
#   node02$ NODE_RANK=0 MASTER_ADDR=192.168.0.101 ./torchrun_node.sh --epochs 4
#   node03$ NODE_RANK=1 MASTER_ADDR=192.168.0.101 ./torchrun_node.sh --epochs 4
#
# Settings (environment variables):
#   NNODES=2  NPROC_PER_NODE=1  MASTER_PORT=29500
#   RDZV=static  the classic rendezvous: node ranks are NODE_RANK, and every node waits
#                for NODE_RANK 0, which hosts the store on MASTER_ADDR:MASTER_PORT
#   RDZV=c10d    torchrun's elastic rendezvous: nodes start in any order, and the
#                rendezvous numbers them itself (NODE_RANK is not used)
# Arguments go to ddplab.train.
set -euo pipefail
: "${NNODES:=2}" "${NPROC_PER_NODE:=1}" "${MASTER_PORT:=29500}" "${RDZV:=static}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node rank 0 (the master)}"

if [[ $RDZV == static ]]; then
    # torchrun itself does not check this: a node rank outside 0..NNODES-1 waits for a
    # rendezvous that can never complete, for 15 minutes (torchrun's 900-s rendezvous
    # timeout), before it fails.
    if ! [[ ${NODE_RANK:-} =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
        echo "torchrun_node.sh: NODE_RANK=${NODE_RANK:-(unset)} is not a node rank of" \
             "NNODES=$NNODES nodes: number the nodes 0 to $((NNODES - 1)), the master" \
             "(MASTER_ADDR) 0, each node a different one." >&2
        exit 2
    fi
    exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" \
        --nproc_per_node="$NPROC_PER_NODE" \
        --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" -m ddplab.train "$@"
elif [[ $RDZV == c10d ]]; then
    exec torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
        --rdzv_id="${RDZV_ID:-ddplab}" -m ddplab.train "$@"
else
    echo "torchrun_node.sh: RDZV=$RDZV: use RDZV=static or RDZV=c10d" >&2
    exit 2
fi
