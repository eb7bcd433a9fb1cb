//! The controller: one worker plans the whole fleet from one snapshot and
//! carries the plan out. It decides nothing itself (see `planner`).
//!
//! Pools, Nodes and HugePageNodes are watched into caches; every event that
//! can change a plan wakes the worker (one wake-up for any number of events
//! that arrive while a pass runs), so P pools cost one plan per burst, not P.
//! A pass first waits until the caches show every write of the pass before
//! it (read your writes), then plans and writes. Nothing is locked across a
//! request: the worker owns its state. A write that fails is kept to its node
//! (or pool): the node is retried with jittered exponential backoff and its
//! pools report it, while every other node goes on.
//!
//! Every write is fenced to the end of it: it is sent only while this replica
//! leads and is abandoned (not counted as done) if it has not finished when
//! the Lease's safe window closes (`leader::Fence::remaining`).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use hugepool_crds::conditions::{bounded_message, find_condition, set_condition};
use hugepool_crds::pool::EvictedPod;
use hugepool_crds::{
    HugePageNode, HugePagePool, HugePagePoolStatus, NodeConditionType, OPERATOR_MANAGER,
    POOL_FINALIZER, PageSize,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus, ObjectReference, Pod, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::Notify;
use tracing::{debug, info, instrument, warn};

use crate::drain::{self, Eviction};
use crate::error::{Error, Result};
use crate::events;
use crate::leader::{Fence, LeaderConfig, Leadership};
use crate::metrics::{Health, Metrics};
use crate::planner::{self, DrainPlan, NodePlan, PlanInput, has_taint};

/// How the operator runs; `main` fills it from flags, tests directly.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where `/metrics`, `/healthz` and `/readyz` listen; None serves nothing.
    pub listen: Option<SocketAddr>,
    /// Lease-based leader election; None leads alone.
    pub leader: Option<LeaderConfig>,
    /// Names this replica in Events.
    pub instance: String,
    /// Re-plan at least this often even without events.
    pub resync: Duration,
    /// Re-plan this often while a drain is evicting pods.
    pub drain_poll: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: None,
            leader: None,
            instance: "hugepool-operator".into(),
            resync: Duration::from_secs(300),
            drain_poll: Duration::from_secs(5),
        }
    }
}

/// How long one write may take when no Lease bounds it sooner.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a pass waits for the caches to show the writes of the pass
/// before it; past that it plans from what they show.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// How soon a pass whose write found its object changed plans again.
const STALE_REPLAN: Duration = Duration::from_millis(100);
/// How many HugePageNode specs one pass writes at once.
const NODE_WRITES_IN_FLIGHT: usize = 32;
/// The first retry of a failed node comes after about this long, doubling.
const RETRY_BASE: Duration = Duration::from_secs(1);
/// ... up to this.
const RETRY_MAX: Duration = Duration::from_secs(300);

/// How long to wait before the `attempts`-th retry: `RETRY_BASE` doubled
/// per attempt up to `RETRY_MAX`, of which `jitter` (0..1) takes off up to
/// half, so nodes that failed together do not retry together.
pub fn retry_delay(attempts: u32, jitter: f64) -> Duration {
    let full = RETRY_BASE
        .saturating_mul(1 << attempts.saturating_sub(1).min(16))
        .min(RETRY_MAX);
    full.mul_f64(1.0 - jitter.clamp(0.0, 1.0) / 2.0)
}

/// A node or pool whose last write failed.
#[derive(Clone, Debug)]
struct Retry {
    attempts: u32,
    next_try: Instant,
    error: String,
}

/// The resourceVersions the watches delivered lately, per object, so that a
/// pass can tell that the caches show the writes of the pass before it.
/// resourceVersions are opaque: they are compared for equality only.
#[derive(Default)]
pub struct Deliveries {
    log: std::sync::Mutex<DeliveryLog>,
    delivered: Notify,
}

#[derive(Default)]
struct DeliveryLog {
    /// "Kind/name" -> the last few resourceVersions delivered.
    recent: HashMap<String, VecDeque<String>>,
    /// Per kind, how many times its watch listed everything anew (after
    /// that the cache is newer than any write made before).
    relists: HashMap<&'static str, u64>,
}

/// How many resourceVersions are kept per object: a write is looked for
/// right after it returns, so only what came since matters.
const RECENT_VERSIONS: usize = 4;

impl Deliveries {
    fn log(&self) -> std::sync::MutexGuard<'_, DeliveryLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The watch of `kind` delivered `object` (it is in the cache now).
    pub fn record<K: Resource>(&self, kind: &'static str, object: &K) {
        let (Some(name), Some(version)) = (&object.meta().name, &object.meta().resource_version)
        else {
            return;
        };
        {
            let mut log = self.log();
            let recent = log.recent.entry(format!("{kind}/{name}")).or_default();
            if recent.len() == RECENT_VERSIONS {
                recent.pop_front();
            }
            recent.push_back(version.clone());
        }
        self.delivered.notify_waiters();
    }

    /// The object is gone from the cache.
    pub fn forget<K: Resource>(&self, kind: &'static str, object: &K) {
        if let Some(name) = &object.meta().name {
            self.log().recent.remove(&format!("{kind}/{name}"));
        }
        self.delivered.notify_waiters();
    }

