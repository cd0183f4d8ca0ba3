#!/usr/bin/env bash
# up.sh - a real one-node Kubernetes for the e2e scenarios (etcd, kube-apiserver, controller-manager,
# scheduler, containerd + runc + the CNI bridge, kubelet, kube-proxy) in its own network AND mount
# namespace, so the host's network, mounts, sysctls and cgroups are left as they are. Adapted from the
# spike in the research notes (real-node-recipe.md), where each step's why is written down.
#
#   keeper   `unshare --net --mount --propagation private sleep infinity`: holds both namespaces;
#            every daemon is started with `nsenter -t KEEPER -n -m` (no pid/cgroup namespace).
#   mounts   (inside the private mount ns only; they vanish with it)
#            tmpfs on /run                   shim sockets, runc state, pod netns handles
#            overlay on /var/lib, /var/log   CNI cache, /var/log/containers
#            files over 3 /proc/sys knobs    the kubelet would otherwise WRITE the host's
#   network  veth: host $VETH 10.250.0.1/30 <-> ns eth0 10.250.0.2/30 (node IP, apiserver :6443);
#            bridge cni0 10.244.0.0/24 in the ns (pods); services 10.96.0.0/16; host routes to both
#            via the node IP (they go with the veth)
#   DNS      CoreDNS (kubernetes plugin) on the node IP, the kubelet's clusterDNS: Service names
#            such as a pool's redis://NAME-kvpool-redis-0.NAME-kvpool-redis.NS.svc resolve in pods
#   cgroups  kubelet cgroupRoot /$CG_ROOT (made here in every v1 hierarchy; removed by down.sh)
#
# Env: NODE_RUN (state dir, required), BIN_K8S (control plane), BIN_NODE (kubelet, kube-proxy),
#      KUBECTL, IMAGES (docker-archive tars to import into containerd, space-separated; the first
#      must hold the sandbox image localhost/kvpool/pause:1).
# Needs root, containerd, runc, containernetworking-plugins, iptables.
# Writes $NODE_RUN/kubeconfig (https://10.250.0.2:6443) and $NODE_RUN/pids (down.sh stops them).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${NODE_RUN:?NODE_RUN: the node state directory}
REPO=$(cd "$HERE/../.." && pwd)
BIN_K8S=${BIN_K8S:-$REPO/.tools/k8s/bin}
BIN_NODE=${BIN_NODE:-$REPO/.tools/k8s/node/bin}
KUBECTL=${KUBECTL:-$REPO/.tools/bin/kubectl}
NODE=kvpool-node VETH=kvnode0
HOST_IP=10.250.0.1 NODE_IP=10.250.0.2
POD_CIDR=10.244.0.0/24 SVC_CIDR=10.96.0.0/16
CG_ROOT=kvpool-node
NICE=(nice -n 19)
T0=$(date +%s.%N)
t() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN { printf "[up %6.2fs] %s\n", b - a, m }' >&2; }
die() { t "ERROR: $*"; exit 1; }

[ -e "$RUN/pids" ] && die "$RUN/pids exists: run down.sh first"
rm -rf "$RUN"; mkdir -p "$RUN"/{pki,logs,etcd,containerd,kubelet,pod-logs,cni/net.d,cni/ipam,sysctl,ovl}
: >"$RUN/pids"
# start NAME CMD...: run CMD inside the namespaces, niced, logging to logs/NAME.log; record its pid
start() {
    local name=$1; shift
    nsenter -t "$KEEP" -n -m --wd="$RUN" -- "${NICE[@]}" "$@" </dev/null >"$RUN/logs/$name.log" 2>&1 &
    echo "$name $!" >>"$RUN/pids"
}
inns() { nsenter -t "$KEEP" -n -m --wd="$RUN" -- "$@"; }
wait_for() { # wait_for SECONDS WHAT CMD...
    local until=$(( $(date +%s) + $1 )) what=$2; shift 2
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$until" ] || die "timed out waiting for $what"
        sleep 0.2
    done
}

# ---- 1. namespaces, mounts, network ------------------------------------------------------------------
unshare --net --mount --propagation private sleep infinity </dev/null >/dev/null 2>&1 &
KEEP=$!
echo "keeper $KEEP" >>"$RUN/pids"
# never nsenter before the keeper has its own namespaces (that would mount over the HOST's /run)
for _ in $(seq 100); do
    [ "$(readlink /proc/$KEEP/ns/net)" != "$(readlink /proc/self/ns/net)" ] &&
        [ "$(readlink /proc/$KEEP/ns/mnt)" != "$(readlink /proc/self/ns/mnt)" ] && break
    sleep 0.05
