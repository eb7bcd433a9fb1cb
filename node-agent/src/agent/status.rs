//! What the agent writes to its HugePageNode's `.status`: a pure function of
//! what the kernel reports now, the targets, and what the agent remembers of
//! its resizes. The conditions and reasons are those of docs/design.md.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hugepool_crds::conditions::{
    ConditionUpdate, NodeConditionType as Type, Reason, find_condition, set_condition,
};
use hugepool_crds::node::{
    KernelInfo, MemoryInfo, NumaStatus, ObtainablePages, PageSizeStatus, PageSizeTarget,
    ResizeSummary,
};
use hugepool_crds::{HugePageNodeStatus, PageSize};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::snapshot::{KernelSnapshot, SizeSnapshot};
use crate::kernel::PoolScope;
use crate::kernel::freelists::GrowEstimate;
use crate::resize::{Direction, Outcome, ShortfallReason};

/// A stall seen during a resize: a slow write, no progress, or a kernel report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StallRecord {
    pub reason: Reason,
    pub message: String,
}

/// A resize in progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Running {
    pub direction: Direction,
    pub from: u64,
    pub target: u64,
}

/// What the agent remembers about one page size.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SizeRecord {
    pub running: Option<Running>,
    /// How the last finished resize of each pool file (the global one, or a
    /// NUMA node's) ended, and for which target of that file.
    pub outcomes: BTreeMap<PoolScope, (u64, Outcome)>,
    /// The settings each file's last finished resize ended with: a short
    /// grow is tried again at once when they change (a lower
    /// minMemAvailable, more retries), not only after the retry interval.
    pub ended_with: BTreeMap<PoolScope, crate::resize::Settings>,
    pub last_resize: Option<ResizeSummary>,
    /// Stall of the running or last resize (cleared when a resize starts).
    pub stall: Option<StallRecord>,
    /// Someone else writes this size's pool (cleared when a resize starts
    /// for a new target).
    pub other_writer: Option<OtherWriter>,
}

/// Another writer moved a pool away from a target the agent had reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtherWriter {
    pub scope: PoolScope,
    /// The target it moved the pool away from.
    pub target: u64,
    /// What it set the pool to, last time.
    pub found: u64,
    /// Moves seen for this target.
    pub times: u32,
    /// When the agent restores the target.
    pub restore_at: std::time::Instant,
    /// The agent has restored the target since the last move.
    pub restored: bool,
}

/// Kubelet's view of the node, from the Node object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubeletView {
    /// `hugepages-<size>` capacity in bytes, by page size; `None` before the
    /// Node has been read.
    pub capacity: Option<BTreeMap<PageSize, u64>>,
    /// The pools (size -> pages) kubelet was last restarted for.
    pub restarted_for: Option<BTreeMap<PageSize, u64>>,
    /// The last restart for the current pools failed; retried at `retry_at`.
    pub failure: Option<RestartFailure>,
    /// This agent has no restart command (`--kubelet-restart-command=`).
    pub restarts_disabled: bool,
    /// A restart is running (on its own task): the command, then the wait
    /// for the kubelet to report the pools.
    pub restarting: bool,
    /// The kubelet's Memory Manager, from its checkpoint.
    pub memory_manager: MemoryManagerView,
    /// The Node's Ready condition as last seen (`True (KubeletReady: ...)`).
    pub node_ready: Option<String>,
    /// The Node's uid, which owns the node's ResourceSlice.
    pub node_uid: Option<String>,
}

/// What the agent knows of the kubelet's Memory Manager
/// (`crate::kubelet_state`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum MemoryManagerView {
    /// No `--kubelet-root-dir`: not read.
    #[default]
    NotRead,
    /// No checkpoint, or a policy that does not check hugepages at start.
    NotChecking,
    /// `Static`: the checkpoint must go before a restart; these pods hold
    /// memory in it (a restart waits until they are gone).
    Static(Vec<crate::kubelet_state::Assignment>),
    /// The checkpoint could not be read; a restart waits.
    Unreadable(String),
}

impl MemoryManagerView {
    pub fn from_read(
        read: Result<Option<crate::kubelet_state::MemoryManagerState>, String>,
    ) -> Self {
        match read {
            Ok(Some(state)) if state.validates_hugepages() => Self::Static(state.assignments),
            Ok(_) => Self::NotChecking,
            Err(message) => Self::Unreadable(message),
        }
    }

    /// Why a restart must wait, if it must.
    pub fn holds_restart(&self) -> Option<String> {
        match self {
            Self::Static(assignments) if !assignments.is_empty() => {
                let pods: Vec<String> = assignments
                    .iter()
                    .map(|a| {
                        format!(
                            "pod {} ({}: {})",
                            a.pod_uid,
                            a.containers.join(", "),
                            a.resources.join(", ")
                        )
                    })
                    .collect();
                Some(format!(
                    "not restarting the kubelet: its Static Memory Manager holds memory for {}, \
                     and a kubelet restarted after a hugepage change refuses that saved state \
                     (drain the pods, or restart the kubelet after they end)",
                    pods.join(", ")
                ))
            }
            Self::Unreadable(message) => Some(format!(
                "not restarting the kubelet: its Memory Manager state is unreadable: {message}"
            )),
            _ => None,
        }
    }
}

/// A kubelet restart that failed (the command's exit, error or timeout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartFailure {
    /// The pools (size -> pages) it was for.
    pub pools: BTreeMap<PageSize, u64>,
    pub attempts: u32,
    pub message: String,
    pub retry_at: std::time::Instant,
}

/// Everything besides the kernel that the status is built from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentMemory {
    /// Pages claims hold (DRA): on each size and NUMA node the larger of
    /// `prepared` and `allocated`. Shrinks leave them, and a target below
    /// them is blocked.
    pub claimed: crate::dra::Claimed,
    /// Pages the kubelet plugin's prepared claims hold.
    pub prepared: crate::dra::Claimed,
    /// Pages the claims the scheduler allocated on this node hold, as the
    /// operator tells (`status.allocatedClaims`): held from allocation on,
    /// before the kubelet prepares them.
    pub allocated: crate::dra::Claimed,
    pub generation: Option<i64>,
    pub targets: Vec<PageSizeTarget>,
    pub sizes: BTreeMap<PageSize, SizeRecord>,
    pub kubelet: KubeletView,
    pub kernel_log: KernelLogState,
    /// Sizes whose pool was short of its target when the agent started (a
    /// reboot, a new node), with that target: `Restoring` until the pool is
    /// back and the kubelet reports it.
    pub restoring: BTreeMap<PageSize, u64>,
    /// The conditions this agent's predecessor reported on the object, as
    /// the agent found them at start; the status writer starts from them so
    /// that unchanged conditions keep their transition times.
    pub reported_conditions: Option<Vec<Condition>>,
    /// What a grow can get, as the status shows it, per size and NUMA node
    /// (`None`: the whole machine). Replaced only when a figure moves
    /// materially ([`settle_obtainable`]).
    pub obtainable: BTreeMap<(PageSize, Option<u32>), GrowEstimate>,
    /// When `obtainable` was last changed ([`settle_obtainable`]).
    pub obtainable_shown_at: Option<Instant>,
    /// Pages per size that the pods on this node request, from their
    /// cgroups' hugetlb limits; `None` until read, or where no hugetlb
    /// controller holds the pods (crate::pod_cgroups).
    pub requested: Option<BTreeMap<PageSize, u64>>,
}

/// Whether the agent reads the kernel log, where lockups, RCU stalls and hung
/// tasks are reported. A container runtime's device cgroup commonly refuses
/// `/dev/kmsg`; that must show in the status, never be silent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KernelLogState {
    /// Turned off (`--no-kmsg`).
    #[default]
    Disabled,
    /// Records are being read; from where (`/dev/kmsg`, or syslog(2) and why).
    Watching(String),
    /// Opening or reading failed; the error.
    Unavailable(String),
}

/// How far one target is from the kernel's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    AtTarget,
    /// The size is not offered by this kernel (or the spec's size is invalid).
    Unsupported(String),
    /// The target names a NUMA node this machine does not have.
    Invalid(String),
    /// Pages in use keep the pool (of the size, or of one NUMA node of it:
    /// `numa`) above the target.
    Blocked {
        numa: Option<u32>,
        target: u64,
        persistent: u64,
        in_use: u64,
        reserved: u64,
        surplus: u64,
        /// Pages prepared claims hold there.
        claimed: u64,
    },
    Away {
        target: u64,
        persistent: u64,
        surplus: u64,
    },
}

/// Most pages one target may ask for (the CRDs' maximum: 32 TiB of 2Mi pages).
pub const MAX_PAGES: i64 = 16_777_216;

/// Why a target entry cannot be acted on whatever the machine: a page count
/// or NUMA id out of range (the CRD schema refuses them; an agent never
/// reads one as 0).
pub fn out_of_range(entry: &PageSizeTarget) -> Option<String> {
    let size = entry.size;
    let bad_pages = |pages: i64| !(0..=MAX_PAGES).contains(&pages);
    if bad_pages(entry.pages) {
        return Some(format!(
            "{size}: {} pages is out of range (0 to {MAX_PAGES})",
            entry.pages
        ));
    }
    for numa in entry.numa.iter().flatten() {
        if numa.id < 0 {
            return Some(format!("{size}: NUMA node {} is out of range", numa.id));
        }
        if bad_pages(numa.pages) {
            return Some(format!(
                "{size}: NUMA node {}: {} pages is out of range (0 to {MAX_PAGES})",
                numa.id, numa.pages
            ));
        }
    }
    None
}

