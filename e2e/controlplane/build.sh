#!/usr/bin/env bash
# Usage: build.sh [k8s-MINOR]
# Builds bin/controlplane, bin/kubectl and bin/kubelet from the Kubernetes Go modules pinned
# in go.mod, and the node's container runtime (bin/containerd, bin/containerd-shim-runc-v2,
# bin/ctr) from the containerd module pinned in ../containerd/go.mod.
# With a module directory (k8s-1.33: go.mod and go.sum written by gen-replace.sh), builds
# bin-1.33/controlplane and bin-1.33/kubectl from the same sources against that release:
# the control plane of `make test-oldest-k8s` (no node: the kubelet is never older there).
# Does nothing when the inputs' hash matches the output directory's .stamp.
# Uses the machine's normal GOMODCACHE/GOCACHE, so rebuilds are incremental.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

module_dir="${1:-.}"
module_dir="${module_dir%/}"
if [[ "$module_dir" == . ]]; then
  out=bin
  binaries=(controlplane kubectl kubelet containerd containerd-shim-runc-v2 ctr)
  inputs=(go.mod go.sum ../containerd/go.mod ../containerd/go.sum)
elif [[ "$module_dir" =~ ^k8s-([0-9]+\.[0-9]+)$ && -f "$module_dir/go.mod" ]]; then
  out="bin-${BASH_REMATCH[1]}"
  binaries=(controlplane kubectl)
  inputs=("$module_dir/go.mod" "$module_dir/go.sum")
else
  echo "build.sh: '$module_dir' is not a k8s-MINOR directory with a go.mod (see gen-replace.sh)" >&2
  exit 1
fi
mkdir -p "$out"

# Serialise concurrent builds of one output directory.
exec 9>"$out/.lock"
flock 9

stamp="$({ sha256sum "${inputs[@]}" ./*.go build.sh; go env GOVERSION GOOS GOARCH; } | sha256sum | cut -d' ' -f1)"
built=1
for b in "${binaries[@]}"; do [[ -x "$out/$b" ]] || built=0; done
if [[ $built == 1 && "$(cat "$out/.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "build.sh: $out/{${binaries[*]}} are up to date" | tr ' ' ,
  exit 0
fi

# Version stamping as in kubernetes' hack/lib/version.sh, so /version and
# `kubectl version` report the real release instead of v0.0.0-master.
read -r k8s_version build_date < <(cd "$module_dir" && go list -m -f '{{.Version}} {{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
IFS=. read -r major minor _ <<<"${k8s_version#v}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X ${pkg}.gitVersion=${k8s_version}"
  ldflags+=" -X ${pkg}.gitMajor=${major} -X ${pkg}.gitMinor=${minor}"
  ldflags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.gitCommit="
  ldflags+=" -X ${pkg}.buildDate=${build_date}"
done

tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
# Build into a temp dir and rename, so a running controlplane is never
# overwritten in place.
if [[ "$module_dir" == . ]]; then
  echo "build.sh: building controlplane, kubectl and kubelet ${k8s_version} (first build takes several minutes)"
  CGO_ENABLED=0 go build -buildvcs=false -ldflags "$ldflags" -o "$tmp/" . k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubelet

  # containerd 2.x, static (no cgo: no btrfs, devmapper or zfs snapshotter; the
  # node uses overlayfs), stamped with its module version as its Makefile does.
  ctr_version="$(cd ../containerd && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)"
  (cd ../containerd && CGO_ENABLED=0 go build -buildvcs=false -tags "no_btrfs no_devmapper no_zfs" \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${ctr_version}" -o "$OLDPWD/$tmp/" \
    github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr)
else
  echo "build.sh: building controlplane and kubectl ${k8s_version} into $out (first build takes several minutes)"
  # The same sources, resolved against the older release's modules.
  mkdir "$tmp/src"
  cp ./*.go "$module_dir/go.mod" "$module_dir/go.sum" "$tmp/src/"
  (cd "$tmp/src" && CGO_ENABLED=0 go build -buildvcs=false -ldflags "$ldflags" -o "$OLDPWD/$tmp/" . k8s.io/kubernetes/cmd/kubectl)
fi
for b in "${binaries[@]}"; do mv -f "$tmp/$b" "$out/"; done
echo "$stamp" >"$out/.stamp"
if [[ "$module_dir" == . ]]; then
  echo "build.sh: done in $((SECONDS - start))s: $(bin/controlplane version), containerd $(bin/containerd --version | cut -d' ' -f3)"
else
  echo "build.sh: done in $((SECONDS - start))s: $("$out/controlplane" version)"
fi
