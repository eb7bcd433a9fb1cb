//! The cluster agent (`hugepool-agent run`): converges this node's
//! HugePageNode `.spec` with the resize engine and reports `.status`,
//! Events and metrics. Deciding lives in [`status`] (pure); this module
//! wires the engine, the kernel and the API server together.
//!
//! Three loops run side by side, so that an unreachable API server never
//! stops the kernel work: the resize loop (this module), the status writer
//! (reads the kernel, builds the status, patches it with backoff), and the
//! watchers of the node's own HugePageNode and Node.

pub mod liveness;
pub mod metrics;
pub mod server;
pub mod snapshot;
pub mod status;
pub mod writer_lock;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hugepool_crds::node::{PageSizeTarget, ResizeSummary};
use hugepool_crds::{
    AGENT_MANAGER, HugePageNode, HugePageNodeStatus, PageSize, duration, quantity,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, watcher};
use kube::{Client, Resource};
use tokio::sync::{Notify, mpsc, watch};
use tracing::{Instrument, debug, info, info_span, warn};

use self::metrics::{Metrics, PageState, SizeLabels, StallLabels, StepLabels};
use self::snapshot::KernelSnapshot;
use self::status::{AgentMemory, KernelLogState, Running, StallRecord};
use crate::kernel::{Kernel, PoolScope};
use crate::kmsg::KernelLogEvent;
use crate::resize::{self, CostModels, Direction, Event, Outcome, Settings, Summary, Target};
use hugepool_crds::conditions::Reason;

/// How the agent runs; the CLI fills it from flags.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_name: String,
    pub kernel_release: String,
    /// At most one status patch per this interval while resizing.
    pub min_patch_interval: Duration,
    /// How often the kernel is re-read when nothing happens.
    pub refresh_interval: Duration,
    /// How often a blocked shrink is re-checked.
    pub blocked_poll: Duration,
    /// How long after a shortfall growth is tried again.
    pub retry_interval: Duration,
    /// Command that restarts kubelet; empty disables restarts.
    pub kubelet_restart_command: Vec<String>,
    /// How long that command may run.
    pub kubelet_restart_timeout: Duration,
    /// `/dev/kmsg`, or `None` to not watch the kernel log.
    pub kmsg_path: Option<PathBuf>,
}

impl AgentConfig {
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            kernel_release: "unknown".into(),
            min_patch_interval: Duration::from_secs(1),
            refresh_interval: Duration::from_secs(15),
            blocked_poll: Duration::from_secs(2),
            retry_interval: Duration::from_secs(300),
            kubelet_restart_command: Vec::new(),
            kubelet_restart_timeout: Duration::from_secs(120),
            kmsg_path: None,
        }
    }
}

/// State the loops share.
pub struct Shared {
    memory: Mutex<AgentMemory>,
    changed: Notify,
    urgent: AtomicBool,
    /// Ready once the first status is written (or there is no HugePageNode).
    pub ready: Arc<AtomicBool>,
    pub metrics: Metrics,
    /// Status patches sent, for tests and logs.
    pub patches: AtomicU64,
    /// The resize loop's heartbeat, which `/healthz` reports.
    pub liveness: Arc<liveness::Liveness>,
}

impl Shared {
    pub fn new(metrics: Metrics) -> Arc<Self> {
        Self::with_liveness_timeout(metrics, Duration::from_secs(300))
    }

    /// `/healthz` fails once the resize loop has not come round for `timeout`.
    pub fn with_liveness_timeout(metrics: Metrics, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            memory: Mutex::new(AgentMemory::default()),
            changed: Notify::new(),
            urgent: AtomicBool::new(false),
            ready: Arc::new(AtomicBool::new(false)),
            metrics,
            patches: AtomicU64::new(0),
            liveness: Arc::new(liveness::Liveness::new(timeout)),
        })
    }

    fn memory(&self) -> MutexGuard<'_, AgentMemory> {
        // A panic elsewhere must not stop reporting: take the data as it is.
        self.memory
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Something the status shows changed; `urgent` skips the rate limit.
    fn touch(&self, urgent: bool) {
        if urgent {
            self.urgent.store(true, Ordering::Relaxed);
        }
        self.changed.notify_one();
    }
}

/// Events waiting for the API server at most; beyond, new ones are dropped
/// and counted (`hugepool_events_dropped_total`), so an unreachable API never
/// grows the agent's memory.
const EVENT_QUEUE: usize = 256;

type EventSender = mpsc::Sender<PendingEvent>;

/// Queues an Event without waiting; a full queue drops it and counts it.
fn queue_event(events: &EventSender, metrics: &Metrics, event: PendingEvent) {
    if let Err(mpsc::error::TrySendError::Full(event)) = events.try_send(event) {
        metrics.events_dropped.inc();
        debug!(reason = event.reason, "event queue full; event dropped");
    }
}

/// An Event the resize loop wants published (publishing is async and must
/// never hold up a kernel write).
struct PendingEvent {
    type_: EventType,
    reason: &'static str,
    note: String,
}

/// Runs the agent until `shutdown` turns true; then finishes the write in
/// flight, writes a last status and returns.
pub async fn run(
    client: Client,
    kernel: Arc<dyn Kernel>,
    config: AgentConfig,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) -> crate::Result<()> {
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    shared.memory().kubelet.restarts_disabled = config.kubelet_restart_command.is_empty();
    let (spec_tx, mut spec_rx) = watch::channel::<Option<HugePageNode>>(None);
    let (seen_tx, mut seen_rx) = watch::channel(false);
    tokio::spawn(watch_own_node_spec(
        hpns.clone(),
        config.node_name.clone(),
        spec_tx,
        seen_tx,
        Arc::clone(&shared),
    ));
    tokio::spawn(watch_kubelet_capacity(
        nodes,
        config.node_name.clone(),
        Arc::clone(&shared),
    ));

    let (events_tx, events_rx) = mpsc::channel::<PendingEvent>(EVENT_QUEUE);
    let (object_tx, object_rx) = watch::channel::<Option<HugePageNode>>(None);
    tokio::spawn(publish_events(
        client.clone(),
        config.node_name.clone(),
        events_rx,
        object_rx,
    ));

    // The writer stops only after the resize loop, so the last status shows
    // where the pool stopped.
    let (done_tx, done_rx) = watch::channel(false);
    let writer = tokio::spawn(write_status(
        hpns,
        Arc::clone(&kernel),
        config.clone(),
        Arc::clone(&shared),
        done_rx,
    ));

    if let Some(path) = config.kmsg_path.clone() {
        watch_kernel_log(path, Arc::clone(&shared), events_tx.clone());
    }

    // Wait for the first list of our HugePageNode so we never act on "none"
    // by mistake (however long the API takes: that is no wedged loop).
    shared.liveness.idle_for(Duration::MAX);
    while !*seen_rx.borrow_and_update() {
        tokio::select! {
            _ = seen_rx.changed() => {}
            _ = shutdown.changed() => break,
        }
    }

    let mut models = CostModels::default();
    let mut looper = ResizeLoop {
        kernel,
        config,
        shared: Arc::clone(&shared),
        events: events_tx,
    };
    while !*shutdown.borrow() {
        shared.liveness.beat();
        let object = spec_rx.borrow_and_update().clone();
        let _ = object_tx.send(object.clone());
        let next_check = looper
            .converge(object.as_ref(), &mut spec_rx, &mut shutdown, &mut models)
            .await;
        if *shutdown.borrow() {
            break;
        }
        shared.liveness.idle_for(next_check);
        tokio::select! {
            _ = spec_rx.changed() => {}
            _ = shutdown.changed() => {}
            _ = tokio::time::sleep(next_check) => {}
        }
    }
    info!("shutting down: writing a last status");
    shared.touch(true);
    let _ = done_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    Ok(())
}

