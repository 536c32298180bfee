//! Small helpers for human and JSON output.

/// Prints a value as pretty JSON on stdout.
pub(crate) fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
