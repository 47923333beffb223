#!/usr/bin/env bash
# A Docker engine of our own on a machine without systemd (CI, this project's machines),
# and its removal leaving nothing behind.
#
#   bash deploy/images/dockerd.sh start STATE_DIR   # starts dockerd unless one answers
#   bash deploy/images/dockerd.sh stop  STATE_DIR   # stops the one `start` started, by pid,
#                                                   # and undoes its iptables, docker0, ip_forward
#
# STATE_DIR keeps the pid, the log and what the machine was like before (iptables rules,
# net.ipv4.ip_forward). An engine that already answered at `start` is left alone by `stop`.
set -euo pipefail
action="${1:?start or stop}"
state="${2:?a folder for the daemon's pid, log and the machine's prior state}"
mkdir -p "$state"

case "$action" in
start)
  if docker info >/dev/null 2>&1; then
    echo "dockerd: one is already running; using it"
    rm -f "$state/dockerd.pid"
    exit 0
  fi
  command -v dockerd >/dev/null || { echo "needs docker.io (apt-get install docker.io docker-compose)" >&2; exit 1; }
  iptables-save >"$state/iptables.before" 2>/dev/null || true
  sysctl -n net.ipv4.ip_forward >"$state/ip_forward.before" 2>/dev/null || true
  ip link show docker0 >/dev/null 2>&1 && touch "$state/docker0.before" || rm -f "$state/docker0.before"
  # --exec-opt: there is no systemd to hand cgroups to.
  dockerd --storage-driver=overlay2 --exec-opt native.cgroupdriver=cgroupfs \
    >"$state/dockerd.log" 2>&1 &
  echo $! >"$state/dockerd.pid"
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && { echo "dockerd: started (pid $(cat "$state/dockerd.pid"))"; exit 0; }
    kill -0 "$(cat "$state/dockerd.pid")" 2>/dev/null || break
    sleep 0.5
  done
  echo "dockerd did not start; its log ends:" >&2
  tail -20 "$state/dockerd.log" >&2
  exit 1
  ;;
stop)
  [ -f "$state/dockerd.pid" ] || { echo "dockerd: not started by us; left alone"; exit 0; }
  pid=$(cat "$state/dockerd.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  # containerd, started by dockerd as its child, ends with it; wait for it to go.
  for _ in $(seq 1 20); do pgrep -P "$pid" >/dev/null 2>&1 || break; sleep 0.5; done
  # What dockerd added: its rules (those naming a DOCKER chain or docker0) and chains,
  # in the filter and nat tables; then the FORWARD policy it set to DROP, back as it was.
  for table in filter nat; do
    iptables -t "$table" -S 2>/dev/null | grep -E '^-A .*(DOCKER|docker0)' | sed 's/^-A /-D /' |
      while read -r rule; do eval "iptables -t $table $rule" 2>/dev/null || true; done
    for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
      iptables -t "$table" -F "$chain" 2>/dev/null || true
    done
    for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
      iptables -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
  policy=$(grep -oE '^:FORWARD [A-Z]+' "$state/iptables.before" 2>/dev/null | awk '{print $2}' || true)
  iptables -P FORWARD "${policy:-ACCEPT}" 2>/dev/null || true
  [ -f "$state/docker0.before" ] || ip link delete docker0 2>/dev/null || true
  if [ -s "$state/ip_forward.before" ]; then
    sysctl -qw "net.ipv4.ip_forward=$(cat "$state/ip_forward.before")" || true
  fi
  rm -f "$state/dockerd.pid"
  echo "dockerd: stopped (pid $pid); iptables, docker0 and ip_forward as before"
  ;;
*)
  echo "usage: $0 start|stop STATE_DIR" >&2
  exit 2
  ;;
esac