/// Compares one target entry with the kernel and what prepared claims hold.
pub fn progress(
    entry: &PageSizeTarget,
    snapshot: &KernelSnapshot,
    claimed: &crate::dra::Claimed,
) -> Progress {
    let size = entry.size;
    if let Some(why) = out_of_range(entry) {
        return Progress::Invalid(why);
    }
    let Some(sizes) = snapshot.size(size) else {
        let offered: Vec<String> = snapshot.sizes.iter().map(|s| s.size.to_string()).collect();
        return Progress::Unsupported(format!(
            "the kernel does not offer {size} pages (offered: {})",
            offered.join(", ")
        ));
    };
    let missing: Vec<String> = entry
        .numa
        .iter()
        .flatten()
        .filter(|t| {
            !sizes
                .numa
                .iter()
                .any(|n| i64::from(n.node) == i64::from(t.id))
        })
        .map(|t| t.id.to_string())
        .collect();
    if !missing.is_empty() {
        let present: Vec<String> = sizes.numa.iter().map(|n| n.node.to_string()).collect();
        return Progress::Invalid(format!(
            "{size}: NUMA node {} not on this machine (it has {})",
            missing.join(", "),
            if present.is_empty() {
                "none".to_string()
            } else {
                present.join(", ")
            }
        ));
    }
    let target = entry.pages.max(0) as u64;
    let pool = sizes.pool;
    if entry.reached_by(&size_status(sizes, Some(entry), None, &BTreeMap::new())) {
        return Progress::AtTarget;
    }
    let held = |numa: Option<u32>| crate::dra::claimed_of(claimed, size, numa);
    let floor = (pool.in_use() + pool.reserved).max(held(None));
    if target < floor && (pool.persistent() > target || pool.surplus > 0) {
        return Progress::Blocked {
            numa: None,
            target,
            persistent: pool.persistent(),
            in_use: pool.in_use(),
            reserved: pool.reserved,
            surplus: pool.surplus,
            claimed: held(None),
        };
    }
    // A NUMA node's own floor: its pages in use (sysfs keeps no per-node
    // reservation count).
    for t in entry.numa.iter().flatten() {
        let want = t.pages.max(0) as u64;
        let Some(node) = sizes
            .numa
            .iter()
            .find(|n| i64::from(n.node) == i64::from(t.id))
        else {
            continue;
        };
        let node_floor = node.in_use().max(held(Some(node.node)));
        if want < node_floor && (node.persistent() > want || node.surplus > 0) {
            return Progress::Blocked {
                numa: Some(node.node),
                target: want,
                persistent: node.persistent(),
                in_use: node.in_use(),
                reserved: 0,
                surplus: node.surplus,
                claimed: held(Some(node.node)),
            };
        }
    }
    Progress::Away {
        target,
        persistent: pool.persistent(),
        surplus: pool.surplus,
    }
}

fn size_status(
    sizes: &SizeSnapshot,
    entry: Option<&PageSizeTarget>,
    record: Option<&SizeRecord>,
    obtainable: &BTreeMap<(PageSize, Option<u32>), GrowEstimate>,
) -> PageSizeStatus {
    let pool = sizes.pool;
    PageSizeStatus {
        size: sizes.size,
        target: entry.map(|e| e.pages),
        total: pool.total as i64,
        free: pool.free as i64,
        reserved: pool.reserved as i64,
        surplus: pool.surplus as i64,
        in_use: pool.in_use() as i64,
        // Set by `build` from the pods the agent watches and the claims.
        requested: None,
        claimed: None,
        numa: sizes
            .numa
            .iter()
            .map(|n| NumaStatus {
                id: n.node as i32,
                total: n.total as i64,
                free: n.free as i64,
                surplus: n.surplus as i64,
                // Set by `build` from the prepared claims.
                claimed: None,
                obtainable: obtainable_pages(obtainable.get(&(sizes.size, Some(n.node)))),
            })
            .collect(),
        obtainable: obtainable_pages(obtainable.get(&(sizes.size, None))),
        last_resize: record.and_then(|r| r.last_resize.clone()),
    }
}

/// How a message names a pool file after its size: nothing for the size's
/// global pool, " NUMA node N" for a node's.
fn scope_label(scope: PoolScope) -> String {
    match scope {
        PoolScope::Global => String::new(),
        PoolScope::Node(n) => format!(" NUMA node {n}"),
    }
}

fn shortfall_reason(reason: ShortfallReason) -> Reason {
    match reason {
        ShortfallReason::Fragmented | ShortfallReason::NoProgress => Reason::Fragmented,
        ShortfallReason::MemoryGuard => Reason::MemoryGuard,
        ShortfallReason::InsufficientMemory => Reason::InsufficientMemory,
        ShortfallReason::WriteError => Reason::WriteError,
    }
}

/// The conditions the agent owns, in a stable order, for `memory` and `snapshot`.
pub fn conditions(snapshot: &KernelSnapshot, memory: &AgentMemory) -> Vec<ConditionUpdate> {
    let generation = memory.generation;
    let mut converged_parts = Vec::new();
    let mut away = Vec::new();
    let mut blocked = Vec::new();
    let mut unsupported = Vec::new();
    let mut invalid = Vec::new();
    let mut other_writers = Vec::new();
    let mut shortfalls = Vec::new();
    let mut running = Vec::new();
    let mut stalls = Vec::new();
    for entry in &memory.targets {
        let record = memory.sizes.get(&entry.size);
        match progress(entry, snapshot, &memory.claimed) {
            Progress::AtTarget => converged_parts.push(format!(
                "{}: {}/{} pages",
                entry.size, entry.pages, entry.pages
            )),
            Progress::Unsupported(why) => unsupported.push(why),
            Progress::Invalid(why) => invalid.push(why),
            Progress::Blocked {
                numa,
                target,
                persistent,
                in_use,
                reserved,
                surplus,
                claimed,
            } => blocked.push(format!(
                "{}{}: target {target} is below {}; pool is {persistent} with {surplus} surplus",
                entry.size,
                scope_label(numa.map_or(PoolScope::Global, PoolScope::Node)),
                if claimed > in_use + reserved {
                    let of =
                        |held: &crate::dra::Claimed| crate::dra::claimed_of(held, entry.size, numa);
                    format!(
                        "the {claimed} pages claims hold (DRA: {} prepared by the kubelet, {} \
                         allocated by the scheduler; {in_use} in use)",
                        of(&memory.prepared),
                        of(&memory.allocated)
                    )
                } else {
                    format!("{in_use} pages in use + {reserved} reserved")
                }
            )),
            Progress::Away {
                target,
                persistent,
                surplus,
            } => {
                let mut part = format!("{}: {persistent}/{target} pages", entry.size);
                if surplus > 0 {
                    part.push_str(&format!(", {surplus} surplus"));
                }
                away.push(part);
            }
        }
        let Some(record) = record else { continue };
        if let Some(writer) = &record.other_writer
            && !writer.restored
            && record.running.is_none()
            && super::targets_for(entry)
                .iter()
                .any(|t| t.scope == writer.scope && t.pages == writer.target)
        {
            let scope = scope_label(writer.scope);
            other_writers.push(format!(
                "{}{scope}: another writer set the pool to {} (target {}), {} times; \
                 the agent restores it {}s after each move",
                entry.size,
                writer.found,
                writer.target,
                writer.times,
                super::other_writer_backoff(writer.times).as_secs()
            ));
        }
        if let Some(run) = &record.running {
            running.push((
                run.direction,
                format!("{}: {} -> {}", entry.size, run.from, run.target),
            ));
        }
        // Each pool file's outcome against that file's own target (a NUMA
        // node's, or the size's global one).
        for target in super::targets_for(entry) {
            let Some((
                wanted,
                Outcome::Shortfall {
                    requested,
                    achieved,
                    reason,
                    detail,
                },
            )) = record.outcomes.get(&target.scope)
            else {
                continue;
            };
            if *wanted != target.pages || record.running.is_some() {
                continue;
            }
            let scope = scope_label(target.scope);
            if *reason == ShortfallReason::NoProgress {
                // Writes the plan allowed changed nothing: a stall of the
                // kernel, on a shrink or a grow; only a grow also falls short
                // of an allocation.
                stalls.push(StallRecord {
                    reason: Reason::NoProgress,
                    message: format!(
                        "{}{scope}: writes toward {requested} changed nothing (pool at {achieved})",
                        entry.size
                    ),
                });
                if achieved > requested {
                    continue;
                }
            }
            let detail = detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default();
            shortfalls.push((
                shortfall_reason(*reason),
                format!(
                    "{}{scope}: requested {requested}, achieved {achieved}, short {} ({reason:?}{detail})",
                    entry.size,
                    requested.saturating_sub(*achieved)
                ),
            ));
        }
        if let Some(stall) = &record.stall {
            stalls.push(stall.clone());
        }
    }

    let mut updates = Vec::new();
    let all_converged =
        away.is_empty() && blocked.is_empty() && unsupported.is_empty() && invalid.is_empty();
    let converged = if all_converged {
        let message = if converged_parts.is_empty() {
            "no page size targets".to_string()
        } else {
            converged_parts.join("; ")
        };
        ConditionUpdate::new(Type::Converged, true, Reason::AtTarget, message)
    } else {
        let reason = if !unsupported.is_empty() {
            Reason::UnsupportedPageSize
        } else if !invalid.is_empty() {
            Reason::InvalidTarget
        } else if !other_writers.is_empty() {
            Reason::OtherWriter
        } else if !stalls.is_empty() {
            Reason::Stalled
        } else if !blocked.is_empty() {
            Reason::PagesInUse
        } else if !shortfalls.is_empty() {
            Reason::AllocationShortfall
        } else {
            Reason::Resizing
        };
        let parts: Vec<String> = unsupported
            .iter()
            .chain(&invalid)
            .chain(&other_writers)
            .chain(&blocked)
            .chain(&away)
            .cloned()
            .collect();
        ConditionUpdate::new(Type::Converged, false, reason, parts.join("; "))
    };
    updates.push(converged);

    updates.push(match running.first() {
        Some((direction, _)) => {
            let reason = if *direction == Direction::Grow {
                Reason::Growing
            } else {
                Reason::Shrinking
            };
            let parts: Vec<String> = running.iter().map(|(_, p)| p.clone()).collect();
            ConditionUpdate::new(Type::Resizing, true, reason, parts.join("; "))
        }
        None => ConditionUpdate::new(Type::Resizing, false, Reason::Idle, "no resize running"),
    });

    updates.push(match stalls.first() {
        Some(first) => {
            let parts: Vec<String> = stalls.iter().map(|s| s.message.clone()).collect();
            ConditionUpdate::new(Type::Stalled, true, first.reason, parts.join("; "))
        }
        None => ConditionUpdate::new(
            Type::Stalled,
            false,
            Reason::WritesWithinBudget,
            "every write finished within the stall threshold",
        ),
    });

    updates.push(match shortfalls.first() {
        Some((reason, _)) => {
            let parts: Vec<String> = shortfalls.iter().map(|(_, p)| p.clone()).collect();
            ConditionUpdate::new(Type::AllocationFailed, true, *reason, parts.join("; "))
        }
        None => ConditionUpdate::new(
            Type::AllocationFailed,
            false,
            Reason::AllocationComplete,
            "no allocation shortfall",
        ),
    });

    updates.push(if blocked.is_empty() {
        ConditionUpdate::new(
            Type::ShrinkBlocked,
            false,
            Reason::NotBlocked,
            "no shrink is blocked",
        )
    } else {
        ConditionUpdate::new(
            Type::ShrinkBlocked,
            true,
            Reason::PagesInUse,
            blocked.join("; "),
        )
    });

    if let Some(update) = kubelet_condition(snapshot, memory) {
        updates.push(update);
    }
    updates.push(kernel_log_condition(&memory.kernel_log));
    updates.push(restoring_condition(snapshot, memory));
    updates
        .into_iter()
        .map(|u| u.generation(generation))
        .collect()
}

