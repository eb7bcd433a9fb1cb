//! `why pod/NAME` for a pod that takes its pages through ResourceClaims of
//! hugepool's DeviceClasses: what each claim asks, and what each node's
//! devices (its ResourceSlice) have left after the claims allocated there.

use hugepool_crds::PageSize;
use hugepool_crds::dra::{DRIVER, claimed_pages, parse_device_class, parse_device_name};
use hugepool_crds::quantity::parse_bytes;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use serde_json::Value;

/// The cluster's DRA objects `why pod/NAME` reads (as JSON): hugepool's
/// ResourceSlices and every ResourceClaim. Empty when the pod uses no claim.
#[derive(Clone, Debug, Default)]
pub struct DraObjects {
    pub slices: Vec<Value>,
    pub claims: Vec<Value>,
}

/// One request of a pod's claim for pages of a hugepool DeviceClass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRequest {
    /// The ResourceClaim, in the pod's namespace.
    pub claim: String,
    pub request: String,
    pub size: PageSize,
    /// Pages the request takes from one device.
    pub pages: u64,
    /// `node/device` it is allocated on; absent until the scheduler
    /// allocates it.
    pub allocated: Option<String>,
    /// The pods the claim is reserved for, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved_for: Vec<String>,
}

/// One device a pending request could be allocated from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRow {
    pub node: String,
    pub device: String,
    pub size: PageSize,
    /// Pages the device publishes.
    pub capacity: u64,
    /// Pages the claims allocated on it consume.
    pub allocated: u64,
    /// What keeps the pod's largest pending request of the size off this
    /// device, or empty when it fits.
    pub blocked_by: String,
    /// The pod may run on the node (its nodeSelector, the hugepool taints).
    #[serde(skip)]
    node_allowed: bool,
}

/// The pod's claims, by request, and the names of those not created yet
/// (a claim from a template the resourceclaim controller has not made).
pub fn claim_requests(pod: &Pod, objects: &DraObjects) -> (Vec<ClaimRequest>, Vec<String>) {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref());
    let mut requests = Vec::new();
    let mut missing = Vec::new();
    let pod_claims = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref());
    for pod_claim in pod_claims.into_iter().flatten() {
        let name = pod_claim.resource_claim_name.clone().or_else(|| {
            statuses?
                .iter()
                .find(|s| s.name == pod_claim.name)?
                .resource_claim_name
                .clone()
        });
        let found = name.as_deref().and_then(|name| {
            objects
                .claims
                .iter()
                .find(|c| c["metadata"]["namespace"] == namespace && c["metadata"]["name"] == name)
        });
        let Some(claim) = found else {
            missing.push(match (&name, &pod_claim.resource_claim_template_name) {
                (Some(name), _) => name.clone(),
                (None, Some(template)) => format!("{} (from template {template})", pod_claim.name),
                (None, None) => pod_claim.name.clone(),
            });
            continue;
        };
        requests.extend(requests_of(claim));
    }
    (requests, missing)
}

/// The requests of `claim` for a hugepool DeviceClass, with where each is
/// allocated.
fn requests_of(claim: &Value) -> Vec<ClaimRequest> {
    let name = claim["metadata"]["name"].as_str().unwrap_or_default();
    let results = claim["status"]["allocation"]["devices"]["results"].as_array();
    let reserved_for = hugepool_crds::dra::reserved_for(claim, "name");
    claim["spec"]["devices"]["requests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|request| {
            let exactly = &request["exactly"];
            let size = parse_device_class(exactly["deviceClassName"].as_str()?)?;
            let request_name = request["name"].as_str().unwrap_or_default();
            // No memory asked is the request policy's default: one page;
            // the scheduler rounds what is asked up to whole pages.
            let pages = exactly["capacity"]["requests"]["memory"]
                .as_str()
                .and_then(|q| parse_bytes(q).ok())
                .map_or(1, |bytes| bytes.div_ceil(size.bytes()).max(1));
            let allocated = results
                .into_iter()
                .flatten()
                .find(|r| r["request"] == request_name && r["driver"] == DRIVER)
                .map(|r| {
                    format!(
                        "{}/{}",
                        r["pool"].as_str().unwrap_or_default(),
                        r["device"].as_str().unwrap_or_default()
                    )
                });
            Some(ClaimRequest {
                claim: name.to_string(),
                request: request_name.to_string(),
                size,
                pages,
                allocated,
                reserved_for: reserved_for.clone(),
            })
        })
        .collect()
}

