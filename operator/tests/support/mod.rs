//! A simulated fleet on the real control plane: Node objects, one in-process
//! agent per Node over a `SimulatedKernel`, the operator in-process (each
//! replica on a runtime and thread of its own, like a process), and a
//! watcher that checks the rollout bound on every HugePageNode change.
//!
//! Tests share one control plane and run in parallel, so each fleet has a
//! scope (a unique name): its Nodes and pools carry the scope label, and the
//! fleet's operators get a client that adds that label selector to their
//! lists and watches of Nodes and HugePagePools. To each operator the
//! cluster then holds only its own test's objects, as it would in
//! production.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hugepool_agent::agent::metrics::Metrics as AgentMetrics;
use hugepool_agent::agent::{AgentConfig, Shared};
use hugepool_agent::kernel::{Kernel, SimConfig, SimNode as SimNodeConfig, SimulatedKernel};
use hugepool_crds::{HugePageNode, HugePagePool, PageSize};
use hugepool_e2e::TestEnv;
use hugepool_operator::{Config as OperatorConfig, LeaderConfig};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// The label a test's pools select its nodes by, with the scope label.
pub const ROLE_LABEL: &str = "fleet.hugepool.dev/role";

/// A 2Mi pool of `pages` over the scope's nodes labelled `role`, resized
/// in short steps, rolled out `max_unavailable` at a time.
pub fn pool_spec(
    scope: &str,
    role: &str,
    pages: i64,
    max_unavailable: serde_json::Value,
) -> serde_json::Value {
    json!({
        "nodeSelector": {"matchLabels": {SCOPE_LABEL: scope, ROLE_LABEL: role}},
        "pageSize": "2Mi",
        "pages": pages,
        "resize": {"maxStepDuration": "50ms", "stepPause": "5ms", "stallThreshold": "2s"},
        "rollout": {"maxUnavailable": max_unavailable},
    })
}

/// Label every object of one fleet carries, valued with the fleet's scope.
pub const SCOPE_LABEL: &str = "fleet.hugepool.dev/scope";
pub const MI2: PageSize = PageSize::SIZE_2MI;
pub const GIB: u64 = 1 << 30;

/// Real time slept per simulated second of write cost: a 2048-page grow
/// costs ~25 ms simulated, so ~100 ms real over a handful of writes.
pub const TIME_SCALE: f64 = 4.0;

/// Logs to the test's output, filtered by `RUST_LOG` (default: warnings).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Polls `probe` every 100 ms until it returns `Ok`, or panics after
/// `timeout` naming `what` and the last thing the probe said.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(value) => return value,
            Err(last) => last,
        };
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One simulated node: its kernel, its agent, and the pod cgroups its
/// agent reads what the node's pods request from.
pub struct SimNode {
    pub name: String,
    pub kernel: SimulatedKernel,
    /// The node's cgroup file system as a kubelet leaves it (cgroup v2,
    /// the systemd driver, the hugetlb controller enabled): a fixture tree
    /// the test writes pods' limits into ([`SimNode::set_pod_pages_2mi`]).
    cgroups: Arc<tempfile::TempDir>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// A cgroup v2 tree with the kubelet's `kubepods.slice` and no pod yet.
fn pod_cgroup_tree() -> Arc<tempfile::TempDir> {
    let root = tempfile::tempdir().expect("temp dir");
    hugepool_e2e::KubeletCgroups::create(root.path()).expect("cgroup tree");
    Arc::new(root)
}

impl SimNode {
    /// A pod on this node as its kubelet would have it: a Burstable pod's
    /// cgroup whose 2Mi hugetlb limit is `pages` (its request).
    pub fn set_pod_pages_2mi(&self, uid: &str, pages: u64) {
        self.pod_cgroups()
            .set_pod_pages_2mi(uid, pages)
            .expect("pod's hugetlb limit");
    }

    /// The pod's cgroup goes, as the kubelet removes it when the pod ends.
    pub fn remove_pod(&self, uid: &str) {
        self.pod_cgroups()
            .remove_pod(uid)
            .expect("remove pod cgroup");
    }

    fn pod_cgroups(&self) -> hugepool_e2e::KubeletCgroups {
        hugepool_e2e::KubeletCgroups {
            root: self.cgroups.path().to_path_buf(),
        }
    }

    /// Persistent and surplus 2Mi pages as the simulated kernel has them.
    pub fn pages_2mi(&self) -> (u64, u64) {
        let counts = self.kernel.pool(MI2).expect("simulated 2Mi pool");
        (counts.persistent(), counts.surplus)
    }

    /// Persistent 2Mi pages on each NUMA node, by id.
    pub fn numa_pages_2mi(&self) -> Vec<(u32, u64)> {
        self.kernel
            .numa_pools(MI2)
            .expect("simulated NUMA pools")
            .iter()
            .map(|n| (n.node, n.persistent()))
            .collect()
    }
}

/// An operator replica on a runtime (and thread) of its own, as a separate
/// process would be: killing it drops every task it has, Lease renewal
/// included.
pub struct OperatorHandle {
    /// Where it serves /metrics, if anywhere.
    pub listen: Option<std::net::SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    kill: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OperatorHandle {
    /// Stops it as SIGTERM would (it releases its Lease).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.join().await;
    }

    /// Kills it as a crash would: no clean-up, the Lease is left to expire.
    pub async fn kill(mut self) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        self.join().await;
    }

    async fn join(&mut self) {
        if let Some(thread) = self.thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join());
            tokio::time::timeout(Duration::from_secs(10), joined)
                .await
                .expect("the operator stops within 10s")
                .expect("operator thread joined")
                .expect("the operator did not panic");
        }
    }
}

