#!/usr/bin/env bash
# The whole test suite: installs what is missing, then cargo fmt --check, clippy with
# -D warnings, and every unit, integration and doc test against the embedded server
# (or MONGODB_URI if set). Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/prereqs.sh
# Headless Chromium renders the dashboard (tests/ui.rs) and the verify report; without it
# those tests skip and say so.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "[docwarden setup] chromium is missing: installing Debian's chromium (apt-get, ~1 minute)…" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; }; then
    echo "[docwarden setup] could not install chromium: the browser tests will report themselves skipped" >&2
  fi
fi
step() { echo "[docwarden test] $*" >&2; }
# Tests that cannot run in this setting record themselves here (see docwarden_testkit::skip).
export DOCWARDEN_SKIP_LOG="${DOCWARDEN_SKIP_LOG:-$(mktemp -t docwarden-skipped.XXXXXX)}"
: > "$DOCWARDEN_SKIP_LOG"
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
step "cargo doc with -D warnings (every public item documented, links resolve)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
step "checking that the shipped binary does not depend on test code"
if cargo tree -p docwarden-cli -e normal --prefix none | grep -q '^docwarden-testkit'; then
  echo "[docwarden test] docwarden-cli depends on docwarden-testkit outside [dev-dependencies]" >&2
  exit 1
fi
step "cargo test (unit, integration and doc tests; the embedded server starts per test binary)"
cargo test --workspace --no-fail-fast
step "running every example (cargo run --example: lock, queue_worker, sequence, guard, worker_metrics), so they never rot"
for example in lock queue_worker sequence guard; do
  cargo run --quiet -p docwarden --example "$example" >/dev/null
done
# worker_metrics needs the library's optional `prometheus` feature; port 0: any free port.
METRICS_ADDR=127.0.0.1:0 cargo run --quiet -p docwarden --features prometheus --example worker_metrics >/dev/null
step "checking that no embedded server was left running by the tests"
sleep 1
if [ -z "${DOCWARDEN_ALLOW_RUNNING_SERVERS:-}" ] && pgrep -f "docwarden-embedded-" >/dev/null 2>&1; then
  echo "[docwarden test] orphan embedded servers remain:" >&2
  pgrep -a -f "docwarden-embedded-" >&2 || true
  exit 1
fi
skipped=$(grep -c '^skipped: ' "$DOCWARDEN_SKIP_LOG" 2>/dev/null || true)
if [ "${skipped:-0}" -gt 0 ]; then
  step "$skipped test(s) skipped in this setting (they asserted nothing):"
  sed 's/^/  /' "$DOCWARDEN_SKIP_LOG" >&2
else
  step "no test was skipped"
fi
step "all passed"
