//! The dashboard and the alerts against a real Prometheus: it scrapes the
//! operator and the agent (the release binaries `make images` builds) while
//! they run a pool on the real control plane and this machine's kernel, and
//! every panel query of charts/hugepool/dashboards/hugepool.json and every
//! alert expression of the chart's PrometheusRule returns series.
//!
//! The pool grows twice (so rates and the step-latency histogram have an
//! increase in their window) and is then held below its target by a
//! minMemAvailable guard larger than the node's memory (so the shortfall
//! table has a row). An alert is queried without its final threshold
//! ([`compared_queries`]); a panel's `or vector(0)` fallback is dropped,
//! since it makes any query look non-empty.
//!
//! Needs root (the 2Mi pool is written, and restored afterwards), the
//! binaries of `make images`, and helm and prometheus from `hack/helm.sh`
//! and `hack/prometheus.sh`; outside CI the test skips (saying why) when one
//! is missing, under `CI=true` it fails.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::FutureExt;
use hugepool_crds::{HugePageNode, HugePagePool};
use hugepool_e2e::{
    KubeletCgroups, free_port, http_get, in_ci_mode, lock_machine_kernel, setup, unique_name,
};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const SYSFS_2MI: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";
/// The namespace and agent PodMonitor the chart's default install creates;
/// the Prometheus Operator names a PodMonitor's job `namespace/name`.
const NAMESPACE: &str = "hugepool-system";
const AGENT_JOB: &str = "hugepool-system/hugepool-agent";
/// A ServiceMonitor's job is the Service's name.
const OPERATOR_JOB: &str = "hugepool-operator-metrics";
/// Grafana's `$__rate_interval` at the chart's 30s scrape interval (four
/// scrapes); it also leaves the test two minutes after the last grow.
const RATE_INTERVAL: &str = "2m";
/// Generous: the VM is slow and other builds may share it.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(180);
/// Pages of 2Mi the one pod in the agent's cgroup tree requests.
const REQUESTED_PAGES: u64 = 10;
const PAGE_2MI: u64 = 2 * 1024 * 1024;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// Skips (outside CI) or fails (under CI=true) for a missing prerequisite.
fn missing(why: &str) {
    if in_ci_mode() {
        panic!("CI=true and {why}");
    }
    eprintln!("skipping: {why}");
}

/// Where hack/images.sh (`make images`) builds the static binaries.
fn release_binary(name: &str) -> Result<PathBuf, String> {
    let target = format!("{}-unknown-linux-musl", std::env::consts::ARCH);
    let path = repo()
        .join("target")
        .join(target)
        .join("release")
        .join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("no {} (run `make images`)", path.display()))
    }
}

struct Tools {
    helm: PathBuf,
    prometheus: PathBuf,
    operator: PathBuf,
    agent: PathBuf,
}

impl Tools {
    fn find() -> Result<Tools, String> {
        Ok(Tools {
            helm: hugepool_e2e::hack_tool("helm.sh", &[])?,
            prometheus: hugepool_e2e::hack_tool("prometheus.sh", &["prometheus"])?,
            operator: release_binary("hugepool-operator")?,
            agent: release_binary("hugepool-agent")?,
        })
    }
}

/// The machine's 2Mi pool, held for this test alone and set back to what it
/// was when dropped (after the agent has stopped: declare it first).
struct Kernel2Mi {
    saved: u64,
    _lock: std::fs::File,
}

impl Kernel2Mi {
    fn acquire() -> Result<Kernel2Mi, String> {
        let lock = lock_machine_kernel();
        let saved = read_sysfs("nr_hugepages")?;
        write_sysfs("nr_hugepages", 0)?;
        // Pages someone uses stay: the resize counts below would be off.
        match read_sysfs("nr_hugepages")? {
            0 => Ok(Kernel2Mi { saved, _lock: lock }),
            left => {
                let _ = write_sysfs("nr_hugepages", saved);
                Err(format!("the 2Mi pool keeps {left} pages in use"))
            }
        }
    }
}

impl Drop for Kernel2Mi {
    fn drop(&mut self) {
        if let Err(e) = write_sysfs("nr_hugepages", self.saved) {
            eprintln!("could not restore the 2Mi pool to {}: {e}", self.saved);
        }
    }
}

