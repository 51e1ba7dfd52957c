#!/usr/bin/env bash
# Runs a test binary as two torchrun "nodes" of one process each on this machine (static
# rendezvous on a free port), and fails if either fails; when one fails, the other is stopped
# rather than left waiting for it.
#   two_nodes.sh PYTHON BINARY [ARGS...]
set -u
python=$1
shift
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
run_node() {
  local rank=$1
  shift
  "$python" -m torch.distributed.run --nnodes 2 --node-rank "$rank" --nproc-per-node 1 \
    --master-addr 127.0.0.1 --master-port "$port" --no-python "$@"
}
run_node 0 "$@" &
node0=$!
run_node 1 "$@" &
node1=$!
trap 'kill "$node0" "$node1" 2>/dev/null' EXIT INT TERM
wait -n -p done "$node0" "$node1"
status=$?
if [ "$status" -ne 0 ]; then
  echo "two_nodes.sh: a node failed (exit status $status)" >&2
  exit "$status"
fi
if [ "$done" = "$node0" ]; then wait "$node1"; else wait "$node0"; fi
