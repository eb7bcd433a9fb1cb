//! The cluster agent (`hugepool-agent run`): converges this node's
//! HugePageNode `.spec` with the resize engine and reports `.status`,
//! Events and metrics. What to do about each pool is decided in `decide.rs`
//! and what the status says in [`status`] (both pure); this module holds the configuration, the state the loops share
//! and the wiring (`run`).
//!
//! Loops run side by side, so that an unreachable API server never stops
//! the kernel work: the resize loop (`resize_loop.rs`, with the kubelet
//! restart in `kubelet.rs`), the status writer (`status_writer.rs`: reads
//! the kernel, builds the status, patches it with jittered backoff), the
//! watchers of the node's own HugePageNode, its Node and the kernel log
//! (`watchers.rs`), the watch of the pods bound to the node and the huge
//! pages they request (`pods.rs`), and the Event publisher (`events.rs`). `/healthz` is
//! the resize loop's heartbeat (`liveness.rs`).

mod decide;
mod events;
mod kubelet;
pub mod liveness;
pub mod metrics;
pub mod pods;
mod resize_loop;
pub mod server;
pub mod slice;
pub mod snapshot;
pub mod status;
mod status_writer;
mod watchers;
pub mod writer_lock;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hugepool_crds::node::{PageSizeTarget, ResizeSummary};
use hugepool_crds::{AGENT_MANAGER, HugePageNode, HugePageNodeStatus, PageSize, duration};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, watcher};
use kube::{Client, Resource};
use tokio::sync::{Notify, mpsc, watch};
use tracing::{Instrument, debug, info, info_span, warn};

use self::events::{EVENT_QUEUE, EventSender, PendingEvent, publish_events, queue_event};
use self::metrics::{Metrics, SizeLabels, StallLabels, StepLabels};
use self::resize_loop::ResizeLoop;
pub use self::resize_loop::other_writer_backoff;
use self::snapshot::KernelSnapshot;
use self::status::{AgentMemory, KernelLogState, Running, StallRecord};
use self::status_writer::write_status;
pub use self::watchers::node_capacity;
use self::watchers::{watch_kernel_log, watch_kubelet_capacity, watch_own_node_spec};
use crate::kernel::kmsg::KernelLogEvent;
use crate::kernel::{Kernel, PoolScope};
use crate::resize::{self, CostModels, Direction, Event, Goal, Outcome, Summary, Target};
pub use crate::resize::{settings_for, targets_for};
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
    /// Command that prints the kubelet's recent log; empty: none.
    pub kubelet_log_command: Vec<String>,
    /// How long that command may run.
    pub kubelet_restart_timeout: Duration,
    /// How long the kubelet has after the command to report the pools.
    pub kubelet_ready_timeout: Duration,
    /// The kubelet's root directory, for its Memory Manager checkpoint.
    pub kubelet_root_dir: Option<crate::kubelet_state::KubeletRootDir>,
    /// `/dev/kmsg`, or `None` to not watch the kernel log.
    pub kmsg_path: Option<PathBuf>,
    /// Where the fitted write-cost models are kept across restarts.
    pub model_file: Option<PathBuf>,
    /// Where the targets are kept each time the node converges, for
    /// `hugepool-agent boot` (crate::boot).
    pub boot_file: Option<PathBuf>,
    /// The cgroup file system whose pod cgroups' hugetlb limits say what
    /// the node's pods request (crate::pod_cgroups); `None`: not reported.
    pub pod_cgroups: Option<PathBuf>,
    /// How often the pod cgroups are read.
    pub pod_cgroups_interval: Duration,
    /// Publish the node's ResourceSlice (slice.rs).
    pub resource_slices: bool,
    /// Serve the kubelet plugin of the DRA driver there (crate::dra).
    pub kubelet_plugin: Option<crate::dra::PluginDirs>,
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
            kubelet_log_command: Vec::new(),
            kubelet_restart_timeout: Duration::from_secs(120),
            kubelet_ready_timeout: Duration::from_secs(120),
            kubelet_root_dir: None,
            kmsg_path: None,
            model_file: None,
            boot_file: None,
            pod_cgroups: None,
            pod_cgroups_interval: Duration::from_secs(5),
            resource_slices: false,
            kubelet_plugin: None,
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
    /// Statuses built and compared with the last one sent (written or
    /// found unchanged), for tests: a writer that would send blocks on the
    /// send before it counts the next.
    pub reports: AtomicU64,
    /// The resize loop's heartbeat, which `/healthz` reports.
    pub liveness: Arc<liveness::Liveness>,
    /// What the node's ResourceSlice should hold, as the status writer last
    /// read the kernel (slice.rs publishes it).
    slice: watch::Sender<slice::Desired>,
    /// Pages the kubelet plugin's prepared claims hold (dra.rs): shrinks
    /// leave them.
    pub claimed: watch::Sender<crate::dra::Claimed>,
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
            reports: AtomicU64::new(0),
            liveness: Arc::new(liveness::Liveness::new(timeout)),
            slice: watch::Sender::new(slice::Desired::Unknown),
            claimed: watch::Sender::new(crate::dra::Claimed::new()),
        })
    }

    fn memory(&self) -> MutexGuard<'_, AgentMemory> {
        // A panic elsewhere must not stop reporting: take the data as it is.
        self.memory
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records what prepared claims (the kubelet plugin) or allocated ones
    /// (the operator's `status.allocatedClaims`) hold, whichever is given;
    /// the resize loop and the status follow the hold when it changes.
    pub fn set_claims(
        &self,
        prepared: Option<crate::dra::Claimed>,
        allocated: Option<crate::dra::Claimed>,
    ) {
        let mut memory = self.memory();
        let given = prepared.is_some();
        if let Some(prepared) = prepared {
            memory.prepared = prepared;
        }
        if let Some(allocated) = allocated {
            memory.allocated = allocated;
        }
        let held = crate::dra::held(&memory.prepared, &memory.allocated);
        if held == memory.claimed && !given {
            return;
        }
        memory.claimed = held.clone();
        drop(memory);
        self.claimed.send_replace(held);
        self.touch(true);
    }

    /// Something the status shows changed; `urgent` skips the rate limit.
    fn touch(&self, urgent: bool) {
        if urgent {
            self.urgent.store(true, Ordering::Relaxed);
        }
        self.changed.notify_one();
    }
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
    if config.resource_slices {
        tokio::spawn(slice::publish_slice(
            Api::all_with(client.clone(), &slice::resource_slices()),
            config.node_name.clone(),
            shared.slice.subscribe(),
            Arc::clone(&shared),
        ));
    }
    if let Some(dirs) = config.kubelet_plugin.clone() {
        let file = dirs
            .plugins
            .join(slice::DRIVER)
            .join("prepared-claims.json");
        let claimed = Arc::clone(&shared);
        let plugin = Arc::new(
            crate::dra::KubeletPlugin::new(
                client.clone(),
                config.node_name.clone(),
                dirs,
                Some(file),
            )
            .with_pool({
                let kernel = Arc::clone(&kernel);
                Box::new(move |size, numa| {
                    kernel
                        .numa_pool(size, numa)
                        .map(|pool| pool.persistent())
                        .map_err(|err| format!("cannot read NUMA node {numa}'s {size} pool: {err}"))
                })
            })
            .on_change(move |prepared| claimed.set_claims(Some(prepared), None)),
        );
        let checked = Arc::clone(&plugin);
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => return,
                    () = tokio::time::sleep(crate::dra::FORGET_GONE_INTERVAL) => {}
                }
                checked.forget_gone().await;
            }
        });
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let stopped = async move {
                let _ = stop.wait_for(|stop| *stop).await;
            };
            if let Err(err) = crate::dra::serve(plugin, stopped).await {
                warn!(error = %err, "cannot serve the kubelet plugin");
            }
        });
    }
    if let Some(root) = config.pod_cgroups.clone() {
        tokio::spawn(pods::read_pod_cgroups(
            crate::pod_cgroups::PodCgroups::new(root),
            config.pod_cgroups_interval,
            Arc::clone(&shared),
        ));
    }

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

    // What the pools are as the agent starts: short of their targets after
    // a reboot or on a new node (`Restoring`, and the operator taints).
    let first = spec_rx.borrow().clone();
    if let Some(object) = first {
        let targets = object.spec.page_sizes.clone();
        let reader = Arc::clone(&kernel);
        let sizes: Vec<PageSize> = targets.iter().map(|e| e.size).collect();
        let pools = tokio::task::spawn_blocking(move || {
            sizes
                .into_iter()
                .filter_map(|size| Some((size, reader.pool(size).ok()?.persistent())))
                .collect::<BTreeMap<_, _>>()
        })
        .await
        .unwrap_or_default();
        let restoring = {
            let mut memory = shared.memory();
            status::start_restoring(&mut memory, object.metadata.generation, &targets, &pools);
            // With the generation, under one lock: the first status the
            // writer builds starts from what was reported before.
            memory.reported_conditions = Some(status_writer::own_conditions(&object));
            memory.restoring.clone()
        };
        if !restoring.is_empty() {
            info!(short = ?restoring, "pools short of their targets at start: restoring");
        }
        shared.touch(true);
    }

    let mut models = config
        .model_file
        .as_deref()
        .map(|path| crate::resize::model_file::load(path, &config.kernel_release))
        .unwrap_or_default();
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

