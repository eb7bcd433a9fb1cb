//! `kubectl hugepool why NODE`: one node's conditions, last resizes, recent
//! Events and the pods holding its pages.

use hugepool_crds::node::ResizeSummary;
use hugepool_crds::{DRAINING_TAINT, HugePageNode, NOT_READY_TAINT, PageSize};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Event, Node, Taint};
use serde::Serialize;

use crate::drain::{self, OnNode, Unevictable};

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WhyReport {
    pub node: String,
    /// Whether the Node object exists (a HugePageNode outlives it briefly).
    pub node_exists: bool,
    /// Whether the operator's draining taint is on the Node.
    pub draining_taint: bool,
    /// Every hugepool taint on the Node (draining, not-ready), with what it means.
    pub taints: Vec<TaintRow>,
    pub sizes: Vec<SizeRow>,
    pub conditions: Vec<ConditionRow>,
    /// Newest first, at most `MAX_EVENTS`.
    pub events: Vec<EventRow>,
    pub pods: Vec<PodRow>,
}

/// A hugepool taint on a Node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaintRow {
    /// `key:Effect`, such as `hugepool.dev/not-ready:NoSchedule`.
    pub taint: String,
    /// What it means and what lifts it.
    pub meaning: String,
}

/// The taints on `node` that hugepool sets (`hugepool.dev/...`), in its order.
pub fn hugepool_taint_list(node: &Node) -> impl Iterator<Item = &Taint> {
    let prefix = format!("{}/", hugepool_crds::GROUP);
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .filter(move |t| t.key.starts_with(&prefix))
}

/// Every hugepool taint on `node`, in its order, with what it means.
pub fn hugepool_taints(node: &Node) -> Vec<TaintRow> {
    hugepool_taint_list(node)
        .map(|t| TaintRow {
            taint: format!("{}:{}", t.key, t.effect),
            meaning: match t.key.as_str() {
                DRAINING_TAINT => {
                    "the operator evicts pods holding pages so a shrink can finish; \
                     lifted when the node reaches its target"
                }
                NOT_READY_TAINT => {
                    "the node's pools are not back at target, or its kubelet does not \
                     report them yet (a reboot, a new node); lifted when both are"
                }
                _ => "not a taint this version of hugepool sets",
            }
            .to_string(),
        })
        .collect()
}

