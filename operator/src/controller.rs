//! The controller: one worker plans the whole fleet from one snapshot and
//! carries the plan out. It decides nothing itself (see `planner`).
//!
//! Pools, Nodes and HugePageNodes are watched into caches; every event that
//! can change a plan wakes the worker (one wake-up for any number of events
//! that arrive while a pass runs), so P pools cost one plan per burst, not P.
//! A pass goes through named steps ([`pass`]):
//!
//! ```text
//!  await own writes ─▶ evictions answered ─▶ finalizers ─▶ plan ─▶ specs
//!      ─▶ drains (conditions, taints, pods) ─▶ statuses (+ eviction records)
//!      ─▶ evictions started ─▶ next deadline
//! ```
//!
//! Nothing is locked across a request: the worker owns its state. A write
//! that fails or times out is kept to its node (or pool): it is retried with
//! jittered exponential backoff and its pools report it, while every other
//! node goes on. Only a lost Lease ends a pass early. Evictions run beside
//! the passes (`evictions`), so a slow eviction webhook holds up one pod.
//!
//! Every write is fenced (`writes::fenced`): sent only while this replica
//! leads, bounded by the Lease's safe window, and conditioned on the version
//! the plan read, so that a deposed leader's late write lands nothing.

mod claims;
mod drains;
mod evictions;
mod specs;
mod statuses;
mod watches;
mod writes;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use hugepool_crds::{HugePageNode, HugePagePool, OPERATOR_MANAGER};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::api::{Api, DynamicObject};
use kube::runtime::events::{Event, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::Notify;
use tracing::{info, instrument, warn};

pub use drains::{has_drain_taint, taint_patch, taints_patch};
pub use evictions::{EVICTION_TIMEOUT, SLOW_EVICTION};
pub use specs::{new_node_state, node_spec_patch};
pub use statuses::release_patch;
pub use watches::{NodeTrigger, slim_node};
pub use writes::{Deliveries, retry_delay};

use crate::error::{Error, Result};
use crate::events;
use crate::leader::{Fence, LeaderConfig, Leadership};
use crate::metrics::{Health, Metrics};
use crate::planner::{self, Plan, PlanInput};
use evictions::{Evictions, PlannedEviction};
use watches::{AbortOnDrop, PodWatches, follow};
use writes::{Retries, fenced};

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
    /// The Nodes the agents run on (see `planner::PlanInput::agent_nodes`).
    pub agent_nodes: Option<kube::core::Selector>,
    /// Follow every ResourceClaim and tell each node's agent what the
    /// claims allocated there hold (pools consumed through DRA).
    pub watch_claims: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: None,
            leader: None,
            instance: "hugepool-operator".into(),
            resync: Duration::from_secs(300),
            agent_nodes: None,
            watch_claims: false,
        }
    }
}

/// How long a pass waits for the caches to show the writes of the pass
/// before it; past that it plans from what they show.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// How many HugePageNode specs one pass writes at once.
const NODE_WRITES_IN_FLIGHT: usize = 32;
/// How soon a replica that still leads passes again after a pass that
/// found the Lease closed (a renewal not seen yet).
const FENCE_RECHECK: Duration = Duration::from_millis(500);

/// What the worker carries from one pass to the next.
pub struct Worker {
    /// Nodes whose last spec write did not land.
    node_retries: Retries,
    /// Nodes whose last drain step (pods or claims read, taints, Draining
    /// condition) did not land.
    drain_retries: Retries,
    /// Nodes whose last `status.allocatedClaims` write did not land.
    claim_retries: Retries,
    /// The API server dropped `status.allocatedClaims` from a write: its
    /// HugePageNode CRD predates the field (said once; not written again
    /// by this worker, which would write every pass for nothing).
    claims_field_unknown: bool,
    /// Pools whose last write did not land.
    pool_retries: Retries,
    /// Evictions in flight, refused ones waiting out their backoff, and
    /// the records to take back.
    evictions: Evictions,
    /// The pods of the nodes being drained, watched.
    pod_watches: PodWatches,
    /// Pools whose metrics are published.
    pools_seen: HashSet<String>,
    /// Failed writes and unacknowledged specs, for the planner.
    observed: planner::Observed,
}

