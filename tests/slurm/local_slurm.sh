#!/usr/bin/env bash
# A real Slurm on this machine for the sbatch tests: munge, slurmctld and two emulated nodes (n1, n2),
# each a `slurmd -N` on its own port, with two fake GPUs per node (character devices + gres.conf) so
# scripts that ask for --gpus-per-node run unchanged. Needs root and Debian's slurm packages
# (installed here when missing).
#
#   tests/slurm/local_slurm.sh start    # prints the SLURM_CONF path to export
#   tests/slurm/local_slurm.sh stop
set -euo pipefail

base="${MCORE_PACKING_SLURM_DIR:-/tmp/mcore_packing_slurm}"
conf="$base/slurm.conf"
host="$(hostname -s)"

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
  mkdir -p "$base"/{state,log,spool-n1,spool-n2}
  cat > "$conf" <<CONF
ClusterName=mcpack
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=16817
AuthType=auth/munge
AuthInfo=cred_expire=10  # a requeued job waits cred_expire before it starts again (default 120 s)
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SlurmUser=root
SlurmdUser=root
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$base/state
SlurmdSpoolDir=$base/spool-%n
SlurmctldPidFile=$base/slurmctld.pid
SlurmdPidFile=$base/slurmd-%n.pid
SlurmctldLogFile=$base/log/slurmctld.log
SlurmdLogFile=$base/log/slurmd-%n.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
InactiveLimit=0
KillWait=5
MinJobAge=30
NodeName=n[1-2] NodeHostname=${host} NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=2 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  for i in 0 1; do
    [[ -e /dev/mcpack_gpu$i ]] || mknod /dev/mcpack_gpu$i c 240 $i
  done
  echo "NodeName=n[1-2] Name=gpu File=/dev/mcpack_gpu[0-1]" > "$base/gres.conf"
}

start() {
  install_packages
  stop >/dev/null 2>&1 || true
  write_config
  mkdir -p /etc/munge /var/run/munge /var/log/munge /var/lib/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || munged --force
  export SLURM_CONF="$conf"
  slurmctld -f "$conf"
  slurmd -f "$conf" -N n1
  slurmd -f "$conf" -N n2
  for _ in $(seq 1 60); do
    if [[ "$(sinfo -h -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')" == "idle " ]]; then
      echo "SLURM_CONF=$conf"
      return 0
    fi
    sleep 1
  done
  echo "local Slurm did not come up; logs in $base/log" >&2
  sinfo >&2 || true
  tail -n 20 "$base"/log/*.log >&2 || true
  return 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
  sleep 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
