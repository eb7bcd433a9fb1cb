//! `kubectl hugepool plan`: what applying a pool would do, from the
//! operator's own planner run forward over a copy of the live cluster. Each
//! pass admits what the operator would admit; then every agent is assumed to
//! reach its target, and the next pass runs. Nothing is written.

use std::collections::{BTreeMap, BTreeSet};

use hugepool_crds::conditions::{ConditionUpdate, set_condition};
use hugepool_crds::node::{NumaStatus, ObtainablePages, PageSizeStatus, PageSizeTarget};
use hugepool_crds::settings::DrainPolicy;
use hugepool_crds::{HugePageNode, HugePagePool, NodeConditionType, PageSize, Reason};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;

use crate::drain::{self, OnNode};
use crate::planner::{self, NodeState, PlanInput};

/// What applying one pool would do.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanReport {
    pub pool: String,
    /// Whether a pool of that name exists already (the plan is a change).
    pub exists: bool,
    pub page_size: PageSize,
    /// `maxUnavailable` resolved against the nodes the pool would manage.
    pub max_unavailable: usize,
    /// Nodes whose target moves, in the passes the operator would admit them.
    pub waves: Vec<Vec<NodeChange>>,
    /// Selected nodes already at the pool's target.
    pub unchanged: Vec<String>,
    /// Selected nodes an older pool owns for this size: this one waits there.
    pub conflicts: Vec<Conflict>,
    /// Nodes the rollout would not get past, with why (a paused rollout, a
    /// failed node holding its slot, ...).
    pub stuck: Vec<Stuck>,
    /// The sum over waves of each wave's slowest measured estimate.
    pub estimated_seconds: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeChange {
    pub node: String,
    /// Pages of the size the node holds now.
    pub from: i64,
    pub to: i64,
    /// Present when a shrink goes below the pages in use there.
    pub drain: Option<DrainNeed>,
    /// From the node's last measured resize rate of the size.
    pub estimated_seconds: Option<f64>,
    /// For a grow: the pages the node would reach by its agent's estimate of
    /// what a grow can get (`status.pageSizes[].obtainable`, after
    /// compaction and within the memory guard; per NUMA node for split
    /// targets); absent for a shrink or where the agent reports none.
    pub predicted: Option<i64>,
}

impl NodeChange {
    /// Pages the node is predicted to come short of its target.
    pub fn short(&self) -> Option<i64> {
        self.predicted
            .map(|p| self.to - p)
            .filter(|short| *short > 0)
    }
}

