#!/usr/bin/env bash
# hack/previous.sh [COMMIT]: the chart and images of an earlier version of
# hugepool, for the upgrade and rollback test (e2e/tests/node.rs). Prints the
# directory that holds them:
#
#   DIR/src/charts/hugepool                 the chart as it was at COMMIT
#   DIR/images/hugepool-operator-V.tar      localhost/previous/hugepool-operator:V
#   DIR/images/hugepool-agent-V.tar         localhost/previous/hugepool-agent:V
#
# V is the commit's version with "-previous" added.
#
# COMMIT defaults to PREVIOUS below: the last version before the node stack
# changed (containerd 2.x, hugetlb limits enforced, the agent's ClusterRole
# without pods). Its sources come from this clone's history (git archive);
# its images are built by today's hack/images.sh, after `make images` (whose
# compiled dependencies it reuses). Built once; later runs print DIR at once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREVIOUS=9bbb7c94deff7ffde1370df9428f123c9bfb24fd
commit="${1:-$PREVIOUS}"
dir="$root/target/previous/$commit"
if compgen -G "$dir/images/hugepool-agent-*.tar" >/dev/null &&
  compgen -G "$dir/images/hugepool-operator-*.tar" >/dev/null; then
  echo "$dir"
  exit 0
fi
if ! git -C "$root" cat-file -e "$commit^{commit}" 2>/dev/null; then
  # A shallow clone: that one commit, from where the clone came from.
  echo "previous.sh: commit $commit is not in this clone: git fetch --depth=1 origin $commit" >&2
  if ! git -C "$root" fetch --quiet --depth=1 origin "$commit" >&2 ||
    ! git -C "$root" cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "previous.sh: commit $commit could not be fetched (no git history, or no remote that has it):" \
      "the upgrade test needs it; fetch it, or clone with history" >&2
    exit 1
  fi
fi
rm -rf "$dir"
mkdir -p "$dir/src"
git -C "$root" archive "$commit" | tar -x -C "$dir/src"
# Its own version, VERSION-previous, so that nothing of it is taken for this
# repository's build.
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$dir/src/Cargo.toml" | head -n1)"
sed -i "0,/^version = \"$version\"/s//version = \"$version-previous\"/" "$dir/src/Cargo.toml"
(cd "$dir/src" && cargo update -q --offline --workspace)
# Its own crates unoptimised: the upgrade test needs their behaviour, not
# their speed.
mkdir -p "$dir/src/.cargo"
for package in hugepool-crds hugepool-runtime hugepool-agent hugepool-operator hugepool-e2e; do
  printf '[profile.release.package.%s]\nopt-level = 0\ncodegen-units = 16\n' "$package"
done >"$dir/src/.cargo/config.toml"
# Built in a target/ of its own (two checkouts sharing one overwrite each
# other's builds of the same crate), seeded with a copy of the dependencies
# `make images` compiled: the Cargo.lock is the same, so only hugepool's own
# crates compile.
triple="$(uname -m)-unknown-linux-musl"
for build in release "$triple/release"; do
  if [[ -d "$root/target/$build" ]]; then
    mkdir -p "$dir/target/$(dirname "$build")"
    cp -a "$root/target/$build" "$dir/target/$build"
  fi
done
HUGEPOOL_IMAGES_SOURCE="$dir/src" HUGEPOOL_IMAGES_TARGET_DIR="$dir/target" \
  HUGEPOOL_IMAGES_OUT="$dir/images" HUGEPOOL_IMAGE_REGISTRY=localhost/previous \
  bash "$root/hack/images.sh" >&2
rm -rf "$dir/target"
echo "$dir"