fn read_sysfs(file: &str) -> Result<u64, String> {
    let path = Path::new(SYSFS_2MI).join(file);
    std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .trim()
        .parse()
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn write_sysfs(file: &str, value: u64) -> Result<(), String> {
    let path = Path::new(SYSFS_2MI).join(file);
    std::fs::write(&path, value.to_string()).map_err(|e| format!("{}: {e}", path.display()))
}

/// A process this test started, killed when dropped; its output goes to `log`.
struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn start(name: &'static str, command: &mut Command, dir: &Path) -> Process {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log handle"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        Process { name, child, log }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(25)..].join("\n");
        format!("--- {} log:\n{tail}", self.name)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One sample of an instant query.
#[derive(Debug)]
struct Sample {
    labels: serde_json::Map<String, Value>,
    value: f64,
}

impl std::fmt::Display for Sample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
            .collect();
        write!(f, "{{{}}} {}", labels.join(","), self.value)
    }
}

/// Percent-encodes a query parameter (everything but RFC 3986's unreserved).
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The operator, the agent and the Prometheus that scrapes them.
struct Stack {
    prometheus_addr: String,
    // Dropped in this order: the agent stops before the kernel is restored.
    agent: Process,
    operator: Process,
    prometheus: Process,
    _dir: tempfile::TempDir,
}

