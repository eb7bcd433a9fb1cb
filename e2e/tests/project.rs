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

/// The Kubernetes version a go.mod requires (`k8s.io/kubernetes v1.33.13` -> "1.33.13").
fn required_kubernetes(go_mod: &Path) -> String {
    let text = std::fs::read_to_string(go_mod)
        .unwrap_or_else(|e| panic!("read {}: {e}", go_mod.display()));
    text.lines()
        .find_map(|line| line.trim().strip_prefix("k8s.io/kubernetes v"))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{} requires no k8s.io/kubernetes", go_mod.display()))
        .to_string()
}

/// The Kubernetes release `make TARGET` tests for `minor` (the Makefile's
/// `VARIABLE := minor`, built from e2e/controlplane/k8s-MINOR/go.mod).
fn tested_by_make(root: &Path, variable: &str, target: &str, minor: &str) -> String {
    let makefile = std::fs::read_to_string(root.join("Makefile")).expect("read Makefile");
    assert!(
        makefile.contains(&format!("\n{variable} := {minor}\n")),
        "`make {target}` must test {minor}"
    );
    let tested = required_kubernetes(
        &root
            .join("e2e/controlplane")
            .join(format!("k8s-{minor}"))
            .join("go.mod"),
    );
    assert!(
        tested.starts_with(&format!("{minor}.")),
        "e2e/controlplane/k8s-{minor} builds Kubernetes {tested}"
    );
    tested
}

#[test]
fn the_oldest_kubernetes_is_one_version_everywhere() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |path: &str| {
        std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
    };
    // The API the binaries are built for: k8s-openapi's `v1_MINOR` feature.
    let cargo = read("Cargo.toml");
    let openapi = cargo
        .lines()
        .find(|line| line.starts_with("k8s-openapi "))
        .expect("k8s-openapi in the workspace's dependencies");
    let minor = openapi
        .split('"')
        .find_map(|word| word.strip_prefix("v1_"))
        .unwrap_or_else(|| panic!("no v1_MINOR feature in: {openapi}"));
    let oldest = format!("1.{minor}");

    let chart: serde_json::Value =
        serde_saphyr::from_str(&read("charts/hugepool/Chart.yaml")).expect("Chart.yaml is YAML");
    assert_eq!(
        chart["kubeVersion"],
        format!(">={oldest}.0-0"),
        "the chart must admit exactly what k8s-openapi's v1_{minor} is built for"
    );
    let oldest_tested = tested_by_make(&root, "OLDEST_K8S", "test-oldest-k8s", &oldest);
    let newest_tested = required_kubernetes(&root.join("e2e/controlplane/go.mod"));

    let readme = read("README.md");
    let row = readme
        .lines()
        .find(|line| line.starts_with("| Kubernetes |"))
        .expect("the README's compatibility table has a Kubernetes row");
    for said in [
        format!("{oldest} and later"),
        format!("`v1_{minor}`"),
        format!("v{oldest_tested}"),
        format!("v{newest_tested}"),
    ] {
        assert!(
            row.contains(&said),
            "the README's Kubernetes row does not say {said:?}: {row}"
        );
    }
}

/// DRA pools' oldest Kubernetes is one version in the tests' gate
/// (`DRA_MINOR`), the chart's refusal, `make test-dra-k8s`'s control plane
/// and the README.
#[test]
fn the_oldest_kubernetes_for_dra_is_one_version_everywhere() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |path: &str| {
        std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
    };
    let oldest = format!("1.{}", hugepool_e2e::DRA_MINOR);
    assert!(
        read("charts/hugepool/templates/dra-deviceclasses.yaml")
            .contains(&format!("semverCompare \"<{oldest}-0\"")),
        "the chart must refuse dra.enabled below {oldest}"
    );
    let tested = tested_by_make(&root, "DRA_K8S", "test-dra-k8s", &oldest);
    let readme = read("README.md");
    let row = |start: &str| {
        readme
            .lines()
            .find(|line| line.starts_with(start))
            .unwrap_or_else(|| panic!("the README's compatibility table has a row {start}"))
            .to_string()
    };
    assert!(
        row("| Kubernetes |").contains(&format!("v{tested}: the control-plane tests of DRA pools")),
        "the README's Kubernetes row names v{tested} for DRA"
    );
    assert!(
        row("| DRA ").contains(&format!("Kubernetes {oldest} and later")),
        "the README's DRA row says {oldest} and later"
    );
}
