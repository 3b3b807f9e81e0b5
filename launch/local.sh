#!/usr/bin/env bash
# One machine. Usage: launch/local.sh <accelerate-config-name> [scale-train args...]
#   launch/local.sh single --config configs/train/default.yaml
#   launch/local.sh ddp --config configs/train/default.yaml      # all GPUs of this machine
#   launch/local.sh cpu_ddp --config configs/train/tiny_cpu.yaml # 2 CPU processes (gloo)
set -euo pipefail
cfg="$1"; shift
# --accelerate-config reads the shipped configs/accelerate/<name>.yaml from any directory and exits with the job's
# code (2 bad input, 75 pre-empted) rather than the launcher's 1.
# train.resume_from=auto: a rerun continues this output_dir's run from its newest checkpoint (a later
# train.resume_from=... on the command line wins).
exec scale-train --accelerate-config "${cfg}" train.resume_from=auto "$@"
