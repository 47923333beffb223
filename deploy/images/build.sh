#!/usr/bin/env bash
# Builds rollwire:light and rollwire:full with no registry and no network:
#
#   bash deploy/images/build.sh             # base from Debian (base.sh), wheels from the host
#   BASE_IMAGE=python:3.11-slim-bookworm bash deploy/images/build.sh   # with a registry
#
# Needs a running Docker engine (deploy/images/dockerd.sh starts one where there is no
# systemd) and, for the wheelhouse, a python3.11 with pip (PYTHON, default python3).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
base="${BASE_IMAGE:-}"
if [ -z "$base" ]; then
  base=rollwire-base:bookworm
  bash "$here/base.sh" "$base"
fi
bash "$here/wheelhouse.sh" "${PYTHON:-python3}"
for target in light full; do
  echo "image rollwire:$target (base $base)"
  docker build --quiet --build-arg "BASE_IMAGE=$base" --target "$target" -t "rollwire:$target" "$here" >/dev/null
  echo "image rollwire:$target: $(docker image inspect -f '{{.Size}}' "rollwire:$target" | awk '{printf "%.0f MB", $1/1e6}')"
done
