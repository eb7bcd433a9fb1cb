#!/usr/bin/env bash
# Builds bin/controlplane, bin/kubectl and bin/kubelet from the Kubernetes Go modules pinned
# in go.mod. Does nothing when the inputs' hash matches bin/.stamp.
# Uses the machine's normal GOMODCACHE/GOCACHE, so rebuilds are incremental.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
mkdir -p bin

# Serialise concurrent `make controlplane` runs.
exec 9>bin/.lock
flock 9

stamp="$({ sha256sum go.mod go.sum ./*.go build.sh; go env GOVERSION GOOS GOARCH; } | sha256sum | cut -d' ' -f1)"
if [[ -x bin/controlplane && -x bin/kubectl && -x bin/kubelet && "$(cat bin/.stamp 2>/dev/null)" == "$stamp" ]]; then
  echo "build.sh: bin/controlplane, bin/kubectl and bin/kubelet are up to date"
  exit 0
fi

# Version stamping as in kubernetes' hack/lib/version.sh, so /version and
# `kubectl version` report the real release instead of v0.0.0-master.
read -r k8s_version build_date < <(go list -m -f '{{.Version}} {{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
IFS=. read -r major minor _ <<<"${k8s_version#v}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X ${pkg}.gitVersion=${k8s_version}"
  ldflags+=" -X ${pkg}.gitMajor=${major} -X ${pkg}.gitMinor=${minor}"
  ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.gitCommit="
  ldflags+=" -X ${pkg}.buildDate=${build_date}"
done

echo "build.sh: building controlplane, kubectl and kubelet ${k8s_version} (first build takes several minutes)"
start=$SECONDS
tmp="$(mktemp -d bin/.build.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
# Build into a temp dir and rename, so a running controlplane is never
# overwritten in place.
CGO_ENABLED=0 go build -buildvcs=false -ldflags "$ldflags" -o "$tmp/" . k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubelet
mv -f "$tmp/controlplane" "$tmp/kubectl" "$tmp/kubelet" bin/
echo "$stamp" >bin/.stamp
echo "build.sh: done in $((SECONDS - start))s: $(bin/controlplane version)"