/// Pages the allocated claims consume on `node`'s `device` (read as the
/// drain and the kubelet plugin read them).
fn allocated_on(claims: &[Value], node: &str, device: &str) -> u64 {
    claims
        .iter()
        .filter_map(|claim| claimed_pages(claim, node).ok())
        .flat_map(|held| held.pages)
        .filter(|pages| pages.device == device)
        .map(|pages| pages.pages)
        .sum()
}

/// Every device of a size a pending request asks for, by size, node and
/// device, with what keeps that size's largest pending request off it.
/// `keeps_off` says why the pod may not run on a node at all (its
/// nodeSelector, a hugepool taint), if it may not.
pub fn device_rows(
    requests: &[ClaimRequest],
    objects: &DraObjects,
    nodes: &[Node],
    keeps_off: impl Fn(&Node) -> Option<String>,
) -> Vec<DeviceRow> {
    let mut rows = Vec::new();
    for slice in &objects.slices {
        let spec = &slice["spec"];
        if spec["driver"] != DRIVER {
            continue;
        }
        let node = spec["pool"]["name"].as_str().unwrap_or_default();
        let node_blocked = nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(node))
            .map_or_else(|| Some("no such Node".to_string()), &keeps_off);
        for device in spec["devices"].as_array().into_iter().flatten() {
            let name = device["name"].as_str().unwrap_or_default();
            let Some((size, _)) = parse_device_name(name) else {
                continue;
            };
            let Some(wanted) = requests
                .iter()
                .filter(|r| r.size == size && r.allocated.is_none())
                .map(|r| r.pages)
                .max()
            else {
                continue;
            };
            let capacity = device["capacity"]["memory"]["value"]
                .as_str()
                .and_then(|q| parse_bytes(q).ok())
                .map_or(0, |bytes| bytes / size.bytes());
            let allocated = allocated_on(&objects.claims, node, name);
            let free = capacity.saturating_sub(allocated);
            let blocked_by = match &node_blocked {
                Some(why) => why.clone(),
                None if free < wanted => format!("{free} pages free < {wanted}"),
                None => String::new(),
            };
            rows.push(DeviceRow {
                node: node.to_string(),
                device: name.to_string(),
                size,
                capacity,
                allocated,
                blocked_by,
                node_allowed: node_blocked.is_none(),
            });
        }
    }
    rows.sort_by(|a, b| (a.size, &a.node, &a.device).cmp(&(b.size, &b.node, &b.device)));
    rows
}

