#!/usr/bin/env bash
# Every check one CUDA GPU can make, on the GPU machine this project is lent as it is: its own
# Python (3.12) and torch (2.11, CUDA), no network, one GPU, at most 8 minutes.
#
#   bash deploy/gpu/wheels.sh          # here: what that machine lacks, as wheels, into .whl/
#   bash deploy/gpu/checks.sh          # there, with .whl carried: one summary line per check
#   bash deploy/gpu/checks.sh --dry-run   # anywhere: what it would run, and nothing else
#
# With no CUDA device it says so, prints the plan and exits 2: nothing was checked.
# SMOLLM2_MODEL=FOLDER (a Hugging Face folder, e.g. what examples/smollm2_from_gguf.py
# writes) makes the short training run the SmolLM2 example's; without it the run trains the
# built-in 27M-parameter shape on the default task (the GGUF is 94 MB, over what one call
# may carry), and the summary says which it was.
set -uo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# name | seconds | what it runs
plan=(
  "one-GPU checks: bf16 step vs fp32, HF engine vs the trainer's forward (text, and a vision-language model with images), weights process to process|150|pytest tests/gpu"
  "HF engine on CUDA: batching, seeds, aborts, weights mid-generation, joins|120|ROLLWIRE_TEST_DEVICE=cuda pytest tests/rollout/test_rollout.py (the engine tests)"
  "FSDP2 on one rank on CUDA (NCCL), against the local step, with resume|150|pytest -m gpu tests/trainer/test_backends.py -k fsdp2"
  "rollwire train on CUDA, HF engine, weight_transport group on one device|200|rollwire train (SmolLM2 example, or the 27M built-in shape) 10 steps"
)
not_here=(
  "NCCL weight group between a trainer and rollout-servers on different GPUs: needs two GPUs (tests/rollout/test_weight_group.py::test_broadcast_over_nccl)"
  "FSDP2 / ZeRO-3 on two ranks over NCCL: needs two GPUs (tests/trainer/test_backends.py, gpu marker)"
  "DeepSpeed on CUDA: deepspeed is not on the machine and builds its ops there (tests/trainer/test_backends.py -k zero3)"
  "vLLM and SGLang on CUDA, vLLM's image inputs (multi_modal_data) among them: their wheels are larger than the 64 MiB a call may carry (tests/rollout/test_vllm_engine.py, test_sglang_engine.py)"
)

print_plan() {
  echo "the checks, in order (seconds allowed):"
  for row in "${plan[@]}"; do IFS='|' read -r name seconds command <<<"$row"; echo "  [$seconds s] $name: $command"; done
  echo "not checked on one GPU, and why:"
  for row in "${not_here[@]}"; do echo "  - $row"; done
}

if [ "${1:-}" = "--dry-run" ]; then
  print_plan
  exit 0
