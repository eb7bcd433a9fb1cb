//! Boot mode (docs/design.md, "Reboots and new nodes"): the agent keeps the
//! node's last converged targets in a file on the host, and
//! `hugepool-agent boot`, run by a systemd unit before the kubelet starts,
//! applies them, so that a rebooted node's kubelet registers the pools it
//! had and needs no restart. Memory is least fragmented then, too.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hugepool_crds::node::PageSizeTarget;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::kernel::Kernel;
use crate::resize::{self, CostModels, Goal, Options, Outcome, settings_for, targets_for};
use crate::{Error, Result};

/// The format's version; a file of another version is refused, never guessed.
pub const VERSION: u32 = 1;

/// What the boot file holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BootTargets {
    pub version: u32,
    /// The node the targets are for (a disk moved to another node is
    /// refused).
    pub node: String,
    /// The HugePageNode's entries when the node last converged.
    pub page_sizes: Vec<PageSizeTarget>,
}

impl BootTargets {
    pub fn new(node: &str, page_sizes: Vec<PageSizeTarget>) -> Self {
        Self {
            version: VERSION,
            node: node.to_string(),
            page_sizes,
        }
    }
}

/// Writes `targets` to `path` atomically (a temporary file beside it, synced,
/// then renamed over it): a crash leaves the old file or the new one.
pub fn save(path: &Path, targets: &BootTargets) -> Result<()> {
    let error = |source| Error::Write {
        path: path.to_path_buf(),
        value: "boot targets".into(),
        source,
    };
    let json = serde_json::to_vec_pretty(targets).map_err(|e| error(std::io::Error::other(e)))?;
    let temporary = path.with_extension("tmp");
    let mut file = std::fs::File::create(&temporary).map_err(error)?;
    file.write_all(&json).map_err(error)?;
    file.sync_all().map_err(error)?;
    std::fs::rename(&temporary, path).map_err(error)
}

/// Reads a boot file; refuses another version, or another node's file
/// when `node` is given.
pub fn load(path: &Path, node: Option<&str>) -> Result<BootTargets> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let parse = |detail: String| Error::Parse {
        path: path.to_path_buf(),
        detail,
    };
    let targets: BootTargets = serde_json::from_str(&text).map_err(|e| parse(e.to_string()))?;
    if targets.version != VERSION {
        return Err(parse(format!(
            "version {} (this agent reads version {VERSION})",
            targets.version
        )));
    }
    if let Some(node) = node
        && targets.node != node
    {
        return Err(parse(format!(
            "the targets of node {:?}, not of {node:?}",
            targets.node
        )));
    }
    Ok(targets)
}

/// One pool file's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub line: String,
    pub reached: bool,
}

/// Moves every pool of `targets` to its target with the resize engine and
/// the entry's own settings (budgeted writes, the memory guard), one pool
/// file after the other; a pool that cannot be reached does not stop the
/// others. Returns one line per pool file.
pub async fn apply(kernel: Arc<dyn Kernel>, targets: &BootTargets) -> Result<Vec<Applied>> {
    let offered = kernel.page_sizes()?;
    let mut applied = Vec::new();
    let mut models = CostModels::default();
    for entry in &targets.page_sizes {
        if !offered.contains(&entry.size) {
            applied.push(Applied {
                line: format!("{}: not offered by this kernel; skipped", entry.size),
                reached: false,
            });
            continue;
        }
        // A pool claimed through DRA is grown by the agent once the kubelet
        // runs: the kubelet advertises as hugepages-<size> every page it
        // finds when it starts, and the slice offers claims only the rest.
        if entry.by_claims() {
            applied.push(Applied {
                line: format!(
                    "{}: consumed through DRA; the agent grows it after the kubelet starts",
                    entry.size
                ),
                reached: true,
            });
            continue;
        }
        for target in targets_for(entry) {
            let (_goal_tx, mut goal_rx) = watch::channel(Goal {
                target,
                settings: settings_for(entry),
            });
            // Nothing holds pages before the kubelet starts: a shrink that
            // is blocked ends at once.
            let options = Options {
                blocked_wait: Duration::ZERO,
                blocked_poll: Duration::from_millis(200),
            };
            let summary = resize::run(
                Arc::clone(&kernel),
                &mut goal_rx,
                &options,
                &mut models,
                |_| {},
            )
            .await?;
            let reached = summary.outcome == Outcome::Reached;
            let scope = match target.scope {
                crate::kernel::PoolScope::Global => String::new(),
                crate::kernel::PoolScope::Node(n) => format!(" NUMA node {n}"),
            };
            applied.push(Applied {
                line: format!(
                    "{}{scope}: {} -> {} of {} pages ({})",
                    entry.size,
                    summary.from,
                    summary.achieved,
                    target.pages,
                    if reached {
                        "reached".to_string()
                    } else {
                        format!("{:?}", summary.outcome)
                    }
                ),
                reached,
            });
        }
    }
    Ok(applied)
}

