//! `HugePagePool`: what a cluster operator asks for: a page size and a count
//! per node on the nodes a selector picks, and how carefully to get there.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::settings::{
    AllocationSettings, Consumption, DeletionPolicy, DrainPolicy, KubeletRestart, NumaPolicy,
    NumaTarget, ResizeSettings,
};

/// Schema pattern of a page size: a power of two in canonical binary form.
pub const PAGE_SIZE_PATTERN: &str = r"^(1|2|4|8|16|32|64|128|256|512)(Ki|Mi|Gi|Ti)$";

/// The operators of a label selector's `matchExpressions`.
pub const SELECTOR_OPERATORS: [&str; 4] = ["In", "NotIn", "Exists", "DoesNotExist"];

/// Makes the apiserver refuse the selector requirements that Kubernetes
/// refuses only when the selector is used (k8s-openapi's schema says just
/// "a string" and "an array"): an operator other than
/// [`SELECTOR_OPERATORS`], no values for In and NotIn, values for Exists
/// and DoesNotExist. Each refusal names `matchExpressions[i]`'s field.
fn selector_requirements(schema: &mut schemars::Schema) {
    let Some(requirement) = schema
        .get_mut("properties")
        .and_then(|properties| properties.get_mut("matchExpressions"))
        .and_then(|expressions| expressions.get_mut("items"))
        .and_then(serde_json::Value::as_object_mut)
    else {
        return;
    };
    if let Some(operator) = requirement
        .get_mut("properties")
        .and_then(|properties| properties.get_mut("operator"))
        .and_then(serde_json::Value::as_object_mut)
    {
        operator.insert("enum".into(), serde_json::json!(SELECTOR_OPERATORS));
    }
    requirement.insert(
        "x-kubernetes-validations".into(),
        serde_json::json!([{
            "rule": "self.operator == 'In' || self.operator == 'NotIn' ? has(self.values) && size(self.values) > 0 : !has(self.values) || size(self.values) == 0",
            "message": "values must be non-empty for operator In and NotIn, and empty for Exists and DoesNotExist",
            "fieldPath": ".values",
        }]),
    );
}

