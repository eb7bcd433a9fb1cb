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