/// Where a grow to `entry` would end, from what the node reports: its pages
/// now plus what its free lists give, per NUMA node for a split target.
pub fn predicted_reach(entry: &PageSizeTarget, reported: Option<&PageSizeStatus>) -> Option<i64> {
    let reported = reported?;
    let reach = |now: i64, want: i64, obtainable: Option<&ObtainablePages>| {
        if want <= now {
            return Some(want);
        }
        Some(now + (want - now).min(obtainable?.after_compaction.max(0)))
    };
    match &entry.numa {
        None => reach(reported.total, entry.pages, reported.obtainable.as_ref()),
        Some(targets) => targets
            .iter()
            .map(|t| {
                let node = reported.numa.iter().find(|n| n.id == t.id);
                reach(
                    node.map_or(0, |n| n.total),
                    t.pages,
                    node.and_then(|n| n.obtainable.as_ref()),
                )
            })
            .sum(),
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainNeed {
    /// Pages in use or reserved on the node now, or held by DRA claims
    /// there (whichever is more): what a shrink cannot free.
    pub held: i64,
    /// The pool's drain policy: Never only reports the shrink as blocked.
    pub policy: DrainPolicy,
    /// `namespace/name` of the pods the operator would evict, in its order.
    pub evict: Vec<String>,
    /// Why nothing would be evicted although pages are held.
    pub unexplained: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Conflict {
    pub node: String,
    pub owner: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Stuck {
    pub node: String,
    pub reason: String,
}

/// The live cluster as the planner reads it.
pub struct ClusterView<'a> {
    pub pools: &'a [HugePagePool],
    pub nodes: &'a [Node],
    pub node_states: &'a [HugePageNode],
}

impl ClusterView<'_> {
    /// The operator's planner over this cluster, as a pass at `now` would
    /// plan it (nothing observed of earlier passes).
    pub fn plan(&self, now: Timestamp) -> planner::Plan {
        let nodes: Vec<&Node> = self.nodes.iter().collect();
        let states: Vec<&HugePageNode> = self.node_states.iter().collect();
        planner::plan(&PlanInput {
            observed: &Default::default(),
            pools: self.pools,
            nodes: &nodes,
            node_states: &states,
            now,
            agent_nodes: None,
        })
    }
}

/// Runs the planner forward with `candidate` in place of (or beside) the
/// live pool of its name. `pods` are the pods (and what their claims hold)
/// on each node that would shrink below its pages in use or claimed (see
/// [`nodes_to_drain`]); missing ones count as none.
pub fn simulate(
    view: &ClusterView<'_>,
    candidate: &HugePagePool,
    pods: &BTreeMap<String, OnNode>,
    now: Timestamp,
) -> PlanReport {
    let name = candidate.metadata.name.clone().unwrap_or_default();
    let size = candidate.spec.page_size;
    let exists = view
        .pools
        .iter()
        .any(|p| p.metadata.name.as_deref() == Some(name.as_str()));
    let mut pools: Vec<HugePagePool> = view
        .pools
        .iter()
        .filter(|p| p.metadata.name.as_deref() != Some(name.as_str()))
        .cloned()
        .collect();
    let mut candidate = candidate.clone();
    if !exists {
        // Not created yet (a dry run stamps it now): the planner ranks a
        // pool without a creationTimestamp newest, as it will be.
        candidate.metadata.creation_timestamp = None;
    }
    pools.push(candidate.clone());
    let mut states: Vec<HugePageNode> = view.node_states.to_vec();
    let before: BTreeMap<String, PageSizeStatus> = states
        .iter()
        .filter_map(|s| {
            let reported = s
                .status
                .as_ref()?
                .page_sizes
                .iter()
                .find(|r| r.size == size)?;
            Some((s.metadata.name.clone()?, reported.clone()))
        })
        .collect();
    let node_refs: Vec<&Node> = view.nodes.iter().collect();

    let mut waves = Vec::new();
    let mut first = None;
    let mut last = None;
    // Each pass admits at least one node or ends the loop; two more let new
    // HugePageNodes be created and the last wave be seen converged.
    for _ in 0..view.nodes.len() + 3 {
        let state_refs: Vec<&HugePageNode> = states.iter().collect();
        let plan = planner::plan(&PlanInput {
            observed: &Default::default(),
            pools: &pools,
            nodes: &node_refs,
            node_states: &state_refs,
            now,
            agent_nodes: None,
        });
        let Some(pool_plan) = plan.pools.get(&name).cloned() else {
            break;
        };
        first.get_or_insert_with(|| pool_plan.clone());
        let wave: Vec<NodeChange> = pool_plan
            .admitted
            .iter()
            .filter_map(|node| {
                let entry = plan
                    .nodes
                    .get(node)?
                    .spec
                    .page_sizes
                    .iter()
                    .find(|e| e.pool == name)?;
                let to = entry.pages;
                let reported = before.get(node);
                let from = reported.map_or(0, |r| r.total);
                let predicted = (to > from)
                    .then(|| predicted_reach(entry, reported))
                    .flatten();
                Some(NodeChange {
                    node: node.clone(),
                    from,
                    to,
                    drain: drain_need(&candidate, reported, entry, pods.get(node)),
                    estimated_seconds: reported
                        .and_then(|r| r.last_resize.as_ref())
                        .filter(|r| r.pages_per_second > 0.0)
                        .map(|r| (to - from).abs() as f64 / r.pages_per_second),
                    predicted,
                })
            })
            .collect();
        let writes: Vec<(String, planner::NodePlan)> = plan
            .spec_writes()
            .map(|(node, node_plan)| (node.clone(), node_plan.clone()))
            .collect();
        for pool in pools.iter_mut() {
            if let Some(pool_plan) = plan
                .pools
                .get(pool.metadata.name.as_deref().unwrap_or_default())
            {
                pool.status = Some(pool_plan.status.clone());
            }
        }
        last = Some(pool_plan);
        if !wave.is_empty() {
            waves.push(wave);
        }
        if writes.is_empty() {
            break;
        }
        for (node, node_plan) in writes {
            write_and_converge(&mut states, &node, node_plan.spec, now);
        }
    }

    let first = first.unwrap_or_default();
    let last = last.unwrap_or_default();
    let changed: BTreeSet<&str> = waves.iter().flatten().map(|c| c.node.as_str()).collect();
    let unchanged = first
        .members
        .iter()
        .filter(|m| m.state == NodeState::Converged && !changed.contains(m.node.as_str()))
        .map(|m| m.node.clone())
        .collect();
    let conflicts = first
        .conflicts
        .iter()
        .map(|(node, owner)| Conflict {
            node: node.clone(),
            owner: owner.clone(),
        })
        .collect();
    let stuck = last
        .members
        .iter()
        .filter_map(|m| {
            let reason = match &m.state {
                NodeState::Converged => return None,
                NodeState::Failed { reason, message } => {
                    format!("failed ({reason}: {message}); it keeps its rollout slot")
                }
                NodeState::Pending if candidate.spec.rollout.paused => {
                    "the rollout is paused".to_string()
                }
                NodeState::Pending => "waiting for a rollout slot held by failed nodes".to_string(),
                NodeState::Updating => "its target is not reached".to_string(),
            };
            Some(Stuck {
                node: m.node.clone(),
                reason,
            })
        })
        .collect();
    let estimated_seconds = waves
        .iter()
        .map(|wave| {
            wave.iter()
                .map(|c| c.estimated_seconds)
                .try_fold(0.0_f64, |slowest, estimate| {
                    estimate.map(|e| slowest.max(e))
                })
        })
        .sum::<Option<f64>>()
        .filter(|_| !waves.is_empty());
    PlanReport {
        pool: name,
        exists,
        page_size: size,
        max_unavailable: first.max_unavailable,
        waves,
        unchanged,
        conflicts,
        stuck,
        estimated_seconds,
    }
}

/// Nodes where `report`'s shrinks go below the pages in use: the pods on
/// them decide what a drain evicts.
pub fn nodes_to_drain(report: &PlanReport) -> Vec<String> {
    report
        .waves
        .iter()
        .flatten()
        .filter(|c| c.drain.is_some())
        .map(|c| c.node.clone())
        .collect()
}

fn drain_need(
    pool: &HugePagePool,
    reported: Option<&PageSizeStatus>,
    entry: &PageSizeTarget,
    on_node: Option<&OnNode>,
) -> Option<DrainNeed> {
    let reported = reported?;
    let must_free = planner::pages_to_free(reported, entry);
    if must_free == 0 {
        return None;
    }
    let held = (reported.in_use + reported.reserved).max(reported.claimed.unwrap_or(0));
    let none = OnNode::default();
    let on_node = on_node.unwrap_or(&none);
    let selection = drain::choose(
        &on_node.pods,
        &on_node.claims,
        pool.spec.page_size,
        must_free,
    );
    Some(DrainNeed {
        held,
        policy: pool.spec.drain.policy,
        evict: selection
            .evict
            .iter()
            .map(|pod| {
                format!(
                    "{}/{}",
                    pod.metadata.namespace.as_deref().unwrap_or_default(),
                    pod.metadata.name.as_deref().unwrap_or_default()
                )
            })
            .collect(),
        unexplained: selection.unexplained,
    })
}

/// What an agent reports once the kernel holds `entry`'s target, `in_use`
/// pages of it mapped by processes.
pub fn reached_status(entry: &PageSizeTarget, in_use: i64) -> PageSizeStatus {
    PageSizeStatus {
        target: Some(entry.pages),
        total: entry.pages,
        free: entry.pages - in_use,
        in_use,
        numa: entry
            .numa
            .iter()
            .flatten()
            .map(|t| NumaStatus {
                id: t.id,
                total: t.pages,
                free: t.pages,
                surplus: 0,
                claimed: None,
                obtainable: None,
            })
            .collect(),
        ..PageSizeStatus::empty(entry.size)
    }
}

/// Writes `spec` as the API server would (a new generation) and reports it
/// reached, as an agent would: the pages in use stay in use.
fn write_and_converge(
    states: &mut Vec<HugePageNode>,
    node: &str,
    spec: hugepool_crds::HugePageNodeSpec,
    now: Timestamp,
) {
    let index = match states
        .iter()
        .position(|s| s.metadata.name.as_deref() == Some(node))
    {
        Some(index) => index,
        None => {
            states.push(HugePageNode::new(node, Default::default()));
            states.len() - 1
        }
    };
    let state = &mut states[index];
    state.spec = spec;
    let generation = state.metadata.generation.unwrap_or(0) + 1;
    state.metadata.generation = Some(generation);
    let mut status = state.status.clone().unwrap_or_default();
    status.observed_generation = Some(generation);
    for entry in &state.spec.page_sizes {
        let in_use = status
            .page_sizes
            .iter()
            .find(|r| r.size == entry.size)
            .map_or(0, |r| r.in_use)
            .min(entry.pages);
        let reached = reached_status(entry, in_use);
        match status.page_sizes.iter_mut().find(|r| r.size == entry.size) {
            Some(reported) => *reported = reached,
            None => status.page_sizes.push(reached),
        }
    }
    let now = Time(now);
    for condition in [
        ConditionUpdate::new(NodeConditionType::Converged, true, Reason::AtTarget, ""),
        ConditionUpdate::new(
            NodeConditionType::AllocationFailed,
            false,
            Reason::AllocationComplete,
            "",
        ),
        ConditionUpdate::new(
            NodeConditionType::ShrinkBlocked,
            false,
            Reason::NotBlocked,
            "",
        ),
    ] {
        set_condition(
            &mut status.conditions,
            condition.generation(Some(generation)),
            &now,
        );
    }
    status
        .conditions
        .retain(|c| c.type_ != NodeConditionType::Draining.to_string());
    state.status = Some(status);
}

#[cfg(test)]
mod tests;
