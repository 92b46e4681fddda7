#!/usr/bin/env bash
# local_slurm.sh: a throw-away SLURM on this host for rlc's tests (Debian 12, root, no systemd).
#
#   local_slurm.sh install          apt-install slurmctld slurmd slurm-client munge shellcheck podman runc,
#                                   and build the stand-in container image (cached)
#   local_slurm.sh start            (re)shape and start the cluster, wait until every node is idle
#   local_slurm.sh stop             cancel jobs, stop every daemon this script started
#   local_slurm.sh status           print the cluster state (exit 1 if it is not up)
#   local_slurm.sh env              print `export SLURM_CONF=...` for a shell to eval
#
# Shape (start): NODES=2 GPUS_PER_NODE=8 (0 = no GRES) GPU_TYPE= (e.g. h100) CPUS_PER_NODE=16
#   MEM_PER_NODE_MB=64000 PARTITIONS=debug (comma list, first = default)
# Place: RLC_SLURM_DIR=/tmp/rlc-slurm RLC_SLURM_PORT=17817 RLC_SLURM_TIMEOUT=60
#
# Everything lives under $RLC_SLURM_DIR, configuration included (etc/slurm.conf): /etc/slurm is
# never touched, so clients must run with SLURM_CONF=$RLC_SLURM_DIR/etc/slurm.conf (see `env`).
# Fake nodes node1..nodeN all run on this host: one `slurmd -N nodeN` each, a unique slurmd
# port each, NodeAddr=127.0.0.1. Fake GPUs: gres.conf with AutoDetect=off and File= pointing at
# symlinks to /dev/null. `start` with an unchanged shape and live daemons returns at once; a new
# shape restarts slurmctld and the slurmds from a clean state (munged stays up). Finished jobs
# stay visible to `scontrol show job` for an hour and in the jobcomp file ($D/log/jobcomp.txt).
#
# Containers: a bundle compiled with cluster.container.runtime=apptainer runs its steps in real
# containers when tests/harness/bin is first on the job's PATH: its `apptainer` runs `podman run`
# (rootful, runc, host network, storage under $D/podman) with exactly the bundle's --bind list, so a
# path the bundle does not mount is missing in the container, as on a cluster. The image is
# $D/image/rootfs, a folder (an Apptainer "sandbox" image) built by `install` from this host's own
# Debian packages (bash, coreutils, procps, the host's python3): no download, rebuilt only when those
# packages change.
set -euo pipefail
umask 022

D=${RLC_SLURM_DIR:-/tmp/rlc-slurm}
PORT=${RLC_SLURM_PORT:-17817}
TIMEOUT=${RLC_SLURM_TIMEOUT:-60}
ETC=$D/etc RUN=$D/run LOG=$D/log
CONF=$ETC/slurm.conf
PKGS=(munge slurmctld slurmd slurm-client shellcheck podman runc python3)
IMAGE=$D/image
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
T0=$(date +%s%N)

log() { echo "[local-slurm] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
elapsed() { echo "$(( ($(date +%s%N) - T0) / 1000000 ))ms"; }

# alive PIDFILE NAME: the pid in PIDFILE is a live (non-zombie) process whose comm starts with NAME
alive() {
  local pid comm state
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ $comm == "$2"* && $state != Z ]]
}

# stop_pid PIDFILE NAME: TERM (then KILL after 10 s) the daemon named in PIDFILE, if it is ours
stop_pid() {
  local f=$1 name=$2 pid k
  [ -f "$f" ] || return 0
  if alive "$f" "$name"; then
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null || true
    for ((k = 0; k < 100; k++)); do alive "$f" "$name" || break; sleep 0.1; done
    if alive "$f" "$name"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$f"
}

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"; }

