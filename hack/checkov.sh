#!/usr/bin/env bash
# Prints the path of the checkov binary the rendered manifests are linted
# with (e2e/tests/lint_manifests.rs), installing it once from PyPI into a
# virtualenv under target/tools/ (pip's normal cache). Nothing has to be
# installed by hand beyond python3: Debian's python3-venv (what `-m venv`
# needs there) is installed when missing. The install output goes to
# stderr; stdout is only the path.
#
#   CHECKOV_VERSION  the checkov version on PyPI (default below)
#   PYTHON           the interpreter the virtualenv is made with (python3)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${CHECKOV_VERSION:-3.3.30}"
python="${PYTHON:-python3}"
tools="$root/target/tools"
venv="$tools/checkov"
bin="$venv/bin/checkov"

installed_version() {
  [[ -x "$venv/bin/python" ]] || return 0
  # A virtualenv moved with its target/ (a cache restored elsewhere) keeps
  # its version but its scripts still name the old interpreter: not usable.
  [[ "$(head -n 1 "$bin" 2>/dev/null)" == "#!$venv/bin/python"* ]] || return 0
  "$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("checkov"))' 2>/dev/null || true
}

if [[ ! -x "$bin" || "$(installed_version)" != "$version" ]]; then
  mkdir -p "$tools"
  # Serialise concurrent callers (tests run in parallel).
  exec 9>"$tools/.checkov.lock"
  flock 9
  if [[ ! -x "$bin" || "$(installed_version)" != "$version" ]]; then
    echo "hack/checkov.sh: installing checkov $version (pip install checkov==$version into $venv)" >&2
    start=$SECONDS
    # A virtualenv cannot be moved (its scripts name their interpreter by
    # path), so it is made in place and removed whole if the install fails:
    # no half-made one is ever taken for installed.
    # Debian splits venv's pip bootstrap (ensurepip) into python3-venv.
    if ! "$python" -c 'import ensurepip, venv' 2>/dev/null && command -v apt-get >/dev/null; then
      echo "hack/checkov.sh: apt-get install python3-venv" >&2
      exec 8>"${TMPDIR:-/tmp}/hugepool-apt.lock"
      flock 8
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-venv >/dev/null
      exec 8>&-
    fi
    rm -rf "$venv"
    trap 'rm -rf "$venv"' ERR
    "$python" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "checkov==$version" >&2
    trap - ERR
    echo "hack/checkov.sh: installed $bin in $((SECONDS - start))s" >&2
  fi
fi
echo "$bin"