/// One line for a pod whose pages come through claims.
pub fn verdict(requests: &[ClaimRequest], missing: &[String], devices: &[DeviceRow]) -> String {
    if let Some(claim) = missing.first() {
        return format!(
            "claim {claim} does not exist yet: the resourceclaim controller (kube-controller-manager) creates a claim from its template, or the pod names a claim nobody made"
        );
    }
    if let Some(shared) = requests.iter().find(|r| r.reserved_for.len() > 1) {
        return format!(
            "claim {} is reserved for {} pods ({}): a claim's pages go to one pod, the one it was \
             prepared for first, and the others' containers are refused; give each pod its own \
             claim, e.g. from a ResourceClaimTemplate (docs/user-guide.md, \"One claim, one pod\")",
            shared.claim,
            shared.reserved_for.len(),
            shared.reserved_for.join(", ")
        );
    }
    let pending: Vec<&ClaimRequest> = requests.iter().filter(|r| r.allocated.is_none()).collect();
    if pending.is_empty() {
        let on: Vec<String> = requests
            .iter()
            .filter_map(|r| r.allocated.clone())
            .collect();
        return format!(
            "its claims are allocated ({}): hugepages are not what keeps it from running",
            on.join(", ")
        );
    }
    for request in pending {
        let size = request.size;
        let pages = request.pages;
        let of_size: Vec<&DeviceRow> = devices.iter().filter(|d| d.size == size).collect();
        if of_size.is_empty() {
            return format!(
                "no node publishes {size} pages for claims: a HugePagePool of {size} with consumption DynamicResourceAllocation must select the nodes the pod may run on (and the chart needs dra.enabled)"
            );
        }
        if of_size.iter().any(|d| d.blocked_by.is_empty()) {
            continue;
        }
        let most = of_size
            .iter()
            .filter(|d| d.node_allowed)
            .max_by_key(|d| d.capacity.saturating_sub(d.allocated));
        return match most {
            None => format!(
                "every node that publishes {size} pages for claims is one the pod may not run on (see BLOCKED BY)"
            ),
            Some(d) => format!(
                "claim {} asks {pages} pages of {size} from one device, and no device has them free: the most is {} on node {} ({}); grow the pool there, or wait for claims to be released",
                request.claim,
                d.capacity.saturating_sub(d.allocated),
                d.node,
                d.device
            ),
        };
    }
    "a device has room for each of its claims: hugepages are not what keeps it Pending (see the scheduler's message)".into()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::fixtures;

    /// A slice of hugepool's driver on `node` with 2Mi devices of
    /// `pages` each, one per NUMA node.
    fn slice(node: &str, pages: &[u64]) -> Value {
        let devices: Vec<Value> = pages
            .iter()
            .enumerate()
            .map(|(numa, pages)| {
                json!({"name": format!("hugepages-2mi-numa{numa}"),
                       "capacity": {"memory": {"value": format!("{}Mi", pages * 2)}}})
            })
            .collect();
        json!({"spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node},
                        "devices": devices}})
    }

    /// A claim `name` in `apps` asking `memory` of 2Mi pages.
    fn pending(name: &str, memory: &str) -> Value {
        json!({
            "metadata": {"namespace": "apps", "name": name},
            "spec": {"devices": {"requests": [{"name": "pages", "exactly": {
                "deviceClassName": "hugepages-2mi.hugepool.dev",
                "capacity": {"requests": {"memory": memory}},
            }}]}},
        })
    }

    fn pod(claims: Value, statuses: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "l2fwd", "namespace": "apps"},
            "spec": {"containers": [{"name": "c"}], "resourceClaims": claims,
                     "nodeSelector": {"dpdk": "true"}},
            "status": {"phase": "Pending", "resourceClaimStatuses": statuses},
        }))
        .expect("pod")
    }

    #[test]
    fn a_claim_that_fits_no_device_names_the_one_with_the_most_free() {
        let nodes = [
            fixtures::node("w-1", &["dpdk"]),
            fixtures::node("w-2", &["dpdk"]),
            fixtures::node("other", &[]),
        ];
        // The pod's claim comes from a template (named in its status) and
        // asks 31 Mi: 16 pages, rounded up.
        let pod = pod(
            json!([{"name": "pages", "resourceClaimTemplateName": "dpdk-pages"}]),
            json!([{"name": "pages", "resourceClaimName": "l2fwd-pages-x7"}]),
        );
        let objects = DraObjects {
            slices: vec![
                slice("w-1", &[20, 20]),
                slice("w-2", &[32]),
                slice("other", &[64]),
            ],
            claims: vec![
                pending("l2fwd-pages-x7", "31Mi"),
                // w-1 numa0 has 8 of 20 left, numa1 all 20; w-2 has 12 of 32.
                fixtures::claim(&["u-a"], "w-1", "hugepages-2mi-numa0", "24Mi"),
                fixtures::claim(&["u-b"], "w-2", "hugepages-2mi-numa0", "40Mi"),
                fixtures::claim(&["u-c"], "other", "hugepages-2mi-numa0", "2Mi"),
            ],
        };
        let (requests, missing) = claim_requests(&pod, &objects);
        assert!(missing.is_empty());
        assert_eq!(
            requests,
            [ClaimRequest {
                claim: "l2fwd-pages-x7".into(),
                request: "pages".into(),
                size: PageSize::SIZE_2MI,
                pages: 16,
                allocated: None,
                reserved_for: vec![],
            }]
        );
        let keeps_off = |node: &Node| super::super::keeps_off(&pod, node);
        let rows = device_rows(&requests, &objects, &nodes, keeps_off);
        let seen: Vec<(&str, &str, u64, u64, &str)> = rows
            .iter()
            .map(|d| {
                let device = d.device.as_str();
                (
                    d.node.as_str(),
                    device,
                    d.capacity,
                    d.allocated,
                    d.blocked_by.as_str(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (
                    "other",
                    "hugepages-2mi-numa0",
                    64,
                    1,
                    "the pod's nodeSelector"
                ),
                ("w-1", "hugepages-2mi-numa0", 20, 12, "8 pages free < 16"),
                ("w-1", "hugepages-2mi-numa1", 20, 0, ""),
                ("w-2", "hugepages-2mi-numa0", 32, 20, "12 pages free < 16"),
            ]
        );
        assert!(verdict(&requests, &missing, &rows).starts_with("a device has room"));

        // 42 Mi (21 pages): no device the pod may use has them; the most
        // free is w-1's numa1, though "other" has more.
        let mut objects = objects;
        objects.claims[0] = pending("l2fwd-pages-x7", "42Mi");
        let (requests, _) = claim_requests(&pod, &objects);
        let rows = device_rows(&requests, &objects, &nodes, keeps_off);
        assert_eq!(
            verdict(&requests, &[], &rows),
            "claim l2fwd-pages-x7 asks 21 pages of 2Mi from one device, and no device has them free: the most is 20 on node w-1 (hugepages-2mi-numa1); grow the pool there, or wait for claims to be released"
        );
    }

    #[test]
    fn a_claim_not_made_yet_or_allocated_already_is_said_so() {
        let template = pod(
            json!([{"name": "pages", "resourceClaimTemplateName": "dpdk-pages"}]),
            json!([]),
        );
        let objects = DraObjects::default();
        let (requests, missing) = claim_requests(&template, &objects);
        assert!(requests.is_empty());
        assert_eq!(missing, ["pages (from template dpdk-pages)"]);
        assert!(
            verdict(&requests, &missing, &[])
                .starts_with("claim pages (from template dpdk-pages) does not exist yet"),
        );

        let named = pod(
            json!([{"name": "pages", "resourceClaimName": "shared-pages"}]),
            json!([]),
        );
        let mut allocated = pending("shared-pages", "8Mi");
        allocated["status"] =
            fixtures::claim(&["u-a"], "w-1", "hugepages-2mi-numa1", "8Mi")["status"].clone();
        let objects = DraObjects {
            slices: vec![slice("w-1", &[20, 20])],
            claims: vec![allocated],
        };
        let (requests, missing) = claim_requests(&named, &objects);
        assert!(missing.is_empty());
        assert_eq!(
            requests[0].allocated.as_deref(),
            Some("w-1/hugepages-2mi-numa1")
        );
        assert_eq!(requests[0].pages, 4);
        // No pending request: no device rows.
        let rows = device_rows(&requests, &objects, &[], |_| None);
        assert!(rows.is_empty());
        assert_eq!(
            verdict(&requests, &missing, &rows),
            "its claims are allocated (w-1/hugepages-2mi-numa1): hugepages are not what keeps it from running"
        );
        // Reserved for a second pod too: the second gets nothing, and why
        // says so whichever of the two is asked about.
        let mut shared = objects.clone();
        shared.claims[0]["status"]["reservedFor"] = json!([
            {"resource": "pods", "name": "l2fwd-a", "uid": "u-a"},
            {"resource": "pods", "name": "l2fwd-b", "uid": "u-b"},
        ]);
        let (requests, missing) = claim_requests(&named, &shared);
        assert_eq!(
            verdict(&requests, &missing, &[]),
            "claim shared-pages is reserved for 2 pods (l2fwd-a, l2fwd-b): a claim's pages go to \
             one pod, the one it was prepared for first, and the others' containers are refused; \
             give each pod its own claim, e.g. from a ResourceClaimTemplate (docs/user-guide.md, \
             \"One claim, one pod\")"
        );
        // A claim of another driver's class is none of hugepool's.
        let mut gpu = pending("shared-pages", "8Mi");
        gpu["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] =
            json!("gpu.example.com");
        let (requests, missing) = claim_requests(
            &named,
            &DraObjects {
                slices: vec![],
                claims: vec![gpu],
            },
        );
        assert!(requests.is_empty() && missing.is_empty());
    }
}