    /// The watch of `kind` listed everything anew.
    pub fn relisted(&self, kind: &'static str) {
        *self.log().relists.entry(kind).or_default() += 1;
        self.delivered.notify_waiters();
    }

    fn relists(&self, kind: &'static str) -> u64 {
        self.log().relists.get(kind).copied().unwrap_or(0)
    }

    fn seen(&self, write: &Written) -> bool {
        let log = self.log();
        log.relists.get(write.kind).copied().unwrap_or(0) > write.relists
            || log
                .recent
                .get(&write.key)
                .is_some_and(|versions| versions.contains(&write.version))
    }
}

/// One write of a pass, until the cache shows it.
#[derive(Clone, Debug)]
struct Written {
    kind: &'static str,
    key: String,
    version: String,
    relists: u64,
}

/// What the worker carries from one pass to the next.
#[derive(Default)]
pub struct Worker {
    /// Writes the caches have not shown yet.
    written: Vec<Written>,
    /// Nodes whose last write failed.
    node_retries: BTreeMap<String, Retry>,
    /// Pools whose last write failed.
    pool_retries: BTreeMap<String, Retry>,
    /// Pods whose eviction a PodDisruptionBudget refused.
    evictions: drain::Refusals,
    /// Pools whose metrics are published.
    pools_seen: HashSet<String>,
    /// Failed writes and unacknowledged specs, for the planner.
    observed: planner::Observed,
}

impl Worker {
    fn wrote<K: Resource>(&mut self, ctx: &Context, kind: &'static str, object: &K) {
        let (Some(name), Some(version)) = (&object.meta().name, &object.meta().resource_version)
        else {
            return;
        };
        self.written.push(Written {
            kind,
            key: format!("{kind}/{name}"),
            version: version.clone(),
            relists: ctx.deliveries.relists(kind),
        });
    }

    /// Waits until the caches show every write of the last pass (or one was
    /// listed anew since), at most `DELIVERY_TIMEOUT`.
    async fn await_deliveries(&mut self, deliveries: &Deliveries) {
        let deadline = tokio::time::Instant::now() + DELIVERY_TIMEOUT;
        loop {
            // Registered before looking, so no delivery is missed between.
            let delivered = deliveries.delivered.notified();
            self.written.retain(|write| !deliveries.seen(write));
            if self.written.is_empty() {
                return;
            }
            if tokio::time::timeout_at(deadline, delivered).await.is_err() {
                warn!(
                    writes = self.written.len(),
                    "the caches did not show the last pass's writes in time; planning from them"
                );
                self.written.clear();
                return;
            }
        }
    }

    fn fail_node(&mut self, node: &str, error: &Error) -> bool {
        fail(&mut self.node_retries, node, error)
    }

    fn fail_pool(&mut self, pool: &str, error: &Error) -> bool {
        fail(&mut self.pool_retries, pool, error)
    }

    /// When the first retry is due.
    fn next_retry(&self) -> Option<Instant> {
        self.node_retries
            .values()
            .chain(self.pool_retries.values())
            .map(|r| r.next_try)
            .min()
    }
}

/// Records a failed write of `name`; true on the first failure of a streak.
fn fail(retries: &mut BTreeMap<String, Retry>, name: &str, error: &Error) -> bool {
    let retry = retries.entry(name.to_string()).or_insert(Retry {
        attempts: 0,
        next_try: Instant::now(),
        error: String::new(),
    });
    retry.attempts += 1;
    retry.next_try = Instant::now() + retry_delay(retry.attempts, fastrand::f64());
    retry.error = bounded_message(error.to_string());
    warn!(%name, %error, attempts = retry.attempts, "write failed; retried with backoff");
    retry.attempts == 1
}

fn due(retries: &BTreeMap<String, Retry>, name: &str, now: Instant) -> bool {
    retries.get(name).is_none_or(|r| r.next_try <= now)
}

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

/// What the worker reads and writes through.
pub struct Context {
    pub client: Client,
    pub pools: Store<HugePagePool>,
    pub nodes: Store<Node>,
    pub node_states: Store<HugePageNode>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Asked before, and bounding, every write (see `leader`).
    pub leader: Fence,
    pub ready: Arc<AtomicBool>,
    pub config: Config,
    /// The clock; tests pass a fixed one.
    pub now: fn() -> Timestamp,
    /// What the watches delivered (see [`Deliveries`]).
    pub deliveries: Arc<Deliveries>,
}

impl Context {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Client,
        pools: Store<HugePagePool>,
        nodes: Store<Node>,
        node_states: Store<HugePageNode>,
        metrics: Arc<Metrics>,
        leader: Fence,
        ready: Arc<AtomicBool>,
        config: Config,
    ) -> Self {
        let reporter = Reporter {
            controller: OPERATOR_MANAGER.into(),
            instance: Some(config.instance.clone()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            pools,
            nodes,
            node_states,
            metrics,
            leader,
            ready,
            config,
            now: Timestamp::now,
            deliveries: Arc::default(),
        }
    }

    /// Publishes an Event, fenced like every write; a failure is logged.
    async fn publish(&self, event: Event, reference: &ObjectReference) {
        let reason = event.reason.clone();
        let sent = fenced(self, async {
            self.recorder
                .publish(&event, reference)
                .await
                .map_err(|source| Error::Event { source })
        })
        .await;
        if let Err(err) = sent {
            warn!(error = %err, %reason, "publishing an event");
        }
    }
}

