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
# 65532; the agent adds busybox's static nsenter for kubelet restarts and
# the node hooks (hugepool-hooks, Go) for pools claimed through DRA.
# Registries (HUGEPOOL_IMAGE_REGISTRY) other than the default only change the
# names written into the archives.
#
# HUGEPOOL_IMAGES_SOURCE=DIR builds another checkout of this workspace (an
# earlier commit: hack/previous.sh) in HUGEPOOL_IMAGES_TARGET_DIR into
# HUGEPOOL_IMAGES_OUT, operator and agent only, with the same package
# selection (the dependencies' features stay the same).
#
# `hack/images.sh ARCH` (amd64 or arm64) builds the operator and agent images
# for another architecture into target/images/ARCH/ (the release does, with
# kubectl-hugepool beside them): cross-compiled with Debian's
# gcc-<arch>-linux-gnu as ring's C compiler and the linker, busybox's nsenter
# from Debian's busybox-static of that architecture.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
src_dir="${HUGEPOOL_IMAGES_SOURCE:-$root}"
out="${HUGEPOOL_IMAGES_OUT:-$root/target/images}"
target_dir="${HUGEPOOL_IMAGES_TARGET_DIR:-$root/target}"
registry="${HUGEPOOL_IMAGE_REGISTRY:-ghcr.io/hugepool-dev}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$src_dir/Cargo.toml" | head -n1)"
host_arch="$(uname -m)"
# `hack/images.sh binaries`: only the host build below (what make krew
# packs), with exactly this selection of packages, so that neither run
# rebuilds what the other built.
binaries_only=""
if [[ "${1:-}" == binaries ]]; then
  binaries_only=1
  shift
fi
case "${1:-}" in
  "") arch="$host_arch" ;;
  amd64) arch=x86_64 ;;
  arm64) arch=aarch64 ;;
  *) echo "images.sh: unknown architecture ${1} (amd64 or arm64)" >&2; exit 2 ;;
esac
case "$arch" in
  x86_64) oci_arch=amd64 ;;
  aarch64) oci_arch=arm64 ;;
  *) echo "images.sh: unsupported architecture $arch" >&2; exit 1 ;;
esac
target="$arch-unknown-linux-musl"
cross=""
[[ "$arch" == "$host_arch" ]] || cross="$arch-linux-gnu"
start=$SECONDS
say() { printf 'images.sh: %-58s %4ss\n' "$1" "$((SECONDS - start))"; }

# Tools, installed when missing (Debian packages; the musl std from rustup).
need_pkgs=()
command -v umoci >/dev/null || need_pkgs+=(umoci)
# To tell a static busybox from a dynamic one (below).
command -v file >/dev/null || need_pkgs+=(file)
[[ -f /etc/ssl/certs/ca-certificates.crt ]] || need_pkgs+=(ca-certificates)
if [[ -z "$cross" ]]; then
  command -v musl-gcc >/dev/null || need_pkgs+=(musl-tools)
  [[ -x /bin/busybox ]] && /bin/busybox --list | grep -x nsenter >/dev/null || need_pkgs+=(busybox-static)
else
  command -v "$cross-gcc" >/dev/null || need_pkgs+=("gcc-${cross//_/-}")
