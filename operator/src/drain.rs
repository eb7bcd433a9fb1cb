//! Drain helpers: which pods consume a page size, how long to wait before
//! retrying an eviction a PodDisruptionBudget refused, and the eviction call.

use std::collections::BTreeMap;
use std::time::Duration;

use hugepool_crds::PageSize;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Pod, ResourceRequirements};
use kube::api::{
    Api, DeleteParams, DynamicObject, EvictParams, ListParams, PostParams, Preconditions,
};
use kube::{Client, ResourceExt};

/// First wait after a refused eviction; it doubles up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Whether any container of `pod` requests (or is limited to) one of `sizes`.
pub fn requests_hugepages(pod: &Pod, sizes: &[PageSize]) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    let names: Vec<String> = sizes.iter().map(|s| s.resource_name()).collect();
    let asks = |resources: &Option<ResourceRequirements>| {
        resources.as_ref().is_some_and(|r| {
            [&r.requests, &r.limits]
                .into_iter()
                .flatten()
                .any(|amounts| {
                    amounts
                        .iter()
                        .any(|(name, amount)| names.contains(name) && amount.0 != "0")
                })
        })
    };
    spec.containers.iter().any(|c| asks(&c.resources))
        || spec
            .init_containers
            .iter()
            .flatten()
            .any(|c| asks(&c.resources))
}

/// Why a consumer is never evicted: its pages would not come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unevictable {
    /// A DaemonSet recreates it on the same node at once (and tolerates the
    /// draining taint, as DaemonSet pods tolerate NoSchedule taints they ask for).
    DaemonSet,
    /// A static pod: the kubelet runs it from a file; its API object is a
    /// mirror that the Eviction API cannot stop.
    Static,
}

impl Unevictable {
    pub fn of(pod: &Pod) -> Option<Self> {
        let mirror = pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"));
        if mirror {
            return Some(Self::Static);
        }
        pod.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true) && o.kind == "DaemonSet")
            .then_some(Self::DaemonSet)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Unevictable::DaemonSet => "DaemonSet-owned",
            Unevictable::Static => "static pod",
        }
    }
}

/// Pages that DRA claims (driver `hugepages.hugepool.dev`) hold on a node,
/// per pod UID and page size: a pod that consumes a pool through DRA
/// requests no `hugepages-<size>`, its claims hold the pages. A claim
/// reserved for several pods counts for each (its pages come back when the
/// last one goes: a drain evicts on until the agent reports them free).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claims(BTreeMap<String, BTreeMap<PageSize, u64>>);

impl Claims {
    /// What `claims` (ResourceClaims as JSON) hold from `node`'s pool.
    /// Claims that hold nothing there (not allocated, another driver's,
    /// another node's) are left out.
    pub fn on_node(claims: &[serde_json::Value], node: &str) -> Self {
        let mut held: BTreeMap<String, BTreeMap<PageSize, u64>> = BTreeMap::new();
        for claim in claims {
            let Ok(holding) = hugepool_crds::dra::claimed_pages(claim, node) else {
                continue;
            };
            for pod in &holding.pods {
                let sizes = held.entry(pod.clone()).or_default();
                for pages in &holding.pages {
                    *sizes.entry(pages.size).or_default() += pages.pages;
                }
            }
        }
        Self(held)
    }

    /// What the claims of `pods` hold on `node`, read from the API: the
    /// ResourceClaims of the namespaces where any of `pods` uses claims (no
    /// request at all when none does).
    pub async fn read(client: &Client, node: &str, pods: &[Pod]) -> Result<Self, ListClaimsError> {
        let mut claims = Vec::new();
        for namespace in claim_namespaces(pods) {
            let api: Api<DynamicObject> = Api::namespaced_with(
                client.clone(),
                &namespace,
                &hugepool_crds::dra::resource_claims(),
            );
            let listed = list_served(&api, &ListParams::default())
                .await
                .map_err(|source| ListClaimsError {
                    namespace: namespace.clone(),
                    source,
                })?;
            claims.extend(
                listed
                    .into_iter()
                    .filter_map(|claim| serde_json::to_value(claim).ok()),
            );
        }
        Ok(Self::on_node(&claims, node))
    }