/// Runs `write` only while this replica may write, and abandons it (as
/// `NotLeader`: not done) if it has not finished when the Lease's safe
/// window closes, or after `WRITE_TIMEOUT`.
async fn fenced<T>(ctx: &Context, write: impl Future<Output = Result<T>>) -> Result<T> {
    let Some(window) = ctx.leader.remaining() else {
        return Err(Error::NotLeader);
    };
    let limit = window.min(WRITE_TIMEOUT);
    match tokio::time::timeout(limit, write).await {
        Ok(result) => result,
        Err(_) if limit < WRITE_TIMEOUT => Err(Error::NotLeader),
        Err(_) => Err(Error::Timeout(limit)),
    }
}

fn node_reference(node: &Node) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: node.metadata.name.clone(),
        uid: node.metadata.uid.clone(),
        ..ObjectReference::default()
    }
}

pub(crate) fn has_drain_taint(node: &Node) -> bool {
    has_taint(node, hugepool_crds::DRAINING_TAINT)
}

/// The HugePageNode is owned by its Node (so it goes with it).
fn owned_by(node_state: &HugePageNode, node: &Node) -> bool {
    node_state
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "Node" && Some(&o.uid) == node.metadata.uid.as_ref())
}

/// The server-side apply body of a HugePageNode's spec. `planned_from` is
/// the resourceVersion of the HugePageNode the plan read: the write fails
/// (409) if it changed since, rather than overwrite from a stale snapshot.
pub fn node_spec_apply(
    node: &Node,
    plan: &NodePlan,
    planned_from: Option<&str>,
) -> serde_json::Value {
    let name = node.name_any();
    let mut body = json!({
        "apiVersion": HugePageNode::api_version(&()),
        "kind": HugePageNode::kind(&()),
        "metadata": {
            "name": name,
            "ownerReferences": [{
                "apiVersion": "v1",
                "kind": "Node",
                "name": name,
                "uid": node.metadata.uid.clone().unwrap_or_default(),
            }],
        },
        "spec": plan.spec,
    });
    if let Some(version) = planned_from {
        body["metadata"]["resourceVersion"] = json!(version);
    }
    body
}

/// The merge patch that empties a HugePageNode's spec, guarded like
/// [`node_spec_apply`].
pub fn node_spec_clear(
    node: &Node,
    with_owner: bool,
    planned_from: Option<&str>,
) -> serde_json::Value {
    let mut patch = json!({"spec": {"pageSizes": []}});
    if with_owner {
        patch["metadata"] = node_spec_apply(node, &NodePlan::default(), None)["metadata"].clone();
    }
    if let Some(version) = planned_from {
        patch["metadata"]["resourceVersion"] = json!(version);
    }
    patch
}

/// One eviction a drain asks for, with the pools it is for.
struct PlannedEviction<'a> {
    pod: &'a Pod,
    node: String,
    pools: Vec<String>,
    record: EvictedPod,
}

/// How a pass went: when to look again without an event.
#[derive(Debug, PartialEq, Eq)]
pub struct Pass {
    pub next: Duration,
}

