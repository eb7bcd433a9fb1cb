#!/bin/bash
# Measures, on the test node (controlplane up --node), how long a kubelet
# restart through the node's systemd takes until the Node reports the new
# hugepages-2Mi capacity: three grows of 32 pages with memoryManagerPolicy
# None and with Static (the checkpoint removed first, as the agent does).
# Needs root, `make controlplane images`; holds the real-kernel lock and
# restores vm.nr_hugepages. docs/design.md quotes its output.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=$repo/e2e/controlplane/bin
exec 9>"${TMPDIR:-/tmp}/hugepool-real-kernel.lock"
flock 9
saved=$(cat /proc/sys/vm/nr_hugepages)
trap 'echo "$saved" > /proc/sys/vm/nr_hugepages' EXIT
for policy in None Static; do
    dir=$(mktemp -d)
    echo 0 > /proc/sys/vm/nr_hugepages
    "$bin/controlplane" up --node --memory-manager="$policy" --data-dir "$dir" \
        --images "$repo/target/images" > "$dir/up.log" 2>&1 &
    up=$!
    until [ -e "$dir/ready" ]; do
        kill -0 "$up" 2>/dev/null || { tail -20 "$dir/up.log"; exit 1; }
        sleep 0.2
    done
    capacity() {
        "$bin/kubectl" --kubeconfig "$dir/kubeconfig" get node vm \
            -o jsonpath='{.status.capacity.hugepages-2Mi}'
    }
    for pages in 32 64 96; do
        echo "$pages" > /proc/sys/vm/nr_hugepages
        start=$(date +%s%N)
        [ "$policy" = Static ] && rm -f "$dir/node/kubelet/memory_manager_state"
        "$dir/node/systemctl" restart kubelet
        until [ "$(capacity)" = "$((pages * 2))Mi" ]; do sleep 0.05; done
        echo "$policy: grow to $pages pages, restart to capacity $(( ($(date +%s%N) - start) / 1000000 )) ms"
    done
    kill "$up"
    wait "$up" || true
    rm -rf "$dir"
done