    /// Pages of `size` the pod's claims hold.
    pub fn pages(&self, pod: &Pod, size: PageSize) -> u64 {
        pod.metadata
            .uid
            .as_ref()
            .and_then(|uid| self.0.get(uid))
            .and_then(|sizes| sizes.get(&size))
            .copied()
            .unwrap_or(0)
    }

    fn hold_any(&self, pod: &Pod, sizes: &[PageSize]) -> bool {
        sizes.iter().any(|&size| self.pages(pod, size) > 0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The objects `api` lists, or none when the server does not serve their
/// API (404): resource.k8s.io/v1 before Kubernetes 1.34, where a pod's
/// claims (of another API version, another driver's) cannot hold hugepool's
/// pages, so a drain must not stall on them.
pub async fn list_served(
    api: &Api<DynamicObject>,
    params: &ListParams,
) -> Result<Vec<DynamicObject>, kube::Error> {
    match api.list(params).await {
        Ok(list) => Ok(list.items),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// A list of one namespace's ResourceClaims that failed.
#[derive(Debug, thiserror::Error)]
#[error("listing the ResourceClaims in namespace {namespace}: {source}")]
pub struct ListClaimsError {
    pub namespace: String,
    pub source: kube::Error,
}

/// What a node's pods hold: the pods bound to it and what DRA claims hold
/// for them.
#[derive(Default)]
pub struct OnNode {
    pub pods: Vec<Pod>,
    pub claims: Claims,
}

/// Whether `pod` uses ResourceClaims (named or from a template).
pub fn uses_claims(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .is_some_and(|claims| !claims.is_empty())
}

/// The namespaces of the pods that use ResourceClaims (named or from a
/// template: the pod's spec lists both), sorted: where a drain looks for
/// the claims of a node's pods.
pub fn claim_namespaces(pods: &[Pod]) -> Vec<String> {
    let mut namespaces: Vec<String> = pods
        .iter()
        .filter(|pod| uses_claims(pod))
        .filter_map(|pod| pod.namespace())
        .collect();
    namespaces.sort();
    namespaces.dedup();
    namespaces
}

/// Whether the pod requests one of `sizes` or its claims hold one.
fn holds(pod: &Pod, claims: &Claims, sizes: &[PageSize]) -> bool {
    requests_hugepages(pod, sizes) || claims.hold_any(pod, sizes)
}

/// Pods that hold one of `sizes` now: they request it or their claims hold
/// it, are not already going and not finished (a finished pod's pages are
/// already free).
pub fn holders<'p: 'c, 'c>(
    pods: &'p [Pod],
    claims: &'c Claims,
    sizes: &'c [PageSize],
) -> impl Iterator<Item = &'p Pod> + 'c {
    pods.iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .filter(|pod| {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Succeeded" | "Failed"))
        })
        .filter(move |pod| holds(pod, claims, sizes))
}

/// Pods to evict: the holders of `sizes` that eviction can move.
pub fn hugepage_consumers<'a>(
    pods: &'a [Pod],
    claims: &Claims,
    sizes: &[PageSize],
) -> Vec<&'a Pod> {
    let mut consumers: Vec<&Pod> = holders(pods, claims, sizes)
        .filter(|pod| Unevictable::of(pod).is_none())
        .collect();
    consumers.sort_by_key(|pod| (pod.namespace(), pod.name_any()));
    consumers
}

/// Pages of `size` the pod may hold: what it requests, as the kubelet
/// sizes a pod (init containers, sidecars and overhead included; the one
/// definition the agent's report of requested pages uses too), and what
/// its DRA claims hold.
pub fn pages_held(pod: &Pod, claims: &Claims, size: PageSize) -> u64 {
    hugepool_crds::pod::requested_pages(pod, size) + claims.pages(pod, size)
}

/// Which pods a drain of `size` evicts, when `must_free` pages of it have
/// to come back for the shrink to finish.
#[derive(Debug, PartialEq)]
pub struct Selection<'a> {
    pub evict: Vec<&'a Pod>,
    /// Why nothing is evicted although pages are held, for the Draining message.
    pub unexplained: Option<String>,
}

/// The fewest pods whose requests or claims free `must_free` pages of `size`: the
/// agent's word alone (its reported pages in use) never evicts anything
/// the pods' own requests cannot explain. Lower priority first, then the
/// larger holders (fewest pods), then by name; pods already terminating
/// count as freeing their pages; DaemonSet-owned and static pods are never
/// chosen.
pub fn choose<'a>(
    pods: &'a [Pod],
    claims: &Claims,
    size: PageSize,
    must_free: u64,
) -> Selection<'a> {
    let sizes = [size];
    let going: u64 = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_some())
        .filter(|p| holds(p, claims, &sizes))
        .map(|p| pages_held(p, claims, size))
        .sum();
    let held: u64 = holders(pods, claims, &sizes)
        .map(|p| pages_held(p, claims, size))
        .sum();
    if held + going < must_free {
        return Selection {
            evict: Vec::new(),
            unexplained: Some(format!(
                "not evicting: pods on the node request or claim {} pages of {size}, but \
                 {must_free} must be freed (pages held outside pods cannot be drained)",
                held + going
            )),
        };
    }
    let mut candidates = hugepage_consumers(pods, claims, &sizes);
    // Only what eviction can move counts: when DaemonSet-owned or static
    // pods hold the rest, evicting every other consumer would not let the
    // shrink finish, so nobody is evicted.
    let movable: u64 = candidates.iter().map(|p| pages_held(p, claims, size)).sum();
    if movable + going < must_free {
        return Selection {
            evict: Vec::new(),
            unexplained: Some(format!(
                "not evicting: evictable pods hold {} pages of {size} and {going} are being \
                 freed, but {must_free} must be freed (the rest is held by pods that are never \
                 evicted)",
                movable
            )),
        };
    }
    candidates.sort_by_key(|p| {
        let priority = p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        (
            priority,
            std::cmp::Reverse(pages_held(p, claims, size)),
            p.namespace(),
            p.name_any(),
        )
    });
    let mut freed = going;
    let mut evict = Vec::new();
    for pod in candidates {
        if freed >= must_free {
            break;
        }
        freed += pages_held(pod, claims, size);
        evict.push(pod);
    }
    Selection {
        evict,
        unexplained: None,
    }
}

