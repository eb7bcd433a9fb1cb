//! `kubectl hugepool why pod/NAME`: why a pod that requests
//! `hugepages-<size>` is Pending, from what each node with the size holds,
//! targets and publishes, its hugepool taints, and the pods already there;
//! for a pod that claims its pages through DRA, from each node's devices
//! and the claims allocated on them (`dra`).

mod dra;

use std::collections::BTreeMap;

use hugepool_crds::{HugePageNode, PageSize};
use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use serde::Serialize;

use crate::drain;
pub use dra::{ClaimRequest, DeviceRow, DraObjects};

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodReport {
    /// `namespace/name`.
    pub pod: String,
    pub phase: String,
    /// The node it is bound to, if any.
    pub node: Option<String>,
    /// Pages it requests, by size.
    pub requests: Vec<SizeRequest>,
    /// The scheduler's word (`PodScheduled=False`), if any.
    pub scheduler: Option<String>,
    /// Every node with a requested size (a target, pages, or capacity)
    /// that the pod's nodeSelector allows, by size then name.
    pub nodes: Vec<PodNodeRow>,
    /// Nodes with a requested size that the pod's nodeSelector rules out.
    pub excluded_by_node_selector: usize,
    /// What its ResourceClaims ask of hugepool's DeviceClasses, by request.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<ClaimRequest>,
    /// Claims the pod names that do not exist (yet).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub missing_claims: Vec<String>,
    /// The devices of the sizes its pending claims ask, node by node.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceRow>,
    /// One line: what keeps the pod off the nodes, or that one has room.
    pub verdict: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SizeRequest {
    pub size: PageSize,
    pub pages: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodNodeRow {
    pub node: String,
    pub size: PageSize,
    /// The pool whose target the node's HugePageNode carries for the size.
    pub pool: Option<String>,
    /// That target, in pages.
    pub target: Option<i64>,
    /// Persistent pages the kernel holds, as the agent reports.
    pub kernel: Option<i64>,
    /// `hugepages-<size>` the Node's kubelet publishes as allocatable, in pages.
    pub allocatable: Option<i64>,
    /// Pages of the size requested by the pods already on the node.
    pub requested: i64,
    /// The kubelet publishes a capacity other than the kernel's pool: it read
    /// the pool before the last resize and must restart to see it.
    pub stale: bool,
    /// Hugepool taints on the node the pod does not tolerate.
    pub taints: Vec<String>,
    /// What keeps the pod off this node (hugepool-wise), or empty when it fits.
    pub blocked_by: String,
    #[serde(skip)]
    block: Option<Block>,
}

/// Why a node cannot take the pod. A node's is the first its checks find
/// (node_row); the verdict names the most actionable across nodes, the
/// greatest in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Block {
    NodeSelector,
    NoTarget,
    TargetTooSmall,
    TakenByPods,
    KernelShort,
    Taint,
    StaleKubelet,
}

/// The report on `pod` over the cluster's Nodes, HugePageNodes and pods,
/// and the DRA objects when the pod uses claims.
pub fn report(
    pod: &Pod,
    nodes: &[Node],
    states: &[HugePageNode],
    pods: &[Pod],
    objects: &DraObjects,
) -> PodReport {
    let name = format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    );
    let status = pod.status.as_ref();
    let phase = status
        .and_then(|s| s.phase.clone())
        .unwrap_or_else(|| "Unknown".into());
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let scheduler = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| {
            let reason = c.reason.clone().unwrap_or_default();
            match c.message.as_deref() {
                Some(message) if !message.is_empty() => format!("{reason}: {message}"),
                _ => reason,
            }
        });
    let requests: Vec<SizeRequest> = hugepool_crds::pod::named_sizes(pod)
        .into_iter()
        .map(|size| SizeRequest {
            size,
            pages: hugepool_crds::pod::requested_pages(pod, size),
        })
        .filter(|r| r.pages > 0)
        .collect();

    let mut rows = Vec::new();
    for request in &requests {
        for node in nodes {
            let node_name = node.metadata.name.clone().unwrap_or_default();
            let state = states
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(&node_name));
            if let Some(row) = node_row(pod, request, node, state, pods) {
                rows.push(row);
            }
        }
    }
    rows.sort_by(|a, b| (a.size, &a.node).cmp(&(b.size, &b.node)));
    let excluded = rows
        .iter()
        .filter(|r| r.block == Some(Block::NodeSelector))
        .count();
    rows.retain(|r| r.block != Some(Block::NodeSelector));
    let (claims, missing_claims) = dra::claim_requests(pod, objects);
    let devices = dra::device_rows(&claims, objects, nodes, |node| keeps_off(pod, node));
    let verdict = if requests.is_empty() && !(claims.is_empty() && missing_claims.is_empty()) {
        dra::verdict(&claims, &missing_claims, &devices)
    } else {
        verdict(&phase, bound.as_deref(), &requests, &rows, excluded)
    };
    PodReport {
        pod: name,
        phase,
        node: bound,
        requests,
        scheduler,
        nodes: rows,
        excluded_by_node_selector: excluded,
        claims,
        missing_claims,
        devices,
        verdict,
    }
}

