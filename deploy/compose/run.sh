#!/usr/bin/env bash
# One command: a run as a docker-compose stack, from images to the held-out result.
#
#   bash deploy/compose/run.sh                                  # the built-in default run
#   bash deploy/compose/run.sh -c examples/agentic.yaml --env-servers 4
#   bash deploy/compose/run.sh --set rl.max_steps=20 --out runs/compose
#   bash deploy/compose/run.sh -c run.yaml --model models/my-model   # a model folder of yours
#   bash deploy/compose/run.sh -c guess.yaml --node-env      # episodes on the Node env server
#   bash deploy/compose/run.sh --rollout-servers 2            # two rollout-servers from the start
#   bash deploy/compose/run.sh --project NAME --scale rollout-server=3   # a running stack's
#
# `--scale SERVICE=N` (rollout-server, env-server, reward-server; repeatable) changes the
# replicas of a stack this script started and is still running (`--project`, default
# rollwire): the orchestrator and the trainer look the services' DNS names up again every
# endpoints.refresh_seconds, so servers added join the run (a rollout-server takes work
# once the trainer has sent it the weights) and servers removed leave it.
#
# Starts a Docker engine if none answers (and stops it after), builds rollwire:light and
# rollwire:full if they are missing (--build: always), brings the stack up, follows the
# trainer's and orchestrator's logs until both have finished, copies the run folder
# (metrics, checkpoints, logs) to --out, prints the held-out reward, and takes the stack
# down with its volumes (--keep: leaves it up). Exit status: 0 when the run finished.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
project_root="$(cd "$here/../.." && pwd)"
config="$here/default.yaml"
env_servers=0
node_env=0
out="runs/compose"
build=0
keep=0
timeout_s=3600
name="rollwire"
model=""
sets=()
rollout_servers=1
rescale=()
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; echo "options: -c FILE, --set KEY=VALUE, --env-servers N, --rollout-servers N, --node-env, --model DIR, --out DIR, --build, --keep, --timeout S, --project NAME, --scale SERVICE=N"; }
while [ $# -gt 0 ]; do
  case "$1" in
  -c | --config) config="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
  --set) sets+=("$2"); shift 2 ;;
  --env-servers) env_servers="$2"; shift 2 ;;
  --rollout-servers) rollout_servers="$2"; shift 2 ;;
  --scale) rescale+=("$2"); shift 2 ;;
  --node-env) node_env=1; shift ;;
  --out) out="$2"; shift 2 ;;
  --model) model="$(cd "$2" && pwd)"; shift 2 ;;
  --build) build=1; shift ;;
  --keep) keep=1; shift ;;
  --timeout) timeout_s="$2"; shift 2 ;;
  --project) name="$2"; shift 2 ;;
  -h | --help) usage; exit 0 ;;
  *) echo "run.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
# A running stack's replicas: the settings it was started with are in its registry file.
registry="${TMPDIR:-/tmp}/rollwire-compose"
if [ "${#rescale[@]}" -gt 0 ]; then
  [ -f "$registry/$name.sh" ] || { echo "run.sh: no running stack $name started by this script (--project)" >&2; exit 2; }
  # shellcheck source=/dev/null
  . "$registry/$name.sh"
  for change in "${rescale[@]}"; do
    service="${change%%=*}"
    case "$service" in rollout-server | env-server | reward-server) ;; *)
      echo "run.sh: --scale $change: the service must be rollout-server, env-server or reward-server" >&2; exit 2 ;;
    esac
    "${compose[@]}" "${profile[@]}" up -d --no-recreate --no-deps --scale "$change" "$service" 2>&1 | grep -v '^Creating\|^Starting' || true
    echo "compose: $service now $("${compose[@]}" ps -q "$service" | wc -l) container(s)"
  done
  exit 0
fi
[ -f "$config" ] || { echo "run.sh: no config file $config" >&2; exit 2; }

state="$(mktemp -d)"
compose=(docker-compose --project-directory "$here" -f "$here/docker-compose.yml" -p "$name")
if [ -n "$model" ]; then
  # `prepare` copies this host folder into the models volume instead of building one. The
  # containers run as uid 10001: the folder must be readable by others (chmod -R o+rX).
  [ -f "$model/config.json" ] || { echo "run.sh: $model is not a Hugging Face model folder (no config.json)" >&2; exit 2; }
  cat >"$state/model.yml" <<YAML
version: "3.9"
services:
  prepare:
    volumes: ["$model:/host-model:ro"]
    environment:
      ROLLWIRE__TRAINER__MODEL_PATH: /host-model
YAML
  compose+=(-f "$state/model.yml")