impl Drop for OperatorHandle {
    fn drop(&mut self) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
    }
}

pub struct Fleet {
    pub client: Client,
    pub scope: String,
    pub nodes: Vec<SimNode>,
    /// The operators started from now on give every Node this selects a
    /// HugePageNode before a pool selects it (`Config::agent_nodes`).
    pub agent_nodes: Option<kube::core::Selector>,
    /// The operators started from now on follow ResourceClaims
    /// (`Config::watch_claims`).
    pub watch_claims: bool,
    kubeconfig: std::path::PathBuf,
    operators: Vec<OperatorHandle>,
    pools: Vec<String>,
}

/// How to build a fleet.
pub struct FleetSpec {
    pub nodes: usize,
    /// Labels every Node gets (besides the scope label).
    pub labels: BTreeMap<String, String>,
    /// Labels of single nodes, by index, on top of `labels`.
    pub node_labels: BTreeMap<usize, BTreeMap<String, String>>,
    pub memory_bytes: u64,
    /// Memory of single nodes, by index, instead of `memory_bytes`.
    pub node_memory: BTreeMap<usize, u64>,
    /// NUMA nodes of single nodes, by index: each one's memory (one NUMA
    /// node of the node's memory otherwise).
    pub numa_memory: BTreeMap<usize, Vec<u64>>,
}

impl FleetSpec {
    pub fn new(nodes: usize) -> Self {
        Self {
            nodes,
            labels: BTreeMap::new(),
            node_labels: BTreeMap::new(),
            memory_bytes: 16 * GIB,
            node_memory: BTreeMap::new(),
            numa_memory: BTreeMap::new(),
        }
    }

    /// Labels nodes `indexes` with `key=value`.
    pub fn label_nodes(mut self, indexes: std::ops::Range<usize>, key: &str, value: &str) -> Self {
        for index in indexes {
            self.node_labels
                .entry(index)
                .or_default()
                .insert(key.into(), value.into());
        }
        self
    }

    /// Gives nodes `indexes` one NUMA node per entry of `memory`, each with
    /// that much memory of its own.
    pub fn numa_nodes(mut self, indexes: std::ops::Range<usize>, memory: &[u64]) -> Self {
        for index in indexes {
            self.numa_memory.insert(index, memory.to_vec());
        }
        self
    }

