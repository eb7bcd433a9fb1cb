//! Writes the CRD manifests into `crds/` and `charts/hugepool/crds/`.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let root = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    for dir in hugepool_crds::crdgen::OUTPUT_DIRS {
        let dir = root.join(dir);
        std::fs::create_dir_all(&dir)?;
        for (name, yaml) in hugepool_crds::crdgen::manifests() {
            std::fs::write(dir.join(name), yaml)?;
            println!("wrote {}", dir.join(name).display());
        }
    }
    Ok(())
}
