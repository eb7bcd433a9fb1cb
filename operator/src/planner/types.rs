//! What a plan says: per node its spec and drain, per pool its status.

use super::*;

/// What the cluster should look like after this pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Per Node name: its HugePageNode's spec and drain state.
    pub nodes: BTreeMap<String, NodePlan>,
    /// Per pool name: its status and whether its finalizer may go.
    pub pools: BTreeMap<String, PoolPlan>,
    /// The earliest time something is due without any watch event (a drain
    /// deadline); the controller requeues for it.
    pub next_deadline: Option<Timestamp>,
}

impl Plan {
    /// Nodes whose HugePageNode spec must be written (created or changed).
    pub fn spec_writes(&self) -> impl Iterator<Item = (&String, &NodePlan)> {
        self.nodes.iter().filter(|(_, node)| node.spec_changed)
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodePlan {
    /// The whole desired `.spec`; entries sorted by page size.
    pub spec: HugePageNodeSpec,
    /// The HugePageNode is missing or its spec differs from `spec`.
    pub spec_changed: bool,
    pub drain: DrainPlan,
    /// Whether `hugepool.dev/not-ready:NoSchedule` should be on the Node
    /// (see [`not_ready_taint`]).
    pub not_ready_taint: bool,
}

/// The drain state a node should be in (policy IfNeeded, docs/design.md).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DrainPlan {
    /// Whether the `hugepool.dev/draining:NoSchedule` taint should be on the Node.
    pub taint: bool,
    /// The operator-owned Draining condition to set; None leaves it as it is.
    pub condition: Option<ConditionUpdate>,
    /// Evict the pods on the node that request these page sizes now.
    pub evict: Vec<PageSize>,
    /// Evict these pods (UIDs) now: the kubelet's Static Memory Manager holds
    /// memory for them, and the kubelet restart a pool asks for waits for them.
    pub evict_pods: Vec<String>,
    /// For each size in `evict`, the pool whose shrink the eviction is for.
    pub shrink_pools: BTreeMap<PageSize, String>,
    /// The pools whose kubelet restart waits for `evict_pods`.
    pub restart_pools: Vec<String>,
    /// Pools the drain is for, oldest first (events and metrics name them).
    pub pools: Vec<String>,
    /// When the running drain fails with DrainTimeout.
    pub deadline: Option<Timestamp>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolPlan {
    /// The complete status to write (conditions keep their transition times).
    pub status: HugePagePoolStatus,
    /// The pool is being deleted and has nothing left on any node.
    pub remove_finalizer: bool,
    /// `maxUnavailable` resolved against the nodes the pool manages.
    pub max_unavailable: usize,
    /// Nodes whose target this pass moves for the pool, in admission order.
    pub admitted: Vec<String>,
    /// Nodes the pool selects that an older pool owns, with that pool's name.
    pub conflicts: Vec<(String, String)>,
    /// Nodes where the pool's shrink is blocked by pages in use and its
    /// drain policy is Never.
    pub blocked: Vec<String>,
    /// Nodes where the pool's shrink is held by the pages ResourceClaims
    /// hold there (any drain policy).
    pub held_by_claims: Vec<String>,
    /// Nodes whose agent reports Stalled.
    pub stalled: Vec<String>,
    /// Converged nodes whose kubelet reports a different `hugepages-<size>`
    /// capacity than the pool (pods cannot use the pages until it restarts).
    pub capacity_stale: Vec<String>,
    /// Converged nodes of a pool taken through claims whose kubelet
    /// advertises its pages as `hugepages-<size>`.
    pub advertising_claim_pool: Vec<String>,
    /// Nodes being drained for the pool.
    pub draining: Vec<String>,
    /// Nodes of the pool whose Node still carries the draining taint
    /// (a taint write still to land): the pool is not Available before it
    /// goes, or pods would wait on a node the pool calls done.
    pub tainted: Vec<String>,
    /// Failed nodes whose drain timed out.
    pub drain_timeouts: Vec<String>,
    /// Nodes of the pool the operator could not write to, with the error.
    pub write_errors: Vec<(String, String)>,
    /// Nodes with work left for the pool that do not answer, with why.
    pub unresponsive: Vec<(String, String)>,
    /// Nodes holding a rollout slot that have not answered yet, each with
    /// when it will be passed over unless it answers.
    pub silent: Vec<(String, Timestamp)>,
    /// Every node the pool manages, by name, with where it stands.
    pub members: Vec<PoolMember>,
    /// The pool's page size (its pages in bytes, for the metrics).
    pub page_size: Option<PageSize>,
}

/// One node of a pool as the planner sees it (`kubectl hugepool status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolMember {
    pub node: String,
    pub state: NodeState,
    /// Pages of the pool's size the node reports now.
    pub current: i64,
    /// Pages of the size the node's pods request, once its agent reports it.
    pub requested: Option<i64>,
    /// Pages of the size processes have mapped there.
    pub in_use: i64,
    /// The target the pool wants there, once it can be computed.
    pub target: Option<i64>,
    pub stalled: bool,
    pub shrink_blocked: bool,
}

/// Where one node stands for one pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// At the pool's current target.
    Converged,
    /// Its target moved and it has not reported converged for it yet.
    Updating,
    /// Waiting for a rollout slot.
    Pending,
    /// Failed at its current target; keeps its rollout slot.
    Failed { reason: String, message: String },
}