/// Where the chart keeps the boot file on the host.
pub fn default_path() -> PathBuf {
    PathBuf::from("/var/lib/hugepool/boot-targets.json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{SimConfig, SimulatedKernel};
    use hugepool_crds::PageSize;

    fn entry(pages: i64) -> PageSizeTarget {
        PageSizeTarget {
            pool: "p".into(),
            pool_generation: 1,
            ..PageSizeTarget::new(PageSize::SIZE_2MI, pages)
        }
    }

    #[test]
    fn a_saved_file_loads_back_and_another_nodes_or_versions_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("boot.json");
        let targets = BootTargets::new("w-1", vec![entry(64)]);
        save(&path, &targets).expect("save");
        assert_eq!(load(&path, Some("w-1")).expect("load"), targets);
        assert!(!path.with_extension("tmp").exists(), "renamed into place");
        let other = load(&path, Some("w-2")).expect_err("another node's file");
        assert!(other.to_string().contains("\"w-1\""), "{other}");
        let mut future = targets.clone();
        future.version = VERSION + 1;
        save(&path, &future).expect("save");
        let refused = load(&path, None).expect_err("another version");
        assert!(refused.to_string().contains("version 2"), "{refused}");
    }

    #[tokio::test]
    async fn apply_moves_each_pool_to_its_saved_target() {
        let kernel = SimulatedKernel::new(SimConfig::single_node(8 << 30));
        let shared: Arc<dyn Kernel> = Arc::new(kernel.clone());
        let applied = apply(
            Arc::clone(&shared),
            &BootTargets::new("w-1", vec![entry(64)]),
        )
        .await
        .expect("apply");
        assert_eq!(
            applied,
            [Applied {
                line: "2Mi: 0 -> 64 of 64 pages (reached)".into(),
                reached: true
            }]
        );
        assert_eq!(
            kernel.pool(PageSize::SIZE_2MI).expect("pool").persistent(),
            64
        );
    }

    #[tokio::test]
    async fn a_pool_claimed_through_dra_is_left_for_the_agent_after_the_kubelet_starts() {
        let kernel = SimulatedKernel::new(SimConfig::single_node(8 << 30));
        let shared: Arc<dyn Kernel> = Arc::new(kernel.clone());
        let claimed = PageSizeTarget {
            consumption: Some(hugepool_crds::settings::Consumption::DynamicResourceAllocation),
            ..entry(64)
        };
        let applied = apply(Arc::clone(&shared), &BootTargets::new("w-1", vec![claimed]))
            .await
            .expect("apply");
        assert_eq!(
            applied,
            [Applied {
                line: "2Mi: consumed through DRA; the agent grows it after the kubelet starts"
                    .into(),
                reached: true
            }]
        );
        assert_eq!(
            kernel.pool(PageSize::SIZE_2MI).expect("pool").persistent(),
            0,
            "the kubelet starts with none of its pages to advertise"
        );
    }
}
