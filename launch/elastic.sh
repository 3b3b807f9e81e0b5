#!/usr/bin/env bash
# Elastic restarts with torchrun: a worker that dies (OOM kill, segfault, a lost node's ranks) makes torch elastic
# stop the group and start it again, up to MAX_RESTARTS times; the new workers resume from the newest complete
# checkpoint (train.resume_from=auto: a fresh start when there is none, a refusal when output_dir holds another
# run). Checkpoint often (train.save_every / train.save_every_minutes): a restart repeats the steps since the last.
#   launch/elastic.sh --config configs/train/default.yaml train.save_every=50
#   NNODES=2 RDZV_ENDPOINT=10.0.0.1:29400 launch/elastic.sh --config ...   # on every node (same RDZV_ID)
#   NPROC_PER_NODE=2 launch/elastic.sh --config configs/train/tiny_cpu.yaml   # 2 CPU processes (gloo)
# A node range (NNODES=1:4): the group restarts with the nodes that are left (or joined), and the run resumes on that
# number of processes with the same global batch (gradient_accumulation_steps recomputed, docs/checkpoints.md). The
# node hosting the rendezvous store (the one at RDZV_ENDPOINT) must stay. RDZV_CONF=last_call_timeout=5 shortens the
# wait for more nodes (default 30 s) once the minimum is there.
#   NNODES=1:2 NPROC_PER_NODE=8 RDZV_ENDPOINT=10.0.0.1:29400 launch/elastic.sh --config ...   # on every node
# A failed process-group rendezvous of a restarted group is retried inside the attempt (train.rendezvous_retries,
# backoff 2, 4, 8 s) instead of spending a restart. Plain torchrun: DDP (or DeepSpeed with train.deepspeed_config).
set -euo pipefail
exec torchrun --nnodes "${NNODES:-1}" --nproc-per-node "${NPROC_PER_NODE:-gpu}" \
  --max-restarts "${MAX_RESTARTS:-3}" --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:-127.0.0.1:29400}" \
  --rdzv-id "${RDZV_ID:-scale}" ${RDZV_CONF:+--rdzv-conf "$RDZV_CONF"} -m scale.train train.resume_from=auto "$@"
