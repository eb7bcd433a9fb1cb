//! `make bench-fleet`: the operator at fleet size on the project's own real
//! control plane (docs/design.md, "Fleet scale").
//!
//! For each fleet size N and each number of pools P (1 and 5; each of P
//! pools selects every P-th node): a control plane of its own, N minimal
//! Node objects (no status), the operator's release binary as a process of
//! its own, and simulated agents in this process that report each new
//! target converged `HUGEPOOL_FLEET_AGENT_DELAY` (1 s) after they see it
//! and, as the real agent on a busy node does (its page cache filled and
//! dropped, the free blocks a grow gets at once moved at every refresh),
//! write their status again every `HUGEPOOL_FLEET_REFRESH` (5 min, spread
//! over the period: the agent shows such a move at most that often).
//! Then:
//!
//! 1. the pools at maxUnavailable 100% are applied: time until every
//!    HugePageNode carries its target;
//! 2. their `pages` change: time until every node carries the new target,
//!    and the operator's API writes per node for the change (counted by the
//!    apiserver, `apiserver_request_total`, all kinds but the agents'
//!    `hugepagenodes/status`);
//! 3. a rollout at maxUnavailable 10%: time until every pool is Available;
//! 4. a drain wave: back to 128 pages at maxUnavailable 100%, which every
//!    tenth node cannot finish (its agent reports the 256 pages in use and
//!    the shrink blocked): time until each of those carries the draining
//!    taint and Draining=True (its pods listed: none). Its lower bound is
//!    the change's floor, the agents' delay, and a bare client's drain steps
//!    for those nodes (pods listed, Node tainted, condition written, 32
//!    nodes at a time).
//!
//! Before the operator starts, a bare client does the same writes at the
//! same concurrency on the same apiserver (the bare floors, the headline):
//! N HugePageNode applies (apply), the same N changed (change), and for
//! the rollout a true lower bound: the larger of ten agent delays (at 10%
//! ten waves wait at least that long) and the time of the writes no rollout
//! avoids (each node's spec, then its status). Apply and change are also
//! measured with the simulated agents and their refreshes beside the bare
//! client (the floors with agents). The operator's writes that met a newer
//! object and were retried (`hugepool_write_conflicts_total`) are counted
//! per phase.
//! Prints one table with the operator's peak RSS (VmHWM), CPU seconds, its
//! passes and the mean time a pass spends planning
//! (`hugepool_plan_duration_seconds`). Environment: HUGEPOOL_FLEET_NODES
//! (default "2000,10000"), HUGEPOOL_FLEET_POOLS (default "1,5"),
//! HUGEPOOL_FLEET_AGENT_DELAY and HUGEPOOL_FLEET_REFRESH (Go durations,
//! default 1s and 5m), HUGEPOOL_FLEET_OPERATOR (another operator binary,
//! such as the image's musl build). Under `cargo test` (no `--bench`) it
//! runs 50 nodes with 200 ms agents refreshing every 2 s and fails above 3
//! operator writes per node per change.
//! `HUGEPOOL_FLEET_WRITE_COSTS=1` measures instead what each kind of
//! HugePageNode write costs the apiserver (spec applies, the agents' status
//! applies, the same status as a merge patch), N of each on a control plane
//! of its own, and prints each phase's profile.
//! Each row also draws its rollout (nodes changing and converged every
//! 100 ms against maxUnavailable) as target/bench-fleet/rollout-N-P.svg.

#[path = "fleet/plot.rs"]
mod plot;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use hugepool_crds::conditions::find_condition;
use hugepool_crds::{AGENT_MANAGER, HugePageNode, HugePagePool, PageSize};
use hugepool_e2e::{OwnedControlPlane, free_port, http_get, install_crds};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::Semaphore;

/// The pools are `bench-0` .. `bench-{P-1}`.
const POOL: &str = "bench";
/// Simulated agents' writes in flight at once (a real fleet has one agent
/// per node; this bounds the bench process, not the operator).
const AGENT_WRITES_IN_FLIGHT: usize = 64;

struct Row {
    nodes: usize,
    pools: usize,
    floor: Floors,
    /// Where each phase's time went, floors first.
    profiles: Vec<(String, Profile)>,
    apply: Duration,
    change: Duration,
    rollout: Duration,
    /// A tenth of the nodes blocked by pages in use: until each is tainted
    /// and Draining.
    drain_wave: Duration,
    writes_per_node: f64,
    /// Writes of the operator's that met a newer object (409, or a failed
    /// JSON-patch test) and were retried, in apply, change and rollout.
    conflicts: [u64; 3],
    /// The agents' status writes per second while the operator ran:
    /// reports of new targets and refreshes.
    agent_writes_per_second: f64,
    peak_rss_mib: f64,
    cpu: Duration,
    passes: u64,
    plan: Duration,
}

/// What the bench reads of every HugePageNode: the target it carries.
#[derive(Default)]
struct Targets {
    by_node: HashMap<String, i64>,
    /// Status writes the simulated agents have made.
    reported: usize,
    /// The target each node's agent last reported converged at.
    reported_by_node: HashMap<String, i64>,
    /// The status each node's agent last wrote, which its refreshes write
    /// again with the estimates moved.
    status_by_node: HashMap<String, serde_json::Value>,
    /// Status writes the refreshes have made.
    refreshed: usize,
    /// One writer at a time per node, as one agent writes.
    writers: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// The drain wave's nodes: their agents report a shrink below `held`
    /// blocked by pages in use.
    blocking: std::collections::HashSet<String>,
    held: i64,
    /// Nodes whose HugePageNode carries Draining=True, and Nodes that carry
    /// the draining taint, as the bench's watches saw them.
    draining: std::collections::HashSet<String>,
    tainted: std::collections::HashSet<String>,
}

impl Targets {
    fn writer(&mut self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.writers.entry(name.to_string()).or_default().clone()
    }

    /// Drain wave nodes not yet both tainted and Draining.
    fn not_draining(&self) -> usize {
        self.blocking
            .iter()
            .filter(|n| !(self.draining.contains(*n) && self.tainted.contains(*n)))
            .count()
    }

    fn count(&self, pages: i64) -> usize {
        self.by_node.values().filter(|p| **p == pages).count()
    }

    /// Nodes carrying `pages` not yet reported at it, and nodes reported at it.
    fn rollout(&self, pages: i64) -> (usize, usize) {
        let converged = self
            .reported_by_node
            .values()
            .filter(|p| **p == pages)
            .count();
        let changing = self
            .by_node
            .iter()
            .filter(|(name, p)| **p == pages && self.reported_by_node.get(*name) != Some(&pages))
            .count();
        (changing, converged)
    }
}