/// The holders of `sizes` that are never evicted, as `namespace/name (why)`,
/// for the node's Draining condition.
pub fn unevictable_consumers(pods: &[Pod], claims: &Claims, sizes: &[PageSize]) -> Vec<String> {
    let mut found: Vec<String> = holders(pods, claims, sizes)
        .filter_map(|pod| {
            let why = Unevictable::of(pod)?;
            Some(format!(
                "{}/{} ({})",
                pod.namespace().unwrap_or_default(),
                pod.name_any(),
                why.as_str()
            ))
        })
        .collect();
    found.sort();
    found
}

/// The pods on the node whose UIDs the agent lists as held by the kubelet's
/// Static Memory Manager (a kubelet restart waits for them): those eviction
/// can move, sorted, and those it never evicts, as `namespace/name (why)`.
pub fn memory_manager_holders<'a>(pods: &'a [Pod], uids: &[String]) -> (Vec<&'a Pod>, Vec<String>) {
    let mut evict = Vec::new();
    let mut kept = Vec::new();
    for pod in pods
        .iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .filter(|pod| {
            pod.metadata
                .uid
                .as_ref()
                .is_some_and(|uid| uids.contains(uid))
        })
    {
        match Unevictable::of(pod) {
            None => evict.push(pod),
            Some(why) => kept.push(format!(
                "{}/{} ({})",
                pod.namespace().unwrap_or_default(),
                pod.name_any(),
                why.as_str()
            )),
        }
    }
    evict.sort_by_key(|pod| (pod.namespace(), pod.name_any()));
    kept.sort();
    (evict, kept)
}

/// Retry state of one pod whose eviction was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictionBackoff {
    pub attempts: u32,
    pub next_try: Timestamp,
}