/// One pass over the fleet: waits for the caches to show the last pass's
/// writes, plans from one snapshot, then writes the node specs, the drains,
/// every pool's status and the finalizers. A node or pool whose write fails
/// is retried with backoff; the others go on. `Err(NotLeader)` when this
/// replica stopped leading part way.
#[instrument(skip_all)]
pub async fn pass(ctx: &Context, worker: &mut Worker) -> Result<Pass> {
    worker.await_deliveries(&ctx.deliveries).await;
    let planning = Instant::now();
    let now = (ctx.now)();
    let started = Instant::now();
    let mut pools: Vec<HugePagePool> = ctx
        .pools
        .state()
        .iter()
        .map(|p| HugePagePool::clone(p))
        .collect();
    let pools_api: Api<HugePagePool> = Api::all(ctx.client.clone());
    // A new pool gets its finalizer before anything is written for it.
    for pool in &mut pools {
        let name = pool.name_any();
        if pool.metadata.deletion_timestamp.is_some()
            || pool.finalizers().iter().any(|f| f == POOL_FINALIZER)
            || !due(&worker.pool_retries, &name, started)
        {
            continue;
        }
        match fenced(ctx, add_finalizer(&pools_api, pool)).await {
            Ok(updated) => {
                worker.wrote(ctx, "HugePagePool", &updated);
                *pool = updated;
            }
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            Err(err) => {
                ctx.metrics.count_error(err.metric_label());
                worker.fail_pool(&name, &err);
            }
        }
    }
    let nodes = ctx.nodes.state();
    let states = ctx.node_states.state();
    worker.observed.write_errors = worker
        .node_retries
        .iter()
        .map(|(node, retry)| (node.clone(), retry.error.clone()))
        .collect();
    worker
        .observed
        .track_acknowledgements(states.iter().map(Arc::as_ref), now);
    let plan = {
        let nodes: Vec<&Node> = nodes.iter().map(Arc::as_ref).collect();
        let node_states: Vec<&HugePageNode> = states.iter().map(Arc::as_ref).collect();
        planner::plan(&PlanInput {
            pools: &pools,
            nodes: &nodes,
            node_states: &node_states,
            observed: &worker.observed,
            now,
        })
    };
    ctx.metrics
        .plan_duration
        .observe(planning.elapsed().as_secs_f64());
    let nodes_by_name: HashMap<&str, &Node> = nodes
        .iter()
        .filter_map(|n| n.metadata.name.as_deref().map(|name| (name, n.as_ref())))
        .collect();
    let states_by_name: HashMap<&str, &Arc<HugePageNode>> = states
        .iter()
        .filter_map(|s| s.metadata.name.as_deref().map(|name| (name, s)))
        .collect();

    // The specs first, `NODE_WRITES_IN_FLIGHT` at a time: a rollout's wave
    // (or a whole fleet at maxUnavailable 100%) is written in a fraction of
    // the time one write after another takes.
    let mut drain_states: HashMap<&str, Arc<HugePageNode>> = HashMap::new();
    let mut to_write = Vec::new();
    for (node_name, node_plan) in &plan.nodes {
        let Some(&node) = nodes_by_name.get(node_name.as_str()) else {
            continue;
        };
        let current = states_by_name.get(node_name.as_str()).copied();
        if reads_state(&node_plan.drain)
            && let Some(current) = current
        {
            drain_states.insert(node_name.as_str(), Arc::clone(current));
        }
        let needs_owner = current.is_none_or(|c| !owned_by(c, node));
        if (node_plan.spec_changed || needs_owner) && due(&worker.node_retries, node_name, started)
        {
            to_write.push((node, current.map(Arc::as_ref), node_plan, needs_owner));
        }
    }
    let mut stale = false;
    let mut waiting = to_write.into_iter();
    let mut in_flight = FuturesUnordered::new();
    loop {
        while in_flight.len() < NODE_WRITES_IN_FLIGHT {
            let Some((node, current, node_plan, needs_owner)) = waiting.next() else {
                break;
            };
            in_flight.push(write_node_spec(ctx, node, current, node_plan, needs_owner));
        }
        let Some((node_name, result)) = in_flight.next().await else {
            break;
        };
        match result {
            Ok(updated) => {
                worker.node_retries.remove(&node_name);
                worker.wrote(ctx, "HugePageNode", &updated);
                if let Some(state) = drain_states.get_mut(node_name.as_str()) {
                    *state = Arc::new(updated);
                }
            }
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            // Planned from a HugePageNode that has changed since (its agent
            // wrote its status): plan again from the newer one.
            Err(err) if err.is_conflict() => {
                debug!(node = %node_name, "HugePageNode changed since the plan read it");
                stale = true;
            }
            Err(err) => {
                ctx.metrics.count_error(err.metric_label());
                if worker.fail_node(&node_name, &err)
                    && let Some(&node) = nodes_by_name.get(node_name.as_str())
                {
                    ctx.publish(events::write_failed(&err), &node_reference(node))
                        .await;
                }
            }
        }
    }

    // Then the drains, in node order (they are few, and evictions must be
    // paced): conditions and taints, then the pods to evict.
    let mut evicting = false;
    let mut to_evict: Vec<PlannedEviction<'_>> = Vec::new();
    let mut pods_by_node: Vec<(String, Vec<Pod>)> = Vec::new();
    for (node_name, node_plan) in &plan.nodes {
        let Some(&node) = nodes_by_name.get(node_name.as_str()) else {
            continue;
        };
        if !due(&worker.node_retries, node_name, started) {
            continue;
        }
        let node_state = drain_states.get(node_name.as_str()).map(Arc::as_ref);
        match carry_out_drain(ctx, worker, node, node_state, node_plan, now).await {
            Ok(Some(pods)) => {
                evicting = true;
                pods_by_node.push((node_name.clone(), pods));
            }
            Ok(None) => {}
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            Err(err) => {
                ctx.metrics.count_error(err.metric_label());
                if worker.fail_node(node_name, &err) {
                    ctx.publish(events::write_failed(&err), &node_reference(node))
                        .await;
                }
            }
        }
    }
    for (node_name, pods) in &pods_by_node {
        let (Some(node_plan), Some(&node)) = (
            plan.nodes.get(node_name),
            nodes_by_name.get(node_name.as_str()),
        ) else {
            continue;
        };
        let node_state = drain_states.get(node_name.as_str()).map(Arc::as_ref);
        to_evict.extend(choose_evictions(
            worker, node, node_state, node_plan, pods, now,
        ));
    }

    // Every pool's status: evictions are recorded in it before they are
    // made, so a crash right after one still leaves the record.
    let mut records: BTreeMap<String, Vec<EvictedPod>> = BTreeMap::new();
    // Each pool's status as the pass read it, and as this pass wrote it.
    let old_statuses: BTreeMap<String, HugePagePoolStatus> = pools
        .iter()
        .map(|p| (p.name_any(), p.status.clone().unwrap_or_default()))
        .collect();
    let mut statuses = old_statuses.clone();
    let mut pools_by_name: BTreeMap<String, HugePagePool> =
        pools.into_iter().map(|p| (p.name_any(), p)).collect();
    for eviction in to_evict {
        let key = eviction.record.pod.clone();
        let uid = eviction.pod.metadata.uid.clone().unwrap_or_default();
        // Asked first without effect: only an eviction the API would make
        // now is recorded (a PodDisruptionBudget refuses most of them).
        let dry_run = fenced(ctx, async {
            Ok(drain::evict(&ctx.client, eviction.pod, true).await)
        })
        .await?;
        if let Eviction::Evicted = dry_run {
            for pool in &eviction.pools {
                records
                    .entry(pool.clone())
                    .or_default()
                    .push(eviction.record.clone());
            }
            let mut recorded = true;
            for pool in &eviction.pools {
                let (Some(pool_plan), Some(current)) =
                    (plan.pools.get(pool), pools_by_name.get_mut(pool))
                else {
                    continue;
                };
                let status = planned_status(pool_plan, records.get(pool));
                match write_pool_status(ctx, worker, current, &status, statuses.get(pool)).await {
                    Ok(()) => {
                        statuses.insert(pool.clone(), status);
                    }
                    Err(Error::NotLeader) => return Err(Error::NotLeader),
                    Err(err) => {
                        ctx.metrics.count_error(err.metric_label());
                        worker.fail_pool(pool, &err);
                        recorded = false;
                    }
                }
            }
            if !recorded {
                // Not evicted unless recorded; the next pass tries again.
                for pool in &eviction.pools {
                    if let Some(list) = records.get_mut(pool) {
                        list.retain(|r| r.pod != key);
                    }
                }
                continue;
            }
        }
        let outcome = match dry_run {
            Eviction::Evicted => {
                fenced(ctx, async {
                    Ok(drain::evict(&ctx.client, eviction.pod, false).await)
                })
                .await?
            }
            refused => refused,
        };
        let first_refusal = worker.evictions.get(&uid).is_none();
        for pool in &eviction.pools {
            ctx.metrics.count_eviction(pool, outcome.metric_label());
        }
        match &outcome {
            Eviction::Evicted => {
                worker.evictions.forget(&uid);
                info!(node = %eviction.node, pod = %key, pools = ?eviction.pools, "evicted");
            }
            Eviction::Gone => {
                worker.evictions.forget(&uid);
                debug!(node = %eviction.node, pod = %key, "already gone; not an eviction");
            }
            Eviction::Blocked(message) | Eviction::Failed(message) => {
                // Recorded but refused after all: the record goes again.
                for pool in &eviction.pools {
                    if let Some(list) = records.get_mut(pool) {
                        list.retain(|r| r.pod != key);
                    }
                }
                let backoff = worker.evictions.refused(&uid, &eviction.node, now);
                debug!(node = %eviction.node, pod = %key, %message, attempts = backoff.attempts, "eviction refused");
            }
        }
        // A refusal is told once per streak; it retries with backoff.
        let tell = matches!(outcome, Eviction::Evicted) || first_refusal;
        if tell
            && let Some(event) = events::eviction_event(&key, &outcome)
            && let Some(&node) = nodes_by_name.get(eviction.node.as_str())
        {
            ctx.publish(event, &node_reference(node)).await;
        }
    }

    for (name, pool_plan) in &plan.pools {
        let Some(pool) = pools_by_name.get_mut(name) else {
            continue;
        };
        ctx.metrics.observe_pool(name, pool_plan);
        worker.pools_seen.insert(name.clone());
        let status = planned_status(pool_plan, records.get(name));
        let old_status = old_statuses.get(name).cloned().unwrap_or_default();
        if status != old_status {
            if !due(&worker.pool_retries, name, started) {
                continue;
            }
            match write_pool_status(ctx, worker, pool, &status, statuses.get(name)).await {
                Ok(()) => {}
                Err(Error::NotLeader) => return Err(Error::NotLeader),
                Err(err) => {
                    ctx.metrics.count_error(err.metric_label());
                    worker.fail_pool(name, &err);
                    continue;
                }
            }
            if !pool_plan.admitted.is_empty() {
                info!(pool = %name, admitted = ?pool_plan.admitted, "nodes admitted to the rollout");
            }
            for event in events::pool_events(&old_status, &status) {
                ctx.publish(event, &pool.object_ref(&())).await;
            }
        }
        if pool_plan.remove_finalizer && pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
            match fenced(ctx, remove_finalizer(&pools_api, pool)).await {
                Ok(()) => {
                    worker.pool_retries.remove(name);
                    worker.pools_seen.remove(name);
                    ctx.metrics.forget_pool(name);
                    info!(pool = %name, "pool released every node; finalizer removed");
                }
                Err(Error::NotLeader) => return Err(Error::NotLeader),
                Err(err) => {
                    ctx.metrics.count_error(err.metric_label());
                    worker.fail_pool(name, &err);
                }
            }
        }
    }
    // Pools that are gone.
    worker.pools_seen.retain(|name| {
        let kept = plan.pools.contains_key(name);
        if !kept {
            ctx.metrics.forget_pool(name);
        }
        kept
    });
    worker
        .pool_retries
        .retain(|name, _| plan.pools.contains_key(name));
    worker
        .node_retries
        .retain(|name, _| nodes_by_name.contains_key(name.as_str()));

    // When to look again without an event.
    let mut next = ctx.config.resync;
    if let Some(deadline) = plan.next_deadline {
        let until = Duration::try_from(deadline.duration_since(now)).unwrap_or(Duration::ZERO);
        next = next.min(until + Duration::from_millis(100));
    }
    if evicting {
        next = next.min(ctx.config.drain_poll);
    }
    if let Some(retry) = worker.next_retry() {
        next = next.min(retry.saturating_duration_since(Instant::now()));
    }
    if stale {
        // Soon, not at once: the watch may not have delivered the version
        // that refused the write yet.
        next = next.min(STALE_REPLAN);
    }
    ctx.metrics.observe_reconcile(started.elapsed());
    Ok(Pass { next })
}

