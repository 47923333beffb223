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
# The two base images and the wheelhouse do not depend on one another and mostly wait on
# the package mirrors: made at once, each with its own log, shown when it ends.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
jobs_started=()
start() { # NAME COMMAND...
  local name="$1"
  shift
  "$@" >"$logs/$name.log" 2>&1 &
  jobs_started+=("$!:$name")
}
if [ -z "$base" ]; then
  base=rollwire-base:bookworm
  start base bash "$here/base.sh" "$base"
fi
if [ -z "$node_base" ]; then
  if [ -n "${BASE_IMAGE:-}" ]; then
    node_base=node:20-bookworm-slim
  else
    node_base=rollwire-base-node:bookworm
    start base-node bash "$here/base.sh" "$node_base" nodejs
  fi
fi
start wheelhouse bash "$here/wheelhouse.sh" "${PYTHON:-python3}"
failed=0
for job in "${jobs_started[@]}"; do
  pid="${job%%:*}" name="${job#*:}"
  if wait "$pid"; then cat "$logs/$name.log"; else
    echo "$name failed:" >&2
    cat "$logs/$name.log" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
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
