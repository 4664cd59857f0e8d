#!/usr/bin/env bash
# Stops the cluster scripts/slurm-up.sh started in DIR (by the PIDs in its pid files).
dir=${1:?usage: slurm-down.sh DIR}
for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
exit 0
