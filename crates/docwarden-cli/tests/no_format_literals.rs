//! No stored field name or state is spelled as a string literal outside the library's
//! format module (issue 12): the CLI and the checkers go through `docwarden::format`.
//! The list of forbidden literals is taken from the format module's constants, so this
//! test cannot drift from the format.

use std::path::{Path, PathBuf};

use docwarden::format::{job, lock};

/// Every stored field name and state, from the format module.
fn forbidden() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = Vec::new();
    all.extend(job::field::ALL);
    all.extend(job::STATES);
    all.extend(lock::collection::ALL);
    all.extend(lock::document::ALL);
    all.push(lock::FENCE_TOKEN);
    all
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// `"literal"` occurrences outside `//` comments, as (file, line number, literal).
fn hits(files: &[PathBuf], forbidden: &[&str]) -> std::io::Result<Vec<String>> {
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file)?;
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            // A word that happens to equal a stored name but is something else (a fault's
            // name, a metric label) says so on its line.
            if code.starts_with("//") || line.contains("// not a stored field") {
                continue;
            }
            for lit in forbidden {
                if line.contains(&format!("\"{lit}\"")) {
                    found.push(format!("{}:{}: \"{lit}\"", file.display(), n + 1));
                }
            }
        }
    }
    Ok(found)
}

#[test]
fn no_stored_field_or_state_literal_in_the_cli_the_workloads_or_the_checkers() -> std::io::Result<()>
{
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&crates.join("docwarden-cli/src"), &mut files)?;
    rust_files(&crates.join("docwarden/src/check"), &mut files)?;
    rust_files(&crates.join("docwarden-workloads/src"), &mut files)?;
    assert!(files.len() > 10, "scanned only {} files", files.len());
    // The dashboard (issue 17) reads every stored field through the format module too.
    for module in [
        "ui.rs",
        "ui/data.rs",
        "ui/metrics.rs",
        "ui/live.rs",
        "ui/guard.rs",
    ] {
        let path = crates.join("docwarden-cli/src").join(module);
        assert!(files.contains(&path), "{} is not scanned", path.display());
    }
    let found = hits(&files, &forbidden())?;
    assert!(
        found.is_empty(),
        "stored field names or states spelled as literals (use docwarden::format):\n{}",
        found.join("\n")
    );
    Ok(())
}

/// The scanner itself finds a planted literal (its control).
#[test]
fn the_scanner_finds_a_planted_literal() -> std::io::Result<()> {
    let dir = std::env::temp_dir().join(format!("no_format_literals_{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("planted.rs");
    std::fs::write(
        &file,
        "// \"running\" in a comment is fine\nlet f = doc! { \"lease.token\": 1 };\n",
    )?;
    let found = hits(&[file], &forbidden())?;
    std::fs::remove_dir_all(&dir)?;
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].ends_with(":2: \"lease.token\""), "{found:?}");
    Ok(())
}
