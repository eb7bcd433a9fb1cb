//! The watches behind the caches: what of a Node is kept, which events
//! wake the worker, and the task that drives each watch.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crate::metrics::WatchCounters;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::Notify;
use tracing::warn;

use hugepool_crds::{HugePageNode, OPERATOR_MANAGER};

use super::writes::Deliveries;

/// Keeps of a Node what the operator reads: name, uid, labels, taints, the
/// kubelet's `hugepages-*` capacity and the Ready condition (without its
/// heartbeat).
pub fn slim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    if let Some(status) = node.status.take() {
        let hugepages = |resources: Option<BTreeMap<String, Quantity>>| {
            resources.map(|r| {
                r.into_iter()
                    .filter(|(name, _)| name.starts_with("hugepages-"))
                    .collect()
            })
        };
        let ready = status.conditions.map(|conditions| {
            conditions
                .into_iter()
                .filter(|c| c.type_ == "Ready")
                .map(|c| NodeCondition {
                    last_heartbeat_time: None,
                    message: None,
                    ..c
                })
                .collect()
        });
        node.status = Some(NodeStatus {
            capacity: hugepages(status.capacity),
            allocatable: hugepages(status.allocatable),
            conditions: ready,
            ..NodeStatus::default()
        });
    }
}

/// Keeps of a HugePageNode's managedFields only when the operator last
/// wrote its spec (the entry's time, without its field set): the
/// acknowledgement clock reads it (`planner::spec_written_at`).
pub fn slim_node_state(state: &mut HugePageNode) {
    if let Some(fields) = &mut state.metadata.managed_fields {
        fields.retain(|m| {
            m.manager.as_deref() == Some(OPERATOR_MANAGER)
                && m.subresource.as_deref().unwrap_or_default().is_empty()
        });
        for entry in fields.iter_mut() {
            entry.fields_v1 = None;
        }
    }
}

/// Whether ResourceClaim events can change what an agent is told: a claim
/// allocated from hugepool's driver, or one that was and is no longer
/// (deallocated or deleted). Claims of other drivers wake nothing.
#[derive(Default)]
pub struct ClaimTrigger {
    ours: HashSet<String>,
}

impl ClaimTrigger {
    pub fn wakes(&mut self, event: &watcher::Event<kube::api::DynamicObject>) -> bool {
        let key = |claim: &kube::api::DynamicObject| {
            format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            )
        };
        let allocated_here = |claim: &kube::api::DynamicObject| {
            claim.data["status"]["allocation"]["devices"]["results"]
                .as_array()
                .is_some_and(|results| {
                    results
                        .iter()
                        .any(|r| r["driver"] == hugepool_crds::dra::DRIVER)
                })
        };
        match event {
            watcher::Event::Apply(claim) | watcher::Event::InitApply(claim) => {
                let key = key(claim);
                if allocated_here(claim) {
                    self.ours.insert(key);
                    true
                } else {
                    self.ours.remove(&key)
                }
            }
            watcher::Event::Delete(claim) => self.ours.remove(&key(claim)),
            watcher::Event::Init => false,
            watcher::Event::InitDone => true,
        }
    }
}

/// Whether Node events can change a plan: a Node is new or deleted, or its
/// labels, taints or hugepage capacity changed (a hash of each Node's is
/// kept). Heartbeats, images and conditions plan nothing.
#[derive(Default)]
pub struct NodeTrigger {
    seen: HashMap<String, u64>,
    /// Names listed so far while the watch lists everything anew.
    relisting: Option<HashSet<String>>,
}

