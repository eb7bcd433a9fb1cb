//! `kubectl hugepool status`: pools and their nodes at a glance, as the
//! operator's planner sees the live cluster.

use hugepool_crds::conditions::find_condition;
use hugepool_crds::{PageSize, PoolConditionType};
use jiff::Timestamp;
use serde::Serialize;

use super::plan::ClusterView;
use crate::planner::NodeState;

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolRow {
    pub name: String,
    pub page_size: PageSize,
    /// Pages per node (`spec.pages`, or `spec.memory` over the page size).
    pub pages: Option<i64>,
    pub selected: i64,
    pub converged: i64,
    pub changing: i64,
    pub pending: i64,
    pub failed: i64,
    pub stalled: usize,
    /// Shrinks blocked by pages in use: draining (IfNeeded) or reported only (Never).
    pub blocked: usize,
    pub paused: bool,
    /// Degraded's reason while it is True, else Progressing's.
    pub reason: String,
    pub message: String,
    /// Available: whether pods can get the pool's pages on every selected
    /// node, and if not why (a finished rollout on stale kubelets is not).
    pub available: ConditionRow,
    pub nodes: Vec<NodeRow>,
}

/// One pool condition as the planner sees the cluster now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionRow {
    /// True, False or Unknown.
    pub status: String,
    pub reason: String,
    pub message: String,
}

impl ConditionRow {
    /// `True`, or `False/REASON` (what blocks it).
    pub fn short(&self) -> String {
        if self.status == "True" || self.reason.is_empty() {
            self.status.clone()
        } else {
            format!("{}/{}", self.status, self.reason)
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRow {
    pub node: String,
    /// Converged, Changing, Pending, Failed or Conflict.
    pub state: String,
    pub current: i64,
    pub target: Option<i64>,
    pub stalled: bool,
    pub blocked: bool,
    /// Why it failed, or which pool owns it.
    pub reason: String,
}

/// Every pool (or only `only`), with its nodes.
pub fn report(view: &ClusterView<'_>, only: Option<&str>, now: Timestamp) -> Vec<PoolRow> {
    let plan = view.plan(now);
    let mut rows = Vec::new();
    for pool in view.pools {
        let name = pool.metadata.name.clone().unwrap_or_default();
        if only.is_some_and(|only| only != name) {
            continue;
        }
        let Some(pool_plan) = plan.pools.get(&name) else {
            continue;
        };
        let counts = &pool_plan.status.nodes;
        let conditions = &pool_plan.status.conditions;
        let degraded =
            find_condition(conditions, PoolConditionType::Degraded).filter(|c| c.status == "True");
        let shown = degraded.or_else(|| find_condition(conditions, PoolConditionType::Progressing));
        let available = find_condition(conditions, PoolConditionType::Available)
            .map(|c| ConditionRow {
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
            })
            .unwrap_or_else(|| ConditionRow {
                status: "Unknown".into(),
                ..ConditionRow::default()
            });
        let mut nodes: Vec<NodeRow> = pool_plan
            .members
            .iter()
            .map(|m| {
                let (state, reason) = match &m.state {
                    NodeState::Converged => ("Converged", String::new()),
                    NodeState::Updating => ("Changing", String::new()),
                    NodeState::Pending => ("Pending", String::new()),
                    NodeState::Failed { reason, message } => {
                        ("Failed", format!("{reason}: {message}"))
                    }
                };
                NodeRow {
                    node: m.node.clone(),
                    state: state.to_string(),
                    current: m.current,
                    target: m.target,
                    stalled: m.stalled,
                    blocked: m.shrink_blocked,
                    reason,
                }
            })
            .collect();
        for (node, owner) in &pool_plan.conflicts {
            nodes.push(NodeRow {
                node: node.clone(),
                state: "Conflict".into(),
                current: 0,
                target: None,
                stalled: false,
                blocked: false,
                reason: format!("owned by the older pool {owner}"),
            });
        }
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        rows.push(PoolRow {
            name,
            page_size: pool.spec.page_size,
            pages: pool.spec.pages.or_else(|| {
                let memory =
                    hugepool_crds::quantity::parse_bytes(pool.spec.memory.as_deref()?).ok()?;
                i64::try_from(memory / pool.spec.page_size.bytes()).ok()
            }),
            selected: counts.selected,
            converged: counts.converged,
            changing: counts.updating,
            pending: counts.pending,
            failed: counts.failed,
            stalled: pool_plan.stalled.len(),
            blocked: pool_plan
                .members
                .iter()
                .filter(|m| m.shrink_blocked)
                .count(),
            paused: pool.spec.rollout.paused,
            reason: shown.map(|c| c.reason.clone()).unwrap_or_default(),
            message: shown.map(|c| c.message.clone()).unwrap_or_default(),
            available,
            nodes,
        });
    }
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    rows
}
