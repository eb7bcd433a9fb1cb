//! The node's ResourceSlice: the pages of pools consumed through Dynamic
//! Resource Allocation (`consumption: DynamicResourceAllocation`), published
//! as consumable capacity that follows every resize.
//!
//! One device per page size and NUMA node (`hugepages-2mi-numa0`), shared by
//! any number of claims (`allowMultipleAllocations`), with a `memory`
//! capacity in bytes that claims take in whole pages (request policy:
//! default and minimum one page, step one page). A device's capacity is the
//! pages its NUMA node holds that the kubelet does not advertise as
//! `hugepages-<size>`: the kubelet reads the pool once, when it starts, and
//! pods that request `hugepages-<size>` may take all of what it advertised
//! from any one NUMA node, so each device leaves that many out. Nothing is
//! counted twice: a grow is the claims' at once, and a kubelet restart
//! that advertises it moves it back to the kubelet's side.
//!
//! What to publish is decided from one kernel read and the Node's capacity
//! ([`desired`], pure, called by the status writer); [`publish_slice`]
//! writes it with server-side apply and jittered backoff, on its own task,
//! so a slow or refused write never holds the status or the resize loop.

use std::collections::BTreeMap;

use hugepool_crds::node::PageSizeTarget;
use hugepool_crds::quantity::format_bytes;
use kube::api::{DeleteParams, DynamicObject};
use serde_json::json;

use super::status_writer::{MAX_BACKOFF, jittered};
use super::*;

pub use hugepool_crds::dra::{DRIVER, resource_slices};

/// The node's slice name: the node's name and the project's, so that one
/// node's slice is found without a list.
pub fn slice_name(node: &str) -> String {
    format!("{node}-hugepool")
}

/// One device: the claimable pages of one size on one NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub size: PageSize,
    pub numa: u32,
    pub pages: u64,
}

impl Device {
    /// A DNS label that stays the same across restarts and resizes.
    pub fn name(&self) -> String {
        hugepool_crds::dra::device_name(self.size, self.numa)
    }
}

/// What the node's slice should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Desired {
    /// No pool on this node is consumed through DRA: no slice.
    Absent,
    /// A pool is, but the Node's capacity has not been read yet: leave the
    /// slice as it is rather than publish pages the kubelet also advertises.
    Unknown,
    /// These devices, sorted by size then NUMA node; a device with no
    /// claimable page is left out (a range policy needs one page).
    Devices(Vec<Device>),
}

/// The slice one kernel read, the kubelet's advertised capacity and the
/// prepared claims call for. Sizes the kernel does not offer publish
/// nothing. A device never shows less than its prepared claims hold (the
/// kubelet, restarted, may advertise pages the claims hold; a writer other
/// than the agent may shrink the pool): the scheduler then sees it full,
/// not overcommitted.
pub fn desired(
    snapshot: &KernelSnapshot,
    targets: &[PageSizeTarget],
    kubelet_capacity: Option<&BTreeMap<PageSize, u64>>,
    claimed: &crate::dra::Claimed,
) -> Desired {
    let sizes: Vec<PageSize> = targets
        .iter()
        .filter(|t| t.by_claims())
        .map(|t| t.size)
        .collect();
    if sizes.is_empty() {
        return Desired::Absent;
    }
    let Some(capacity) = kubelet_capacity else {
        return Desired::Unknown;
    };
    let mut devices = Vec::new();
    for size in sizes {
        let Some(counts) = snapshot.size(size) else {
            continue;
        };
        let advertised = capacity.get(&size).copied().unwrap_or(0) / size.bytes();
        for numa in &counts.numa {
            let held = claimed.get(&(size, numa.node)).copied().unwrap_or(0);
            let pages = numa.persistent().saturating_sub(advertised).max(held);
            if pages > 0 {
                devices.push(Device {
                    size,
                    numa: numa.node,
                    pages,
                });
            }
        }
    }
    devices.sort_by_key(|d| (d.size, d.numa));
    Desired::Devices(devices)
}