impl Stack {
    fn start(tools: &Tools, kubeconfig: &Path, node: &str, node_label: &str) -> Stack {
        let dir = tempfile::Builder::new()
            .prefix("prometheus")
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .expect("temp dir");
        // The node's cgroups as a kubelet leaves them (cgroup v2, the
        // systemd driver): one pod whose hugetlb limit asks for
        // REQUESTED_PAGES, which the agent reports as requested.
        let cgroups = KubeletCgroups::create(&dir.path().join("cgroup")).expect("cgroup tree");
        cgroups
            .set_pod_pages_2mi("prom", REQUESTED_PAGES)
            .expect("the pod's limit");
        let operator_addr = format!("127.0.0.1:{}", free_port());
        let agent_addr = format!("127.0.0.1:{}", free_port());
        let prometheus_addr = format!("127.0.0.1:{}", free_port());
        let operator = Process::start(
            "operator",
            Command::new(&tools.operator)
                .args(["run", "--listen", &operator_addr])
                .env("KUBECONFIG", kubeconfig)
                .env("RUST_LOG", "info"),
            dir.path(),
        );
        let agent = Process::start(
            "agent",
            Command::new(&tools.agent)
                .args(["run", "--node-name", node, "--metrics-addr", &agent_addr])
                .arg("--cgroup-root")
                .arg(&cgroups.root)
                // Status and metrics follow the kernel within a second; a
                // shortfall is not retried while the test looks at it.
                .args(["--refresh-interval", "1s", "--retry-interval", "1h"])
                .env("KUBECONFIG", kubeconfig)
                .env("RUST_LOG", "info"),
            dir.path(),
        );
        // JSON is YAML. The labels are those the chart's ServiceMonitor and
        // PodMonitor give in production, the PodMonitor's node label included.
        let config = json!({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": OPERATOR_JOB,
                    "static_configs": [{
                        "targets": [operator_addr],
                        "labels": {"namespace": NAMESPACE},
                    }],
                },
                {
                    "job_name": AGENT_JOB,
                    "static_configs": [{
                        "targets": [agent_addr],
                        "labels": {"namespace": NAMESPACE, node_label: node},
                    }],
                },
            ],
        });
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config.to_string()).expect("write prometheus.yml");
        let prometheus = Process::start(
            "prometheus",
            Command::new(&tools.prometheus)
                .arg(format!("--config.file={}", config_file.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address={prometheus_addr}")),
            dir.path(),
        );
        Stack {
            prometheus_addr,
            agent,
            operator,
            prometheus,
            _dir: dir,
        }
    }

    fn logs(&self) -> String {
        [&self.operator, &self.agent, &self.prometheus]
            .map(Process::log_tail)
            .join("\n")
    }

    /// An instant query's vector, or why there is none.
    fn query(&self, expr: &str) -> Result<Vec<Sample>, String> {
        let path = format!("/api/v1/query?query={}", url_encode(expr));
        let body = http_get(&self.prometheus_addr, &path)?;
        let response: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        let data = &response["data"];
        if response["status"] != "success" || data["resultType"] != "vector" {
            return Err(format!("not a vector: {body}"));
        }
        let samples = data["result"]
            .as_array()
            .ok_or_else(|| format!("no result: {body}"))?
            .iter()
            .map(|series| Sample {
                labels: series["metric"].as_object().cloned().unwrap_or_default(),
                // Prometheus writes values as strings ("NaN" and "+Inf" too).
                value: series["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(f64::NAN),
            })
            .collect();
        Ok(samples)
    }

    /// The one sample of `expr` equals `wanted`.
    fn query_is(&self, expr: &str, wanted: f64) -> Result<(), String> {
        match self.query(expr)?.as_slice() {
            [one] if one.value == wanted => Ok(()),
            other => Err(format!("{expr} is {other:?}, want {wanted}")),
        }
    }

    /// Every scrape target is up.
    fn targets_up(&self) -> Result<(), String> {
        let body = http_get(&self.prometheus_addr, "/api/v1/targets?state=active")?;
        let response: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        let targets = response["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up = targets.iter().filter(|t| t["health"] == "up").count();
        if targets.len() == 2 && up == 2 {
            Ok(())
        } else {
            Err(format!("{up} of {} targets up: {targets:?}", targets.len()))
        }
    }

    /// Polls `check` until it holds; panics with its last answer and the logs.
    async fn wait_until<T, F, Fut>(&self, what: &str, timeout: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            let why = match check().await {
                Ok(value) => return value,
                Err(why) => why,
            };
            if Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}: {why}\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// `helm template` of the chart's PrometheusRule and agent PodMonitor, by kind.
fn rendered_monitoring(helm: &Path) -> (Value, Value) {
    let yaml = hugepool_e2e::helm_template(
        helm,
        &[
            "--set",
            "monitoring.prometheusRule.enabled=true",
            // Off by default; its expression is queried like the others'.
            "--set",
            "monitoring.prometheusRule.reservedUnrequested.enabled=true",
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--show-only",
            "templates/prometheusrule.yaml",
            "--show-only",
            "templates/podmonitor.yaml",
        ],
    );
    let docs = hugepool_e2e::yaml_documents(&yaml);
    let find = |kind: &str| {
        docs.iter()
            .find(|doc| doc["kind"] == kind)
            .cloned()
            .unwrap_or_else(|| panic!("no {kind} in the rendered chart"))
    };
    (find("PrometheusRule"), find("PodMonitor"))
}

/// The label the PodMonitor writes the pod's node name into.
fn node_label(pod_monitor: &Value) -> String {
    let relabelings = pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    relabelings
        .iter()
        .find(|r| r["sourceLabels"] == json!(["__meta_kubernetes_pod_node_name"]))
        .and_then(|r| r["targetLabel"].as_str())
        .unwrap_or_else(|| panic!("the PodMonitor copies no node name: {relabelings:?}"))
        .to_owned()
}

/// Calls `visit` with each byte index of `expr` outside parentheses,
/// braces, brackets and string literals (where PromQL's operators are).
fn top_level(expr: &str, mut visit: impl FnMut(usize)) {
    let bytes = expr.as_bytes();
    let (mut depth, mut quote, mut escaped) = (0usize, None, false);
    for (at, &byte) in bytes.iter().enumerate() {
        if let Some(open) = quote {
            if escaped {
                escaped = false;
            } else if byte == b'\\' && open != b'`' {
                escaped = true;
            } else if byte == open {
                quote = None;
            }
            continue;
        }
        match byte {
            b'"' | b'\'' | b'`' => quote = Some(byte),
            b'(' | b'{' | b'[' => depth += 1,
            b')' | b'}' | b']' => depth = depth.saturating_sub(1),
            _ if depth == 0 => visit(at),
            _ => {}
        }
    }
}

/// `expr` without parentheses around all of it.
fn without_parens(expr: &str) -> &str {
    let mut expr = expr.trim();
    while expr.starts_with('(') && expr.ends_with(')') {
        let inner = &expr[1..expr.len() - 1];
        // `(a) or (b)`: the first parenthesis closes before the end.
        let mut balanced = true;
        let mut depth = 0i32;
        for byte in inner.bytes() {
            depth += match byte {
                b'(' => 1,
                b')' => -1,
                _ => 0,
            };
            balanced &= depth >= 0;
        }
        if !balanced || depth != 0 {
            break;
        }
        expr = inner.trim();
    }
    expr
}

/// `expr` without a trailing `or vector(N)`: the fallback makes a query that
/// matches nothing look as if it returned a series.
fn without_fallback(expr: &str) -> String {
    let expr = without_parens(expr);
    let mut last_or = None;
    top_level(expr, |at| {
        if expr[at..].starts_with(" or ") {
            last_or = Some(at);
        }
    });
    if let Some(at) = last_or {
        let fallback = expr[at + 4..].trim();
        let is_vector_of_number = fallback
            .strip_prefix("vector(")
            .and_then(|rest| rest.strip_suffix(')'))
            .is_some_and(|n| n.trim().parse::<f64>().is_ok());
        if is_vector_of_number {
            return without_parens(&expr[..at]).to_owned();
        }
    }
    expr.to_owned()
}

/// The queries whose series an alert's expression compares: with its final
/// comparison against a number dropped (`X > 0` is `X`), or both sides of a
/// comparison of two queries (`A < B` is `A` and `B`), fallbacks dropped
/// from each. An alert's data is there when these return series, whether or
/// not it fires.
fn compared_queries(expr: &str) -> Vec<String> {
    let expr = expr.trim();
    let mut comparison = None;
    top_level(expr, |at| {
        let rest = &expr[at..];
        // The two-character operators first: `>=` is not `>` then `=`.
        if let Some(op) = ["==", "!=", ">=", "<=", ">", "<"]
            .into_iter()
            .find(|op| rest.starts_with(op))
        {
            comparison = Some((at, op.len()));
        }
    });
    let Some((at, len)) = comparison else {
        return vec![without_fallback(expr)];
    };
    let (left, right) = (&expr[..at], expr[at + len..].trim());
    if right.parse::<f64>().is_ok() {
        vec![without_fallback(left)]
    } else {
        vec![without_fallback(left), without_fallback(right)]
    }
}

/// A panel's query as Grafana sends it for one selected `pool`.
fn grafana_query(expr: &str, pool: &str) -> String {
    let query = expr
        .replace("$__rate_interval", RATE_INTERVAL)
        .replace("${pool}", pool)
        .replace("$pool", pool);
    assert!(
        !query.contains('$'),
        "{expr:?} uses a Grafana variable this test does not set"
    );
    query
}

/// What the dashboard queries, named: each panel target and each query
/// variable (`label_values(metric, label)`: a series per value of `label`).
fn dashboard_queries(dashboard: &Value, pool: &str) -> Vec<(String, String)> {
    fn panels<'a>(list: &'a Value, into: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            into.push(panel);
            panels(&panel["panels"], into);
        }
    }
    let mut all = Vec::new();
    panels(&dashboard["panels"], &mut all);
    let mut queries = Vec::new();
    for panel in all {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let Some(expr) = target["expr"].as_str() else {
                continue;
            };
            let name = format!(
                "panel {:?} ({})",
                panel["title"].as_str().unwrap_or_default(),
                target["refId"].as_str().unwrap_or_default()
            );
            queries.push((name, without_fallback(&grafana_query(expr, pool))));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] != "query" {
            continue;
        }
        let definition = variable["definition"].as_str().unwrap_or_default();
        let (metric, label) = definition
            .strip_prefix("label_values(")
            .and_then(|rest| rest.strip_suffix(')'))
            .and_then(|rest| rest.split_once(','))
            .unwrap_or_else(|| {
                panic!("variable {definition:?} is not label_values(metric, label)")
            });
        let name = format!(
            "variable {:?}",
            variable["name"].as_str().unwrap_or_default()
        );
        queries.push((
            name,
            format!("count by ({}) ({})", label.trim(), metric.trim()),
        ));
    }
    queries
}

