#!/usr/bin/env bash
# Prints the path of Graphviz's `dot`, which renders the docs' diagrams
# (docs/images/*.dot -> .svg: `make diagrams`; e2e/tests/project.rs checks
# the committed SVGs are what it renders). Installs Debian's graphviz when
# it is missing (as root: apt-get). Install output goes to stderr; stdout is
# only the path.
set -euo pipefail

if ! command -v dot >/dev/null; then
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "hack/graphviz.sh: dot not found; install graphviz (Debian: apt-get install graphviz)" >&2
    exit 1
  fi
  echo "hack/graphviz.sh: apt-get install graphviz" >&2
  # Serialise concurrent callers (tests run in parallel).
  # The lock hack/images.sh takes for its installs too.
  exec 9>"${TMPDIR:-/tmp}/hugepool-apt.lock"
  flock 9
  if ! command -v dot >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq graphviz >&2
  fi
fi
command -v dot
