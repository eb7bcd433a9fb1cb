#!/usr/bin/env bash
# Runs a command with one real control plane shared by every e2e test binary:
# starts `controlplane up` in a fresh directory, waits for it to be ready,
# exports HUGEPOOL_E2E_KUBECONFIG, runs "$@", then stops the control plane.
# HUGEPOOL_CONTROLPLANE_BIN names another build (e2e/controlplane/bin-1.33);
# the tests' own control planes come from the same directory.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${HUGEPOOL_CONTROLPLANE_BIN:-$root/e2e/controlplane/bin}/controlplane"
dir="$root/target/e2e/shared"
[[ -x "$bin" ]] || { echo "with-controlplane: $bin missing: run 'make controlplane'" >&2; exit 1; }

rm -rf "$dir"
mkdir -p "$dir"
"$bin" up --data-dir "$dir" >"$dir/up.log" 2>&1 &
cp_pid=$!
stop() {
  kill -TERM "$cp_pid" 2>/dev/null || true
  wait "$cp_pid" 2>/dev/null || true
}
trap stop EXIT

start=$SECONDS
until [[ -f "$dir/ready" ]]; do
  if ! kill -0 "$cp_pid" 2>/dev/null || (( SECONDS - start > 180 )); then
    echo "with-controlplane: control plane failed to start; see $dir/up.log:" >&2
    tail -n 30 "$dir/up.log" >&2
    exit 1
  fi
  sleep 0.2
done
echo "with-controlplane: ready in $((SECONDS - start))s ($dir/kubeconfig)"
export HUGEPOOL_E2E_KUBECONFIG="$dir/kubeconfig"
"$@"