missing_pkgs() {
  local p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

cmd_install() {
  need_root
  mkdir -p "$LOG"
  install_pkgs
  build_image
  # The stand-in runs one container here, so a host where podman cannot run fails now, with podman's words.
  RLC_SLURM_DIR=$D "$HERE/bin/apptainer" exec --no-home "$IMAGE/rootfs" /bin/true >"$LOG/container-check.log" 2>&1 ||
    die "podman cannot run the stand-in image here: $(tail -n 3 "$LOG/container-check.log")"
  log "containers run ($(elapsed))"
}

install_pkgs() {
  local missing policy_added=0 rc=0
  mapfile -t missing < <(missing_pkgs)
  if [ ${#missing[@]} -eq 0 ]; then log "packages present ($(elapsed))"; return 0; fi
  command -v apt-get >/dev/null || die "apt-get not found (the harness needs Debian/Ubuntu)"
  mkdir -p "$LOG"
  log "installing: ${missing[*]}"
  # The packages ship init.d scripts; a temporary policy-rc.d keeps postinst from starting them.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    policy_added=1
  fi
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      "${missing[@]}"; } >"$LOG/apt.log" 2>&1 || rc=$?
  [ "$policy_added" = 1 ] && rm -f /usr/sbin/policy-rc.d
  if [ "$rc" != 0 ]; then tail -n 20 "$LOG/apt.log" >&2; die "apt-get failed (rc=$rc), see $LOG/apt.log"; fi
  log "installed in $(elapsed)"
}

# The stand-in image: the host's own packages for bash, coreutils, procps (pkill), libstdc++ (Ray's
# binaries) and the host's python3, whatever they depend on, unpacked into $IMAGE/rootfs. A stamp of
# the package versions decides whether the cached image is current.
image_pkgs() {
  local py pkg
  py=$(readlink -f /usr/bin/python3) || return 1
  pkg=$(dpkg -S "$py" 2>/dev/null | head -n 1 | cut -d: -f1) || return 1
  [ -n "$pkg" ] || return 1
  echo bash coreutils procps libstdc++6 python3-minimal "$pkg" "lib${pkg%-minimal}-stdlib"
}

build_image() {
  local stamp new pkgs
  pkgs=$(image_pkgs) || die "/usr/bin/python3 is missing or not from a Debian package (the stand-in image carries it)"
  # shellcheck disable=SC2086 # a list of package names
  stamp=$(/usr/bin/python3 "$HERE/image_files.py" $pkgs | sha256sum | cut -c1-16) || die "cannot list the image's packages"
  if [ -f "$IMAGE/stamp" ] && [ "$(cat "$IMAGE/stamp")" = "$stamp" ] && [ -x "$IMAGE/rootfs/bin/bash" ]; then
    log "stand-in image current ($(elapsed))"
    return 0
  fi
  new=$IMAGE.new
  rm -rf "$new"
  mkdir -p "$new/rootfs"
  # shellcheck disable=SC2086
  /usr/bin/python3 "$HERE/image_files.py" --files $pkgs >"$new/files.txt" || die "cannot list the image's files"
  tar -C / --no-recursion -cf - -T "$new/files.txt" 2>"$new/tar.log" | tar -C "$new/rootfs" -xf - ||
    die "cannot copy the image's files, see $new/tar.log"
  (
    cd "$new/rootfs"
    mkdir -p proc sys dev run tmp var/tmp root workspace etc
    chmod 1777 tmp var/tmp
    printf 'root:x:0:0:root:/root:/bin/bash\n' >etc/passwd
    printf 'root:x:0:\n' >etc/group
    cp /etc/ld.so.conf etc/ 2>/dev/null || true
    cp -r /etc/ld.so.conf.d etc/ 2>/dev/null || true
  )
  ldconfig -r "$new/rootfs" 2>/dev/null || true
  echo "$stamp" >"$new/stamp"
  rm -rf "$IMAGE"
  mv "$new" "$IMAGE"
  log "stand-in image built in $IMAGE/rootfs ($(du -sm "$IMAGE/rootfs" | cut -f1) MB, $(elapsed))"
}

# remove_containers: the stand-in's containers still there (a step killed before it could stop its own)
remove_containers() {
  [ -x "$HERE/bin/apptainer" ] && command -v podman >/dev/null || return 0
  RLC_SLURM_DIR=$D "$HERE/bin/apptainer" --rlc-harness-cleanup || true
  rm -rf "${D:?}/ctmp"
}

write_conf() { # -> $ETC/slurm.conf.new, $ETC/gres.conf.new
  local nodes=$1 gpus=$2 gtype=$3 cpus=$4 mem=$5 parts=$6 host gres="" i p def files
  host=$(hostname -s 2>/dev/null || hostname)
  [ "$gpus" -gt 0 ] && gres="Gres=gpu:${gtype:+$gtype:}$gpus"
  {
    echo "# generated by rlc tests/harness/local_slurm.sh"
    cat <<EOF
ClusterName=rlclocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$RUN/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
TmpFS=$D/tmp/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=300
MessageTimeout=30
MinJobAge=3600
KillWait=10
EnforcePartLimits=ALL
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
EOF
    [ "$gpus" -gt 0 ] && echo "GresTypes=gpu"
    for ((i = 1; i <= nodes; i++)); do
      echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 100 + i))" \
        "CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem $gres State=UNKNOWN"
    done
    IFS=, read -ra plist <<<"$parts"
    for p in "${plist[@]}"; do
      def=NO; [ "$p" = "${plist[0]}" ] && def=YES
      echo "PartitionName=$p Nodes=ALL Default=$def MaxTime=INFINITE State=UP OverSubscribe=NO"
    done
  } >"$ETC/slurm.conf.new"
  {
    echo "# generated by rlc tests/harness/local_slurm.sh"
    echo "AutoDetect=off"
    if [ "$gpus" -gt 0 ]; then
      files=$D/dev/nvidia0
      [ "$gpus" -gt 1 ] && files="$D/dev/nvidia[0-$((gpus - 1))]"
      echo "Name=gpu${gtype:+ Type=$gtype} File=$files"
    fi
  } >"$ETC/gres.conf.new"
}

