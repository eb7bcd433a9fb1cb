#!/usr/bin/env bash
# Prints the path of the kube-score binary the rendered manifests are linted
# with (e2e/tests/lint_manifests.rs), building it once from the Go module
# proxy into target/tools/ (with the machine's normal GOMODCACHE/GOCACHE).
# Nothing has to be installed by hand beyond Go. The build output goes to
# stderr; stdout is only the path.
#
#   KUBE_SCORE_VERSION  the github.com/zegl/kube-score module version
#                       (default below)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${KUBE_SCORE_VERSION:-v1.20.0}"
module="github.com/zegl/kube-score"
tools="$root/target/tools"
bin="$tools/kube-score"

built_version() {
  [[ -x "$bin" ]] || return 0
  go version -m "$bin" 2>/dev/null | awk -v m="$module" '$1 == "mod" && $2 == m { print $3 }'
}

if [[ "$(built_version)" != "$version" ]]; then
  mkdir -p "$tools"
  # Serialise concurrent callers (tests run in parallel).
  exec 9>"$tools/.kube-score.lock"
  flock 9
  if [[ "$(built_version)" != "$version" ]]; then
    echo "hack/kube-score.sh: building kube-score $version (go install $module/cmd/kube-score@$version)" >&2
    start=$SECONDS
    tmp="$(mktemp -d "$tools/.kube-score.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    # The version stamp of kube-score's own release build (goreleaser), so
    # `kube-score version` names it.
    ldflags="-s -w -X main.version=${version#v}"
    CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
      go install -ldflags "$ldflags" "$module/cmd/kube-score@$version" >&2
    mv -f "$tmp/kube-score" "$bin"
    echo "hack/kube-score.sh: built $bin in $((SECONDS - start))s" >&2
  fi
fi
echo "$bin"
