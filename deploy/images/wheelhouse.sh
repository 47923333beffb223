#!/usr/bin/env bash
# The wheels the images install, made on the host with its own pip (which already
# resolves the CPU build of torch here), so `docker build` needs no network: the way
# air-gapped clusters build.
#
#   bash deploy/images/wheelhouse.sh [PYTHON]   # a python3.11 with pip (default: python3)
#
# Writes, for each image, wheels/IMAGE/deps (every dependency) and wheels/IMAGE/project
# (rollwire's own wheel): light = rollwire[env,reward,judge], full = rollwire[$FULL_EXTRAS]
# (default train,judge: torch's CPU build included). Kept apart so that a change to
# rollwire alone rebuilds one small image layer. Remade each time, never stale.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
project="$(cd "$here/../.." && pwd)"
python="${1:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
for image in light full; do
  case "$image" in
  light) extras="env,reward,judge" ;;
  full) extras="${FULL_EXTRAS:-train,judge}" ;;
  esac
  out="$here/wheels/$image"
  rm -rf "$out"
  mkdir -p "$out/deps" "$out/project"
  echo "wheelhouse $image: rollwire[$extras]"
  "$python" -m pip wheel --quiet --wheel-dir "$out/deps" "$project[$extras]"
  mv "$out"/deps/rollwire-*.whl "$out/project/"
  # What the image installs: every dependency pinned to the wheel that is here.
  (cd "$out/deps" && ls ./*.whl | sed -E 's|^\./([^-]+)-([^-]+)-.*|\1==\2|') >"$out/deps/requirements.txt"
  printf 'rollwire[%s]\n' "$extras" >"$out/project/REQUIREMENT"
  echo "wheelhouse $image: $(ls "$out/deps" | grep -c '\.whl$') wheels, $(du -sh "$out" | cut -f1)"
done