slurmd_pidfiles() { compgen -G "$RUN/slurmd-*.pid" || true; }

stop_slurm() { # cancel jobs, then stop slurmds and slurmctld (munged stays)
  local jobs f k
  if alive "$RUN/slurmctld.pid" slurmctld; then
    jobs=$(SLURM_CONF=$CONF timeout 5 squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      # shellcheck disable=SC2086 # a list of numeric job ids
      SLURM_CONF=$CONF timeout 10 scancel $jobs 2>/dev/null || true
      for ((k = 0; k < 150; k++)); do
        [ -z "$(SLURM_CONF=$CONF timeout 5 squeue -h -t R,CG -o %A 2>/dev/null)" ] && break
        sleep 0.1
      done
    fi
  fi
  for f in $(slurmd_pidfiles); do stop_pid "$f" slurmd; done
  stop_pid "$RUN/slurmctld.pid" slurmctld
}

start_munge() {
  alive "$RUN/munged.pid" munged && return 0
  install -d -m 700 "$D/munge"
  if [ ! -s "$D/munge/munge.key" ]; then
    head -c 1024 /dev/urandom >"$D/munge/munge.key"
    chmod 600 "$D/munge/munge.key"
  fi
  rm -f "$RUN/munge.socket" "$RUN/munge.socket.lock"
  munged --key-file="$D/munge/munge.key" --socket="$RUN/munge.socket" --pid-file="$RUN/munged.pid" \
    --log-file="$LOG/munged.log" --seed-file="$D/munge/munged.seed" </dev/null >>"$LOG/daemons.out" 2>&1 \
    || die "munged failed: $(tail -n 3 "$LOG/munged.log" 2>/dev/null)"
  munge -S "$RUN/munge.socket" -n </dev/null | unmunge -S "$RUN/munge.socket" >/dev/null \
    || die "munge self-test failed, see $LOG/munged.log"
}

wait_idle() { # nodes
  local want=$1 n=0 end=$(($(date +%s) + TIMEOUT))
  while [ "$(date +%s)" -lt "$end" ]; do
    n=$(SLURM_CONF=$CONF timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2=="idle"' | sort -u | wc -l || true)
    [ "$n" = "$want" ] && return 0
    sleep 0.2
  done
  log "only $n/$want nodes idle after ${TIMEOUT}s"
  SLURM_CONF=$CONF timeout 5 sinfo -N >&2 || true
  tail -n 15 "$LOG/slurmctld.log" >&2 || true
  return 1
}

cmd_start() {
  need_root
  local nodes=${NODES:-2} gpus=${GPUS_PER_NODE:-8} gtype=${GPU_TYPE:-} cpus=${CPUS_PER_NODE:-16}
  local mem=${MEM_PER_NODE_MB:-64000} parts=${PARTITIONS:-debug} i up=1 f
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive integer, got '$nodes'"
  [[ $gpus =~ ^[0-9]+$ ]] || die "GPUS_PER_NODE must be an integer, got '$gpus'"
  [[ $cpus =~ ^[1-9][0-9]*$ ]] || die "CPUS_PER_NODE must be a positive integer, got '$cpus'"
  [[ $mem =~ ^[1-9][0-9]*$ ]] || die "MEM_PER_NODE_MB must be a positive integer, got '$mem'"
  [[ $gtype =~ ^[A-Za-z0-9_-]*$ ]] || die "GPU_TYPE must be a GRES type name, got '$gtype'"
  [[ $parts =~ ^[A-Za-z0-9_-]+(,[A-Za-z0-9_-]+)*$ ]] || die "PARTITIONS must be a comma list, got '$parts'"
  [ -n "$(missing_pkgs)" ] && cmd_install
  mkdir -p "$ETC" "$RUN" "$LOG" "$D/state" "$D/spool" "$D/tmp" "$D/dev"
  write_conf "$nodes" "$gpus" "$gtype" "$cpus" "$mem" "$parts"

  cmp -s "$ETC/slurm.conf.new" "$CONF" && cmp -s "$ETC/gres.conf.new" "$ETC/gres.conf" || up=0
  alive "$RUN/munged.pid" munged && alive "$RUN/slurmctld.pid" slurmctld || up=0
  for ((i = 1; i <= nodes; i++)); do alive "$RUN/slurmd-node$i.pid" slurmd || up=0; done
  if [ "$up" = 1 ] && wait_idle "$nodes"; then
    summary "$nodes" "$gpus" "$gtype" "$cpus" "already up"
    return 0
  fi

  stop_slurm
  remove_containers
  for ((g = 0; g < gpus; g++)); do ln -sfn /dev/null "$D/dev/nvidia$g"; done
  rm -rf "${D:?}/state/"* "${D:?}/spool/"* "${D:?}/tmp/"*
  # Job ids restart at 1 with the fresh state: per-job temp dirs an earlier cluster's jobs left in
  # /tmp (rlc-<jobid>-<node>) would otherwise pass for this cluster's jobs of the same id.
  rm -rf /tmp/rlc-[0-9]*-[0-9]*
  rm -f "$LOG"/slurmctld.log "$LOG"/slurmd-*.log "$LOG/jobcomp.txt"
  for ((i = 1; i <= nodes; i++)); do mkdir -p "$D/tmp/node$i" "$D/spool/node$i"; done
  mv -f "$ETC/slurm.conf.new" "$CONF"
  mv -f "$ETC/gres.conf.new" "$ETC/gres.conf"
  start_munge
  slurmctld -f "$CONF" </dev/null >>"$LOG/daemons.out" 2>&1 || die "slurmctld failed, see $LOG/slurmctld.log"
  for ((i = 1; i <= nodes; i++)); do
    slurmd -f "$CONF" -N "node$i" </dev/null >>"$LOG/daemons.out" 2>&1 \
      || die "slurmd node$i failed, see $LOG/slurmd-node$i.log"
  done
  wait_idle "$nodes" || die "cluster did not come up, see $LOG"
  summary "$nodes" "$gpus" "$gtype" "$cpus" "started"
}

summary() {
  local ver
  ver=$(SLURM_CONF=$CONF sinfo -V 2>/dev/null | awk '{print $2}')
  echo "local-slurm: SLURM $ver $5 in $(elapsed): $1 node(s) node[1-$1], gpu:${3:+$3:}$2/node," \
    "$4 cpus/node, SLURM_CONF=$CONF"
}

cmd_stop() {
  local f
  stop_slurm
  remove_containers
  for f in $(slurmd_pidfiles); do stop_pid "$f" slurmd; done
  stop_pid "$RUN/munged.pid" munged
  log "stopped in $(elapsed)"
}

cmd_status() {
  alive "$RUN/slurmctld.pid" slurmctld || { echo "local-slurm: down"; return 1; }
  SLURM_CONF=$CONF sinfo -N -o '%N %t %c %m %G'
}

case ${1:-} in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
