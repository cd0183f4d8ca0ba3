#!/usr/bin/env bash
# down.sh - stop what up.sh started, each process by its own pid, and remove what it made: the
# daemons (pids in $NODE_RUN/pids), container processes (the pids in the kubelet's cgroup root), the
# containerd shims (the processes in the keeper's network namespace), then the keeper (its mount and
# network namespaces go with it: cni0, pod netns, the veth, its routes, every mount), then the cgroup
# root. Safe to run after a failed or partial up.sh, and twice.
# Env: NODE_RUN (required), KEEP_RUN=1 keeps $NODE_RUN (logs) on disk. Daemons are SIGKILLed: the
# node's state is thrown away, so nothing needs a graceful shutdown.
set -uo pipefail
RUN=${NODE_RUN:?NODE_RUN: the node state directory}
CG_ROOT=kvpool-node VETH=kvnode0
T0=$(date +%s.%N)
log() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN { printf "[down %5.1fs] %s\n", b - a, m }' >&2; }
[ -f "$RUN/pids" ] || { log "no $RUN/pids: nothing to stop"; exit 0; }
pid_of() { awk -v n="$1" '$1 == n { print $2 }' "$RUN/pids"; }
# alive PID: running and not a zombie (daemons outlive up.sh, so pid 1 reaps them, and it may take a while)
alive() { [ -n "$1" ] && [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" != Z ]; }
stop_pid() { # stop_pid NAME PID: SIGTERM, up to 10 s, then SIGKILL
    local name=$1 pid=$2 i
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 50); do alive "$pid" || { log "stopped $name ($pid)"; return 0; }; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null; log "killed $name ($pid)"
}
KEEP=$(pid_of keeper)
NETNS=$(readlink "/proc/$KEEP/ns/net" 2>/dev/null || true)

# 1. the daemons, in reverse order of start
#    (all at once; anything else a test added to $RUN/pids too, e.g. the webhook), not containerd/keeper
others=$(awk '$1 != "keeper" && $1 != "containerd" { print $1 ":" $2 }' "$RUN/pids")
for np in $others; do alive "${np#*:}" && kill -KILL "${np#*:}" 2>/dev/null; done
for np in $others; do stop_pid "${np%%:*}" "${np#*:}"; done
# 2. container processes still in the kubelet's cgroup root
for f in $(find "/sys/fs/cgroup/pids/$CG_ROOT" -name cgroup.procs 2>/dev/null); do
    for p in $(cat "$f"); do kill -KILL "$p" 2>/dev/null && log "killed container process $p"; done
done
stop_pid containerd "$(pid_of containerd)"
# 3. shims (and anything else) left in the keeper's network namespace, by pid
if [ -n "$NETNS" ]; then
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        [ "$p" = "$KEEP" ] && continue
        [ "$(readlink "$d/ns/net" 2>/dev/null)" = "$NETNS" ] || continue
        stop_pid "$(tr '\0' ' ' <"$d/cmdline" | cut -c1-60)" "$p"
    done
fi
stop_pid keeper "$KEEP"
# 4. cgroups (deepest first), the veth if it is still there
for c in /sys/fs/cgroup/*/; do
    [ -d "$c$CG_ROOT" ] || continue
    find "$c$CG_ROOT" -depth -type d -exec rmdir {} \; 2>/dev/null
    [ -d "$c$CG_ROOT" ] && log "WARNING: $c$CG_ROOT still there"
done
ip link show $VETH >/dev/null 2>&1 && ip link del $VETH
# 5. checks
mount | grep -q "$RUN" && log "WARNING: mounts left: $(mount | grep -c "$RUN")"
ps -eo pid,args | grep -F "$RUN" | grep -v grep && log "WARNING: processes left (above)"
mv "$RUN/pids" "$RUN/pids.done"
[ "${KEEP_RUN:-0}" = 1 ] || rm -rf "$RUN"
log "done"
