//! Pools consumed through Dynamic Resource Allocation: the driver's name,
//! its device names, and what a ResourceClaim holds. The agent's kubelet
//! plugin and the operator's drain read claims the same way with these.

use serde::{Deserialize, Serialize};

use crate::PageSize;

/// The DRA driver the agents publish as.
pub const DRIVER: &str = "hugepages.hugepool.dev";

/// `resource.k8s.io/v1` ResourceClaim (read as JSON: GA from 1.34, newer
/// than the API version the crate's types are built for).
pub fn resource_claims() -> kube::core::ApiResource {
    kube::core::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaim"),
        "resourceclaims",
    )
}

/// `resource.k8s.io/v1` ResourceSlice (GA in Kubernetes 1.34; consumable
/// capacity, beta and on by default, from 1.36).
pub fn resource_slices() -> kube::core::ApiResource {
    kube::core::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceSlice"),
        "resourceslices",
    )
}

/// The DeviceClass the chart installs for `size`
/// (`hugepages-2mi.hugepool.dev`): a claim names it to ask for pages of it.
pub fn device_class_name(size: PageSize) -> String {
    format!(
        "hugepages-{}.{}",
        size.to_string().to_ascii_lowercase(),
        crate::GROUP
    )
}

/// The size a [`device_class_name`] stands for.
pub fn parse_device_class(name: &str) -> Option<PageSize> {
    let size = name
        .strip_prefix("hugepages-")?
        .strip_suffix(&format!(".{}", crate::GROUP))?;
    let size = parse_lowered_size(size)?;
    (device_class_name(size) == name).then_some(size)
}

/// A page size as device and class names write it, its unit lowercased
/// (`2mi` is 2Mi).
fn parse_lowered_size(lowered: &str) -> Option<PageSize> {
    let mut chars: Vec<char> = lowered.chars().collect();
    let unit = chars.iter().position(|c| c.is_ascii_alphabetic())?;
    chars[unit] = chars[unit].to_ascii_uppercase();
    chars.into_iter().collect::<String>().parse().ok()
}

/// The device of one page size on one NUMA node: a DNS label that stays
/// the same across restarts and resizes (`hugepages-2mi-numa0`).
pub fn device_name(size: PageSize, numa: u32) -> String {
    format!(
        "hugepages-{}-numa{numa}",
        size.to_string().to_ascii_lowercase()
    )
}

/// The size and NUMA node a [`device_name`] stands for.
pub fn parse_device_name(name: &str) -> Option<(PageSize, u32)> {
    let (size, numa) = name.strip_prefix("hugepages-")?.split_once("-numa")?;
    let size = parse_lowered_size(size)?;
    let numa = numa.parse().ok()?;
    (device_name(size, numa) == name).then_some((size, numa))
}

/// The pages one allocation result of a claim holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedPages {
    /// The claim's request this result serves.
    pub request: String,
    pub device: String,
    pub size: PageSize,
    pub numa: u32,
    pub pages: u64,
    /// The allocation's share of the device, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
}

/// What one claim holds on a node from this driver.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HugepageClaim {
    pub namespace: String,
    pub name: String,
    /// The uids of the pods the claim is reserved for.
    pub pods: Vec<String>,
    pub pages: Vec<ClaimedPages>,
}

/// The pods `claim` (a ResourceClaim as JSON) is reserved for, each by its
/// `field` in `status.reservedFor` (`uid` or `name`).
pub fn reserved_for(claim: &serde_json::Value, field: &str) -> Vec<String> {
    claim["status"]["reservedFor"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["resource"] == "pods")
        .filter_map(|r| r[field].as_str().map(str::to_string))
        .collect()
}

