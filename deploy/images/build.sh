#!/usr/bin/env bash
# Builds rollwire:light, rollwire:full and rollwire:node-env (the Node env example) with no
# registry and no network:
#
#   bash deploy/images/build.sh             # base from Debian (base.sh), wheels from the host
#   BASE_IMAGE=python:3.11-slim-bookworm bash deploy/images/build.sh   # with a registry
#
# Needs a running Docker engine (deploy/images/dockerd.sh starts one where there is no
# systemd) and, for the wheelhouse, a python3.11 with pip (PYTHON, default python3).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
base="${BASE_IMAGE:-}"
node_base="${NODE_BASE_IMAGE:-}"
if [ -z "$base" ]; then
  base=rollwire-base:bookworm
  bash "$here/base.sh" "$base"
fi
if [ -z "$node_base" ]; then
  if [ -n "${BASE_IMAGE:-}" ]; then
    node_base=node:20-bookworm-slim
  else
    node_base=rollwire-base-node:bookworm
    bash "$here/base.sh" "$node_base" nodejs
  fi
fi
bash "$here/wheelhouse.sh" "${PYTHON:-python3}"
for target in light full; do
  echo "image rollwire:$target (base $base)"
  docker build --quiet --build-arg "BASE_IMAGE=$base" --build-arg "FLAVOR=$target" -t "rollwire:$target" "$here" >/dev/null
  echo "image rollwire:$target: $(docker image inspect -f '{{.Size}}' "rollwire:$target" | awk '{printf "%.0f MB", $1/1e6}')"
done
project="$(cd "$here/../.." && pwd)"
[ -d "$project/examples/node-env/node_modules" ] || (cd "$project/examples/node-env" && npm ci --no-audit --no-fund)
echo "image rollwire:node-env (base $node_base)"
docker build --quiet --build-arg "BASE_IMAGE=$node_base" -f "$project/examples/node-env/Dockerfile" \
  -t rollwire:node-env "$project" >/dev/null
echo "image rollwire:node-env: $(docker image inspect -f '{{.Size}}' rollwire:node-env | awk '{printf "%.0f MB", $1/1e6}')"
