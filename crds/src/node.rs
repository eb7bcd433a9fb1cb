//! `HugePageNode`: one per selected Node, named after it. The operator writes
//! `.spec` (the targets the agent must reach now); the agent writes `.status`
//! (what the kernel reports, what the last resize did, and conditions).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::settings::{AllocationSettings, KubeletRestart, NumaTarget, ResizeSettings};

// Each printcolumn(...) names its own type_; clippy reads them as one list.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "hugepool.dev",
    version = "v1alpha1",
    kind = "HugePageNode",
    shortname = "hpn",
    status = "HugePageNodeStatus",
    derive = "PartialEq",
    doc = "The hugetlb pool targets of one node and what its agent reports",
    printcolumn(name = "Size", type_ = "string", json_path = ".spec.pageSizes[*].size"),
    printcolumn(
        name = "Target",
        type_ = "string",
        json_path = ".status.pageSizes[*].target"
    ),
    printcolumn(
        name = "Total",
        type_ = "string",
        json_path = ".status.pageSizes[*].total"
    ),
    printcolumn(
        name = "Free",
        type_ = "string",
        json_path = ".status.pageSizes[*].free"
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
    #[schemars(regex(pattern = crate::pool::PAGE_SIZE_PATTERN), length(max = 8))]
    pub size: String,
    /// Persistent pages the agent must reach now.
    #[schemars(range(min = 0))]
    pub pages: i64,
    /// Exact per-NUMA targets; absent means one write of the global file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub numa: Option<Vec<NumaTarget>>,
    /// The pool this target comes from.
    #[serde(default)]
    pub pool: String,
    #[serde(default)]
    pub pool_generation: i64,
    #[serde(default)]
    pub resize: ResizeSettings,
    #[serde(default)]
    pub allocation: AllocationSettings,
    #[serde(default)]
    pub kubelet_restart: KubeletRestart,
}

impl PageSizeTarget {
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

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HugePageNodeStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<KernelInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryInfo>,
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["size".into()]))]
    pub page_sizes: Vec<PageSizeStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct KernelInfo {
    pub release: String,
    /// HugeTLB Vmemmap Optimisation (`vm.hugetlb_optimize_vmemmap`).
    pub hvo: bool,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MemoryInfo {
    pub total_bytes: i64,
    pub available_bytes: i64,
}

/// What the kernel reports for one page size, and the last resize of it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PageSizeStatus {
    pub size: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<i64>,
    /// `nr_hugepages` as the kernel reads it (persistent + surplus).
    pub total: i64,
    pub free: i64,
    pub reserved: i64,
    pub surplus: i64,
    pub in_use: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub numa: Vec<NumaStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_resize: Option<ResizeSummary>,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NumaStatus {
    pub id: i32,
    pub total: i64,
    pub free: i64,
    pub surplus: i64,
}

/// The outcome of one resize, as the agent measured it.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ResizeSummary {
    pub from: i64,
    pub to: i64,
    pub achieved: i64,
    pub steps: i64,
    pub max_step_seconds: f64,
    pub duration_seconds: f64,
    pub pages_per_second: f64,
    /// Reached, Blocked, Short, Stalled or Failed.
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
}
