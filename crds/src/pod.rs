//! What a pod asks of huge pages, counted as Kubernetes counts a pod's
//! request (the scheduler's and the kubelet's `PodRequests`): the agent
//! reports the pages the pods bound to its node request from it, and the
//! operator's drains size their evictions with it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, ResourceRequirements};

use crate::{PageSize, quantity};

/// Bytes of `resource` one set of requirements asks for: its request, or
/// its limit when it has none (the API server defaults a missing request
/// to the limit; for huge pages the two must be equal). A quantity that
/// does not parse counts as nothing.
fn asked(resources: Option<&ResourceRequirements>, resource: &str) -> Option<u64> {
    let resources = resources?;
    [&resources.requests, &resources.limits]
        .into_iter()
        .flatten()
        .find_map(|amounts| amounts.get(resource))
        .map(|amount| quantity::parse_bytes(&amount.0).unwrap_or(0))
}

fn container_bytes(container: &Container, resource: &str) -> u64 {
    asked(container.resources.as_ref(), resource).unwrap_or(0)
}

/// Whether an init container is a sidecar: it keeps running beside the
/// app containers (`restartPolicy: Always`).
fn is_sidecar(container: &Container) -> bool {
    container.restart_policy.as_deref() == Some("Always")
}

/// Bytes of `hugepages-<size>` the pod requests, as Kubernetes sizes a pod:
/// the larger of (every app container plus every sidecar) and, for each
/// ordinary init container, its own request plus the sidecars started
/// before it; plus the RuntimeClass's overhead. A pod-level request
/// (`spec.resources`) replaces the containers' sum.
pub fn requested_bytes(pod: &Pod, size: PageSize) -> u64 {
    let Some(spec) = &pod.spec else {
        return 0;
    };
    let resource = size.resource_name();
    let overhead = spec
        .overhead
        .as_ref()
        .and_then(|o| o.get(&resource))
        .map_or(0, |amount| quantity::parse_bytes(&amount.0).unwrap_or(0));
    if let Some(pod_level) = asked(spec.resources.as_ref(), &resource) {
        return pod_level.saturating_add(overhead);
    }
    let mut running: u64 = spec
        .containers
        .iter()
        .map(|c| container_bytes(c, &resource))
        .fold(0, u64::saturating_add);
    let mut sidecars: u64 = 0;
    let mut init_peak: u64 = 0;
    for container in spec.init_containers.iter().flatten() {
        let bytes = container_bytes(container, &resource);
        if is_sidecar(container) {
            sidecars = sidecars.saturating_add(bytes);
            running = running.saturating_add(bytes);
            init_peak = init_peak.max(sidecars);
        } else {
            init_peak = init_peak.max(bytes.saturating_add(sidecars));
        }
    }
    running.max(init_peak).saturating_add(overhead)
}

/// Pages of `size` the pod requests ([`requested_bytes`] in whole pages).
pub fn requested_pages(pod: &Pod, size: PageSize) -> u64 {
    requested_bytes(pod, size) / size.bytes()
}

/// A pod that has ended (Succeeded or Failed): the kubelet has released
/// what it held, and the scheduler no longer counts it.
pub fn is_terminal(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// The `hugepages-<size>` sizes any of the pod's containers, its
/// pod-level resources or its overhead name.
pub fn named_sizes(pod: &Pod) -> Vec<PageSize> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref());
    let mut sizes: Vec<PageSize> = containers
        .chain(spec.resources.as_ref())
        .flat_map(|r| [&r.requests, &r.limits])
        .flatten()
        .chain(spec.overhead.as_ref())
        .flat_map(|amounts| amounts.keys())
        .filter_map(|name| name.strip_prefix("hugepages-")?.parse().ok())
        .collect();
    sizes.sort();
    sizes.dedup();
    sizes
}

