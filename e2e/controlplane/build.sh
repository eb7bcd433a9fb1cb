#!/usr/bin/env bash
# Builds bin/controlplane, bin/kubectl and bin/kubelet from the Kubernetes Go modules pinned
# in go.mod, and the node's container runtime (bin/containerd, bin/containerd-shim-runc-v2,
# bin/ctr) from the containerd module pinned in ../containerd/go.mod. Does nothing when the
# inputs' hash matches bin/.stamp.
# Uses the machine's normal GOMODCACHE/GOCACHE, so rebuilds are incremental.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
mkdir -p bin

# Serialise concurrent `make controlplane` runs.
exec 9>bin/.lock
flock 9

binaries=(controlplane kubectl kubelet containerd containerd-shim-runc-v2 ctr)
stamp="$({ sha256sum go.mod go.sum ./*.go build.sh ../containerd/go.mod ../containerd/go.sum; go env GOVERSION GOOS GOARCH; } | sha256sum | cut -d' ' -f1)"
built=1
for b in "${binaries[@]}"; do [[ -x "bin/$b" ]] || built=0; done
if [[ $built == 1 && "$(cat bin/.stamp 2>/dev/null)" == "$stamp" ]]; then
  echo "build.sh: bin/{${binaries[*]}} are up to date" | tr ' ' ,
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

# containerd 2.x, static (no cgo: no btrfs, devmapper or zfs snapshotter; the
# node uses overlayfs), stamped with its module version as its Makefile does.
ctr_version="$(cd ../containerd && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)"
(cd ../containerd && CGO_ENABLED=0 go build -buildvcs=false -tags "no_btrfs no_devmapper no_zfs" \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${ctr_version}" -o "$OLDPWD/$tmp/" \
  github.com/containerd/containerd/v2/cmd/containerd \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
  github.com/containerd/containerd/v2/cmd/ctr)
for b in "${binaries[@]}"; do mv -f "$tmp/$b" bin/; done
echo "$stamp" >bin/.stamp
echo "build.sh: done in $((SECONDS - start))s: $(bin/controlplane version), containerd $(bin/containerd --version | cut -d' ' -f3)"