fi
follower=""
finish() {
  status=$?
  [ -n "$follower" ] && kill "$follower" 2>/dev/null || true
  if [ "$keep" -eq 0 ]; then
    "${compose[@]}" --profile env --profile node down --volumes --remove-orphans --timeout 20 >/dev/null 2>&1 || true
  fi
  bash "$here/../images/dockerd.sh" stop "$state/docker" >/dev/null || true
  rm -f "$registry/$name.sh"
  rm -rf "$state"
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT TERM

bash "$here/../images/dockerd.sh" start "$state/docker"
if [ "$build" -eq 1 ] || ! docker image inspect rollwire:full rollwire:light >/dev/null 2>&1; then
  PYTHON="${PYTHON:-python3}" bash "$here/../images/build.sh"
fi

# --set KEY=VALUE -> ROLLWIRE__KEY=VALUE (the services read these over the file).
: >"$state/overrides.env"
for assignment in "${sets[@]+"${sets[@]}"}"; do
  key="${assignment%%=*}"
  value="${assignment#*=}"
  [ "$key" != "$assignment" ] || { echo "run.sh: --set $assignment is not KEY=VALUE" >&2; exit 2; }
  printf 'ROLLWIRE__%s=%s\n' "$(echo "$key" | tr '[:lower:]' '[:upper:]' | sed 's/\./__/g')" "$value" >>"$state/overrides.env"
done
export ROLLWIRE_CONFIG="$config" ROLLWIRE_ENV_FILE="$state/overrides.env"

# The run's secrets: the stack's gRPC token and the trainer's token on the buffer, fresh
# for each run. Readable by the containers' user (uid 10001); the folder is this run's own.
mkdir -p "$state/secrets"
for secret in token trainer-token; do
  "${PYTHON:-python3}" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$state/secrets/$secret"
  chmod 0644 "$state/secrets/$secret"
done
export ROLLWIRE_SECRETS="$state/secrets"

profile=()
scale=(--scale "rollout-server=$rollout_servers")
if [ "$env_servers" -gt 0 ]; then
  profile=(--profile env)
  scale+=(--scale "env-server=$env_servers")
fi
if [ "$node_env" -eq 1 ]; then
  profile+=(--profile node)
  export ROLLWIRE_ENV_SERVERS='["dns:///node-env-server:7004"]'
fi
echo "compose: project $name, config $config, rollout-servers $rollout_servers, env-servers $env_servers$([ "$node_env" -eq 1 ] && echo ', the Node env server')"
# What `run.sh --project $name --scale ...` needs to reach this stack while it runs.
mkdir -p "$registry"
{
  declare -p compose profile
  for variable in ROLLWIRE_CONFIG ROLLWIRE_ENV_FILE ROLLWIRE_SECRETS ROLLWIRE_ENV_SERVERS; do
    if [ -n "${!variable:-}" ]; then printf 'export %s=%q\n' "$variable" "${!variable}"; fi
  done
} >"$registry/$name.sh"
started=$(date +%s)
"${compose[@]}" "${profile[@]}" up -d "${scale[@]}" 2>&1 | grep -v '^Creating\|^Starting' || true
"${compose[@]}" logs -f --no-color --tail 0 prepare trainer orchestrator &
follower=$!

# Until the trainer and the orchestrator have both exited (restarts: on-failure).
deadline=$((started + timeout_s))
result=""
while :; do
  trainer_id=$("${compose[@]}" ps -q trainer)
  orchestrator_id=$("${compose[@]}" ps -q orchestrator)
  prepare_id=$("${compose[@]}" ps -q prepare)
  if [ -n "$prepare_id" ]; then
    case "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$prepare_id")" in
    "exited 0") ;;
    exited*) result="prepare failed"; break ;;
    esac
  fi
  if [ -n "$trainer_id" ] && [ -n "$orchestrator_id" ]; then
    t=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.State.Restarting}}' "$trainer_id")
    o=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.State.Restarting}}' "$orchestrator_id")
    if [ "$t" = "exited 0 false" ] && [ "$o" = "exited 0 false" ]; then result="finished"; break; fi
    case "$t $o" in *"exited 2"*) result="stopped on an error a restart cannot mend"; break ;; esac
  fi
  [ "$(date +%s)" -lt "$deadline" ] || { result="timed out after ${timeout_s}s"; break; }
  sleep 2
done
kill "$follower" 2>/dev/null || true
follower=""
elapsed=$(( $(date +%s) - started ))

mkdir -p "$out"
rm -rf "$out/run"
if [ -n "${orchestrator_id:-}" ]; then
  docker cp "$orchestrator_id:/run-data" "$out/run" >/dev/null 2>&1 || true
fi
mkdir -p "$out/run/logs"
for service in prepare buffer reward-server rollout-server env-server node-env-server trainer orchestrator; do
  "${compose[@]}" "${profile[@]}" logs --no-color "$service" >"$out/run/logs/$service.compose.log" 2>&1 || true
done
echo "compose: $result in ${elapsed}s; run folder: $out/run"
python3 - "$out/run/metrics/eval.jsonl" <<'PY' || true
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    sys.exit(0)
if rows:
    first, last = rows[0], rows[-1]
    print(f"held-out eval reward: {first['eval_reward']:.3f} (version {first['policy_version']}) -> "
          f"{last['eval_reward']:.3f} (version {last['policy_version']})")
PY
[ "$result" = "finished" ]
