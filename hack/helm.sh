#!/usr/bin/env bash
# Prints the path of the helm binary the chart is rendered and linted with,
# building it once from the Go module proxy into target/tools/ (with the
# machine's normal GOMODCACHE/GOCACHE). Nothing has to be installed by hand
# beyond Go. The build output goes to stderr; stdout is only the path.
#
#   HELM_VERSION  the helm module version (default below); a v3.x version
#                 builds helm.sh/helm/v3 instead (the chart works with both,
#                 but deploy/ is rendered by the default one: helm v4 puts a
#                 blank line before each `---`)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${HELM_VERSION:-v4.3.2}"
module="helm.sh/helm/v${version:1:1}"
tools="$root/target/tools"
bin="$tools/helm"

built_version() {
  [[ -x "$bin" ]] || return 0
  go version -m "$bin" 2>/dev/null | awk -v m="$module" '$1 == "mod" && $2 == m { print $3 }'
}

if [[ "$(built_version)" != "$version" ]]; then
  mkdir -p "$tools"
  # Serialise concurrent callers (tests run in parallel).
  exec 9>"$tools/.helm.lock"
  flock 9
  if [[ "$(built_version)" != "$version" ]]; then
    echo "hack/helm.sh: building helm $version (go install $module/cmd/helm@$version)" >&2
    start=$SECONDS
    tmp="$(mktemp -d "$tools/.helm.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    # The version stamp helm's own Makefile sets, so `helm version` is right.
    ldflags="-s -w -X $module/internal/version.version=$version"
    if [[ "$module" == helm.sh/helm/v3 ]]; then
      # helm v3 takes its default Kubernetes version (`helm template`,
      # `helm lint`) from ldflags, else v1.20; its Makefile derives it from
      # the client-go it builds with.
      gomod="$(go mod download -json "$module@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
      minor="$(awk '$1 == "k8s.io/client-go" { split($2, v, "."); print v[2] }' "$gomod")"
      for pkg in pkg/chartutil pkg/lint/rules; do
        ldflags+=" -X $module/$pkg.k8sVersionMajor=1 -X $module/$pkg.k8sVersionMinor=$minor"
      done
    fi
    CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
      go install -ldflags "$ldflags" "$module/cmd/helm@$version" >&2
    mv -f "$tmp/helm" "$bin"
    echo "hack/helm.sh: built $bin in $((SECONDS - start))s" >&2
  fi
fi
echo "$bin"
