//! The committed CRD manifests must be exactly what the types generate.

use std::path::Path;

#[test]
fn committed_crds_match_the_types() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut drifted = Vec::new();
    for dir in hugepool_crds::crdgen::OUTPUT_DIRS {
        for (name, yaml) in hugepool_crds::crdgen::manifests() {
            let path = root.join(dir).join(name);
            match std::fs::read_to_string(&path) {
                Ok(committed) if committed == yaml => {}
                _ => drifted.push(format!("{dir}/{name}")),
            }
        }
    }
    assert!(
        drifted.is_empty(),
        "CRD manifests are out of date: {drifted:?}. Regenerate them with `make crds`."
    );
}

/// What crdgen writes reads back as the very CRD the types define (the YAML
/// writer quotes what YAML would otherwise retype, such as `"1"` or `null`).
#[test]
fn the_generated_yaml_reads_back_as_the_types_crds() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::CustomResourceExt;
    let crds = [
        hugepool_crds::HugePagePool::crd(),
        hugepool_crds::HugePageNode::crd(),
    ];
    let manifests = hugepool_crds::crdgen::manifests();
    assert_eq!(manifests.len(), crds.len());
    for ((name, yaml), crd) in manifests.iter().zip(crds) {
        let read: CustomResourceDefinition =
            serde_saphyr::from_str(yaml).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!(
            serde_json::to_value(&read).unwrap(),
            serde_json::to_value(&crd).unwrap(),
            "{name}"
        );
    }
}

/// `kubectl explain` explains every field, and `kubectl get hugepool` lists
/// both kinds.
#[test]
fn every_field_is_described_and_both_kinds_are_in_the_hugepool_category() {
    use kube::CustomResourceExt;
    fn undescribed(schema: &serde_json::Value, path: &str, out: &mut Vec<String>) {
        if let Some(properties) = schema.get("properties").and_then(|p| p.as_object()) {
            for (name, property) in properties {
                let here = format!("{path}.{name}");
                if property.get("description").is_none() {
                    out.push(here.clone());
                }
                undescribed(property, &here, out);
            }
        }
        if let Some(items) = schema.get("items") {
            undescribed(items, &format!("{path}[]"), out);
        }
    }
    for crd in [
        hugepool_crds::HugePagePool::crd(),
        hugepool_crds::HugePageNode::crd(),
    ] {
        let kind = crd.spec.names.kind.clone();
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["hugepool".to_string()][..]),
            "{kind} categories"
        );
        let mut missing = Vec::new();
        for version in &crd.spec.versions {
            let schema = version
                .schema
                .as_ref()
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .expect("a schema");
            let schema = serde_json::to_value(schema).expect("schema as JSON");
            undescribed(&schema, "", &mut missing);
        }
        assert!(
            missing.is_empty(),
            "{kind} fields without a description: {missing:?}"
        );
    }
}