/// Events shown, newest first.
pub const MAX_EVENTS: usize = 20;

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SizeRow {
    pub size: PageSize,
    /// The pool whose target the node's spec carries for the size.
    pub pool: Option<String>,
    pub target: Option<i64>,
    pub total: i64,
    pub free: i64,
    pub reserved: i64,
    pub in_use: i64,
    /// Pages of the size the pods bound to the node request, as its agent
    /// counts them (`None`: not reported).
    pub requested: Option<i64>,
    pub surplus: i64,
    /// What the kubelet reports as `hugepages-<size>` capacity, in pages.
    pub kubelet_capacity: Option<i64>,
    pub last_resize: Option<ResizeSummary>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionRow {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    /// Seconds since it last changed.
    pub age_seconds: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventRow {
    /// The kind of object it is about (Node, HugePageNode, Pod).
    pub object: String,
    #[serde(rename = "type")]
    pub type_: String,
    pub reason: String,
    pub message: String,
    pub count: i32,
    pub age_seconds: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRow {
    /// `namespace/name`.
    pub pod: String,
    pub size: PageSize,
    /// Pages of the size it requests or its ResourceClaims hold.
    pub pages: u64,
    /// Empty when a drain may evict it; else why it never is.
    pub unevictable: String,
}

pub fn report(
    name: &str,
    node: Option<&Node>,
    state: Option<&HugePageNode>,
    events: &[Event],
    on_node: &OnNode,
    now: Timestamp,
) -> WhyReport {
    let age = |time: Option<Timestamp>| time.map(|t| now.duration_since(t).as_secs());
    let status = state.and_then(|s| s.status.as_ref());
    let capacity = node
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.capacity.as_ref());
    let sizes: Vec<SizeRow> = status
        .map(|s| s.page_sizes.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|reported| {
            let entry =
                state.and_then(|s| s.spec.page_sizes.iter().find(|e| e.size == reported.size));
            SizeRow {
                size: reported.size,
                pool: entry.map(|e| e.pool.clone()),
                target: entry.map(|e| e.pages),
                total: reported.total,
                free: reported.free,
                reserved: reported.reserved,
                in_use: reported.in_use,
                requested: reported.requested,
                surplus: reported.surplus,
                kubelet_capacity: capacity
                    .and_then(|c| c.get(&reported.size.resource_name()))
                    .and_then(|q| hugepool_crds::quantity::parse_bytes(&q.0).ok())
                    .and_then(|bytes| i64::try_from(bytes / reported.size.bytes()).ok()),
                last_resize: reported.last_resize.clone(),
            }
        })
        .collect();
    let conditions = status
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|c| ConditionRow {
            type_: c.type_.clone(),
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
            age_seconds: age(Some(c.last_transition_time.0)),
        })
        .collect();
    let mut events: Vec<(Option<Timestamp>, EventRow)> = events
        .iter()
        .map(|e| {
            let last = e
                .last_timestamp
                .as_ref()
                .map(|t| t.0)
                .or_else(|| e.event_time.as_ref().map(|t| t.0))
                .or_else(|| e.first_timestamp.as_ref().map(|t| t.0));
            let row = EventRow {
                object: e.involved_object.kind.clone().unwrap_or_default(),
                type_: e.type_.clone().unwrap_or_default(),
                reason: e.reason.clone().unwrap_or_default(),
                message: e.message.clone().unwrap_or_default(),
                count: e
                    .count
                    .or_else(|| e.series.as_ref().and_then(|s| s.count))
                    .unwrap_or(1),
                age_seconds: age(last),
            };
            (last, row)
        })
        .collect();
    events.sort_by_key(|e| std::cmp::Reverse(e.0));
    let sizes_held: Vec<PageSize> = sizes.iter().map(|s| s.size).collect();
    let claims = &on_node.claims;
    let mut pods: Vec<PodRow> = drain::holders(&on_node.pods, claims, &sizes_held)
        .flat_map(|pod| {
            let name = format!(
                "{}/{}",
                pod.metadata.namespace.as_deref().unwrap_or_default(),
                pod.metadata.name.as_deref().unwrap_or_default()
            );
            let unevictable = Unevictable::of(pod)
                .map(|u| u.as_str().to_string())
                .unwrap_or_default();
            sizes_held.iter().filter_map(move |&size| {
                let pages = drain::pages_held(pod, claims, size);
                (pages > 0).then(|| PodRow {
                    pod: name.clone(),
                    size,
                    pages,
                    unevictable: unevictable.clone(),
                })
            })
        })
        .collect();
    pods.sort_by(|a, b| (a.size, &a.pod).cmp(&(b.size, &b.pod)));
    WhyReport {
        node: name.to_string(),
        node_exists: node.is_some(),
        draining_taint: node.is_some_and(|n| crate::planner::has_taint(n, DRAINING_TAINT)),
        taints: node.map(hugepool_taints).unwrap_or_default(),
        sizes,
        conditions,
        events: events
            .into_iter()
            .take(MAX_EVENTS)
            .map(|(_, row)| row)
            .collect(),
        pods,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;

    use super::*;
    use crate::fixtures::{self, at};

    #[test]
    fn pods_holding_pages_through_claims_are_listed_with_what_their_claims_hold() {
        let mut state = fixtures::hpn("w-00", 1, Vec::new());
        fixtures::converge(&mut state);
        let status = fixtures::status_of(&mut state);
        status.page_sizes = vec![hugepool_crds::node::PageSizeStatus {
            total: 64,
            free: 64,
            ..hugepool_crds::node::PageSizeStatus::empty(PageSize::SIZE_2MI)
        }];
        let pod = |name: &str, containers: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "apps", "uid": format!("u-{name}")},
                "spec": {"nodeName": "w-00", "containers": containers,
                         "resourceClaims": [{"name": "pages", "resourceClaimName": name}]},
            }))
            .expect("pod")
        };
        let on_node = OnNode {
            pods: vec![
                pod("claimer", serde_json::json!([{"name": "c"}])),
                pod("idle", serde_json::json!([{"name": "c"}])),
            ],
            claims: drain::Claims::on_node(
                &[fixtures::claim(
                    &["u-claimer"],
                    "w-00",
                    "hugepages-2mi-numa0",
                    "24Mi",
                )],
                "w-00",
            ),
        };
        let report = report("w-00", None, Some(&state), &[], &on_node, at(10));
        assert_eq!(
            report.pods,
            [PodRow {
                pod: "apps/claimer".into(),
                size: PageSize::SIZE_2MI,
                pages: 12,
                unevictable: String::new(),
            }]
        );
    }
}