struct ResizeLoop {
    kernel: Arc<dyn Kernel>,
    config: AgentConfig,
    shared: Arc<Shared>,
    events: EventSender,
}

/// The engine's settings from one target entry; bad values (which the
/// schema should have stopped) fall back to the defaults.
pub fn settings_for(entry: &PageSizeTarget) -> Settings {
    let defaults = Settings::default();
    Settings {
        max_step_duration: duration::parse(&entry.resize.max_step_duration)
            .unwrap_or(defaults.max_step_duration),
        step_pause: duration::parse(&entry.resize.step_pause).unwrap_or(defaults.step_pause),
        stall_threshold: duration::parse(&entry.resize.stall_threshold)
            .unwrap_or(defaults.stall_threshold),
        min_mem_available: quantity::parse_bytes(&entry.allocation.min_mem_available)
            .unwrap_or(defaults.min_mem_available),
        retries: entry.allocation.retries.max(0) as u32,
        compact: entry.allocation.compact,
        ..defaults
    }
}

/// The engine targets of one entry: one per NUMA node when the entry lists
/// them, otherwise one write of the size's global file.
pub fn targets_for(entry: &PageSizeTarget, size: PageSize) -> Vec<Target> {
    match &entry.numa {
        Some(numa) => numa
            .iter()
            .map(|n| Target {
                size,
                pages: n.pages.max(0) as u64,
                scope: PoolScope::Node(n.id.max(0) as u32),
            })
            .collect(),
        None => vec![Target {
            size,
            pages: entry.pages.max(0) as u64,
            scope: PoolScope::Global,
        }],
    }
}

fn find_target(object: Option<&HugePageNode>, size: PageSize, scope: PoolScope) -> Option<Target> {
    let entry = object?
        .spec
        .page_sizes
        .iter()
        .find(|e| e.size.parse::<PageSize>().ok() == Some(size))?;
    targets_for(entry, size)
        .into_iter()
        .find(|t| t.scope == scope)
}

impl ResizeLoop {
    /// One pass over every target; returns when to look again.
    async fn converge(
        &mut self,
        object: Option<&HugePageNode>,
        spec_rx: &mut watch::Receiver<Option<HugePageNode>>,
        shutdown: &mut watch::Receiver<bool>,
        models: &mut CostModels,
    ) -> Duration {
        let entries = object
            .map(|o| o.spec.page_sizes.clone())
            .unwrap_or_default();
        {
            let mut memory = self.shared.memory();
            memory.generation = object.and_then(|o| o.metadata.generation);
            memory.targets = entries.clone();
        }
        self.shared.touch(true);
        let offered = match self.blocking(|k| k.page_sizes()).await {
            Ok(sizes) => sizes,
            Err(err) => {
                warn!(error = %err, "cannot read the kernel's page sizes");
                return self.config.blocked_poll;
            }
        };
        let numa_nodes = match self.blocking(|k| k.numa_nodes()).await {
            Ok(nodes) => nodes,
            Err(err) => {
                warn!(error = %err, "cannot list the NUMA nodes");
                return self.config.blocked_poll;
            }
        };
        let mut next_check = self.config.refresh_interval;
        for entry in &entries {
            let Ok(size) = entry.size.parse::<PageSize>() else {
                continue;
            };
            if !offered.contains(&size) {
                continue; // reported as UnsupportedPageSize by the status
            }
            let targets = targets_for(entry, size);
            if targets
                .iter()
                .any(|t| matches!(t.scope, PoolScope::Node(n) if !numa_nodes.contains(&n)))
            {
                continue; // reported as InvalidTarget by the status
            }
            for target in targets {
                if *shutdown.borrow() || spec_rx.has_changed().unwrap_or(false) {
                    return Duration::ZERO;
                }
                let observed = match resize::executor::observe(&self.kernel, target).await {
                    Ok(observed) => observed,
                    Err(err) => {
                        warn!(error = %err, %size, scope = %target.scope, "cannot read the pool");
                        next_check = next_check.min(self.config.blocked_poll);
                        continue;
                    }
                };
                if observed.persistent() == target.pages && observed.surplus() == 0 {
                    continue;
                }
                let last = self
                    .shared
                    .memory()
                    .sizes
                    .get(&size)
                    .and_then(|r| r.outcomes.get(&target.scope).cloned());
                // Reached earlier, moved since without a write of ours:
                // someone else writes this pool (tuned, sysctl.d, a second
                // tool). Say so, and restore it only after a backoff that
                // grows while they keep writing, instead of fighting them.
                if matches!(&last, Some((t, Outcome::Reached)) if *t == target.pages) {
                    let wait = self.other_writer(size, target, observed.persistent());
                    if !wait.is_zero() {
                        next_check = next_check.min(wait);
                        continue;
                    }
                }
                let still_blocked = matches!(&last, Some((t, Outcome::Blocked { .. })) if *t == target.pages)
                    && observed.shrink_floor() >= observed.persistent();
                let recently_short =
                    matches!(&last, Some((t, Outcome::Shortfall { .. })) if *t == target.pages);
                if still_blocked {
                    next_check = next_check.min(self.config.blocked_poll);
                    continue;
                }
                if recently_short && !self.retry_due(size) {
                    next_check = next_check.min(self.config.retry_interval);
                    continue;
                }
                let outcome = self.resize(entry, target, spec_rx, shutdown, models).await;
                match outcome {
                    Some(Outcome::Blocked { .. }) => {
                        next_check = next_check.min(self.config.blocked_poll)
                    }
                    Some(Outcome::Shortfall { .. }) => {
                        next_check = next_check.min(self.config.retry_interval)
                    }
                    Some(Outcome::Reached) => {}
                    None => next_check = next_check.min(self.config.blocked_poll),
                }
            }
        }
        if !*shutdown.borrow() {
            self.maybe_restart_kubelet(&entries).await;
        }
        next_check
    }

