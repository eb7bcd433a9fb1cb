#!/usr/bin/env bash
# `make demo`: a local control plane, the operator and an agent on this
# machine's real kernel. Applies examples/pool-2mi.yaml, waits for it to
# converge, shows what the cluster and the kernel report, then deletes the
# pool (Release: the pages go back) and stops everything.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dir="$root/target/demo"
bin="$root/target/debug"
kubectl="$root/e2e/controlplane/bin/kubectl"
sysfs=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
node="$(hostname | tr '[:upper:]_' '[:lower:]-')"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
[[ $(id -u) == 0 ]] || { echo "demo: the agent writes the kernel's hugetlb pools: run as root" >&2; exit 1; }

say "building (first run: several minutes)"
bash e2e/controlplane/build.sh
cargo build -q -p hugepool-agent -p hugepool-operator -p hugepool-crds

# Real-kernel tests take this lock too: never write the pools at the same time.
exec 8>"${TMPDIR:-/tmp}/hugepool-real-kernel.lock"
flock 8

pids=()
original="$(cat "$sysfs")"
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "$original" >"$sysfs" 2>/dev/null || true
}
trap cleanup EXIT

say "starting a control plane (kube-apiserver, etcd, controller-manager v1.37.2) in $dir"
rm -rf "$dir" && mkdir -p "$dir"
e2e/controlplane/bin/controlplane up --data-dir "$dir/cp" >"$dir/controlplane.log" 2>&1 &
pids+=($!)
until [[ -f "$dir/cp/ready" ]]; do sleep 0.2; done
export KUBECONFIG="$dir/cp/kubeconfig"

say "installing the CRDs; this machine joins as Node $node"
"$kubectl" apply -f crds/ >/dev/null
"$kubectl" wait --for=condition=Established crd --all --timeout=60s >/dev/null
"$kubectl" create namespace hugepool-system >/dev/null
"$kubectl" create -f - >/dev/null <<YAML
apiVersion: v1
kind: Node
metadata: {name: $node, labels: {hugepool.dev/demo: "true"}}
YAML

say "starting the operator and the node agent (logs in $dir)"
RUST_LOG="${RUST_LOG:-info,kube_runtime=debug}" "$bin/hugepool-operator" run --listen 127.0.0.1:18080 >"$dir/operator.log" 2>&1 &
pids+=($!)
NODE_NAME="$node" "$bin/hugepool-agent" run --metrics-addr 127.0.0.1:19478 >"$dir/agent.log" 2>&1 &
pids+=($!)

show_logs() {
  for log in operator agent; do echo "--- last lines of $dir/$log.log"; tail -n 15 "$dir/$log.log"; done
}
for _ in $(seq 300); do
  curl -sf http://127.0.0.1:18080/readyz >/dev/null 2>&1 && break
  sleep 0.2
done

say "kernel before: $(cat "$sysfs") x 2Mi pages; applying examples/pool-2mi.yaml"
"$kubectl" apply -f examples/pool-2mi.yaml
"$kubectl" wait --for=condition=Available hugepagepool/demo-2mi --timeout=120s || { show_logs; exit 1; }

say "converged"
"$kubectl" get hugepagepools
"$kubectl" get hugepagenodes
echo "kernel now: $(cat "$sysfs") x 2Mi pages"
"$kubectl" get hugepagenode "$node" -o jsonpath='{range .status.conditions[*]}{.type}={.status} ({.reason}): {.message}{"\n"}{end}'
echo "last resize: $("$kubectl" get hugepagenode "$node" -o jsonpath='{.status.pageSizes[0].lastResize}')"
say "agent metrics"
curl -s http://127.0.0.1:19478/metrics | grep -E '^hugepool_(pages\{size="2Mi",numa="all"|resize_pages_total|mem_available)' || true

say "deleting the pool (deletionPolicy Release: the operator shrinks the node to 0 first)"
"$kubectl" delete -f examples/pool-2mi.yaml --wait=true --timeout=120s
echo "kernel after: $(cat "$sysfs") x 2Mi pages"
say "done; stopping"
