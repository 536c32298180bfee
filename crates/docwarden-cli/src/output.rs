//! Small helpers for human and JSON output.

use std::borrow::Cow;

/// Prints a value as pretty JSON on stdout.
pub(crate) fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// `s` with its control characters escaped (`\n`, `\u{1b}`, `\0`, …) for text printed to a
/// terminal: stored data (a job's error message, an owner id, a hand-edited field) cannot
/// move the cursor, clear the screen or fake a row of a table. JSON output needs none of
/// this (serde escapes control characters).
pub(crate) fn terminal_safe(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The longest cell of a text table, in characters; `--json` prints values whole.
pub(crate) const MAX_CELL_CHARS: usize = 200;

/// `s` as a cell of a text table: [`terminal_safe`], and cut to [`MAX_CELL_CHARS`]
/// characters with `…` (a 200 KB error message would otherwise be one row of 200 KB).
pub(crate) fn cell(s: &str) -> String {
    let safe = terminal_safe(s);
    match safe.char_indices().nth(MAX_CELL_CHARS) {
        Some((cut, _)) => format!("{}…", &safe[..cut]),
        None => safe.into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_long_cells_cut() {
        assert_eq!(terminal_safe("plain text, é ✓"), "plain text, é ✓");
        assert_eq!(
            terminal_safe("\u{1b}[2J clear\nfake row\0"),
            "\\u{1b}[2J clear\\nfake row\\u{0}"
        );
        assert_eq!(cell("short"), "short");
        let long = "é".repeat(MAX_CELL_CHARS + 50);
        let c = cell(&long);
        assert_eq!(c.chars().count(), MAX_CELL_CHARS + 1);
        assert!(c.ends_with('…'));
        assert!(!cell("a\u{1b}b").contains('\u{1b}'));
    }
}
