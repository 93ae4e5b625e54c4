#!/usr/bin/env bash
# Two simulated nodes on this machine: two `minifabric run` commands that meet at one rendezvous.
# On real machines, run the node-rank-1 line on the second machine with --main-address set to
# node 0's address (reachable from node 1, port open).
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT="${PORT:-29510}"
for NODE in 0 1; do
    minifabric run --num-nodes 2 --node-rank "$NODE" --devices "${DEVICES:-1}" --accelerator cpu \
        --main-address 127.0.0.1 --main-port "$PORT" examples/multinode/train.py "$@" &
done
wait -n && wait -n  # fails as soon as either node fails