fi
# Package installs and downloads take one lock, shared with the other hack/
# scripts (two builds at once both found a package missing, and the second
# apt-get failed on dpkg's lock), and wait for dpkg's own lock too.
apt_lock() {
  exec 8>"${TMPDIR:-/tmp}/hugepool-apt.lock"
  flock 8
}
apt_unlock() { exec 8>&-; }
apt_get() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }
if ((${#need_pkgs[@]})); then
  say "apt-get install ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt_lock
  apt_get update -qq >/dev/null
  apt_get install -y -qq "${need_pkgs[@]}" >/dev/null
  apt_unlock
fi
if ! rustup target list --installed | grep -qx "$target"; then
  say "rustup target add $target"
  rustup target add "$target"
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/hugepool-images.XXXXXX")"
trap 'rm -rf "$work"' EXIT
busybox=/bin/busybox
if [[ -n "$cross" ]]; then
  # busybox-static of the target architecture, unpacked here (not installed).
  apt_lock
  if ! dpkg --print-foreign-architectures | grep -qx "$oci_arch"; then
    say "dpkg --add-architecture $oci_arch"
    dpkg --add-architecture "$oci_arch"
    apt_get update -qq >/dev/null
  fi
  (cd "$work" && apt_get download -qq -o APT::Sandbox::User=root "busybox-static:$oci_arch" >/dev/null)
  apt_unlock
  dpkg-deb -x "$work"/busybox-static_*.deb "$work/busybox"
  busybox="$work/busybox/bin/busybox"
fi
if ! file -L "$busybox" | grep -q 'statically linked'; then
  echo "images.sh: $busybox is not static (install busybox-static)" >&2
  exit 1
fi

say "cargo build --release --target $target"
cd "$src_dir"
# Run from a test (the release test runs release.sh), the environment holds the
# test crate's CARGO_MANIFEST_DIR, CARGO_PKG_NAME and the like; ring's build
# script reruns when they change (rerun-if-env-changed), and with it ring and
# all that links it: 4-5 min rebuilt inside `make test`, and again by the next
# `make images` or `make demo` outside it. They describe no crate built here.
while IFS= read -r var; do
  unset "$var"
done < <(compgen -e | grep -E '^(CARGO_(PKG_|MANIFEST_|CRATE_NAME$|BIN_NAME$|PRIMARY_PACKAGE$|TARGET_TMPDIR$)|OUT_DIR$)' || true)
# Another checkout builds no kubectl-hugepool (its packages stay the same,
# and with them the dependencies' features).
plugin=(--bin kubectl-hugepool)
[[ "$src_dir" == "$root" ]] || plugin=()
if [[ -z "$cross" ]]; then
  env "CC_${target//-/_}=musl-gcc" cargo build -q --release --locked --target "$target" \
    --target-dir "$target_dir" \
    -p hugepool-operator --bin hugepool-operator "${plugin[@]}" \
    -p hugepool-agent --bin hugepool-agent \
    -p hugepool-e2e --bin pause --bin hugepage-holder
else
  linker_var="CARGO_TARGET_$(tr 'a-z-' 'A-Z_' <<<"$target")_LINKER"
  env "CC_${target//-/_}=$cross-gcc" "$linker_var=$cross-gcc" \
    cargo build -q --release --locked --target "$target" --target-dir "$target_dir" \
    -p hugepool-operator --bin hugepool-operator --bin kubectl-hugepool \
    -p hugepool-agent --bin hugepool-agent
  out="$out/$oci_arch"
fi
bin="$target_dir/$target/release"
[[ -z "$binaries_only" ]] || exit 0
mkdir -p "$out"

# The node hooks of DRA pools (hooks/, Go: the NRI plugin on containerd/nri's
# stub, the kubelet plugin's registration), static, in the agent's image. An
# earlier version (make previous) may have none.
hooks=()
if [[ -d "$src_dir/hooks" ]]; then
  say "go build hugepool-hooks ($oci_arch)"
  (cd "$src_dir/hooks" && CGO_ENABLED=0 GOOS=linux GOARCH="$oci_arch" \
    go build -trimpath -ldflags "-s -w" -o "$target_dir/go/$oci_arch/hugepool-hooks" .)
  hooks=("$target_dir/go/$oci_arch/hugepool-hooks:hugepool-hooks")
fi

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
  "$bin/hugepool-agent:hugepool-agent" "$certs" "$busybox:usr/bin/nsenter" "${hooks[@]}"
if [[ -n "$cross" ]]; then
  cp -f "$bin/kubectl-hugepool" "$out/kubectl-hugepool"
elif [[ "$src_dir" == "$root" ]]; then
  image hugepool-e2e "localhost/hugepool-e2e:$version" 65532:65532 /pause \
    "$bin/pause:pause" "$bin/hugepage-holder:hugepage-holder"
fi
say "done: $out"