/// A pool's planned status with this pass's evictions recorded.
fn planned_status(
    pool_plan: &planner::PoolPlan,
    records: Option<&Vec<EvictedPod>>,
) -> HugePagePoolStatus {
    let mut status = pool_plan.status.clone();
    status.record_evictions(records.into_iter().flatten().cloned());
    status
}

/// Writes `status` as the pool's (server-side apply) unless it is `old`.
async fn write_pool_status(
    ctx: &Context,
    worker: &mut Worker,
    pool: &mut HugePagePool,
    status: &HugePagePoolStatus,
    old: Option<&HugePagePoolStatus>,
) -> Result<()> {
    if old == Some(status) {
        return Ok(());
    }
    let name = pool.name_any();
    let api: Api<HugePagePool> = Api::all(ctx.client.clone());
    let updated = fenced(ctx, async {
        api.patch_status(
            &name,
            &PatchParams::apply(OPERATOR_MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": HugePagePool::api_version(&()),
                "kind": HugePagePool::kind(&()),
                "status": status,
            })),
        )
        .await
        .map_err(|source| Error::PoolStatus {
            pool: name.clone(),
            source,
        })
    })
    .await?;
    worker.pool_retries.remove(&name);
    worker.wrote(ctx, "HugePagePool", &updated);
    // The finalizer patch must carry the newest resourceVersion.
    *pool = updated;
    Ok(())
}