/// What the alerts query, named: [`compared_queries`] of each alert.
fn alert_queries(rule: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    for group in rule["spec"]["groups"].as_array().into_iter().flatten() {
        for alert in group["rules"].as_array().into_iter().flatten() {
            let (Some(name), Some(expr)) = (alert["alert"].as_str(), alert["expr"].as_str()) else {
                continue;
            };
            for query in compared_queries(expr) {
                queries.push((format!("alert {name}"), query));
            }
        }
    }
    queries
}

fn pool_converged_at(pool: &HugePagePool, pages: i64) -> Result<(), String> {
    let status = pool.status.as_ref().ok_or("no status yet")?;
    let nodes = &status.nodes;
    if status.observed_generation == pool.metadata.generation
        && (nodes.selected, nodes.converged) == (1, 1)
        && (status.pages.target, status.pages.current) == (pages, pages)
    {
        Ok(())
    } else {
        Err(format!(
            "generation {:?}, status {:?}",
            pool.metadata.generation, status
        ))
    }
}

/// MemAvailable can never stay above the node's whole memory.
fn unmeetable_min_mem_available() -> String {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("read /proc/meminfo");
    let total_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("MemTotal in /proc/meminfo");
    format!("{total_kib}Ki")
}

struct Scenario<'a> {
    client: &'a Client,
    stack: &'a Stack,
    pool: &'a str,
    node: &'a str,
    node_label: &'a str,
}

