//! The images `make images` builds (target/images/*.tar, OCI archives):
//! named as the chart's defaults expect, static binaries on an empty base,
//! the operator as 65532 with its binary and CA certificates only, the agent
//! with only what its chart features need. Missing archives skip outside CI
//! (run `make images`) and fail under `CI=true`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// An unpacked OCI archive: its index, manifest and config as JSON, and the
/// directory holding its blobs.
struct Archive {
    dir: tempfile::TempDir,
    index: Value,
    manifest: Value,
    config: Value,
}

impl Archive {
    fn open(name: &str) -> Option<Archive> {
        let path = repo()
            .join("target/images")
            .join(format!("{name}-{}.tar", env!("CARGO_PKG_VERSION")));
        if !path.exists() {
            let why = format!("{} missing: run `make images`", path.display());
            assert!(!hugepool_e2e::in_ci_mode(), "CI=true: {why}");
            eprintln!("skipping: {why}");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new("tar")
            .arg("-xf")
            .arg(&path)
            .arg("-C")
            .arg(dir.path())
            .status()
            .expect("tar");
        assert!(status.success(), "tar -xf {}", path.display());
        let index = read_json(&dir.path().join("index.json"));
        let manifests = index["manifests"].as_array().expect("index.manifests");
        assert_eq!(manifests.len(), 1, "one image per archive: {index}");
        let manifest = read_json(&blob(dir.path(), &manifests[0]));
        let config = read_json(&blob(dir.path(), &manifest["config"]));
        Some(Archive {
            dir,
            index,
            manifest,
            config,
        })
    }

    fn name(&self) -> &str {
        self.index["manifests"][0]["annotations"]["io.containerd.image.name"]
            .as_str()
            .expect("io.containerd.image.name annotation")
    }

    /// Every regular file of every layer, and the layer count.
    fn files(&self) -> (BTreeSet<String>, usize) {
        let layers = self.manifest["layers"].as_array().expect("layers");
        let mut files = BTreeSet::new();
        for layer in layers {
            let out = Command::new("tar")
                .arg("-tvzf")
                .arg(blob(self.dir.path(), layer))
                .output()
                .expect("tar -t");
            assert!(out.status.success(), "listing a layer");
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                // "-rwxr-xr-x root/root 123 2026-12-01 19:00 hugepool-operator"
                if line.starts_with('-') {
                    let path = line.split_whitespace().last().unwrap_or_default();
                    files.insert(path.trim_start_matches("./").to_string());
                }
            }
        }
        (files, layers.len())
    }

    fn extract(&self, file: &str) -> Vec<u8> {
        let layer = blob(self.dir.path(), &self.manifest["layers"][0]);
        let out = Command::new("tar")
            .arg("-xOzf")
            .arg(layer)
            .arg(file)
            .output()
            .expect("tar -xO");
        assert!(out.status.success(), "extracting {file}");
        out.stdout
    }
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn blob(dir: &Path, descriptor: &Value) -> PathBuf {
    let digest = descriptor["digest"].as_str().expect("digest");
    let (algorithm, hex) = digest.split_once(':').expect("algorithm:hex");
    dir.join("blobs").join(algorithm).join(hex)
}

/// Whether an ELF file asks for a dynamic loader (has a PT_INTERP header).
fn is_dynamic(elf: &[u8]) -> bool {
    assert_eq!(&elf[..4], b"\x7fELF", "not an ELF file");
    assert_eq!(elf[4], 2, "not a 64-bit ELF file");
    let u16_at = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).any(|i| {
        let at = phoff + i * phentsize;
        u32::from_le_bytes(elf[at..at + 4].try_into().unwrap()) == 3
    })
}

/// The image reference the chart uses by default for a component.
fn chart_default(component: &str) -> String {
    let chart = repo().join("charts/hugepool");
    let values: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(chart.join("values.yaml")).unwrap())
            .unwrap();
    let meta: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(chart.join("Chart.yaml")).unwrap())
            .unwrap();
    let app_version = meta["appVersion"].as_str().expect("appVersion");
    assert_eq!(
        app_version,
        env!("CARGO_PKG_VERSION"),
        "the chart's appVersion is the crate version that `make images` tags"
    );
    let repository = values[component]["image"]["repository"].as_str().unwrap();
    let tag = values[component]["image"]["tag"]
        .as_str()
        .unwrap_or_default();
    format!(
        "{repository}:{}",
        if tag.is_empty() { app_version } else { tag }
    )
}

#[test]
fn the_operator_image_is_its_static_binary_and_ca_certificates_run_as_65532() {
    let Some(image) = Archive::open("hugepool-operator") else {
        return;
    };
    assert_eq!(image.name(), chart_default("operator"));
    let config = &image.config["config"];
    assert_eq!(config["User"], "65532:65532");
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(["/hugepool-operator"])
    );
    assert_eq!(
        image.config["architecture"],
        std::env::consts::ARCH
            .replace("x86_64", "amd64")
            .replace("aarch64", "arm64")
    );
    let (files, layers) = image.files();
    assert_eq!(layers, 1, "one layer on an empty base");
    let expected: BTreeSet<String> = ["etc/ssl/certs/ca-certificates.crt", "hugepool-operator"]
        .map(String::from)
        .into();
    assert_eq!(files, expected);
    assert!(
        !is_dynamic(&image.extract("hugepool-operator")),
        "the operator binary is static"
    );
}

#[test]
fn the_agent_image_is_its_static_binaries_certificates_and_a_static_nsenter() {
    let Some(image) = Archive::open("hugepool-agent") else {
        return;
    };
    assert_eq!(image.name(), chart_default("agent"));
    assert_eq!(image.config["config"]["User"], "0:0");
    assert_eq!(
        image.config["config"]["Entrypoint"],
        serde_json::json!(["/hugepool-agent"])
    );
    let (files, layers) = image.files();
    assert_eq!(layers, 1, "one layer on an empty base");
    // The agent, and its node hooks for DRA pools (hugepool-hooks, Go).
    let expected: BTreeSet<String> = [
        "etc/ssl/certs/ca-certificates.crt",
        "hugepool-agent",
        "hugepool-hooks",
        "usr/bin/nsenter",
    ]
    .map(String::from)
    .into();
    assert_eq!(files, expected);
    for binary in ["hugepool-agent", "hugepool-hooks", "usr/bin/nsenter"] {
        assert!(!is_dynamic(&image.extract(binary)), "{binary} is static");
    }
}
