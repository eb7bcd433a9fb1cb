#!/usr/bin/env bash
# make release VERSION=X: hugepool as a platform team installs it.
#
#   images  REGISTRY/hugepool-operator:X and REGISTRY/hugepool-agent:X, each a
#           multi-arch index (linux/amd64, linux/arm64; arm64 cross-compiled
#           by hack/images.sh arm64), each platform's manifest also tagged
#           X-ARCH; the index signed with cosign (recursively: each platform
#           too), each platform's CycloneDX SBOM attached as a signed
#           attestation (cosign attest --type cyclonedx), and its build
#           provenance (SLSA v1: the source commit, the workflow run or
#           machine that built it, the inputs) as another (--type
#           slsaprovenance1)
#   chart   oci://REGISTRY/charts/hugepool:X, its values naming these images
#           by digest; signed like the images
#   files   target/release/X/: the chart's .tgz, the SBOMs, kubectl-hugepool
#           archives for both architectures, the krew manifest with their
#           sha256 (hugepool.yaml), images.txt (every pushed digest), the
#           public key that verifies the signatures (cosign.pub) and
#           SHA256SUMS
#
# Environment:
#   VERSION          the release; must be the workspace's and the chart's
#                    version (bump Cargo.toml and charts/hugepool/Chart.yaml)
#   REGISTRY         where images and chart go (default ghcr.io/hugepool-dev);
#                    credentials as crane, cosign and helm read them
#   COSIGN_KEY       the private key (a file from `cosign generate-key-pair`,
#                    or any key reference cosign takes); COSIGN_PASSWORD its
#                    password
#   COSIGN_SIGNING_CONFIG
#                    where signatures are recorded besides the registry:
#                    unset, nowhere (no transparency log; verify with
#                    --insecure-ignore-tlog); `sigstore`, cosign's default
#                    (the public Sigstore services, Rekor); else the path of
#                    a signing config (cosign signing-config create)
#   PLAIN_HTTP=1     the registry speaks plain HTTP (a local test registry)
#   DOWNLOAD_URL     where the kubectl-hugepool archives will be downloaded
#                    from (default: the GitHub release of vX)
#
# The amd64 binaries are the ones `make images` builds (nothing is rebuilt
# when it ran); the tools (crane, cosign, cargo-cyclonedx) come from
# hack/tool.sh, helm from hack/helm.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$SECONDS
say() { printf 'release.sh: %-62s %4ss\n' "$1" "$((SECONDS - start))"; }
die() { echo "release.sh: $*" >&2; exit 1; }

version="${VERSION:-}"
[[ -n "$version" ]] || die "VERSION is required (make release VERSION=X)"
crate_version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
chart_version="$(sed -n 's/^version: *//p' charts/hugepool/Chart.yaml)"
app_version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/hugepool/Chart.yaml)"
[[ "$version" == "$crate_version" && "$version" == "$chart_version" && "$version" == "$app_version" ]] ||
  die "VERSION $version is not the version of the workspace ($crate_version) and chart ($chart_version, appVersion $app_version): bump Cargo.toml and charts/hugepool/Chart.yaml first"
registry="${REGISTRY:-ghcr.io/hugepool-dev}"
key="${COSIGN_KEY:-}"
[[ -n "$key" ]] || die "COSIGN_KEY is required (a key from cosign generate-key-pair; COSIGN_PASSWORD its password)"
export COSIGN_PASSWORD="${COSIGN_PASSWORD:-}"
download_url="${DOWNLOAD_URL:-https://github.com/hugepool-dev/hugepool/releases/download/v$version}"
crane_flags=() cosign_flags=() helm_flags=()
if [[ -n "${PLAIN_HTTP:-}" ]]; then
  crane_flags+=(--insecure)
  cosign_flags+=(--allow-http-registry)
  helm_flags+=(--plain-http)
fi

crane="$(bash hack/tool.sh crane)"
cosign="$(bash hack/tool.sh cosign)"
cyclonedx="$(bash hack/tool.sh cargo-cyclonedx)"
gomod="$(bash hack/tool.sh cyclonedx-gomod)"
helm="$(bash hack/helm.sh)"

out="$root/target/release/$version"
rm -rf "$out"
mkdir -p "$out/sbom"
work="$(mktemp -d "${TMPDIR:-/tmp}/hugepool-release.XXXXXX")"
trap 'rm -rf "$work"' EXIT
case "${COSIGN_SIGNING_CONFIG:-}" in
  "")
    # A signing config with no services: keyed signatures, no log.
    "$cosign" signing-config create --out "$work/signing-config.json" >/dev/null
    cosign_flags+=(--signing-config "$work/signing-config.json") ;;
  sigstore) ;;
  *) cosign_flags+=(--signing-config "$COSIGN_SIGNING_CONFIG") ;;
esac

host_arch="$(uname -m)"
arches=(amd64 arm64)
triple() { case "$1" in amd64) echo x86_64-unknown-linux-musl ;; arm64) echo aarch64-unknown-linux-musl ;; esac; }
# Where hack/images.sh puts an architecture's archives.
images_of() {
  if [[ "$(triple "$1")" == "$host_arch-unknown-linux-musl" ]]; then echo "$root/target/images"; else echo "$root/target/images/$1"; fi
}