fi
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA device visible to $python: nothing was checked"
  print_plan
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# What the machine lacks (.whl, from deploy/gpu/wheels.sh) into a folder of its own; its
# torch, transformers and peft stay as they are.
if [ -d .whl ]; then
  site=/tmp/rollwire-site
  rm -rf "$site"
  for source in .whl/src/*; do
    [ -e "$source" ] || continue
    "$python" -m pip wheel -q --no-deps --no-build-isolation --no-index -w .whl "$source" || exit 1
  done
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c "import rollwire.services.core.config, torch, transformers; print('rollwire on torch', torch.__version__, 'transformers', transformers.__version__)" || exit 1

declare -a summary
status=0
record() {  # record NAME SECONDS EXIT DETAIL
  local verdict=PASS
  [ "$3" -eq 0 ] || { verdict=FAIL; status=1; }
  [ "$3" -eq 124 ] && verdict="FAIL (over its $4 s)"
  summary+=("$verdict  $1  (${2}s)${5:+: $5}")
}
run_pytest() {  # run_pytest INDEX ARGS...
  local index=$1
  shift
  IFS='|' read -r name seconds _ <<<"${plan[$index]}"
  echo "== $name"
  local started=$SECONDS
  timeout "$seconds" "$python" -m pytest -p no:cacheprovider -q -rs -s "$@" \
    --junitxml="$out/part$index.xml" 2>&1 | tee "$out/part$index.log"
  local code=${PIPESTATUS[0]}
  local counts
  counts=$(tail -1 "$out/part$index.log" | sed -E 's/=+//g; s/^ +| +$//g')
  record "$name" $((SECONDS - started)) "$code" "$seconds" "$counts"
}

run_pytest 0 -m gpu tests/gpu
export ROLLWIRE_TEST_DEVICE=cuda
run_pytest 1 tests/rollout/test_rollout.py -m "not multiproc" \
  -k "engine or generation or abort or update or join or score or seeds"
unset ROLLWIRE_TEST_DEVICE
run_pytest 2 -m gpu tests/trainer/test_backends.py -k fsdp2

# A short run on CUDA with the HF engine: throughput and held-out reward, and which way the
# weights went (one device: NCCL cannot form a group of two processes on it, and the run
# must say so rather than fall back unseen).
IFS='|' read -r name seconds _ <<<"${plan[3]}"
echo "== $name"
started=$SECONDS
run_dir="$out/train"
sets=(
  --set "run.output_dir=$run_dir" --set rl.max_steps=10 --set orchestrator.eval_every=10
  --set trainer.device=cuda --set rollout_server.device=cuda --set rollout_server.engine=hf
  --set trainer.weights.transport=group --set trainer.weights.group_backend=nccl
  --set trainer.weights.group_timeout_seconds=60 --set run.cpu_threads=0
)
if [ -n "${SMOLLM2_MODEL:-}" ]; then
  which="SmolLM2-135M-Instruct (examples/smollm2.yaml)"
  command=(train -c examples/smollm2.yaml --set "trainer.model_path=$SMOLLM2_MODEL"
    --set "rollout_server.model_path=$SMOLLM2_MODEL" --set rollout_server.dtype=bfloat16)
else
  which="the built-in 27M-parameter shape on the default task (SMOLLM2_MODEL unset)"
  command=(train --set 'run.tiny_model={hidden_size: 512, intermediate_size: 1408, num_hidden_layers: 8, num_attention_heads: 8, num_key_value_heads: 4, head_dim: 64}')
fi
timeout "$seconds" "$python" -m rollwire.services.app.cli "${command[@]}" "${sets[@]}" \
  >"$out/train.log" 2>&1
code=$?
tail -25 "$out/train.log"
detail=$("$python" - "$run_dir" "$which" <<'PY'
import json, sys
from pathlib import Path

run, which = Path(sys.argv[1]), sys.argv[2]
def rows(name):
    path = run / "metrics" / name
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
steps, orchestrator, evals = rows("trainer.jsonl"), rows("orchestrator.jsonl"), rows("eval.jsonl")
if not steps:
    print(f"{which}: no step finished")
    sys.exit()
trained = sum(s["sequences"] * s.get("response_tokens_mean", 0) for s in steps)
busy = sum(s.get("time_forward_backward_seconds", 0) + s.get("time_optimizer_seconds", 0) for s in steps)
generated = orchestrator[-1].get("tokens_per_second", 0) if orchestrator else 0
by_group = sorted({int(s.get("weights_by_group", 0)) for s in steps})
transport = {(1,): "weight group", (0,): "gRPC streams", (0, 1): "group, then streams"}[tuple(by_group)]
curve = ", ".join(f"v{e['policy_version']} {e['eval_reward']:.3f}" for e in evals)
print(f"{which}: {len(steps)} steps; generated {generated:.0f} tokens/s; trainer "
      f"{trained / max(busy, 1e-9):.0f} response tokens/s; held-out greedy {curve}; "
      f"weights went by {transport}")
PY
)
if grep -q "no weight group, weights go as gRPC streams" "$out/train.log"; then
  detail+=" ($(grep -o 'no weight group, weights go as gRPC streams[^"]*' "$out/train.log" | head -1 | cut -c1-160))"
fi
record "$name" $((SECONDS - started)) "$code" "$seconds" "$detail"

echo "== summary"
for line in "${summary[@]}"; do echo "$line"; done
for row in "${not_here[@]}"; do echo "NOT RUN  $row"; done
exit "$status"