/// Pages per size that `pods` request, terminal pods left out: what the
/// pods bound to a node ask of its pools. Pods that are terminating still
/// count, since they hold their pages until they are gone.
pub fn requested_pages_by_size<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
) -> BTreeMap<PageSize, u64> {
    let mut requested: BTreeMap<PageSize, u64> = BTreeMap::new();
    for pod in pods.into_iter().filter(|pod| !is_terminal(pod)) {
        for size in named_sizes(pod) {
            let pages = requested_pages(pod, size);
            if pages > 0 {
                let total = requested.entry(size).or_default();
                *total = total.saturating_add(pages);
            }
        }
    }
    requested
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn amounts(list: &[(&str, &str)]) -> Option<BTreeMap<String, Quantity>> {
        Some(
            list.iter()
                .map(|(name, amount)| (name.to_string(), Quantity(amount.to_string())))
                .collect(),
        )
    }

    fn container(name: &str, requests: &[(&str, &str)]) -> Container {
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                requests: amounts(requests),
                limits: amounts(requests),
                ..ResourceRequirements::default()
            }),
            ..Container::default()
        }
    }

    fn sidecar(name: &str, requests: &[(&str, &str)]) -> Container {
        Container {
            restart_policy: Some("Always".into()),
            ..container(name, requests)
        }
    }

    fn pod(containers: Vec<Container>, init: Vec<Container>) -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers,
                init_containers: (!init.is_empty()).then_some(init),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    const MI2: PageSize = PageSize::SIZE_2MI;

    #[test]
    fn app_containers_add_up() {
        let p = pod(
            vec![
                container("a", &[("hugepages-2Mi", "64Mi"), ("memory", "1Gi")]),
                container("b", &[("hugepages-2Mi", "32Mi")]),
                container("c", &[("cpu", "1")]),
            ],
            vec![],
        );
        assert_eq!(requested_pages(&p, MI2), 48);
        assert_eq!(requested_pages(&p, PageSize::SIZE_1GI), 0);
    }

    #[test]
    fn the_largest_init_container_counts_when_it_exceeds_the_app_containers() {
        let p = pod(
            vec![container("app", &[("hugepages-2Mi", "16Mi")])],
            vec![
                container("init-small", &[("hugepages-2Mi", "8Mi")]),
                container("init-big", &[("hugepages-2Mi", "200Mi")]),
            ],
        );
        assert_eq!(requested_pages(&p, MI2), 100);
        let small_init = pod(
            vec![container("app", &[("hugepages-2Mi", "16Mi")])],
            vec![container("init", &[("hugepages-2Mi", "4Mi")])],
        );
        assert_eq!(requested_pages(&small_init, MI2), 8);
    }

    #[test]
    fn sidecars_run_beside_the_app_and_under_later_init_containers() {
        // sidecar (10Mi) + app (20Mi) = 30Mi run together; the init
        // container after the sidecar runs with it: 24Mi + 10Mi = 34Mi.
        let p = pod(
            vec![container("app", &[("hugepages-2Mi", "20Mi")])],
            vec![
                container("before", &[("hugepages-2Mi", "30Mi")]),
                sidecar("proxy", &[("hugepages-2Mi", "10Mi")]),
                container("after", &[("hugepages-2Mi", "24Mi")]),
            ],
        );
        assert_eq!(requested_bytes(&p, MI2), 34 << 20);
        // Without the later init container the sidecar adds to the app.
        let p = pod(
            vec![container("app", &[("hugepages-2Mi", "20Mi")])],
            vec![sidecar("proxy", &[("hugepages-2Mi", "10Mi")])],
        );
        assert_eq!(requested_pages(&p, MI2), 15);
    }

    #[test]
    fn overhead_is_added_and_a_pod_level_request_replaces_the_containers() {
        let mut p = pod(vec![container("app", &[("hugepages-1Gi", "2Gi")])], vec![]);
        p.spec.as_mut().unwrap().overhead = amounts(&[("hugepages-1Gi", "1Gi")]);
        assert_eq!(requested_pages(&p, PageSize::SIZE_1GI), 3);
        p.spec.as_mut().unwrap().resources = Some(ResourceRequirements {
            requests: amounts(&[("hugepages-1Gi", "4Gi")]),
            ..ResourceRequirements::default()
        });
        assert_eq!(requested_pages(&p, PageSize::SIZE_1GI), 5);
        assert_eq!(named_sizes(&p), vec![PageSize::SIZE_1GI]);
    }

    #[test]
    fn a_limit_alone_is_the_request() {
        let mut c = container("app", &[]);
        c.resources = Some(ResourceRequirements {
            limits: amounts(&[("hugepages-2Mi", "8Mi")]),
            ..ResourceRequirements::default()
        });
        assert_eq!(requested_pages(&pod(vec![c], vec![]), MI2), 4);
    }

    #[test]
    fn terminal_pods_and_other_sizes_are_left_out_of_a_nodes_count() {
        let phase = |p: &str| {
            let mut pod = pod(vec![container("app", &[("hugepages-2Mi", "64Mi")])], vec![]);
            pod.status = Some(PodStatus {
                phase: Some(p.into()),
                ..PodStatus::default()
            });
            pod
        };
        let mut terminating = phase("Running");
        terminating.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        let gig = pod(vec![container("vm", &[("hugepages-1Gi", "4Gi")])], vec![]);
        let none = pod(vec![container("web", &[("cpu", "1")])], vec![]);
        let zero = pod(vec![container("z", &[("hugepages-2Mi", "0")])], vec![]);
        let pods = [
            phase("Running"),
            phase("Pending"),
            phase("Succeeded"),
            phase("Failed"),
            terminating,
            gig,
            none,
            zero,
        ];
        assert_eq!(
            requested_pages_by_size(&pods),
            BTreeMap::from([(MI2, 96), (PageSize::SIZE_1GI, 4)])
        );
        assert!(requested_pages_by_size(&[]).is_empty());
    }
}
