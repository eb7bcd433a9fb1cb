//! Carrying out a node's drain as the plan says: its Draining condition,
//! the taints, and which of its pods to evict (the evictions themselves run
//! beside the passes, see `evictions`).

use std::collections::BTreeSet;

use hugepool_crds::ConditionUpdate;
use hugepool_crds::conditions::{bounded_message, find_condition, set_condition};
use hugepool_crds::pool::EvictedPod;
use hugepool_crds::{HugePageNode, NodeConditionType, PageSize};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use tracing::info;

use super::evictions::PlannedEviction;
use super::watches::slim_node;
use super::writes::{WRITE_TIMEOUT, apply_status_where_read, fenced};
use super::{Context, Worker, node_reference};
use crate::drain::{self, OnNode};
use crate::error::{Error, Result};
use crate::events;
use crate::planner::{DrainPlan, NodePlan, has_taint};

pub fn has_drain_taint(node: &Node) -> bool {
    has_taint(node, hugepool_crds::DRAINING_TAINT)
}

/// Whether carrying out `drain` reads the node's HugePageNode (its status:
/// the pages held, the Draining condition).
pub(super) fn reads_state(drain: &DrainPlan) -> bool {
    drain.condition.is_some() || !drain.evict.is_empty() || !drain.evict_pods.is_empty()
}

/// Which of a draining node's pods to evict, and what its condition says
/// of them.
struct DrainSelection<'a> {
    /// Pods to evict, each with the pools its eviction is for.
    chosen: Vec<(&'a Pod, Vec<String>)>,
    /// What the condition adds: whom it evicts, whom it cannot.
    notes: Vec<String>,
    kept: Vec<String>,
    /// The UIDs a kubelet restart waits for.
    restart_waits_for: Vec<String>,
}

/// Only the fewest pods whose own requests free what the shrink needs (the
/// agent's word alone drains nothing), and the pods the kubelet's Memory
/// Manager holds memory for; never those eviction cannot move.
fn select_pods<'a>(
    on_node: &'a OnNode,
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
) -> DrainSelection<'a> {
    let OnNode { pods, claims } = on_node;
    let drain = &plan.drain;
    let mut chosen: Vec<(&Pod, Vec<String>)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let credit = |chosen: &mut Vec<(&'a Pod, Vec<String>)>, pod: &'a Pod, pool: &str| match chosen
        .iter_mut()
        .find(|(c, _)| c.metadata.uid == pod.metadata.uid)
    {
        Some((_, pools)) if !pools.iter().any(|p| p == pool) => pools.push(pool.to_string()),
        Some(_) => {}
        None => chosen.push((pod, vec![pool.to_string()])),
    };
    for &size in &drain.evict {
        let selection = drain::choose(pods, claims, size, must_free(node_state, plan, size));
        notes.extend(selection.unexplained);
        let pool = drain.shrink_pools.get(&size).cloned().unwrap_or_default();
        for pod in selection.evict {
            credit(&mut chosen, pod, &pool);
        }
    }
    let (held, held_kept) = drain::memory_manager_holders(pods, &drain.evict_pods);
    let restart_waits_for: Vec<String> =
        held.iter().filter_map(|p| p.metadata.uid.clone()).collect();
    for pod in held {
        for pool in &drain.restart_pools {
            credit(&mut chosen, pod, pool);
        }
    }
    if !chosen.is_empty() {
        let named: Vec<String> = chosen
            .iter()
            .map(|(p, _)| {
                let pages: u64 = drain
                    .evict
                    .iter()
                    .map(|&s| drain::pages_held(p, claims, s))
                    .sum();
                format!(
                    "{}/{} ({pages} pages)",
                    p.namespace().unwrap_or_default(),
                    p.name_any()
                )
            })
            .collect();
        notes.push(format!("evicting {}", named.join(", ")));
    }
    let mut kept = drain::unevictable_consumers(pods, claims, &drain.evict);
    for pod in held_kept {
        if !kept.contains(&pod) {
            kept.push(pod);
        }
    }
    if !kept.is_empty() {
        notes.push(format!("not evicted: {}", kept.join(", ")));
    }
    DrainSelection {
        chosen,
        notes,
        kept,
        restart_waits_for,
    }
}

