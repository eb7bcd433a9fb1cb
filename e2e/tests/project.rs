//! What the project promises about itself: its license, a dependency tree
//! without archived crates and with one version of each Kubernetes crate,
//! and docs diagrams that are what their sources render.

use std::collections::BTreeMap;
use std::path::Path;

/// Package name -> versions, from the committed Cargo.lock.
fn locked_packages() -> BTreeMap<String, Vec<String>> {
    let lock = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock");
    let text = std::fs::read_to_string(&lock).expect("read Cargo.lock");
    let mut packages: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut name = None;
    for line in text.lines() {
        if let Some(value) = line.strip_prefix("name = ") {
            name = Some(value.trim_matches('"').to_string());
        } else if let (Some(value), Some(current)) = (line.strip_prefix("version = "), name.take())
        {
            packages
                .entry(current)
                .or_default()
                .push(value.trim_matches('"').to_string());
        }
    }
    packages
}

#[test]
fn no_archived_yaml_crate_and_one_kube_and_k8s_openapi() {
    let packages = locked_packages();
    assert!(
        packages.contains_key("kube-client"),
        "Cargo.lock was not read: {:?}",
        packages.keys().take(5).collect::<Vec<_>>()
    );
    // serde_yaml is archived; YAML goes through serde-saphyr, which kube-client uses too.
    for archived in ["serde_yaml", "serde_yml"] {
        assert!(
            !packages.contains_key(archived),
            "{archived} is in Cargo.lock: {:?}",
            packages[archived]
        );
    }
    for one in [
        "kube",
        "kube-client",
        "kube-runtime",
        "k8s-openapi",
        "serde-saphyr",
    ] {
        assert_eq!(
            packages.get(one).map(Vec::len),
            Some(1),
            "{one}: {:?}",
            packages.get(one)
        );
    }
}

/// The LICENSE file is the license every crate and the chart declare.
#[test]
fn the_license_file_is_the_license_cargo_and_the_chart_declare() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cargo = std::fs::read_to_string(root.join("Cargo.toml")).expect("read Cargo.toml");
    assert!(
        cargo
            .lines()
            .any(|line| line == r#"license = "Apache-2.0""#),
        "the workspace license is Apache-2.0"
    );
    let license = std::fs::read_to_string(root.join("LICENSE")).expect("a LICENSE file");
    let heading: Vec<&str> = license
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(2)
        .collect();
    assert_eq!(heading, ["Apache License", "Version 2.0, January 2004"]);
    assert!(
        license.contains("END OF TERMS AND CONDITIONS"),
        "the whole text"
    );
    let chart: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(root.join("charts/hugepool/Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("Chart.yaml is YAML");
    assert_eq!(chart["annotations"]["artifacthub.io/license"], "Apache-2.0");
}

#[test]
fn the_docs_diagrams_are_what_make_diagrams_renders() {
    let Some(dot) = hugepool_e2e::hack_tool_or_skip("graphviz.sh", &[]) else {
        return;
    };
    let images = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("docs")
        .join("images");
    let mut checked = 0;
    for entry in std::fs::read_dir(&images).expect("docs/images") {
        let source = entry.expect("a docs/images entry").path();
        if source.extension().and_then(|e| e.to_str()) != Some("dot") {
            continue;
        }
        let rendered = std::process::Command::new(&dot)
            .arg("-Tsvg")
            .arg(&source)
            .output()
            .expect("run dot");
        assert!(
            rendered.status.success(),
            "dot {}: {rendered:?}",
            source.display()
        );
        let committed = std::fs::read(source.with_extension("svg")).unwrap_or_default();
        assert!(
            committed == rendered.stdout,
            "{} is out of date with its .dot: run `make diagrams`",
            source.with_extension("svg").display()
        );
        checked += 1;
    }
    assert!(checked >= 1, "no diagram in {}", images.display());
}
