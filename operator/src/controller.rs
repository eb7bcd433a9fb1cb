//! The controller: a kube-runtime Controller on HugePagePools that watches
//! Nodes and HugePageNodes, runs the planner over everything it sees and
//! carries the plan out. It decides nothing itself (see `planner`).
//!
//! Every pass plans the whole cluster under one lock, so two pools' passes
//! never admit nodes from different snapshots, and it plans from what this
//! process last wrote when the watch has not caught up with it yet.

use std::collections::{BTreeMap, HashMap};
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
    HugePageNode, HugePagePool, NodeConditionType, OPERATOR_MANAGER, POOL_FINALIZER, PageSize,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, NodeStatus, ObjectReference, Pod, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::{Selector, SelectorExt};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::Mutex;
use tracing::{debug, info, instrument, warn};

use crate::drain::{self, Eviction};
use crate::error::{Error, Result};
use crate::events;
use crate::leader::{Fence, LeaderConfig, Leadership};
use crate::metrics::{Health, Metrics};
use crate::planner::{self, DrainPlan, NodePlan, Plan, PlanInput};

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

/// What this process wrote last, by name, until the watches show it.
#[derive(Default)]
struct Written {
    pools: BTreeMap<String, (Arc<HugePagePool>, Instant)>,
    nodes: BTreeMap<String, (Arc<Node>, Instant)>,
    node_states: BTreeMap<String, (Arc<HugePageNode>, Instant)>,
    /// Pods whose eviction a PodDisruptionBudget refused.
    evictions: drain::Refusals,
    /// Pods evicted for each pool, not yet in its status.
    evicted: BTreeMap<String, Vec<EvictedPod>>,
}

/// How long a write the watch never shows (the object was deleted) is kept.
const WRITTEN_TTL: Duration = Duration::from_secs(30);

fn resource_version<K: Resource>(object: &K) -> Option<u64> {
    object.meta().resource_version.as_deref()?.parse().ok()
}

/// The store's objects, each replaced by what this process wrote when that
/// is newer (resourceVersions of one resource come from one etcd revision
/// counter, so they order writes).
fn fresher<K: Resource>(
    stored: Vec<Arc<K>>,
    written: &mut BTreeMap<String, (Arc<K>, Instant)>,
    keep_unseen: bool,
) -> Vec<Arc<K>> {
    let mut objects = Vec::with_capacity(stored.len());
    let mut seen = std::collections::HashSet::with_capacity(stored.len());
    for object in stored {
        let name = object.meta().name.clone().unwrap_or_default();
        match written.get(&name) {
            Some((ours, _))
                if resource_version(ours.as_ref()) > resource_version(object.as_ref()) =>
            {
                objects.push(Arc::clone(ours));
            }
            Some(_) => {
                written.remove(&name);
                objects.push(object);
            }
            None => objects.push(object),
        }
        seen.insert(name);
    }
    written.retain(|name, (_, at)| {
        seen.contains(name.as_str()) || (keep_unseen && at.elapsed() < WRITTEN_TTL)
    });
    if keep_unseen {
        objects.extend(
            written
                .iter()
                .filter(|(name, _)| !seen.contains(name.as_str()))
                .map(|(_, (object, _))| Arc::clone(object)),
        );
    }
    objects
}

/// Keeps of a Node what the operator reads: name, uid, labels, taints and
/// the kubelet's `hugepages-*` capacity.
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
        node.status = Some(NodeStatus {
            capacity: hugepages(status.capacity),
            allocatable: hugepages(status.allocatable),
            ..NodeStatus::default()
        });
    }
}