done
[ "$(readlink /proc/$KEEP/ns/mnt)" != "$(readlink /proc/self/ns/mnt)" ] || die "keeper has no namespaces of its own"
echo 1 >"$RUN/sysctl/overcommit_memory"; echo 10 >"$RUN/sysctl/panic"; echo 1 >"$RUN/sysctl/panic_on_oops"
mkdir -p "$RUN"/ovl/{varlib,varlog}/{upper,work}
inns sh -euc "
    mount -t tmpfs -o mode=755,size=256m kvpool-node-run /run
    mount -t overlay kvpool-node-varlib -o lowerdir=/var/lib,upperdir=$RUN/ovl/varlib/upper,workdir=$RUN/ovl/varlib/work /var/lib
    mount -t overlay kvpool-node-varlog -o lowerdir=/var/log,upperdir=$RUN/ovl/varlog/upper,workdir=$RUN/ovl/varlog/work /var/log
    mount --bind $RUN/sysctl/overcommit_memory /proc/sys/vm/overcommit_memory
    mount --bind $RUN/sysctl/panic /proc/sys/kernel/panic
    mount --bind $RUN/sysctl/panic_on_oops /proc/sys/kernel/panic_on_oops
    ip link set lo up
"
ip link add $VETH type veth peer name eth0 netns "$KEEP"
ip addr add $HOST_IP/30 dev $VETH; ip link set $VETH up
ip route add $POD_CIDR via $NODE_IP dev $VETH; ip route add $SVC_CIDR via $NODE_IP dev $VETH
inns sh -euc "
    ip addr add $NODE_IP/30 dev eth0; ip link set eth0 up
    ip route add default via $HOST_IP
    sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.ipv4.ip_forward=1
"
for c in /sys/fs/cgroup/*/; do
    case $c in */unified/) continue ;; esac
    mkdir -p "$c$CG_ROOT"
done
cp /sys/fs/cgroup/cpuset/cpuset.cpus /sys/fs/cgroup/cpuset/$CG_ROOT/cpuset.cpus
cp /sys/fs/cgroup/cpuset/cpuset.mems /sys/fs/cgroup/cpuset/$CG_ROOT/cpuset.mems
t "namespaces, mounts, veth, cgroup root ready (keeper pid $KEEP)"

# ---- 2. PKI (EC P-256: fast) ------------------------------------------------------------------------------
cd "$RUN/pki"
ossl() { openssl "$@" 2>/dev/null; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=kvpool-node-ca -keyout ca.key -out ca.crt
leaf() { # leaf NAME SUBJECT EXTENSIONS
    printf '%b\n' "$3" >"$1.ext"
    ossl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr"
    ossl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.crt"
}
leaf apiserver /CN=kube-apiserver "subjectAltName=IP:127.0.0.1,IP:$NODE_IP,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth"
leaf admin /O=system:masters/CN=kvpool-node-admin "extendedKeyUsage=clientAuth"
leaf kubelet "/O=system:nodes/CN=system:node:$NODE" "extendedKeyUsage=clientAuth"
leaf kubelet-serving "/CN=$NODE" "subjectAltName=IP:$NODE_IP,DNS:$NODE\nextendedKeyUsage=serverAuth"
leaf apiserver-kubelet-client /O=system:masters/CN=kube-apiserver-kubelet-client "extendedKeyUsage=clientAuth"
ossl ecparam -name prime256v1 -genkey -noout -out sa.key.ec && ossl pkcs8 -topk8 -nocrypt -in sa.key.ec -out sa.key
ossl ec -in sa.key -pubout -out sa.pub
kubeconfig() { # kubeconfig FILE SERVER CERTNAME
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: kvpool-node, cluster: {server: "$2", certificate-authority: $RUN/pki/ca.crt}}]
users: [{name: u, user: {client-certificate: $RUN/pki/$3.crt, client-key: $RUN/pki/$3.key}}]
contexts: [{name: kvpool-node, context: {cluster: kvpool-node, user: u}}]
current-context: kvpool-node
EOF
}
kubeconfig "$RUN/kubeconfig" "https://$NODE_IP:6443" admin          # host side (and in the ns)
kubeconfig "$RUN/admin-local.kubeconfig" "https://127.0.0.1:6443" admin
kubeconfig "$RUN/kubelet.kubeconfig" "https://127.0.0.1:6443" kubelet
cd "$RUN"
t "PKI and kubeconfigs"

# ---- 3. etcd + kube-apiserver, containerd in parallel --------------------------------------------------
start etcd "$BIN_K8S/etcd" --name node --data-dir "$RUN/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster node=http://127.0.0.1:2380 --unsafe-no-fsync --log-level warn

cat >"$RUN/containerd/config.toml" <<EOF
version = 2
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$RUN/containerd/containerd.sock"
[ttrpc]
  address = "$RUN/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$RUN/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/kvpool/pause:1"
  disable_apparmor = true
  restrict_oom_score_adj = true   # no CAP_SYS_RESOURCE here: runc cannot set the sandbox's -998
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "/usr/sbin/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$RUN/cni/net.d"
EOF
cat >"$RUN/cni/net.d/10-kvpool.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "kvpool-node", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$RUN/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOF
start containerd /usr/bin/containerd --config "$RUN/containerd/config.toml"

