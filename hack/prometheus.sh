#!/usr/bin/env bash
# Prints the path of the Prometheus binaries the chart's alerts are checked
# with, building them once from the Go module proxy into target/tools/ (with
# the machine's normal GOMODCACHE/GOCACHE). Nothing has to be installed by
# hand beyond Go. The build output goes to stderr; stdout is only the path.
#
#   hack/prometheus.sh promtool     builds promtool, prints its path
#   hack/prometheus.sh prometheus   builds prometheus, prints its path
#   hack/prometheus.sh              builds both, prints their directory
#
#   PROMETHEUS_VERSION  the github.com/prometheus/prometheus module version
#                       (default below; module v0.3MM.P is release v3.MM.P)
#
# prometheus is built without the `builtinassets` tag of Prometheus's own
# build: the web UI is compiled by npm and is not in the module, so the
# binary serves the API but its UI pages are empty.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${PROMETHEUS_VERSION:-v0.316.0}"
module="github.com/prometheus/prometheus"
tools="$root/target/tools"

case "${1:-}" in
  promtool | prometheus) binaries=("$1") ;;
  "") binaries=(promtool prometheus) ;;
  *)
    echo "usage: hack/prometheus.sh [promtool|prometheus]" >&2
    exit 2
    ;;
esac

built_version() {
  [[ -x "$tools/$1" ]] || return 0
  go version -m "$tools/$1" 2>/dev/null | awk -v m="$module" '$1 == "mod" && $2 == m { print $3 }'
}

stale() {
  local binary
  for binary in "${binaries[@]}"; do
    [[ "$(built_version "$binary")" == "$version" ]] || echo "$binary"
  done
}

if [[ -n "$(stale)" ]]; then
  mkdir -p "$tools"
  # Serialise concurrent callers (tests run in parallel).
  exec 9>"$tools/.prometheus.lock"
  flock 9
  mapfile -t missing < <(stale)
  if ((${#missing[@]} > 0)); then
    packages=()
    for binary in "${missing[@]}"; do
      packages+=("$module/cmd/$binary@$version")
    done
    echo "hack/prometheus.sh: building ${missing[*]} $version (go install ${packages[*]})" >&2
    start=$SECONDS
    tmp="$(mktemp -d "$tools/.prometheus.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    # The version stamp of Prometheus's own build (.promu.yml), so
    # `--version` names the release; the module ships it in VERSION.
    dir="$(go mod download -json "$module@$version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
    release="$(cat "$dir/VERSION")"
    ldflags="-s -w -X github.com/prometheus/common/version.Version=$release"
    CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
      go install -ldflags "$ldflags" "${packages[@]}" >&2
    for binary in "${missing[@]}"; do
      mv -f "$tmp/$binary" "$tools/$binary"
    done
    echo "hack/prometheus.sh: built ${missing[*]} into $tools in $((SECONDS - start))s" >&2
  fi
fi

if ((${#binaries[@]} == 1)); then
  echo "$tools/${binaries[0]}"
else
  echo "$tools"
fi