    /// Records that another writer moved `target`'s pool to `found`, and
    /// returns how long to leave it before restoring (zero: restore now).
    fn other_writer(&self, size: PageSize, target: Target, found: u64) -> Duration {
        let now = Instant::now();
        let mut memory = self.shared.memory();
        let record = memory.sizes.entry(size).or_default();
        let writer = record.other_writer.get_or_insert(status::OtherWriter {
            scope: target.scope,
            target: target.pages,
            found,
            times: 0,
            restore_at: now,
            restored: true,
        });
        if writer.target != target.pages || writer.scope != target.scope {
            writer.target = target.pages;
            writer.scope = target.scope;
            writer.times = 0;
            writer.restored = true;
        }
        if !writer.restored {
            // The move already counted: wait out its backoff, then restore.
            let wait = writer.restore_at.saturating_duration_since(now);
            if wait.is_zero() {
                writer.restored = true;
            }
            return wait;
        }
        // A new move: the first, or one after our last restore.
        writer.times += 1;
        writer.found = found;
        writer.restored = false;
        let wait = other_writer_backoff(writer.times);
        writer.restore_at = now + wait;
        let (times, scope) = (writer.times, writer.scope);
        drop(memory);
        self.shared
            .metrics
            .foreign_writes
            .get_or_create(&SizeLabels {
                size: size.to_string(),
            })
            .inc();
        warn!(%size, %scope, found, target = target.pages, times, restore_in = ?wait,
            "another writer changed the pool; restoring it after a backoff");
        self.event(
            EventType::Warning,
            "OtherWriter",
            format!(
                "{size} {scope}: another writer set the pool to {found} (target {}); \
                 {times} times so far, restoring in {wait:?}",
                target.pages
            ),
        );
        self.shared.touch(true);
        wait
    }