    pub fn node_memory(mut self, index: usize, bytes: u64) -> Self {
        self.node_memory.insert(index, bytes);
        self
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
}

impl Fleet {
    /// Creates the Nodes and starts one agent per Node (no operator yet).
    pub async fn start(env: &TestEnv, prefix: &str, spec: FleetSpec) -> Fleet {
        init_logging();
        let scope = hugepool_e2e::unique_name(prefix);
        let client = env.client.clone();
        let node_api: Api<Node> = Api::all(client.clone());
        let mut fleet = Fleet {
            client: client.clone(),
            scope: scope.clone(),
            nodes: Vec::new(),
            kubeconfig: env.control_plane.kubeconfig.clone(),
            operators: Vec::new(),
            agent_nodes: None,
            watch_claims: false,
            pools: Vec::new(),
        };
        let names: Vec<String> = (0..spec.nodes)
            .map(|i| format!("{scope}-n{i:02}"))
            .collect();
        let creates = names.iter().enumerate().map(|(index, name)| {
            let mut labels = spec.labels.clone();
            labels.extend(spec.node_labels.get(&index).cloned().unwrap_or_default());
            labels.insert(SCOPE_LABEL.into(), scope.clone());
            let node: Node = serde_json::from_value(json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
            }))
            .expect("Node object");
            let node_api = node_api.clone();
            async move {
                node_api
                    .create(&PostParams::default(), &node)
                    .await
                    .expect("create Node")
            }
        });
        futures::future::join_all(creates).await;
        for (index, name) in names.into_iter().enumerate() {
            let memory = spec.node_memory.get(&index).copied();
            let mut sim = SimConfig::single_node(memory.unwrap_or(spec.memory_bytes));
            if let Some(numa) = spec.numa_memory.get(&index) {
                sim.nodes = numa
                    .iter()
                    .map(|&bytes| SimNodeConfig::unfragmented(bytes))
                    .collect();
            }
            sim.time_scale = TIME_SCALE;
            let kernel = SimulatedKernel::new(sim);
            fleet
                .nodes
                .push(start_agent(&client, &name, kernel, pod_cgroup_tree()));
        }
        fleet
    }

    pub fn node(&self, name: &str) -> &SimNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no simulated node {name}"))
    }

    async fn kube_config(&self) -> kube::Config {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig).expect("kubeconfig");
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("client config")
    }

    /// `SCOPE_LABEL=<scope>`, escaped for a query string.
    fn scope_selector(&self) -> String {
        format!("{SCOPE_LABEL}={}", self.scope)
            .replace('/', "%2F")
            .replace('=', "%3D")
    }

    /// Starts an operator replica; `leader` turns on leader election.
    pub async fn start_operator(&mut self, leader: Option<LeaderConfig>) -> usize {
        self.start_operator_serving(leader, None).await
    }

    /// Starts the one replica of the scope's namespace (created here), with
    /// leader election on a 3 s Lease (1 s grace) and /metrics on a free
    /// port.
    pub async fn start_leading_replica(&mut self) -> LeadingReplica {
        create_namespace(&self.client, &self.scope).await;
        let replica = LeadingReplica {
            lease: "hugepool-operator".to_string(),
            identity: format!("{}-replica", self.scope),
            addr: format!("127.0.0.1:{}", hugepool_e2e::free_port()),
        };
        let leader = LeaderConfig {
            namespace: self.scope.clone(),
            lease_name: replica.lease.clone(),
            identity: replica.identity.clone(),
            duration: Duration::from_secs(3),
            grace: Duration::from_secs(1),
        };
        let listen = replica.addr.parse().expect("address");
        self.start_operator_serving(Some(leader), Some(listen))
            .await;
        replica
    }

    /// Starts an operator replica that serves /metrics on `listen`.
    pub async fn start_operator_serving(
        &mut self,
        leader: Option<LeaderConfig>,
        listen: Option<std::net::SocketAddr>,
    ) -> usize {
        self.start_operator_at(leader, listen, None).await
    }

    /// Starts an operator replica that reaches the apiserver at `url` (a
    /// proxy), not where the kubeconfig says.
    pub async fn start_operator_through(
        &mut self,
        leader: Option<LeaderConfig>,
        url: http::Uri,
    ) -> usize {
        self.start_operator_at(leader, None, Some(url)).await
    }

    /// The apiserver's address, as the kubeconfig gives it.
    pub async fn apiserver_addr(&self) -> std::net::SocketAddr {
        let url = self.kube_config().await.cluster_url;
        let host = url.host().expect("apiserver host");
        let port = url.port_u16().unwrap_or(443);
        format!("{host}:{port}").parse().expect("apiserver address")
    }

    async fn start_operator_at(
        &mut self,
        leader: Option<LeaderConfig>,
        listen: Option<std::net::SocketAddr>,
        url: Option<http::Uri>,
    ) -> usize {
        let index = self.operators.len();
        let config = OperatorConfig {
            listen,
            leader,
            instance: format!("{}-operator-{index}", self.scope),
            resync: Duration::from_secs(60),
            agent_nodes: self.agent_nodes.clone(),
            watch_claims: self.watch_claims,
        };
        let mut kube_config = self.kube_config().await;
        if let Some(url) = url {
            kube_config.cluster_url = url;
        }
        let selector = self.scope_selector();
        let (stop, stopped) = oneshot::channel::<()>();
        let (kill, killed) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("operator runtime");
            runtime.block_on(async move {
                let client = scoped_client(kube_config, selector);
                let shutdown = async move {
                    let _ = stopped.await;
                };
                tokio::select! {
                    result = hugepool_operator::run(client, config, shutdown) => {
                        if let Err(err) = result {
                            panic!("operator failed: {err}");
                        }
                    }
                    _ = killed => {}
                }
            });
            // Dropping the runtime cancels every task the operator left.
            runtime.shutdown_background();
        });
        self.operators.push(OperatorHandle {
            listen,
            stop: Some(stop),
            kill: Some(kill),
            thread: Some(thread),
        });
        index
    }

    /// A counter of operator replica `index`'s /metrics (`name` with its
    /// labels, as exposed), summed over its series; None when it serves no
    /// metrics or cannot be read.
    pub fn operator_counter(&self, index: usize, name: &str) -> Option<f64> {
        let addr = self.operators.get(index)?.listen?;
        let text = hugepool_e2e::http_get(&addr.to_string(), "/metrics").ok()?;
        Some(
            text.lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum(),
        )
    }

    /// Takes an operator replica out of the fleet (to stop or kill it).
    pub fn take_operator(&mut self, index: usize) -> OperatorHandle {
        self.operators.remove(index)
    }

    /// Creates the fleet's pool, `<scope>-pool`, from the JSON `spec` and
    /// waits until it is Available; returns its name.
    pub async fn create_available_pool(&mut self, spec: serde_json::Value) -> String {
        let pool = format!("{}-pool", self.scope);
        self.create_pool(&pool, spec).await;
        self.wait_pool(&pool, "Available", "True", Duration::from_secs(120), |_| {
            Ok(())
        })
        .await;
        pool
    }

    /// Creates a HugePagePool named `name` (the scope label added) from the
    /// JSON `spec`; returns it as created.
    pub async fn create_pool(&mut self, name: &str, spec: serde_json::Value) -> HugePagePool {
        let pool: HugePagePool = serde_json::from_value(json!({
            "apiVersion": "hugepool.dev/v1alpha1",
            "kind": "HugePagePool",
            "metadata": {"name": name, "labels": {SCOPE_LABEL: self.scope}},
            "spec": spec,
        }))
        .expect("HugePagePool object");
        self.pools.push(name.to_string());
        self.pool_api()
            .create(&PostParams::default(), &pool)
            .await
            .expect("create HugePagePool")
    }

    pub fn node_name(&self, index: usize) -> String {
        self.nodes[index].name.clone()
    }

    pub async fn pool(&self, name: &str) -> HugePagePool {
        self.pool_api().get(name).await.expect("get HugePagePool")
    }

    pub async fn node_state(&self, name: &str) -> HugePageNode {
        Api::<HugePageNode>::all(self.client.clone())
            .get(name)
            .await
            .expect("get HugePageNode")
    }

    pub async fn node_object(&self, name: &str) -> Node {
        Api::<Node>::all(self.client.clone())
            .get(name)
            .await
            .expect("get Node")
    }

    pub fn pool_api(&self) -> Api<HugePagePool> {
        Api::all(self.client.clone())
    }

    /// Merge-patches a pool's spec; returns the new generation.
    pub async fn patch_pool(&self, name: &str, spec: serde_json::Value) -> i64 {
        let patched = self
            .pool_api()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": spec })),
            )
            .await
            .expect("patch HugePagePool");
        patched.metadata.generation.unwrap_or_default()
    }

    /// Merge-patches a Node's labels (`None` removes one).
    pub async fn label_node(&self, name: &str, labels: serde_json::Value) {
        Api::<Node>::all(self.client.clone())
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await
            .expect("label Node");
    }

    /// Waits until the pool's `type_` condition has `status` at its current
    /// generation and `check` accepts the pool; returns the pool.
    pub async fn wait_pool(
        &self,
        name: &str,
        type_: &str,
        status: &str,
        timeout: Duration,
        check: impl Fn(&HugePagePool) -> Result<(), String>,
    ) -> HugePagePool {
        let api = self.pool_api();
        wait_for(
            &format!("pool {name} {type_}={status}"),
            timeout,
            || async {
                let pool = api.get(name).await.map_err(|e| e.to_string())?;
                let generation = pool.metadata.generation;
                let status_ = pool.status.clone().unwrap_or_default();
                let condition = condition(&status_.conditions, type_)
                    .ok_or_else(|| format!("no {type_} condition: {status_:?}"))?;
                if status_.observed_generation != generation
                    || condition.status != status
                    || condition.observed_generation != generation
                {
                    return Err(format!(
                        "generation {generation:?}, status {:?}",
                        pool.status
                    ));
                }
                check(&pool)?;
                Ok(pool)
            },
        )
        .await
    }

    /// Waits until every simulated node in `names` holds `pages` persistent
    /// 2Mi pages and no surplus.
    pub async fn wait_kernels(&self, names: &[String], pages: u64, timeout: Duration) {
        wait_for(
            &format!("{} kernels at {pages} x 2Mi", names.len()),
            timeout,
            || async {
                let off: Vec<String> = names
                    .iter()
                    .map(|name| (name, self.node(name).pages_2mi()))
                    .filter(|(_, counts)| *counts != (pages, 0))
                    .map(|(name, counts)| format!("{name}={counts:?}"))
                    .collect();
                if off.is_empty() {
                    Ok(())
                } else {
                    Err(format!("not there: {off:?}"))
                }
            },
        )
        .await;
    }

    /// Stops `name`'s agent, as on a node whose agent went down; its
    /// kernel keeps what it holds.
    pub async fn stop_agent(&mut self, name: &str) {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.name == name)
            .expect("a node of the fleet");
        let _ = node.stop.send(true);
        let _ = (&mut node.task).await;
    }

    /// Starts `name`'s agent again, over the same kernel.
    pub fn restart_agent(&mut self, name: &str) {
        let index = self
            .nodes
            .iter()
            .position(|n| n.name == name)
            .expect("a node of the fleet");
        let kernel = self.nodes[index].kernel.clone();
        let cgroups = Arc::clone(&self.nodes[index].cgroups);
        self.nodes[index] = start_agent(&self.client, name, kernel, cgroups);
    }

    /// Sets the Node's Ready condition as a kubelet (or the node lifecycle
    /// controller) would, changed now.
    pub async fn set_ready(&self, name: &str, ready: bool) {
        let now = jiff::Timestamp::now().to_string();
        let (status, reason) = if ready {
            ("True", "KubeletReady")
        } else {
            ("False", "NodeStatusUnknown")
        };
        let nodes: Api<Node> = Api::all(self.client.clone());
        nodes
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": [{
                    "type": "Ready", "status": status, "reason": reason,
                    "message": "set by the test", "lastTransitionTime": now,
                    "lastHeartbeatTime": now,
                }]}})),
            )
            .await
            .expect("Node Ready condition");
    }

    pub fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// A watcher of this fleet's HugePageNodes that checks `limit` after
    /// every change (see [`RolloutWatch`]).
    pub fn watch_rollout(&self, limit: usize) -> RolloutWatch {
        RolloutWatch::start(self.client.clone(), format!("{}-", self.scope), limit)
    }

    /// Stops the operators and agents and deletes what the fleet created
    /// (pools lose their finalizer first; HugePageNodes go with their Node).
    pub async fn shutdown(mut self) {
        for operator in std::mem::take(&mut self.operators) {
            operator.stop().await;
        }
        for node in &self.nodes {
            let _ = node.stop.send(true);
        }
        for node in std::mem::take(&mut self.nodes) {
            let _ = tokio::time::timeout(Duration::from_secs(10), node.task).await;
        }
        let pools = self.pool_api();
        for name in &self.pools {
            let _ = pools
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                )
                .await;
            let _ = pools.delete(name, &DeleteParams::default()).await;
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        let _ = nodes
            .delete_collection(
                &DeleteParams::default(),
                &kube::api::ListParams::default().labels(&format!("{SCOPE_LABEL}={}", self.scope)),
            )
            .await;
    }
}