impl Default for Worker {
    fn default() -> Self {
        Self {
            node_retries: Retries::up_to(writes::RETRY_MAX),
            drain_retries: Retries::up_to(writes::RETRY_MAX),
            claim_retries: Retries::up_to(writes::RETRY_MAX),
            claims_field_unknown: false,
            pool_retries: Retries::up_to(writes::POOL_RETRY_MAX),
            evictions: Evictions::default(),
            pod_watches: PodWatches::default(),
            pools_seen: HashSet::new(),
            observed: planner::Observed::default(),
        }
    }
}

impl Worker {
    /// Nothing in hand: no eviction, watch, retry or observation.
    fn is_fresh(&self) -> bool {
        self.evictions.is_empty()
            && self.pod_watches.is_empty()
            && self.node_retries.is_empty()
            && self.drain_retries.is_empty()
            && self.claim_retries.is_empty()
            && self.pool_retries.is_empty()
            && self.pools_seen.is_empty()
    }
}

/// Waits until the caches show every write of the last pass (or its kind
/// was listed anew, or the object went), at most `DELIVERY_TIMEOUT`.
async fn await_deliveries(deliveries: &Deliveries) {
    let deadline = tokio::time::Instant::now() + DELIVERY_TIMEOUT;
    loop {
        // Registered before looking, so no delivery is missed between.
        let delivered = deliveries.delivered.notified();
        if deliveries.outstanding() == 0 {
            return;
        }
        if tokio::time::timeout_at(deadline, delivered).await.is_err() {
            warn!(
                writes = deliveries.outstanding(),
                "the caches did not show the last pass's writes in time; planning from them"
            );
            deliveries.give_up();
            return;
        }
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
    /// Wakes the worker: watch events, and evictions that answered.
    pub wake: Arc<Notify>,
    /// Every ResourceClaim, with `Config::watch_claims`.
    pub claims: Option<Store<DynamicObject>>,
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
            wake: Arc::default(),
            claims: None,
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

pub(crate) fn node_reference(node: &Node) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: node.metadata.name.clone(),
        uid: node.metadata.uid.clone(),
        ..ObjectReference::default()
    }
}

/// How a pass went: when to look again without an event.
#[derive(Debug, PartialEq, Eq)]
pub struct Pass {
    pub next: Duration,
}

/// What one pass read: the caches' objects by name.
struct Snapshot {
    nodes: Vec<Arc<Node>>,
    states: Vec<Arc<HugePageNode>>,
}

impl Snapshot {
    fn node(&self, name: &str) -> Option<&Node> {
        self.nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .map(Arc::as_ref)
    }
}

/// One pass over the fleet, in named steps: waits for the caches to show
/// the last pass's writes, takes in the evictions that answered, gives new
/// pools their finalizer, plans from one snapshot, then writes the node
/// specs, the drains, every pool's status, and starts the evictions the
/// drains ask for. A node or pool whose write fails is retried with
/// backoff; the others go on. `Err(NotLeader)` only when this replica's
/// Lease closed part way.
#[instrument(skip_all)]
pub async fn pass(ctx: &Context, worker: &mut Worker) -> Result<Pass> {
    await_deliveries(&ctx.deliveries).await;
    let started = Instant::now();
    let now = (ctx.now)();
    let finished = worker.evictions.collect(now);
    statuses::tell_evictions(ctx, finished).await;

    let mut pools: Vec<HugePagePool> = ctx.pools.state().iter().map(|p| (**p).clone()).collect();
    statuses::add_finalizers(ctx, worker, &mut pools, started).await?;
    let snapshot = Snapshot {
        nodes: ctx.nodes.state(),
        states: ctx.node_states.state(),
    };
    let plan = plan_fleet(ctx, worker, &pools, &snapshot, now);

    let drain_states = write_specs(ctx, worker, &plan, &snapshot, started).await?;
    let Drains {
        to_evict,
        evicting,
        judged,
    } = carry_out_drains(ctx, worker, &plan, &snapshot, &drain_states, now, started).await?;
    worker.pod_watches.keep(
        &ctx.client,
        &ctx.wake,
        &ctx.metrics.watch_of("Pod"),
        evicting,
    );
    worker.evictions.abandon_unwanted(
        &judged,
        |node| plan.nodes.contains_key(node),
        |pool| plan.pools.contains_key(pool),
    );
    tell_allocated_claims(ctx, worker, &snapshot, started).await?;
    statuses::write_statuses(ctx, worker, &plan, pools, started).await?;
    for eviction in to_evict {
        worker
            .evictions
            .start(&ctx.client, &ctx.leader, &ctx.wake, eviction, now);
    }

    forget_what_went(ctx, worker, &plan, &snapshot);
    let next = next_look(ctx, worker, &plan, now, started);
    ctx.metrics.observe_reconcile(started.elapsed());
    Ok(Pass { next })
}