for arch in "${arches[@]}"; do
  if [[ "$(images_of "$arch")" == "$root/target/images" ]]; then
    say "images for $arch (make images)"
    bash hack/images.sh
  else
    say "images for $arch (cross-compiled)"
    bash hack/images.sh "$arch"
  fi
done

# Each platform's SBOM: the binary's crates as Cargo resolved them for that
# target (cargo-cyclonedx writes them beside each crate's Cargo.toml).
for arch in "${arches[@]}"; do
  t="$(triple "$arch")"
  "$cyclonedx" cyclonedx -q --format json --describe binaries --target "$t" \
    --target-in-filename --spec-version 1.5 --no-build-deps
  mv -f "operator/hugepool-operator_bin_$t.cdx.json" "$out/sbom/hugepool-operator-$arch.cdx.json"
  mv -f "node-agent/hugepool-agent_bin_$t.cdx.json" "$out/sbom/hugepool-agent-$arch.cdx.json"
  find . -path ./target -prune -o -name "*_bin_$t.cdx.json" -exec rm -f {} +
  # The agent's image holds hugepool-hooks (Go) too: its modules, as Go
  # recorded them in the binary, go into the agent's SBOM as a component of
  # their own.
  hooks="$root/target/go/$arch/hugepool-hooks"
  [[ -f "$hooks" ]] || die "no $hooks (hack/images.sh builds it)"
  # cyclonedx-gomod names the platform from GOARCH, not from the binary.
  GOOS=linux GOARCH="$arch" "$gomod" bin -json -output "$work/hooks-$arch.cdx.json" -version "$version" "$hooks" 2>"$work/gomod.log" ||
    { cat "$work/gomod.log" >&2; die "cyclonedx-gomod $arch failed"; }
  python3 - "$out/sbom/hugepool-agent-$arch.cdx.json" "$work/hooks-$arch.cdx.json" <<'PY'
import json, sys
agent_path, hooks_path = sys.argv[1:3]
agent = json.load(open(agent_path))
hooks = json.load(open(hooks_path))
binary = dict(hooks["metadata"]["component"])
binary["name"] = "hugepool-hooks"
binary["components"] = hooks.get("components", [])
agent.setdefault("components", []).append(binary)
json.dump(agent, open(agent_path, "w"), indent=2)
PY
done
say "SBOMs: $out/sbom"

# The SLSA v1 provenance predicate of IMAGE for ARCH: the commit it was
# built from, and who built it: the GitHub Actions run (its workflow file at
# its ref) or, run by hand, this machine. A tree with uncommitted changes is
# said so (gitTreeDirty): its commit is not all that went in.
if commit="$(git -C "$root" rev-parse HEAD 2>/dev/null)"; then
  dirty=false
  [[ -z "$(git -C "$root" status --porcelain)" ]] || dirty=true
else
  # A source archive: no commit to name, and nothing says the tree is one.
  commit=unknown dirty=true