/// A client that sees only the Nodes and HugePagePools matching
/// `selector` in lists and watches (see the module docs).
fn scoped_client(mut config: kube::Config, selector: String) -> Client {
    // As the operator's main builds it (see `hugepool_operator::run`).
    config.default_retry = false;
    let layer = tower::util::MapRequestLayer::new(move |request| {
        scope_collection_reads(request, &selector)
    });
    ClientBuilder::try_from(config)
        .expect("client builder")
        .with_layer(&layer)
        .build()
}

/// Adds the fleet's label selector to list and watch requests of Nodes and
/// HugePagePools (a named get or any write passes unchanged).
fn scope_collection_reads(
    mut request: http::Request<kube::client::Body>,
    selector: &str,
) -> http::Request<kube::client::Body> {
    const SCOPED: [&str; 2] = ["/api/v1/nodes", "/apis/hugepool.dev/v1alpha1/hugepagepools"];
    let uri = request.uri().clone();
    if request.method() != http::Method::GET || !SCOPED.contains(&uri.path()) {
        return request;
    }
    let query = uri.query().unwrap_or_default();
    if query.contains("labelSelector=") {
        return request;
    }
    let separator = if query.is_empty() { "" } else { "&" };
    let path_and_query = format!("{}?{query}{separator}labelSelector={selector}", uri.path());
    let mut parts = uri.into_parts();
    parts.path_and_query = Some(path_and_query.parse().expect("path and query"));
    *request.uri_mut() = http::Uri::from_parts(parts).expect("scoped URI");
    request
}