    fn retry_due(&self, size: PageSize) -> bool {
        let memory = self.shared.memory();
        let finished = memory
            .sizes
            .get(&size)
            .and_then(|r| r.last_resize.as_ref())
            .and_then(|s| s.finished_at.clone());
        match finished {
            Some(at) => {
                let age = jiff::Timestamp::now().duration_since(at.0);
                age.as_secs_f64() >= self.config.retry_interval.as_secs_f64()
            }
            None => true,
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        read: impl FnOnce(&dyn Kernel) -> crate::Result<T> + Send + 'static,
    ) -> crate::Result<T> {
        let kernel = Arc::clone(&self.kernel);
        tokio::task::spawn_blocking(move || read(kernel.as_ref()))
            .await
            .map_err(|err| crate::Error::WriteThread(err.to_string()))?
    }

    /// Runs one resize to `target`, following spec changes at step boundaries.
    async fn resize(
        &mut self,
        entry: &PageSizeTarget,
        target: Target,
        spec_rx: &mut watch::Receiver<Option<HugePageNode>>,
        shutdown: &mut watch::Receiver<bool>,
        models: &mut CostModels,
    ) -> Option<Outcome> {
        let size = target.size;
        let size_label = size.to_string();
        let from = resize::executor::observe(&self.kernel, target)
            .await
            .map(|o| o.persistent())
            .unwrap_or(0);
        let direction = if target.pages >= from {
            Direction::Grow
        } else {
            Direction::Shrink
        };
        {
            let mut memory = self.shared.memory();
            let record = memory.sizes.entry(size).or_default();
            record.running = Some(Running {
                direction,
                from,
                target: target.pages,
            });
            record.stall = None;
        }
        self.shared.touch(true);
        self.event(
            EventType::Normal,
            "ResizeStarted",
            format!("{size} {}: {from} -> {} pages", target.scope, target.pages),
        );

        let span = info_span!("resize", node = %self.config.node_name, size = %size_label, scope = %target.scope, from, target = target.pages, direction = direction.as_str());
        let (target_tx, mut target_rx) = watch::channel(target);
        let stopping = Arc::new(AtomicBool::new(false));
        let options = resize::Options::default();
        let settings = settings_for(entry);
        let stall_threshold = settings.stall_threshold;
        let on_event = {
            let shared = Arc::clone(&self.shared);
            let events = self.events.clone();
            let target_tx = target_tx.clone();
            let stopping = Arc::clone(&stopping);
            let size_label = size_label.clone();
            move |event: &Event| {
                on_resize_event(
                    event,
                    &shared,
                    &events,
                    &target_tx,
                    &stopping,
                    size,
                    &size_label,
                    stall_threshold,
                )
            }
        };
        let engine = resize::run(
            Arc::clone(&self.kernel),
            &mut target_rx,
            settings,
            &options,
            models,
            on_event,
        )
        .instrument(span.clone());
        tokio::pin!(engine);
        let result = loop {
            tokio::select! {
                result = &mut engine => break result,
                changed = spec_rx.changed(), if !stopping.load(Ordering::Relaxed) => {
                    let object = if changed.is_ok() { spec_rx.borrow().clone() } else { None };
                    match find_target(object.as_ref(), size, target.scope) {
                        Some(new_target) => {
                            let mut memory = self.shared.memory();
                            memory.generation = object.as_ref().and_then(|o| o.metadata.generation);
                            memory.targets = object.as_ref().map(|o| o.spec.page_sizes.clone()).unwrap_or_default();
                            if let Some(running) = memory.sizes.get_mut(&size).and_then(|r| r.running.as_mut()) {
                                running.target = new_target.pages;
                            }
                            drop(memory);
                            span.in_scope(|| info!(new_target = new_target.pages, "target changed mid-resize"));
                            let _ = target_tx.send(new_target);
                        }
                        None => {
                            // The entry is gone: stop after the write in flight.
                            span.in_scope(|| info!("target removed mid-resize; stopping at the next step boundary"));
                            stopping.store(true, Ordering::Relaxed);
                        }
                    }
                }
                _ = shutdown.changed(), if !stopping.load(Ordering::Relaxed) => {
                    span.in_scope(|| info!("shutdown requested; stopping at the next step boundary"));
                    stopping.store(true, Ordering::Relaxed);
                }
            }
        };
        let outcome = match result {
            Ok(summary) => {
                self.record_summary(&summary, target.scope, &span);
                Some(summary.outcome)
            }
            Err(err) => {
                span.in_scope(|| warn!(error = %err, "resize failed"));
                self.event(
                    EventType::Warning,
                    "ResizeFailed",
                    format!("{size} {}: {err}", target.scope),
                );
                let mut memory = self.shared.memory();
                if let Some(record) = memory.sizes.get_mut(&size) {
                    record.running = None;
                }
                None
            }
        };
        self.shared.touch(true);
        outcome
    }

    fn record_summary(&self, summary: &Summary, scope: PoolScope, span: &tracing::Span) {
        let size: Option<PageSize> = summary.page_size.parse().ok();
        let outcome_name = match &summary.outcome {
            Outcome::Reached => "Reached",
            Outcome::Blocked { .. } => "Blocked",
            Outcome::Shortfall { .. } => "Short",
        };
        span.in_scope(|| {
            info!(
                achieved = summary.achieved,
                to = summary.to,
                steps = summary.steps,
                max_write_seconds = summary.max_write_seconds,
                duration_seconds = summary.duration_seconds,
                outcome = outcome_name,
                "resize finished"
            )
        });
        let api_summary = ResizeSummary {
            from: summary.from as i64,
            to: summary.to as i64,
            achieved: summary.achieved as i64,
            steps: i64::from(summary.steps),
            max_step_seconds: summary.max_write_seconds,
            duration_seconds: summary.duration_seconds,
            pages_per_second: summary.pages_per_second,
            outcome: outcome_name.to_string(),
            finished_at: Some(Time(jiff::Timestamp::now())),
        };
        let note = format!(
            "{} {}: {} -> {} pages (target {}) in {} steps, {:.3}s, max write {:.3}s",
            summary.page_size,
            summary.scope,
            summary.from,
            summary.achieved,
            summary.to,
            summary.steps,
            summary.duration_seconds,
            summary.max_write_seconds
        );
        let previous = size.and_then(|s| {
            self.shared
                .memory()
                .sizes
                .get(&s)
                .and_then(|r| r.outcomes.get(&scope).cloned())
        });
        let repeated = previous.as_ref().is_some_and(|(t, o)| {
            *t == summary.to
                && std::mem::discriminant(o) == std::mem::discriminant(&summary.outcome)
        });
        match &summary.outcome {
            Outcome::Reached => self.event(EventType::Normal, "ResizeFinished", note),
            Outcome::Blocked { in_use, reserved, .. } if !repeated => self.event(
                EventType::Warning,
                "ShrinkBlocked",
                format!("{note}; {in_use} pages in use and {reserved} reserved keep the pool above target"),
            ),
            Outcome::Shortfall { requested, achieved, reason, .. } if !repeated => self.event(
                EventType::Warning,
                "AllocationShort",
                format!("{note}; requested {requested}, achieved {achieved} ({reason:?})"),
            ),
            _ => {}
        }
        if let Some(size) = size {
            let shortfall = match &summary.outcome {
                Outcome::Shortfall {
                    requested,
                    achieved,
                    ..
                } => requested.saturating_sub(*achieved),
                _ => 0,
            };
            self.shared
                .metrics
                .shortfall_pages
                .get_or_create(&SizeLabels {
                    size: size.to_string(),
                })
                .set(shortfall as i64);
            let mut memory = self.shared.memory();
            let record = memory.sizes.entry(size).or_default();
            record.running = None;
            record
                .outcomes
                .insert(scope, (summary.to, summary.outcome.clone()));
            record.last_resize = Some(api_summary);
        }
    }

    fn event(&self, type_: EventType, reason: &'static str, note: String) {
        queue_event(
            &self.events,
            &self.shared.metrics,
            PendingEvent {
                type_,
                reason,
                note,
            },
        );
    }

    /// With `kubeletRestart: AfterResize`, restarts kubelet once the node has
    /// converged and kubelet's capacity is stale, at most once per change.
    async fn maybe_restart_kubelet(&self, entries: &[PageSizeTarget]) {
        use hugepool_crds::settings::KubeletRestart;
        if self.config.kubelet_restart_command.is_empty()
            || !entries
                .iter()
                .any(|e| e.kubelet_restart == KubeletRestart::AfterResize)
        {
            return;
        }
        let snapshot =
            match KernelSnapshot::read_blocking(&self.kernel, &self.config.kernel_release).await {
                Ok(snapshot) => snapshot,
                Err(_) => return,
            };
        let (pools, due) = {
            let memory = self.shared.memory();
            let converged = memory
                .targets
                .iter()
                .all(|e| status::progress(e, &snapshot) == status::Progress::AtTarget);
            let pools = status::kubelet_pools(&snapshot, &memory);
            let stale = memory.kubelet.capacity.as_ref().is_some_and(|capacity| {
                pools.iter().any(|(size, pages)| {
                    capacity.get(size).copied().unwrap_or(0) != pages * size.bytes()
                })
            });
            let already = memory.kubelet.restarted_for.as_ref() == Some(&pools);
            let waiting = memory
                .kubelet
                .failure
                .as_ref()
                .is_some_and(|f| f.pools == pools && Instant::now() < f.retry_at);
            (pools, converged && stale && !already && !waiting)
        };
        if !due {
            return;
        }
        let command = self.config.kubelet_restart_command.clone();
        info!(
            ?command,
            "restarting kubelet so it reports the new hugepage capacity"
        );
        let result = run_bounded(&command, self.config.kubelet_restart_timeout).await;
        {
            let mut memory = self.shared.memory();
            match &result {
                Ok(()) => {
                    memory.kubelet.restarted_for = Some(pools);
                    memory.kubelet.failure = None;
                }
                Err(message) => {
                    let attempts = memory
                        .kubelet
                        .failure
                        .as_ref()
                        .filter(|f| f.pools == pools)
                        .map_or(1, |f| f.attempts + 1);
                    let backoff = restart_backoff(attempts);
                    memory.kubelet.failure = Some(status::RestartFailure {
                        pools,
                        attempts,
                        message: format!("{message} (attempt {attempts}, next in {backoff:?})"),
                        retry_at: Instant::now() + backoff,
                    });
                }
            }
        }
        match result {
            Ok(()) => self.event(
                EventType::Normal,
                "KubeletRestarted",
                format!("ran {}", command.join(" ")),
            ),
            Err(message) => {
                warn!(%message, "kubelet restart failed");
                self.event(EventType::Warning, "KubeletRestartFailed", message);
            }
        }
        self.shared.touch(true);
    }
}

/// Runs `command` to its end or kills it (and everything it started) after
/// `timeout`; the error says which happened, with the end of its stderr.
async fn run_bounded(command: &[String], timeout: Duration) -> Result<(), String> {
    let shown = command.join(" ");
    let child = tokio::process::Command::new(&command[0])
        .args(&command[1..])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("{shown}: {err}"))?;
    let group = child.id().and_then(|id| i32::try_from(id).ok());
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => {
            if let Some(group) = group {
                // SAFETY: signals only the process group this call created.
                unsafe { libc::killpg(group, libc::SIGKILL) };
            }
            Err(format!(
                "{shown} did not finish within {timeout:?} and was killed"
            ))
        }
        Ok(Err(err)) => Err(format!("{shown}: {err}")),
        Ok(Ok(output)) if output.status.success() => Ok(()),
        Ok(Ok(output)) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let stderr = stderr.trim();
            let start = stderr.char_indices().rev().nth(299).map_or(0, |(i, _)| i);
            Err(format!(
                "{shown} exited with {}: {}",
                output.status,
                &stderr[start..]
            ))
        }
    }
}