start kube-apiserver "$BIN_K8S/kube-apiserver" --etcd-servers http://127.0.0.1:2379 \
    --bind-address 0.0.0.0 --advertise-address $NODE_IP --secure-port 6443 \
    --tls-cert-file $RUN/pki/apiserver.crt --tls-private-key-file $RUN/pki/apiserver.key --client-ca-file $RUN/pki/ca.crt \
    --kubelet-client-certificate $RUN/pki/apiserver-kubelet-client.crt --kubelet-client-key $RUN/pki/apiserver-kubelet-client.key \
    --kubelet-certificate-authority $RUN/pki/ca.crt --kubelet-preferred-address-types InternalIP \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file $RUN/pki/sa.pub --service-account-signing-key-file $RUN/pki/sa.key \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --service-cluster-ip-range $SVC_CIDR --allow-privileged=true --profiling=false

# images: straight into containerd's k8s.io namespace, no registry
wait_for 30 containerd inns ctr -a "$RUN/containerd/containerd.sock" version
t "containerd up"
for i in ${IMAGES:-}; do
    inns ctr -a "$RUN/containerd/containerd.sock" -n k8s.io images import "$i" >/dev/null
done
t "images imported: $(inns ctr -a "$RUN/containerd/containerd.sock" -n k8s.io images ls -q | grep -c localhost/)"

K() { "$KUBECTL" --kubeconfig "$RUN/kubeconfig" "$@"; }
apiserver_ready() { [ "$(K get --raw /readyz 2>/dev/null)" = ok ]; }
node_ready() { [ "$(K get node $NODE -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]; }
wait_for 120 kube-apiserver apiserver_ready
t "kube-apiserver ready"

# ---- 4. controller-manager, scheduler, kubelet (+ kube-proxy) ---------------------------------------
start kube-controller-manager "$BIN_K8S/kube-controller-manager" --kubeconfig $RUN/admin-local.kubeconfig \
    --authentication-kubeconfig $RUN/admin-local.kubeconfig --authorization-kubeconfig $RUN/admin-local.kubeconfig \
    --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file $RUN/pki/sa.key --root-ca-file $RUN/pki/ca.crt \
    --cluster-signing-cert-file $RUN/pki/ca.crt --cluster-signing-key-file $RUN/pki/ca.key
start kube-scheduler "$BIN_K8S/kube-scheduler" --kubeconfig $RUN/admin-local.kubeconfig \
    --authentication-kubeconfig $RUN/admin-local.kubeconfig --authorization-kubeconfig $RUN/admin-local.kubeconfig \
    --bind-address 127.0.0.1 --leader-elect=false

cat >"$RUN/Corefile" <<EOF
.:53 {
    errors
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $RUN/admin-local.kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
start coredns "$BIN_NODE/coredns" -conf "$RUN/Corefile"

cat >"$RUN/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false              # 1.35 refuses cgroup v1 by default (KEP-5573)
cgroupDriver: cgroupfs           # containerd 1.6 has no RuntimeConfig RPC: kubelet falls back to this
cgroupRoot: /$CG_ROOT
failSwapOn: false
containerRuntimeEndpoint: unix://$RUN/containerd/containerd.sock
podLogsDirectory: $RUN/pod-logs
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
tlsCertFile: $RUN/pki/kubelet-serving.crt
tlsPrivateKeyFile: $RUN/pki/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $RUN/pki/ca.crt}
authorization: {mode: Webhook}
clusterDomain: cluster.local
clusterDNS: [$NODE_IP]
resolvConf: /etc/resolv.conf
serializeImagePulls: false
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusUpdateFrequency: 4s
EOF
start kubelet "$BIN_NODE/kubelet" --config "$RUN/kubelet/config.yaml" --kubeconfig "$RUN/kubelet.kubeconfig" \
    --root-dir "$RUN/kubelet" --hostname-override $NODE --node-ip $NODE_IP --v=2
if [ "${KUBE_PROXY:-1}" = 1 ]; then
    cat >"$RUN/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $RUN/admin-local.kubeconfig}
hostnameOverride: $NODE
clusterCIDR: $POD_CIDR
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
    start kube-proxy "$BIN_NODE/kube-proxy" --config "$RUN/kube-proxy.yaml"
fi

dns_ready() { inns bash -c 'exec 3<>/dev/tcp/127.0.0.1/8181 && printf "GET /ready HTTP/1.0\r\n\r\n" >&3 && grep -q "200 OK" <&3'; }
wait_for 60 "CoreDNS ready" dns_ready
t "CoreDNS ready"
wait_for 120 "node $NODE Ready" node_ready
t "node $NODE Ready"
wait_for 60 "default ServiceAccount" K -n default get serviceaccount default
t "default ServiceAccount exists (pods can be created)"