/// Samples `targets` every `every` from `started` until `stop` fires, then
/// once more.
fn sample_rollout(
    targets: Arc<Mutex<Targets>>,
    pages: i64,
    started: Instant,
    every: Duration,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Vec<plot::RolloutSample>>,
) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let sampler = tokio::spawn(async move {
        let sample = || {
            let (changing, converged) = targets.lock().expect("targets").rollout(pages);
            plot::RolloutSample {
                seconds: started.elapsed().as_secs_f64(),
                changing,
                converged,
            }
        };
        let mut samples = Vec::new();
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut stopped => break,
                _ = ticks.tick() => samples.push(sample()),
            }
        }
        samples.push(sample());
        samples
    });
    (stop, sampler)
}

fn target_of(state: &HugePageNode) -> Option<i64> {
    state
        .spec
        .page_sizes
        .iter()
        .find(|e| e.pool.starts_with(POOL))
        .map(|e| e.pages)
}

/// What the same writes take a bare client on the same apiserver.
#[derive(Debug, Default)]
struct Floors {
    apply: Duration,
    change: Duration,
    rollout: Duration,
    /// The apply with the simulated agents and their watch beside it, as in
    /// the operator's run (not a floor the issue defines: it shows how much
    /// of the gap is the agents' share of the apiserver).
    apply_with_agents: Duration,
    /// The change likewise, on objects that carry the agents' status.
    change_with_agents: Duration,
    /// A drain wave's lower bound: the change's spec writes, the agents'
    /// delay, then each draining node's drain steps (its pods listed, its
    /// Node tainted, its Draining condition written), 32 nodes at a time.
    drain_wave: Duration,
    /// Each phase's profile, by name.
    profiles: Vec<(String, Profile)>,
}

/// The status an agent writes once the kernel holds `pages`.
fn converged_status(state: &HugePageNode, pages: i64) -> serde_json::Value {
    let generation = state.metadata.generation.unwrap_or(0);
    let now = jiff::Timestamp::now().to_string();
    json!({
        "apiVersion": "hugepool.dev/v1alpha1",
        "kind": "HugePageNode",
        "status": {
            "observedGeneration": generation,
            "pageSizes": [{
                "size": PageSize::SIZE_2MI,
                "target": pages,
                "total": pages,
                "free": pages,
                "reserved": 0,
                "surplus": 0,
                "inUse": 0,
            }],
            "conditions": [{
                "type": "Converged",
                "status": "True",
                "reason": "AtTarget",
                "message": format!("2Mi: {pages}/{pages} pages"),
                "observedGeneration": generation,
                "lastTransitionTime": now,
            }],
        },
    })
}

/// The status an agent writes when a shrink to `target` stops at `held`
/// pages in use.
fn blocked_status(state: &HugePageNode, target: i64, held: i64) -> serde_json::Value {
    let generation = state.metadata.generation.unwrap_or(0);
    let now = jiff::Timestamp::now().to_string();
    json!({
        "apiVersion": "hugepool.dev/v1alpha1",
        "kind": "HugePageNode",
        "status": {
            "observedGeneration": generation,
            "pageSizes": [{
                "size": PageSize::SIZE_2MI,
                "target": target,
                "total": held,
                "free": 0,
                "reserved": 0,
                "surplus": 0,
                "inUse": held,
            }],
            "conditions": [{
                "type": "Converged",
                "status": "False",
                "reason": "PagesInUse",
                "message": format!("2Mi: {held}/{target} pages"),
                "observedGeneration": generation,
                "lastTransitionTime": now,
            }, {
                "type": "ShrinkBlocked",
                "status": "True",
                "reason": "PagesInUse",
                "message": format!("2Mi: target {target} is below {held} pages in use + 0 reserved"),
                "observedGeneration": generation,
                "lastTransitionTime": now,
            }],
        },
    })
}

/// Simulated agents: every HugePageNode whose spec generation has not been
/// reported is reported converged `delay` after it is first seen.
fn start_agents(
    client: Client,
    delay: Duration,
    targets: Arc<Mutex<Targets>>,
    selector: &str,
) -> tokio::task::JoinHandle<()> {
    let config = watcher::Config::default().labels(selector);
    tokio::spawn(async move {
        let api: Api<HugePageNode> = Api::all(client);
        let slots = Arc::new(Semaphore::new(AGENT_WRITES_IN_FLIGHT));
        let mut scheduled: HashMap<String, i64> = HashMap::new();
        let mut events = watcher(api.clone(), config).default_backoff().boxed();
        while let Some(event) = events.next().await {
            let Ok(event) = event else { continue };
            let objects: Vec<HugePageNode> = match event {
                watcher::Event::Apply(o) | watcher::Event::InitApply(o) => vec![o],
                _ => continue,
            };
            for state in objects {
                let name = state.name_any();
                let generation = state.metadata.generation.unwrap_or(0);
                if let Some(pages) = target_of(&state) {
                    targets
                        .lock()
                        .expect("targets")
                        .by_node
                        .insert(name.clone(), pages);
                }
                let draining = state.status.as_ref().is_some_and(|s| {
                    hugepool_crds::conditions::is_true(
                        &s.conditions,
                        hugepool_crds::NodeConditionType::Draining,
                    )
                });
                if draining {
                    targets
                        .lock()
                        .expect("targets")
                        .draining
                        .insert(name.clone());
                }
                let reported = state
                    .status
                    .as_ref()
                    .and_then(|s| s.observed_generation)
                    .unwrap_or(0);
                if reported >= generation || scheduled.get(&name) == Some(&generation) {
                    continue;
                }
                let Some(pages) = target_of(&state) else {
                    continue;
                };
                scheduled.insert(name.clone(), generation);
                let (api, slots, targets) = (api.clone(), slots.clone(), targets.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _slot = slots.acquire().await.expect("semaphore");
                    let writer = targets.lock().expect("targets").writer(&name);
                    let _writer = writer.lock().await;
                    let params = PatchParams::apply(AGENT_MANAGER).force();
                    let held = {
                        let targets = targets.lock().expect("targets");
                        targets.blocking.contains(&name).then_some(targets.held)
                    };
                    let status = match held {
                        Some(held) if pages < held => blocked_status(&state, pages, held),
                        _ => converged_status(&state, pages),
                    };
                    for _ in 0..5 {
                        if api
                            .patch_status(&name, &params, &Patch::Apply(&status))
                            .await
                            .is_ok()
                        {
                            let mut targets = targets.lock().expect("targets");
                            targets.reported += 1;
                            targets.reported_by_node.insert(name.clone(), pages);
                            targets.status_by_node.insert(name.clone(), status);
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                });
            }
        }
    })
}

/// Follows the Nodes' draining taints into `targets.tainted`.
fn watch_taints(client: Client, targets: Arc<Mutex<Targets>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<Node> = Api::all(client);
        let mut events = watcher(api, watcher::Config::default().labels("bench=true"))
            .default_backoff()
            .applied_objects()
            .boxed();
        while let Some(event) = events.next().await {
            let Ok(node) = event else { continue };
            let tainted = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == hugepool_crds::DRAINING_TAINT));
            let mut targets = targets.lock().expect("targets");
            if tainted {
                targets.tainted.insert(node.name_any());
            } else {
                targets.tainted.remove(&node.name_any());
            }
        }
    })
}