fn start_agent(
    client: &Client,
    name: &str,
    kernel: SimulatedKernel,
    cgroups: Arc<tempfile::TempDir>,
) -> SimNode {
    let mut config = AgentConfig::new(name);
    config.pod_cgroups = Some(cgroups.path().to_path_buf());
    config.pod_cgroups_interval = Duration::from_millis(200);
    config.kernel_release = "6.18.0-simulated".into();
    config.min_patch_interval = Duration::from_millis(500);
    config.refresh_interval = Duration::from_secs(1);
    config.blocked_poll = Duration::from_millis(200);
    config.retry_interval = Duration::from_secs(3600);
    config.kubelet_restart_command = Vec::new();
    config.kmsg_path = None;
    let mut registry = prometheus_client::registry::Registry::default();
    let shared = Shared::new(AgentMetrics::register(&mut registry));
    let (stop, stopped) = watch::channel(false);
    let dyn_kernel: Arc<dyn Kernel> = Arc::new(kernel.clone());
    let client = client.clone();
    let node = name.to_string();
    let task = tokio::spawn(async move {
        if let Err(err) =
            hugepool_agent::agent::run(client, dyn_kernel, config, shared, stopped).await
        {
            panic!("agent {node} failed: {err}");
        }
    });
    SimNode {
        name: name.to_string(),
        kernel,
        cgroups,
        stop,
        task,
    }
}

/// Whether `state` reports its `entry` converged, by the contract in
/// docs/design.md: the agent has seen this generation and reports the
/// target, reached as `PageSizeTarget::reached_by` defines it.
pub fn entry_converged(state: &HugePageNode, size: PageSize, pages: i64) -> bool {
    let Some(status) = &state.status else {
        return false;
    };
    let Some(entry) = state.spec.page_sizes.iter().find(|e| e.size == size) else {
        return false;
    };
    let generation = state.metadata.generation.unwrap_or(0);
    entry.pages == pages
        && status.observed_generation.is_some_and(|g| g >= generation)
        && status
            .page_sizes
            .iter()
            .any(|reported| reported.target == Some(pages) && entry.reached_by(reported))
}

/// Nodes changing per (pool, size) in one consistent view of the fleet.
pub fn changing(
    states: &BTreeMap<String, HugePageNode>,
) -> BTreeMap<(String, PageSize), Vec<String>> {
    let mut changing: BTreeMap<(String, PageSize), Vec<String>> = BTreeMap::new();
    for (name, state) in states {
        for entry in &state.spec.page_sizes {
            if !entry_converged(state, entry.size, entry.pages) {
                changing
                    .entry((entry.pool.clone(), entry.size))
                    .or_default()
                    .push(name.clone());
            }
        }
    }
    changing
}

/// What the rollout watcher saw.
#[derive(Clone, Debug, Default)]
pub struct RolloutRecord {
    /// Views checked (one per HugePageNode change).
    pub views: u64,
    /// The most nodes changing at once, per (pool, size).
    pub max_changing: BTreeMap<(String, PageSize), usize>,
    /// Views with more than the limit changing, as (pool, size, nodes).
    pub violations: Vec<(String, PageSize, Vec<String>)>,
    /// (pool, node) in the order the nodes' specs first carried the pool.
    pub first_targeted: Vec<(String, String)>,
}

/// Watches the fleet's HugePageNodes and, after every event, counts the
/// nodes changing per (pool, size) in the store: each event carries one
/// etcd revision, so every view checked is one the cluster really had.
pub struct RolloutWatch {
    record: Arc<Mutex<RolloutRecord>>,
    limit: watch::Sender<usize>,
    synced: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

impl RolloutWatch {
    fn start(client: Client, prefix: String, limit: usize) -> RolloutWatch {
        let record = Arc::new(Mutex::new(RolloutRecord::default()));
        let (limit_tx, limit_rx) = watch::channel(limit);
        let (synced_tx, synced_rx) = watch::channel(false);
        let task = tokio::spawn({
            let record = record.clone();
            async move {
                let api: Api<HugePageNode> = Api::all(client);
                let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
                let mut states: BTreeMap<String, HugePageNode> = BTreeMap::new();
                let mut listing: BTreeMap<String, HugePageNode> = BTreeMap::new();
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(watcher::Event::Init) => listing.clear(),
                        Ok(watcher::Event::InitApply(state)) => {
                            if state.name_any().starts_with(&prefix) {
                                listing.insert(state.name_any(), state);
                            }
                        }
                        Ok(watcher::Event::InitDone) => {
                            states = std::mem::take(&mut listing);
                            let _ = synced_tx.send(true);
                        }
                        Ok(watcher::Event::Apply(state)) => {
                            if !state.name_any().starts_with(&prefix) {
                                continue;
                            }
                            states.insert(state.name_any(), state);
                        }
                        Ok(watcher::Event::Delete(state)) => {
                            if states.remove(&state.name_any()).is_none() {
                                continue;
                            }
                        }
                        Err(err) => {
                            // A broken watch restarts with a fresh list.
                            eprintln!("rollout watch: {err}");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                    }
                    let limit = *limit_rx.borrow();
                    let mut record = record.lock().unwrap_or_else(|p| p.into_inner());
                    record.views += 1;
                    for (name, state) in &states {
                        for entry in &state.spec.page_sizes {
                            let key = (entry.pool.clone(), name.clone());
                            if !record.first_targeted.contains(&key) {
                                record.first_targeted.push(key);
                            }
                        }
                    }
                    for ((pool, size), nodes) in changing(&states) {
                        let max = record.max_changing.entry((pool.clone(), size)).or_default();
                        *max = (*max).max(nodes.len());
                        if nodes.len() > limit {
                            record.violations.push((pool, size, nodes));
                        }
                    }
                }
            }
        });
        RolloutWatch {
            record,
            limit: limit_tx,
            synced: synced_rx,
            task,
        }
    }

