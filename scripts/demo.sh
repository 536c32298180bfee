#!/usr/bin/env bash
# The main job: installs what is missing, builds docwarden, and runs `docwarden demo`
# (all five seed scenarios) against an embedded server it starts and stops itself.
# Extra arguments go to `docwarden demo` (for example: ./scripts/demo.sh locks).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/prereqs.sh
echo "[docwarden demo] building docwarden (release)…" >&2
cargo build --release --quiet -p docwarden-cli
echo "[docwarden demo] running: docwarden demo $*" >&2
exec ./target/release/docwarden demo "$@"