/// The agents' refreshes: every node whose agent has reported writes its
/// status again once per `refresh`, the fleet's writes spread evenly over
/// the period, each with its estimates moved: a busy node's agent, whose
/// free blocks move at every refresh and are shown at most every 5
/// minutes. Each write is the node's last status with `obtainable` changed, so
/// it never reports a target the node has not reached.
fn start_refreshes(
    client: Client,
    refresh: Duration,
    targets: Arc<Mutex<Targets>>,
) -> tokio::task::JoinHandle<()> {
    const TICK: Duration = Duration::from_millis(100);
    tokio::spawn(async move {
        let api: Api<HugePageNode> = Api::all(client);
        let slots = Arc::new(Semaphore::new(AGENT_WRITES_IN_FLIGHT));
        let params = PatchParams::apply(AGENT_MANAGER).force();
        let mut ticks = tokio::time::interval(TICK);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Where the round-robin is, and the share of a write carried over.
        let (mut next, mut owed, mut round) = (0usize, 0.0f64, 0u64);
        loop {
            ticks.tick().await;
            let due: Vec<String> = {
                let targets = targets.lock().expect("targets");
                let mut names: Vec<&String> = targets.status_by_node.keys().collect();
                if names.is_empty() {
                    continue;
                }
                names.sort_unstable();
                owed += names.len() as f64 * TICK.as_secs_f64() / refresh.as_secs_f64();
                let count = owed as usize;
                owed -= count as f64;
                (0..count)
                    .map(|k| names[(next + k) % names.len()].clone())
                    .collect()
            };
            if !due.is_empty() {
                next += due.len();
                if next >= targets.lock().expect("targets").status_by_node.len() {
                    next = 0;
                    round += 1;
                }
            }
            // By more than a tenth each round, as a figure that moves enough
            // to be written.
            let moved = 1000 + 200 * (round % 2);
            for name in due {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (api, params, targets) = (api.clone(), params.clone(), targets.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    let writer = targets.lock().expect("targets").writer(&name);
                    let _writer = writer.lock().await;
                    // The node's last status, read under its writer's lock.
                    let Some(mut status) = targets
                        .lock()
                        .expect("targets")
                        .status_by_node
                        .get(&name)
                        .cloned()
                    else {
                        return;
                    };
                    status["status"]["pageSizes"][0]["obtainable"] =
                        json!({"now": moved, "afterCompaction": moved + 500});
                    if api
                        .patch_status(&name, &params, &Patch::Apply(&status))
                        .await
                        .is_ok()
                    {
                        targets.lock().expect("targets").refreshed += 1;
                    }
                });
            }
        }
    })
}

/// The operator's release binary, run against `kubeconfig`.
struct Operator {
    child: Child,
    metrics_port: u16,
}

impl Operator {
    fn start(kubeconfig: &Path, log: &Path) -> Operator {
        let port = free_port();
        let log = std::fs::File::create(log).expect("operator log");
        // HUGEPOOL_FLEET_OPERATOR runs another build (the image's musl one).
        let binary = std::env::var("HUGEPOOL_FLEET_OPERATOR")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_hugepool-operator").into());
        let child = Command::new(binary)
            .args(["run", "--listen", &format!("127.0.0.1:{port}")])
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start hugepool-operator");
        Operator {
            child,
            metrics_port: port,
        }
    }

    fn proc_file(&self, name: &str) -> String {
        std::fs::read_to_string(format!("/proc/{}/{name}", self.child.id())).unwrap_or_default()
    }

    /// Peak resident set (VmHWM) in MiB.
    fn peak_rss_mib(&self) -> f64 {
        self.proc_file("status")
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    }

    /// User + system CPU time so far.
    fn cpu(&self) -> Duration {
        cpu_of(self.child.id())
    }