fn pages_of(
    quantities: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
    size: PageSize,
) -> Option<i64> {
    let bytes =
        hugepool_crds::quantity::parse_bytes(&quantities?.get(&size.resource_name())?.0).ok()?;
    i64::try_from(bytes / size.bytes()).ok()
}

/// The node's row for `request`, or None when the node has nothing of the
/// size (no target, no pages, no capacity).
fn node_row(
    pod: &Pod,
    request: &SizeRequest,
    node: &Node,
    state: Option<&HugePageNode>,
    pods: &[Pod],
) -> Option<PodNodeRow> {
    let size = request.size;
    let node_name = node.metadata.name.clone().unwrap_or_default();
    let entry = state.and_then(|s| s.spec.page_sizes.iter().find(|e| e.size == size));
    let kernel = state
        .and_then(|s| s.status.as_ref())
        .and_then(|s| s.page_sizes.iter().find(|p| p.size == size))
        .map(|p| p.total - p.surplus);
    let node_status = node.status.as_ref();
    let capacity = pages_of(node_status.and_then(|s| s.capacity.as_ref()), size);
    let allocatable = pages_of(node_status.and_then(|s| s.allocatable.as_ref()), size);
    let has_size = entry.is_some_and(|e| e.pages > 0)
        || kernel.is_some_and(|k| k > 0)
        || allocatable.is_some_and(|a| a > 0);
    if !has_size {
        return None;
    }
    let no_claims = drain::Claims::default();
    let requested: i64 = drain::holders(pods, &no_claims, &[size])
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node_name))
        .map(|p| hugepool_crds::pod::requested_pages(p, size) as i64)
        .sum();
    let stale = matches!((capacity, kernel), (Some(c), Some(k)) if c != k);
    let taints = untolerated_taints(pod, node);
    let wanted = request.pages as i64;
    let selector_matches = selector_matches(pod, node);
    // Every reason that applies: the taints, then the first capacity
    // problem in the order the pages get to the pod.
    let mut blocks: Vec<(Block, String)> = Vec::new();
    if !selector_matches {
        blocks.push((Block::NodeSelector, "the pod's nodeSelector".into()));
    }
    if !taints.is_empty() {
        blocks.push((Block::Taint, format!("taint {}", taints.join(", "))));
    }
    let published = allocatable.unwrap_or(0);
    let capacity_block = if entry.is_none() && published < wanted {
        Some((Block::NoTarget, "no pool targets the size here".to_string()))
    } else if let Some(entry) = entry.filter(|e| e.pages < wanted) {
        Some((
            Block::TargetTooSmall,
            format!("target {} < {wanted} pages", entry.pages),
        ))
    } else if kernel.unwrap_or(0) < wanted && published < wanted {
        Some((
            Block::KernelShort,
            format!("kernel holds {} of its target yet", kernel.unwrap_or(0)),
        ))
    } else if published < wanted || stale && capacity.unwrap_or(0) < wanted {
        Some((
            Block::StaleKubelet,
            format!(
                "kubelet publishes {published} (stale), kernel holds {}",
                kernel.unwrap_or(0)
            ),
        ))
    } else if published - requested < wanted {
        Some((
            Block::TakenByPods,
            format!("{requested} of {published} requested by other pods"),
        ))
    } else {
        None
    };
    blocks.extend(capacity_block);
    // A node the pod may not run on is left out, whatever else holds there.
    let block = if selector_matches {
        blocks.iter().map(|(b, _)| *b).max()
    } else {
        Some(Block::NodeSelector)
    };
    let blocked_by = blocks
        .into_iter()
        .map(|(_, text)| text)
        .collect::<Vec<_>>()
        .join("; ");
    Some(PodNodeRow {
        node: node_name,
        size,
        pool: entry.map(|e| e.pool.clone()),
        target: entry.map(|e| e.pages),
        kernel,
        allocatable,
        requested,
        stale,
        taints,
        blocked_by,
        block,
    })
}

/// The hugepool taints on `node` that keep `pod` off (`key:Effect`).
fn untolerated_taints(pod: &Pod, node: &Node) -> Vec<String> {
    let tolerations = pod
        .spec
        .as_ref()
        .and_then(|s| s.tolerations.clone())
        .unwrap_or_default();
    super::why::hugepool_taint_list(node)
        .filter(|t| t.effect != "PreferNoSchedule")
        .filter(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
        .map(|t| format!("{}:{}", t.key, t.effect))
        .collect()
}

/// Whether `pod`'s nodeSelector allows `node`.
fn selector_matches(pod: &Pod, node: &Node) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_selector.as_ref())
        .is_none_or(|selector| {
            let labels = node.metadata.labels.clone().unwrap_or_default();
            selector.iter().all(|(k, v)| labels.get(k) == Some(v))
        })
}

/// Why `pod` may not run on `node` at all, hugepool-wise: its nodeSelector,
/// then the hugepool taints it does not tolerate; None when it may.
fn keeps_off(pod: &Pod, node: &Node) -> Option<String> {
    if !selector_matches(pod, node) {
        return Some("the pod's nodeSelector".into());
    }
    let taints = untolerated_taints(pod, node);
    (!taints.is_empty()).then(|| format!("taint {}", taints.join(", ")))
}