#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "hugepool.dev",
    version = "v1alpha1",
    kind = "HugePagePool",
    shortname = "hpp",
    category = "hugepool",
    status = "HugePagePoolStatus",
    derive = "PartialEq",
    doc = "A hugetlb page pool to hold on every node a selector picks",
    printcolumn(name = "Size", type_ = "string", json_path = ".spec.pageSize"),
    printcolumn(name = "Pages", type_ = "integer", json_path = ".status.pagesPerNode", description = "pages per node: spec.pages, or spec.memory over pageSize"),
    printcolumn(name = "Memory", type_ = "string", json_path = ".spec.memory", priority = 1),
    printcolumn(name = "Converged", type_ = "string", json_path = ".status.nodes.ready", description = "converged/selected nodes"),
    printcolumn(name = "Available", type_ = "string", json_path = ".status.conditions[?(@.type==\"Available\")].status"),
    printcolumn(name = "Degraded", type_ = "string", json_path = ".status.conditions[?(@.type==\"Degraded\")].status"),
    printcolumn(name = "Reason", type_ = "string", json_path = ".status.conditions[?(@.type==\"Available\")].reason", description = "why the pool is or is not Available"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("has(self.spec.pages) != has(self.spec.memory)").message("exactly one of spec.pages and spec.memory must be set").field_path(".spec"),
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
/// What the pool holds on each selected node and how the change rolls out.
#[x_kube(validation = Rule::new("!has(self.memory) || quantity(self.memory).asInteger() % quantity(self.pageSize).asInteger() == 0").message("memory must be a multiple of pageSize").field_path(".memory"))]
#[x_kube(validation = Rule::new("!has(self.numa) || self.numa.policy != 'Explicit' || !has(self.pages) || self.numa.nodes.map(n, n.pages).sum() == self.pages").message("numa.nodes pages must add up to pages").field_path(".numa.nodes"))]
#[x_kube(validation = Rule::new("!has(self.consumption) || self.consumption != 'DynamicResourceAllocation' || !has(self.kubelet) || !has(self.kubelet.restart) || self.kubelet.restart != 'AfterResize'").message("kubelet.restart AfterResize cannot be set with consumption DynamicResourceAllocation: pods take its pages through ResourceClaims, which need no kubelet restart").field_path(".kubelet.restart"))]
#[x_kube(validation = Rule::new("has(self.consumption) == has(oldSelf.consumption) && (!has(self.consumption) || self.consumption == oldSelf.consumption)").message("consumption is immutable: create another pool to change how pods take the pages").field_path(".consumption"))]
pub struct HugePagePoolSpec {
    /// Nodes this pool applies to; `{}` selects every node.
    #[serde(default)]
    #[schemars(transform = selector_requirements)]
    pub node_selector: LabelSelector,
    /// Huge page size, such as 2Mi or 1Gi. Immutable.
    #[schemars(regex(pattern = PAGE_SIZE_PATTERN), length(max = 8))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("pageSize is immutable"))]
    pub page_size: crate::PageSize,
    /// Pages per node (at most 16777216: 32 TiB of 2Mi pages). Exactly one of
    /// pages and memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 16777216))]
    pub pages: Option<i64>,
    /// Memory per node as a quantity, a multiple of pageSize. Exactly one of pages and memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crate::quantity::BYTES_PATTERN), length(max = 32))]
    pub memory: Option<String>,
    /// Placement on NUMA nodes; absent means Spread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<NumaSpec>,
    #[serde(default)]
    pub resize: ResizeSettings,
    #[serde(default)]
    pub allocation: AllocationSettings,
    /// How many nodes change at once.
    #[serde(default)]
    pub rollout: RolloutSpec,
    /// Whether and how long pods holding the pages are evicted so a shrink can finish.
    #[serde(default)]
    pub drain: DrainSpec,
    /// Whether the agent restarts the kubelet so it reports the new capacity.
    #[serde(default)]
    pub kubelet: KubeletSpec,
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// How pods take the pages: Kubelet (absent; `hugepages-<size>`
    /// requests) or DynamicResourceAllocation (ResourceClaims, with no
    /// kubelet restart). Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumption: Option<Consumption>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("self.policy == 'Explicit' ? has(self.nodes) && size(self.nodes) > 0 : !has(self.nodes)").message("numa.nodes is required with policy Explicit and not allowed otherwise").field_path(".nodes"))]
pub struct NumaSpec {
    /// Spread (evenly over the node's NUMA nodes) or Explicit (the counts in nodes).
    #[serde(default)]
    pub policy: NumaPolicy,
    /// Explicit per-NUMA-node counts; ids must be unique.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub nodes: Option<Vec<NumaTarget>>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutSpec {
    /// Nodes changing at once: an integer 1-100000 or a percentage 1%-100% (rounded up).
    #[serde(default = "default_max_unavailable")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 1 && self <= 100000 : self.matches('^([1-9][0-9]?|100)%$')").message("maxUnavailable must be an integer 1-100000 or a percentage 1%-100%"))]
    pub max_unavailable: IntOrString,
    /// A paused rollout admits no new nodes; nodes already changing finish.
    #[serde(default)]
    pub paused: bool,
    /// A node whose Node has been NotReady this long, or whose agent has not
    /// acknowledged its spec this long, is unresponsive: it gets no rollout
    /// slot (one it holds goes back) until it answers (Go duration, > 0, at
    /// most 24h).
    #[serde(default = "default_unresponsive_after")]
    #[schemars(regex(pattern = crate::duration::PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')").message("rollout.unresponsiveAfter must be greater than 0"))]
    #[x_kube(validation = Rule::new("duration(self) <= duration('24h')").message("rollout.unresponsiveAfter must be at most 24h"))]
    pub unresponsive_after: String,
}

fn default_max_unavailable() -> IntOrString {
    IntOrString::String("25%".into())
}

fn default_unresponsive_after() -> String {
    "5m".into()
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            max_unavailable: default_max_unavailable(),
            paused: false,
            unresponsive_after: default_unresponsive_after(),
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DrainSpec {
    /// IfNeeded evicts pods that hold pages a shrink needs; Never only reports them.
    #[serde(default)]
    pub policy: DrainPolicy,
    /// How long evictions may take before the node fails with DrainTimeout
    /// (Go duration, > 0, at most 24h).
    #[serde(default = "default_drain_timeout")]
    #[schemars(regex(pattern = crate::duration::PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')").message("drain.timeout must be greater than 0"))]
    #[x_kube(validation = Rule::new("duration(self) <= duration('24h')").message("drain.timeout must be at most 24h"))]
    pub timeout: String,
}

fn default_drain_timeout() -> String {
    "10m".into()
}

impl Default for DrainSpec {
    fn default() -> Self {
        Self {
            policy: DrainPolicy::default(),
            timeout: default_drain_timeout(),
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeletSpec {
    /// Never, or AfterResize: restart the kubelet once the node has converged
    /// (the kubelet reads hugepage capacity only when it starts).
    #[serde(default)]
    pub restart: KubeletRestart,
}

/// Where the pool's rollout stands, written by the operator.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HugePagePoolStatus {
    /// The pool generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pages per node the pool asks for: `spec.pages`, or `spec.memory`
    /// over `pageSize` (for `kubectl get hpp`); absent while the spec is
    /// invalid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages_per_node: Option<i64>,
    /// Selected nodes by where they stand.
    #[serde(default)]
    pub nodes: PoolNodeCounts,
    /// Pages over all selected nodes.
    #[serde(default)]
    pub pages: PoolPages,
    /// Up to 10 failed nodes with their reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub failed_nodes: Vec<FailedNode>,
    /// The last 10 pods a drain for this pool evicted, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub evicted_pods: Vec<EvictedPod>,
    /// Available, Progressing and Degraded (docs/design.md, "Conditions").
    /// At most 16, each message at most 1024 characters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    #[x_kube(validation = Rule::new("self.all(c, size(c.message) <= 1024)").message("a condition message is at most 1024 characters"))]
    pub conditions: Vec<Condition>,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolNodeCounts {
    /// Nodes the pool selects (or still releases).
    pub selected: i64,
    /// Nodes at the pool's current target.
    pub converged: i64,
    /// Nodes whose target moved and that have not reported converged yet.
    pub updating: i64,
    /// Nodes waiting for a rollout slot (or owned by an older pool).
    pub pending: i64,
    /// Nodes that failed at their current target; they keep their slot.
    pub failed: i64,
    /// Nodes with work left that do not answer (NotReady, or their agent has
    /// not acknowledged their spec within `rollout.unresponsiveAfter`); they
    /// hold no slot and are not counted as updating, pending or failed.
    #[serde(default)]
    pub unresponsive: i64,
    /// `converged/selected`, for `kubectl get hpp`.
    #[serde(default)]
    pub ready: String,
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolPages {
    /// Sum of per-node targets.
    pub target: i64,
    /// Sum of the pages the nodes report (allocated: `total`, surplus
    /// included).
    pub current: i64,
    /// Sum of the pages of the pool's size that pods bound to the nodes
    /// request (`hugepages-<size>`), over the nodes whose agent reports it.
    #[serde(default)]
    pub requested: i64,
    /// Sum of the pages processes have mapped (the kernel's `total - free`).
    #[serde(default)]
    pub in_use: i64,
    /// Pages allocated that no pod requests: per node `current - requested`
    /// (at least 0), summed over the nodes whose agent reports requests.
    /// Memory reserved for huge pages that nothing can use until a pod asks.
    #[serde(default)]
    pub unrequested: i64,
}

/// The most pods `status.evictedPods` lists.
pub const MAX_EVICTED_PODS: usize = 10;

/// One pod a drain evicted, and why.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EvictedPod {
    /// `namespace/name`.
    #[schemars(length(max = 317))]
    pub pod: String,
    /// The Node it ran on.
    #[schemars(length(max = 253))]
    pub node: String,
    /// The pod's UID: one record per pod, however often it was asked for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 64))]
    pub uid: String,
    /// Huge pages of the pool's size its requests held.
    pub pages: i64,
    /// Why it was chosen: the pages the node's shrink needed back.
    #[serde(default)]
    #[schemars(length(max = 1024))]
    pub reason: String,
    /// When the Eviction API accepted it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evicted_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

impl EvictedPod {
    /// Whether both record the same pod.
    pub fn same_pod(&self, other: &EvictedPod) -> bool {
        if self.uid.is_empty() || other.uid.is_empty() {
            self.pod == other.pod && self.node == other.node
        } else {
            self.uid == other.uid
        }
    }
}

impl HugePagePoolStatus {
    /// Appends `evicted` to the list, keeping the newest
    /// [`MAX_EVICTED_PODS`].
    /// A pod already listed (same UID, or same pod and node for a record
    /// without one) is not listed twice.
    pub fn record_evictions(&mut self, evicted: impl IntoIterator<Item = EvictedPod>) {
        for record in evicted {
            if !self.evicted_pods.iter().any(|e| e.same_pod(&record)) {
                self.evicted_pods.push(record);
            }
        }
        let extra = self.evicted_pods.len().saturating_sub(MAX_EVICTED_PODS);
        self.evicted_pods.drain(..extra);
    }
}

#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FailedNode {
    /// The Node's name.
    #[schemars(length(max = 253))]
    pub name: String,
    /// Why it failed: AllocationFailed, DrainTimeout, InvalidSpec, ...
    #[schemars(length(max = 64))]
    pub reason: String,
    /// What its agent or the operator said (at most 1024 characters).
    #[serde(default)]
    #[schemars(length(max = 1024))]
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_evictions_keep_the_newest_ten_in_order() {
        let pod = |i: i64| EvictedPod {
            pod: format!("ns/p{i}"),
            node: "n".into(),
            uid: format!("uid-{i}"),
            pages: i,
            reason: String::new(),
            evicted_at: None,
        };
        let mut status = HugePagePoolStatus::default();
        status.record_evictions((0..4).map(pod));
        status.record_evictions((4..13).map(pod));
        let pages: Vec<i64> = status.evicted_pods.iter().map(|e| e.pages).collect();
        assert_eq!(pages, (3..13).collect::<Vec<_>>());
    }

    #[test]
    fn a_pod_asked_for_twice_is_recorded_once() {
        let record = |uid: &str, pages: i64| EvictedPod {
            pod: "ns/p".into(),
            node: "n".into(),
            uid: uid.into(),
            pages,
            reason: String::new(),
            evicted_at: None,
        };
        let mut status = HugePagePoolStatus::default();
        status.record_evictions([record("a", 1)]);
        status.record_evictions([record("a", 2), record("b", 3)]);
        let kept: Vec<(String, i64)> = status
            .evicted_pods
            .iter()
            .map(|e| (e.uid.clone(), e.pages))
            .collect();
        // The first record stays; a pod re-created under the name is another.
        assert_eq!(kept, [("a".to_string(), 1), ("b".to_string(), 3)]);
    }
}