/// The NUMA node attribute Kubernetes standardises for every driver.
pub const STANDARD_NUMA_ATTRIBUTE: &str = "resource.kubernetes.io/numaNode";
/// The NUMA node attribute of dranet's NICs and dra-driver-cpu's CPUs.
pub const DRANET_NUMA_ATTRIBUTE: &str = "dra.net/numaNode";

/// The ResourceSlice object for `devices` on `node` (owned by its Node, so
/// it goes with it), at pool generation `generation`.
pub fn slice_object(
    node: &str,
    node_uid: Option<&str>,
    generation: i64,
    devices: &[Device],
) -> serde_json::Value {
    let devices: Vec<serde_json::Value> = devices
        .iter()
        .map(|d| {
            let page = format_bytes(d.size.bytes());
            json!({
                "name": d.name(),
                "allowMultipleAllocations": true,
                // numaNode in the driver's domain, and as other drivers
                // name it so that a claim can align pages with their
                // devices (`constraints: matchAttribute`): the standard
                // attribute (KEP-6072) and dranet's, which dra-driver-cpu
                // publishes too.
                "attributes": {
                    "pageSize": {"string": d.size.to_string()},
                    "numaNode": {"int": d.numa},
                    STANDARD_NUMA_ATTRIBUTE: {"int": d.numa},
                    DRANET_NUMA_ATTRIBUTE: {"int": d.numa},
                },
                "capacity": {
                    "memory": {
                        "value": format_bytes(d.pages * d.size.bytes()),
                        "requestPolicy": {
                            "default": page,
                            "validRange": {"min": page, "step": page},
                        },
                    },
                },
            })
        })
        .collect();
    let mut metadata = json!({"name": slice_name(node)});
    if let Some(uid) = node_uid {
        metadata["ownerReferences"] = json!([{
            "apiVersion": "v1",
            "kind": "Node",
            "name": node,
            "uid": uid,
            "controller": true,
        }]);
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    })
}

/// Keeps the node's ResourceSlice as [`desired`] says: applied on every
/// change (each with the next pool generation, so the scheduler takes the
/// newest), deleted when no pool is consumed through DRA. Failed writes
/// are retried with jittered backoff; `hugepool_resource_slice_writes_total`
/// counts them by result.
pub(super) async fn publish_slice(
    api: Api<DynamicObject>,
    node: String,
    mut desired_rx: watch::Receiver<Desired>,
    shared: Arc<Shared>,
) {
    // The generation the stored slice has; read before the first write, so
    // that a restarted agent's next slice is newer than its predecessor's.
    let mut generation: Option<i64> = None;
    let mut written: Option<Desired> = None;
    let mut backoff = Duration::from_millis(250);
    let mut gone = slice_gone(api.clone(), &node);
    loop {
        let want = desired_rx.borrow_and_update().clone();
        let uid = shared.memory().kubelet.node_uid.clone();
        if want != Desired::Unknown && written.as_ref() != Some(&want) {
            let result = match &want {
                Desired::Absent => delete_slice(&api, &node).await,
                Desired::Devices(devices) => {
                    apply_slice(&api, &node, uid.as_deref(), &mut generation, devices).await
                }
                Desired::Unknown => Ok(()),
            };
            match result {
                Ok(()) => {
                    shared
                        .metrics
                        .slice_writes
                        .get_or_create(&metrics::ResultLabels::ok())
                        .inc();
                    info!(slice = %slice_name(&node), ?want, "resource slice published");
                    written = Some(want);
                    backoff = Duration::from_millis(250);
                }
                Err(err) => {
                    shared
                        .metrics
                        .slice_writes
                        .get_or_create(&metrics::ResultLabels::error())
                        .inc();
                    let wait = jittered(backoff);
                    warn!(error = %err, retry_in_ms = wait.as_millis() as u64, "resource slice write failed");
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    tokio::time::sleep(wait).await;
                    continue;
                }
            }
        }
        tokio::select! {
            changed = desired_rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            Some(()) = gone.next() => {
                if matches!(written, Some(Desired::Devices(_))) {
                    // The kubelet deletes its node's slices when it starts
                    // and a driver's while the driver is not registered.
                    warn!(slice = %slice_name(&node), "the node's resource slice was deleted: publishing it again");
                    written = None;
                }
            }
        }
    }
}