/// The sizes of `targets` whose pool is short of its target in `pools`
/// (persistent pages by size): what a reboot or a new node looks like to an
/// agent that starts.
pub fn short_at_start(
    targets: &[PageSizeTarget],
    pools: &BTreeMap<PageSize, u64>,
) -> BTreeMap<PageSize, u64> {
    targets
        .iter()
        .filter_map(|entry| {
            let wanted = u64::try_from(entry.pages).ok()?;
            let have = *pools.get(&entry.size)?;
            (have < wanted).then_some((entry.size, wanted))
        })
        .collect()
}

/// What the agent records as it starts, under one lock: its targets and the
/// pools short of them. The status writer settles `restoring` against
/// `targets` whenever it wakes, so the two must land together: recorded
/// apart, a write in between would see no target and end the restore at once.
pub fn start_restoring(
    memory: &mut AgentMemory,
    generation: Option<i64>,
    targets: &[PageSizeTarget],
    pools: &BTreeMap<PageSize, u64>,
) {
    memory.generation = generation;
    memory.targets = targets.to_vec();
    memory.restoring = short_at_start(targets, pools);
}

/// Drops from `memory.restoring` what is settled: the size's target changed
/// or went (a rollout, not a restore, from then on), or its pool is at the
/// target with no surplus and the kubelet reports it.
pub fn settle_restoring(snapshot: &KernelSnapshot, memory: &mut AgentMemory) {
    let AgentMemory {
        restoring,
        targets,
        kubelet,
        ..
    } = memory;
    restoring.retain(|size, pages| {
        let target = targets
            .iter()
            .find(|e| e.size == *size && u64::try_from(e.pages).ok() == Some(*pages));
        let same_target = target.is_some();
        // A DRA pool's pages are claimable as soon as they are back.
        let by_claims = target.is_some_and(|e| e.by_claims());
        let back = snapshot
            .size(*size)
            .is_some_and(|s| s.pool.persistent() == *pages && s.pool.surplus == 0);
        let reported = kubelet.capacity.as_ref().is_some_and(|capacity| {
            !hugepool_crds::kubelet::capacity_stale(capacity, *size, *pages)
        });
        same_target && !(back && (reported || by_claims))
    });
}

/// What a grow can get now, per size and NUMA node (`None`: the whole
/// machine), from the snapshot's free lists, keeping free the memory guard
/// of the size's target (the default guard for a size with none) and the
/// engine's headroom above it; empty when the free lists could not be read.
pub fn obtainable(
    snapshot: &KernelSnapshot,
    targets: &[PageSizeTarget],
) -> BTreeMap<(PageSize, Option<u32>), GrowEstimate> {
    let mut estimates = BTreeMap::new();
    let Ok(free_lists) = &snapshot.free_lists else {
        return estimates;
    };
    for size in snapshot.sizes.iter().map(|s| s.size) {
        let guard = targets
            .iter()
            .find(|t| t.size == size)
            .map_or_else(
                crate::resize::Settings::default,
                crate::resize::settings_for,
            )
            .kept_free();
        let sized = free_lists.estimates(size, guard);
        estimates.insert((size, None), sized.total);
        for (node, estimate) in sized.numa {
            estimates.insert((size, Some(node)), estimate);
        }
    }
    estimates
}

/// Whether a shown figure must be rewritten: it fell by more than
/// [`ESTIMATE_FALL_SHOWN`] of itself, or rose by more than a tenth of the
/// new value. A status write for what a grow can get is worth that much,
/// not every page the page cache takes or gives back; but a figure a user
/// plans a grow on must not promise pages the kernel no longer has, so a
/// fall is shown long before a rise (`kubectl hugepool plan` over-predicted
/// by up to a tenth while a figure that fell 9% was still shown).
pub fn moved_materially(shown: GrowEstimate, fresh: GrowEstimate) -> bool {
    figure_moved(shown.obtainable_now, fresh.obtainable_now) || changes_a_plan(shown, fresh)
}

/// Whether the figure a plan's verdict rests on moved materially: what a
/// grow gets after compaction (`kubectl hugepool plan`'s prediction). The
/// free blocks a grow gets at once move with every page the page cache
/// takes or gives back, and decide nothing: on a busy node they are
/// shown at most every [`ESTIMATE_SHOWN_FOR`].
pub fn changes_a_plan(shown: GrowEstimate, fresh: GrowEstimate) -> bool {
    figure_moved(shown.after_compaction, fresh.after_compaction)
}

fn figure_moved(shown: u64, fresh: u64) -> bool {
    if fresh < shown {
        (shown - fresh) as f64 > ESTIMATE_FALL_SHOWN * shown as f64
    } else {
        (fresh - shown).saturating_mul(10) > fresh
    }
}

/// The share of a shown estimate it may fall by before it is rewritten:
/// what a status can over-promise between two refreshes.
pub const ESTIMATE_FALL_SHOWN: f64 = 0.02;

/// How long a figure that decides nothing (free blocks at once) may stay
/// as shown after it moved: the status of a busy node is written for it
/// at most this often (the kubelet posts an unchanged node status every
/// 5 minutes too).
pub const ESTIMATE_SHOWN_FOR: Duration = Duration::from_secs(300);

/// Brings `memory.obtainable` up to `fresh` (read at `now`): at once where
/// a figure a plan rests on moved materially or a size or NUMA node came
/// or went, and where only the free blocks moved, once the shown figures
/// are [`ESTIMATE_SHOWN_FOR`] old. Returns whether the shown figures
/// changed.
pub fn settle_obtainable(
    memory: &mut AgentMemory,
    fresh: &BTreeMap<(PageSize, Option<u32>), GrowEstimate>,
    now: Instant,
) -> bool {
    let same_keys = memory.obtainable.len() == fresh.len()
        && memory.obtainable.keys().all(|key| fresh.contains_key(key));
    let shown_long = memory
        .obtainable_shown_at
        .is_none_or(|at| now.saturating_duration_since(at) >= ESTIMATE_SHOWN_FOR);
    let due = |shown: &GrowEstimate, fresh: &GrowEstimate| {
        changes_a_plan(*shown, *fresh) || (shown_long && moved_materially(*shown, *fresh))
    };
    let urgent = !same_keys
        || fresh
            .iter()
            .any(|(key, estimate)| memory.obtainable.get(key).is_some_and(|s| due(s, estimate)));
    if !urgent {
        return false;
    }
    // Every figure that moved goes out with the write a plan needs.
    memory.obtainable.retain(|key, _| fresh.contains_key(key));
    for (key, estimate) in fresh {
        match memory.obtainable.get(key) {
            Some(shown) if !moved_materially(*shown, *estimate) => {}
            _ => {
                memory.obtainable.insert(*key, *estimate);
            }
        }
    }
    memory.obtainable_shown_at = Some(now);
    true
}

fn obtainable_pages(estimate: Option<&GrowEstimate>) -> Option<ObtainablePages> {
    estimate.map(|e| ObtainablePages {
        now: e.obtainable_now as i64,
        after_compaction: e.after_compaction as i64,
    })
}

