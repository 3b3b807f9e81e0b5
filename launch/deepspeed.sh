#!/usr/bin/env bash
# The `deepspeed` launcher with a hostfile (lines "host slots=N"); no accelerate launch involved: the loop
# reads the ZeRO JSON from train.deepspeed_config.
#   HOSTFILE=launch/hostfile.example ZERO=2 launch/deepspeed.sh --config configs/train/default.yaml
# On a CPU-only host add --num_accelerators 2 via DS_ARGS and leave OMP_NUM_THREADS unset or set (the loop
# divides the cores between local ranks when it is unset).
set -euo pipefail
exec deepspeed ${HOSTFILE:+--hostfile "$HOSTFILE"} ${DS_ARGS:-} --module scale.train train.resume_from=auto "$@" \
  "train.deepspeed_config=zero${ZERO:-2}"   # a shipped name: found from any directory
