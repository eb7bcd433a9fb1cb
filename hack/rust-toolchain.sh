#!/usr/bin/env bash
# Makes the Rust toolchain rust-toolchain.toml pins available to rustup
# before any cargo command runs: installed already; or the installed stable
# toolchain is that very version (an offline machine, where rustup cannot
# download), linked under the pinned name; or rustup installs it. Without
# rustup there is nothing to do: cargo is what the machine has.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
want=$(sed -n 's/^channel = "\(.*\)"$/\1/p' rust-toolchain.toml)
[[ -n $want ]] || { echo "hack/rust-toolchain.sh: no channel in rust-toolchain.toml" >&2; exit 1; }
command -v rustup >/dev/null 2>&1 || exit 0
if rustup toolchain list | grep -q "^$want-"; then
  exit 0
fi
stable=$(RUSTUP_TOOLCHAIN=stable rustc --version 2>/dev/null | awk '{print $2}' || true)
if [[ $stable == "$want" ]]; then
  host=$(RUSTUP_TOOLCHAIN=stable rustc -vV | sed -n 's/^host: //p')
  toolchains="${RUSTUP_HOME:-$HOME/.rustup}/toolchains"
  ln -s "$toolchains/stable-$host" "$toolchains/$want-$host"
  echo "hack/rust-toolchain.sh: Rust $want (rust-toolchain.toml) is the installed stable: linked as $want-$host" >&2
  exit 0
fi
echo "hack/rust-toolchain.sh: installing Rust $want (rust-toolchain.toml)" >&2
rustup toolchain install "$want" --profile minimal --component clippy,rustfmt >&2