    /// Waits until the watcher has listed the fleet's HugePageNodes.
    pub async fn synced(&mut self) {
        tokio::time::timeout(Duration::from_secs(30), self.synced.wait_for(|s| *s))
            .await
            .expect("rollout watch listed within 30s")
            .expect("rollout watch running");
    }

    /// Changes the bound (only while no node is changing).
    pub fn set_limit(&self, limit: usize) {
        let _ = self.limit.send(limit);
    }

    pub fn record(&self) -> RolloutRecord {
        self.record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Asserts that the watch saw nodes changing, and no view with more
    /// than the limit changing; returns the record.
    pub fn assert_bounded(&self) -> RolloutRecord {
        let record = self.record();
        // A watch that saw nothing change proves no bound.
        assert!(
            record.max_changing.values().any(|&nodes| nodes > 0),
            "the rollout watch saw no node changing in {} views: nothing was checked",
            record.views
        );
        assert!(
            record.violations.is_empty(),
            "more than maxUnavailable nodes changing at once: {:?}",
            &record.violations[..record.violations.len().min(5)]
        );
        record
    }
}

impl Drop for RolloutWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Creates a namespace (for pods, PDBs or a Lease).
/// What `Fleet::start_leading_replica` started: its Lease's name, its
/// identity and where it serves /metrics.
pub struct LeadingReplica {
    pub lease: String,
    pub identity: String,
    pub addr: String,
}

pub async fn create_namespace(client: &Client, name: &str) {
    let namespace: Namespace = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name},
    }))
    .expect("Namespace object");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create Namespace");
}

pub async fn delete_namespace(client: &Client, name: &str) {
    let _ = Api::<Namespace>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await;
}

/// The condition of `type_` (pool and node condition types alike).
pub fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the Node has the `hugepool.dev/draining` taint.
pub fn has_drain_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == hugepool_crds::DRAINING_TAINT))
}

/// A pod bound to `node` (no scheduler runs), asking for `hugepages_2mi`
/// (e.g. "600Mi") when given; hugepages need requests == limits and a
/// memory or cpu request.
pub fn pod(name: &str, node: &str, app: &str, hugepages_2mi: Option<&str>) -> Pod {
    let mut resources =
        json!({"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "32Mi"}});
    if let Some(amount) = hugepages_2mi {
        resources["requests"]["hugepages-2Mi"] = json!(amount);
        resources["limits"]["hugepages-2Mi"] = json!(amount);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": false,
            "containers": [{"name": "main", "image": "registry.example/app:1", "resources": resources}],
        },
    }))
    .expect("Pod object")
}

/// Creates the pod (retrying while the namespace's ServiceAccount is not
/// there yet) and marks it Running and Ready, as kubelet would.
pub async fn run_pod(client: &Client, namespace: &str, pod: Pod) -> Pod {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let name = pod.name_any();
    wait_for(
        &format!("pod {namespace}/{name} created"),
        Duration::from_secs(30),
        || async {
            api.create(&PostParams::default(), &pod)
                .await
                .map_err(|e| e.to_string())
        },
    )
    .await;
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        }})),
    )
    .await
    .expect("pod Running and Ready")
}

/// A TCP proxy in front of the apiserver that can hold what clients send:
/// while held, it reads their bytes and keeps them; released, it forwards
/// them (and a client's close after them). Answers always pass. It can
/// also cut every connection open through it (watches included).
pub struct HoldingProxy {
    pub addr: std::net::SocketAddr,
    hold: watch::Sender<bool>,
    /// Bumped to close every connection open at that moment.
    cuts: watch::Sender<u64>,
    /// Set: bytes clients send are dropped, not forwarded (see
    /// [`HoldingProxy::release_held_only`]).
    discard: Arc<std::sync::atomic::AtomicBool>,
    /// Connections accepted so far.
    connections: Arc<std::sync::atomic::AtomicUsize>,
    /// Bytes read from clients while held and not forwarded yet.
    held: Arc<std::sync::atomic::AtomicUsize>,
    task: JoinHandle<()>,
}

