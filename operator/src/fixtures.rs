//! Builders of pools, nodes and HugePageNodes for the tests, and a tiny
//! stand-in for the agents so tests can run a rollout to its end.

use std::collections::BTreeMap;

use hugepool_crds::conditions::{ConditionUpdate, set_condition};
use hugepool_crds::node::PageSizeTarget;
use hugepool_crds::pool::RolloutSpec;
use hugepool_crds::{
    HugePageNode, HugePageNodeSpec, HugePageNodeStatus, HugePagePool, HugePagePoolSpec,
    NodeConditionType, Reason,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::planner::{Plan, PlanInput, plan};

pub const T0: i64 = 1_700_000_000;

pub fn at(second: i64) -> Timestamp {
    Timestamp::from_second(T0 + second).expect("test timestamp in range")
}

/// A pool `name` created at second `created`, selecting `label=true`.
pub fn pool(name: &str, created: i64, label: &str, size: &str, pages: i64) -> HugePagePool {
    let mut pool = HugePagePool::new(
        name,
        HugePagePoolSpec {
            node_selector: LabelSelector {
                match_labels: Some(BTreeMap::from([(label.to_string(), "true".to_string())])),
                match_expressions: None,
            },
            page_size: size.parse().expect("a page size"),
            pages: Some(pages),
            memory: None,
            numa: None,
            resize: Default::default(),
            allocation: Default::default(),
            rollout: RolloutSpec::default(),
            drain: Default::default(),
            kubelet: Default::default(),
            deletion_policy: Default::default(),
            consumption: None,
        },
    );
    pool.metadata.creation_timestamp = Some(Time(at(created)));
    pool.metadata.generation = Some(1);
    pool.metadata.uid = Some(format!("uid-{name}"));
    pool
}

pub fn with_max_unavailable(mut pool: HugePagePool, value: IntOrString) -> HugePagePool {
    pool.spec.rollout.max_unavailable = value;
    pool
}

pub fn node(name: &str, labels: &[&str]) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            labels: Some(
                labels
                    .iter()
                    .map(|l| (l.to_string(), "true".to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// Nodes `w-00`.. `w-NN`, all carrying `labels`.
pub fn fleet(count: usize, labels: &[&str]) -> Vec<Node> {
    (0..count)
        .map(|i| node(&format!("w-{i:02}"), labels))
        .collect()
}

pub fn hpn(name: &str, generation: i64, entries: Vec<PageSizeTarget>) -> HugePageNode {
    let mut hpn = HugePageNode::new(
        name,
        HugePageNodeSpec {
            page_sizes: entries,
        },
    );
    hpn.metadata.generation = Some(generation);
    hpn
}

/// What an agent reports once it has reached every target of `hpn`.
pub fn converge(hpn: &mut HugePageNode) {
    let mut status = hpn.status.clone().unwrap_or_default();
    status.observed_generation = hpn.metadata.generation;
    status.page_sizes = hpn
        .spec
        .page_sizes
        .iter()
        .map(|entry| crate::plugin::plan::reached_status(entry, 0))
        .collect();
    let now = Time(at(0));
    set_condition(
        &mut status.conditions,
        ConditionUpdate::new(NodeConditionType::Converged, true, Reason::AtTarget, ""),
        &now,
    );
    hpn.status = Some(status);
}

/// An agent's report of `update` for `hpn`'s current generation.
pub fn report(hpn: &mut HugePageNode, update: ConditionUpdate) {
    let mut status = hpn.status.clone().unwrap_or_default();
    status.observed_generation = hpn.metadata.generation;
    set_condition(
        &mut status.conditions,
        update.generation(hpn.metadata.generation),
        &Time(at(0)),
    );
    hpn.status = Some(status);
}

/// What an agent reports when growth stopped short at this generation.
pub fn fail_allocation(hpn: &mut HugePageNode) {
    report(
        hpn,
        ConditionUpdate::new(
            NodeConditionType::AllocationFailed,
            true,
            Reason::Fragmented,
            "achieved 10 of 64 pages",
        ),
    );
}

/// Writes a plan's HugePageNode specs back as the API server would.
pub fn apply_specs(plan: &Plan, hpns: &mut Vec<HugePageNode>) {
    for (name, node_plan) in plan.spec_writes() {
        match hpns
            .iter_mut()
            .find(|h| h.metadata.name.as_deref() == Some(name))
        {
            Some(existing) => {
                existing.spec = node_plan.spec.clone();
                existing.metadata.generation = Some(existing.metadata.generation.unwrap_or(0) + 1);
            }
            None => hpns.push(hpn(name, 1, node_plan.spec.page_sizes.clone())),
        }
    }
    hpns.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
}

/// Writes the plan's pool statuses and drops pools whose finalizer went.
pub fn apply_statuses(plan: &Plan, pools: &mut Vec<HugePagePool>) {
    pools.retain(|p| {
        let name = p.metadata.name.clone().unwrap_or_default();
        !plan.pools.get(&name).is_some_and(|pp| pp.remove_finalizer)
    });
    for pool in pools.iter_mut() {
        let name = pool.metadata.name.clone().unwrap_or_default();
        if let Some(pool_plan) = plan.pools.get(&name) {
            pool.status = Some(pool_plan.status.clone());
        }
    }
}

pub fn run_plan(
    pools: &[HugePagePool],
    nodes: &[Node],
    hpns: &[HugePageNode],
    second: i64,
) -> Plan {
    let nodes: Vec<&Node> = nodes.iter().collect();
    let hpns: Vec<&HugePageNode> = hpns.iter().collect();
    plan(&PlanInput {
        observed: &Default::default(),
        pools,
        nodes: &nodes,
        node_states: &hpns,
        now: at(second),
        agent_nodes: None,
    })
}

pub fn status_of(hpn: &mut HugePageNode) -> &mut HugePageNodeStatus {
    hpn.status.get_or_insert_with(HugePageNodeStatus::default)
}

pub trait EntryForTest {
    /// The entry this pool writes for `pages` without NUMA targets.
    fn entry_for_test(&self, pages: i64) -> PageSizeTarget;
}

impl EntryForTest for HugePagePool {
    fn entry_for_test(&self, pages: i64) -> PageSizeTarget {
        PageSizeTarget {
            size: self.spec.page_size,
            pages,
            numa: None,
            pool: self.metadata.name.clone().unwrap_or_default(),
            pool_generation: self.metadata.generation.unwrap_or(0),
            resize: self.spec.resize.clone(),
            allocation: self.spec.allocation.clone(),
            kubelet_restart: self.spec.kubelet.restart,
            consumption: self.spec.consumption,
        }
    }
}

/// A ResourceClaim (JSON) of hugepool's DRA driver in namespace `apps`,
/// reserved for the pods of UIDs `pods`, allocated from `pool` (a node) on
/// `device`, consuming `memory`.
pub fn claim(pods: &[&str], pool: &str, device: &str, memory: &str) -> serde_json::Value {
    let reserved: Vec<_> = pods
        .iter()
        .map(|uid| serde_json::json!({"resource": "pods", "name": uid, "uid": uid}))
        .collect();
    serde_json::json!({
        "metadata": {"namespace": "apps", "name": format!("{device}-{}", pods.join("-"))},
        "status": {
            "allocation": {"devices": {"results": [{
                "request": "pages", "driver": hugepool_crds::dra::DRIVER, "pool": pool,
                "device": device, "consumedCapacity": {"memory": memory},
            }]}},
            "reservedFor": reserved,
        },
    })
}
