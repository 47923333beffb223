#!/usr/bin/env bash
# Every GPU check in one run, for a machine with one CUDA GPU (budget: under 8 minutes
# once the environments exist; their first build downloads CUDA wheels and takes longer).
#
#   bash deploy/gpu-checks.sh
#
# 1. .venv-gpu, rollwire[dev,train,deepspeed]: the `gpu`-marked tests (the weight group
#    over NCCL; FSDP2 and DeepSpeed ZeRO-3 backends and the trainer step led by rank 0 on
#    one rank per GPU over NCCL, against one CUDA process, with resume, the ZeRO-3 one
#    with a critic; a short `rollwire train` with trainer ranks on CUDA in bf16, for
#    fsdp2 and deepspeed; `rollwire sft` then `rollwire dpo` on fsdp2 ranks in bf16).
# 2. .venv-gpu-vllm, rollwire[dev,train,vllm]: the vLLM engine tests on CUDA (marker vllm).
# 3. .venv-gpu-sglang, rollwire[dev,train,sglang]: the SGLang engine tests (gpu-marked);
#    SGLang and vLLM pin their own torch, so each has its environment.
# Each part has its own time limit; the summary at the end names what failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off OMP_NUM_THREADS=4

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || {
  echo "no CUDA GPU visible (nvidia-smi failed): nothing to check here" >&2
  exit 2
}

venv() {  # venv NAME EXTRAS: creates or updates an environment
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  "$1/bin/pip" install -q -e ".[$2]"
}

declare -A results
part() {  # part NAME SECONDS PYTHON PYTEST-ARGS...
  local name=$1 seconds=$2 python=$3
  shift 3
  echo "== $name"
  timeout "$seconds" "$python" -m pytest -p no:cacheprovider -q -rs "$@"
  results[$name]=$?
}

venv .venv-gpu dev,train,deepspeed
part "gpu-marked (NCCL, FSDP2, ZeRO-3, trainer ranks)" 240 .venv-gpu/bin/python -m gpu
venv .venv-gpu-vllm dev,train,vllm
part "vLLM on CUDA" 130 .venv-gpu-vllm/bin/python -m vllm tests/test_vllm_engine.py tests/test_vllm_run.py
venv .venv-gpu-sglang dev,train,sglang
part "SGLang" 100 .venv-gpu-sglang/bin/python -m gpu tests/test_sglang_engine.py

echo "== summary"
status=0
for name in "${!results[@]}"; do
  echo "  $name: exit ${results[$name]}"
  [ "${results[$name]}" -eq 0 ] || status=1
done
exit "$status"