async fn add_finalizer(api: &Api<HugePagePool>, pool: &HugePagePool) -> Result<HugePagePool> {
    let mut finalizers = pool.finalizers().to_vec();
    finalizers.push(POOL_FINALIZER.into());
    let patch = json!({
        "metadata": {
            "resourceVersion": pool.resource_version(),
            "finalizers": finalizers,
        }
    });
    api.patch(
        &pool.name_any(),
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await
    .map_err(|source| Error::Finalizer {
        pool: pool.name_any(),
        source,
    })
}

/// The merge patch that removes `hugepool.dev/release` from the pool's
/// finalizers (an atomic list: guarded by the resourceVersion it was read
/// at), or `None` when the pool does not carry it.
pub fn release_patch(pool: &HugePagePool) -> Option<serde_json::Value> {
    let kept: Vec<&String> = pool
        .finalizers()
        .iter()
        .filter(|f| *f != POOL_FINALIZER)
        .collect();
    (kept.len() != pool.finalizers().len()).then(|| {
        json!({
            "metadata": {
                "resourceVersion": pool.resource_version(),
                "finalizers": kept,
            }
        })
    })
}

async fn remove_finalizer(api: &Api<HugePagePool>, pool: &HugePagePool) -> Result<()> {
    let Some(patch) = release_patch(pool) else {
        return Ok(());
    };
    match api
        .patch(
            &pool.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Already gone: nothing left to release.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(source) => Err(Error::Finalizer {
            pool: pool.name_any(),
            source,
        }),
    }
}

/// Creates or updates the node's HugePageNode (its spec, or its owner when
/// `needs_owner`, is not what the plan says), on the condition that it is
/// still `current` (the version the plan read); returns it as it now is.
async fn write_node_spec(
    ctx: &Context,
    node: &Node,
    current: Option<&HugePageNode>,
    plan: &NodePlan,
    needs_owner: bool,
) -> (String, Result<HugePageNode>) {
    let name = node.name_any();
    let api: Api<HugePageNode> = Api::all(ctx.client.clone());
    let planned_from = current.and_then(|c| c.metadata.resource_version.as_deref());
    // Applying an empty list drops `spec` altogether (nothing in it is owned
    // any more), which the schema refuses; clear it explicitly.
    let (params, patch) = if current.is_some() && plan.spec.page_sizes.is_empty() {
        let params = PatchParams {
            field_manager: Some(OPERATOR_MANAGER.into()),
            ..PatchParams::default()
        };
        (
            params,
            Patch::Merge(node_spec_clear(node, needs_owner, planned_from)),
        )
    } else {
        (
            PatchParams::apply(OPERATOR_MANAGER).force(),
            Patch::Apply(node_spec_apply(node, plan, planned_from)),
        )
    };
    let result = fenced(ctx, async {
        api.patch(&name, &params, &patch)
            .await
            .map(|mut updated| {
                // Only its name, version, generation and spec are read.
                updated.metadata.managed_fields = None;
                updated
            })
            .map_err(|source| Error::NodeSpec {
                node: name.clone(),
                source,
            })
    })
    .await;
    if let Ok(updated) = &result {
        debug!(node = %name, generation = ?updated.metadata.generation, "wrote HugePageNode spec");
    }
    (name, result)
}

/// Whether carrying out `drain` reads the node's HugePageNode (its status:
/// the pages held, the Draining condition).
fn reads_state(drain: &DrainPlan) -> bool {
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
    on_node: &'a [Pod],
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
) -> DrainSelection<'a> {
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
        let selection = drain::choose(on_node, size, must_free(node_state, plan, size));
        notes.extend(selection.unexplained);
        let pool = drain.shrink_pools.get(&size).cloned().unwrap_or_default();
        for pod in selection.evict {
            credit(&mut chosen, pod, &pool);
        }
    }
    let (held, held_kept) = drain::memory_manager_holders(on_node, &drain.evict_pods);
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
                let pages: u64 = drain.evict.iter().map(|&s| drain::pages_held(p, s)).sum();
                format!(
                    "{}/{} ({pages} pages)",
                    p.namespace().unwrap_or_default(),
                    p.name_any()
                )
            })
            .collect();
        notes.push(format!("evicting {}", named.join(", ")));
    }
    let mut kept = drain::unevictable_consumers(on_node, &drain.evict);
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

