#!/usr/bin/env bash
# The base image for machines without an image registry: Debian 12 (minbase) from the
# mirror apt already uses, with Python 3.11, imported into the local engine.
#
#   bash deploy/images/base.sh [TAG [PACKAGES]]   # default tag: rollwire-base:bookworm
#
# PACKAGES: more Debian packages, comma-separated (build.sh makes rollwire-base-node:bookworm
# with nodejs for the Node env example's image).
#
# Skipped when the tag exists (remove it with `docker image rm TAG` to rebuild). With a
# registry, skip this script: the Dockerfile's default base is python:3.11-slim-bookworm.
set -euo pipefail
tag="${1:-rollwire-base:bookworm}"
extra="${2:+,$2}"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag: present"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
# The mirror apt uses here (deb822 .sources or a one-line sources.list), else Debian's own.
mirror=$(grep -hoE '^URIs: *\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}' || true)
if [ -z "$mirror" ]; then
  mirror=$(grep -hoE '^deb +(\[[^]]*\] +)?\S+' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $NF}' || true)
fi
mirror="${mirror:-http://deb.debian.org/debian}"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "base image $tag: debootstrap bookworm from $mirror${2:+ (with $2)}"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates$extra \
  bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# Smaller and reproducible: no apt lists or caches, no docs.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "base image $tag: built ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