/// The pods bound to `node`, and, when the drain is of a pool consumed
/// through DRA, the claims of this driver they use (read from the
/// namespaces of the pods that have claims; a drain of a classic pool reads
/// none, so the operator needs no claim access without DRA).
async fn read_on_node(
    ctx: &Context,
    node: &str,
    plan: &NodePlan,
    watched: Option<Vec<Pod>>,
) -> Result<OnNode> {
    let pods = match watched {
        // The node's pods as its watch holds them: no list per pass.
        Some(pods) => pods,
        None => {
            let pods: Api<Pod> = Api::all(ctx.client.clone());
            let listed = tokio::time::timeout(
                WRITE_TIMEOUT,
                pods.list(&ListParams::default().fields(&format!("spec.nodeName={node}"))),
            )
            .await
            .map_err(|_| Error::Timeout(WRITE_TIMEOUT))?;
            listed
                .map_err(|source| Error::ListPods {
                    node: node.to_string(),
                    source,
                })?
                .items
        }
    };
    let by_claims = plan
        .spec
        .page_sizes
        .iter()
        .any(|e| e.by_claims() && plan.drain.evict.contains(&e.size));
    let claims = if by_claims && let Some(store) = &ctx.claims {
        // The operator follows every claim: no list per draining node.
        let cached: Vec<serde_json::Value> = store
            .state()
            .iter()
            .filter_map(|claim| serde_json::to_value(claim.as_ref()).ok())
            .collect();
        drain::Claims::on_node(&cached, node)
    } else if by_claims {
        tokio::time::timeout(WRITE_TIMEOUT, drain::Claims::read(&ctx.client, node, &pods))
            .await
            .map_err(|_| Error::Timeout(WRITE_TIMEOUT))?
            .map_err(|e| Error::ListClaims {
                node: node.to_string(),
                namespace: e.namespace,
                source: e.source,
            })?
    } else {
        drain::Claims::default()
    };
    Ok(OnNode { claims, pods })
}

/// Whether the plan evicts on the node (its pods and claims must be read).
pub(super) fn evicts(plan: &NodePlan) -> bool {
    !plan.drain.evict.is_empty() || !plan.drain.evict_pods.is_empty()
}

/// Reads what a draining node's drain needs: its pods and their claims
/// when it evicts, nothing otherwise.
pub(super) async fn read_drain(
    ctx: &Context,
    node: &Node,
    plan: &NodePlan,
    watched: Option<Vec<Pod>>,
) -> Result<OnNode> {
    if evicts(plan) {
        read_on_node(ctx, &node.name_any(), plan, watched).await
    } else {
        Ok(OnNode::default())
    }
}

/// The Draining condition the plan asks for, its message naming whom the
/// drain evicts and keeps and what its evictions met; forgets the refusals
/// of pods gone from the node.
pub(super) fn draining_condition(
    worker: &mut Worker,
    node: &Node,
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
    on_node: &OnNode,
    now: Timestamp,
) -> Option<ConditionUpdate> {
    let name = node.name_any();
    worker.evictions.prune(&name, &on_node.pods);
    let mut selection = select_pods(on_node, node_state, plan);
    selection.notes.extend(worker.evictions.notes(&name, now));
    plan.drain.condition.clone().map(|mut update| {
        if update.status && !selection.notes.is_empty() {
            update.message = format!("{}; {}", update.message, selection.notes.join("; "));
        } else if !selection.kept.is_empty() {
            update.message = format!(
                "{}; not evicted: {}",
                update.message,
                selection.kept.join(", ")
            );
        }
        update
    })
}

/// Sets the taints and the Draining condition as the plan says.
pub(super) async fn write_drain(
    ctx: &Context,
    node: &Node,
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
    condition_update: Option<&ConditionUpdate>,
    now: Timestamp,
) -> Result<()> {
    let name = node.name_any();
    // The taints first: a node whose drain is over is untainted even when
    // its condition's write must be tried again.
    let taints = [
        (hugepool_crds::DRAINING_TAINT, plan.drain.taint),
        (hugepool_crds::NOT_READY_TAINT, plan.not_ready_taint),
    ];
    if taints
        .iter()
        .any(|&(key, want)| has_taint(node, key) != want)
    {
        let updated = set_taints(ctx, node, &taints).await?;
        ctx.deliveries.await_write("Node", &updated);
    }
    if let (Some(update), Some(state)) = (condition_update, node_state) {
        let written = match write_draining(ctx, state, update, now).await {
            // The agent wrote its status since the plan read it (it does
            // at every change): once more on the version there now.
            Err(err) if err.is_conflict() => {
                let api: Api<HugePageNode> = Api::all(ctx.client.clone());
                let fresh = fenced(ctx, async {
                    api.get(&name)
                        .await
                        .map_err(|source| Error::DrainCondition {
                            node: name.clone(),
                            source,
                        })
                })
                .await?;
                write_draining(ctx, &fresh, update, now).await?
            }
            written => written?,
        };
        if let Some((updated, before)) = written {
            ctx.deliveries.await_write("HugePageNode", &updated);
            if let Some(event) = events::drain_event(before.as_ref(), update) {
                ctx.publish(event, &node_reference(node)).await;
            }
        }
    }
    Ok(())
}

/// Sets the node's Draining condition as `update` says, on the condition
/// that its HugePageNode is still `state` (a deposed leader's late write
/// cannot overwrite what the new one wrote since). Returns the object as
/// written and the condition before, or None when nothing changed.
async fn write_draining(
    ctx: &Context,
    state: &HugePageNode,
    update: &ConditionUpdate,
    now: Timestamp,
) -> Result<Option<(HugePageNode, Option<Condition>)>> {
    let name = state.name_any();
    let mut conditions = state
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let before = find_condition(&conditions, NodeConditionType::Draining).cloned();
    if !set_condition(&mut conditions, update.clone(), &Time(now)) {
        return Ok(None);
    }
    let Some(condition) = find_condition(&conditions, NodeConditionType::Draining) else {
        return Ok(None);
    };
    let api: Api<HugePageNode> = Api::all(ctx.client.clone());
    let updated = fenced(ctx, async {
        apply_status_where_read(&api, state, json!({"conditions": [condition]}))
            .await
            .map_err(|source| Error::DrainCondition {
                node: name.clone(),
                source,
            })
    })
    .await?;
    Ok(Some((updated, before)))
}