/// How long a pool another writer moved is left before it is restored: 10 s
/// the first time, doubling while they keep writing, at most 30 min.
pub(crate) fn other_writer_backoff(times: u32) -> Duration {
    Duration::from_secs(10)
        .saturating_mul(1 << times.saturating_sub(1).min(8))
        .min(Duration::from_secs(1800))
}

/// The longest wait between retries of a status write or a kernel read.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A random wait in `[backoff / 2, backoff]` ("equal jitter").
fn jittered(backoff: Duration) -> Duration {
    let half = backoff / 2;
    half + half.mul_f64(fastrand::f64())
}

/// Wait before retrying a failed kubelet restart: 10 s doubling to 10 min.
fn restart_backoff(attempts: u32) -> Duration {
    let base = Duration::from_secs(10);
    base.saturating_mul(1 << attempts.saturating_sub(1).min(6))
        .min(Duration::from_secs(600))
}

#[allow(clippy::too_many_arguments)]
fn on_resize_event(
    event: &Event,
    shared: &Shared,
    events: &EventSender,
    target_tx: &watch::Sender<Target>,
    stopping: &AtomicBool,
    size: PageSize,
    size_label: &str,
    stall_threshold: Duration,
) {
    match event {
        Event::Step(step) => {
            shared.liveness.beat();
            let labels = StepLabels {
                size: size_label.to_string(),
                direction: step.direction.as_str().to_string(),
            };
            shared
                .metrics
                .step_seconds
                .get_or_create(&labels)
                .observe(step.latency.as_secs_f64());
            shared
                .metrics
                .pages_moved
                .get_or_create(&labels)
                .inc_by(step.after.abs_diff(step.before));
            debug!(
                step = step.step,
                written = step.written,
                after = step.after,
                latency_ms = step.latency.as_secs_f64() * 1e3,
                "step"
            );
            if stopping.load(Ordering::Relaxed) {
                // Make the pool as it is now the target: the engine finishes here.
                target_tx.send_modify(|t| t.pages = step.after);
            }
            shared.touch(false);
        }
        Event::Stall {
            step,
            direction,
            pages,
            elapsed,
        } => {
            shared
                .metrics
                .stalls
                .get_or_create(&StallLabels {
                    reason: "SlowKernelWrite".into(),
                })
                .inc();
            let message = format!(
                "{size_label} {} write {step} of {pages} pages has taken {:.2}s (stall threshold {})",
                direction.as_str(),
                elapsed.as_secs_f64(),
                duration::format(stall_threshold)
            );
            warn!(%message, "slow kernel write");
            shared.memory().sizes.entry(size).or_default().stall = Some(StallRecord {
                reason: Reason::SlowKernelWrite,
                message: message.clone(),
            });
            queue_event(
                events,
                &shared.metrics,
                PendingEvent {
                    type_: EventType::Warning,
                    reason: "Stalled",
                    note: message,
                },
            );
            shared.touch(true);
        }
        Event::WriteFailed { step, error } => warn!(step, %error, "kernel write failed"),
        Event::Compacted { scope, error } => {
            info!(%scope, ?error, "compacted memory before retrying")
        }
        Event::Blocked(outcome) => debug!(?outcome, "waiting for pages in use"),
        Event::Retargeted(target) => info!(pages = target.pages, "retargeted at a step boundary"),
    }
}

/// Follows this node's HugePageNode; `None` when it does not exist.
async fn watch_own_node_spec(
    api: Api<HugePageNode>,
    name: String,
    spec_tx: watch::Sender<Option<HugePageNode>>,
    seen_tx: watch::Sender<bool>,
    shared: Arc<Shared>,
) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut listed: Option<HugePageNode> = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => listed = None,
            Ok(watcher::Event::InitApply(object)) => listed = Some(object),
            Ok(watcher::Event::InitDone) => {
                if listed.is_none() {
                    // Nothing to converge or report: ready as it is.
                    shared.ready.store(true, Ordering::Relaxed);
                }
                publish_spec(&spec_tx, listed.take());
                let _ = seen_tx.send(true);
            }
            Ok(watcher::Event::Apply(object)) => publish_spec(&spec_tx, Some(object)),
            Ok(watcher::Event::Delete(_)) => publish_spec(&spec_tx, None),
            Err(err) => {
                warn!(error = %err, "watch of the HugePageNode failed; retrying with backoff")
            }
        }
    }
}

/// Sends only when the spec (or existence) changed, so status-only updates
/// do not wake the resize loop.
fn publish_spec(spec_tx: &watch::Sender<Option<HugePageNode>>, object: Option<HugePageNode>) {
    spec_tx.send_if_modified(|current| {
        let same = match (current.as_ref(), object.as_ref()) {
            (Some(a), Some(b)) => {
                a.spec == b.spec
                    && a.metadata.generation == b.metadata.generation
                    && a.metadata.uid == b.metadata.uid
            }
            (None, None) => true,
            _ => false,
        };
        if !same {
            *current = object;
        }
        !same
    });
}

