#!/usr/bin/env bash
# `make demo`: hugepool as users run it, on a one-node cluster of this
# machine. Builds what it needs (the control plane and kubelet, the images,
# helm), starts a real control plane with a real kubelet and containerd
# (`controlplane up --node`), installs charts/hugepool with `helm install`
# from the local images, applies examples/pool-2mi.yaml and shows it
# converge on this machine's kernel, what `kubectl hugepool status` and
# `why NODE` say of it, and what `kubectl hugepool plan` predicts of a
# larger pool from the agent's estimate; then deletes the pool (Release: the pages go back),
# uninstalls the chart and stops everything. Root only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dir="$root/target/demo"
kubectl="$root/e2e/controlplane/bin/kubectl"
# kubectl-hugepool, built by hack/images.sh beside the images' binaries.
plugin_dir="$root/target/$(uname -m)-unknown-linux-musl/release"
sysfs=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
start=$SECONDS

say() { printf '\n\033[1m== [%4ss] %s\033[0m\n' "$((SECONDS - start))" "$*"; }
[[ $(id -u) == 0 ]] || { echo "demo: containerd, the kubelet and the agent need root" >&2; exit 1; }

say "building the control plane, kubelet and kubectl v1.37.2 (first run: several minutes)"
bash e2e/controlplane/build.sh
say "building the images (make images: static binaries, nothing pulled)"
bash hack/images.sh
say "building helm"
helm="$(bash hack/helm.sh)"

# Real-kernel tests take this lock too: never write the pools at the same time.
exec 8>"${TMPDIR:-/tmp}/hugepool-real-kernel.lock"
flock 8

cp_pid=""
original="$(cat "$sysfs")"
cleanup() {
  [[ -n "$cp_pid" ]] && kill -TERM "$cp_pid" 2>/dev/null && wait "$cp_pid" 2>/dev/null
  echo "$original" >"$sysfs" 2>/dev/null || true
}
trap cleanup EXIT

say "starting a control plane and a node on this machine (containerd, runc, kubelet) in $dir"
# A demo that was killed may have left pod volumes mounted under $dir.
awk -v d="$dir/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l
rm -rf "$dir" && mkdir -p "$dir"
e2e/controlplane/bin/controlplane up --data-dir "$dir/cp" --node --images target/images >"$dir/controlplane.log" 2>&1 &
cp_pid=$!
until [[ -f "$dir/cp/ready" ]]; do
  kill -0 "$cp_pid" 2>/dev/null || { tail -n 30 "$dir/controlplane.log"; exit 1; }
  sleep 0.2
done
sed -n 's/^controlplane: /  /p' "$dir/controlplane.log"
export KUBECONFIG="$dir/cp/kubeconfig"
node="$("$kubectl" get nodes -o jsonpath='{.items[0].metadata.name}')"
IFS=: read -r api_host api_port <"$dir/cp/pod-apiserver"

say "helm install hugepool charts/hugepool (images ghcr.io/hugepool-dev/hugepool-{operator,agent}:$(sed -n 's/^appVersion: "\(.*\)"/\1/p' charts/hugepool/Chart.yaml))"
"$helm" install hugepool charts/hugepool --namespace hugepool-system --create-namespace \
  --set apiServer.host="$api_host" --set apiServer.port="$api_port" \
  --set agent.kubeletRestart.enabled=true \
  --set agent.kubeletRestart.rootDir="$dir/cp/node/kubelet" \
  --wait --timeout 5m >/dev/null
"$kubectl" get pods -n hugepool-system -o wide

say "kernel before: $(cat "$sysfs") x 2Mi pages; labelling node $node and applying examples/pool-2mi.yaml"
"$kubectl" label node "$node" hugepool.dev/demo=true >/dev/null
"$kubectl" apply -f examples/pool-2mi.yaml
"$kubectl" wait --for=condition=Available hugepagepool/demo-2mi --timeout=300s || {
  "$kubectl" get hpp,hpn -o wide
  exit 1
}

say "converged"
"$kubectl" get hugepagepools
"$kubectl" get hugepagenodes
echo "kernel now: $(cat "$sysfs") x 2Mi pages (written by the agent in its container)"
echo "kubelet capacity: $("$kubectl" get node "$node" -o jsonpath='{.status.capacity.hugepages-2Mi}') of hugepages-2Mi (the agent restarted the kubelet)"
"$kubectl" get hugepagenode "$node" -o jsonpath='{range .status.conditions[*]}{.type}={.status} ({.reason}): {.message}{"\n"}{end}'
echo "last resize: $("$kubectl" get hugepagenode "$node" -o jsonpath='{.status.pageSizes[0].lastResize}')"

say "kubectl hugepool status; kubectl hugepool why $node (the plugin, on PATH from $plugin_dir)"
PATH="$plugin_dir:$PATH" "$kubectl" hugepool status
echo
PATH="$plugin_dir:$PATH" "$kubectl" hugepool why "$node"

say "know before you grow: what a grow of 2Mi pages can get on $node, and kubectl hugepool plan of the pool at 4096 pages"
echo "the agent's estimate from the kernel's free lists: $("$kubectl" get hugepagenode "$node" -o jsonpath='{.status.pageSizes[?(@.size=="2Mi")].obtainable}')"
sed 's/^  pages: 256$/  pages: 4096/' examples/pool-2mi.yaml | PATH="$plugin_dir:$PATH" "$kubectl" hugepool plan -f -

say "deleting the pool (deletionPolicy Release: the operator shrinks the node to 0 first)"
"$kubectl" delete -f examples/pool-2mi.yaml --wait=true --timeout=300s
echo "kernel after: $(cat "$sysfs") x 2Mi pages"
say "helm uninstall"
"$helm" uninstall hugepool --namespace hugepool-system --wait --timeout 2m >/dev/null
say "done in $((SECONDS - start))s; stopping (logs in $dir)"