    /// One sample of its /metrics.
    fn metric(&self, name: &str) -> f64 {
        let text =
            http_get(&format!("127.0.0.1:{}", self.metrics_port), "/metrics").unwrap_or_default();
        let prefix = format!("{name} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }

    fn conflicts(&self) -> u64 {
        self.metric("hugepool_write_conflicts_total") as u64
    }

    fn reconciles(&self) -> u64 {
        self.metric("hugepool_reconciles_total") as u64
    }

    /// Mean time a pass spends planning (`hugepool_plan_duration_seconds`).
    fn mean_plan(&self) -> Duration {
        let count = self.metric("hugepool_plan_duration_seconds_count");
        let sum = self.metric("hugepool_plan_duration_seconds_sum");
        Duration::from_secs_f64(if count > 0.0 { sum / count } else { 0.0 })
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The fields of /proc/PID/stat after the command name (which may hold
/// spaces): state is field 0, ppid 1, utime 11, stime 12.
fn stat_fields(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_default()
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// User + system CPU time a process has used so far.
fn cpu_of(pid: u32) -> Duration {
    let fields = stat_fields(pid);
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Duration::from_secs_f64(ticks as f64 / hz)
}

/// CPU used so far by each process on the apiserver's side of the bench
/// (etcd, kube-apiserver, kube-controller-manager: the children of
/// `controlplane up`, named by their subcommand), the operator and this
/// process (the simulated agents, the watch that times the bench and the
/// floors' client).
fn cpu_by_role(up: u32, operator: Option<u32>) -> BTreeMap<String, Duration> {
    let mut roles = BTreeMap::new();
    let pids = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok());
    for pid in pids {
        if stat_fields(pid).get(1).and_then(|p| p.parse::<u32>().ok()) != Some(up) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let role = cmdline
            .split(|b| *b == 0)
            .nth(1)
            .map(|r| String::from_utf8_lossy(r).into_owned())
            .unwrap_or_default();
        *roles.entry(role).or_insert(Duration::ZERO) += cpu_of(pid);
    }
    if let Some(pid) = operator {
        roles.insert("operator".into(), cpu_of(pid));
    }
    roles.insert("bench".into(), cpu_of(std::process::id()));
    roles
}

/// What one phase cost: its wall time, the CPU each process used in it and
/// the requests the apiserver served in it (`VERB resource`).
#[derive(Debug, Default)]
struct Profile {
    wall: Duration,
    cpu: BTreeMap<String, Duration>,
    requests: BTreeMap<String, f64>,
}

/// A reading at the start of a phase; `finish` makes its profile.
struct Reading {
    cpu: BTreeMap<String, Duration>,
    requests: BTreeMap<String, f64>,
    up: u32,
    operator: Option<u32>,
}

impl Reading {
    async fn take(client: &Client, up: u32, operator: Option<u32>) -> Reading {
        Reading {
            cpu: cpu_by_role(up, operator),
            requests: apiserver_requests(client).await,
            up,
            operator,
        }
    }

    /// The profile from this reading to now; `wall` is the phase's own
    /// measured time.
    async fn finish(self, client: &Client, wall: Duration) -> Profile {
        let cpu = cpu_by_role(self.up, self.operator)
            .into_iter()
            .map(|(role, used)| {
                let before = self.cpu.get(&role).copied().unwrap_or_default();
                (role, used.saturating_sub(before))
            })
            .collect();
        let requests = apiserver_requests(client)
            .await
            .into_iter()
            .map(|(key, count)| {
                let before = self.requests.get(&key).copied().unwrap_or(0.0);
                (key, count - before)
            })
            .filter(|(_, count)| *count >= 1.0)
            .collect();
        Profile {
            wall,
            cpu,
            requests,
        }
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.1} s wall; CPU s:", self.wall.as_secs_f64())?;
        for (role, used) in &self.cpu {
            write!(f, " {role} {:.1}", used.as_secs_f64())?;
        }
        let mut requests: Vec<(&String, &f64)> = self.requests.iter().collect();
        requests.sort_by(|a, b| b.1.total_cmp(a.1));
        write!(f, "; requests:")?;
        for (key, count) in requests.iter().take(8) {
            write!(f, " {key} {count:.0},")?;
        }
        Ok(())
    }
}

/// Requests the apiserver has served, by `VERB resource[/subresource]`,
/// from its own `apiserver_request_total`.
async fn apiserver_requests(client: &Client) -> BTreeMap<String, f64> {
    let request = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("request");
    let text = client.request_text(request).await.unwrap_or_default();
    let mut requests = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let resource = match label("subresource") {
            sub if sub.is_empty() => label("resource"),
            sub => format!("{}/{sub}", label("resource")),
        };
        let key = format!("{} {resource}", label("verb").to_uppercase());
        *requests.entry(key).or_insert(0.0) += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    requests
}

/// Mutating requests the apiserver has served, by resource/subresource.
async fn apiserver_writes(client: &Client) -> BTreeMap<String, f64> {
    const MUTATING: [&str; 7] = [
        "POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE",
    ];
    let mut writes = BTreeMap::new();
    for (key, count) in apiserver_requests(client).await {
        let Some((verb, resource)) = key.split_once(' ') else {
            continue;
        };
        if MUTATING.contains(&verb) {
            *writes.entry(resource.to_string()).or_insert(0.0) += count;
        }
    }
    writes
}

/// The operator's share of the writes between two readings: everything but
/// the simulated agents' status writes and the bench's own Node creates
/// and pool patches.
fn operator_writes(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> f64 {
    after
        .iter()
        .filter(|(key, _)| {
            !matches!(
                key.as_str(),
                "hugepagenodes/status" | "hugepagepools" | "nodes" | "leases"
            )
        })
        .map(|(key, value)| value - before.get(key).copied().unwrap_or(0.0))
        .sum()
}

async fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + timeout;
    loop {
        match done() {
            Ok(()) => return,
            Err(last) if Instant::now() > deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

async fn pool_available(
    api: &Api<HugePagePool>,
    name: &str,
    generation: i64,
) -> Result<(), String> {
    let pool = api.get(name).await.map_err(|e| e.to_string())?;
    let status = pool.status.unwrap_or_default();
    let available = find_condition(
        &status.conditions,
        hugepool_crds::PoolConditionType::Available,
    )
    .is_some_and(|c| c.status == "True" && c.observed_generation == Some(generation));
    if available {
        Ok(())
    } else {
        Err(format!("nodes {:?}", status.nodes))
    }
}

async fn wait_available(api: &Api<HugePagePool>, name: &str, generation: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        match pool_available(api, name, generation).await {
            Ok(()) => return,
            Err(last) if Instant::now() > deadline => {
                panic!(
                    "timed out after {timeout:?} waiting for the pool to be Available; last: {last}"
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

async fn create_nodes(client: &Client, nodes: usize, pools: usize) {
    let api: Api<Node> = Api::all(client.clone());
    futures::stream::iter(0..nodes)
        .map(|i| {
            let api = api.clone();
            async move {
                let node: Node = serde_json::from_value(json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": format!("node-{i:05}"),
                        "labels": {"bench": "true", "group": format!("g{}", i % pools)},
                    },
                }))
                .expect("Node object");
                api.create(&PostParams::default(), &node).await.map(|_| ())
            }
        })
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await
        .expect("create Nodes");
}

/// N HugePageNode applies shaped like the operator's, `in_flight` at once.
async fn apply_specs(api: &Api<HugePageNode>, names: &[String], pages: i64, in_flight: usize) {
    let params = PatchParams::apply("bench-floor").force();
    futures::stream::iter(names)
        .map(|name| {
            let (api, params) = (api.clone(), params.clone());
            async move {
                let body = json!({
                    "apiVersion": "hugepool.dev/v1alpha1",
                    "kind": "HugePageNode",
                    "metadata": {"name": name, "labels": {"bench-floor": "true"}},
                    "spec": {"pageSizes": [{"size": "2Mi", "pages": pages, "pool": POOL, "poolGeneration": 1}]},
                });
                api.patch(name, &params, &Patch::Apply(&body)).await.map(|_| ())
            }
        })
        .buffer_unordered(in_flight)
        .try_collect::<Vec<()>>()
        .await
        .expect("floor writes");
}

/// The apiserver's own floors, measured by a bare client doing the
/// operator's writes (and, for the rollout, the agents') at the same
/// concurrency; its objects are deleted after. `up` is the control plane's
/// process, for the profiles.
async fn apiserver_floors(
    client: &Client,
    nodes: usize,
    delay: Duration,
    refresh: Duration,
    up: u32,
) -> Floors {
    let api: Api<HugePageNode> = Api::all(client.clone());
    let names: Vec<String> = (0..nodes).map(|i| format!("floor-{i:05}")).collect();
    let mut profiles = Vec::new();
    let reading = Reading::take(client, up, None).await;
    let started = Instant::now();
    apply_specs(&api, &names, 64, 32).await;
    let apply = started.elapsed();
    profiles.push(("floor: apply".into(), reading.finish(client, apply).await));
    let reading = Reading::take(client, up, None).await;
    let started = Instant::now();
    apply_specs(&api, &names, 128, 32).await;
    let change = started.elapsed();
    profiles.push(("floor: change".into(), reading.finish(client, change).await));
    // The rollout's lower bound: the writes no rollout can do without (every
    // node's spec, then its agent's status, from the apply's answer), and
    // ten waves of at least the agents' delay each (at 10% no more than a
    // tenth of the nodes wait at once). No rollout is faster than either.
    let started = Instant::now();
    let params = PatchParams::apply("bench-floor").force();
    let status_params = PatchParams::apply(AGENT_MANAGER).force();
    futures::stream::iter(&names)
        .map(|name| {
            let (api, params, status_params) = (api.clone(), params.clone(), status_params.clone());
            async move {
                let body = json!({
                    "apiVersion": "hugepool.dev/v1alpha1",
                    "kind": "HugePageNode",
                    "metadata": {"name": name, "labels": {"bench-floor": "true"}},
                    "spec": {"pageSizes": [{"size": "2Mi", "pages": 256, "pool": POOL, "poolGeneration": 1}]},
                });
                let state = api.patch(name, &params, &Patch::Apply(&body)).await?;
                api.patch_status(name, &status_params, &Patch::Apply(&converged_status(&state, 256)))
                    .await
                    .map(|_| ())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await
        .expect("floor rollout writes");
    let rollout = started.elapsed().max(10 * delay);
    let reading = Reading::take(client, up, None).await;
    let started = Instant::now();
    drain_steps(client, nodes).await;
    let steps = started.elapsed();
    profiles.push((
        "floor: drain steps of a tenth".into(),
        reading.finish(client, steps).await,
    ));
    let drain_wave = change + delay + steps;
    delete_floor_objects(&api).await;
    let mut loaded = floors_with_agents(client, nodes, delay, refresh, up)
        .await
        .into_iter();
    let (apply_with_agents, profile) = loaded.next().expect("the loaded apply");
    profiles.push(("floor + agents and their watch: apply".into(), profile));
    let (change_with_agents, profile) = loaded.next().expect("the loaded change");
    profiles.push(("floor + agents and their watch: change".into(), profile));
    Floors {
        apply,
        change,
        rollout,
        apply_with_agents,
        change_with_agents,
        drain_wave,
        profiles,
    }
}

/// The drain wave's nodes: every tenth.
fn drain_wave_nodes(nodes: usize) -> Vec<usize> {
    (0..nodes).step_by(10).collect()
}

/// What a drain does on each draining node, done by a bare client 32 nodes
/// at a time: list the node's pods (by field selector), taint its Node, and
/// write the Draining condition of its HugePageNode (`floor-*`); then the
/// taints are taken off again, untimed.
async fn drain_steps(client: &Client, nodes: usize) {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::all(client.clone());
    let node_api: Api<Node> = Api::all(client.clone());
    let states: Api<HugePageNode> = Api::all(client.clone());
    let params = PatchParams::apply("bench-floor").force();
    let taints = |on: bool| {
        let taints = if on {
            json!([{"key": hugepool_crds::DRAINING_TAINT, "effect": "NoSchedule"}])
        } else {
            json!(null)
        };
        json!({"spec": {"taints": taints}})
    };
    futures::stream::iter(drain_wave_nodes(nodes))
        .map(|i| {
            let (pods, node_api, states, params) =
                (pods.clone(), node_api.clone(), states.clone(), params.clone());
            let taint = taints(true);
            async move {
                let node = format!("node-{i:05}");
                pods.list(
                    &kube::api::ListParams::default().fields(&format!("spec.nodeName={node}")),
                )
                .await?;
                node_api
                    .patch(&node, &PatchParams::default(), &Patch::Merge(&taint))
                    .await?;
                let condition = json!({
                    "apiVersion": "hugepool.dev/v1alpha1",
                    "kind": "HugePageNode",
                    "status": {"conditions": [{
                        "type": "Draining", "status": "True", "reason": "EvictingPods",
                        "message": "evicting pods that request hugepages-2Mi so the shrink of pool bench-0 can finish",
                        "lastTransitionTime": jiff::Timestamp::now().to_string(),
                    }]},
                });
                states
                    .patch_status(&format!("floor-{i:05}"), &params, &Patch::Apply(&condition))
                    .await
                    .map(|_| ())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await
        .expect("floor drain steps");
    futures::stream::iter(drain_wave_nodes(nodes))
        .map(|i| {
            let (node_api, untaint) = (node_api.clone(), taints(false));
            async move {
                node_api
                    .patch(
                        &format!("node-{i:05}"),
                        &PatchParams::default(),
                        &Patch::Merge(&untaint),
                    )
                    .await
                    .map(|_| ())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await
        .expect("floor untaints");
}

async fn delete_floor_objects(api: &Api<HugePageNode>) {
    api.delete_collection(
        &kube::api::DeleteParams::default(),
        &kube::api::ListParams::default().labels("bench-floor=true"),
    )
    .await
    .expect("delete the floor's objects");
}

/// The apply and change floors with what shares the apiserver in the
/// operator's run: the simulated agents watch the objects and report each
/// target `delay` after they see it, and the clock stops when their watch
/// has seen every target (as the operator's phases are timed). Between the
/// two, every status is written, so the change meets objects shaped like
/// the operator's (with the agents' status and managed fields).
async fn floors_with_agents(
    client: &Client,
    nodes: usize,
    delay: Duration,
    refresh: Duration,
    up: u32,
) -> Vec<(Duration, Profile)> {
    let api: Api<HugePageNode> = Api::all(client.clone());
    let targets = Arc::new(Mutex::new(Targets::default()));
    let agents = start_agents(client.clone(), delay, targets.clone(), "bench-floor=true");
    let refreshes = start_refreshes(client.clone(), refresh, targets.clone());
    let seen = |pages: i64, count: usize| {
        let targets = targets.clone();
        move || {
            let seen = targets.lock().expect("targets").count(pages);
            (seen == count)
                .then_some(())
                .ok_or(format!("the agents' watch saw {seen}/{count} targets"))
        }
    };
    let all_reported = |count: usize| {
        let targets = targets.clone();
        move || {
            let reported = targets.lock().expect("targets").reported;
            (reported >= count)
                .then_some(())
                .ok_or(format!("{reported}/{count} reported"))
        }
    };
    // One object first, so the watch is running when the clock starts.
    let first = ["loaded-start".to_string()];
    apply_specs(&api, &first, 64, 1).await;
    wait_until("the agents' watch", Duration::from_secs(60), seen(64, 1)).await;
    let names: Vec<String> = (0..nodes).map(|i| format!("loaded-{i:05}")).collect();
    let mut phases = Vec::new();
    for (pages, reports) in [(64, nodes + 1), (128, 2 * nodes + 2)] {
        let reading = Reading::take(client, up, None).await;
        let started = Instant::now();
        apply_specs(&api, &names, pages, 32).await;
        if pages == 128 {
            apply_specs(&api, &first, pages, 1).await;
        }
        wait_until(
            "the agents' watch",
            Duration::from_secs(600),
            seen(pages, nodes + 1),
        )
        .await;
        let elapsed = started.elapsed();
        phases.push((elapsed, reading.finish(client, elapsed).await));
        wait_until(
            "the agents' status writes",
            Duration::from_secs(600),
            all_reported(reports),
        )
        .await;
    }
    agents.abort();
    refreshes.abort();
    delete_floor_objects(&api).await;
    phases
}

/// A control plane of its own in `dir` (emptied first), with the CRDs.
async fn fresh_control_plane(dir: &Path) -> (OwnedControlPlane, Client) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("bench dir");
    let control_plane = OwnedControlPlane::start(dir).expect("control plane");
    let client = control_plane.control_plane.client().await.expect("client");
    install_crds(client.clone()).await.expect("CRDs");
    (control_plane, client)
}

async fn measure(
    nodes: usize,
    pool_count: usize,
    delay: Duration,
    refresh: Duration,
    root: &Path,
) -> Row {
    let dir = root.join(format!("{nodes}-{pool_count}"));
    let (control_plane, client) = fresh_control_plane(&dir).await;
    let started = Instant::now();
    create_nodes(&client, nodes, pool_count).await;
    eprintln!("{nodes} Nodes created in {:.1?}", started.elapsed());

    let up = control_plane.pid().expect("the control plane runs");
    let mut floor = apiserver_floors(&client, nodes, delay, refresh, up).await;
    eprintln!(
        "{nodes} nodes: floors apply {:?}, change {:?}, rollout {:?}; with the agents: apply {:?}, change {:?}",
        floor.apply, floor.change, floor.rollout, floor.apply_with_agents, floor.change_with_agents
    );
    let mut profiles = std::mem::take(&mut floor.profiles);
    let targets = Arc::new(Mutex::new(Targets::default()));
    let _agents = start_agents(client.clone(), delay, targets.clone(), "");
    let _refreshes = start_refreshes(client.clone(), refresh, targets.clone());
    let operator = Operator::start(
        &control_plane.control_plane.kubeconfig,
        &dir.join("operator.log"),
    );
    let pools: Api<HugePagePool> = Api::all(client.clone());
    let all_carry = |pages: i64| {
        let targets = targets.clone();
        move || {
            let count = targets.lock().expect("targets").count(pages);
            (count == nodes)
                .then_some(())
                .ok_or(format!("{count}/{nodes} nodes carry {pages}"))
        }
    };
    // Let the operator sync its watches before the clock starts.
    wait_until("the operator's /readyz", Duration::from_secs(120), || {
        http_get(&format!("127.0.0.1:{}", operator.metrics_port), "/readyz").map(drop)
    })
    .await;
    let budget = Duration::from_secs(600);

    let names: Vec<String> = (0..pool_count).map(|k| format!("{POOL}-{k}")).collect();
    // Patches every pool at once; returns each one's new generation.
    let patch_all = |patch: serde_json::Value| {
        let (pools, names) = (pools.clone(), names.clone());
        async move {
            let patched = futures::future::join_all(names.iter().map(|name| {
                let (pools, patch) = (pools.clone(), Patch::Merge(patch.clone()));
                async move { pools.patch(name, &PatchParams::default(), &patch).await }
            }))
            .await;
            patched
                .into_iter()
                .map(|p| p.expect("patch pool").metadata.generation.unwrap_or(0))
                .collect::<Vec<i64>>()
        }
    };
    let all_available = |generations: Vec<i64>| {
        let (pools, names) = (pools.clone(), names.clone());
        async move {
            for (name, generation) in names.iter().zip(generations) {
                wait_available(&pools, name, generation, budget).await;
            }
        }
    };

    let agent_writes = || {
        let targets = targets.lock().expect("targets");
        targets.reported + targets.refreshed
    };
    let (agent_writes_before, run_started) = (agent_writes(), Instant::now());
    let mut conflicts = [0u64; 3];

    // 1. Apply at maxUnavailable 100%.
    let operator_pid = Some(operator.child.id());
    let reading = Reading::take(&client, up, operator_pid).await;
    let conflicts_before = operator.conflicts();
    let t = Instant::now();
    let created = futures::future::join_all(names.iter().enumerate().map(|(k, name)| {
        let pool: HugePagePool = serde_json::from_value(json!({
            "apiVersion": "hugepool.dev/v1alpha1",
            "kind": "HugePagePool",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"matchLabels": {"bench": "true", "group": format!("g{k}")}},
                "pageSize": "2Mi",
                "pages": 64,
                "rollout": {"maxUnavailable": "100%"},
            },
        }))
        .expect("pool");
        let pools = pools.clone();
        async move { pools.create(&PostParams::default(), &pool).await }
    }))
    .await
    .into_iter()
    .map(|p| p.expect("create pool").metadata.generation.unwrap_or(1))
    .collect::<Vec<i64>>();
    wait_until("every node to carry 64", budget, all_carry(64)).await;
    let apply = t.elapsed();
    conflicts[0] = operator.conflicts() - conflicts_before;
    profiles.push((
        "operator: apply".into(),
        reading.finish(&client, apply).await,
    ));
    all_available(created).await;

    // 2. Change pages.
    let before = apiserver_writes(&client).await;
    let reading = Reading::take(&client, up, operator_pid).await;
    let conflicts_before = operator.conflicts();
    let t = Instant::now();
    let changed = patch_all(json!({"spec": {"pages": 128}})).await;
    wait_until("every node to carry 128", budget, all_carry(128)).await;
    let change = t.elapsed();
    conflicts[1] = operator.conflicts() - conflicts_before;
    profiles.push((
        "operator: change".into(),
        reading.finish(&client, change).await,
    ));
    all_available(changed).await;
    let writes = operator_writes(&before, &apiserver_writes(&client).await);

    // 3. A rollout at 10%.
    let passes_before = operator.reconciles();
    let conflicts_before = operator.conflicts();
    let t = Instant::now();
    let (stop_sampling, sampler) =
        sample_rollout(targets.clone(), 256, t, Duration::from_millis(100));
    let rolled =
        patch_all(json!({"spec": {"pages": 256, "rollout": {"maxUnavailable": "10%"}}})).await;
    all_available(rolled).await;
    let rollout = t.elapsed();
    conflicts[2] = operator.conflicts() - conflicts_before;
    let passes = operator.reconciles().saturating_sub(passes_before);

    // 4. A drain wave: a shrink back to 128 at maxUnavailable 100%, which
    // a tenth of the nodes cannot finish (their agents report the 256 pages
    // in use), until each of those is tainted and Draining.
    {
        let mut targets = targets.lock().expect("targets");
        targets.blocking = drain_wave_nodes(nodes)
            .into_iter()
            .map(|i| format!("node-{i:05}"))
            .collect();
        targets.held = 256;
    }
    let taints = watch_taints(client.clone(), targets.clone());
    let reading = Reading::take(&client, up, operator_pid).await;
    let t = Instant::now();
    patch_all(json!({"spec": {"pages": 128, "rollout": {"maxUnavailable": "100%"}}})).await;
    wait_until("every draining node tainted and Draining", budget, || {
        let left = targets.lock().expect("targets").not_draining();
        (left == 0)
            .then_some(())
            .ok_or(format!("{left} nodes not draining yet"))
    })
    .await;
    let drain_wave = t.elapsed();
    profiles.push((
        "operator: drain wave".into(),
        reading.finish(&client, drain_wave).await,
    ));
    taints.abort();
    let agent_writes_per_second =
        (agent_writes() - agent_writes_before) as f64 / run_started.elapsed().as_secs_f64();
    let _ = stop_sampling.send(());
    let samples = sampler.await.expect("the rollout's samples");
    let picture = root.join(format!("rollout-{nodes}-{pool_count}.svg"));
    plot_rollout(&picture, &samples, nodes, pool_count, delay);
    let picture = picture.canonicalize().unwrap_or(picture);
    println!(
        "{nodes} nodes, {pool_count} pools: rollout plot {}",
        picture.display()
    );

    let row = Row {
        nodes,
        pools: pool_count,
        floor,
        profiles,
        apply,
        change,
        rollout,
        drain_wave,
        writes_per_node: writes / nodes as f64,
        conflicts,
        agent_writes_per_second,
        peak_rss_mib: operator.peak_rss_mib(),
        cpu: operator.cpu(),
        passes: operator.reconciles(),
        plan: operator.mean_plan(),
    };
    eprintln!(
        "{nodes} nodes: rollout took {passes} passes; writes by resource: {:?}",
        apiserver_writes(&client).await
    );
    drop(operator);
    drop(control_plane);
    row
}

/// The rollout's picture: each pool selects every `pool_count`-th node and
/// admits 10% of its own (rounded up), so the fleet's limit is their sum.
fn plot_rollout(
    path: &Path,
    samples: &[plot::RolloutSample],
    nodes: usize,
    pool_count: usize,
    delay: Duration,
) {
    let percent = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("10%".into());
    let max_unavailable: usize = (0..pool_count)
        .map(|k| {
            let selected = (k..nodes).step_by(pool_count).count();
            hugepool_crds::quantity::resolve_max_unavailable(&percent, selected).expect("10%")
        })
        .sum();
    let title = format!(
        "Rollout at maxUnavailable 10%: {nodes} nodes, {pool_count} pool{}, agents report {:?} after a new target",
        if pool_count == 1 { "" } else { "s" },
        delay
    );
    plot::write_svg(path, &title, samples, nodes, max_unavailable, "10%")
        .unwrap_or_else(|e| panic!("rollout plot: {e}"));
}

fn main() -> ExitCode {
    // `cargo bench` passes --bench. `cargo test --all-targets` runs this
    // binary too: then it checks itself on 50 nodes (about half a minute)
    // and fails if the operator writes more than 3 times per node per change.
    let smoke = !std::env::args().any(|arg| arg == "--bench");
    let sizes: Vec<usize> = if smoke {
        vec![50]
    } else {
        std::env::var("HUGEPOOL_FLEET_NODES")
            .unwrap_or_else(|_| "2000,10000".into())
            .split(',')
            .filter_map(|n| n.trim().parse().ok())
            .collect()
    };
    let delay = std::env::var("HUGEPOOL_FLEET_AGENT_DELAY")
        .ok()
        .and_then(|d| hugepool_crds::duration::parse(&d).ok())
        .unwrap_or(if smoke {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(1)
        });
    if !hugepool_e2e::controlplane_bin_dir()
        .join("controlplane")
        .exists()
    {
        eprintln!("bench-fleet needs the control plane: run `make controlplane`");
        return ExitCode::FAILURE;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-fleet");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let pool_counts: Vec<usize> = if smoke {
        vec![1]
    } else {
        std::env::var("HUGEPOOL_FLEET_POOLS")
            .unwrap_or_else(|_| "1,5".into())
            .split(',')
            .filter_map(|n| n.trim().parse().ok())
            .collect()
    };
    // How often a busy node's agent writes what a grow gets at once
    // (hugepool_agent::agent::status::ESTIMATE_SHOWN_FOR); shorter in the
    // smoke run, so that its 50 nodes' refreshes are under way while the
    // operator writes.
    let refresh = std::env::var("HUGEPOOL_FLEET_REFRESH")
        .ok()
        .and_then(|d| hugepool_crds::duration::parse(&d).ok())
        .unwrap_or(if smoke {
            Duration::from_secs(2)
        } else {
            Duration::from_secs(300)
        });
    if std::env::var("HUGEPOOL_FLEET_WRITE_COSTS").is_ok() {
        for nodes in sizes {
            runtime.block_on(write_costs(nodes, &root));
        }
        return ExitCode::SUCCESS;
    }
    let mut rows = Vec::new();
    for nodes in sizes {
        for &pools in &pool_counts {
            rows.push(runtime.block_on(measure(nodes, pools, delay, refresh, &root)));
        }
    }
    let too_many: Vec<String> = rows
        .iter()
        .filter(|row| row.writes_per_node > 3.0)
        .map(|row| {
            format!(
                "{} writes per node at {} nodes",
                row.writes_per_node, row.nodes
            )
        })
        .collect();
    println!(
        "Agents report each target {delay:?} after they see it and write their status again every {refresh:?} (estimates moved)."
    );
    println!();
    println!(
        "| nodes | pools | apply -> all targets (floor, x) | change -> all targets (floor, x) | rollout at 10% (lower bound, x) | drain wave of a tenth (lower bound, x) | apply, change against the floors with agents (x) | conflicts retried (apply, change, rollout) | agent writes/s | writes/node per change | operator peak RSS | operator CPU (passes) | planning per pass |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let versus = |ours: Duration, floor: Duration| {
        format!(
            "{:.1} s ({:.1} s, {:.2}x)",
            ours.as_secs_f64(),
            floor.as_secs_f64(),
            ours.as_secs_f64() / floor.as_secs_f64().max(1e-9)
        )
    };
    for row in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {}; {} | {}, {}, {} | {:.0} | {:.2} | {:.0} MiB | {:.1} s ({}) | {:.1} ms |",
            row.nodes,
            row.pools,
            versus(row.apply, row.floor.apply),
            versus(row.change, row.floor.change),
            versus(row.rollout, row.floor.rollout),
            versus(row.drain_wave, row.floor.drain_wave),
            versus(row.apply, row.floor.apply_with_agents),
            versus(row.change, row.floor.change_with_agents),
            row.conflicts[0],
            row.conflicts[1],
            row.conflicts[2],
            row.agent_writes_per_second,
            row.writes_per_node,
            row.peak_rss_mib,
            row.cpu.as_secs_f64(),
            row.passes,
            row.plan.as_secs_f64() * 1e3,
        );
    }
    println!();
    println!(
        "Where the time goes (CPU seconds each process used in the phase; the apiserver's requests in it, most first):"
    );
    println!();
    println!(
        "| nodes | pools | phase | wall | CPU: apiserver, etcd, controller-manager, operator, bench | requests |"
    );
    println!("|---|---|---|---|---|---|");
    for row in &rows {
        for (phase, profile) in &row.profiles {
            let cpu = |role: &str| {
                profile
                    .cpu
                    .get(role)
                    .map_or("-".to_string(), |used| format!("{:.1}", used.as_secs_f64()))
            };
            let mut requests: Vec<(&String, &f64)> = profile.requests.iter().collect();
            requests.sort_by(|a, b| b.1.total_cmp(a.1));
            let requests: Vec<String> = requests
                .iter()
                .take(6)
                .map(|(key, count)| format!("{key} {count:.0}"))
                .collect();
            println!(
                "| {} | {} | {phase} | {:.1} s | {}, {}, {}, {}, {} | {} |",
                row.nodes,
                row.pools,
                profile.wall.as_secs_f64(),
                cpu("apiserver"),
                cpu("etcd"),
                cpu("controller-manager"),
                cpu("operator"),
                cpu("bench"),
                requests.join(", "),
            );
        }
    }
    if !too_many.is_empty() {
        eprintln!("the operator writes more than 3 times per node per change: {too_many:?}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// `HUGEPOOL_FLEET_WRITE_COSTS=1`: what each kind of HugePageNode write
/// costs the apiserver, side by side on one control plane, N of each at 32
/// in flight with no watch open: the spec applied (created, then changed),
/// the status applied as the agent does (server-side apply, forced), the
/// same status change as a JSON merge patch, and as an apply without force;
/// then the spec changed once more, on objects that now carry a status.
async fn write_costs(nodes: usize, root: &Path) {
    let (control_plane, client) = fresh_control_plane(&root.join(format!("costs-{nodes}"))).await;
    let up = control_plane.pid().expect("the control plane runs");
    let api: Api<HugePageNode> = Api::all(client.clone());
    let names: Vec<String> = (0..nodes).map(|i| format!("floor-{i:05}")).collect();
    let time = |what: &'static str, reading: Reading, started: Instant| {
        let client = client.clone();
        async move {
            let profile = reading.finish(&client, started.elapsed()).await;
            println!("{what}: {profile}");
        }
    };
    for (what, pages) in [("spec apply, create", 64), ("spec apply, change", 128)] {
        let reading = Reading::take(&client, up, None).await;
        let started = Instant::now();
        apply_specs(&api, &names, pages, 32).await;
        time(what, reading, started).await;
    }
    let states: Vec<HugePageNode> = futures::stream::iter(&names)
        .map(|name| {
            let api = api.clone();
            async move { api.get(name).await }
        })
        .buffer_unordered(32)
        .try_collect()
        .await
        .expect("read back");
    for (what, kind, pages) in [
        ("status apply (force), first", 0, 128),
        ("status apply (force), change", 0, 100),
        ("status apply (no force), change", 2, 90),
        ("status merge patch, change", 1, 80),
        ("status apply (force), change again", 0, 70),
        ("status merge patch, change again", 1, 60),
    ] {
        let reading = Reading::take(&client, up, None).await;
        let started = Instant::now();
        futures::stream::iter(&states)
            .map(|state| {
                let api = api.clone();
                let name = state.name_any();
                let body = converged_status(state, pages);
                async move {
                    let patch = match kind {
                        0 => {
                            api.patch_status(
                                &name,
                                &PatchParams::apply(AGENT_MANAGER).force(),
                                &Patch::Apply(&body),
                            )
                            .await
                        }
                        1 => {
                            api.patch_status(
                                &name,
                                &PatchParams {
                                    field_manager: Some(AGENT_MANAGER.into()),
                                    ..PatchParams::default()
                                },
                                &Patch::Merge(&body),
                            )
                            .await
                        }
                        _ => {
                            api.patch_status(
                                &name,
                                &PatchParams::apply(AGENT_MANAGER),
                                &Patch::Apply(&body),
                            )
                            .await
                        }
                    };
                    patch.map(|_| ())
                }
            })
            .buffer_unordered(32)
            .try_collect::<Vec<()>>()
            .await
            .expect("status writes");
        time(what, reading, started).await;
    }
    let reading = Reading::take(&client, up, None).await;
    let started = Instant::now();
    apply_specs(&api, &names, 256, 32).await;
    time("spec apply, change (with the status)", reading, started).await;
}