/// Whether a Node event can change a plan: it is new or deleted, or its
/// labels, taints or hugepage capacity changed (`seen` keeps a hash of each
/// Node's). Deletions always pass, which kube's predicate filters do not
/// promise.
fn node_trigger(
    seen: &mut HashMap<String, u64>,
    event: std::result::Result<watcher::Event<Node>, watcher::Error>,
) -> Option<std::result::Result<Node, watcher::Error>> {
    use std::hash::{Hash, Hasher};
    match event {
        Err(err) => Some(Err(err)),
        Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => {
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
            let hash = hasher.finish();
            (seen.insert(node.name_any(), hash) != Some(hash)).then_some(Ok(node))
        }
        Ok(watcher::Event::Delete(node)) => {
            seen.remove(&node.name_any());
            Some(Ok(node))
        }
        Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
    }
}

/// Shared by every reconcile.
pub struct Context {
    pub client: Client,
    pub pools: Store<HugePagePool>,
    pub nodes: Store<Node>,
    pub node_states: Store<HugePageNode>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Asked before every write (see `leader`).
    pub leader: Fence,
    pub ready: Arc<AtomicBool>,
    pub config: Config,
    /// The clock; tests pass a fixed one.
    pub now: fn() -> Timestamp,
    written: Mutex<Written>,
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
            written: Mutex::new(Written::default()),
        }
    }

    async fn publish(&self, event: Event, reference: &ObjectReference) {
        if let Err(err) = self.recorder.publish(&event, reference).await {
            warn!(error = %err, reason = %event.reason, "publishing an event");
        }
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

pub(crate) fn has_taint(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
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

/// The server-side apply body of a HugePageNode's spec.
pub fn node_spec_apply(node: &Node, plan: &NodePlan) -> serde_json::Value {
    let name = node.name_any();
    json!({
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
    })
}

/// The merge patch that empties a HugePageNode's spec.
pub fn node_spec_clear(node: &Node, with_owner: bool) -> serde_json::Value {
    let mut patch = json!({"spec": {"pageSizes": []}});
    if with_owner {
        patch["metadata"] = node_spec_apply(node, &NodePlan::default())["metadata"].clone();
    }
    patch
}

/// Reconciles one pool: plans the cluster, writes what changed.
#[instrument(skip(pool, ctx), fields(pool = %pool.name_any()))]
pub async fn reconcile(pool: Arc<HugePagePool>, ctx: Arc<Context>) -> Result<Action> {
    if !ctx.leader.open() {
        return Ok(Action::await_change());
    }
    if !ctx.ready.load(Ordering::Relaxed) {
        // Never plan from a partial view: a missing HugePageNode would be
        // planned as new and its node admitted again.
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    let started = Instant::now();
    let action = reconcile_pool(&pool.name_any(), &ctx).await;
    ctx.metrics.observe_reconcile(started.elapsed());
    action
}

pub fn error_policy(pool: Arc<HugePagePool>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(pool = %pool.name_any(), %error, "reconcile failed");
    ctx.metrics.count_error(error.metric_label());
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile_pool(name: &str, ctx: &Context) -> Result<Action> {
    let mut written = ctx.written.lock().await;
    // The caches' copy and the planner (the one-time finalizer write of a
    // new pool aside).
    let planning = Instant::now();
    let pools = fresher(ctx.pools.state(), &mut written.pools, false);
    let nodes = fresher(ctx.nodes.state(), &mut written.nodes, false);
    let states = fresher(ctx.node_states.state(), &mut written.node_states, true);
    let Some(mut pool) = pools
        .iter()
        .find(|p| p.name_any() == name)
        .map(|p| HugePagePool::clone(p))
    else {
        ctx.metrics.forget_pool(name);
        return Ok(Action::await_change());
    };
    let pools_api: Api<HugePagePool> = Api::all(ctx.client.clone());
    if pool.metadata.deletion_timestamp.is_none()
        && !pool.finalizers().iter().any(|f| f == POOL_FINALIZER)
    {
        fenced(ctx)?;
        let updated = add_finalizer(&pools_api, &pool).await?;
        written.pools.insert(
            name.to_string(),
            (Arc::new(updated.clone()), Instant::now()),
        );
        pool = updated;
    }

    let now = (ctx.now)();
    let pools: Vec<HugePagePool> = pools.iter().map(|p| HugePagePool::clone(p)).collect();
    let nodes: Vec<&Node> = nodes.iter().map(Arc::as_ref).collect();
    let node_states: Vec<&HugePageNode> = states.iter().map(Arc::as_ref).collect();
    let plan = planner::plan(&PlanInput {
        pools: &pools,
        nodes: &nodes,
        node_states: &node_states,
        now,
    });
    ctx.metrics
        .plan_duration
        .observe(planning.elapsed().as_secs_f64());
    let nodes_by_name: HashMap<&str, &Node> = nodes
        .iter()
        .filter_map(|&n| n.metadata.name.as_deref().map(|name| (name, n)))
        .collect();
    drop(node_states);
    // Of the states the pass planned from it keeps only what its writes and
    // drains read, so the caches' newer copies (the watch delivers every
    // write of this pass) do not live beside a whole older fleet (operator/
    // BENCH.md: peak RSS at 10,000 nodes).
    let (to_write, mut drain_states) = {
        let states_by_name: HashMap<&str, &Arc<HugePageNode>> = states
            .iter()
            .filter_map(|s| s.metadata.name.as_deref().map(|name| (name, s)))
            .collect();
        let mut to_write = Vec::new();
        let mut drain_states: HashMap<&str, Arc<HugePageNode>> = HashMap::new();
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
            if node_plan.spec_changed || needs_owner {
                to_write.push((node, current.is_some(), node_plan, needs_owner));
            }
        }
        (to_write, drain_states)
    };
    drop(states);
    let mut evicting = false;
    // One node's failed write must not hold up the others or the status;
    // the first error is returned at the end so the pass is retried.
    let mut node_error = None;
    // The specs first, `NODE_WRITES_IN_FLIGHT` at a time: a rollout's wave
    // (or a whole fleet at maxUnavailable 100%) is written in a fraction of
    // the time one write after another takes. A write's future is made when
    // a slot frees and its response is kept as it arrives: a Vec of every
    // write's future, then one of every response, were 38 of the 136 MiB of
    // peak heap at 10,000 nodes (operator/BENCH.md). (`buffer_unordered`
    // over a lazy `map` does the same but its closure, borrowing the pass,
    // fails the Controller's higher-ranked `Send` bound.)
    let mut waiting = to_write.into_iter();
    let mut in_flight = FuturesUnordered::new();
    loop {
        while in_flight.len() < NODE_WRITES_IN_FLIGHT {
            let Some((node, exists, node_plan, needs_owner)) = waiting.next() else {
                break;
            };
            in_flight.push(write_node_spec(ctx, node, exists, node_plan, needs_owner));
        }
        let Some((node_name, result)) = in_flight.next().await else {
            break;
        };
        match result {
            Ok(updated) => {
                let updated = Arc::new(updated);
                if let Some(state) = drain_states.get_mut(node_name.as_str()) {
                    *state = Arc::clone(&updated);
                }
                written
                    .node_states
                    .insert(node_name, (updated, Instant::now()));
            }
            Err(Error::NotLeader) => return Ok(Action::await_change()),
            Err(err) => {
                warn!(node = %node_name, error = %err, "node spec not written");
                node_error.get_or_insert(err);
            }
        }
    }
    // Then the drains, in node order (they are few, and evictions must be
    // paced).
    for (node_name, node_plan) in &plan.nodes {
        if !ctx.leader.open() {
            return Ok(Action::await_change());
        }
        let Some(&node) = nodes_by_name.get(node_name.as_str()) else {
            continue;
        };
        let node_state = drain_states.get(node_name.as_str()).map(Arc::as_ref);
        match carry_out_drain(ctx, node, node_state, node_plan, now, &mut written).await {
            Ok(still_evicting) => evicting |= still_evicting,
            Err(Error::NotLeader) => return Ok(Action::await_change()),
            Err(err) => {
                warn!(node = %node_name, error = %err, "node not updated");
                node_error.get_or_insert(err);
            }
        }
    }

    let Some(pool_plan) = plan.pools.get(name) else {
        return Ok(Action::await_change());
    };
    let old_status = pool.status.clone().unwrap_or_default();
    let mut status = pool_plan.status.clone();
    let evicted = written.evicted.get(name).cloned().unwrap_or_default();
    status.record_evictions(evicted);
    if status != old_status {
        fenced(ctx)?;
        let updated = pools_api
            .patch_status(
                name,
                &PatchParams::apply(OPERATOR_MANAGER).force(),
                &Patch::Apply(json!({
                    "apiVersion": HugePagePool::api_version(&()),
                    "kind": HugePagePool::kind(&()),
                    "status": status,
                })),
            )
            .await
            .map_err(|source| Error::PoolStatus {
                pool: name.to_string(),
                source,
            })?;
        written.evicted.remove(name);
        written.pools.insert(
            name.to_string(),
            (Arc::new(updated.clone()), Instant::now()),
        );
        // The finalizer patch below must carry the newest resourceVersion.
        pool = updated;
        if !pool_plan.admitted.is_empty() {
            info!(admitted = ?pool_plan.admitted, "nodes admitted to the rollout");
        }
        for event in events::pool_events(&old_status, &status) {
            ctx.publish(event, &pool.object_ref(&())).await;
        }
    }
    ctx.metrics.observe_pool(name, pool_plan);
    if let Some(err) = node_error {
        return Err(err);
    }
    if pool_plan.remove_finalizer && pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
        fenced(ctx)?;
        remove_finalizer(&pools_api, &pool).await?;
        written.pools.remove(name);
        written.evicted.remove(name);
        ctx.metrics.forget_pool(name);
        info!("pool released every node; finalizer removed");
        return Ok(Action::await_change());
    }
    Ok(next_action(&ctx.config, &plan, now, evicting))
}

/// When to look again without an event: a drain deadline, a drain that is
/// evicting, or the resync period.
fn next_action(config: &Config, plan: &Plan, now: Timestamp, evicting: bool) -> Action {
    let mut wait = config.resync;
    if let Some(deadline) = plan.next_deadline {
        let until = deadline.duration_since(now);
        let until = Duration::try_from(until).unwrap_or(Duration::ZERO);
        wait = wait.min(until + Duration::from_millis(100));
    }
    if evicting {
        wait = wait.min(config.drain_poll);
    }
    Action::requeue(wait)
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

/// How many HugePageNode specs one pass writes at once.
const NODE_WRITES_IN_FLIGHT: usize = 32;

/// Creates or updates the node's HugePageNode (its spec, or its owner when
/// `needs_owner`, is not what the plan says); returns it as it now is.
async fn write_node_spec(
    ctx: &Context,
    node: &Node,
    exists: bool,
    plan: &NodePlan,
    needs_owner: bool,
) -> (String, Result<HugePageNode>) {
    let name = node.name_any();
    // A replica that lost the Lease stops writing at once.
    if !ctx.leader.open() {
        return (name, Err(Error::NotLeader));
    }
    let api: Api<HugePageNode> = Api::all(ctx.client.clone());
    // Applying an empty list drops `spec` altogether (nothing in it is owned
    // any more), which the schema refuses; clear it explicitly.
    let (params, patch) = if exists && plan.spec.page_sizes.is_empty() {
        let params = PatchParams {
            field_manager: Some(OPERATOR_MANAGER.into()),
            ..PatchParams::default()
        };
        (params, Patch::Merge(node_spec_clear(node, needs_owner)))
    } else {
        (
            PatchParams::apply(OPERATOR_MANAGER).force(),
            Patch::Apply(node_spec_apply(node, plan)),
        )
    };
    let result = api
        .patch(&name, &params, &patch)
        .await
        .map(|mut updated| {
            // A pass keeps every response until its writes are done: their
            // managedFields (a tree of maps per field the agent and the
            // operator own) were over half the operator's peak heap.
            updated.metadata.managed_fields = None;
            updated
        })
        .map_err(|source| Error::NodeSpec {
            node: name.clone(),
            source,
        });
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

/// Sets the Draining condition, the taint and evicts as the plan says;
/// returns whether evictions are still going on.
async fn carry_out_drain(
    ctx: &Context,
    node: &Node,
    node_state: Option<&HugePageNode>,
    plan: &NodePlan,
    now: Timestamp,
    written: &mut Written,
) -> Result<bool> {
    let drain = &plan.drain;
    let name = node.name_any();
    let on_node = if drain.evict.is_empty() && drain.evict_pods.is_empty() {
        Vec::new()
    } else {
        let pods: Api<Pod> = Api::all(ctx.client.clone());
        pods.list(&ListParams::default().fields(&format!("spec.nodeName={name}")))
            .await
            .map_err(|source| Error::ListPods {
                node: name.clone(),
                source,
            })?
            .items
    };
    written.evictions.prune(&name, &on_node);
    // Only the fewest pods whose own requests free what the shrink needs
    // (the agent's word alone drains nothing), never those eviction cannot
    // move; the condition names both.
    let mut chosen: Vec<&Pod> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    for &size in &drain.evict {
        let selection = drain::choose(&on_node, size, must_free(node_state, plan, size));
        notes.extend(selection.unexplained);
        for pod in selection.evict {
            if !chosen.iter().any(|c| c.metadata.uid == pod.metadata.uid) {
                chosen.push(pod);
            }
        }
    }
    // The pods a kubelet restart waits for (the Memory Manager's), by UID.
    let (held, held_kept) = drain::memory_manager_holders(&on_node, &drain.evict_pods);
    let restart_waits_for: Vec<String> =
        held.iter().filter_map(|p| p.metadata.uid.clone()).collect();
    for pod in held {
        if !chosen.iter().any(|c| c.metadata.uid == pod.metadata.uid) {
            chosen.push(pod);
        }
    }
    if !chosen.is_empty() {
        let named: Vec<String> = chosen
            .iter()
            .map(|p| {
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
    let mut kept = drain::unevictable_consumers(&on_node, &drain.evict);
    for pod in held_kept {
        if !kept.contains(&pod) {
            kept.push(pod);
        }
    }
    if !kept.is_empty() {
        notes.push(format!("not evicted: {}", kept.join(", ")));
    }
    let condition_update = drain.condition.clone().map(|mut update| {
        if update.status && !notes.is_empty() {
            update.message = format!("{}; {}", update.message, notes.join("; "));
        } else if !kept.is_empty() {
            update.message = format!("{}; not evicted: {}", update.message, kept.join(", "));
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
        if set_condition(&mut conditions, update.clone(), &Time(now)) {
            fenced(ctx)?;
            let Some(condition) = find_condition(&conditions, NodeConditionType::Draining) else {
                return Ok(false);
            };
            let api: Api<HugePageNode> = Api::all(ctx.client.clone());
            let updated = api
                .patch_status(
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
                })?;
            written
                .node_states
                .insert(name.clone(), (Arc::new(updated), Instant::now()));
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
        fenced(ctx)?;
        set_taints(ctx, node, &taints, written).await?;
    }
    if drain.evict.is_empty() && drain.evict_pods.is_empty() {
        return Ok(false);
    }
    let pool = drain.pools.first().cloned().unwrap_or_default();
    let needed: Vec<String> = drain
        .evict
        .iter()
        .map(|&size| format!("{} of {size}", must_free(node_state, plan, size)))
        .collect();
    for pod in chosen {
        let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if written
            .evictions
            .get(&uid)
            .is_some_and(|b| b.next_try > now)
        {
            continue;
        }
        // Evictions are slow (each a round trip, some refused): a replica
        // paused or cut off mid-drain must not go on from its old plan.
        fenced(ctx)?;
        let outcome = drain::evict(&ctx.client, pod).await;
        ctx.metrics.count_eviction(&pool, outcome.metric_label());
        let first_refusal = written.evictions.get(&uid).is_none();
        match &outcome {
            Eviction::Evicted => {
                written.evictions.forget(&uid);
                info!(node = %name, pod = %key, "evicted");
                let pages: u64 = drain.evict.iter().map(|&s| drain::pages_held(pod, s)).sum();
                let reason = if restart_waits_for.contains(&uid) {
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
                written
                    .evicted
                    .entry(pool.clone())
                    .or_default()
                    .push(EvictedPod {
                        pod: key.clone(),
                        node: name.clone(),
                        pages: pages as i64,
                        reason: bounded_message(reason),
                        evicted_at: Some(Time(now)),
                    });
            }
            Eviction::Blocked(message) | Eviction::Failed(message) => {
                let backoff = written.evictions.refused(&uid, &name, now);
                debug!(node = %name, pod = %key, %message, attempts = backoff.attempts, "eviction refused");
            }
        }
        if matches!(outcome, Eviction::Evicted) || first_refusal {
            ctx.publish(
                events::eviction_event(&key, &outcome),
                &node_reference(node),
            )
            .await;
        }
    }
    Ok(true)
}

/// Err(NotLeader) unless this replica may write now (see `leader::Fence`).
fn fenced(ctx: &Context) -> Result<()> {
    if ctx.leader.open() {
        Ok(())
    } else {
        Err(Error::NotLeader)
    }
}

/// Adds or removes `hugepool.dev/draining:NoSchedule`, leaving other taints
/// alone; the resourceVersion makes a concurrent change fail and retry.
async fn set_taints(
    ctx: &Context,
    node: &Node,
    taints: &[(&str, bool)],
    written: &mut Written,
) -> Result<()> {
    let name = node.name_any();
    let api: Api<Node> = Api::all(ctx.client.clone());
    let error = |source| Error::Taint {
        node: name.clone(),
        source,
    };
    let updated = match api
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(taints_patch(node, taints)),
        )
        .await
    {
        Ok(updated) => updated,
        // The Node moved on since the watch saw it (status updates do
        // that often): read it once more and try again.
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let fresh = api.get(&name).await.map_err(error)?;
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(taints_patch(&fresh, taints)),
            )
            .await
            .map_err(error)?
        }
        Err(source) => return Err(error(source)),
    };
    info!(node = %name, ?taints, "taints updated");
    let mut updated = updated;
    slim_node(&mut updated);
    written
        .nodes
        .insert(name, (Arc::new(updated), Instant::now()));
    Ok(())
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

/// Pools that care about a node: those selecting it and those with an
/// entry on its HugePageNode.
fn pools_for_node(
    node_name: &str,
    labels: Option<&BTreeMap<String, String>>,
    pools: &Store<HugePagePool>,
    node_states: &Store<HugePageNode>,
) -> Vec<ObjectRef<HugePagePool>> {
    let entries: Vec<String> = node_states
        .get(&ObjectRef::new(node_name))
        .map(|s| s.spec.page_sizes.iter().map(|e| e.pool.clone()).collect())
        .unwrap_or_default();
    pools
        .state()
        .iter()
        .filter(|pool| {
            let selected = labels.is_some_and(|labels| {
                Selector::try_from(pool.spec.node_selector.clone())
                    .is_ok_and(|selector| selector.matches(labels))
            });
            selected || entries.contains(&pool.name_any())
        })
        .map(|pool| ObjectRef::from_obj(pool.as_ref()))
        .collect()
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

/// Runs the operator until `shutdown` completes: the HTTP endpoints, leader
/// election, the watches and the controller.
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
    let is_leader = leadership.is_leader.clone();

    // The caches hold what the planner reads and no more (a real Node is
    // 10-20 KB, mostly status and managedFields); Node events that change
    // none of it (heartbeats, images, conditions) plan nothing.
    let (nodes, node_writer) = reflector::store();
    let node_events = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default()).modify(slim_node),
    )
    .default_backoff()
    .filter_map({
        let mut seen = HashMap::new();
        move |event| futures::future::ready(node_trigger(&mut seen, event))
    });
    let (node_states, state_writer) = reflector::store();
    let state_events = reflector::reflector(
        state_writer,
        watcher(
            Api::<HugePageNode>::all(client.clone()),
            watcher::Config::default(),
        )
        .modify(|state: &mut HugePageNode| state.metadata.managed_fields = None),
    )
    .default_backoff()
    .touched_objects();

    let controller = Controller::new(
        Api::<HugePagePool>::all(client.clone()),
        watcher::Config::default(),
    );
    let pools = controller.store();
    let ctx = Arc::new(Context::new(
        client,
        pools.clone(),
        nodes.clone(),
        node_states.clone(),
        metrics.clone(),
        leadership.fence(),
        ready.clone(),
        config,
    ));

    {
        let (nodes, node_states, ready) = (nodes.clone(), node_states.clone(), ready.clone());
        tasks.0.push(tokio::spawn(async move {
            // Not the pools store: it is the Controller's, which runs no
            // reconcile before it is ready, and a store's readiness wakes
            // only its latest waiter (kube-runtime's DelayedInit keeps one
            // waker), so waiting on it here too could leave either waiter
            // asleep forever.
            let synced =
                futures::future::try_join(nodes.wait_until_ready(), node_states.wait_until_ready())
                    .await;
            if synced.is_ok() {
                ready.store(true, Ordering::Relaxed);
                info!("watches synced");
            }
        }));
    }

    // Every reconcile that ran while this replica was not leading did
    // nothing; on becoming leader, reconcile every pool.
    let became_leader = {
        let metrics = metrics.clone();
        futures::stream::unfold(is_leader.clone(), move |mut is_leader| {
            let metrics = metrics.clone();
            async move {
                loop {
                    is_leader.changed().await.ok()?;
                    let leading = *is_leader.borrow_and_update();
                    metrics.set_leading(leading);
                    info!(leading, "leadership changed");
                    if leading {
                        return Some(((), is_leader));
                    }
                }
            }
        })
    };
    metrics.set_leading(*is_leader.borrow());

    let node_map = {
        let (pools, node_states) = (pools.clone(), node_states.clone());
        move |node: Node| {
            pools_for_node(
                &node.name_any(),
                node.metadata.labels.as_ref(),
                &pools,
                &node_states,
            )
        }
    };
    let state_map = {
        let (pools, nodes) = (pools.clone(), nodes.clone());
        move |state: HugePageNode| {
            let name = state.name_any();
            let node = nodes.get(&ObjectRef::new(&name));
            let labels = node.as_ref().and_then(|n| n.metadata.labels.as_ref());
            let named: Vec<String> = state
                .spec
                .page_sizes
                .iter()
                .map(|e| e.pool.clone())
                .collect();
            pools
                .state()
                .iter()
                .filter(|pool| {
                    named.contains(&pool.name_any())
                        || labels.is_some_and(|labels| {
                            Selector::try_from(pool.spec.node_selector.clone())
                                .is_ok_and(|selector| selector.matches(labels))
                        })
                })
                .map(|pool| ObjectRef::from_obj(pool.as_ref()))
                .collect::<Vec<_>>()
        }
    };

    controller
        .watches_stream(node_events, node_map)
        .watches_stream(state_events, state_map)
        .reconcile_all_on(became_leader)
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(err) = result {
                debug!(error = %err, "reconcile");
            }
        })
        .await;
    // The lease task gives the Lease up only once every receiver is gone.
    drop(is_leader);
    leadership.release().await;
    Ok(())
}

#[cfg(test)]
mod tests;