impl HoldingProxy {
    pub async fn start(upstream: std::net::SocketAddr) -> HoldingProxy {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (hold, holding) = watch::channel(false);
        let (cuts, _) = watch::channel(0u64);
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&held);
        let (cut_sender, accepted) = (cuts.clone(), Arc::clone(&connections));
        let discard = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let dropping = Arc::clone(&discard);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                let mut cut = cut_sender.subscribe();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let answers = async move {
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                };
                let mut holding = holding.clone();
                let counter = Arc::clone(&counter);
                let dropping = Arc::clone(&dropping);
                let requests = async move {
                    let mut buffer = vec![0u8; 16 * 1024];
                    loop {
                        let read = match client_read.read(&mut buffer).await {
                            Ok(0) | Err(_) => break,
                            Ok(read) => read,
                        };
                        let was_held = *holding.borrow();
                        if was_held {
                            counter.fetch_add(read, Ordering::SeqCst);
                        }
                        if holding.wait_for(|held| !held).await.is_err() {
                            break;
                        }
                        if was_held {
                            counter.fetch_sub(read, Ordering::SeqCst);
                        } else if dropping.load(Ordering::SeqCst) {
                            continue;
                        }
                        if server_write.write_all(&buffer[..read]).await.is_err() {
                            break;
                        }
                    }
                    if dropping.load(Ordering::SeqCst) {
                        // A client's close is dropped too: the server keeps
                        // the connection (and the request on it) until a cut.
                        std::future::pending::<()>().await;
                    }
                    let _ = server_write.shutdown().await;
                };
                // A cut drops both directions: both sockets close.
                tokio::spawn(async move {
                    tokio::select! {
                        _ = async { tokio::join!(answers, requests) } => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        HoldingProxy {
            addr,
            hold,
            cuts,
            discard,
            connections,
            held,
            task,
        }
    }

    /// Forwards what is held (the first bytes each held connection sent
    /// after the hold; what followed them is still in the socket) and drops
    /// everything clients send after: a request that was held arrives, and
    /// whatever its client sent later (an HTTP/2 stream reset when it gave
    /// up waiting) never does. As a write delayed in the network past its
    /// sender's timeout would land.
    pub fn release_held_only(&self) {
        self.discard
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.release();
    }

    /// Closes every connection open through the proxy now; clients that
    /// connect again pass as before.
    pub fn cut(&self) {
        self.cuts.send_modify(|cuts| *cuts += 1);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `https://` and the proxy's address (the apiserver's certificate is
    /// for 127.0.0.1, so TLS holds through it).
    pub fn url(&self) -> http::Uri {
        format!("https://{}", self.addr).parse().expect("proxy URL")
    }

    pub fn hold(&self) {
        self.hold.send_replace(true);
    }

    pub fn release(&self) {
        self.hold.send_replace(false);
    }

    /// Bytes clients sent while held that are not forwarded yet.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the harness, playing kubelet, did with evicted pods.
#[derive(Clone, Debug, Default)]
pub struct KubeletRecord {
    /// (pod, whether the drain taint was on its Node when it was evicted).
    pub evicted: Vec<(String, bool)>,
}

/// Plays kubelet for the pods of `namespace`: a pod the operator evicted
/// (terminating) gets its held pages released on its simulated kernel, as
/// the process exiting would, and is then force-deleted.
pub fn play_kubelet(
    fleet: &Fleet,
    namespace: &str,
    held: Vec<(String, String, u64)>,
) -> (Arc<Mutex<KubeletRecord>>, tokio::task::JoinHandle<()>) {
    let record = Arc::new(Mutex::new(KubeletRecord::default()));
    let pods: Api<Pod> = Api::namespaced(fleet.client.clone(), namespace);
    let nodes: Api<Node> = Api::all(fleet.client.clone());
    let kernels: Vec<(String, SimulatedKernel)> = fleet
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.kernel.clone()))
        .collect();
    let task = tokio::spawn({
        let record = record.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Ok(list) = pods.list(&ListParams::default()).await else {
                    continue;
                };
                for pod in list.items {
                    if pod.metadata.deletion_timestamp.is_none() {
                        continue;
                    }
                    let name = pod.name_any();
                    let node = pod
                        .spec
                        .as_ref()
                        .and_then(|s| s.node_name.clone())
                        .unwrap_or_default();
                    let tainted = nodes.get(&node).await.is_ok_and(|n| has_drain_taint(&n));
                    // Recorded before the pages come back: a test that
                    // waits for the shrink then reads the record.
                    record
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .evicted
                        .push((name.clone(), tainted));
                    for (pod_name, node_name, pages) in &held {
                        if *pod_name == name
                            && let Some((_, kernel)) = kernels.iter().find(|(n, _)| n == node_name)
                        {
                            kernel
                                .release_pages(MI2, 0, *pages)
                                .expect("release held pages");
                        }
                    }
                    let _ = pods
                        .delete(
                            &name,
                            &DeleteParams {
                                grace_period_seconds: Some(0),
                                ..DeleteParams::default()
                            },
                        )
                        .await;
                }
            }
        }
    });
    (record, task)
}

/// A validating admission webhook for `pods/eviction` in one namespace
/// (`controlplane webhook`, registered on the real apiserver), steered
/// through its mode file: `allow`, `delay=20s`, `hang`, `deny-real`,
/// `delay-real=8s`.
pub struct EvictionWebhook {
    name: String,
    dir: tempfile::TempDir,
    process: std::process::Child,
}