/// Plans the fleet from the snapshot and what the worker observed.
fn plan_fleet(
    ctx: &Context,
    worker: &mut Worker,
    pools: &[HugePagePool],
    snapshot: &Snapshot,
    now: Timestamp,
) -> Plan {
    let planning = Instant::now();
    worker.observed.write_errors = worker.node_retries.errors();
    for (node, error) in worker
        .drain_retries
        .errors()
        .into_iter()
        .chain(worker.claim_retries.errors())
    {
        worker.observed.write_errors.entry(node).or_insert(error);
    }
    worker
        .observed
        .track_acknowledgements(snapshot.states.iter().map(Arc::as_ref), now);
    let nodes: Vec<&Node> = snapshot.nodes.iter().map(Arc::as_ref).collect();
    let node_states: Vec<&HugePageNode> = snapshot.states.iter().map(Arc::as_ref).collect();
    let plan = planner::plan(&PlanInput {
        pools,
        nodes: &nodes,
        node_states: &node_states,
        observed: &worker.observed,
        now,
        agent_nodes: ctx.config.agent_nodes.as_ref(),
    });
    ctx.metrics
        .plan_duration
        .observe(planning.elapsed().as_secs_f64());
    plan
}

/// Writes the node specs the plan changed, `NODE_WRITES_IN_FLIGHT` at a
/// time (a rollout's wave, or a whole fleet at maxUnavailable 100%, is
/// written in a fraction of the time one write after another takes).
/// Returns the HugePageNodes the drains read, as written.
async fn write_specs(
    ctx: &Context,
    worker: &mut Worker,
    plan: &Plan,
    snapshot: &Snapshot,
    started: Instant,
) -> Result<HashMap<String, Arc<HugePageNode>>> {
    let states: HashMap<&str, &Arc<HugePageNode>> = snapshot
        .states
        .iter()
        .filter_map(|s| s.metadata.name.as_deref().map(|name| (name, s)))
        .collect();
    let nodes: HashMap<&str, &Node> = snapshot
        .nodes
        .iter()
        .filter_map(|n| n.metadata.name.as_deref().map(|name| (name, n.as_ref())))
        .collect();
    let mut drain_states: HashMap<String, Arc<HugePageNode>> = HashMap::new();
    let mut to_write = Vec::new();
    for (node_name, node_plan) in &plan.nodes {
        let Some(&node) = nodes.get(node_name.as_str()) else {
            continue;
        };
        let current = states.get(node_name.as_str()).copied();
        if drains::reads_state(&node_plan.drain)
            && let Some(current) = current
        {
            drain_states.insert(node_name.clone(), Arc::clone(current));
        }
        let needs_owner = current.is_none_or(|c| !specs::owned_by(c, node));
        if (node_plan.spec_changed || needs_owner) && worker.node_retries.due(node_name, started) {
            to_write.push((node, current.map(Arc::as_ref), node_plan, needs_owner));
        }
    }
    let mut waiting = to_write.into_iter();
    let mut in_flight = FuturesUnordered::new();
    loop {
        while in_flight.len() < NODE_WRITES_IN_FLIGHT {
            let Some((node, current, node_plan, needs_owner)) = waiting.next() else {
                break;
            };
            in_flight.push(specs::write_node_spec(
                ctx,
                node,
                current,
                node_plan,
                needs_owner,
            ));
        }
        let Some((node_name, result)) = in_flight.next().await else {
            break;
        };
        match result {
            Ok(updated) => {
                worker.node_retries.succeeded(&node_name);
                ctx.deliveries.await_write("HugePageNode", &updated);
                if let Some(state) = drain_states.get_mut(&node_name) {
                    *state = Arc::new(updated);
                }
            }
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            // A conflict (the spec changed since the plan read it, or the
            // object exists already) is retried soon for this node alone; a
            // failure is reported and backs off.
            Err(err) => {
                if let Some(&node) = nodes.get(node_name.as_str()) {
                    node_write_failed(ctx, &mut worker.node_retries, node, &err).await;
                }
            }
        }
    }
    Ok(drain_states)
}

