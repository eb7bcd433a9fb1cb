//! The fitted write-cost models, kept in a file across agent restarts: read
//! when the agent starts, written after every resize, so a restarted agent
//! (a DaemonSet update, an OOM kill) sizes its first write from measured
//! costs instead of probing cold. The costs belong to one kernel: a file
//! written under another release, or one that does not parse, is ignored
//! with a warning and the agent starts cold, as it would without a file.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::model::{CostModels, SavedModel};

/// Bumped when the layout changes; a file of another format is ignored.
pub const FORMAT: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ModelFile {
    format: u32,
    /// `uname -r` of the kernel whose writes were measured.
    kernel_release: String,
    models: Vec<SavedModel>,
}

/// Why a file's models were not used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    #[error("no such file")]
    Missing,
    #[error("unreadable: {0}")]
    Unreadable(String),
    #[error("not a model file: {0}")]
    Corrupt(String),
    #[error("format {found}, this agent reads format {FORMAT}")]
    OtherFormat { found: u32 },
    #[error("measured under kernel {found}, this is {running}")]
    OtherKernel { found: String, running: String },
}

/// The models in `text`, if they were measured under `kernel_release`.
pub fn parse(text: &str, kernel_release: &str) -> Result<CostModels, Unusable> {
    let file: ModelFile =
        serde_json::from_str(text).map_err(|err| Unusable::Corrupt(err.to_string()))?;
    if file.format != FORMAT {
        return Err(Unusable::OtherFormat { found: file.format });
    }
    if file.kernel_release != kernel_release {
        return Err(Unusable::OtherKernel {
            found: file.kernel_release,
            running: kernel_release.to_string(),
        });
    }
    Ok(CostModels::from_saved(&file.models))
}

/// The file's contents for `models`.
pub fn render(models: &CostModels, kernel_release: &str) -> String {
    let file = ModelFile {
        format: FORMAT,
        kernel_release: kernel_release.to_string(),
        models: models.to_saved(),
    };
    serde_json::to_string(&file).expect("models serialize")
}

/// The models saved at `path`, or cold ones (saying why, as a warning for
/// a file that is there but unusable).
pub fn load(path: &Path, kernel_release: &str) -> CostModels {
    let result = match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, kernel_release),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Err(Unusable::Missing),
        Err(err) => Err(Unusable::Unreadable(err.to_string())),
    };
    match result {
        Ok(models) => {
            tracing::info!(path = %path.display(), "cost models loaded");
            models
        }
        Err(Unusable::Missing) => {
            tracing::info!(path = %path.display(), "no saved cost models: starting cold");
            CostModels::default()
        }
        Err(why) => {
            tracing::warn!(path = %path.display(), %why, "ignoring the saved cost models: starting cold");
            CostModels::default()
        }
    }
}

/// Writes the models to `path` atomically (a reader never sees half a file).
pub fn save(path: &Path, models: &CostModels, kernel_release: &str) -> std::io::Result<()> {
    let staging = path.with_extension("tmp");
    std::fs::write(&staging, render(models, kernel_release))?;
    std::fs::rename(&staging, path)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::resize::Direction;
    use crate::resize::model::{ModelKey, Sample};

    fn fitted() -> CostModels {
        let mut models = CostModels::default();
        let key = ModelKey {
            size: hugepool_crds::PageSize::SIZE_2MI,
            direction: Direction::Shrink,
            hvo: true,
        };
        for (pages, millis) in [(512, 9), (1024, 14)] {
            let latency = Duration::from_millis(millis);
            models.record(key, Sample { pages, latency });
        }
        models
    }

    #[test]
    fn a_saved_file_reads_back_the_same_models_under_the_same_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cost-models.json");
        save(&path, &fitted(), "6.18.0").unwrap();
        assert_eq!(load(&path, "6.18.0").to_saved(), fitted().to_saved());
        assert!(
            !path.with_extension("tmp").exists(),
            "the staging file is renamed"
        );
    }

    #[test]
    fn missing_corrupt_foreign_or_other_format_files_start_cold() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cost-models.json");
        assert!(load(&path, "6.18.0").to_saved().is_empty(), "missing");
        let good = render(&fitted(), "6.18.0");
        assert_eq!(
            parse(&good, "6.19.0").err(),
            Some(Unusable::OtherKernel {
                found: "6.18.0".into(),
                running: "6.19.0".into()
            })
        );
        let other_format = good.replace("\"format\":1", "\"format\":2");
        assert_eq!(
            parse(&other_format, "6.18.0").err(),
            Some(Unusable::OtherFormat { found: 2 })
        );
        for corrupt in ["", "{", "[]", &good[..good.len() / 2]] {
            assert!(
                matches!(parse(corrupt, "6.18.0"), Err(Unusable::Corrupt(_))),
                "{corrupt:?}"
            );
        }
        std::fs::write(&path, &good[..10]).unwrap();
        assert!(load(&path, "6.18.0").to_saved().is_empty(), "corrupt file");
        std::fs::write(&path, &good).unwrap();
        assert!(
            load(&path, "6.19.0").to_saved().is_empty(),
            "another kernel"
        );
        assert!(!load(&path, "6.18.0").to_saved().is_empty());
    }
}
