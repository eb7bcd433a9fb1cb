//! Raw bench runs as committed files: JSON with one run per line, so that a
//! run's file stays small and a diff shows runs, not one value per line (a
//! pretty-printed resize run was ~85k lines; docs/design.md, issue 22).

use std::path::{Path, PathBuf};

/// `document` (an object with a `runs` array) with its header pretty-printed
/// and each run compact on a line of its own.
pub fn one_run_per_line(document: &serde_json::Value) -> String {
    let mut head = document.clone();
    let runs = head
        .as_object_mut()
        .and_then(|o| o.remove("runs"))
        .unwrap_or_default();
    let header = serde_json::to_string_pretty(&head).expect("JSON");
    let mut text = header
        .trim_end()
        .strip_suffix('}')
        .expect("an object")
        .trim_end()
        .to_string();
    let lines: Vec<String> = runs
        .as_array()
        .into_iter()
        .flatten()
        .map(|run| format!("    {run}"))
        .collect();
    text.push_str(",\n  \"runs\": [\n");
    text.push_str(&lines.join(",\n"));
    text.push_str("\n  ]\n}\n");
    text
}

/// Writes `document` as `dir/name`.
pub fn write(dir: &Path, name: &str, document: &serde_json::Value) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(name);
    std::fs::write(&path, one_run_per_line(document))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}