/// Tells each node's agent what the claims allocated there hold
/// (claims.rs), `NODE_WRITES_IN_FLIGHT` nodes at a time; a node whose write
/// fails backs off on its own.
async fn tell_allocated_claims(
    ctx: &Context,
    worker: &mut Worker,
    snapshot: &Snapshot,
    started: Instant,
) -> Result<()> {
    let Some(store) = &ctx.claims else {
        return Ok(());
    };
    if worker.claims_field_unknown {
        return Ok(());
    }
    let due: Vec<_> = claims::to_tell(store, &snapshot.states)
        .into_iter()
        .filter(|(node, _)| worker.claim_retries.due(node, started))
        .collect();
    let written: Vec<_> = futures::stream::iter(due)
        .map(|(node, allocated)| async move {
            let result = claims::write_allocated(ctx, &node, &allocated).await;
            (node, allocated, result)
        })
        .buffer_unordered(NODE_WRITES_IN_FLIGHT)
        .collect()
        .await;
    for (node_name, allocated, result) in written {
        match result {
            Ok(updated) => {
                worker.claim_retries.succeeded(&node_name);
                ctx.deliveries.await_write("HugePageNode", &updated);
                let shown = updated
                    .status
                    .as_ref()
                    .map_or(&[][..], |s| s.allocated_claims.as_slice());
                if shown != allocated.as_slice() && !worker.claims_field_unknown {
                    worker.claims_field_unknown = true;
                    warn!(
                        node = %node_name,
                        "the API server dropped status.allocatedClaims: the HugePageNode CRD predates it, so \
                         agents cannot hold claims the scheduler allocated before the kubelet prepares them; \
                         apply the chart's CRDs (kubectl apply --server-side --force-conflicts -f \
                         charts/hugepool/crds/) and restart the operator"
                    );
                }
            }
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            Err(err) => match snapshot.node(&node_name) {
                Some(node) => node_write_failed(ctx, &mut worker.claim_retries, node, &err).await,
                None => {
                    writes::count_unlanded(ctx, &err);
                }
            },
        }
    }
    Ok(())
}

/// What carrying out the drains found.
struct Drains {
    /// The evictions to start.
    to_evict: Vec<PlannedEviction>,
    /// The nodes evicting.
    evicting: BTreeSet<String>,
    /// For each node whose drain was carried out, the pods it selects (none
    /// when it no longer evicts).
    judged: BTreeMap<String, BTreeSet<String>>,
}