impl NodeTrigger {
    /// Whether `event` can change a plan. A re-list forgets the Nodes it did
    /// not list (deleted while the watch was down).
    pub fn wakes(&mut self, event: &watcher::Event<Node>) -> bool {
        use std::hash::{Hash, Hasher};
        match event {
            watcher::Event::Apply(node) | watcher::Event::InitApply(node) => {
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                node.metadata.uid.hash(&mut hasher);
                node.metadata.labels.hash(&mut hasher);
                for taint in node.spec.iter().flat_map(|s| s.taints.iter().flatten()) {
                    (&taint.key, &taint.value, &taint.effect).hash(&mut hasher);
                }
                let capacity = node.status.as_ref().and_then(|s| s.capacity.as_ref());
                for (name, quantity) in capacity.into_iter().flatten() {
                    (name, &quantity.0).hash(&mut hasher);
                }
                let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
                for ready in conditions.into_iter().flatten() {
                    (&ready.type_, &ready.status).hash(&mut hasher);
                }
                let hash = hasher.finish();
                let name = node.name_any();
                if let Some(listed) = &mut self.relisting {
                    listed.insert(name.clone());
                }
                self.seen.insert(name, hash) != Some(hash)
            }
            watcher::Event::Delete(node) => {
                self.seen.remove(&node.name_any());
                true
            }
            watcher::Event::Init => {
                self.relisting = Some(HashSet::new());
                false
            }
            watcher::Event::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                let before = self.seen.len();
                self.seen.retain(|name, _| listed.contains(name));
                // A Node that went while the watch was down changes plans.
                self.seen.len() != before
            }
        }
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// Aborts its tasks when dropped.
pub(super) struct AbortOnDrop(pub Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Drives one watch into its cache: records what it delivers and wakes the
/// worker for the events `wakes` lets through.
pub(super) fn follow<K>(
    kind: &'static str,
    events: impl futures::Stream<Item = std::result::Result<watcher::Event<K>, watcher::Error>>
    + Send
    + 'static,
    deliveries: Arc<Deliveries>,
    wake: Arc<Notify>,
    counters: WatchCounters,
    mut wakes: impl FnMut(&watcher::Event<K>) -> bool + Send + 'static,
) -> tokio::task::JoinHandle<()>
where
    K: Resource + Send + 'static,
{
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                // The watcher backs off and lists anew by itself; an
                // error that repeats (an RBAC refusal) leaves the cache
                // stale, so it is said and counted.
                Err(err) => {
                    warn!(%kind, error = %err, "watch failed; retrying with backoff");
                    counters.errors.inc();
                    continue;
                }
            };
            match &event {
                watcher::Event::Apply(object) | watcher::Event::InitApply(object) => {
                    deliveries.record(kind, object);
                }
                watcher::Event::Delete(object) => deliveries.forget(kind, object),
                watcher::Event::InitDone => deliveries.relisted(kind),
                watcher::Event::Init => {}
            }
            if wakes(&event) {
                counters.wakeups.inc();
                wake.notify_one();
            }
        }
    })
}

/// Watches of the pods on the nodes being drained, one per node (a field
/// selector on `spec.nodeName`): a drain hears within a second of a pod
/// that went or changed, without watching every pod of the cluster.
#[derive(Default)]
pub(super) struct PodWatches(BTreeMap<String, PodWatch>);

/// One draining node's pods, watched: the task and the cache it fills.
struct PodWatch {
    task: tokio::task::JoinHandle<()>,
    pods: reflector::Store<Pod>,
}

impl PodWatches {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Watches exactly `nodes`' pods from now on.
    pub fn keep(
        &mut self,
        client: &Client,
        wake: &Arc<Notify>,
        counters: &WatchCounters,
        nodes: BTreeSet<String>,
    ) {
        self.0.retain(|node, watch| {
            let keep = nodes.contains(node);
            if !keep {
                watch.task.abort();
            }
            keep
        });
        for node in nodes {
            self.0.entry(node.clone()).or_insert_with(|| {
                let (pods, writer) = reflector::store();
                let task = tokio::spawn(wake_on_pods(
                    Api::all(client.clone()),
                    node,
                    writer,
                    Arc::clone(wake),
                    counters.clone(),
                ));
                PodWatch { task, pods }
            });
        }
    }

    /// `node`'s pods as its watch holds them, once it has listed them; None
    /// before (or for a node not watched): the drain lists them then.
    pub fn pods(&self, node: &str) -> Option<Vec<Pod>> {
        let watch = self.0.get(node)?;
        watch.pods.wait_until_ready().now_or_never()?.ok()?;
        Some(watch.pods.state().iter().map(|p| (**p).clone()).collect())
    }
}

impl Drop for PodWatches {
    fn drop(&mut self) {
        for watch in self.0.values() {
            watch.task.abort();
        }
    }
}

/// Keeps `node`'s pods in `cache` and wakes the worker on every change of
/// one after the first listing (the pass that started the watch has just
/// listed them).
async fn wake_on_pods(
    api: Api<Pod>,
    node: String,
    cache: reflector::store::Writer<Pod>,
    wake: Arc<Notify>,
    counters: WatchCounters,
) {
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events =
        std::pin::pin!(reflector::reflector(cache, watcher(api, config)).default_backoff());
    let mut listed = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::InitDone) => listed = true,
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) if listed => {
                counters.wakeups.inc();
                wake.notify_one();
            }
            Ok(_) => {}
            Err(err) => {
                warn!(%node, error = %err, "watching the pods of a draining node failed; retrying with backoff");
                counters.errors.inc();
            }
        }
    }
}
