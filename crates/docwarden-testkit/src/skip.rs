//! Saying "skipped" out loud.
//!
//! A test that cannot run in the current setting (for example one that restarts the server
//! while `MONGODB_URI` points at a real deployment) must never pass silently. It calls
//! [`skip`], which prints the reason on standard error and appends a line to the skip log,
//! so `scripts/test.sh` can count and list the skipped tests in its summary.

use std::io::Write;
use std::path::PathBuf;

/// The environment variable naming the skip log; default `<temp dir>/docwarden-skipped.log`.
pub const SKIP_LOG_ENV: &str = "DOCWARDEN_SKIP_LOG";

/// The file skipped tests are recorded in.
pub fn skip_log() -> PathBuf {
    std::env::var_os(SKIP_LOG_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("docwarden-skipped.log"))
}

/// Records that `test` was skipped and why: a line `skipped: <test>: <reason>` on standard
/// error and in the skip log. The caller then returns without asserting anything.
pub fn skip(test: &str, reason: &str) {
    let line = format!("skipped: {test}: {reason}");
    eprintln!("{line}");
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(skip_log())
        .and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = appended {
        eprintln!(
            "(could not record the skip in {}: {e})",
            skip_log().display()
        );
    }
}