/// Carries out each node's drain as planned: the Draining condition, the
/// taints, and the pods to evict. The reads (a node's pods and claims) and
/// the writes run `NODE_WRITES_IN_FLIGHT` nodes at a time, as spec writes
/// do; a drain step that fails backs off that node's drain alone
/// (`drain_retries`), not its spec writes.
async fn carry_out_drains(
    ctx: &Context,
    worker: &mut Worker,
    plan: &Plan,
    snapshot: &Snapshot,
    drain_states: &HashMap<String, Arc<HugePageNode>>,
    now: Timestamp,
    started: Instant,
) -> Result<Drains> {
    let mut to_evict = Vec::new();
    let mut evicting = BTreeSet::new();
    let mut judged = BTreeMap::new();
    let mut due = Vec::new();
    for (node_name, node_plan) in &plan.nodes {
        let Some(node) = snapshot.node(node_name) else {
            continue;
        };
        // A node the plan no longer drains wants no eviction, whether or
        // not its drain is carried out in this pass.
        if !drains::evicts(node_plan) {
            judged.insert(node_name.clone(), BTreeSet::new());
        }
        if worker.drain_retries.due(node_name, started) {
            due.push((
                node,
                node_plan,
                drain_states.get(node_name).map(Arc::as_ref),
                worker.pod_watches.pods(node_name),
            ));
        }
    }
    // What each draining node holds, read in parallel.
    let read: Vec<_> = futures::stream::iter(due)
        .map(|(node, node_plan, node_state, watched)| async move {
            let on_node = drains::read_drain(ctx, node, node_plan, watched).await;
            (node, node_plan, node_state, on_node)
        })
        .buffered(NODE_WRITES_IN_FLIGHT)
        .collect()
        .await;
    let mut to_write = Vec::new();
    for (node, node_plan, node_state, on_node) in read {
        match on_node {
            Ok(on_node) => {
                let condition =
                    drains::draining_condition(worker, node, node_state, node_plan, &on_node, now);
                to_write.push((node, node_plan, node_state, on_node, condition));
            }
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            Err(err) => node_write_failed(ctx, &mut worker.drain_retries, node, &err).await,
        }
    }
    // The taints and conditions, written in parallel.
    let written: Vec<_> = futures::stream::iter(to_write)
        .map(
            |(node, node_plan, node_state, on_node, condition)| async move {
                let result =
                    drains::write_drain(ctx, node, node_state, node_plan, condition.as_ref(), now)
                        .await;
                (node, node_plan, node_state, on_node, result)
            },
        )
        .buffered(NODE_WRITES_IN_FLIGHT)
        .collect()
        .await;
    for (node, node_plan, node_state, on_node, result) in written {
        let node_name = node.name_any();
        match result {
            Ok(()) => {
                worker.drain_retries.succeeded(&node_name);
                if drains::evicts(node_plan) {
                    evicting.insert(node_name.clone());
                    let (evictions, wanted) = drains::choose_evictions(
                        worker, node, node_state, node_plan, &on_node, now,
                    );
                    to_evict.extend(evictions);
                    judged.insert(node_name, wanted);
                }
            }
            Err(Error::NotLeader) => return Err(Error::NotLeader),
            Err(err) => node_write_failed(ctx, &mut worker.drain_retries, node, &err).await,
        }
    }
    Ok(Drains {
        to_evict,
        evicting,
        judged,
    })
}

/// A write to `node` did not land (a spec write, with `retries` the
/// worker's `node_retries`; a drain step, reading its pods or claims, its
/// taints or its Draining condition, with `drain_retries`): counted, put on
/// a retry in `retries`, and the first failure of a streak told as a
/// `WriteFailed` Event.
async fn node_write_failed(ctx: &Context, retries: &mut Retries, node: &Node, err: &Error) {
    writes::count_unlanded(ctx, err);
    if retries.fail(&node.name_any(), err) {
        ctx.publish(events::write_failed(err), &node_reference(node))
            .await;
    }
}

/// Forgets the metrics, retries and refusals of pools and nodes that went.
fn forget_what_went(ctx: &Context, worker: &mut Worker, plan: &Plan, snapshot: &Snapshot) {
    worker.pools_seen.retain(|name| {
        let kept = plan.pools.contains_key(name);
        if !kept {
            ctx.metrics.forget_pool(name);
        }
        kept
    });
    // A pool not planned yet (its finalizer did not land) keeps its retry.
    let pools: HashSet<String> = ctx.pools.state().iter().map(|p| p.name_any()).collect();
    worker.pool_retries.retain(|name| pools.contains(name));
    worker
        .node_retries
        .retain(|name| snapshot.node(name).is_some());
    worker
        .drain_retries
        .retain(|name| snapshot.node(name).is_some());
    worker
        .claim_retries
        .retain(|name| snapshot.node(name).is_some());
    worker
        .evictions
        .forget_pools(|pool| plan.pools.contains_key(pool));
}