/// The evictions a draining node's plan asks for now: the selected pods
/// not waiting out a refusal, each with its record for the pools it is for;
/// and the UIDs of every pod it selects (those asked for already too).
pub(super) fn choose_evictions(
    worker: &Worker,
    node: &Node,
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
    on_node: &OnNode,
    now: Timestamp,
) -> (Vec<PlannedEviction>, BTreeSet<String>) {
    let drain = &plan.drain;
    let name = node.name_any();
    let selection = select_pods(on_node, node_state, plan);
    let wanted = selection
        .chosen
        .iter()
        .filter_map(|(pod, _)| pod.metadata.uid.clone())
        .collect();
    let needed: Vec<String> = drain
        .evict
        .iter()
        .map(|&size| format!("{} of {size}", must_free(node_state, plan, size)))
        .collect();
    let evictions = selection
        .chosen
        .into_iter()
        .filter(|(pod, _)| {
            let uid = pod.metadata.uid.as_deref().unwrap_or_default();
            worker.evictions.may_ask(uid, now)
        })
        .map(|(pod, pools)| {
            let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
            let pages: u64 = drain
                .evict
                .iter()
                .map(|&s| drain::pages_held(pod, &on_node.claims, s))
                .sum();
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            let reason = if selection.restart_waits_for.contains(&uid) {
                format!(
                    "the kubelet's Static Memory Manager held memory for it; the kubelet \
                     restart of {name} waited for it"
                )
            } else {
                format!(
                    "held {pages} pages; the shrink of {name} needed {} back",
                    needed.join(" and ")
                )
            };
            PlannedEviction {
                pod: pod.clone(),
                node: name.clone(),
                pools,
                record: EvictedPod {
                    pod: key,
                    node: name.clone(),
                    uid,
                    pages: pages as i64,
                    reason: bounded_message(reason),
                    evicted_at: Some(Time(now)),
                },
            }
        })
        .collect();
    (evictions, wanted)
}

/// Adds or removes our taints (`NoSchedule`), leaving other taints alone;
/// the resourceVersion makes a concurrent change fail and retry once.
pub(super) async fn set_taints(
    ctx: &Context,
    node: &Node,
    taints: &[(&str, bool)],
) -> Result<Node> {
    let name = node.name_any();
    let api: Api<Node> = Api::all(ctx.client.clone());
    let error = |source| Error::Taint {
        node: name.clone(),
        source,
    };
    let first = fenced(ctx, async {
        Ok(api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(taints_patch(node, taints)),
            )
            .await)
    })
    .await?;
    let mut updated = match first {
        Ok(updated) => updated,
        // The Node moved on since the watch saw it (status updates do
        // that often): read it once more and try again.
        Err(kube::Error::Api(status)) if status.code == 409 => {
            fenced(ctx, async {
                let fresh = api.get(&name).await.map_err(error)?;
                api.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(taints_patch(&fresh, taints)),
                )
                .await
                .map_err(error)
            })
            .await?
        }
        Err(source) => return Err(error(source)),
    };
    info!(node = %name, ?taints, "taints updated");
    slim_node(&mut updated);
    Ok(updated)
}

/// Pages of `size` that must come back before the node's shrink can
/// finish (`planner::pages_to_free`: node-wide, or per NUMA node).
fn must_free(node_state: Option<&HugePageNode>, plan: &NodePlan, size: PageSize) -> u64 {
    let Some(entry) = plan.spec.page_sizes.iter().find(|e| e.size == size) else {
        return 0;
    };
    node_state
        .and_then(|s| s.status.as_ref())
        .and_then(|s| s.page_sizes.iter().find(|r| r.size == size))
        .map_or(0, |reported| crate::planner::pages_to_free(reported, entry))
}

/// The merge patch that sets the Node's taints so that each of ours in
/// `wanted` (key, present) is there or not, `NoSchedule`, other taints left
/// alone. Taints are one atomic list, so the patch names the
/// resourceVersion it was computed from.
pub fn taints_patch(node: &Node, wanted: &[(&str, bool)]) -> serde_json::Value {
    let mut taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    for &(key, present) in wanted {
        let had = taints.iter().any(|t| t.key == key);
        if had && !present {
            taints.retain(|t| t.key != key);
        } else if present && !had {
            taints.push(Taint {
                key: key.into(),
                effect: "NoSchedule".into(),
                value: None,
                time_added: None,
            });
        }
    }
    json!({
        "metadata": {"resourceVersion": node.resource_version()},
        "spec": {"taints": taints},
    })
}

/// [`taints_patch`] for `hugepool.dev/draining` alone.
pub fn taint_patch(node: &Node, taint: bool) -> serde_json::Value {
    taints_patch(node, &[(hugepool_crds::DRAINING_TAINT, taint)])
}
