//! `HugePageNode`: one per selected Node, named after it. The operator writes
//! `.spec` (the targets the agent must reach now); the agent writes `.status`
//! (what the kernel reports, what the last resize did, and conditions).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::settings::{
    AllocationSettings, Consumption, KubeletRestart, NumaTarget, ResizeSettings,
};

// Each printcolumn(...) names its own type_; clippy reads them as one list.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "hugepool.dev",
    version = "v1alpha1",
    kind = "HugePageNode",
    shortname = "hpn",
    category = "hugepool",
    status = "HugePageNodeStatus",
    derive = "PartialEq",
    doc = "The hugetlb pool targets of one node and what its agent reports",
    // One column for every size: a `[*]` path shows only its first match.
    printcolumn(
        name = "Pages",
        type_ = "string",
        json_path = ".status.summary",
        description = "per page size: pages the kernel holds/the target (- for none)"
    ),
    printcolumn(
        name = "Converged",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Converged\")].status"
    ),
    printcolumn(
        name = "Stalled",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Stalled\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
/// The targets the node's agent must reach now, written by the operator.
pub struct HugePageNodeSpec {
    /// One entry per page size, keyed by size.
    #[serde(default)]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["size".into()]))]
    pub page_sizes: Vec<PageSizeTarget>,
}

/// The target of one page size on this node.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PageSizeTarget {
    /// The page size, such as 2Mi or 1Gi.
    #[schemars(regex(pattern = crate::pool::PAGE_SIZE_PATTERN), length(max = 8))]
    pub size: crate::PageSize,
    /// Persistent pages the agent must reach now (at most 16777216, as a
    /// pool's pages).
    #[schemars(range(min = 0, max = 16777216))]
    pub pages: i64,
    /// Exact per-NUMA targets; absent means one write of the global file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub numa: Option<Vec<NumaTarget>>,
    /// The pool this target comes from.
    #[serde(default)]
    pub pool: String,
    /// The pool's generation this target was written for.
    #[serde(default)]
    pub pool_generation: i64,
    #[serde(default)]
    pub resize: ResizeSettings,
    #[serde(default)]
    pub allocation: AllocationSettings,
    #[serde(default)]
    pub kubelet_restart: KubeletRestart,
    /// How pods take the pages, copied from the pool; absent is Kubelet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumption: Option<Consumption>,
}

impl PageSizeTarget {
    /// `pages` of `size`, one global write, every setting at its default,
    /// of no pool yet.
    pub fn new(size: crate::PageSize, pages: i64) -> Self {
        Self {
            size,
            pages,
            numa: None,
            pool: String::new(),
            pool_generation: 0,
            resize: ResizeSettings::default(),
            allocation: AllocationSettings::default(),
            kubelet_restart: KubeletRestart::default(),
            consumption: None,
        }
    }

    /// Whether pods take these pages through ResourceClaims (the agent's
    /// ResourceSlice) rather than the kubelet's `hugepages-<size>`.
    pub fn by_claims(&self) -> bool {
        self.consumption == Some(Consumption::DynamicResourceAllocation)
    }

    /// Whether `reported` (what the kernel holds of this size) is this
    /// target reached: the one definition the operator, the agent and the
    /// tests share. The size's persistent pool is `pages` with no surplus
    /// (surplus pages are in use above a shrunk target), and with per-NUMA
    /// targets every listed NUMA node holds exactly its own, with no
    /// surplus: the right total in the wrong place is not reached.
    pub fn reached_by(&self, reported: &PageSizeStatus) -> bool {
        let numa_reached = self.numa.as_ref().is_none_or(|targets| {
            targets.iter().all(|t| {
                reported
                    .numa
                    .iter()
                    .any(|n| n.id == t.id && n.surplus == 0 && n.total == t.pages)
            })
        });
        reported.size == self.size
            && reported.surplus == 0
            && reported.total == self.pages
            && numa_reached
    }
}

/// What the node's kernel holds and its agent reports, written by the agent.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HugePageNodeStatus {
    /// The generation of `.spec` the agent has seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The running kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<KernelInfo>,
    /// The node's memory from /proc/meminfo.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryInfo>,
    /// Every size with pages or a target, as `SIZE:TOTAL/TARGET` (`-` for
    /// no target), such as `2Mi:64/64 1Gi:2/4`; `none` for no such size.
    /// The agent writes it for `kubectl get hpn`, which can show only one
    /// element of a list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub summary: Option<String>,
    /// Every page size the kernel offers, as it reports it.
    #[serde(default)]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["size".into()]))]
    pub page_sizes: Vec<PageSizeStatus>,
    /// Converged, Resizing, Stalled, AllocationFailed, ShrinkBlocked,
    /// KubeletCapacityStale, KernelLogUnavailable, Restoring (agent) and Draining
    /// (operator): docs/design.md, "Conditions". At most 16, each message
    /// at most 1024 characters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    #[x_kube(validation = Rule::new("self.all(c, size(c.message) <= 1024)").message("a condition message is at most 1024 characters"))]
    pub conditions: Vec<Condition>,
    /// UIDs of the pods the kubelet's Static Memory Manager holds memory for
    /// while a kubelet restart is needed and waits for them (condition
    /// KubeletCapacityStale, reason MemoryManagerAssignments): the operator
    /// drains them under the pool's drain policy. Empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128))]
    pub memory_manager_pods: Vec<String>,
    /// Pages that ResourceClaims allocated on this node hold, by page size
    /// and NUMA node, as the operator last read the claims (written by the
    /// operator, for pools consumed through DRA). The agent holds them
    /// against a shrink from the moment the scheduler allocates a claim,
    /// before the kubelet prepares it. Empty when no claim is allocated
    /// here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128))]
    #[x_kube(merge_strategy = ListMerge::Atomic)]
    pub allocated_claims: Vec<ClaimedPagesOnNuma>,
}