/// Yields each time the node's slice is found missing: deleted, or absent
/// when the watch (re)lists.
fn slice_gone(
    api: Api<DynamicObject>,
    node: &str,
) -> impl futures::Stream<Item = ()> + Send + Unpin + 'static {
    let config = watcher::Config::default().fields(&format!("metadata.name={}", slice_name(node)));
    let mut listed = false;
    watcher(api, config)
        .default_backoff()
        .filter_map(move |event| {
            let gone = match event {
                Ok(watcher::Event::Init) => {
                    listed = false;
                    None
                }
                Ok(watcher::Event::InitApply(_)) => {
                    listed = true;
                    None
                }
                Ok(watcher::Event::InitDone) => (!listed).then_some(()),
                Ok(watcher::Event::Delete(_)) => Some(()),
                Ok(watcher::Event::Apply(_)) => None,
                Err(err) => {
                    debug!(error = %err, "watch of the node's resource slice failed; retrying with backoff");
                    None
                }
            };
            std::future::ready(gone)
        })
        .boxed()
}

async fn apply_slice(
    api: &Api<DynamicObject>,
    node: &str,
    node_uid: Option<&str>,
    generation: &mut Option<i64>,
    devices: &[Device],
) -> kube::Result<()> {
    let current = match *generation {
        Some(g) => g,
        None => api
            .get_opt(&slice_name(node))
            .await?
            .and_then(|o| o.data["spec"]["pool"]["generation"].as_i64())
            .unwrap_or(0),
    };
    let next = current + 1;
    let body = slice_object(node, node_uid, next, devices);
    api.patch(
        &slice_name(node),
        &PatchParams::apply(AGENT_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await?;
    *generation = Some(next);
    Ok(())
}

async fn delete_slice(api: &Api<DynamicObject>, node: &str) -> kube::Result<()> {
    match api
        .delete(&slice_name(node), &DeleteParams::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::snapshot::SizeSnapshot;
    use crate::kernel::{MemInfo, NumaCounts, PoolCounts};
    use hugepool_crds::settings::Consumption;

    fn snapshot(size: PageSize, numa: &[(u32, u64, u64)]) -> KernelSnapshot {
        let numa: Vec<NumaCounts> = numa
            .iter()
            .map(|&(node, total, surplus)| NumaCounts {
                node,
                total,
                free: total,
                surplus,
            })
            .collect();
        KernelSnapshot {
            release: "test".into(),
            hvo: None,
            memory: MemInfo::default(),
            sizes: vec![SizeSnapshot {
                size,
                pool: PoolCounts {
                    total: numa.iter().map(|n| n.total).sum(),
                    free: 0,
                    reserved: 0,
                    surplus: numa.iter().map(|n| n.surplus).sum(),
                },
                numa,
            }],
            free_lists: Err("not read".into()),
        }
    }

    fn target(size: PageSize, pages: i64, consumption: Option<Consumption>) -> PageSizeTarget {
        PageSizeTarget {
            consumption,
            ..PageSizeTarget::new(size, pages)
        }
    }

    const DRA: Option<Consumption> = Some(Consumption::DynamicResourceAllocation);
    const NONE: crate::dra::Claimed = crate::dra::Claimed::new();

    #[test]
    fn pools_consumed_by_the_kubelet_publish_no_slice() {
        let kernel = snapshot(PageSize::SIZE_2MI, &[(0, 64, 0)]);
        let capacity = BTreeMap::new();
        for consumption in [None, Some(Consumption::Kubelet)] {
            let targets = [target(PageSize::SIZE_2MI, 64, consumption)];
            assert_eq!(
                desired(&kernel, &targets, Some(&capacity), &NONE),
                Desired::Absent
            );
        }
        assert_eq!(desired(&kernel, &[], None, &NONE), Desired::Absent);
    }

    #[test]
    fn nothing_is_published_before_the_kubelet_capacity_is_known() {
        let kernel = snapshot(PageSize::SIZE_2MI, &[(0, 64, 0)]);
        let targets = [target(PageSize::SIZE_2MI, 64, DRA)];
        assert_eq!(desired(&kernel, &targets, None, &NONE), Desired::Unknown);
    }

    #[test]
    fn each_numa_node_publishes_what_the_kubelet_does_not_advertise() {
        let size = PageSize::SIZE_2MI;
        // 100 and 40 pages on two NUMA nodes, 3 of node 0's surplus; the
        // kubelet started when the pool held 30.
        let kernel = snapshot(size, &[(0, 103, 3), (1, 40, 0)]);
        let targets = [target(size, 140, DRA)];
        let capacity = BTreeMap::from([(size, 30 * size.bytes())]);
        assert_eq!(
            desired(&kernel, &targets, Some(&capacity), &NONE),
            Desired::Devices(vec![
                Device {
                    size,
                    numa: 0,
                    pages: 70
                },
                Device {
                    size,
                    numa: 1,
                    pages: 10
                },
            ])
        );
        // Once the kubelet advertises more than a NUMA node holds, that
        // node's device goes; when it advertises the whole pool, all do.
        let capacity = BTreeMap::from([(size, 50 * size.bytes())]);
        assert_eq!(
            desired(&kernel, &targets, Some(&capacity), &NONE),
            Desired::Devices(vec![Device {
                size,
                numa: 0,
                pages: 50
            }])
        );
        let capacity = BTreeMap::from([(size, 140 * size.bytes())]);
        assert_eq!(
            desired(&kernel, &targets, Some(&capacity), &NONE),
            Desired::Devices(vec![])
        );
        // Never below what prepared claims hold: a kubelet restarted with
        // claims prepared advertises their pages too.
        let claimed = crate::dra::Claimed::from([((size, 1), 25)]);
        assert_eq!(
            desired(&kernel, &targets, Some(&capacity), &claimed),
            Desired::Devices(vec![Device {
                size,
                numa: 1,
                pages: 25
            }])
        );
        // A Node that lists no such size advertises none of it.
        assert_eq!(
            desired(&kernel, &targets, Some(&BTreeMap::new()), &NONE),
            Desired::Devices(vec![
                Device {
                    size,
                    numa: 0,
                    pages: 100
                },
                Device {
                    size,
                    numa: 1,
                    pages: 40
                },
            ])
        );
    }

    #[test]
    fn the_slice_names_stable_devices_with_page_granular_capacity() {
        let devices = [
            Device {
                size: PageSize::SIZE_2MI,
                numa: 0,
                pages: 64,
            },
            Device {
                size: PageSize::SIZE_1GI,
                numa: 1,
                pages: 3,
            },
        ];
        let object = slice_object("w-1", Some("uid-1"), 7, &devices);
        assert_eq!(object["metadata"]["name"], "w-1-hugepool");
        assert_eq!(object["metadata"]["ownerReferences"][0]["uid"], "uid-1");
        let spec = &object["spec"];
        assert_eq!(spec["driver"], DRIVER);
        assert_eq!(spec["nodeName"], "w-1");
        assert_eq!(
            spec["pool"],
            json!({"name": "w-1", "generation": 7, "resourceSliceCount": 1})
        );
        let first = &spec["devices"][0];
        assert_eq!(first["name"], "hugepages-2mi-numa0");
        assert_eq!(first["allowMultipleAllocations"], true);
        assert_eq!(first["attributes"]["pageSize"]["string"], "2Mi");
        assert_eq!(first["attributes"]["numaNode"]["int"], 0);
        assert_eq!(
            first["attributes"]["resource.kubernetes.io/numaNode"]["int"],
            0
        );
        assert_eq!(first["attributes"]["dra.net/numaNode"]["int"], 0);
        assert_eq!(first["capacity"]["memory"]["value"], "128Mi");
        assert_eq!(
            first["capacity"]["memory"]["requestPolicy"],
            json!({"default": "2Mi", "validRange": {"min": "2Mi", "step": "2Mi"}})
        );
        let second = &spec["devices"][1];
        assert_eq!(second["name"], "hugepages-1gi-numa1");
        assert_eq!(second["capacity"]["memory"]["value"], "3Gi");
        assert_eq!(
            second["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
            "1Gi"
        );
        assert!(
            slice_object("w-1", None, 1, &[])["metadata"]
                .get("ownerReferences")
                .is_none()
        );
    }
}