/// Follows this node's `hugepages-<size>` capacity, as kubelet reports it.
async fn watch_kubelet_capacity(api: Api<Node>, name: String, shared: Arc<Shared>) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(node) => {
                let capacity = node_capacity(&node);
                let mut memory = shared.memory();
                if memory.kubelet.capacity.as_ref() != Some(&capacity) {
                    memory.kubelet.capacity = Some(capacity);
                    drop(memory);
                    shared.touch(true);
                }
            }
            Err(err) => warn!(error = %err, "watch of the Node failed; retrying with backoff"),
        }
    }
}

/// `hugepages-<size>` capacities of a Node, in bytes.
pub fn node_capacity(node: &Node) -> BTreeMap<PageSize, u64> {
    let Some(capacity) = node.status.as_ref().and_then(|s| s.capacity.as_ref()) else {
        return BTreeMap::new();
    };
    capacity
        .iter()
        .filter_map(|(name, quantity)| {
            let size: PageSize = name.strip_prefix("hugepages-")?.parse().ok()?;
            Some((size, quantity::parse_bytes(&quantity.0).ok()?))
        })
        .collect()
}

/// Publishes Events on the HugePageNode, once it is known.
async fn publish_events(
    client: Client,
    node_name: String,
    mut events_rx: mpsc::Receiver<PendingEvent>,
    object_rx: watch::Receiver<Option<HugePageNode>>,
) {
    let reporter = Reporter {
        controller: "hugepool-agent".into(),
        instance: Some(node_name),
    };
    let recorder = Recorder::new(client, reporter);
    while let Some(pending) = events_rx.recv().await {
        let Some(object) = object_rx.borrow().clone() else {
            continue;
        };
        let reference = object.object_ref(&());
        let event = KubeEvent {
            type_: pending.type_,
            reason: pending.reason.into(),
            note: Some(pending.note),
            action: "Resize".into(),
            secondary: None,
        };
        if let Err(err) = recorder.publish(&event, &reference).await {
            debug!(error = %err, "could not publish an event");
        }
    }
}

/// How often syslog(2) is read when `/dev/kmsg` cannot be opened.
const KERNEL_LOG_POLL: Duration = Duration::from_secs(1);

/// Reads `/dev/kmsg` (or polls syslog(2)) on its own thread; stalls the kernel reports while a
/// resize runs set Stalled with the kernel's line.
fn watch_kernel_log(path: PathBuf, shared: Arc<Shared>, events: EventSender) {
    let set_state = |shared: &Shared, state: KernelLogState| {
        let watching = matches!(state, KernelLogState::Watching(_));
        shared.metrics.kernel_log_watching.set(i64::from(watching));
        shared.memory().kernel_log = state;
        shared.touch(!watching);
    };
    let thread_shared = Arc::clone(&shared);
    let spawned = std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || {
            let shared = thread_shared;
            let on_record = |record: KernelLogEvent| {
                let reason = Reason::parse(record.kind.as_str()).unwrap_or(Reason::SoftLockup);
                shared
                    .metrics
                    .stalls
                    .get_or_create(&StallLabels {
                        reason: reason.as_str().into(),
                    })
                    .inc();
                let mut memory = shared.memory();
                let running: Vec<PageSize> = memory
                    .sizes
                    .iter()
                    .filter(|(_, r)| r.running.is_some())
                    .map(|(s, _)| *s)
                    .collect();
                for size in &running {
                    if let Some(record_of_size) = memory.sizes.get_mut(size) {
                        record_of_size.stall = Some(StallRecord {
                            reason,
                            message: format!("kernel: {}", record.message),
                        });
                    }
                }
                drop(memory);
                if running.is_empty() {
                    info!(kernel = %record.message, "kernel reported a stall while no resize ran");
                } else {
                    warn!(kernel = %record.message, "kernel reported a stall during a resize");
                    queue_event(
                        &events,
                        &shared.metrics,
                        PendingEvent {
                            type_: EventType::Warning,
                            reason: "KernelStall",
                            note: record.message.clone(),
                        },
                    );
                    shared.touch(true);
                }
                true
            };
            // A container runtime's device cgroup refuses opening /dev/kmsg
            // even with CAP_SYSLOG; syslog(2) needs only the capability.
            let result = match std::fs::File::open(&path) {
                Ok(_) => {
                    set_state(
                        &shared,
                        KernelLogState::Watching(path.display().to_string()),
                    );
                    crate::kmsg::watch(&path, true, on_record).map_err(|err| err.to_string())
                }
                Err(open_error) => {
                    let refused = format!("cannot open {}: {open_error}", path.display());
                    info!(%refused, "reading the kernel log through syslog(2) instead");
                    set_state(
                        &shared,
                        KernelLogState::Watching(format!("syslog(2) ({refused})")),
                    );
                    crate::kmsg::watch_syslog(KERNEL_LOG_POLL, on_record)
                        .map_err(|err| format!("{refused}; {err}"))
                }
            };
            let error = match result {
                Err(error) => error,
                Ok(()) => format!("{} ended", path.display()),
            };
            warn!(%error, "kernel log watcher stopped");
            set_state(&shared, KernelLogState::Unavailable(error));
        });
    if let Err(err) = spawned {
        warn!(error = %err, "cannot start the kernel log watcher");
        set_state(
            &shared,
            KernelLogState::Unavailable(format!("no watcher thread: {err}")),
        );
    }
}

/// The part of a status whose change is worth a patch: everything but the
/// ever-moving MemAvailable.
fn significant(status: &HugePageNodeStatus) -> HugePageNodeStatus {
    HugePageNodeStatus {
        memory: None,
        ..status.clone()
    }
}

