#!/usr/bin/env bash
# Several machines, DDP or ZeRO. Run the same command on every node; the node's rank and the rendezvous come
# from the environment:
#   MACHINE_RANK (0..NUM_MACHINES-1), MASTER_ADDR, MASTER_PORT (default 29500),
#   NUM_MACHINES (default 2), NUM_PROCESSES (total over all nodes), ACCELERATE_CONFIG (default multinode).
#   MACHINE_RANK=0 MASTER_ADDR=10.0.0.1 NUM_PROCESSES=16 launch/multinode.sh --config configs/train/default.yaml
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"   # the configs are found from any working directory
exec accelerate launch --config_file "${root}/configs/accelerate/${ACCELERATE_CONFIG:-multinode}.yaml" \
  --num_machines "${NUM_MACHINES:-2}" --num_processes "${NUM_PROCESSES:?total processes over all nodes}" \
  --machine_rank "${MACHINE_RANK:?rank of this node}" \
  --main_process_ip "${MASTER_ADDR:?address of node 0}" --main_process_port "${MASTER_PORT:-29500}" \
  -m scale.train train.resume_from=auto "$@"   # a rerun continues from the newest checkpoint