impl Scenario<'_> {
    async fn wait_for_pool(&self, pages: i64) {
        let pools = &Api::<HugePagePool>::all(self.client.clone());
        let name = self.pool;
        let what = format!("pool {name} converged at {pages}");
        self.stack
            .wait_until(&what, CONVERGE_TIMEOUT, || async move {
                let pool = pools.get(name).await.map_err(|e| e.to_string())?;
                pool_converged_at(&pool, pages)
            })
            .await;
    }

    /// Waits until Prometheus has scraped the pool at `pages` and the agent's
    /// count of grown pages at `grown`.
    async fn wait_for_scrape(&self, pages: i64, grown: i64) {
        let (pool, node, label) = (self.pool, self.node, self.node_label);
        let current = format!(r#"hugepool_pool_pages{{pool="{pool}",kind="current"}}"#);
        let moved = format!(
            r#"hugepool_resize_pages_total{{size="2Mi",direction="grow",{label}="{node}"}}"#
        );
        let requested = format!(r#"hugepool_requested_bytes{{size="2Mi",{label}="{node}"}}"#);
        let what =
            format!("Prometheus to see {pages} pages, {grown} grown, {REQUESTED_PAGES} requested");
        let (stack, current, moved, requested) = (self.stack, &current, &moved, &requested);
        stack
            .wait_until(&what, CONVERGE_TIMEOUT, || async move {
                stack.query_is(current, pages as f64)?;
                stack.query_is(moved, grown as f64)?;
                stack.query_is(requested, (REQUESTED_PAGES * PAGE_2MI) as f64)
            })
            .await;
    }

    async fn patch_pool(&self, spec: Value) {
        Api::<HugePagePool>::all(self.client.clone())
            .patch(
                self.pool,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": spec})),
            )
            .await
            .expect("patch the pool");
    }

    async fn run(&self, dashboard: &Value, rule: &Value) {
        let started = Instant::now();
        let stack = self.stack;
        stack
            .wait_until("both targets up", CONVERGE_TIMEOUT, || async move {
                stack.targets_up()
            })
            .await;
        let pool: HugePagePool = serde_json::from_value(json!({
            "apiVersion": "hugepool.dev/v1alpha1",
            "kind": "HugePagePool",
            "metadata": {"name": self.pool},
            "spec": {
                "nodeSelector": {"matchLabels": {"hugepool.dev/e2e-prometheus": self.node}},
                "pageSize": "2Mi",
                "pages": 16,
                "rollout": {"maxUnavailable": 1},
            },
        }))
        .expect("a pool");
        Api::<HugePagePool>::all(self.client.clone())
            .create(&PostParams::default(), &pool)
            .await
            .expect("create the pool");
        self.wait_for_pool(16).await;
        self.wait_for_scrape(16, 16).await;
        // A second grow, scraped before and after: rates see an increase.
        self.patch_pool(json!({"pages": 32})).await;
        self.wait_for_pool(32).await;
        self.wait_for_scrape(32, 32).await;
        // A guard no node meets: the next grow stops where it is, 16 short.
        self.patch_pool(json!({
            "pages": 48,
            "allocation": {"minMemAvailable": unmeetable_min_mem_available()},
        }))
        .await;
        let short = format!(
            r#"hugepool_allocation_shortfall_pages{{size="2Mi",{}="{}"}}"#,
            self.node_label, self.node
        );
        let short = &short;
        stack
            .wait_until("a 16-page shortfall", CONVERGE_TIMEOUT, || async move {
                stack.query_is(short, 16.0)
            })
            .await;
        assert_eq!(
            read_sysfs("nr_hugepages"),
            Ok(32),
            "the guard held the pool"
        );
        eprintln!(
            "scenario ready after {:.1}s",
            started.elapsed().as_secs_f64()
        );

        let mut queries = dashboard_queries(dashboard, self.pool);
        queries.extend(alert_queries(rule));
        let mut empty = Vec::new();
        for (name, query) in &queries {
            let samples = self
                .stack
                .query(query)
                .unwrap_or_else(|e| panic!("{name}: {query}: {e}"));
            let shown: Vec<String> = samples.iter().map(Sample::to_string).collect();
            eprintln!(
                "{name}: {} series: {query}\n    {}",
                samples.len(),
                shown.join("\n    ")
            );
            // NaN (histogram_quantile without observations) draws nothing.
            if samples.is_empty() || samples.iter().any(|s| !s.value.is_finite()) {
                empty.push(format!("{name}: {query} -> {shown:?}"));
            }
            // Samples by node are the one agent's; those by pool include this pool.
            let by_node = query.contains(&format!("by ({}", self.node_label));
            for sample in &samples {
                let node = sample.labels.get(self.node_label);
                if by_node || node.is_some() {
                    assert_eq!(node, Some(&json!(self.node)), "{name}: {sample}");
                }
            }
            let pools: Vec<&Value> = samples
                .iter()
                .filter_map(|s| s.labels.get("pool"))
                .collect();
            if !pools.is_empty() && !pools.contains(&&json!(self.pool)) {
                empty.push(format!(
                    "{name}: {query} has no pool {}: {shown:?}",
                    self.pool
                ));
            }
        }
        assert!(
            empty.is_empty(),
            "queries without a series of numbers:\n{}",
            empty.join("\n")
        );
        eprintln!(
            "{} queries checked after {:.1}s",
            queries.len(),
            started.elapsed().as_secs_f64()
        );
    }

    /// Deletes the pool while the operator runs (it holds a finalizer), then
    /// the Node and its HugePageNode.
    async fn clean_up(&self) {
        let pools: Api<HugePagePool> = Api::all(self.client.clone());
        let _ = pools.delete(self.pool, &DeleteParams::default()).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while pools.get_opt(self.pool).await.ok().flatten().is_some() {
            if Instant::now() > deadline {
                eprintln!("pool {} still there after 60s", self.pool);
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let _ = Api::<HugePageNode>::all(self.client.clone())
            .delete(self.node, &DeleteParams::default())
            .await;
        let _ = Api::<Node>::all(self.client.clone())
            .delete(self.node, &DeleteParams::default())
            .await;
    }
}

#[tokio::test]
async fn every_panel_and_alert_query_returns_series_from_a_real_scrape() {
    let Some(env) = setup().await else { return };
    let tools = match Tools::find() {
        Ok(tools) => tools,
        Err(why) => return missing(&why),
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return missing("not root: the test writes the 2Mi pool");
    }
    let waited = Instant::now();
    let kernel = match Kernel2Mi::acquire() {
        Ok(kernel) => kernel,
        Err(why) => return missing(&why),
    };
    eprintln!(
        "waited {:.1}s for the machine's kernel",
        waited.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let (rule, pod_monitor) = rendered_monitoring(&tools.helm);
    let node_label = node_label(&pod_monitor);
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("charts/hugepool/dashboards/hugepool.json"))
            .expect("read the dashboard"),
    )
    .expect("the dashboard is JSON");

    let node = unique_name("prom-node");
    let pool = unique_name("prom-pool");
    let object: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node, "labels": {"hugepool.dev/e2e-prometheus": node}},
    }))
    .expect("a Node");
    Api::<Node>::all(env.client.clone())
        .create(&PostParams::default(), &object)
        .await
        .expect("create the Node");
    let stack = Stack::start(&tools, &env.control_plane.kubeconfig, &node, &node_label);
    let scenario = Scenario {
        client: &env.client,
        stack: &stack,
        pool: &pool,
        node: &node,
        node_label: &node_label,
    };
    let outcome = std::panic::AssertUnwindSafe(scenario.run(&dashboard, &rule))
        .catch_unwind()
        .await;
    scenario.clean_up().await;
    drop(stack);
    drop(kernel);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    eprintln!("took {:.1}s", started.elapsed().as_secs_f64());
}

