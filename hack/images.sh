#!/usr/bin/env bash
# make images: builds hugepool's container images from this workspace without
# pulling anything, as OCI archives under target/images/:
#
#   hugepool-operator-VERSION.tar  ghcr.io/hugepool-dev/hugepool-operator:VERSION
#   hugepool-agent-VERSION.tar     ghcr.io/hugepool-dev/hugepool-agent:VERSION
#   hugepool-e2e-VERSION.tar       localhost/hugepool-e2e:VERSION (test node only:
#                                  pause and hugepage-holder)
#
# VERSION is the workspace crate version; the chart's appVersion must match
# (a test checks). Binaries are static (musl) and each image is one layer on
# an empty base: the operator holds its binary and CA certificates and runs as
# 65532; the agent adds busybox's static nsenter for kubelet restarts.
# Registries (HUGEPOOL_IMAGE_REGISTRY) other than the default only change the
# names written into the archives.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="$root/target/images"
registry="${HUGEPOOL_IMAGE_REGISTRY:-ghcr.io/hugepool-dev}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
arch="$(uname -m)"
case "$arch" in
  x86_64) oci_arch=amd64 ;;
  aarch64) oci_arch=arm64 ;;
  *) echo "images.sh: unsupported architecture $arch" >&2; exit 1 ;;
esac
target="$arch-unknown-linux-musl"
start=$SECONDS
say() { printf 'images.sh: %-58s %4ss\n' "$1" "$((SECONDS - start))"; }

# Tools, installed when missing (Debian packages; the musl std from rustup).
need_pkgs=()
command -v umoci >/dev/null || need_pkgs+=(umoci)
command -v musl-gcc >/dev/null || need_pkgs+=(musl-tools)
[[ -x /bin/busybox ]] && /bin/busybox --list | grep -x nsenter >/dev/null || need_pkgs+=(busybox-static)
[[ -f /etc/ssl/certs/ca-certificates.crt ]] || need_pkgs+=(ca-certificates)
if ((${#need_pkgs[@]})); then
  say "apt-get install ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
if ! rustup target list --installed | grep -qx "$target"; then
  say "rustup target add $target"
  rustup target add "$target"
fi
if ! file -L /bin/busybox | grep -q 'statically linked'; then
  echo "images.sh: /bin/busybox is not static (install busybox-static)" >&2
  exit 1
fi

say "cargo build --release --target $target"
CC="musl-gcc" cargo build -q --release --locked --target "$target" \
  -p hugepool-operator --bin hugepool-operator --bin kubectl-hugepool \
  -p hugepool-agent --bin hugepool-agent \
  -p hugepool-e2e --bin pause --bin hugepage-holder
bin="$root/target/$target/release"

work="$(mktemp -d "${TMPDIR:-/tmp}/hugepool-images.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# image NAME REF USER ENTRYPOINT FILE... : one OCI archive with FILEs
# (src:dest pairs) as its only layer.
image() {
  local name="$1" ref="$2" user="$3" entrypoint="$4"
  shift 4
  local layout="$work/$name" bundle="$work/$name.bundle"
  umoci init --layout "$layout"
  umoci new --image "$layout:$version"
  umoci unpack --image "$layout:$version" "$bundle" >/dev/null
  local pair src dest
  for pair in "$@"; do
    src="${pair%%:*}" dest="$bundle/rootfs/${pair#*:}"
    mkdir -p "$(dirname "$dest")"
    cp -L "$src" "$dest"
  done
  umoci repack --image "$layout:$version" --history.created_by "hack/images.sh" "$bundle"
  umoci config --image "$layout:$version" --os linux --architecture "$oci_arch" \
    --config.user "$user" --config.entrypoint "$entrypoint" \
    --config.env PATH=/usr/bin:/bin --config.workingdir / \
    --config.label "org.opencontainers.image.version=$version" \
    --config.label "org.opencontainers.image.source=https://github.com/hugepool-dev/hugepool" \
    --history.created_by "hack/images.sh"
  umoci gc --layout "$layout"
  # containerd names an imported image after io.containerd.image.name;
  # skopeo and podman find it by the tag in org.opencontainers.image.ref.name.
  python3 - "$layout/index.json" "$ref" <<'PY'
import json, sys
path, ref = sys.argv[1], sys.argv[2]
index = json.load(open(path))
for manifest in index["manifests"]:
    manifest.setdefault("annotations", {})["io.containerd.image.name"] = ref
json.dump(index, open(path, "w"))
PY
  tar -C "$layout" -cf "$out/$name-$version.tar.tmp" .
  mv -f "$out/$name-$version.tar.tmp" "$out/$name-$version.tar"
  say "$name-$version.tar: $ref ($(du -h "$out/$name-$version.tar" | cut -f1))"
}

certs=/etc/ssl/certs/ca-certificates.crt:etc/ssl/certs/ca-certificates.crt
image hugepool-operator "$registry/hugepool-operator:$version" 65532:65532 /hugepool-operator \
  "$bin/hugepool-operator:hugepool-operator" "$certs"
image hugepool-agent "$registry/hugepool-agent:$version" 0:0 /hugepool-agent \
  "$bin/hugepool-agent:hugepool-agent" "$certs" /bin/busybox:usr/bin/nsenter
image hugepool-e2e "localhost/hugepool-e2e:$version" 65532:65532 /pause \
  "$bin/pause:pause" "$bin/hugepage-holder:hugepage-holder"
say "done: $out"
