//! The dependency tree the project promises: no archived crates, and one
//! version of each Kubernetes crate for the whole workspace.

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
