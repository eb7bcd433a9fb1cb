//! A HugePageNode entry as the resize engine takes it: its settings and its
//! targets. The agent's resize loop and `hugepool-agent boot` share these.

use hugepool_crds::node::PageSizeTarget;
use hugepool_crds::{duration, quantity};

use crate::kernel::PoolScope;
use crate::resize::{Settings, Target};

/// The engine's settings from one target entry; bad values (which the
/// schema should have stopped) fall back to the defaults.
pub fn settings_for(entry: &PageSizeTarget) -> Settings {
    let defaults = Settings::default();
    Settings {
        max_step_duration: duration::parse(&entry.resize.max_step_duration)
            .unwrap_or(defaults.max_step_duration),
        step_pause: duration::parse(&entry.resize.step_pause).unwrap_or(defaults.step_pause),
        stall_threshold: duration::parse(&entry.resize.stall_threshold)
            .unwrap_or(defaults.stall_threshold),
        min_mem_available: quantity::parse_bytes(&entry.allocation.min_mem_available)
            .unwrap_or(defaults.min_mem_available),
        retries: entry.allocation.retries.max(0) as u32,
        compact: entry.allocation.compact,
        ..defaults
    }
}

/// The engine targets of one entry: one per NUMA node when the entry lists
/// them, otherwise one write of the size's global file. For an entry in
/// range (`status::out_of_range`): the resize loop never acts on another.
pub fn targets_for(entry: &PageSizeTarget) -> Vec<Target> {
    let size = entry.size;
    match &entry.numa {
        Some(numa) => numa
            .iter()
            .map(|n| Target {
                size,
                pages: n.pages.max(0) as u64,
                scope: PoolScope::Node(n.id.max(0) as u32),
            })
            .collect(),
        None => vec![Target {
            size,
            pages: entry.pages.max(0) as u64,
            scope: PoolScope::Global,
        }],
    }
}