/// Pages of one size that claims allocated on one NUMA node hold.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedPagesOnNuma {
    /// The page size, such as 2Mi or 1Gi.
    #[schemars(regex(pattern = crate::pool::PAGE_SIZE_PATTERN), length(max = 8))]
    pub size: crate::PageSize,
    /// The NUMA node's id.
    #[schemars(range(min = 0, max = 1023))]
    pub numa: i32,
    /// Pages the claims allocated there hold together.
    #[schemars(range(min = 0, max = 16777216))]
    pub pages: i64,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct KernelInfo {
    /// `uname -r`.
    pub release: String,
    /// HugeTLB Vmemmap Optimisation (`vm.hugetlb_optimize_vmemmap`).
    pub hvo: bool,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MemoryInfo {
    /// MemTotal.
    pub total_bytes: i64,
    /// MemAvailable.
    pub available_bytes: i64,
}

/// What the kernel reports for one page size, and the last resize of it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PageSizeStatus {
    /// The page size, such as 2Mi.
    pub size: crate::PageSize,
    /// The target the agent works toward, when `.spec` has one for the size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<i64>,
    /// `nr_hugepages` as the kernel reads it (persistent + surplus).
    pub total: i64,
    /// `free_hugepages`: not mapped by any process (reserved ones included).
    pub free: i64,
    /// `resv_hugepages`: promised to mappings, not faulted in yet.
    pub reserved: i64,
    /// `surplus_hugepages`: in use above the persistent pool.
    pub surplus: i64,
    /// `total - free`: mapped by processes.
    pub in_use: i64,
    /// Pages of this size that the pods bound to the node request
    /// (`hugepages-<size>`, counted as the scheduler counts a pod; ended
    /// pods left out); absent until the agent has listed the node's pods.
    /// `total` less this is memory reserved that no pod asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested: Option<i64>,
    /// Pages of this size that DRA claims hold on the node, faulted or not
    /// (claims the agent's kubelet plugin has prepared); a shrink stops at
    /// them. Absent when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed: Option<i64>,
    /// The same counts per NUMA node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub numa: Vec<NumaStatus>,
    /// Pages of this size a grow could add, over all NUMA nodes, estimated
    /// from the kernel's free lists; absent where the agent cannot read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub obtainable: Option<ObtainablePages>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_resize: Option<ResizeSummary>,
}

impl PageSizeStatus {
    /// A size the kernel holds no pages of.
    pub fn empty(size: crate::PageSize) -> Self {
        Self {
            size,
            target: None,
            total: 0,
            free: 0,
            reserved: 0,
            surplus: 0,
            in_use: 0,
            requested: None,
            claimed: None,
            numa: Vec::new(),
            obtainable: None,
            last_resize: None,
        }
    }
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NumaStatus {
    /// The NUMA node's id.
    pub id: i32,
    /// Its `nr_hugepages`.
    pub total: i64,
    /// Its `free_hugepages`.
    pub free: i64,
    /// Its `surplus_hugepages`.
    pub surplus: i64,
    /// Pages of this size DRA claims hold on this NUMA node (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed: Option<i64>,
    /// Pages of this size a grow on this NUMA node could add.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub obtainable: Option<ObtainablePages>,
}

/// Pages a grow could add to a pool, estimated by the agent from
/// `/proc/buddyinfo` and `/proc/pagetypeinfo` (docs/design.md, "What a grow
/// can get"). Updated when a figure moves by more than a tenth, not on
/// every read.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq,
)]
#[serde(rename_all = "camelCase")]
pub struct ObtainablePages {
    /// Free blocks at or above the page's size: what a grow gets without
    /// compaction (always 0 for 1Gi: the free lists stop at 4 MiB).
    pub now: i64,
    /// What a grow could get after compacting, keeping the pool's
    /// `minMemAvailable` free; never below `now`.
    pub after_compaction: i64,
}

/// The outcome of one resize, as the agent measured it.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ResizeSummary {
    /// Persistent pages when it started.
    pub from: i64,
    /// Its target.
    pub to: i64,
    /// Persistent pages when it ended.
    pub achieved: i64,
    /// Kernel writes it took.
    pub steps: i64,
    /// The longest single write.
    pub max_step_seconds: f64,
    /// From the first write to the end, pauses included.
    pub duration_seconds: f64,
    /// Pages moved per second over the whole resize.
    pub pages_per_second: f64,
    /// Reached, Blocked, Short, Stalled or Failed.
    #[schemars(length(max = 16))]
    pub outcome: String,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
}