fn restoring_condition(snapshot: &KernelSnapshot, memory: &AgentMemory) -> ConditionUpdate {
    if memory.restoring.is_empty() {
        return ConditionUpdate::new(
            Type::Restoring,
            false,
            Reason::PoolsReady,
            "no pool was short of its target when the agent started, or each is back and the kubelet reports it",
        );
    }
    let parts: Vec<String> = memory
        .restoring
        .iter()
        .map(|(size, pages)| {
            let have = snapshot.size(*size).map_or(0, |s| s.pool.persistent());
            format!("{size}: {have} of {pages} pages")
        })
        .collect();
    ConditionUpdate::new(
        Type::Restoring,
        true,
        Reason::PoolsShortAtStart,
        format!(
            "short of target when the agent started (a reboot or a new node): {}; ordinary pods \
             are kept off ({}) until the pools are back and the kubelet reports them",
            parts.join("; "),
            hugepool_crds::NOT_READY_TAINT
        ),
    )
}

fn kernel_log_condition(state: &KernelLogState) -> ConditionUpdate {
    const UNSEEN: &str = "kernel-reported soft lockups, RCU stalls and hung tasks are not seen";
    match state {
        KernelLogState::Watching(source) => ConditionUpdate::new(
            Type::KernelLogUnavailable,
            false,
            Reason::KernelLogWatched,
            format!("reading the kernel log from {source}"),
        ),
        KernelLogState::Disabled => ConditionUpdate::new(
            Type::KernelLogUnavailable,
            true,
            Reason::KernelLogDisabled,
            format!("the kernel log watcher is off (--no-kmsg): {UNSEEN}"),
        ),
        KernelLogState::Unavailable(error) => ConditionUpdate::new(
            Type::KernelLogUnavailable,
            true,
            Reason::KernelLogUnreadable,
            format!("{error}: {UNSEEN}"),
        ),
    }
}

/// The pools kubelet should report: persistent pages of every targeted size
/// that pods take through the kubelet (pods claim the pages of a DRA pool
/// from the node's ResourceSlice, slice.rs).
pub fn kubelet_pools(snapshot: &KernelSnapshot, memory: &AgentMemory) -> BTreeMap<PageSize, u64> {
    memory
        .targets
        .iter()
        .filter(|entry| !entry.by_claims())
        .map(|entry| entry.size)
        .filter_map(|size| snapshot.size(size).map(|s| (size, s.pool.persistent())))
        .collect()
}

fn kubelet_condition(snapshot: &KernelSnapshot, memory: &AgentMemory) -> Option<ConditionUpdate> {
    let capacity = memory.kubelet.capacity.as_ref()?;
    let mut stale = Vec::new();
    for (size, pages) in kubelet_pools(snapshot, memory) {
        if hugepool_crds::kubelet::capacity_stale(capacity, size, pages) {
            let kubelet_bytes = capacity.get(&size).copied().unwrap_or(0);
            stale.push(format!(
                "{}: kubelet reports {} bytes ({} pages), the pool is {pages} pages",
                size.resource_name(),
                kubelet_bytes,
                kubelet_bytes / size.bytes()
            ));
        }
    }
    let claim_pools = claim_pools_advertised(snapshot, memory, capacity);
    Some(if stale.is_empty() && !claim_pools.is_empty() {
        ConditionUpdate::new(
            Type::KubeletCapacityStale,
            true,
            Reason::KubeletAdvertisesClaimPool,
            claim_pools.join("; "),
        )
    } else if stale.is_empty() {
        ConditionUpdate::new(
            Type::KubeletCapacityStale,
            false,
            Reason::CapacityMatches,
            "kubelet capacity matches the pools",
        )
    } else if let Some(failure) = memory
        .kubelet
        .failure
        .as_ref()
        .filter(|f| f.pools == kubelet_pools(snapshot, memory))
    {
        ConditionUpdate::new(
            Type::KubeletCapacityStale,
            true,
            Reason::KubeletRestartFailed,
            format!(
                "{}; restarting kubelet failed: {}",
                stale.join("; "),
                failure.message
            ),
        )
    } else if let Some(held) = memory.kubelet.memory_manager.holds_restart() {
        ConditionUpdate::new(
            Type::KubeletCapacityStale,
            true,
            Reason::MemoryManagerAssignments,
            format!("{}; {held}", stale.join("; ")),
        )
    } else if memory.kubelet.restarted_for.as_ref() == Some(&kubelet_pools(snapshot, memory)) {
        ConditionUpdate::new(
            Type::KubeletCapacityStale,
            true,
            Reason::KubeletRestarted,
            format!(
                "kubelet restarted; waiting for it to report: {}",
                stale.join("; ")
            ),
        )
    } else {
        let mut message = stale.join("; ");
        if memory.kubelet.restarts_disabled {
            message.push_str(
                "; this agent does not restart the kubelet (no --kubelet-restart-command: \
                 the chart's agent.kubeletRestart.enabled is false)",
            );
        }
        ConditionUpdate::new(
            Type::KubeletCapacityStale,
            true,
            Reason::KubeletRestartRequired,
            message,
        )
    })
}

/// Pools taken through claims whose pages the kubelet advertises as
/// `hugepages-<size>` (it read the pool when it last started: a restart
/// after the pool grew): pods that request the size may be placed on them,
/// and claims get only the rest. Each part names the size, the pool, the
/// pages and how many of those claims hold too (offered both ways).
fn claim_pools_advertised(
    snapshot: &KernelSnapshot,
    memory: &AgentMemory,
    capacity: &BTreeMap<PageSize, u64>,
) -> Vec<String> {
    memory
        .targets
        .iter()
        .filter(|entry| entry.by_claims())
        .filter_map(|entry| {
            let size = entry.size;
            let advertised = capacity.get(&size).copied().unwrap_or(0) / size.bytes();
            if advertised == 0 {
                return None;
            }
            let pool = snapshot.size(size).map_or(0, |s| s.pool.persistent());
            let held = crate::dra::claimed_of(&memory.claimed, size, None);
            let mut part = format!(
                "{}: the kubelet advertises {advertised} of the {pool} pages of pool {}, \
                 which pods take through ResourceClaims (it read the pool when it last \
                 started): pods that request {} may be placed on them, and claims get \
                 only the rest",
                size.resource_name(),
                entry.pool,
                size.resource_name()
            );
            let both = (advertised + held).saturating_sub(pool);
            if both > 0 {
                part.push_str(&format!(
                    "; {both} of the {held} pages claims hold are offered both ways"
                ));
            }
            Some(part)
        })
        .collect()
}

/// Builds the whole status. `conditions` is the agent's own condition list,
/// updated in place so that `lastTransitionTime` only moves on a change.
pub fn build(
    snapshot: &KernelSnapshot,
    memory: &AgentMemory,
    conditions_list: &mut Vec<Condition>,
    now: &Time,
) -> HugePageNodeStatus {
    for update in conditions(snapshot, memory) {
        set_condition(conditions_list, update, now);
    }
    let page_sizes: Vec<PageSizeStatus> = snapshot
        .sizes
        .iter()
        .map(|sizes| {
            let entry = memory.targets.iter().find(|t| t.size == sizes.size);
            let status = size_status(
                sizes,
                entry,
                memory.sizes.get(&sizes.size),
                &memory.obtainable,
            );
            let claimed = |numa: Option<i32>| {
                let numa = numa.map(|n| u32::try_from(n).unwrap_or(u32::MAX));
                let pages = crate::dra::claimed_of(&memory.claimed, sizes.size, numa);
                (pages > 0).then(|| i64::try_from(pages).unwrap_or(i64::MAX))
            };
            PageSizeStatus {
                requested: requested_pages(memory, sizes.size),
                claimed: claimed(None),
                numa: status
                    .numa
                    .into_iter()
                    .map(|n| NumaStatus {
                        claimed: claimed(Some(n.id)),
                        ..n
                    })
                    .collect(),
                ..status
            }
        })
        .collect();
    HugePageNodeStatus {
        summary: Some(summary(&page_sizes, &memory.targets)),
        observed_generation: memory.generation,
        kernel: Some(KernelInfo {
            release: snapshot.release.clone(),
            hvo: snapshot.hvo.unwrap_or(false),
        }),
        memory: Some(MemoryInfo {
            total_bytes: snapshot.memory.total_bytes as i64,
            available_bytes: snapshot.memory.available_bytes as i64,
        }),
        page_sizes,
        conditions: conditions_list.clone(),
        memory_manager_pods: memory_manager_pods(conditions_list, memory),
        // The operator's (claims.rs there): never in the agent's apply.
        allocated_claims: Vec::new(),
    }
}

/// Pages of `size` the node's pods request, once the pod watch has
/// listed them (`None` before: unknown, not zero).
fn requested_pages(memory: &AgentMemory, size: PageSize) -> Option<i64> {
    let requested = memory.requested.as_ref()?;
    Some(i64::try_from(requested.get(&size).copied().unwrap_or(0)).unwrap_or(i64::MAX))
}