fi
started_on="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
provenance() {
  python3 - "$1" "$2" <<'PY'
import json, os, re, sys, socket, datetime
image, arch = sys.argv[1:3]
env = os.environ.get
server, repository = env("GITHUB_SERVER_URL", "https://github.com"), env("GITHUB_REPOSITORY")
source = f"{server}/{repository}" if repository else "https://github.com/hugepool-dev/hugepool"
if env("GITHUB_ACTIONS") == "true":
    workflow = env("GITHUB_WORKFLOW_REF", "")
    builder = f"{server}/{workflow}" if workflow else f"{source}/.github/workflows/release.yml@{env('GITHUB_REF', '')}"
    invocation = f"{source}/actions/runs/{env('GITHUB_RUN_ID', '')}/attempts/{env('GITHUB_RUN_ATTEMPT', '1')}"
else:
    builder = f"local://{socket.gethostname()}/hack/release.sh"
    invocation = ""
toolchain = re.search(r'(?m)^channel = "([^"]+)"', open("rust-toolchain.toml").read())
predicate = {
    "buildDefinition": {
        "buildType": "https://github.com/hugepool-dev/hugepool/blob/main/docs/development.md#releases",
        "externalParameters": {
            "source": source,
            "ref": env("GITHUB_REF", ""),
            "version": env("RELEASE_VERSION"),
            "registry": env("RELEASE_REGISTRY"),
            "image": image,
            "platform": f"linux/{arch}",
        },
        "internalParameters": {
            "rustToolchain": toolchain.group(1) if toolchain else "",
            "gitTreeDirty": env("RELEASE_DIRTY") == "true",
        },
        "resolvedDependencies": [{
            "uri": f"git+{source}@{env('GITHUB_REF', '') or env('RELEASE_COMMIT')}",
            "digest": {"gitCommit": env("RELEASE_COMMIT")},
        }],
    },
    "runDetails": {
        "builder": {"id": builder},
        "metadata": {
            "invocationId": invocation,
            "startedOn": env("RELEASE_STARTED"),
            "finishedOn": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    },
}
json.dump(predicate, sys.stdout, indent=2)
PY
}
export RELEASE_VERSION="$version" RELEASE_REGISTRY="$registry" RELEASE_COMMIT="$commit" \
  RELEASE_DIRTY="$dirty" RELEASE_STARTED="$started_on"

: > "$out/images.txt"
declare -A index_digest
for image in hugepool-operator hugepool-agent; do
  ref="$registry/$image:$version"
  for arch in "${arches[@]}"; do
    layout="$work/$image-$arch"
    mkdir -p "$layout"
    tar -xf "$(images_of "$arch")/$image-$version.tar" -C "$layout"
    "$crane" push "${crane_flags[@]}" "$layout" "$ref-$arch" >/dev/null 2>"$work/crane.log" ||
      { cat "$work/crane.log" >&2; die "crane push $image $arch failed"; }
  done
  "$crane" index append "${crane_flags[@]}" -t "$ref" \
    $(printf -- "-m $ref-%s " "${arches[@]}") >/dev/null 2>"$work/crane.log" ||
    { cat "$work/crane.log" >&2; die "crane index append $image failed"; }
  digest="$("$crane" digest "${crane_flags[@]}" "$ref")"
  index_digest[$image]="$digest"
  echo "$registry/$image@$digest $version" >> "$out/images.txt"
  "$cosign" sign "${cosign_flags[@]}" --yes --recursive --key "$key" "$registry/$image@$digest" 2>"$work/cosign.log" ||
    { cat "$work/cosign.log" >&2; die "cosign sign $image failed"; }
  for arch in "${arches[@]}"; do
    platform_digest="$("$crane" digest "${crane_flags[@]}" --platform "linux/$arch" "$ref")"
    echo "$registry/$image@$platform_digest $version linux/$arch" >> "$out/images.txt"
    "$cosign" attest "${cosign_flags[@]}" --yes --key "$key" --type cyclonedx \
      --predicate "$out/sbom/$image-$arch.cdx.json" "$registry/$image@$platform_digest" 2>"$work/cosign.log" ||
      { cat "$work/cosign.log" >&2; die "cosign attest $image $arch failed"; }
    provenance "$image" "$arch" > "$work/provenance-$image-$arch.json"
    "$cosign" attest "${cosign_flags[@]}" --yes --key "$key" --type slsaprovenance1 \
      --predicate "$work/provenance-$image-$arch.json" "$registry/$image@$platform_digest" 2>"$work/cosign.log" ||
      { cat "$work/cosign.log" >&2; die "cosign attest the provenance of $image $arch failed"; }
  done
  say "$ref ($digest): pushed, signed, SBOMs and provenance attested"
done

# The chart, naming the images just pushed by digest.
cp -r charts/hugepool "$work/hugepool"
python3 - "$work/hugepool/values.yaml" "$registry" "${index_digest[hugepool-operator]}" "${index_digest[hugepool-agent]}" <<'PY'
import re, sys
path, registry, operator, agent = sys.argv[1:]
text = open(path).read()
for image, digest in (("hugepool-operator", operator), ("hugepool-agent", agent)):
    pattern = re.compile(
        r"(?m)^(    repository: )ghcr\.io/hugepool-dev/" + image + r"\n((?:    .*\n)*?)(    digest: )\"\"\n")
    text, n = pattern.subn(
        lambda m: f"{m.group(1)}{registry}/{image}\n{m.group(2)}{m.group(3)}\"{digest}\"\n", text)
    assert n == 1, f"values.yaml: no image block for {image}"
open(path, "w").write(text)
PY
"$helm" package "$work/hugepool" -d "$out" >/dev/null
pushed="$("$helm" push "$out/hugepool-$version.tgz" "oci://$registry/charts" "${helm_flags[@]}" 2>&1)" ||
  die "helm push failed: $pushed"
chart_digest="$(sed -n 's/^Digest: *//p' <<<"$pushed")"
[[ -n "$chart_digest" ]] || die "helm push printed no digest: $pushed"
echo "$registry/charts/hugepool@$chart_digest $version chart" >> "$out/images.txt"
"$cosign" sign "${cosign_flags[@]}" --yes --key "$key" "$registry/charts/hugepool@$chart_digest" 2>"$work/cosign.log" ||
  { cat "$work/cosign.log" >&2; die "cosign sign the chart failed"; }
say "oci://$registry/charts/hugepool:$version ($chart_digest): pushed, signed"

# kubectl-hugepool for krew: one archive per architecture, the manifest with
# their sha256.
archives=()
for arch in "${arches[@]}"; do
  binary="$root/target/$(triple "$arch")/release/kubectl-hugepool"
  archives+=("$(bash hack/krew.sh archive "$arch" "$binary" "$out")")
done
bash hack/krew.sh manifest "v$version" "$download_url" "${archives[@]}" > "$out/hugepool.yaml"
say "krew: $out/hugepool.yaml"

"$cosign" public-key --key "$key" > "$out/cosign.pub"

(cd "$out" && find . -type f ! -name SHA256SUMS -printf '%P\n' | sort | xargs sha256sum > SHA256SUMS)
say "done: $out"