/// When to look again without an event: the earliest deadline the plan,
/// the retries and the evictions know, at most `resync` away.
fn next_look(
    ctx: &Context,
    worker: &Worker,
    plan: &Plan,
    now: Timestamp,
    started: Instant,
) -> Duration {
    let until = |deadline: Timestamp| {
        Duration::try_from(deadline.duration_since(now)).unwrap_or(Duration::ZERO)
            + Duration::from_millis(100)
    };
    let mut next = ctx.config.resync;
    if let Some(deadline) = plan.next_deadline {
        next = next.min(until(deadline));
    }
    if let Some(deadline) = worker.evictions.next_deadline(now) {
        next = next.min(until(deadline));
    }
    // Retries due when the pass started were tried by it (or wait on
    // something else, such as a node the plan no longer has).
    let retry = worker
        .node_retries
        .next_after(started)
        .into_iter()
        .chain(worker.pool_retries.next_after(started))
        .chain(worker.drain_retries.next_after(started))
        .chain(worker.claim_retries.next_after(started))
        .min();
    if let Some(retry) = retry {
        next = next.min(retry.saturating_duration_since(Instant::now()));
    }
    next
}

/// A replica that may no longer write forgets its work: evictions in
/// flight are abandoned (their tasks stopped: nothing more is asked or
/// written), the pods' watches end, and the retries, refusals and records
/// to withdraw go. Leading again, it starts afresh from what the API holds
/// then (another leader may have changed it meanwhile).
fn stand_by(worker: &mut Worker) {
    if worker.is_fresh() {
        return;
    }
    info!("not leading: the work in hand is abandoned");
    *worker = Worker::default();
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
        Some(leader) => {
            Leadership::elect(client.clone(), leader, metrics.watch_errors_of("Lease")).await?
        }
        None => Leadership::always(),
    };
    let mut is_leader = leadership.is_leader.clone();
    metrics.set_leading(*is_leader.borrow());

    // The caches hold what the planner reads and no more (a real Node is
    // 10-20 KB, mostly status and managedFields).
    let (pools, pool_writer) = reflector::store();
    let (nodes, node_writer) = reflector::store();
    let (node_states, state_writer) = reflector::store();
    let mut ctx = Context::new(
        client.clone(),
        pools.clone(),
        nodes.clone(),
        node_states.clone(),
        metrics.clone(),
        leadership.fence(),
        ready.clone(),
        config,
    );
    let wake = Arc::clone(&ctx.wake);
    let deliveries = Arc::clone(&ctx.deliveries);
    let mut claims = None;
    if ctx.config.watch_claims {
        let resource = hugepool_crds::dra::resource_claims();
        let writer = reflector::store::Writer::new(resource.clone());
        ctx.claims = Some(writer.as_reader());
        claims = ctx.claims.clone();
        let mut ours = watches::ClaimTrigger::default();
        tasks.0.push(follow(
            "ResourceClaim",
            reflector::reflector(
                writer,
                watcher(
                    Api::<DynamicObject>::all_with(client.clone(), &resource),
                    watcher::Config::default(),
                )
                .modify(|claim: &mut DynamicObject| claim.metadata.managed_fields = None),
            )
            .default_backoff(),
            Arc::clone(&deliveries),
            Arc::clone(&wake),
            metrics.watch_of("ResourceClaim"),
            move |event| ours.wakes(event),
        ));
    }
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
        metrics.watch_of("HugePagePool"),
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
        metrics.watch_of("Node"),
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
            .modify(watches::slim_node_state),
        )
        .default_backoff(),
        Arc::clone(&deliveries),
        Arc::clone(&wake),
        metrics.watch_of("HugePageNode"),
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
        // Nor tell an agent no claim holds pages before the claims are read.
        if let Some(claims) = &claims
            && claims.wait_until_ready().await.is_err()
        {
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
                stand_by(&mut worker);
                // Waits for leadership (or an event) without a timer.
                next = Duration::from_secs(3600);
                continue;
            }
            next = match pass(&ctx, &mut worker).await {
                Ok(pass) => pass.next,
                // The Lease closed part way (lost, or a renewal not seen
                // in time): a leadership change wakes the loop; a replica
                // whose fence opens again looks again soon.
                Err(Error::NotLeader) if ctx.leader.open() => FENCE_RECHECK,
                Err(Error::NotLeader) => {
                    info!("stopped writing: this replica does not lead");
                    stand_by(&mut worker);
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