/// How one (node, page size) entry is doing at its current target, as the
/// agent reports it (the contract in docs/design.md, "The operator").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryState {
    Converged,
    InFlight,
    Failed { reason: String, message: String },
}

/// Reads the agent's report of `entry` on `node_state` (see [`EntryState`]).
/// Converged for target T: the agent has seen this generation, the size is
/// at T with no surplus, and the node has not failed.
pub fn entry_state(node_state: &HugePageNode, entry: &PageSizeTarget) -> EntryState {
    let generation = node_state.metadata.generation.unwrap_or(0);
    let Some(status) = &node_state.status else {
        return EntryState::InFlight;
    };
    let observed = status.observed_generation.is_some_and(|g| g >= generation);
    let current = |condition: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition| {
        condition
            .observed_generation
            .is_none_or(|g| g >= generation)
    };
    if let Some(timeout) = find_condition(&status.conditions, NodeConditionType::Draining)
        && timeout.status == "False"
        && timeout.reason == Reason::DrainTimeout.as_str()
        && timeout.observed_generation.is_some_and(|g| g >= generation)
    {
        return EntryState::Failed {
            reason: Reason::DrainTimeout.to_string(),
            message: timeout.message.clone(),
        };
    }
    if !observed {
        return EntryState::InFlight;
    }
    if let Some(failed) = find_condition(&status.conditions, NodeConditionType::AllocationFailed)
        && failed.status == "True"
        && current(failed)
    {
        return EntryState::Failed {
            reason: NodeConditionType::AllocationFailed.to_string(),
            message: format!("{}: {}", failed.reason, failed.message),
        };
    }
    // A kubelet that did not come back after its restart fails the node as
    // a shortfall does: it keeps its rollout slot, so that failures halt the
    // rollout at maxUnavailable and no more kubelets are restarted for it.
    if let Some(stale) = find_condition(&status.conditions, NodeConditionType::KubeletCapacityStale)
        && stale.status == "True"
        && stale.reason == Reason::KubeletRestartFailed.as_str()
        && current(stale)
    {
        return EntryState::Failed {
            reason: Reason::KubeletRestartFailed.to_string(),
            message: stale.message.clone(),
        };
    }
    if let Some(converged) = find_condition(&status.conditions, NodeConditionType::Converged)
        && converged.status == "False"
        && current(converged)
        && [Reason::UnsupportedPageSize, Reason::InvalidTarget]
            .iter()
            .any(|r| r.as_str() == converged.reason)
    {
        return EntryState::Failed {
            reason: converged.reason.clone(),
            message: converged.message.clone(),
        };
    }
    let at_target = status
        .page_sizes
        .iter()
        .any(|reported| reported.target == Some(entry.pages) && entry.reached_by(reported));
    if at_target {
        EntryState::Converged
    } else {
        EntryState::InFlight
    }
}