/// Sets the Draining condition and the taints as the plan says; returns the
/// node's pods when it is evicting.
async fn carry_out_drain(
    ctx: &Context,
    worker: &mut Worker,
    node: &Node,
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
    now: Timestamp,
) -> Result<Option<Vec<Pod>>> {
    let drain = &plan.drain;
    let name = node.name_any();
    let evicts = !drain.evict.is_empty() || !drain.evict_pods.is_empty();
    let on_node = if evicts {
        let pods: Api<Pod> = Api::all(ctx.client.clone());
        let listed = tokio::time::timeout(
            WRITE_TIMEOUT,
            pods.list(&ListParams::default().fields(&format!("spec.nodeName={name}"))),
        )
        .await
        .map_err(|_| Error::Timeout(WRITE_TIMEOUT))?;
        listed
            .map_err(|source| Error::ListPods {
                node: name.clone(),
                source,
            })?
            .items
    } else {
        Vec::new()
    };
    worker.evictions.prune(&name, &on_node);
    let selection = select_pods(&on_node, node_state, plan);
    let condition_update = drain.condition.clone().map(|mut update| {
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
    });
    if let (Some(update), Some(state)) = (&condition_update, node_state) {
        let mut conditions = state
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        let before = find_condition(&conditions, NodeConditionType::Draining).cloned();
        if set_condition(&mut conditions, update.clone(), &Time(now))
            && let Some(condition) = find_condition(&conditions, NodeConditionType::Draining)
        {
            let api: Api<HugePageNode> = Api::all(ctx.client.clone());
            let updated = fenced(ctx, async {
                api.patch_status(
                    &name,
                    &PatchParams::apply(OPERATOR_MANAGER).force(),
                    &Patch::Apply(json!({
                        "apiVersion": HugePageNode::api_version(&()),
                        "kind": HugePageNode::kind(&()),
                        "status": {"conditions": [condition]},
                    })),
                )
                .await
                .map_err(|source| Error::DrainCondition {
                    node: name.clone(),
                    source,
                })
            })
            .await?;
            worker.wrote(ctx, "HugePageNode", &updated);
            if let Some(event) = events::drain_event(before.as_ref(), update) {
                ctx.publish(event, &node_reference(node)).await;
            }
        }
    }
    let taints = [
        (hugepool_crds::DRAINING_TAINT, drain.taint),
        (hugepool_crds::NOT_READY_TAINT, plan.not_ready_taint),
    ];
    if taints
        .iter()
        .any(|&(key, want)| has_taint(node, key) != want)
    {
        let updated = set_taints(ctx, node, &taints).await?;
        worker.wrote(ctx, "Node", &updated);
    }
    Ok(evicts.then_some(on_node))
}

/// The evictions a draining node's plan asks for now: the selected pods
/// not waiting out a refusal, each with its record for the pools it is for.
fn choose_evictions<'a>(
    worker: &Worker,
    node: &Node,
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
    on_node: &'a [Pod],
    now: Timestamp,
) -> Vec<PlannedEviction<'a>> {
    let drain = &plan.drain;
    let name = node.name_any();
    let selection = select_pods(on_node, node_state, plan);
    let needed: Vec<String> = drain
        .evict
        .iter()
        .map(|&size| format!("{} of {size}", must_free(node_state, plan, size)))
        .collect();
    selection
        .chosen
        .into_iter()
        .filter(|(pod, _)| {
            let uid = pod.metadata.uid.as_deref().unwrap_or_default();
            worker.evictions.get(uid).is_none_or(|b| b.next_try <= now)
        })
        .map(|(pod, pools)| {
            let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
            let pages: u64 = drain.evict.iter().map(|&s| drain::pages_held(pod, s)).sum();
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
                pod,
                node: name.clone(),
                pools,
                record: EvictedPod {
                    pod: key,
                    node: name.clone(),
                    pages: pages as i64,
                    reason: bounded_message(reason),
                    evicted_at: Some(Time(now)),
                },
            }
        })
        .collect()
}

