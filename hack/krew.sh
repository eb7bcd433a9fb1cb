#!/usr/bin/env bash
# make krew: the kubectl-hugepool release archive for this machine's
# architecture, as krew installs it, and the krew manifest for it:
#
#   target/krew/kubectl-hugepool-linux-ARCH.tar.gz   kubectl-hugepool + LICENSE
#   target/krew/hugepool.yaml                         .krew.yaml for vVERSION,
#                                                     this archive's uri and sha256
#
# Try it: kubectl krew install --manifest=target/krew/hugepool.yaml \
#           --archive=target/krew/kubectl-hugepool-linux-ARCH.tar.gz
# The binary is the static (musl) one `make images` builds (hack/images.sh
# binaries: the same build, a no-op after make images).
#
# `hack/krew.sh tool` instead prints the path of krew itself, built once
# from its Go module into target/tools (KREW_VERSION), for the tests.
# `hack/krew.sh archive` and `manifest` are the two steps alone, for the
# release (hack/release.sh: both architectures, https URLs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [[ "${1:-}" == tool ]]; then
  krew_version="${KREW_VERSION:-v0.4.3}"
  tools="$root/target/tools"
  bin="$tools/krew"
  built() { [[ -x "$bin" ]] && go version -m "$bin" | awk '$1 == "mod" { print $3 }' | grep -qx "$krew_version"; }
  if ! built; then
    mkdir -p "$tools"
    exec 9>"$tools/.krew.lock"
    flock 9
    if ! built; then
      echo "krew.sh: building krew $krew_version (go install sigs.k8s.io/krew/cmd/krew)" >&2
      tmp="$(mktemp -d "$tools/.krew.XXXXXX")"
      trap 'rm -rf "$tmp"' EXIT
      CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
        go install "sigs.k8s.io/krew/cmd/krew@$krew_version" >&2
      mv -f "$tmp/krew" "$bin"
    fi
  fi
  echo "$bin"
  exit 0
fi
# archive ARCH BINARY OUT: OUT/kubectl-hugepool-linux-ARCH.tar.gz holding
# BINARY (as kubectl-hugepool) and LICENSE; prints its path.
archive() {
  local arch="$1" binary="$2" out="$3" work
  local path="$out/kubectl-hugepool-linux-$arch.tar.gz"
  mkdir -p "$out"
  work="$(mktemp -d "${TMPDIR:-/tmp}/hugepool-krew.XXXXXX")"
  cp "$binary" "$work/kubectl-hugepool"
  cp LICENSE "$work/"
  # Reproducible: fixed owner and time, sorted names, no gzip timestamp.
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
    -C "$work" -cf - kubectl-hugepool LICENSE | gzip -9n > "$path"
  rm -rf "$work"
  echo "$path"
}

# manifest TAG BASE_URL ARCHIVE...: .krew.yaml as krew-release-bot fills it
# in for TAG: each archive's platform with uri BASE_URL/NAME and the
# archive's sha256; platforms with no archive here and the template's
# comments left out.
manifest() {
  python3 - "$@" <<'PY'
import hashlib, os, re, sys
tag, base, *paths = sys.argv[1:]
text = open(".krew.yaml").read()
head, *platforms = re.split(r"(?m)^  - selector:\n", text)
head = "".join(l for l in head.splitlines(True) if not l.startswith("#"))
call = re.compile(r'(?m)^( *)\{\{addURIAndSha "([^"]+)" \.TagName \}\}$')
rendered = []
for path in paths:
    name = os.path.basename(path)
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    kept = [p for p in platforms if call.search(p).group(2).endswith("/" + name)]
    assert len(kept) == 1, f"no platform in .krew.yaml names {name}"
    rendered.append("  - selector:\n" + call.sub(
        lambda m: f'{m.group(1)}uri: {base}/{name}\n{m.group(1)}sha256: "{sha}"', kept[0]))
print((head + "".join(rendered)).replace("{{ .TagName }}", tag), end="")
PY
}

case "${1:-}" in
  archive) shift; archive "$@"; exit 0 ;;
  manifest) shift; manifest "$@"; exit 0 ;;
esac

version="v$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
arch="$(uname -m)"
case "$arch" in
  x86_64) krew_arch=amd64 ;;
  aarch64) krew_arch=arm64 ;;
  *) echo "krew.sh: unsupported architecture $arch" >&2; exit 1 ;;
esac
target="$arch-unknown-linux-musl"
# The build `make images` runs (a no-op after it).
bash hack/images.sh binaries >&2

out="$root/target/krew"
path="$(archive "$krew_arch" "target/$target/release/kubectl-hugepool" "$out")"
manifest "$version" "file://$out" "$path" > "$out/hugepool.yaml"
echo "krew.sh: $path ($(sha256sum "$path" | cut -d' ' -f1)) and $out/hugepool.yaml"