#[test]
fn an_alert_is_queried_without_its_threshold() {
    let cases: &[(&str, &[&str])] = &[
        (
            "increase(hugepool_stalls_total[15m]) > 0",
            &["increase(hugepool_stalls_total[15m])"],
        ),
        (
            r#"max by (pool) (hugepool_pool_nodes{state="failed"}) > 0"#,
            &[r#"max by (pool) (hugepool_pool_nodes{state="failed"})"#],
        ),
        (
            "sum by (error) (rate(hugepool_reconcile_errors_total[10m])) >= 0.5",
            &["sum by (error) (rate(hugepool_reconcile_errors_total[10m]))"],
        ),
        // A comparison of two queries: both must have series.
        (
            "max by (pool) (hugepool_pool_nodes{state=\"converged\"})\n< max by (pool) (hugepool_pool_nodes{state=\"selected\"})",
            &[
                r#"max by (pool) (hugepool_pool_nodes{state="converged"})"#,
                r#"max by (pool) (hugepool_pool_nodes{state="selected"})"#,
            ],
        ),
        // A product with a comparison inside parentheses: one query.
        (
            "max by (pool) (hugepool_pool_kubelet_stale_nodes)\n* on (pool) (max by (pool) (hugepool_pool_nodes{state=\"converged\"})\n== bool max by (pool) (hugepool_pool_nodes{state=\"selected\"}))\n> 0",
            &[
                "max by (pool) (hugepool_pool_kubelet_stale_nodes)\n* on (pool) (max by (pool) (hugepool_pool_nodes{state=\"converged\"})\n== bool max by (pool) (hugepool_pool_nodes{state=\"selected\"}))",
            ],
        ),
        // The fallback would always answer.
        (
            "(max(hugepool_leader) or vector(0)) < 1",
            &["max(hugepool_leader)"],
        ),
        // Operators inside matchers and strings are no comparison.
        (r#"x{a!="b", c=~"<d>"} != 2"#, &[r#"x{a!="b", c=~"<d>"}"#]),
        ("hugepool_leader", &["hugepool_leader"]),
    ];
    for (expr, wanted) in cases {
        assert_eq!(compared_queries(expr), *wanted, "{expr:?}");
    }
}

#[test]
fn only_a_vector_fallback_is_dropped() {
    assert_eq!(
        without_fallback("sum(increase(hugepool_stalls_total[24h])) or vector(0)"),
        "sum(increase(hugepool_stalls_total[24h]))"
    );
    assert_eq!(without_fallback("a or b"), "a or b");
    assert_eq!(without_fallback("(a) or (b)"), "(a) or (b)");
    assert_eq!(
        without_fallback("max(a or vector(0))"),
        "max(a or vector(0))"
    );
}

#[test]
fn grafana_variables_become_the_pool_and_a_rate_window() {
    assert_eq!(
        grafana_query(
            r#"sum(rate(x{pool=~"$pool"}[$__rate_interval])) + y{pool=~"${pool}"}"#,
            "db"
        ),
        r#"sum(rate(x{pool=~"db"}[2m])) + y{pool=~"db"}"#
    );
}

#[test]
#[should_panic(expected = "uses a Grafana variable this test does not set")]
fn an_unknown_grafana_variable_is_refused() {
    grafana_query("rate(x[$__interval])", "db");
}