/// Builds and writes the status whenever something changed (at most once
/// per `min_patch_interval` unless urgent), and re-reads the kernel every
/// `refresh_interval`. Failed writes are retried with backoff; meanwhile
/// the resize loop goes on.
async fn write_status(
    api: Api<HugePageNode>,
    kernel: Arc<dyn Kernel>,
    config: AgentConfig,
    shared: Arc<Shared>,
    mut done: watch::Receiver<bool>,
) {
    let mut conditions: Vec<Condition> = Vec::new();
    let mut last_sent: Option<HugePageNodeStatus> = None;
    let mut last_patch = Instant::now() - config.min_patch_interval;
    let mut backoff = Duration::from_millis(250);
    let mut kernel_backoff = Duration::from_millis(250);
    let mut retry = false;
    loop {
        let stopping = *done.borrow();
        if !stopping && !retry {
            tokio::select! {
                _ = shared.changed.notified() => {}
                _ = tokio::time::sleep(config.refresh_interval) => {}
                _ = done.changed() => {}
            }
        }
        let urgent = shared.urgent.swap(false, Ordering::Relaxed) || *done.borrow();
        let since = last_patch.elapsed();
        if !urgent && since < config.min_patch_interval {
            tokio::time::sleep(config.min_patch_interval - since).await;
        }
        let snapshot = match KernelSnapshot::read_blocking(&kernel, &config.kernel_release).await {
            Ok(snapshot) => {
                kernel_backoff = Duration::from_millis(250);
                snapshot
            }
            Err(err) => {
                warn!(error = %err, retry_in_ms = kernel_backoff.as_millis() as u64, "cannot read the kernel for status");
                tokio::time::sleep(kernel_backoff).await;
                kernel_backoff = (kernel_backoff * 2).min(MAX_BACKOFF);
                if *done.borrow() {
                    return;
                }
                continue;
            }
        };
        let memory = shared.memory().clone();
        update_gauges(&shared.metrics, &snapshot, &memory);
        let now = Time(jiff::Timestamp::now());
        let status = status::build(&snapshot, &memory, &mut conditions, &now);
        let has_object = memory.generation.is_some();
        let changed = last_sent.as_ref().map(significant) != Some(significant(&status));
        if has_object && changed {
            let body = serde_json::json!({
                "apiVersion": "hugepool.dev/v1alpha1",
                "kind": "HugePageNode",
                "status": status,
            });
            let params = PatchParams::apply(AGENT_MANAGER).force();
            match api
                .patch_status(&config.node_name, &params, &Patch::Apply(&body))
                .await
            {
                Ok(_) => {
                    last_sent = Some(status);
                    last_patch = Instant::now();
                    backoff = Duration::from_millis(250);
                    retry = false;
                    shared.patches.fetch_add(1, Ordering::Relaxed);
                    shared.ready.store(true, Ordering::Relaxed);
                }
                Err(err) => {
                    // Jittered, so that a fleet of agents does not retry in
                    // step after an API outage.
                    let wait = jittered(backoff);
                    warn!(error = ?err, retry_in_ms = wait.as_millis() as u64, "status write failed");
                    tokio::time::sleep(wait).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    retry = true;
                    if *done.borrow() && backoff >= Duration::from_secs(2) {
                        return;
                    }
                    continue;
                }
            }
        }
        if *done.borrow() {
            return;
        }
    }
}