impl EvictionWebhook {
    /// Starts the webhook in `mode` and registers it for the evictions of
    /// `namespace`'s pods, with the apiserver's longest timeout (30 s),
    /// `failurePolicy: Fail` and `sideEffects: None` (so dry runs reach it).
    pub async fn start(env: &TestEnv, namespace: &str, mode: &str) -> EvictionWebhook {
        Self::start_for(
            env,
            &format!("{namespace}-evictions"),
            mode,
            json!({
                "rules": [{
                    "operations": ["CREATE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods/eviction"],
                }],
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": namespace},
                },
                "timeoutSeconds": 30,
            }),
        )
        .await
    }

    /// Starts the webhook in `mode` and registers it as `name` for what
    /// `matching` says (its rules, selectors, match conditions and
    /// timeout), `failurePolicy: Fail`, `sideEffects: None`.
    pub async fn start_for(
        env: &TestEnv,
        name: &str,
        mode: &str,
        matching: serde_json::Value,
    ) -> EvictionWebhook {
        let dir = tempfile::tempdir().expect("webhook dir");
        std::fs::write(dir.path().join("mode"), mode).expect("mode");
        let data_dir = env
            .control_plane
            .kubeconfig
            .parent()
            .expect("the control plane's data dir");
        let process =
            std::process::Command::new(hugepool_e2e::controlplane_bin_dir().join("controlplane"))
                .arg("webhook")
                .arg("--data-dir")
                .arg(data_dir)
                .arg("--dir")
                .arg(dir.path())
                .stderr(std::fs::File::create(dir.path().join("log")).expect("log"))
                .spawn()
                .expect("controlplane webhook (make controlplane)");
        let addr_file = dir.path().join("addr");
        let addr = wait_for("the webhook listening", Duration::from_secs(30), || {
            let addr = std::fs::read_to_string(&addr_file);
            async move { addr.map_err(|e| e.to_string()) }
        })
        .await;
        let ca =
            std::fs::read(data_dir.join("pki").join("ca.crt")).expect("the control plane's CA");
        let mut webhook = json!({
            "name": "steered.faults.hugepool.dev",
            "clientConfig": {
                "url": format!("https://{addr}/evict"),
                "caBundle": k8s_openapi::ByteString(ca),
            },
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
        });
        for (key, value) in matching.as_object().expect("an object") {
            webhook[key] = value.clone();
        }
        let config: k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration =
            serde_json::from_value(json!({
                "metadata": {"name": name},
                "webhooks": [webhook],
            }))
            .expect("a webhook configuration");
        let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
            Api::all(env.client.clone());
        api.create(&PostParams::default(), &config)
            .await
            .expect("webhook registered");
        EvictionWebhook {
            name: name.to_string(),
            dir,
            process,
        }
    }

    pub fn set_mode(&self, mode: &str) {
        let path = self.dir.path().join("mode");
        let next = self.dir.path().join("mode.next");
        std::fs::write(&next, mode).expect("mode");
        std::fs::rename(next, path).expect("mode");
    }

    /// What it was asked, in order: "dryRun=BOOL namespace/pod mode".
    pub fn requests(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("requests"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Unregisters it (the apiserver stops calling it at once).
    pub async fn remove(&self, client: &Client) {
        let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
            Api::all(client.clone());
        let _ = api.delete(&self.name, &DeleteParams::default()).await;
    }
}

impl Drop for EvictionWebhook {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// Makes the API server fail (500: "failed calling webhook", the webhook's
/// address refuses connections) every write of `resource` (e.g.
/// `hugepagepools/status`) in group `group` whose object carries `label`
/// (key, value), until [`stop_failing_writes`] of the returned name.
pub async fn fail_writes(
    client: &Client,
    label: (&str, &str),
    group: &str,
    resource: &str,
) -> String {
    let name = format!("{}-fail-writes", label.1);
    let closed = format!("127.0.0.1:{}", hugepool_e2e::free_port());
    let config: k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration =
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "webhooks": [{
                "name": "fail-writes.faults.hugepool.dev",
                "clientConfig": {"url": format!("https://{closed}/fail")},
                "rules": [{
                    "operations": ["CREATE", "UPDATE"],
                    "apiGroups": [group],
                    "apiVersions": ["*"],
                    "resources": [resource],
                    "scope": "*",
                }],
                "objectSelector": {"matchLabels": {label.0: label.1}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "timeoutSeconds": 5,
                "admissionReviewVersions": ["v1"],
            }],
        }))
        .expect("a webhook configuration");
    let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(client.clone());
    api.create(&PostParams::default(), &config)
        .await
        .expect("failing webhook registered");
    name
}

/// Ends what [`fail_writes`] started.
pub async fn stop_failing_writes(client: &Client, name: &str) {
    let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(client.clone());
    api.delete(name, &DeleteParams::default())
        .await
        .expect("failing webhook removed");
}

/// Who holds the Lease `name` in `namespace`, if anyone.
pub async fn lease_holder(client: &Client, namespace: &str, name: &str) -> Option<String> {
    Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

/// A control plane of the test's own (which it may stop, kill and start
/// again) with the CRDs installed, in a new directory named after
/// `prefix`; returns it, its test environment and the directory.
pub async fn own_control_plane(
    prefix: &str,
) -> (hugepool_e2e::OwnedControlPlane, TestEnv, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(hugepool_e2e::unique_name(prefix));
    let own = hugepool_e2e::OwnedControlPlane::start(&dir).expect("a private control plane");
    let client = own.control_plane.client().await.expect("client");
    hugepool_e2e::install_crds(client.clone())
        .await
        .expect("CRDs");
    let env = TestEnv {
        control_plane: Box::leak(Box::new(hugepool_e2e::ControlPlane {
            kubeconfig: own.control_plane.kubeconfig.clone(),
        })),
        client,
    };
    (own, env, dir)
}
