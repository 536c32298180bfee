#!/usr/bin/env bash
# Installs what docwarden's commands need and says what it is doing:
#   - Debian's cmake (secantus-mdb builds WiredTiger with it)
#   - secantusd-rs, the embedded MongoDB-compatible server, pinned at 0.5.3-beta.196
# Sourced by scripts/demo.sh and scripts/test.sh. Skipped entirely when MONGODB_URI is set.
set -euo pipefail

SECANTUS_VERSION="0.5.3-beta.196"
export PATH="$HOME/.cargo/bin:$PATH"

say() { echo "[docwarden setup] $*" >&2; }

if [ -n "${MONGODB_URI:-}" ]; then
  say "MONGODB_URI is set: using that deployment, not installing the embedded server."
  return 0 2>/dev/null || exit 0
fi

if command -v secantusd-rs >/dev/null 2>&1 && secantusd-rs --version 2>/dev/null | grep -q "$SECANTUS_VERSION"; then
  say "secantusd-rs $SECANTUS_VERSION is installed ($(command -v secantusd-rs))."
else
  if ! command -v cmake >/dev/null 2>&1; then
    say "cmake is missing: installing Debian's cmake (apt-get)…"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq cmake >/dev/null
  fi
  say "secantusd-rs is missing: building secantus-mdb $SECANTUS_VERSION with cargo install"
  say "(about 10-15 minutes on a fresh 2-core machine; later runs find it in ~/.cargo/bin)…"
  cargo install secantus-mdb --version "$SECANTUS_VERSION" --locked --ignore-rust-version
  say "secantusd-rs installed at $(command -v secantusd-rs)."
fi
