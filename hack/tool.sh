#!/usr/bin/env bash
# hack/tool.sh NAME: prints the path of a release tool, building it once from
# its Go module into target/tools/ (with the machine's normal GOMODCACHE and
# GOCACHE). Nothing has to be installed by hand beyond Go. Build output goes
# to stderr; stdout is only the path.
#
#   cosign      signs and verifies images, attaches and verifies SBOMs
#   registry    the distribution registry (the release test's OCI registry)
#   crane       pushes OCI layouts, assembles multi-arch indexes, reads them
#   actionlint  checks .github/workflows
#   kube-score  lints the rendered manifests (e2e/tests/lint_manifests.rs)
#   cyclonedx-gomod  the CycloneDX SBOM of the Go binary hugepool-hooks, from
#               the module list Go writes into it
#   cargo-cyclonedx  writes the CycloneDX SBOM of each binary (a crate: built
#               with cargo install)
#
# Each tool's version is pinned below; NAME_VERSION (e.g. COSIGN_VERSION)
# overrides it.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="${1:?usage: hack/tool.sh cosign|registry|crane|actionlint|kube-score|cyclonedx-gomod|cargo-cyclonedx}"
crate=""
case "$name" in
  cosign)
    module=github.com/sigstore/cosign/v3 package=cmd/cosign version="${COSIGN_VERSION:-v3.1.3}"
    ldflags="-X sigs.k8s.io/release-utils/version.gitVersion=$version" ;;
  registry)
    module=github.com/distribution/distribution/v3 package=cmd/registry version="${REGISTRY_VERSION:-v3.1.2}"
    ldflags="-X $module/version.version=$version" ;;
  crane)
    module=github.com/google/go-containerregistry package=cmd/crane version="${CRANE_VERSION:-v0.22.1}"
    ldflags="-X $module/cmd/crane/cmd.Version=$version" ;;
  actionlint)
    module=github.com/rhysd/actionlint package=cmd/actionlint version="${ACTIONLINT_VERSION:-v1.7.12}"
    ldflags="-X $module.version=$version" ;;
  kube-score)
    # The version stamp of kube-score's own release build (goreleaser).
    module=github.com/zegl/kube-score package=cmd/kube-score version="${KUBE_SCORE_VERSION:-v1.20.0}"
    ldflags="-X main.version=${version#v}" ;;
  cyclonedx-gomod)
    module=github.com/CycloneDX/cyclonedx-gomod package=cmd/cyclonedx-gomod version="${CYCLONEDX_GOMOD_VERSION:-v1.10.0}"
    ldflags="" ;;
  cargo-cyclonedx)
    crate=cargo-cyclonedx version="${CARGO_CYCLONEDX_VERSION:-0.5.9}" ;;
  *) echo "hack/tool.sh: unknown tool $name" >&2; exit 2 ;;
esac
tools="$root/target/tools"
bin="$tools/$name"

built_version() {
  [[ -x "$bin" ]] || return 0
  if [[ -n "$crate" ]]; then
    cat "$bin.version" 2>/dev/null || true
  else
    go version -m "$bin" 2>/dev/null | awk -v m="$module" '$1 == "mod" && $2 == m { print $3 }'
  fi
}

if [[ "$(built_version)" != "$version" ]]; then
  mkdir -p "$tools"
  # Serialise concurrent callers (tests run in parallel).
  exec 9>"$tools/.$name.lock"
  flock 9
  if [[ "$(built_version)" != "$version" ]]; then
    start=$SECONDS
    tmp="$(mktemp -d "$tools/.$name.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    if [[ -n "$crate" ]]; then
      echo "hack/tool.sh: building $name $version (cargo install $crate@$version)" >&2
      cargo install -q --locked --root "$tmp" "$crate@$version" >&2
      mv -f "$tmp/bin/$name" "$bin"
      echo "$version" > "$bin.version"
    else
      echo "hack/tool.sh: building $name $version (go install $module/$package@$version)" >&2
      CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-buildvcs=false \
        go install -ldflags "-s -w $ldflags" "$module/$package@$version" >&2
      mv -f "$tmp/$(basename "$package")" "$bin"
    fi
    echo "hack/tool.sh: built $bin in $((SECONDS - start))s" >&2
  fi
fi
echo "$bin"