fn update_gauges(metrics: &Metrics, snapshot: &KernelSnapshot, memory: &AgentMemory) {
    metrics
        .mem_available_bytes
        .set(snapshot.memory.available_bytes as i64);
    for sizes in &snapshot.sizes {
        let size = sizes.size.to_string();
        let pool = sizes.pool;
        metrics.set_pages(&size, "all", PageState::total, pool.total);
        metrics.set_pages(&size, "all", PageState::free, pool.free);
        metrics.set_pages(&size, "all", PageState::reserved, pool.reserved);
        metrics.set_pages(&size, "all", PageState::surplus, pool.surplus);
        for numa in &sizes.numa {
            let id = numa.node.to_string();
            metrics.set_pages(&size, &id, PageState::total, numa.total);
            metrics.set_pages(&size, &id, PageState::free, numa.free);
            metrics.set_pages(&size, &id, PageState::surplus, numa.surplus);
        }
        if let Some(entry) = memory
            .targets
            .iter()
            .find(|e| e.size.parse::<PageSize>().ok() == Some(sizes.size))
        {
            metrics.set_pages(&size, "all", PageState::target, entry.pages.max(0) as u64);
            for numa in entry.numa.iter().flatten() {
                metrics.set_pages(
                    &size,
                    &numa.id.to_string(),
                    PageState::target,
                    numa.pages.max(0) as u64,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{SimConfig, SimulatedKernel};
    use http::{Request, Response};
    use kube::client::Body;
    use prometheus_client::registry::Registry;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn entry(pages: i64) -> PageSizeTarget {
        PageSizeTarget {
            size: "2Mi".into(),
            pages,
            numa: None,
            pool: "p".into(),
            pool_generation: 1,
            resize: Default::default(),
            allocation: Default::default(),
            kubelet_restart: Default::default(),
        }
    }

    /// Answers the next request, which must be the agent's status apply, and
    /// returns its decoded body.
    async fn expect_status_apply(handle: &mut Handle) -> serde_json::Value {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
            .await
            .expect("a status patch within 5s")
            .expect("the service is alive");
        assert_eq!(request.method(), http::Method::PATCH);
        assert_eq!(
            request.uri().path(),
            "/apis/hugepool.dev/v1alpha1/hugepagenodes/n1/status"
        );
        let query = request.uri().query().unwrap_or_default();
        assert!(
            query.contains("fieldManager=hugepool-agent") && query.contains("force=true"),
            "{query}"
        );
        assert_eq!(
            request.headers()["content-type"],
            "application/apply-patch+yaml"
        );
        let bytes = request.into_body().collect_bytes().await.expect("body");
        let body: serde_json::Value = serde_json::from_slice(&bytes).expect("json body");
        let mut object = serde_json::json!({"apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePageNode", "metadata": {"name": "n1"}, "spec": {}});
        object["status"] = body["status"].clone();
        send.send_response(
            Response::builder()
                .body(Body::from(serde_json::to_vec(&object).unwrap()))
                .unwrap(),
        );
        body
    }

    /// Waits (up to 2 s) for the writer to have handled the last response.
    async fn eventually(what: &str, check: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while !check() {
            assert!(Instant::now() < deadline, "not within 2s: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn no_request_within(handle: &mut Handle, wait: Duration) {
        if let Ok(Some((request, _))) = tokio::time::timeout(wait, handle.next_request()).await {
            panic!("unexpected request {} {}", request.method(), request.uri());
        }
    }

    #[tokio::test]
    async fn status_writer_applies_once_per_change_and_skips_no_ops() {
        let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(mock, "default");
        let kernel = SimulatedKernel::new(SimConfig::single_node(8 << 30));
        kernel.set_time_scale(0.0);
        kernel
            .preset(PageSize::SIZE_2MI, PoolScope::Global, 64)
            .unwrap();
        let shared = Shared::new(Metrics::register(&mut Registry::default()));
        {
            let mut memory = shared.memory();
            memory.generation = Some(4);
            memory.targets = vec![entry(64)];
        }
        let mut config = AgentConfig::new("n1");
        config.min_patch_interval = Duration::from_millis(50);
        config.refresh_interval = Duration::from_millis(100);
        let (done_tx, done_rx) = watch::channel(false);
        let kernel_dyn: Arc<dyn Kernel> = Arc::new(kernel.clone());
        let writer = tokio::spawn(write_status(
            Api::all(client),
            kernel_dyn,
            config,
            Arc::clone(&shared),
            done_rx,
        ));
        shared.touch(true);

        let body = expect_status_apply(&mut handle).await;
        let status = &body["status"];
        assert_eq!(status["observedGeneration"], 4);
        assert_eq!(status["pageSizes"][0]["size"], "2Mi");
        assert_eq!(status["pageSizes"][0]["target"], 64);
        assert_eq!(status["pageSizes"][0]["total"], 64);
        let converged = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Converged")
            .unwrap();
        assert_eq!(
            (converged["status"].as_str(), converged["reason"].as_str()),
            (Some("True"), Some("AtTarget"))
        );
        assert!(
            status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["type"] != "Draining"),
            "Draining is the operator's"
        );
        eventually("ready after the first status", || {
            shared.ready.load(Ordering::Relaxed)
        })
        .await;

        // Nothing changed: several refreshes later, still no second request.
        shared.touch(true);
        no_request_within(&mut handle, Duration::from_millis(400)).await;

        // The kernel changed (pages taken by something else): one new apply,
        // Converged flips and its transition time moves.
        kernel
            .preset(PageSize::SIZE_2MI, PoolScope::Global, 32)
            .unwrap();
        let body = expect_status_apply(&mut handle).await;
        let converged = body["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Converged")
            .unwrap()
            .clone();
        assert_eq!(
            (converged["status"].as_str(), converged["reason"].as_str()),
            (Some("False"), Some("Resizing"))
        );
        assert!(
            converged["message"]
                .as_str()
                .unwrap()
                .contains("2Mi: 32/64 pages")
        );
        eventually("two patches", || {
            shared.patches.load(Ordering::Relaxed) == 2
        })
        .await;

        done_tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(2), writer)
            .await
            .expect("writer stops when done")
            .unwrap();
    }

    #[tokio::test]
    async fn failed_status_writes_are_retried_with_backoff() {
        let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(mock, "default");
        let kernel = SimulatedKernel::new(SimConfig::single_node(8 << 30));
        let shared = Shared::new(Metrics::register(&mut Registry::default()));
        shared.memory().generation = Some(1);
        let mut config = AgentConfig::new("n1");
        config.refresh_interval = Duration::from_secs(60);
        let (_done_tx, done_rx) = watch::channel(false);
        let kernel_dyn: Arc<dyn Kernel> = Arc::new(kernel);
        tokio::spawn(write_status(
            Api::all(client),
            kernel_dyn,
            config,
            Arc::clone(&shared),
            done_rx,
        ));
        shared.touch(true);
        // The API server answers 503 twice; the writer keeps the same status and tries again.
        for _ in 0..2 {
            let (_, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
                .await
                .unwrap()
                .unwrap();
            let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "unavailable", "reason": "ServiceUnavailable", "code": 503});
            send.send_response(
                Response::builder()
                    .status(503)
                    .body(Body::from(serde_json::to_vec(&status).unwrap()))
                    .unwrap(),
            );
        }
        assert!(!shared.ready.load(Ordering::Relaxed));
        expect_status_apply(&mut handle).await;
        eventually("one patch, then ready", || {
            shared.patches.load(Ordering::Relaxed) == 1 && shared.ready.load(Ordering::Relaxed)
        })
        .await;
    }

    #[tokio::test]
    async fn a_restart_command_is_bounded_and_its_failure_explained() {
        let sh = |script: &str| vec!["/bin/sh".to_string(), "-c".into(), script.into()];
        assert_eq!(
            run_bounded(&sh("exit 0"), Duration::from_secs(30)).await,
            Ok(())
        );
        let failed = run_bounded(
            &sh("echo 'unit kubelet not found' >&2; exit 5"),
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
        assert!(failed.contains("exit status: 5"), "{failed}");
        assert!(failed.contains("unit kubelet not found"), "{failed}");
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("child.pid");
        let hang = format!("sleep 60 & echo $! > {}; wait", pid_file.display());
        let hung = run_bounded(&sh(&hang), Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(hung.contains("did not finish within 500ms"), "{hung}");
        // What the command started goes with it.
        let child = std::fs::read_to_string(&pid_file).unwrap();
        let proc_dir = std::path::Path::new("/proc").join(child.trim());
        for _ in 0..100 {
            let zombie_or_gone = std::fs::read_to_string(proc_dir.join("stat"))
                .map_or(true, |stat| stat.contains(") Z "));
            if zombie_or_gone {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let stat = std::fs::read_to_string(proc_dir.join("stat")).unwrap_or_default();
        assert!(
            stat.is_empty() || stat.contains(") Z "),
            "sleep still runs: {stat}"
        );
        let missing = run_bounded(
            &["/nonexistent/systemctl".to_string()],
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        assert!(missing.contains("/nonexistent/systemctl"), "{missing}");
        assert_eq!(restart_backoff(1), Duration::from_secs(10));
        assert_eq!(restart_backoff(3), Duration::from_secs(40));
        assert_eq!(restart_backoff(30), Duration::from_secs(600));
    }

    #[test]
    fn retries_are_jittered_within_half_and_all_of_the_backoff() {
        let backoff = Duration::from_secs(8);
        let waits: Vec<Duration> = (0..200).map(|_| jittered(backoff)).collect();
        assert!(waits.iter().all(|w| *w >= backoff / 2 && *w <= backoff));
        let distinct: std::collections::BTreeSet<Duration> = waits.iter().copied().collect();
        assert!(
            distinct.len() > 100,
            "agents would retry in step: {distinct:?}"
        );
    }

    #[test]
    fn a_full_event_queue_drops_and_counts_instead_of_growing() {
        let metrics = Metrics::register(&mut Registry::default());
        let (events, mut receiver) = mpsc::channel(EVENT_QUEUE);
        let event = || PendingEvent {
            type_: EventType::Normal,
            reason: "ResizeStarted",
            note: String::new(),
        };
        for _ in 0..EVENT_QUEUE + 10 {
            queue_event(&events, &metrics, event());
        }
        assert_eq!(metrics.events_dropped.get(), 10);
        let mut queued = 0;
        while receiver.try_recv().is_ok() {
            queued += 1;
        }
        assert_eq!(queued, EVENT_QUEUE);
    }
}
