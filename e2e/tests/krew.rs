//! `kubectl hugepool` as krew installs it: the template `.krew.yaml` names a
//! `kubectl-hugepool` archive for each platform, `make krew` builds this
//! machine's archive and manifest, and the real krew installs them.

use std::path::{Path, PathBuf};
use std::process::Command;

use hugepool_e2e::in_ci_mode;
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `hack/krew.sh ARGS`; its stdout, or None (after saying why) when it
/// cannot run here outside CI.
fn krew_sh(args: &[&str]) -> Option<String> {
    let output = Command::new("bash")
        .arg(repo().join("hack/krew.sh"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run hack/krew.sh");
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        if !in_ci_mode() && stderr.contains("musl-gcc missing") {
            eprintln!("skipping: {stderr}");
            return None;
        }
        panic!("hack/krew.sh {args:?} failed: {stderr}");
    }
    Some(String::from_utf8(output.stdout).expect("UTF-8"))
}

#[test]
fn the_template_names_an_archive_and_the_binary_for_each_platform() {
    let text = std::fs::read_to_string(repo().join(".krew.yaml")).expect(".krew.yaml");
    // What krew-release-bot substitutes, so the rest parses as YAML.
    let filled = text
        .lines()
        .map(
            |line| match line.trim_start().strip_prefix("{{addURIAndSha \"") {
                Some(rest) => {
                    let indent = &line[..line.len() - line.trim_start().len()];
                    let uri = rest.split('"').next().expect("a uri");
                    format!("{indent}uri: {uri}\n{indent}sha256: \"{}\"", "0".repeat(64))
                }
                None => line.to_string(),
            },
        )
        .collect::<Vec<_>>()
        .join("\n")
        .replace("{{ .TagName }}", "v9.9.9");
    let manifest: Value = serde_saphyr::from_str(&filled).expect("the filled template is YAML");
    assert_eq!(manifest["kind"], "Plugin");
    // krew runs `kubectl <name>` as the binary kubectl-<name>.
    assert_eq!(manifest["metadata"]["name"], "hugepool");
    assert_eq!(manifest["spec"]["version"], "v9.9.9");
    let cargo = std::fs::read_to_string(repo().join("Cargo.toml")).expect("Cargo.toml");
    let homepage = manifest["spec"]["homepage"].as_str().expect("homepage");
    assert!(
        cargo.contains(&format!("repository = \"{homepage}\"")),
        "{homepage}"
    );
    let mut platforms = Vec::new();
    for platform in manifest["spec"]["platforms"].as_array().expect("platforms") {
        let labels = &platform["selector"]["matchLabels"];
        let (os, arch) = (
            labels["os"].as_str().unwrap(),
            labels["arch"].as_str().unwrap(),
        );
        assert_eq!(platform["bin"], "kubectl-hugepool");
        assert_eq!(
            platform["uri"],
            format!("{homepage}/releases/download/v9.9.9/kubectl-hugepool-{os}-{arch}.tar.gz")
        );
        platforms.push(format!("{os}/{arch}"));
    }
    assert_eq!(platforms, ["linux/amd64", "linux/arm64"]);
    let operator = std::fs::read_to_string(repo().join("operator/Cargo.toml")).expect("Cargo.toml");
    assert!(
        operator.contains("name = \"kubectl-hugepool\""),
        "the binary krew installs"
    );
}

#[test]
fn make_krew_builds_an_archive_the_real_krew_installs() {
    let Some(first) = krew_sh(&[]) else { return };
    let second = krew_sh(&[]).expect("a second run");
    assert_eq!(first, second, "the archive is reproducible (same sha256)");
    let krew = krew_sh(&["tool"]).expect("krew built");
    let out = repo().join("target/krew");
    let archive = std::fs::read_dir(&out)
        .expect("target/krew")
        .map(|e| e.expect("entry").path())
        .find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        .expect("an archive");
    let listing = Command::new("tar")
        .arg("-tzf")
        .arg(&archive)
        .output()
        .expect("tar");
    let mut files: Vec<String> = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .map(String::from)
        .collect();
    files.sort();
    assert_eq!(files, ["LICENSE", "kubectl-hugepool"]);

    let root = tempfile::tempdir().expect("KREW_ROOT");
    let installed = Command::new(krew.trim())
        .env("KREW_ROOT", root.path())
        .arg("install")
        .arg(format!(
            "--manifest={}",
            out.join("hugepool.yaml").display()
        ))
        .arg(format!("--archive={}", archive.display()))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run krew");
    assert!(
        installed.status.success(),
        "krew install: {}{}",
        String::from_utf8_lossy(&installed.stdout),
        String::from_utf8_lossy(&installed.stderr)
    );
    let plugin = root.path().join("bin/kubectl-hugepool");
    let help = Command::new(&plugin)
        .arg("--help")
        .output()
        .expect("run the installed plugin");
    let help = String::from_utf8_lossy(&help.stdout);
    for word in [
        "See, plan and check hugepool's hugepage pools",
        "Usage: kubectl hugepool",
        "status",
        "plan",
        "why",
        "check",
    ] {
        assert!(help.contains(word), "{word} missing from:\n{help}");
    }
}
