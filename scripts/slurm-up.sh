#!/usr/bin/env bash
# Starts a real one-node Slurm cluster (controller and node daemon, loopback only) in a scratch
# folder, for the tests that launch byzcoll with srun. Prints the SLURM_CONF to export.
# Stop it with scripts/slurm-down.sh DIR. Installs slurm-wlm and munge when missing.
set -euo pipefail
dir=${1:-$(mktemp -d /tmp/byzcoll-slurm.XXXXXX)}
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq slurm-wlm munge >&2
fi
host=$(hostname -s)
mkdir -p "$dir/state" "$dir/spool" /run/munge
chown munge:munge /run/munge
if ! pgrep -x munged >/dev/null; then
    su -s /bin/sh munge -c /usr/sbin/munged
fi
cat > "$dir/slurm.conf" <<CONF
ClusterName=byzcoll
SlurmctldHost=$host
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
/usr/sbin/slurmctld -f "$dir/slurm.conf"
/usr/sbin/slurmd -f "$dir/slurm.conf"
for _ in $(seq 1 50); do
    if SLURM_CONF="$dir/slurm.conf" sinfo -h -o %t 2>/dev/null | grep -q idle; then
        echo "$dir/slurm.conf"
        exit 0
    fi
    sleep 0.2
done
echo "slurm did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
exit 1