#[cfg(test)]
mod tests {
    use super::kubelet::{restart_backoff, run_bounded};
    use super::status_writer::jittered;
    use super::*;
    use crate::kernel::{SimConfig, SimulatedKernel};
    use http::{Request, Response};
    use kube::client::Body;
    use prometheus_client::registry::Registry;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn entry(pages: i64) -> PageSizeTarget {
        PageSizeTarget {
            pool: "p".into(),
            pool_generation: 1,
            ..PageSizeTarget::new(PageSize::SIZE_2MI, pages)
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

    /// Waits for the writer to have handled the last response (up to 30 s:
    /// room for a loaded machine; the state, not the time, is the check).
    async fn eventually(what: &str, check: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !check() {
            assert!(Instant::now() < deadline, "not within 30s: {what}");
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

        // Nothing changed: three statuses built later, still no second
        // request (a writer that sent one would wait for its answer and
        // build no further status).
        let built = shared.reports.load(Ordering::Relaxed);
        shared.touch(true);
        eventually("three statuses built after the touch", || {
            shared.reports.load(Ordering::Relaxed) >= built + 3
        })
        .await;
        no_request_within(&mut handle, Duration::ZERO).await;

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
        // A command that writes 8 MiB to stderr: its end is said, at most
        // 300 characters of it.
        let loud = run_bounded(
            &sh("head -c 8388608 /dev/zero | tr '\\0' x >&2; echo ' the last words' >&2; exit 3"),
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
        assert!(
            loud.ends_with("x the last words"),
            "{}",
            &loud[loud.len().saturating_sub(80)..]
        );
        assert!(loud.len() < 600, "{} bytes", loud.len());
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("child.pid");
        let hang = format!("sleep 60 & echo $! > {}; wait", pid_file.display());
        // 3 s: room for a loaded machine to start the shell and its child.
        let hung = run_bounded(&sh(&hang), Duration::from_secs(3))
            .await
            .unwrap_err();
        assert!(hung.contains("did not finish within 3s"), "{hung}");
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