/// What `claim` (a ResourceClaim as JSON) holds on `node` from this driver,
/// or why it holds nothing here (the kubelet plugin refuses to prepare it
/// with that reason). Pure: the agent's DRA service calls it on the claim it
/// read, the operator on the claims of a node it drains.
pub fn claimed_pages(claim: &serde_json::Value, node: &str) -> Result<HugepageClaim, String> {
    let metadata = &claim["metadata"];
    let results = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .ok_or("the claim is not allocated")?;
    let mut pages = Vec::new();
    for result in results.iter().filter(|r| r["driver"] == DRIVER) {
        let device = result["device"].as_str().unwrap_or_default();
        let pool = result["pool"].as_str().unwrap_or_default();
        if pool != node {
            return Err(format!(
                "device {device} is allocated from node {pool}'s pool, not {node}'s"
            ));
        }
        let (size, numa) =
            parse_device_name(device).ok_or_else(|| format!("no such device: {device}"))?;
        let bytes = match result["consumedCapacity"]["memory"].as_str() {
            Some(quantity) => crate::quantity::parse_bytes(quantity)
                .map_err(|err| format!("device {device}: consumed memory {quantity}: {err}"))?,
            None => return Err(format!("device {device}: no consumed memory capacity")),
        };
        if bytes % size.bytes() != 0 {
            return Err(format!(
                "device {device}: {bytes} bytes is not a whole number of {size} pages"
            ));
        }
        pages.push(ClaimedPages {
            request: result["request"].as_str().unwrap_or_default().to_string(),
            device: device.to_string(),
            size,
            numa,
            pages: bytes / size.bytes(),
            share_id: result["shareID"].as_str().map(str::to_string),
        });
    }
    if pages.is_empty() {
        return Err(format!("the claim has no device of driver {DRIVER}"));
    }
    let pods = reserved_for(claim, "uid");

    Ok(HugepageClaim {
        namespace: metadata["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        name: metadata["name"].as_str().unwrap_or_default().to_string(),
        pods,
        pages,
    })
}

/// What the allocated `claims` (ResourceClaims as JSON) hold on each node
/// from this driver, by page size and NUMA node, sorted: what the operator
/// tells each node's agent to hold (`status.allocatedClaims`). A claim that
/// names no node's pool of this driver, or holds nothing a node could
/// prepare, counts nowhere.
pub fn allocated_by_node<'a>(
    claims: impl IntoIterator<Item = &'a serde_json::Value>,
) -> std::collections::BTreeMap<String, Vec<crate::node::ClaimedPagesOnNuma>> {
    let mut held: std::collections::BTreeMap<
        String,
        std::collections::BTreeMap<(PageSize, u32), u64>,
    > = Default::default();
    for claim in claims {
        let node = claim["status"]["allocation"]["devices"]["results"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["driver"] == DRIVER)
            .and_then(|r| r["pool"].as_str());
        let Some(node) = node else { continue };
        let Ok(holding) = claimed_pages(claim, node) else {
            continue;
        };
        let on_node = held.entry(node.to_string()).or_default();
        for pages in holding.pages {
            *on_node.entry((pages.size, pages.numa)).or_default() += pages.pages;
        }
    }
    held.into_iter()
        .map(|(node, pages)| {
            let pages = pages
                .into_iter()
                .map(|((size, numa), pages)| crate::node::ClaimedPagesOnNuma {
                    size,
                    numa: i32::try_from(numa).unwrap_or(i32::MAX),
                    pages: i64::try_from(pages).unwrap_or(i64::MAX),
                })
                .collect();
            (node, pages)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(results: serde_json::Value) -> serde_json::Value {
        json!({
            "metadata": {"namespace": "apps", "name": "pages", "uid": "u1"},
            "status": {
                "allocation": {"devices": {"results": results}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
            },
        })
    }

    #[test]
    fn device_classes_name_their_size_and_nothing_else() {
        for size in [PageSize::SIZE_2MI, PageSize::SIZE_1GI] {
            assert_eq!(parse_device_class(&device_class_name(size)), Some(size));
        }
        assert_eq!(
            device_class_name(PageSize::SIZE_2MI),
            "hugepages-2mi.hugepool.dev"
        );
        for other in [
            "gpu.example.com",
            "hugepages-2mi.example.com",
            "hugepages-2Mi.hugepool.dev",
            "hugepages-2mi-numa0.hugepool.dev",
        ] {
            assert_eq!(parse_device_class(other), None, "{other}");
        }
    }

    #[test]
    fn a_claim_holds_the_pages_its_allocation_consumed_on_this_node() {
        let allocated = claim(json!([{
            "request": "pages", "driver": DRIVER, "pool": "w-1",
            "device": "hugepages-2mi-numa1", "consumedCapacity": {"memory": "40Mi"},
            "shareID": "9f3c",
        }, {
            "request": "gpu", "driver": "gpu.example.com", "pool": "w-1", "device": "gpu-0",
        }]));
        let prepared = claimed_pages(&allocated, "w-1").unwrap();
        assert_eq!(prepared.namespace, "apps");
        assert_eq!(prepared.name, "pages");
        assert_eq!(prepared.pods, ["pod-1"]);
        assert_eq!(
            prepared.pages,
            [ClaimedPages {
                request: "pages".into(),
                device: "hugepages-2mi-numa1".into(),
                size: PageSize::SIZE_2MI,
                numa: 1,
                pages: 20,
                share_id: Some("9f3c".into()),
            }]
        );
    }

    #[test]
    fn allocated_claims_add_up_per_node_size_and_numa_node() {
        let on = |pool: &str, device: &str, memory: &str| {
            claim(json!([{
                "request": "pages", "driver": DRIVER, "pool": pool,
                "device": device, "consumedCapacity": {"memory": memory},
            }]))
        };
        let claims = [
            on("w-1", "hugepages-2mi-numa0", "20Mi"),
            on("w-1", "hugepages-2mi-numa0", "4Mi"),
            on("w-1", "hugepages-2mi-numa1", "2Mi"),
            on("w-1", "hugepages-1gi-numa0", "1Gi"),
            on("w-2", "hugepages-2mi-numa0", "2Mi"),
            // Not allocated, another driver, a torn result: nowhere.
            json!({"metadata": {"name": "pending"}}),
            claim(json!([{"driver": "gpu.example.com", "pool": "w-1", "device": "gpu-0"}])),
            on("w-1", "hugepages-2mi-numa0", "3Mi"),
        ];
        let held = allocated_by_node(&claims);
        let pages = |size, numa, pages| crate::node::ClaimedPagesOnNuma { size, numa, pages };
        assert_eq!(
            held["w-1"],
            [
                pages(PageSize::SIZE_2MI, 0, 12),
                pages(PageSize::SIZE_2MI, 1, 1),
                pages(PageSize::SIZE_1GI, 0, 1),
            ]
        );
        assert_eq!(held["w-2"], [pages(PageSize::SIZE_2MI, 0, 1)]);
        assert_eq!(held.len(), 2);
    }

    #[test]
    fn claims_that_cannot_be_prepared_here_say_why() {
        let cases = [
            (json!({"metadata": {}}), "not allocated"),
            (
                claim(
                    json!([{"driver": DRIVER, "pool": "w-2", "device": "hugepages-2mi-numa0",
                               "consumedCapacity": {"memory": "2Mi"}}]),
                ),
                "node w-2's pool, not w-1's",
            ),
            (
                claim(json!([{"driver": DRIVER, "pool": "w-1", "device": "gpu-0",
                               "consumedCapacity": {"memory": "2Mi"}}])),
                "no such device: gpu-0",
            ),
            (
                claim(json!([{"driver": DRIVER, "pool": "w-1", "device": "hugepages-2mi-numa0"}])),
                "no consumed memory capacity",
            ),
            (
                claim(
                    json!([{"driver": DRIVER, "pool": "w-1", "device": "hugepages-2mi-numa0",
                               "consumedCapacity": {"memory": "3Mi"}}]),
                ),
                "not a whole number of 2Mi pages",
            ),
            (
                claim(json!([{"driver": "gpu.example.com", "pool": "w-1", "device": "gpu-0"}])),
                "no device of driver",
            ),
        ];
        for (claim, why) in cases {
            let error = claimed_pages(&claim, "w-1").unwrap_err();
            assert!(error.contains(why), "{error} (wanted {why})");
        }
    }

    #[test]
    fn device_names_read_back_as_their_size_and_numa_node() {
        for (size, numa) in [(PageSize::SIZE_2MI, 0), (PageSize::SIZE_1GI, 3)] {
            assert_eq!(
                parse_device_name(&device_name(size, numa)),
                Some((size, numa))
            );
        }
        assert_eq!(device_name(PageSize::SIZE_2MI, 1), "hugepages-2mi-numa1");
        for other in [
            "gpu-0",
            "hugepages-2mi",
            "hugepages-3mi-numa0",
            "hugepages-2mi-numa01",
            "hugepages-2Mi-numa0",
        ] {
            assert_eq!(parse_device_name(other), None, "{other}");
        }
    }
}