/// Whether `toleration` tolerates `taint` (the scheduler's rule).
fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        _ => key == taint.key && toleration.value == taint.value,
    }
}

fn verdict(
    phase: &str,
    bound: Option<&str>,
    requests: &[SizeRequest],
    rows: &[PodNodeRow],
    excluded: usize,
) -> String {
    if requests.is_empty() {
        return "the pod requests no hugepages-<size>: hugepool does not decide where it runs"
            .into();
    }
    if let Some(node) = bound {
        return format!("the pod is bound to node {node} (phase {phase}): it is past scheduling");
    }
    for request in requests {
        let size = request.size;
        let resource = size.resource_name();
        let of_size: Vec<&PodNodeRow> = rows.iter().filter(|r| r.size == size).collect();
        if of_size.is_empty() && excluded > 0 {
            return format!(
                "the pod's nodeSelector rules out all {excluded} node(s) with {resource}"
            );
        }
        if of_size.is_empty() {
            return format!(
                "no node has {resource}: create a HugePagePool of {size} selecting the nodes the pod may run on"
            );
        }
        if of_size.iter().any(|r| r.block.is_none()) {
            continue;
        }
        let Some((block, row)) = of_size
            .iter()
            .filter_map(|r| Some((r.block?, *r)))
            .max_by_key(|(block, _)| *block)
        else {
            continue;
        };
        let count = of_size.iter().filter(|r| r.block == Some(block)).count();
        let nodes = if count == 1 {
            format!("node {}", row.node)
        } else {
            format!("{count} nodes (such as {})", row.node)
        };
        let others = of_size.len() - count;
        let others = if others == 0 {
            String::new()
        } else {
            format!(" ({others} other node(s) blocked otherwise: see BLOCKED BY)")
        };
        let pages = request.pages;
        let kernel = row.kernel.unwrap_or(0);
        let allocatable = row.allocatable.unwrap_or(0);
        let why = match block {
            Block::NodeSelector | Block::NoTarget => {
                format!("no HugePagePool of {size} targets a node the pod may run on")
            }
            Block::TargetTooSmall => format!(
                "the pod asks for {pages} pages of {size}, the largest target is {}: grow the pool {}",
                of_size.iter().filter_map(|r| r.target).max().unwrap_or(0),
                row.pool.as_deref().unwrap_or("-")
            ),
            Block::TakenByPods => format!(
                "{nodes}: other pods request {} of the {allocatable} pages of {size}, fewer than {pages} are left",
                row.requested
            ),
            Block::KernelShort => format!(
                "{nodes}: the kernel holds {kernel} pages of {size}, short of the target; the agent is still growing the pool (kubectl hugepool why {})",
                row.node
            ),
            Block::Taint => format!(
                "{nodes}: tainted {}, which the pod does not tolerate (kubectl hugepool why {})",
                row.taints.join(", "),
                row.node
            ),
            Block::StaleKubelet => format!(
                "{nodes}: the kernel holds {kernel} pages of {size} but the kubelet publishes {allocatable} (stale: it reads the pool only when it starts): restart the kubelet there, or set the pool's kubelet.restart: AfterResize (needs the chart's agent.kubeletRestart.enabled=true)"
            ),
        };
        return format!("{why}{others}");
    }
    // A node fits when it has room for every size the pod requests.
    let fits = rows.iter().map(|r| r.node.as_str()).find(|node| {
        requests.iter().all(|request| {
            rows.iter()
                .any(|r| r.node == *node && r.size == request.size && r.block.is_none())
        })
    });
    match fits {
        Some(node) => format!(
            "hugepages are not what keeps it Pending: node {node} has room for every size it requests (see the scheduler's message)"
        ),
        None => {
            "each requested size has room on some node, but no node has room for all of them".into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn taint(key: &str) -> Taint {
        serde_json::from_value(json!({"key": key, "effect": "NoSchedule"})).unwrap()
    }

    fn toleration(value: serde_json::Value) -> Toleration {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn tolerations_match_as_the_scheduler_matches_them() {
        let not_ready = taint(hugepool_crds::NOT_READY_TAINT);
        assert!(tolerates(
            &toleration(json!({"operator": "Exists"})),
            &not_ready
        ));
        assert!(tolerates(
            &toleration(
                json!({"key": "hugepool.dev/not-ready", "operator": "Exists", "effect": "NoSchedule"})
            ),
            &not_ready
        ));
        assert!(!tolerates(
            &toleration(
                json!({"key": "hugepool.dev/not-ready", "operator": "Exists", "effect": "NoExecute"})
            ),
            &not_ready
        ));
        assert!(!tolerates(
            &toleration(json!({"key": "hugepool.dev/draining", "operator": "Exists"})),
            &not_ready
        ));
        assert!(tolerates(
            &toleration(json!({"key": "hugepool.dev/not-ready"})),
            &not_ready
        ));
    }
}
