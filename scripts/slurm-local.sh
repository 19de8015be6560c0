#!/usr/bin/env bash
# A real Slurm cluster on this machine, to try slurm/train.sbatch and for the Slurm tests: Debian's Slurm,
# two emulated nodes.
#
#   make slurm-up     (scripts/slurm-local.sh)       as root; installs Slurm; idempotent; says how long it took
#   make slurm-down   (scripts/slurm-local.sh stop)  stops the daemons
#
# Two slurmd daemons (nodes n1 and n2, 2 CPUs each) on one machine: Debian builds Slurm with
# MULTIPLE_SLURMD. Both "nodes" share this machine's network and host name; n1 and n2 resolve to
# 127.0.0.1. No systemd: munged, slurmctld and the slurmd run as plain daemons. Settings that make a
# requeued job run again within seconds instead of minutes: credentials expire after 10 s, the
# scheduler looks every 2 s. The layout follows shared/slurm-local.md, tested on this kind of machine.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
NODES=(n1 n2)
PORTS=(17001 17002)

log() { printf '[slurm-local] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

idle_nodes() { sinfo -h -t idle -o %D 2>/dev/null | awk '{s += $1} END {print s + 0}'; }

stop() {
  local pid
  for pid in /run/slurm/*.pid; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  pkill -x munged 2>/dev/null || true
}

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  [ "$(id -u)" = 0 ] || die "installing Slurm needs root"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  [ -f /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
  install -d -o munge -g munge /run/munge
  # runuser, not su: the daemon must not be reparented as a zombie of this shell.
  runuser -u munge -- /usr/sbin/munged
  local deadline=$((SECONDS + 10))
  until munge -n 2>/dev/null | unmunge >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "munged does not answer (see /var/log/munge/munged.log)"
    sleep 0.2
  done
}

write_config() {
  mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm "$(dirname "$CONF")"
  cat >"$CONF" <<CONFIG
# Written by .ci/slurm-setup.sh: one machine, two emulated nodes.
ClusterName=ci
SlurmctldHost=$(hostname -s)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=2,sched_interval=2
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
NodeName=n[1-2] NodeHostname=localhost Port=[${PORTS[0]}-${PORTS[1]}] CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONFIG
  grep -qE "^127\.0\.0\.1\s.*\bn1\b" /etc/hosts || echo "127.0.0.1 ${NODES[*]}" >>/etc/hosts
}

start_daemons() {
  slurmctld -i
  local node
  for node in "${NODES[@]}"; do
    slurmd -N "$node"
  done
  local deadline=$((SECONDS + 60))
  until [ "$(idle_nodes)" = "${#NODES[@]}" ]; do
    [ $SECONDS -lt $deadline ] || die "the nodes did not become idle within 60 s: $(sinfo 2>&1 | tail -n 3)"
    sleep 0.3
  done
}

main() {
  local start=$SECONDS
  if [ "$(idle_nodes)" = "${#NODES[@]}" ]; then
    log "cluster: already up, ${#NODES[@]} idle nodes"
    return
  fi
  [ "$(id -u)" = 0 ] || die "starting a Slurm cluster needs root"
  install_packages
  start_munge
  stop_slurm_only
  write_config
  start_daemons
  log "cluster: ${#NODES[@]} idle nodes (${NODES[*]}) in $((SECONDS - start)) s"
}

stop_slurm_only() {
  local pid
  for pid in /run/slurm/*.pid; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  sleep 0.5
}

case ${1:-start} in
  start) main ;;
  stop) stop ;;
  *) echo "usage: $0 [start|stop]" >&2; exit 2 ;;
esac