impl EvictionBackoff {
    /// The state after a refusal at `now`.
    pub fn refused(previous: Option<&EvictionBackoff>, now: Timestamp) -> Self {
        let attempts = previous.map_or(0, |b| b.attempts) + 1;
        let wait = FIRST_BACKOFF
            .saturating_mul(1 << attempts.saturating_sub(1).min(16))
            .min(MAX_BACKOFF);
        let next_try = jiff::SignedDuration::try_from(wait)
            .ok()
            .and_then(|wait| now.checked_add(wait).ok())
            .unwrap_or(now);
        Self { attempts, next_try }
    }
}

/// Backoffs of refused evictions, by pod UID (a pod re-created under the
/// same name starts over), each with the node it ran on, so that a node's
/// pods that are gone are forgotten.
#[derive(Debug, Default)]
pub struct Refusals {
    by_uid: BTreeMap<String, (String, EvictionBackoff)>,
}

impl Refusals {
    pub fn get(&self, uid: &str) -> Option<&EvictionBackoff> {
        self.by_uid.get(uid).map(|(_, backoff)| backoff)
    }

    /// Records a refusal at `now`; returns the new backoff.
    pub fn refused(&mut self, uid: &str, node: &str, now: Timestamp) -> EvictionBackoff {
        let backoff = EvictionBackoff::refused(self.get(uid), now);
        self.by_uid
            .insert(uid.to_string(), (node.to_string(), backoff.clone()));
        backoff
    }

    pub fn forget(&mut self, uid: &str) {
        self.by_uid.remove(uid);
    }

    /// When each backoff ends.
    pub fn next_tries(&self) -> impl Iterator<Item = Timestamp> + '_ {
        self.by_uid.values().map(|(_, b)| b.next_try)
    }

    /// Forgets the refusals of `node`'s pods that are not in `pods` (its
    /// pods now; none when it is not draining).
    pub fn prune(&mut self, node: &str, pods: &[Pod]) {
        self.by_uid.retain(|uid, (on, _)| {
            on != node
                || pods
                    .iter()
                    .any(|p| p.metadata.uid.as_deref() == Some(uid.as_str()))
        });
    }

    pub fn len(&self) -> usize {
        self.by_uid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_uid.is_empty()
    }
}

/// How one eviction went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Eviction {
    /// The API server accepted it.
    Evicted,
    /// 404: the pod is already gone; nothing was evicted.
    Gone,
    /// 429: a PodDisruptionBudget does not allow it now.
    Blocked(String),
    Failed(String),
    /// Not sent for real: the plan no longer needs it (why).
    Abandoned(String),
}

impl Eviction {
    /// The `result` label of `hugepool_evictions_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Eviction::Evicted => "evicted",
            Eviction::Gone => "gone",
            Eviction::Blocked(_) => "blocked",
            Eviction::Failed(_) => "failed",
            Eviction::Abandoned(_) => "abandoned",
        }
    }
}