/// `status.summary`: every size with pages or a target as
/// `SIZE:TOTAL/TARGET` (`-` for no target, and for the total of a targeted
/// size the kernel does not offer), smallest first, or `none`.
pub fn summary(page_sizes: &[PageSizeStatus], targets: &[PageSizeTarget]) -> String {
    let mut shown: Vec<(PageSize, Option<i64>, Option<i64>)> = page_sizes
        .iter()
        .filter(|s| s.total > 0 || s.target.is_some())
        .map(|s| (s.size, Some(s.total), s.target))
        .collect();
    for target in targets {
        if !page_sizes.iter().any(|s| s.size == target.size) {
            shown.push((target.size, None, Some(target.pages)));
        }
    }
    if shown.is_empty() {
        return "none".into();
    }
    shown.sort_by_key(|(size, _, _)| *size);
    let count = |n: Option<i64>| n.map_or_else(|| "-".to_string(), |n| n.to_string());
    shown
        .iter()
        .map(|(size, total, target)| format!("{size}:{}/{}", count(*total), count(*target)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The pods a held kubelet restart waits for (KubeletCapacityStale, reason
/// MemoryManagerAssignments): the UIDs the operator drains.
fn memory_manager_pods(conditions: &[Condition], memory: &AgentMemory) -> Vec<String> {
    let held = find_condition(conditions, Type::KubeletCapacityStale).is_some_and(|c| {
        c.status == "True" && c.reason == Reason::MemoryManagerAssignments.as_str()
    });
    match &memory.kubelet.memory_manager {
        MemoryManagerView::Static(assignments) if held => {
            assignments.iter().map(|a| a.pod_uid.clone()).collect()
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{MemInfo, NumaCounts, PoolCounts};
    use hugepool_crds::conditions::{NodeConditionType, find_condition};

    fn snapshot(total: u64, free: u64, reserved: u64, surplus: u64) -> KernelSnapshot {
        KernelSnapshot {
            release: "6.18.44".into(),
            hvo: Some(true),
            memory: MemInfo {
                total_bytes: 24 << 30,
                available_bytes: 20 << 30,
            },
            sizes: vec![
                SizeSnapshot {
                    size: PageSize::SIZE_2MI,
                    pool: PoolCounts {
                        total,
                        free,
                        reserved,
                        surplus,
                    },
                    numa: vec![NumaCounts {
                        node: 0,
                        total,
                        free,
                        surplus,
                    }],
                },
                SizeSnapshot {
                    size: PageSize::SIZE_1GI,
                    pool: PoolCounts::default(),
                    numa: vec![],
                },
            ],
            free_lists: Err("not read in this test".into()),
        }
    }

    fn target(size: &str, pages: i64) -> PageSizeTarget {
        PageSizeTarget {
            pool: "p".into(),
            pool_generation: 1,
            ..PageSizeTarget::new(size.parse().unwrap(), pages)
        }
    }

    fn memory(targets: Vec<PageSizeTarget>) -> AgentMemory {
        AgentMemory {
            generation: Some(3),
            targets,
            ..Default::default()
        }
    }

    fn built(snapshot: &KernelSnapshot, memory: &AgentMemory) -> HugePageNodeStatus {
        let now = Time(jiff::Timestamp::from_second(1_700_000_000).unwrap());
        build(snapshot, memory, &mut Vec::new(), &now)
    }

    fn cond(status: &HugePageNodeStatus, t: NodeConditionType) -> &Condition {
        find_condition(&status.conditions, t).unwrap_or_else(|| panic!("no {t} condition"))
    }

    #[test]
    fn the_summary_shows_every_size_with_pages_or_a_target_smallest_first() {
        // 2Mi at 64 of 64, 1Gi targeted at 4 but still empty: both shown
        // (a `[*]` printer column would show only the first).
        let status = built(
            &snapshot(64, 64, 0, 0),
            &memory(vec![target("1Gi", 4), target("2Mi", 64)]),
        );
        assert_eq!(status.summary.as_deref(), Some("2Mi:64/64 1Gi:0/4"));
        // Pages of a size no pool targets: shown, with no target.
        let status = built(&snapshot(10, 10, 0, 0), &memory(vec![]));
        assert_eq!(status.summary.as_deref(), Some("2Mi:10/-"));
        // Nothing held, nothing targeted.
        let status = built(&snapshot(0, 0, 0, 0), &memory(vec![]));
        assert_eq!(status.summary.as_deref(), Some("none"));
        // A target of a size this kernel does not offer: no total.
        let status = built(
            &snapshot(8, 8, 0, 0),
            &memory(vec![target("2Mi", 8), target("16Gi", 1)]),
        );
        assert_eq!(status.summary.as_deref(), Some("2Mi:8/8 16Gi:-/1"));
    }

    #[test]
    fn a_pool_short_at_start_is_restoring_until_it_is_back_and_the_kubelet_reports_it() {
        let mi2 = PageSize::SIZE_2MI;
        let targets = vec![target("2Mi", 64), target("1Gi", 0)];
        // A reboot: the kernel's pool empty, the target still 64.
        let short = short_at_start(
            &targets,
            &BTreeMap::from([(mi2, 0), (PageSize::SIZE_1GI, 0)]),
        );
        assert_eq!(short, BTreeMap::from([(mi2, 64)]));
        // An agent restarted on a converged node restores nothing.
        assert!(short_at_start(&targets, &BTreeMap::from([(mi2, 64)])).is_empty());

        let mut memory = memory(targets);
        memory.restoring = short;
        memory.kubelet.capacity = Some(BTreeMap::from([(mi2, 0)]));
        let empty = snapshot(0, 0, 0, 0);
        settle_restoring(&empty, &mut memory);
        let restoring = built(&empty, &memory);
        let condition = cond(&restoring, NodeConditionType::Restoring);
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("True", "PoolsShortAtStart")
        );
        assert!(
            condition.message.contains("2Mi: 0 of 64 pages")
                && condition.message.contains("hugepool.dev/not-ready"),
            "{}",
            condition.message
        );
        // Back in the kernel, but the kubelet still reports 0: still restoring.
        let back = snapshot(64, 64, 0, 0);
        settle_restoring(&back, &mut memory);
        assert_eq!(memory.restoring, BTreeMap::from([(mi2, 64)]));
        assert_eq!(
            cond(&built(&back, &memory), NodeConditionType::Restoring).status,
            "True"
        );
        // The kubelet reports it: settled for good.
        memory.kubelet.capacity = Some(BTreeMap::from([(mi2, 64 * mi2.bytes())]));
        settle_restoring(&back, &mut memory);
        assert!(memory.restoring.is_empty());
        let ready = built(&back, &memory);
        let condition = cond(&ready, NodeConditionType::Restoring);
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("False", "PoolsReady")
        );
    }

    #[test]
    fn a_restore_recorded_at_start_survives_a_status_write_before_the_first_converge() {
        let mi2 = PageSize::SIZE_2MI;
        // As the agent starts its memory holds no targets yet.
        let mut memory = AgentMemory::default();
        start_restoring(
            &mut memory,
            Some(3),
            &[target("2Mi", 64)],
            &BTreeMap::from([(mi2, 0)]),
        );
        // The status writer wakes before the resize loop has run once.
        let empty = snapshot(0, 0, 0, 0);
        settle_restoring(&empty, &mut memory);
        assert_eq!(memory.restoring, BTreeMap::from([(mi2, 64)]));
        assert_eq!(memory.generation, Some(3));
        assert_eq!(
            cond(&built(&empty, &memory), NodeConditionType::Restoring).status,
            "True"
        );
    }

    #[test]
    fn a_restart_held_by_the_memory_manager_lists_the_pods_for_the_operator() {
        let mi2 = PageSize::SIZE_2MI;
        let mut memory = memory(vec![target("2Mi", 64)]);
        // The pool grew to 64; the kubelet still reports 0.
        memory.kubelet.capacity = Some(BTreeMap::from([(mi2, 0)]));
        memory.kubelet.memory_manager =
            MemoryManagerView::Static(vec![crate::kubelet_state::Assignment {
                pod_uid: "uid-1".into(),
                containers: vec!["main".into()],
                resources: vec!["hugepages-2Mi".into(), "memory".into()],
            }]);
        let grown = snapshot(64, 64, 0, 0);
        let status = built(&grown, &memory);
        let stale = cond(&status, NodeConditionType::KubeletCapacityStale);
        assert_eq!(
            (stale.status.as_str(), stale.reason.as_str()),
            ("True", "MemoryManagerAssignments")
        );
        assert_eq!(status.memory_manager_pods, ["uid-1"]);
        // The kubelet reports the pool: nothing waits, nothing to drain.
        memory.kubelet.capacity = Some(BTreeMap::from([(mi2, 64 * mi2.bytes())]));
        assert!(built(&grown, &memory).memory_manager_pods.is_empty());
        // No assignment: the restart goes ahead, nothing to drain either.
        memory.kubelet.capacity = Some(BTreeMap::from([(mi2, 0)]));
        memory.kubelet.memory_manager = MemoryManagerView::Static(Vec::new());
        let status = built(&grown, &memory);
        assert_eq!(
            cond(&status, NodeConditionType::KubeletCapacityStale).reason,
            "KubeletRestartRequired"
        );
        assert!(status.memory_manager_pods.is_empty());
    }

    #[test]
    fn a_new_target_ends_a_restore_it_is_a_rollout_from_then_on() {
        let mi2 = PageSize::SIZE_2MI;
        let mut memory = memory(vec![target("2Mi", 128)]);
        memory.restoring = BTreeMap::from([(mi2, 64)]);
        settle_restoring(&snapshot(0, 0, 0, 0), &mut memory);
        assert!(memory.restoring.is_empty());
    }

    #[test]
    fn an_unreadable_kernel_log_is_reported_with_the_error_never_silently() {
        let snapshot = snapshot(0, 0, 0, 0);
        let mut memory = memory(vec![]);
        memory.kernel_log = KernelLogState::Watching("syslog(2)".into());
        let watching = built(&snapshot, &memory);
        let condition = cond(&watching, NodeConditionType::KernelLogUnavailable);
        assert_eq!(
            (
                condition.status.as_str(),
                condition.reason.as_str(),
                condition.message.as_str()
            ),
            (
                "False",
                "KernelLogWatched",
                "reading the kernel log from syslog(2)"
            )
        );

        memory.kernel_log =
            KernelLogState::Unavailable("reading /dev/kmsg: Operation not permitted".into());
        let refused = built(&snapshot, &memory);
        let condition = cond(&refused, NodeConditionType::KernelLogUnavailable);
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("True", "KernelLogUnreadable")
        );
        assert!(
            condition
                .message
                .starts_with("reading /dev/kmsg: Operation not permitted: "),
            "{}",
            condition.message
        );

        memory.kernel_log = KernelLogState::Disabled;
        let off = built(&snapshot, &memory);
        assert_eq!(
            cond(&off, NodeConditionType::KernelLogUnavailable).reason,
            "KernelLogDisabled"
        );
    }

    #[test]
    fn at_target_is_converged_with_counts_from_the_kernel() {
        let status = built(
            &snapshot(4096, 1000, 10, 0),
            &memory(vec![target("2Mi", 4096)]),
        );
        assert_eq!(status.observed_generation, Some(3));
        let two_mi = &status.page_sizes[0];
        assert_eq!(
            (
                two_mi.size,
                two_mi.target,
                two_mi.total,
                two_mi.free,
                two_mi.reserved,
                two_mi.in_use
            ),
            (PageSize::SIZE_2MI, Some(4096), 4096, 1000, 10, 3096)
        );
        assert_eq!(two_mi.numa[0].total, 4096);
        assert_eq!(status.page_sizes[1].target, None, "1Gi has no target");
        let converged = cond(&status, NodeConditionType::Converged);
        assert_eq!(
            (converged.status.as_str(), converged.reason.as_str()),
            ("True", "AtTarget")
        );
        assert_eq!(converged.observed_generation, Some(3));
        assert_eq!(
            cond(&status, NodeConditionType::ShrinkBlocked).status,
            "False"
        );
        assert_eq!(cond(&status, NodeConditionType::Resizing).reason, "Idle");
        assert!(
            find_condition(&status.conditions, NodeConditionType::KubeletCapacityStale).is_none(),
            "no Node read yet"
        );
    }

    #[test]
    fn pages_prepared_claims_hold_block_the_shrink_and_are_named() {
        // 60 free pages, target 10, 50 held by prepared DRA claims.
        let mut held = memory(vec![target("2Mi", 10)]);
        held.prepared = crate::dra::Claimed::from([((PageSize::SIZE_2MI, 0), 50)]);
        held.claimed = held.prepared.clone();
        let status = built(&snapshot(60, 60, 0, 0), &held);
        let blocked = cond(&status, NodeConditionType::ShrinkBlocked);
        assert_eq!(
            (blocked.status.as_str(), blocked.reason.as_str()),
            ("True", "PagesInUse")
        );
        assert!(
            blocked
                .message
                .contains("target 10 is below the 50 pages claims hold (DRA: 50 prepared by the kubelet, 0 allocated by the scheduler"),
            "{}",
            blocked.message
        );
        // The operator reads the claimed pages from the status to drain.
        let two_mi = &status.page_sizes[0];
        assert_eq!(
            (two_mi.claimed, two_mi.numa[0].claimed),
            (Some(50), Some(50))
        );
        assert_eq!(status.page_sizes[1].claimed, None, "no 1Gi claim");
        // Without the claims the same node is merely away from its target.
        let status = built(&snapshot(60, 60, 0, 0), &memory(vec![target("2Mi", 10)]));
        assert_eq!(
            cond(&status, NodeConditionType::ShrinkBlocked).status,
            "False"
        );
        assert_eq!(status.page_sizes[0].claimed, None);
    }

    #[test]
    fn pages_in_use_above_target_block_the_shrink_with_counts() {
        // 60 pages in use, target 10: the engine stopped at the floor of 60.
        let status = built(&snapshot(60, 0, 0, 0), &memory(vec![target("2Mi", 10)]));
        let blocked = cond(&status, NodeConditionType::ShrinkBlocked);
        assert_eq!(
            (blocked.status.as_str(), blocked.reason.as_str()),
            ("True", "PagesInUse")
        );
        assert!(
            blocked.message.contains("target 10") && blocked.message.contains("60 pages in use"),
            "{}",
            blocked.message
        );
        let converged = cond(&status, NodeConditionType::Converged);
        assert_eq!(
            (converged.status.as_str(), converged.reason.as_str()),
            ("False", "PagesInUse")
        );
    }

    #[test]
    fn surplus_is_not_converged_even_at_the_count() {
        let status = built(&snapshot(100, 0, 0, 50), &memory(vec![target("2Mi", 50)]));
        assert_eq!(cond(&status, NodeConditionType::Converged).status, "False");
        assert_eq!(
            cond(&status, NodeConditionType::ShrinkBlocked).status,
            "True"
        );
    }

    #[test]
    fn shortfall_sets_allocation_failed_with_the_reason_and_numbers() {
        let memory = with_outcome(
            memory(vec![target("2Mi", 6000)]),
            6000,
            Outcome::Shortfall {
                requested: 6000,
                achieved: 4057,
                reason: ShortfallReason::MemoryGuard,
                detail: None,
            },
        );
        let status = built(&snapshot(4057, 4057, 0, 0), &memory);
        let failed = cond(&status, NodeConditionType::AllocationFailed);
        assert_eq!(
            (failed.status.as_str(), failed.reason.as_str()),
            ("True", "MemoryGuard")
        );
        assert!(
            failed
                .message
                .contains("requested 6000, achieved 4057, short 1943"),
            "{}",
            failed.message
        );
        assert_eq!(
            cond(&status, NodeConditionType::Converged).reason,
            "AllocationShortfall"
        );
    }

    #[test]
    fn a_running_resize_and_a_stall_show() {
        let mut memory = memory(vec![target("2Mi", 4096)]);
        memory.sizes.insert(
            PageSize::SIZE_2MI,
            SizeRecord {
                running: Some(Running {
                    direction: Direction::Shrink,
                    from: 8192,
                    target: 4096,
                }),
                stall: Some(StallRecord {
                    reason: Reason::SoftLockup,
                    message: "kernel: watchdog: BUG: soft lockup".into(),
                }),
                ..Default::default()
            },
        );
        let status = built(&snapshot(6000, 6000, 0, 0), &memory);
        let resizing = cond(&status, NodeConditionType::Resizing);
        assert_eq!(
            (resizing.status.as_str(), resizing.reason.as_str()),
            ("True", "Shrinking")
        );
        assert!(resizing.message.contains("8192 -> 4096"));
        let stalled = cond(&status, NodeConditionType::Stalled);
        assert_eq!(
            (stalled.status.as_str(), stalled.reason.as_str()),
            ("True", "SoftLockup")
        );
        assert!(stalled.message.contains("soft lockup"));
    }

    #[test]
    fn unsupported_size_is_reported_not_attempted() {
        let status = built(&snapshot(0, 0, 0, 0), &memory(vec![target("16Gi", 2)]));
        let converged = cond(&status, NodeConditionType::Converged);
        assert_eq!(
            (converged.status.as_str(), converged.reason.as_str()),
            ("False", "UnsupportedPageSize")
        );
        assert!(
            converged.message.contains("offered: 2Mi, 1Gi"),
            "{}",
            converged.message
        );
    }

    #[test]
    fn kubelet_capacity_compared_in_bytes() {
        let mut memory = memory(vec![target("2Mi", 512)]);
        memory.kubelet.capacity = Some(BTreeMap::from([(PageSize::SIZE_2MI, 0)]));
        let status = built(&snapshot(512, 512, 0, 0), &memory);
        let stale = cond(&status, NodeConditionType::KubeletCapacityStale);
        assert_eq!(
            (stale.status.as_str(), stale.reason.as_str()),
            ("True", "KubeletRestartRequired")
        );
        memory.kubelet.restarted_for = Some(BTreeMap::from([(PageSize::SIZE_2MI, 512)]));
        assert_eq!(
            cond(
                &built(&snapshot(512, 512, 0, 0), &memory),
                NodeConditionType::KubeletCapacityStale
            )
            .reason,
            "KubeletRestarted"
        );
        memory.kubelet.capacity = Some(BTreeMap::from([(
            PageSize::SIZE_2MI,
            512 * 2 * 1024 * 1024,
        )]));
        let matches = built(&snapshot(512, 512, 0, 0), &memory);
        assert_eq!(
            cond(&matches, NodeConditionType::KubeletCapacityStale).status,
            "False"
        );
    }

    #[test]
    fn a_pool_claimed_through_dra_needs_no_kubelet_to_report_it() {
        let mut claimed = target("2Mi", 512);
        claimed.consumption = Some(hugepool_crds::settings::Consumption::DynamicResourceAllocation);
        let mut memory = memory(vec![claimed]);
        memory.kubelet.capacity = Some(BTreeMap::from([(PageSize::SIZE_2MI, 0)]));
        let snapshot = snapshot(512, 512, 0, 0);
        assert!(kubelet_pools(&snapshot, &memory).is_empty());
        let status = built(&snapshot, &memory);
        assert_ne!(
            cond(&status, NodeConditionType::KubeletCapacityStale).status,
            "True"
        );
    }

    // A kubelet restarted after a DRA pool grew advertises the pool: pods
    // that request hugepages-2Mi may be placed on its pages, some of which
    // claims hold. Said on the node, with how many are offered both ways.
    #[test]
    fn a_kubelet_that_advertises_a_claim_pool_is_named_with_the_pages_offered_both_ways() {
        let mut claimed = target("2Mi", 20);
        claimed.consumption = Some(hugepool_crds::settings::Consumption::DynamicResourceAllocation);
        let mut memory = memory(vec![claimed]);
        // All 20 advertised, 10 held by a prepared claim.
        memory.kubelet.capacity = Some(BTreeMap::from([(PageSize::SIZE_2MI, 40 << 20)]));
        memory.claimed = crate::dra::Claimed::from([((PageSize::SIZE_2MI, 0), 10)]);
        let status = built(&snapshot(20, 10, 0, 0), &memory);
        let stale = cond(&status, NodeConditionType::KubeletCapacityStale);
        assert_eq!(
            (stale.status.as_str(), stale.reason.as_str()),
            ("True", "KubeletAdvertisesClaimPool")
        );
        assert!(
            stale
                .message
                .contains("the kubelet advertises 20 of the 20 pages of pool p")
                && stale
                    .message
                    .contains("10 of the 10 pages claims hold are offered both ways"),
            "{}",
            stale.message
        );
        // 5 advertised: claims get 15, and the 10 they hold are not offered
        // to pods that request the size.
        memory.kubelet.capacity = Some(BTreeMap::from([(PageSize::SIZE_2MI, 10 << 20)]));
        let stale = cond(
            &built(&snapshot(20, 10, 0, 0), &memory),
            NodeConditionType::KubeletCapacityStale,
        )
        .clone();
        assert_eq!(stale.reason, "KubeletAdvertisesClaimPool");
        assert!(!stale.message.contains("both ways"), "{}", stale.message);
        // None advertised: nothing to say.
        memory.kubelet.capacity = Some(BTreeMap::from([(PageSize::SIZE_2MI, 0)]));
        assert_eq!(
            cond(
                &built(&snapshot(20, 10, 0, 0), &memory),
                NodeConditionType::KubeletCapacityStale
            )
            .status,
            "False"
        );
    }

    #[test]
    fn kubelet_restart_failures_and_disabled_restarts_are_said() {
        let mut memory = memory(vec![target("2Mi", 512)]);
        memory.kubelet.capacity = Some(BTreeMap::from([(PageSize::SIZE_2MI, 0)]));
        memory.kubelet.restarts_disabled = true;
        let disabled = built(&snapshot(512, 512, 0, 0), &memory);
        let stale = cond(&disabled, NodeConditionType::KubeletCapacityStale);
        assert_eq!(stale.reason, "KubeletRestartRequired");
        assert!(
            stale.message.contains("does not restart the kubelet"),
            "{}",
            stale.message
        );

        memory.kubelet.restarts_disabled = false;
        memory.kubelet.failure = Some(RestartFailure {
            pools: BTreeMap::from([(PageSize::SIZE_2MI, 512)]),
            attempts: 2,
            message: "systemctl exited with 1 (attempt 2, next in 20s)".into(),
            retry_at: std::time::Instant::now(),
        });
        let failed = built(&snapshot(512, 512, 0, 0), &memory);
        let stale = cond(&failed, NodeConditionType::KubeletCapacityStale);
        assert_eq!(
            (stale.status.as_str(), stale.reason.as_str()),
            ("True", "KubeletRestartFailed")
        );
        assert!(stale.message.contains("attempt 2"), "{}", stale.message);
        // A failure for other pools says nothing about these.
        memory.kubelet.failure.as_mut().unwrap().pools = BTreeMap::from([(PageSize::SIZE_2MI, 64)]);
        let other = built(&snapshot(512, 512, 0, 0), &memory);
        assert_eq!(
            cond(&other, NodeConditionType::KubeletCapacityStale).reason,
            "KubeletRestartRequired"
        );
    }

    #[test]
    fn numa_targets_must_each_match() {
        let mut entry = target("2Mi", 4096);
        entry.numa = Some(vec![hugepool_crds::settings::NumaTarget {
            id: 0,
            pages: 4000,
        }]);
        let status = built(&snapshot(4096, 4096, 0, 0), &memory(vec![entry]));
        assert_eq!(cond(&status, NodeConditionType::Converged).status, "False");
    }

    fn real_free_lists() -> crate::kernel::freelists::FreeLists {
        use crate::kernel::freelists::{buddyinfo, pagetypeinfo};
        use std::path::Path;
        let mut lists = crate::kernel::freelists::FreeLists::of_files(
            buddyinfo(
                Path::new("buddyinfo"),
                include_str!("../../tests/fixtures/freelists/buddyinfo.real"),
            )
            .unwrap(),
            pagetypeinfo(
                Path::new("pagetypeinfo"),
                include_str!("../../tests/fixtures/freelists/pagetypeinfo.real"),
            )
            .unwrap(),
        );
        lists.mem_available = 8 << 30;
        lists
    }

    // The development machine's files give 2Mi (4576 now, 4955 after
    // compaction) and 1Gi (0, 8) with no guard (freelists.rs tests). With
    // 8 GiB available, the 2Mi target's 100Mi guard + 32Mi of headroom
    // leaves (8192 - 132) / 2 = 4030 pages. 1Gi: no clean range of 1 GiB
    // on that machine, nothing.
    #[test]
    fn what_a_grow_can_get_shows_per_size_and_numa_node_under_each_guard() {
        let mut snapshot = snapshot(0, 0, 0, 0);
        snapshot.free_lists = Ok(real_free_lists());
        let mut entry = target("2Mi", 8);
        entry.allocation.min_mem_available = "100Mi".into();
        let mut memory = memory(vec![entry]);
        let fresh = obtainable(&snapshot, &memory.targets);
        settle_obtainable(&mut memory, &fresh, Instant::now());
        let status = built(&snapshot, &memory);
        let pages = |now, after_compaction| {
            Some(ObtainablePages {
                now,
                after_compaction,
            })
        };
        assert_eq!(status.page_sizes[0].obtainable, pages(4576, 4030));
        assert_eq!(status.page_sizes[0].numa[0].obtainable, pages(4576, 4030));
        assert_eq!(status.page_sizes[1].obtainable, pages(0, 0));
        // A size with no target keeps the default guard (1Gi + 32Mi):
        // (8192 - 1056) / 2 = 3568 pages.
        let fresh = obtainable(&snapshot, &[]);
        assert_eq!(
            fresh
                .get(&(PageSize::SIZE_2MI, None))
                .map(|e| e.after_compaction),
            Some(3568)
        );

        // Unreadable free lists (no root, no mount): nothing is claimed.
        snapshot.free_lists = Err("permission denied".into());
        let fresh = obtainable(&snapshot, &memory.targets);
        settle_obtainable(&mut memory, &fresh, Instant::now());
        let status = built(&snapshot, &memory);
        assert_eq!(status.page_sizes[0].obtainable, None);
        assert_eq!(status.page_sizes[0].numa[0].obtainable, None);
    }

    /// What a 2Mi grow can get machine-wide: `now` and after compaction.
    fn estimates_2mi(
        now: u64,
        after_compaction: u64,
    ) -> BTreeMap<(PageSize, Option<u32>), GrowEstimate> {
        BTreeMap::from([(
            (PageSize::SIZE_2MI, None),
            GrowEstimate {
                obtainable_now: now,
                after_compaction,
            },
        )])
    }

    #[test]
    fn what_a_grow_can_get_is_shown_at_once_when_it_falls_and_after_a_tenth_when_it_rises() {
        let at = estimates_2mi;
        let mut memory = AgentMemory::default();
        let start = Instant::now();
        // Each settle is a refresh long after the last: both figures count.
        let mut clock = start;
        let mut settle = |memory: &mut AgentMemory, fresh| {
            clock += ESTIMATE_SHOWN_FOR;
            settle_obtainable(memory, &fresh, clock)
        };
        assert!(settle(&mut memory, at(1000, 2000)));
        // Rises of 9% and falls of 2% keep what the status shows.
        assert!(!settle(&mut memory, at(1090, 1960)));
        assert_eq!(memory.obtainable, at(1000, 2000));
        // A fall of 3% on one figure replaces both: the status never
        // promises more than 2% above what the kernel's lists give.
        settle(&mut memory, at(1090, 1940));
        assert_eq!(memory.obtainable, at(1090, 1940));
        // A fall of 9% (kept by the old rule, a tenth either way) shows.
        settle(&mut memory, at(1090, 1766));
        assert_eq!(memory.obtainable, at(1090, 1766));
        // A rise of 11% on one figure replaces both.
        settle(&mut memory, at(1090, 1985));
        assert_eq!(memory.obtainable, at(1090, 1985));
        // From nothing to something, and back, always shows.
        settle(&mut memory, at(0, 1985));
        assert_eq!(memory.obtainable, at(0, 1985));
        settle(&mut memory, at(1, 1985));
        assert_eq!(memory.obtainable, at(1, 1985));
        // A size that went is dropped.
        settle(&mut memory, BTreeMap::new());
        assert!(memory.obtainable.is_empty());
    }

    // A busy node: the page cache fills and is dropped between refreshes,
    // so the free blocks a grow gets at once swing by half while what it
    // gets after compaction (page cache reclaimed) stays. Measured before:
    // a status write at every refresh (6 in 120 s; ~500 writes a second
    // from a fleet of 10,000).
    #[test]
    fn a_busy_node_shows_free_blocks_at_most_every_few_minutes_and_a_plans_figure_at_once() {
        let key = (PageSize::SIZE_2MI, None);
        let at = estimates_2mi;
        let refresh = Duration::from_secs(15);
        let start = Instant::now();
        let mut memory = AgentMemory::default();
        assert!(settle_obtainable(&mut memory, &at(8000, 9000), start));
        let mut writes = 0;
        let mut clock = start;
        // Ten minutes of refreshes, the cache filled and dropped by turns.
        for round in 1..=40u32 {
            clock = start + refresh * round;
            let now = if round % 2 == 1 { 4000 } else { 8000 };
            if settle_obtainable(&mut memory, &at(now, 9000), clock) {
                writes += 1;
            }
        }
        // Once at 5 minutes and once at 10 (round 20 and 40: back at 8000
        // then, so the first is a no-op and only the next fall shows).
        assert!(
            (1..=2).contains(&writes),
            "{writes} writes of free blocks in 10 minutes"
        );
        // The shown figure is never older than ESTIMATE_SHOWN_FOR plus a
        // refresh.
        let shown_at = memory.obtainable_shown_at.expect("shown");
        assert!(clock.duration_since(shown_at) <= ESTIMATE_SHOWN_FOR + refresh);
        // What a plan rests on shows at the next refresh, however recent
        // the last write: a fall of 3% after compaction.
        let shown = memory.obtainable[&key];
        clock += refresh;
        assert!(settle_obtainable(
            &mut memory,
            &at(shown.obtainable_now, 8730),
            clock
        ));
        assert_eq!(memory.obtainable[&key].after_compaction, 8730);
        // So does a NUMA node or size that came or went.
        let mut more = at(shown.obtainable_now, 8730);
        more.insert((PageSize::SIZE_2MI, Some(0)), GrowEstimate::default());
        assert!(settle_obtainable(&mut memory, &more, clock + refresh));
        assert!(!settle_obtainable(&mut memory, &more, clock + refresh * 2));
    }

    /// Two NUMA nodes: `(total, free)` on each, the size's pool their sum.
    fn two_nodes(node0: (u64, u64), node1: (u64, u64)) -> KernelSnapshot {
        let mut snapshot = snapshot(node0.0 + node1.0, node0.1 + node1.1, 0, 0);
        snapshot.sizes[0].numa = vec![
            NumaCounts {
                node: 0,
                total: node0.0,
                free: node0.1,
                surplus: 0,
            },
            NumaCounts {
                node: 1,
                total: node1.0,
                free: node1.1,
                surplus: 0,
            },
        ];
        snapshot
    }

    fn split(pages: [i64; 2]) -> PageSizeTarget {
        let mut entry = target("2Mi", pages[0] + pages[1]);
        entry.numa = Some(
            pages
                .iter()
                .enumerate()
                .map(|(id, &pages)| hugepool_crds::settings::NumaTarget {
                    id: id as i32,
                    pages,
                })
                .collect(),
        );
        entry
    }

    #[test]
    fn a_shortfall_on_one_numa_node_is_reported_against_that_nodes_target() {
        // 512 + 512 asked; node 1 reached only 300 of its 512.
        let mut memory = memory(vec![split([512, 512])]);
        let shortfall = Outcome::Shortfall {
            requested: 512,
            achieved: 300,
            reason: ShortfallReason::Fragmented,
            detail: None,
        };
        memory.sizes.insert(
            PageSize::SIZE_2MI,
            SizeRecord {
                outcomes: BTreeMap::from([
                    (PoolScope::Node(0), (512, Outcome::Reached)),
                    (PoolScope::Node(1), (512, shortfall)),
                ]),
                ..Default::default()
            },
        );
        let status = built(&two_nodes((512, 512), (300, 300)), &memory);
        let failed = cond(&status, NodeConditionType::AllocationFailed);
        assert_eq!(
            (failed.status.as_str(), failed.reason.as_str()),
            ("True", "Fragmented")
        );
        assert!(
            failed
                .message
                .contains("2Mi NUMA node 1: requested 512, achieved 300, short 212"),
            "{}",
            failed.message
        );
        assert_eq!(
            cond(&status, NodeConditionType::Converged).reason,
            "AllocationShortfall"
        );
    }

    #[test]
    fn a_shrink_blocked_on_one_numa_node_is_blocked_though_the_node_total_is_not() {
        // 1000 + 1000 -> 900 + 100: node 1 has 400 pages in use. The
        // node-wide floor (400) is below the total target (1000).
        let memory = memory(vec![split([900, 100])]);
        let status = built(&two_nodes((1000, 1000), (400, 0)), &memory);
        let blocked = cond(&status, NodeConditionType::ShrinkBlocked);
        assert_eq!(
            (blocked.status.as_str(), blocked.reason.as_str()),
            ("True", "PagesInUse")
        );
        assert!(
            blocked
                .message
                .contains("2Mi NUMA node 1: target 100 is below 400 pages in use"),
            "{}",
            blocked.message
        );
    }

    #[test]
    fn the_right_total_in_the_wrong_numa_split_is_not_converged() {
        let memory = memory(vec![split([512, 512])]);
        let status = built(&two_nodes((1024, 1024), (0, 0)), &memory);
        let converged = cond(&status, NodeConditionType::Converged);
        assert_eq!(converged.status, "False", "{}", converged.message);
        assert_eq!(
            cond(
                &built(&two_nodes((512, 512), (512, 512)), &memory),
                NodeConditionType::Converged
            )
            .status,
            "True"
        );
    }

    fn with_outcome(mut memory: AgentMemory, target: u64, outcome: Outcome) -> AgentMemory {
        memory.sizes.insert(
            PageSize::SIZE_2MI,
            SizeRecord {
                outcomes: BTreeMap::from([(PoolScope::Global, (target, outcome))]),
                ..Default::default()
            },
        );
        memory
    }

    #[test]
    fn writes_that_change_nothing_are_a_stall_and_only_a_grow_also_falls_short() {
        let no_progress = |requested, achieved| Outcome::Shortfall {
            requested,
            achieved,
            reason: ShortfallReason::NoProgress,
            detail: None,
        };
        // A shrink 1000 -> 200 whose writes left the pool at 1000.
        let shrink = with_outcome(
            memory(vec![target("2Mi", 200)]),
            200,
            no_progress(200, 1000),
        );
        let status = built(&snapshot(1000, 1000, 0, 0), &shrink);
        let stalled = cond(&status, NodeConditionType::Stalled);
        assert_eq!(
            (stalled.status.as_str(), stalled.reason.as_str()),
            ("True", "NoProgress")
        );
        assert!(
            stalled
                .message
                .contains("writes toward 200 changed nothing (pool at 1000)"),
            "{}",
            stalled.message
        );
        assert_eq!(
            cond(&status, NodeConditionType::AllocationFailed).status,
            "False",
            "a shrink allocates nothing"
        );
        assert_eq!(
            cond(&status, NodeConditionType::Converged).reason,
            "Stalled"
        );

        // A grow 0 -> 500 stuck at 100: stalled, and short of its allocation.
        let grow = with_outcome(memory(vec![target("2Mi", 500)]), 500, no_progress(500, 100));
        let status = built(&snapshot(100, 100, 0, 0), &grow);
        assert_eq!(
            cond(&status, NodeConditionType::Stalled).reason,
            "NoProgress"
        );
        let failed = cond(&status, NodeConditionType::AllocationFailed);
        assert_eq!(failed.status, "True");
        assert!(failed.message.contains("short 400"), "{}", failed.message);
    }

    #[test]
    fn out_of_range_targets_are_invalid_not_read_as_zero() {
        let snapshot = snapshot(64, 64, 0, 0);
        let mut negative = target("2Mi", -1);
        assert_eq!(
            progress(&negative, &snapshot, &Default::default()),
            Progress::Invalid("2Mi: -1 pages is out of range (0 to 16777216)".into())
        );
        negative.pages = MAX_PAGES + 1;
        assert!(matches!(
            progress(&negative, &snapshot, &Default::default()),
            Progress::Invalid(_)
        ));
        let mut numa = target("2Mi", 64);
        numa.numa = Some(vec![hugepool_crds::settings::NumaTarget {
            id: -1,
            pages: 64,
        }]);
        assert_eq!(
            progress(&numa, &snapshot, &Default::default()),
            Progress::Invalid("2Mi: NUMA node -1 is out of range".into())
        );
        numa.numa = Some(vec![hugepool_crds::settings::NumaTarget {
            id: 0,
            pages: -5,
        }]);
        assert_eq!(
            out_of_range(&numa).as_deref(),
            Some("2Mi: NUMA node 0: -5 pages is out of range (0 to 16777216)")
        );
        let status = built(&snapshot, &memory(vec![numa]));
        let converged = cond(&status, NodeConditionType::Converged);
        assert_eq!(
            (converged.status.as_str(), converged.reason.as_str()),
            ("False", "InvalidTarget")
        );
    }

    #[test]
    fn a_numa_node_the_machine_lacks_is_an_invalid_target() {
        let mut entry = target("2Mi", 64);
        entry.numa = Some(vec![
            hugepool_crds::settings::NumaTarget { id: 0, pages: 32 },
            hugepool_crds::settings::NumaTarget { id: 3, pages: 32 },
        ]);
        let status = built(&snapshot(0, 0, 0, 0), &memory(vec![entry]));
        let converged = cond(&status, NodeConditionType::Converged);
        assert_eq!(
            (converged.status.as_str(), converged.reason.as_str()),
            ("False", "InvalidTarget")
        );
        assert!(
            converged
                .message
                .contains("2Mi: NUMA node 3 not on this machine (it has 0)"),
            "{}",
            converged.message
        );
    }

    #[test]
    fn requested_pages_are_reported_per_size_once_the_pods_are_listed() {
        let mut agent = memory(vec![target("2Mi", 64)]);
        let unknown = built(&snapshot(64, 64, 0, 0), &agent);
        assert!(unknown.page_sizes.iter().all(|s| s.requested.is_none()));
        agent.requested = Some(BTreeMap::from([(PageSize::SIZE_2MI, 40)]));
        let status = built(&snapshot(64, 34, 0, 0), &agent);
        let requested: Vec<(String, Option<i64>, i64)> = status
            .page_sizes
            .iter()
            .map(|s| (s.size.to_string(), s.requested, s.in_use))
            .collect();
        assert_eq!(
            requested,
            [("2Mi".into(), Some(40), 30), ("1Gi".into(), Some(0), 0)]
        );
    }
}