/// Adds or removes our taints (`NoSchedule`), leaving other taints alone;
/// the resourceVersion makes a concurrent change fail and retry once.
async fn set_taints(ctx: &Context, node: &Node, taints: &[(&str, bool)]) -> Result<Node> {
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

/// Aborts its tasks when dropped.
struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Drives one watch into its cache: records what it delivers and wakes the
/// worker for the events `wakes` lets through.
fn follow<K>(
    kind: &'static str,
    events: impl futures::Stream<Item = std::result::Result<watcher::Event<K>, watcher::Error>>
    + Send
    + 'static,
    deliveries: Arc<Deliveries>,
    wake: Arc<Notify>,
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
                // The watcher backs off and lists anew by itself.
                Err(err) => {
                    debug!(%kind, error = %err, "watch");
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
                wake.notify_one();
            }
        }
    })
}

/// Runs the operator until `shutdown` completes: the HTTP endpoints, leader
/// election, the watches and the fleet worker.
///
/// `client` must not retry 429 answers itself (build it with
/// `kube::Config::default_retry = false`, as `main` does): a refused
/// eviction would otherwise block the pass for minutes.
pub async fn run(
    client: Client,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let shutdown = shutdown.shared();
    // Helper tasks end with `run`, also when a test drops its future.
    let mut tasks = AbortOnDrop(Vec::new());
    let metrics = Arc::new(Metrics::default());
    let ready = Arc::new(AtomicBool::new(false));
    if let Some(addr) = config.listen {
        let probes = Arc::new(Health {
            metrics: metrics.clone(),
            ready: ready.clone(),
        });
        let (bound, task) = hugepool_runtime::serve(addr, probes, shutdown.clone())
            .await
            .map_err(|source| Error::Serve { addr, source })?;
        tasks.0.push(task);
        info!(addr = %bound, "serving /metrics, /healthz and /readyz");
    }
    let leadership = match &config.leader {
        Some(leader) => Leadership::elect(client.clone(), leader).await?,
        None => Leadership::always(),
    };
    let mut is_leader = leadership.is_leader.clone();
    metrics.set_leading(*is_leader.borrow());

    // The caches hold what the planner reads and no more (a real Node is
    // 10-20 KB, mostly status and managedFields).
    let (pools, pool_writer) = reflector::store();
    let (nodes, node_writer) = reflector::store();
    let (node_states, state_writer) = reflector::store();
    let ctx = Context::new(
        client.clone(),
        pools.clone(),
        nodes.clone(),
        node_states.clone(),
        metrics.clone(),
        leadership.fence(),
        ready.clone(),
        config,
    );
    let wake = Arc::new(Notify::new());
    let deliveries = Arc::clone(&ctx.deliveries);
    tasks.0.push(follow(
        "HugePagePool",
        reflector::reflector(
            pool_writer,
            watcher(
                Api::<HugePagePool>::all(client.clone()),
                watcher::Config::default(),
            )
            .modify(|pool: &mut HugePagePool| pool.metadata.managed_fields = None),
        )
        .default_backoff(),
        Arc::clone(&deliveries),
        Arc::clone(&wake),
        |event| !matches!(event, watcher::Event::Init),
    ));
    let mut node_trigger = NodeTrigger::default();
    tasks.0.push(follow(
        "Node",
        reflector::reflector(
            node_writer,
            watcher(Api::<Node>::all(client.clone()), watcher::Config::default()).modify(slim_node),
        )
        .default_backoff(),
        Arc::clone(&deliveries),
        Arc::clone(&wake),
        move |event| node_trigger.wakes(event),
    ));
    tasks.0.push(follow(
        "HugePageNode",
        reflector::reflector(
            state_writer,
            watcher(
                Api::<HugePageNode>::all(client.clone()),
                watcher::Config::default(),
            )
            .modify(|state: &mut HugePageNode| state.metadata.managed_fields = None),
        )
        .default_backoff(),
        Arc::clone(&deliveries),
        Arc::clone(&wake),
        |event| !matches!(event, watcher::Event::Init),
    ));

    let work = async {
        // Never plan from a partial view: a missing HugePageNode would be
        // planned as new and its node admitted again.
        let synced = futures::future::try_join3(
            pools.wait_until_ready(),
            nodes.wait_until_ready(),
            node_states.wait_until_ready(),
        )
        .await;
        if synced.is_err() {
            return;
        }
        ready.store(true, Ordering::Relaxed);
        info!("watches synced");
        let mut worker = Worker::default();
        let mut next = Duration::ZERO;
        loop {
            tokio::select! {
                () = wake.notified() => {}
                () = tokio::time::sleep(next) => {}
                changed = is_leader.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let leading = *is_leader.borrow_and_update();
                    metrics.set_leading(leading);
                    info!(leading, "leadership changed");
                }
            }
            if !ctx.leader.open() {
                // Waits for leadership (or an event) without a timer.
                next = Duration::from_secs(3600);
                continue;
            }
            next = match pass(&ctx, &mut worker).await {
                Ok(pass) => pass.next,
                Err(Error::NotLeader) => {
                    info!("stopped writing: this replica does not lead");
                    Duration::from_secs(3600)
                }
                Err(err) => {
                    warn!(error = %err, "pass failed");
                    ctx.metrics.count_error(err.metric_label());
                    retry_delay(1, fastrand::f64())
                }
            };
        }
    };
    tokio::select! {
        () = work => {}
        () = shutdown.clone() => {}
    }
    // The lease task gives the Lease up only once every receiver is gone.
    drop(is_leader);
    drop(ctx);
    leadership.release().await;
    Ok(())
}

#[cfg(test)]
mod tests;