/// Evicts one pod through the Eviction API, so PodDisruptionBudgets apply;
/// with `dry_run`, only asks whether the API would evict it now.
pub async fn evict(client: &Client, pod: &Pod, dry_run: bool) -> Eviction {
    let namespace = pod.namespace().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    // Only the pod the plan saw: a pod re-created under its name since is
    // another pod (the server answers 409, a refusal retried later).
    let params = EvictParams {
        delete_options: Some(DeleteParams {
            preconditions: pod.metadata.uid.clone().map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            dry_run,
            ..DeleteParams::default()
        }),
        post_options: PostParams {
            dry_run,
            ..PostParams::default()
        },
    };
    match api.evict(&pod.name_any(), &params).await {
        Ok(_) => Eviction::Evicted,
        Err(kube::Error::Api(status)) if status.code == 404 => Eviction::Gone,
        Err(kube::Error::Api(status)) if status.code == 429 => Eviction::Blocked(status.message),
        Err(err) => Eviction::Failed(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};

    use super::*;
    use crate::fixtures::claim;

    const NONE: Claims = Claims(BTreeMap::new());

    fn pod(name: &str, resources: &[(&str, &str)]) -> Pod {
        let amounts: BTreeMap<String, Quantity> = resources
            .iter()
            .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
            .collect();
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("apps".into()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "main".into(),
                    resources: Some(ResourceRequirements {
                        limits: Some(amounts.clone()),
                        requests: Some(amounts),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                ..PodStatus::default()
            }),
        }
    }

    #[test]
    fn only_pods_requesting_the_blocked_size_are_evicted() {
        let mut terminating = pod("going", &[("hugepages-2Mi", "4Mi")]);
        terminating.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        let mut finished = pod("done", &[("hugepages-2Mi", "4Mi")]);
        finished.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let pods = vec![
            pod("dpdk", &[("hugepages-2Mi", "8Mi"), ("memory", "1Gi")]),
            pod("web", &[("cpu", "1"), ("memory", "1Gi")]),
            pod("db", &[("hugepages-1Gi", "2Gi")]),
            pod("zero", &[("hugepages-2Mi", "0")]),
            terminating,
            finished,
        ];
        let names: Vec<String> = hugepage_consumers(&pods, &NONE, &[PageSize::SIZE_2MI])
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(names, ["dpdk"]);
        let both = hugepage_consumers(&pods, &NONE, &[PageSize::SIZE_2MI, PageSize::SIZE_1GI]);
        assert_eq!(both.len(), 2);
    }

    fn controlled_by(kind: &str, name: &str) -> Option<Vec<OwnerReference>> {
        Some(vec![OwnerReference {
            api_version: "apps/v1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: format!("{kind}-{name}"),
            controller: Some(true),
            ..OwnerReference::default()
        }])
    }

    #[test]
    fn daemonset_and_static_pods_are_never_evicted_but_named() {
        let mut daemon = pod("agent-x", &[("hugepages-2Mi", "4Mi")]);
        daemon.metadata.owner_references = controlled_by("DaemonSet", "agent");
        let mut mirror = pod("holder-vm", &[("hugepages-2Mi", "4Mi")]);
        mirror.metadata.annotations =
            Some([("kubernetes.io/config.mirror".to_string(), "abc".to_string())].into());
        let mut replica = pod("dpdk-7f9", &[("hugepages-2Mi", "4Mi")]);
        replica.metadata.owner_references = controlled_by("ReplicaSet", "dpdk-7f");
        let pods = vec![daemon, mirror, replica];
        let evict: Vec<String> = hugepage_consumers(&pods, &NONE, &[PageSize::SIZE_2MI])
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(evict, ["dpdk-7f9"]);
        assert_eq!(
            unevictable_consumers(&pods, &NONE, &[PageSize::SIZE_2MI]),
            [
                "apps/agent-x (DaemonSet-owned)",
                "apps/holder-vm (static pod)"
            ]
        );
    }

    #[test]
    fn refusals_are_kept_by_uid_and_forgotten_when_the_pod_is_gone() {
        let now = Timestamp::UNIX_EPOCH;
        let mut old = pod("db-0", &[("hugepages-2Mi", "4Mi")]);
        old.metadata.uid = Some("uid-1".into());
        let mut other = pod("db-1", &[("hugepages-2Mi", "4Mi")]);
        other.metadata.uid = Some("uid-2".into());
        let mut refusals = Refusals::default();
        refusals.refused("uid-1", "n1", now);
        assert_eq!(refusals.refused("uid-1", "n1", now).attempts, 2);
        refusals.refused("uid-2", "n1", now);
        refusals.refused("uid-9", "n2", now);
        // db-0 re-created under its name has a new UID: no backoff inherited.
        let mut recreated = pod("db-0", &[("hugepages-2Mi", "4Mi")]);
        recreated.metadata.uid = Some("uid-3".into());
        assert!(refusals.get("uid-3").is_none());
        // n1 now runs the new db-0 and db-1: the old db-0 is forgotten, the
        // other node's refusal stays.
        refusals.prune("n1", &[recreated, other]);
        assert!(refusals.get("uid-1").is_none());
        assert_eq!(refusals.get("uid-2").map(|b| b.attempts), Some(1));
        assert_eq!(refusals.get("uid-9").map(|b| b.attempts), Some(1));
        // A node no longer draining forgets all of its own.
        refusals.prune("n1", &[]);
        assert_eq!(refusals.len(), 1);
        refusals.forget("uid-9");
        assert!(refusals.is_empty());
        drop(old);
    }

    #[test]
    fn refused_evictions_back_off_exponentially_up_to_a_cap() {
        let now = Timestamp::UNIX_EPOCH;
        let mut backoff = EvictionBackoff::refused(None, now);
        let mut waits = vec![backoff.next_try.as_second()];
        for _ in 0..7 {
            backoff = EvictionBackoff::refused(Some(&backoff), now);
            waits.push(backoff.next_try.as_second());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    fn with_priority(mut pod: Pod, priority: i32) -> Pod {
        pod.spec.as_mut().unwrap().priority = Some(priority);
        pod
    }

    fn names(selection: &Selection<'_>) -> Vec<String> {
        selection.evict.iter().map(|p| p.name_any()).collect()
    }

    #[test]
    fn a_drain_evicts_the_fewest_pods_that_free_what_the_shrink_needs() {
        let two_mi = PageSize::SIZE_2MI;
        let pods = vec![
            pod("small", &[("hugepages-2Mi", "16Mi")]),  // 8 pages
            pod("large", &[("hugepages-2Mi", "64Mi")]),  // 32 pages
            pod("medium", &[("hugepages-2Mi", "32Mi")]), // 16 pages
            pod("web", &[("memory", "1Gi")]),
        ];
        assert_eq!(pages_held(&pods[1], &NONE, two_mi), 32);
        // 20 pages: the large one alone.
        assert_eq!(names(&choose(&pods, &NONE, two_mi, 20)), ["large"]);
        // 40: large and medium, not all three.
        assert_eq!(
            names(&choose(&pods, &NONE, two_mi, 40)),
            ["large", "medium"]
        );
        // Nothing to free: nobody goes.
        assert!(choose(&pods, &NONE, two_mi, 0).evict.is_empty());
        // Lower priority goes first, even when smaller.
        let ranked = vec![
            with_priority(pod("important", &[("hugepages-2Mi", "64Mi")]), 1000),
            with_priority(pod("batch", &[("hugepages-2Mi", "16Mi")]), 0),
        ];
        assert_eq!(names(&choose(&ranked, &NONE, two_mi, 8)), ["batch"]);
        assert_eq!(
            names(&choose(&ranked, &NONE, two_mi, 9)),
            ["batch", "important"]
        );
    }

    #[test]
    fn memory_manager_holders_are_the_listed_pods_eviction_can_move() {
        let with_uid = |mut p: Pod, uid: &str| {
            p.metadata.uid = Some(uid.into());
            p
        };
        // Holding memory, not hugepages: the Memory Manager assigns both.
        let vm = with_uid(pod("vm", &[("memory", "1Gi")]), "u-vm");
        let mut mirror = with_uid(pod("static-vm", &[("memory", "1Gi")]), "u-static");
        mirror.metadata.annotations =
            Some([("kubernetes.io/config.mirror".to_string(), "abc".to_string())].into());
        let mut going = with_uid(pod("going", &[("memory", "1Gi")]), "u-going");
        going.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        let other = with_uid(pod("other", &[("hugepages-2Mi", "16Mi")]), "u-other");
        let pods = vec![other, mirror, going, vm];
        let listed: Vec<String> = ["u-vm", "u-static", "u-going", "u-gone"]
            .map(String::from)
            .to_vec();
        let (evict, kept) = memory_manager_holders(&pods, &listed);
        assert_eq!(
            evict.iter().map(|p| p.name_any()).collect::<Vec<_>>(),
            ["vm"]
        );
        assert_eq!(kept, ["apps/static-vm (static pod)"]);
        assert!(memory_manager_holders(&pods, &[]).0.is_empty());
    }

    #[test]
    fn pages_the_pods_cannot_explain_evict_nothing() {
        let pods = vec![pod("dpdk", &[("hugepages-2Mi", "16Mi")])];
        let selection = choose(&pods, &NONE, PageSize::SIZE_2MI, 100);
        assert!(selection.evict.is_empty());
        let why = selection.unexplained.expect("a reason");
        assert!(
            why.contains("request or claim 8 pages of 2Mi, but 100 must be freed"),
            "{why}"
        );
    }

    fn with_uid(mut pod: Pod, uid: &str) -> Pod {
        pod.metadata.uid = Some(uid.into());
        pod
    }

    #[test]
    fn pods_holding_pages_through_dra_claims_are_drained_by_them() {
        let two_mi = PageSize::SIZE_2MI;
        // No pod requests hugepages-2Mi: their claims hold the pages.
        let pods = vec![
            with_uid(pod("small", &[("cpu", "1")]), "u-small"),
            with_uid(pod("large", &[("cpu", "1")]), "u-large"),
            with_uid(pod("classic", &[("hugepages-2Mi", "8Mi")]), "u-classic"),
            with_uid(pod("elsewhere", &[("cpu", "1")]), "u-elsewhere"),
            with_uid(pod("gpu", &[("cpu", "1")]), "u-gpu"),
        ];
        let mut gpu = claim(&["u-gpu"], "w-1", "gpu-0", "1Gi");
        gpu["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.example.com".into();
        let claims = Claims::on_node(
            &[
                claim(&["u-small"], "w-1", "hugepages-2mi-numa0", "8Mi"),
                claim(&["u-large"], "w-1", "hugepages-2mi-numa0", "40Mi"),
                claim(&["u-large"], "w-1", "hugepages-1gi-numa0", "1Gi"),
                // Another node's pool, another driver, not allocated: nothing here.
                claim(&["u-elsewhere"], "w-2", "hugepages-2mi-numa0", "8Mi"),
                gpu,
                serde_json::json!({"metadata": {"name": "pending"}, "status": {}}),
            ],
            "w-1",
        );
        assert_eq!(pages_held(&pods[0], &claims, two_mi), 4);
        assert_eq!(pages_held(&pods[1], &claims, two_mi), 20);
        assert_eq!(pages_held(&pods[1], &claims, PageSize::SIZE_1GI), 1);
        assert_eq!(
            pages_held(&pods[2], &claims, two_mi),
            4,
            "requests still count"
        );
        assert_eq!(pages_held(&pods[3], &claims, two_mi), 0);
        assert_eq!(pages_held(&pods[4], &claims, two_mi), 0);
        let holders: Vec<String> = holders(&pods, &claims, &[two_mi])
            .map(|p| p.name_any())
            .collect();
        assert_eq!(holders, ["small", "large", "classic"]);
        // The largest holder first, as for requests.
        assert_eq!(names(&choose(&pods, &claims, two_mi, 16)), ["large"]);
        // Then 4 and 4 pages: by name.
        assert_eq!(
            names(&choose(&pods, &claims, two_mi, 28)),
            ["large", "classic", "small"]
        );
        // Without the claims the same drain cannot be explained.
        let blind = choose(&pods, &NONE, two_mi, 16);
        assert!(blind.evict.is_empty() && blind.unexplained.is_some());
        // A claim shared by two pods counts for each.
        let shared = Claims::on_node(
            &[claim(
                &["u-small", "u-large"],
                "w-1",
                "hugepages-2mi-numa0",
                "8Mi",
            )],
            "w-1",
        );
        assert_eq!(pages_held(&pods[0], &shared, two_mi), 4);
        assert_eq!(pages_held(&pods[1], &shared, two_mi), 4);
    }

    #[test]
    fn claims_are_looked_for_where_the_pods_use_them() {
        use k8s_openapi::api::core::v1::PodResourceClaim;
        // A claim named in the spec, or made from a template (the pod's
        // status names it then; the spec lists it either way).
        let claiming = |name: &str, namespace: &str, template: bool| {
            let mut pod = pod(name, &[("cpu", "1")]);
            pod.metadata.namespace = Some(namespace.into());
            let claim = PodResourceClaim {
                name: "pages".into(),
                resource_claim_name: (!template).then(|| format!("{name}-pages")),
                resource_claim_template_name: template.then(|| "pages".to_string()),
            };
            pod.spec.as_mut().unwrap().resource_claims = Some(vec![claim]);
            pod
        };
        let pods = vec![
            claiming("a", "team-b", true),
            pod("plain", &[("cpu", "1")]),
            claiming("b", "team-a", false),
            claiming("c", "team-b", false),
        ];
        assert_eq!(claim_namespaces(&pods), ["team-a", "team-b"]);
    }

    #[test]
    fn a_drain_that_unevictable_pods_keep_from_finishing_evicts_nobody() {
        let two_mi = PageSize::SIZE_2MI;
        let mut daemon = pod("agent-x", &[("hugepages-2Mi", "64Mi")]); // 32 pages
        daemon.metadata.owner_references = controlled_by("DaemonSet", "agent");
        let mut mirror = pod("holder-vm", &[("hugepages-2Mi", "32Mi")]); // 16 pages
        mirror.metadata.annotations =
            Some([("kubernetes.io/config.mirror".to_string(), "abc".to_string())].into());
        let pods = vec![
            daemon,
            mirror,
            pod("dpdk-a", &[("hugepages-2Mi", "16Mi")]), // 8 pages
            pod("dpdk-b", &[("hugepages-2Mi", "8Mi")]),  // 4 pages
        ];
        // The pods explain 60 pages, but only 12 can be moved: 20 cannot be
        // freed by eviction, so nobody goes.
        let selection = choose(&pods, &NONE, two_mi, 20);
        assert!(selection.evict.is_empty(), "{:?}", names(&selection));
        let why = selection.unexplained.expect("a reason");
        assert!(
            why.contains(
                "evictable pods hold 12 pages of 2Mi and 0 are being freed, but 20 must be freed"
            ),
            "{why}"
        );
        // 12 can: both evictable pods go, the others stay.
        assert_eq!(
            names(&choose(&pods, &NONE, two_mi, 12)),
            ["dpdk-a", "dpdk-b"]
        );
        assert!(choose(&pods, &NONE, two_mi, 12).unexplained.is_none());
    }

    #[test]
    fn a_terminating_holder_counts_as_freeing_its_pages() {
        let mut going = pod("going", &[("hugepages-2Mi", "32Mi")]);
        going.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        let pods = vec![going, pod("next", &[("hugepages-2Mi", "32Mi")])];
        // 16 pages are on their way back: nobody else needs to go.
        assert!(
            choose(&pods, &NONE, PageSize::SIZE_2MI, 16)
                .evict
                .is_empty()
        );
        assert_eq!(
            names(&choose(&pods, &NONE, PageSize::SIZE_2MI, 20)),
            ["next"]
        );
    }

    /// A server that does not serve resource.k8s.io/v1 (before 1.34)
    /// answers 404 "page not found": no claims to count, not an error that
    /// would stall a drain; any other failure stays an error.
    #[tokio::test]
    async fn claims_of_an_unserved_api_are_none_and_other_failures_stay_errors() {
        use http::{Request, Response};
        use kube::client::Body;

        let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(mock, "default");
        let mut claimer = pod("claimer", &[]);
        claimer.metadata.uid = Some("uid-claimer".into());
        claimer.spec.as_mut().expect("spec").resource_claims =
            Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
                name: "pages".into(),
                resource_claim_name: Some("pages".into()),
                ..Default::default()
            }]);
        let pods = vec![claimer];
        let server = tokio::spawn(async move {
            for (code, body) in [
                (404, "404 page not found\n".to_string()),
                (
                    403,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Forbidden", "code": 403, "message": "forbidden"})
                    .to_string(),
                ),
            ] {
                let (request, send) = handle.next_request().await.expect("a list request");
                assert_eq!(
                    request.uri().path(),
                    "/apis/resource.k8s.io/v1/namespaces/apps/resourceclaims"
                );
                send.send_response(
                    Response::builder()
                        .status(code)
                        .body(Body::from(body.into_bytes()))
                        .expect("response"),
                );
            }
        });
        let unserved = Claims::read(&client, "node-a", &pods)
            .await
            .expect("an unserved API is no claims");
        assert!(unserved.is_empty());
        let refused = Claims::read(&client, "node-a", &pods)
            .await
            .expect_err("a 403 is an error");
        assert_eq!(refused.namespace, "apps");
        assert!(
            matches!(refused.source, kube::Error::Api(ref s) if s.code == 403),
            "{refused}"
        );
        server.await.expect("the mock server");
    }
}
