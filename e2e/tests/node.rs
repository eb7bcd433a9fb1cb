//! hugepool as its users run it: `helm install` of charts/hugepool, from the
//! images `make images` built, on a real node of this machine (containerd,
//! runc, a real kubelet; `controlplane up --node`). The agent, in its
//! container with exactly the chart's securityContext and mounts, resizes
//! this machine's kernel.
//!
//! Needs root, `make images` and `make controlplane`; outside CI the test
//! skips (saying why) when one is missing, under `CI=true` it fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hugepool_crds::conditions::find_condition;
use hugepool_crds::{HugePageNode, HugePagePool, NodeConditionType, PageSize, PoolConditionType};
use hugepool_e2e::{OwnedControlPlane, in_ci_mode, lock_machine_kernel};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams};

const NAMESPACE: &str = "hugepool-system";
const SYSFS_2MI: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Skips (outside CI) or fails (under CI) with the reason.
fn unavailable(why: String) -> Option<Node> {
    if in_ci_mode() {
        panic!("CI=true and the node test cannot run: {why}");
    }
    eprintln!("skipping: {why}");
    None
}

/// A cluster of one real node on this machine, the kernel lock held and the
/// 2Mi pool restored on drop.
struct Node {
    cp: OwnedControlPlane,
    helm: PathBuf,
    name: String,
    pod_apiserver: (String, u16),
    /// `systemctl` of the node's systemd (its PID 1, which runs
    /// kubelet.service), run from this machine.
    systemctl: PathBuf,
    /// The node's file system as its kubelet and pods see it (its systemd's
    /// /proc/PID/root): the node's /run is its own tmpfs.
    root: PathBuf,
    /// The kubelet's --root-dir (its Memory Manager checkpoint is there).
    kubelet_root: PathBuf,
    /// The kubelet's podLogsDir: NAMESPACE_POD_UID/CONTAINER/0.log.
    pod_logs: PathBuf,
    saved_2mi: u64,
    _kernel: std::fs::File,
}

impl Node {
    fn start() -> Option<Node> {
        Self::start_with(&[])
    }

    /// A node whose `controlplane up` gets `extra` flags too.
    fn start_with(extra: &[&str]) -> Option<Node> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return unavailable("containerd, the kubelet and the agent need root".into());
        }
        let images = repo().join("target").join("images");
        let version = env!("CARGO_PKG_VERSION");
        for image in ["hugepool-operator", "hugepool-agent", "hugepool-e2e"] {
            let archive = images.join(format!("{image}-{version}.tar"));
            if !archive.exists() {
                return unavailable(format!("{} missing: run `make images`", archive.display()));
            }
        }
        let helm = match Command::new("bash")
            .arg(repo().join("hack/helm.sh"))
            .output()
        {
            Ok(out) if out.status.success() => {
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
            Ok(out) => {
                return unavailable(format!(
                    "hack/helm.sh failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            Err(e) => return unavailable(format!("running hack/helm.sh: {e}")),
        };
        let kernel = lock_machine_kernel();
        let saved_2mi = read_sys("nr_hugepages");
        let dir = repo()
            .join("target")
            .join("e2e")
            .join(format!("node-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cp = OwnedControlPlane::start_with_node_args(&dir, &images, extra)
            .unwrap_or_else(|e| panic!("controlplane up --node {extra:?}: {e}"));
        let pod_apiserver = std::fs::read_to_string(dir.join("pod-apiserver"))
            .expect("controlplane wrote pod-apiserver");
        let (host, port) = pod_apiserver
            .trim()
            .rsplit_once(':')
            .expect("pod-apiserver is host:port");
        let name = node_name();
        Some(Node {
            cp,
            helm,
            name,
            pod_apiserver: (host.to_string(), port.parse().expect("port")),
            systemctl: dir.join("node").join("systemctl"),
            root: {
                let pid = std::fs::read_to_string(dir.join("node").join("init.pid"))
                    .expect("controlplane wrote init.pid");
                PathBuf::from(format!("/proc/{}/root", pid.trim()))
            },
            // A hostPath must not contain "..", as repo() does.
            kubelet_root: std::fs::canonicalize(dir.join("node").join("kubelet"))
                .expect("the kubelet's root dir"),
            pod_logs: dir.join("node").join("pod-logs"),
            saved_2mi,
            _kernel: kernel,
        })
    }

    async fn client(&self) -> Client {
        self.cp.control_plane.client().await.expect("client")
    }

    /// A client with a token of the chart's ServiceAccount `account` (and
    /// no client certificate): what that component may do.
    async fn client_as(&self, account: &str) -> Client {
        let token = self.kubectl(&["create", "token", account, "-n", NAMESPACE]);
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.cp.control_plane.kubeconfig)
            .expect("kubeconfig");
        let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("config");
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.trim().to_string().into()),
            ..Default::default()
        };
        Client::try_from(config).expect("client")
    }

    /// Runs a command with KUBECONFIG set to this cluster; panics with its
    /// output when it fails.
    fn run(&self, program: &Path, args: &[&str]) -> String {
        let out = Command::new(program)
            .env("KUBECONFIG", &self.cp.control_plane.kubeconfig)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "{} {} failed:\n{text}",
            program.display(),
            args.join(" ")
        );
        text
    }

    fn kubectl(&self, args: &[&str]) -> String {
        self.run(&hugepool_e2e::kubectl_path(), args)
    }

    /// `ctr` on the node's containerd, in the kubelet's namespace.
    fn ctr(&self, args: &[&str]) -> String {
        let socket = self.cp.dir.join("node").join("containerd.sock");
        let mut all = vec![
            "--address",
            socket.to_str().expect("utf-8 path"),
            "--namespace",
            "k8s.io",
        ];
        all.extend_from_slice(args);
        self.run(&hugepool_e2e::controlplane_bin_dir().join("ctr"), &all)
    }

    fn helm_install(&self) -> String {
        self.helm_install_with(&[])
    }

    /// `helm install` with more `--set` values.
    fn helm_install_with(&self, sets: &[&str]) -> String {
        let root = format!(
            "agent.kubeletRestart.rootDir={}",
            self.kubelet_root.display()
        );
        // The agent's own restart command: nsenter into the node's PID 1 (its
        // systemd), systemctl restart kubelet.
        let mut values = vec!["agent.kubeletRestart.enabled=true", root.as_str()];
        values.extend_from_slice(sets);
        self.helm_install_values(&values)
    }

    /// `helm install` of the chart with its defaults but for where pods reach
    /// this test's apiserver and `values`; prints what helm printed (NOTES).
    fn helm_install_values(&self, values: &[&str]) -> String {
        self.helm_install_chart(&repo().join("charts").join("hugepool"), values)
    }

    /// `helm install` of `chart` (this repository's or an earlier
    /// version's) as [`Node::helm_install_values`] does.
    fn helm_install_chart(&self, chart: &Path, values: &[&str]) -> String {
        let host = format!("apiServer.host={}", self.pod_apiserver.0);
        let port = format!("apiServer.port={}", self.pod_apiserver.1);
        self.run(
            &self.helm,
            &[
                "install",
                "hugepool",
                chart.to_str().expect("utf-8 path"),
                "--namespace",
                NAMESPACE,
                "--create-namespace",
                "--set",
                &host,
                "--set",
                &port,
            ]
            .into_iter()
            .chain(values.iter().flat_map(|set| ["--set", *set]))
            .chain(["--wait", "--timeout", "5m"])
            .collect::<Vec<_>>(),
        )
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.cp.stop();
        if let Err(e) = std::fs::write(
            Path::new(SYSFS_2MI).join("nr_hugepages"),
            self.saved_2mi.to_string(),
        ) {
            eprintln!("could not restore the 2Mi pool to {}: {e}", self.saved_2mi);
        }
    }
}

/// The node is named after the host, as `controlplane up --node` names it.
fn node_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    host.trim().to_lowercase().replace('_', "-")
}

fn read_sys(file: &str) -> u64 {
    std::fs::read_to_string(Path::new(SYSFS_2MI).join(file))
        .unwrap_or_else(|e| panic!("reading {file}: {e}"))
        .trim()
        .parse()
        .expect("a number")
}

/// Polls `check` until it returns Some, or panics after `timeout` with the
/// last state it saw.
async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(state) if Instant::now() > deadline => {
                panic!("{what}: not reached within {timeout:?}; last state: {state}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn helm_install_on_a_real_node_resizes_this_kernel_from_the_agent_container() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;

    node.helm_install();

    // The operator: two replicas Ready, exactly one of them holds the Lease.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let operator = deployments
        .get("hugepool-operator")
        .await
        .expect("operator Deployment");
    let ready = operator
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    assert_eq!(
        ready, 2,
        "helm --wait returned with {ready}/2 operator replicas ready"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let operator_pods: Vec<String> = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=operator"))
        .await
        .expect("operator pods")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(operator_pods.len(), 2, "operator pods: {operator_pods:?}");
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    let holder = wait_for("a leader", Duration::from_secs(120), || async {
        let lease = leases
            .get_opt("hugepool-operator")
            .await
            .map_err(|e| e.to_string())?;
        lease
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty())
            .ok_or_else(|| "no Lease holder".to_string())
    })
    .await;
    assert!(
        operator_pods.contains(&holder),
        "Lease holder {holder} is not one of the operator pods {operator_pods:?}"
    );

    // The agent: one pod on this node, Ready.
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), NAMESPACE);
    let agent = daemonsets
        .get("hugepool-agent")
        .await
        .expect("agent DaemonSet");
    let status = agent.status.expect("DaemonSet status");
    assert_eq!(
        (status.desired_number_scheduled, status.number_ready),
        (1, 1),
        "agent DaemonSet scheduled/ready"
    );

    // The example pool, applied as a user would.
    let kubelet_before = node.kubelet_run();
    node.kubectl(&["label", "node", &node.name, "hugepool.dev/demo=true"]);
    node.kubectl(&[
        "apply",
        "-f",
        repo().join("examples/pool-2mi.yaml").to_str().unwrap(),
    ]);
    node.kubectl(&[
        "wait",
        "--for=condition=Available",
        "hugepagepool/demo-2mi",
        "--timeout=300s",
    ]);

    // What the agent reports is what the kernel has, and that is the pool.
    assert_eq!(read_sys("nr_hugepages"), 256, "the kernel's 2Mi pool");
    // Available waited for the kubelet too: the agent restarted it through
    // the node's restart command (the example's kubelet.restart is
    // AfterResize), and it reports the pool.
    assert_ne!(
        node.kubelet_run(),
        kubelet_before,
        "the agent restarted the kubelet"
    );
    // It did so with the agent's default command, through the node's
    // systemd (its PID 1 as the agent's hostPID sees it), and said so.
    let notes = wait_for(
        "the KubeletRestarted Event",
        Duration::from_secs(120),
        || async {
            let notes = node.kubectl(&[
                "get",
                "events",
                "--all-namespaces",
                "--field-selector",
                "reason=KubeletRestarted",
                "-o",
                "jsonpath={.items[*].message}",
            ]);
            (!notes.trim().is_empty())
                .then_some(notes.clone())
                .ok_or(notes)
        },
    )
    .await;
    assert!(
        notes.contains(
            "ran nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart kubelet"
        ),
        "{notes}"
    );
    let journal = Command::new(node.cp.dir.join("node").join("journalctl"))
        .args(["--unit", "kubelet", "--no-pager", "--output", "cat"])
        .output()
        .expect("journalctl");
    let journal = String::from_utf8_lossy(&journal.stdout);
    assert!(
        journal.contains("Stopping kubelet.service")
            || journal.contains("Stopping kubelet of the hugepool test node"),
        "systemd stopped the kubelet unit: {}",
        journal
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(node.kubelet_capacity_2mi(&client).await, "512Mi");
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    let hpn = hpns.get(&node.name).await.expect("HugePageNode");
    let reported = hpn
        .status
        .as_ref()
        .and_then(|s| s.page_sizes.iter().find(|p| p.size == PageSize::SIZE_2MI))
        .cloned()
        .expect("2Mi in the node's status");
    let sys = |file| i64::try_from(read_sys(file)).expect("fits");
    assert_eq!(reported.total, sys("nr_hugepages"), "status total vs /sys");
    assert_eq!(reported.free, sys("free_hugepages"), "status free vs /sys");
    assert_eq!(
        reported.surplus,
        sys("surplus_hugepages"),
        "status surplus vs /sys"
    );
    // What a grow can get, from the free lists the chart mounts read-only
    // (/proc/pagetypeinfo is root only): on a machine with gigabytes free
    // some 2Mi pages are always obtainable after compaction.
    let obtainable = reported.obtainable.expect(
        "status.pageSizes[2Mi].obtainable: the agent reads the free lists in its container",
    );
    assert!(
        obtainable.after_compaction >= obtainable.now && obtainable.after_compaction > 0,
        "{obtainable:?}"
    );
    assert!(
        reported.numa.iter().all(|n| n.obtainable.is_some()),
        "every NUMA node has its estimate: {:?}",
        reported.numa
    );

    // The kernel log, measured in the container: the device cgroup refuses
    // /dev/kmsg (the chart mounts none), CAP_SYSLOG allows syslog(2).
    let kernel_log = hpn
        .status
        .as_ref()
        .and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "KernelLogUnavailable")
        })
        .cloned()
        .expect("KernelLogUnavailable condition");
    assert_eq!(
        (kernel_log.status.as_str(), kernel_log.reason.as_str()),
        ("False", "KernelLogWatched"),
        "{}",
        kernel_log.message
    );
    assert!(
        kernel_log.message.contains("syslog(2)"),
        "{}",
        kernel_log.message
    );
    let agent_pod = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=agent"))
        .await
        .expect("agent pods")
        .items
        .pop()
        .expect("an agent pod");
    let pod_ip = agent_pod
        .status
        .and_then(|s| s.pod_ip)
        .expect("agent pod IP");
    let metrics = hugepool_e2e::http_get(&format!("{pod_ip}:9478"), "/metrics")
        .unwrap_or_else(|err| panic!("{err}"));
    assert!(
        metrics.contains("hugepool_kernel_log_watching 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("hugepool_free_lists_readable 1"),
        "{metrics}"
    );
    let pages_2mi: f64 = metrics
        .lines()
        .filter(|line| line.starts_with(r#"hugepool_pages{size="2Mi","#))
        .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    assert_eq!(pages_2mi, 256.0, "the states add up to the pool: {metrics}");

    // Release: deleting the pool returns the pages, through the agent.
    node.kubectl(&[
        "delete",
        "hugepagepool",
        "demo-2mi",
        "--wait=true",
        "--timeout=300s",
    ]);
    let pools: Api<HugePagePool> = Api::all(client.clone());
    assert!(pools.get_opt("demo-2mi").await.expect("get pool").is_none());
    assert_eq!(read_sys("nr_hugepages"), 0, "Release returned every page");
}

impl Node {
    /// Installs the chart, labels the node and applies a 2Mi pool of `pages`
    /// with a short drain timeout and kubelet restarts `AfterResize`; waits
    /// for it to be Available, which needs the kubelet to report the pool.
    async fn with_pool(&self, pages: u32, drain_timeout: &str) {
        self.with_pool_restarting(pages, drain_timeout, "AfterResize");
        self.wait_available("consumers-2mi");
    }

    fn wait_available(&self, pool: &str) {
        self.kubectl(&[
            "wait",
            "--for=condition=Available",
            &format!("hugepagepool/{pool}"),
            "--timeout=300s",
        ]);
    }

    /// Installs the chart, labels the node and applies the pool
    /// `consumers-2mi` with kubelet restarts `restart`.
    fn with_pool_restarting(&self, pages: u32, drain_timeout: &str, restart: &str) {
        self.with_pool_and(pages, drain_timeout, restart, &[]);
    }

    /// As `with_pool_restarting`, the chart installed with `sets` too.
    fn with_pool_and(&self, pages: u32, drain_timeout: &str, restart: &str, sets: &[&str]) {
        self.helm_install_with(sets);
        self.kubectl(&["label", "node", &self.name, "hugepool.dev/demo=true"]);
        self.apply(&format!(
            r#"
apiVersion: hugepool.dev/v1alpha1
kind: HugePagePool
metadata: {{name: consumers-2mi}}
spec:
  nodeSelector: {{matchLabels: {{hugepool.dev/demo: "true"}}}}
  pageSize: 2Mi
  pages: {pages}
  drain: {{policy: IfNeeded, timeout: {drain_timeout}}}
  kubelet: {{restart: {restart}}}
  deletionPolicy: Release
"#
        ));
    }

    fn apply(&self, yaml: &str) {
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), yaml).expect("write manifest");
        self.kubectl(&["apply", "-f", file.path().to_str().expect("utf-8")]);
    }

    /// The Node's `hugepages-2Mi` capacity as the kubelet reports it.
    async fn kubelet_capacity_2mi(&self, client: &Client) -> String {
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
        let node = nodes.get(&self.name).await.expect("Node");
        node.status
            .and_then(|s| s.capacity)
            .and_then(|c| c.get("hugepages-2Mi").map(|q| q.0.clone()))
            .unwrap_or_default()
    }

    /// `systemctl` of the node's systemd; panics with its output when it fails.
    fn systemctl(&self, args: &[&str]) -> String {
        let out = Command::new(&self.systemctl)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", self.systemctl.display()));
        assert!(out.status.success(), "systemctl {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Which run of kubelet.service this is: systemd gives every start of a
    /// unit a new InvocationID.
    fn kubelet_run(&self) -> String {
        let id = self.systemctl(&["show", "--property=InvocationID", "--value", "kubelet"]);
        assert!(!id.is_empty(), "kubelet.service has run");
        id
    }

    /// Waits until the 2Mi pool is `total` pages of which `in_use` are held.
    /// (A holder may first wait for the kubelet's restart to report the
    /// pool; on a loaded 2-core machine running two suites that took over
    /// 120 s.)
    async fn wait_in_use(&self, total: u64, in_use: u64) {
        wait_for("pages in use", Duration::from_secs(300), || async {
            let (nr, free) = (read_sys("nr_hugepages"), read_sys("free_hugepages"));
            if nr == total && free == total - in_use {
                Ok(())
            } else {
                Err(format!("pool {nr}, free {free}"))
            }
        })
        .await;
    }

    fn set_pool_pages(&self, pages: u32) {
        let patch = format!(r#"{{"spec":{{"pages":{pages}}}}}"#);
        self.kubectl(&[
            "patch",
            "hugepagepool",
            "consumers-2mi",
            "--type=merge",
            "-p",
            &patch,
        ]);
    }

    /// A bare pod holding `pages` x 2Mi through MAP_HUGETLB, with the
    /// `hugepages-2Mi` limit the kubelet admits it by.
    /// A holder of 16 of the pool's 64 pages that a PodDisruptionBudget
    /// never lets go; waits until it holds them.
    async fn start_protected_holder(&self) {
        self.apply(
            r#"
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: holder, namespace: default}
spec:
  maxUnavailable: 0
  selector: {matchLabels: {app: hugepage-holder}}
"#,
        );
        self.start_holder("holder", 16);
        self.wait_in_use(64, 16).await;
    }

    fn start_holder(&self, name: &str, pages: u32) {
        self.start_holder_with(name, pages, pages, &[]);
    }

    /// A holder pod that requests `requested` pages and maps `pages`, with
    /// the holder's `flags`.
    fn start_holder_with(&self, name: &str, requested: u32, pages: u32, flags: &[&str]) {
        let command: Vec<String> = ["/hugepage-holder".to_string(), pages.to_string()]
            .into_iter()
            .chain(flags.iter().map(|f| f.to_string()))
            .collect();
        self.apply(&format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default, labels: {{app: hugepage-holder}}}}
spec:
  terminationGracePeriodSeconds: 5
  containers:
  - name: holder
    image: localhost/hugepool-e2e:{version}
    command: {command:?}
    resources:
      limits: {{hugepages-2Mi: {bytes}Mi, memory: 64Mi, cpu: 100m}}
"#,
            version = env!("CARGO_PKG_VERSION"),
            bytes = requested * 2,
        ));
    }

    /// A pod running `command` in the test image that claims `pages` x 2Mi
    /// through a ResourceClaimTemplate of the chart's 2Mi DeviceClass and
    /// requests no hugepages-2Mi.
    fn claim_pod(&self, name: &str, pages: u32, command: &[&str]) {
        self.apply(&format!(
            r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}-pages, namespace: default}}
spec:
  spec:
    devices:
      requests:
      - name: pages
        exactly:
          deviceClassName: hugepages-2mi.hugepool.dev
          capacity: {{requests: {{memory: {bytes}Mi}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  terminationGracePeriodSeconds: 5
  resourceClaims:
  - {{name: pages, resourceClaimTemplateName: {name}-pages}}
  containers:
  - name: main
    image: localhost/hugepool-e2e:{version}
    command: {command:?}
    resources:
      claims: [{{name: pages}}]
      limits: {{memory: 64Mi, cpu: 100m}}
"#,
            version = env!("CARGO_PKG_VERSION"),
            bytes = pages * 2,
        ));
    }

    /// The chart with `dra.enabled` and the 32-page 2Mi pool `claims-2mi`
    /// consumed through DRA (drain Never, Release), Available.
    async fn with_dra_pool(&self) {
        let kubelet_root = format!("dra.kubeletRootDir={}", self.kubelet_root.display());
        // The test node is cgroup v1 (hugetlb its own hierarchy).
        self.helm_install_values(&["dra.enabled=true", "dra.cgroup.version=v1", &kubelet_root]);
        self.kubectl(&["label", "node", &self.name, "hugepool.dev/demo=true"]);
        self.apply(
            r#"
apiVersion: hugepool.dev/v1alpha1
kind: HugePagePool
metadata: {name: claims-2mi}
spec:
  nodeSelector: {matchLabels: {hugepool.dev/demo: "true"}}
  pageSize: 2Mi
  pages: 32
  consumption: DynamicResourceAllocation
  drain: {policy: Never}
  deletionPolicy: Release
"#,
        );
        self.wait_available("claims-2mi");
    }

    /// A pod with no hugepages request running `/hugepage-holder 4` with
    /// `name=value` in its environment and, unless empty, the
    /// ResourceClaim `claim`.
    fn env_pod(&self, pod: &str, name: &str, value: &str, claim: &str) {
        let claims = if claim.is_empty() {
            String::new()
        } else {
            format!("  resourceClaims:\n  - {{name: pages, resourceClaimName: {claim}}}\n")
        };
        let uses = if claim.is_empty() {
            ""
        } else {
            "\n      claims: [{name: pages}]"
        };
        self.apply(&format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {pod}, namespace: default}}
spec:
  terminationGracePeriodSeconds: 5
{claims}  containers:
  - name: main
    image: localhost/hugepool-e2e:{version}
    command: ["/hugepage-holder", "4"]
    env: [{{name: {name}, value: "{value}"}}]
    resources:{uses}
      limits: {{memory: 64Mi, cpu: 100m}}
"#,
            version = env!("CARGO_PKG_VERSION"),
        ));
    }

    /// Waits until pod `name` in namespace default is Running.
    async fn wait_running(&self, pods: &Api<Pod>, name: &str) {
        wait_for(
            &format!("{name} runs"),
            Duration::from_secs(300),
            || async {
                let pod = pods.get(name).await.map_err(|e| e.to_string())?;
                let status = pod.status.unwrap_or_default();
                match status.phase.as_deref() {
                    Some("Running") => Ok(()),
                    other => Err(format!("{other:?}; events: {}", self.pod_events(name))),
                }
            },
        )
        .await;
    }

    /// The events of pod `name` in namespace default, a line each.
    fn pod_events(&self, name: &str) -> String {
        self.kubectl(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector",
            &format!("involvedObject.name={name}"),
            "-o",
            "custom-columns=REASON:.reason,MESSAGE:.message",
        ])
    }

    /// Waits until an event of pod `name` says `text`; returns its line.
    async fn wait_event(&self, name: &str, text: &str) -> String {
        wait_for(
            &format!("an event of {name} says {text:?}"),
            Duration::from_secs(300),
            || async {
                let events = self.pod_events(name);
                events
                    .lines()
                    .find(|l| l.contains(text))
                    .map(str::to_string)
                    .ok_or(events)
            },
        )
        .await
    }

    /// A 2Mi hugetlb file of the cgroup `cgroup` (relative to the node's
    /// hugetlb hierarchy, e.g. `kubepods`), e.g. `limit_in_bytes`; `None`
    /// when the file is not there (`rsvd.*` on older kernels).
    fn hugetlb_2mi(&self, cgroup: &str, file: &str) -> Option<u64> {
        let path = self
            .root
            .join("sys/fs/cgroup/hugetlb")
            .join(cgroup)
            .join(format!("hugetlb.2MB.{file}"));
        let text = std::fs::read_to_string(&path).ok()?;
        Some(text.trim().parse().expect("a number"))
    }

    /// Waits until `kubepods`' 2Mi hugetlb limit is unbounded (2^62 bytes):
    /// the kubelet writes its allocatable hugepages there when it starts,
    /// then its QoS manager raises the limit to 2^62 (at once and every
    /// minute; kubelet v1.37, pkg/kubelet/cm/qos_container_manager_linux.go),
    /// so only the pods' own limits hold.
    async fn wait_kubepods_unbounded(&self) {
        wait_for(
            "kubepods' hugetlb limit unbounded",
            Duration::from_secs(180),
            || async {
                match self.hugetlb_2mi("kubepods", "limit_in_bytes") {
                    Some(limit) if limit >= 1 << 62 => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
    }

    /// The pod's cgroup (the kubelet's cgroupfs driver: Guaranteed pods sit
    /// right below `kubepods`) and its first container's, below it.
    async fn pod_cgroups(&self, pods: &Api<Pod>, name: &str) -> (String, String) {
        let pod = pods.get(name).await.expect("pod");
        let uid = pod.metadata.uid.clone().expect("uid");
        let status = pod.status.expect("status");
        assert_eq!(status.qos_class.as_deref(), Some("Guaranteed"));
        let container = status
            .container_statuses
            .and_then(|c| c.into_iter().next())
            .and_then(|c| c.container_id)
            .expect("a started container");
        let id = container
            .rsplit_once("://")
            .map(|(_, id)| id.to_string())
            .expect("runtime://ID");
        let pod_cgroup = format!("kubepods/pod{uid}");
        (pod_cgroup.clone(), format!("{pod_cgroup}/{id}"))
    }

    /// Waits until the log of pod `name`'s first container in namespace
    /// default has a line containing `text`; returns that line.
    async fn wait_log_line(&self, name: &str, text: &str) -> String {
        let prefix = format!("default_{name}_");
        wait_for(
            &format!("{name}'s log says {text:?}"),
            Duration::from_secs(120),
            || async {
                let dirs = std::fs::read_dir(&self.pod_logs).map_err(|e| e.to_string())?;
                let mut seen = String::new();
                for dir in dirs.flatten() {
                    if !dir.file_name().to_string_lossy().starts_with(&prefix) {
                        continue;
                    }
                    for container in std::fs::read_dir(dir.path())
                        .into_iter()
                        .flatten()
                        .flatten()
                    {
                        let log = std::fs::read_to_string(container.path().join("0.log"))
                            .unwrap_or_default();
                        if let Some(line) = log.lines().find(|l| l.contains(text)) {
                            return Ok(line.to_string());
                        }
                        seen.push_str(&log);
                    }
                }
                Err(format!("log so far: {seen:?}"))
            },
        )
        .await
    }
}

/// Bytes in `pages` 2Mi pages.
fn bytes_2mi(pages: u64) -> u64 {
    pages * 2 * 1024 * 1024
}

/// The HugePagePool condition `type_`, as (status, reason, message).
async fn pool_condition(
    client: &Client,
    pool: &str,
    type_: &str,
) -> Option<(String, String, String)> {
    let pools: Api<HugePagePool> = Api::all(client.clone());
    let pool = pools.get_opt(pool).await.ok()??;
    pool.status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status, c.reason, c.message))
}

/// The HugePageNode condition `type_`, as (status, reason, message).
/// The pods `pool`'s status records as evicted.
async fn evicted_pods(client: &Client, pool: &str) -> Vec<hugepool_crds::pool::EvictedPod> {
    Api::<HugePagePool>::all(client.clone())
        .get(pool)
        .await
        .expect("pool")
        .status
        .map(|s| s.evicted_pods)
        .unwrap_or_default()
}

/// Waits until the node's Draining condition says DrainComplete.
async fn wait_drain_complete(client: &Client, node: &str) {
    wait_for("the drain ends", Duration::from_secs(120), || async {
        match node_condition(client, node, "Draining").await {
            Some((status, reason, _)) if status == "False" && reason == "DrainComplete" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

async fn node_condition(
    client: &Client,
    node: &str,
    type_: &str,
) -> Option<(String, String, String)> {
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    let hpn = hpns.get_opt(node).await.ok()??;
    hpn.status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status, c.reason, c.message))
}

fn node_tainted_draining(node: &k8s_openapi::api::core::v1::Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == hugepool_crds::DRAINING_TAINT))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_holding_hugepages_blocks_the_shrink_until_the_operator_evicts_it() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    node.with_pool_restarting(64, "2m", "Never");

    // What this kubelet reports: its hugepages capacity is read at start, so
    // a grow is not seen until the kubelet restarts, and until then the pool
    // is not Available (pods could not get its pages).
    let at_start = match node.saved_2mi {
        0 => "0".to_string(),
        pages => format!("{}Mi", pages * 2),
    };
    assert_ne!(
        at_start, "128Mi",
        "the machine's pool starts at the test's target"
    );
    let (reason, message) = wait_for(
        "Available=False/KubeletCapacityStale",
        Duration::from_secs(300),
        || async {
            match pool_condition(&client, "consumers-2mi", "Available").await {
                Some((status, reason, message))
                    if status == "False" && reason == "KubeletCapacityStale" =>
                {
                    Ok((reason, message))
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(message.contains(&node.name), "{reason}: {message}");
    assert_eq!(read_sys("nr_hugepages"), 64, "the kernel has the pool");
    let stale = node.kubelet_capacity_2mi(&client).await;
    assert_eq!(stale, at_start, "capacity before a kubelet restart");
    let (status, reason, message) = node_condition(&client, &node.name, "KubeletCapacityStale")
        .await
        .expect("KubeletCapacityStale");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "KubeletRestartRequired"),
        "{message}"
    );
    // What a pod meets meanwhile: a pod that asks for more than the kubelet
    // started with is not scheduled. kubepods' own limit does not hold it
    // back: the kubelet keeps it unbounded.
    node.wait_kubepods_unbounded().await;
    node.start_holder("holder", 16);
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    if node.saved_2mi < 16 {
        let message = wait_for(
            "the holder unschedulable",
            Duration::from_secs(120),
            || async {
                let pod = pods.get("holder").await.map_err(|e| e.to_string())?;
                let scheduled = pod
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .into_iter()
                    .find(|c| c.type_ == "PodScheduled");
                match scheduled {
                    Some(c)
                        if c.status == "False" && c.reason.as_deref() == Some("Unschedulable") =>
                    {
                        Ok(c.message.unwrap_or_default())
                    }
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
        assert!(message.contains("Insufficient hugepages-2Mi"), "{message}");
    }

    // With AfterResize the agent restarts the kubelet itself, through the
    // node's restart command, and the pool becomes Available.
    let kubelet_before = node.kubelet_run();
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "consumers-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"kubelet":{"restart":"AfterResize"}}}"#,
    ]);
    node.wait_available("consumers-2mi");
    assert_eq!(node.kubelet_capacity_2mi(&client).await, "128Mi");
    assert_ne!(
        node.kubelet_run(),
        kubelet_before,
        "the agent restarted the kubelet"
    );
    let (status, reason, _) = node_condition(&client, &node.name, "KubeletCapacityStale")
        .await
        .expect("KubeletCapacityStale");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "CapacityMatches")
    );

    // The holder, scheduled now, holds its 16 pages; shrinking to 8 is
    // blocked by them.
    node.wait_in_use(64, 16).await;
    node.set_pool_pages(8);

    // The operator drains under its taint through the Eviction API; the
    // holder's pages come back and the shrink completes.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let saw_blocked = AtomicBool::new(false);
    let saw_taint = AtomicBool::new(false);
    wait_for("the shrink to 8 pages", Duration::from_secs(300), || {
        let (nodes, pods, client) = (nodes.clone(), pods.clone(), client.clone());
        let name = node.name.clone();
        let (saw_blocked, saw_taint) = (&saw_blocked, &saw_taint);
        async move {
            if let Some((status, _, _)) = node_condition(&client, &name, "ShrinkBlocked").await
                && status == "True"
            {
                saw_blocked.store(true, Ordering::Relaxed);
            }
            let n = nodes.get(&name).await.map_err(|e| e.to_string())?;
            if node_tainted_draining(&n) {
                saw_taint.store(true, Ordering::Relaxed);
            }
            let holder_gone = pods
                .get_opt("holder")
                .await
                .map_err(|e| e.to_string())?
                .is_none();
            let total = read_sys("nr_hugepages");
            if holder_gone && total == 8 {
                Ok(())
            } else {
                Err(format!("holder gone {holder_gone}, pool {total}"))
            }
        }
    })
    .await;
    assert!(
        saw_blocked.into_inner(),
        "the agent reported ShrinkBlocked while the holder ran"
    );
    assert!(
        saw_taint.into_inner(),
        "the node was tainted {} while draining",
        hugepool_crds::DRAINING_TAINT
    );
    // Available again once the agent restarted the kubelet for the shrink.
    node.wait_available("consumers-2mi");
    assert_eq!(node.kubelet_capacity_2mi(&client).await, "16Mi");
    let n = nodes.get(&node.name).await.expect("Node");
    assert!(
        !node_tainted_draining(&n),
        "the draining taint is gone once converged"
    );
    let events = node.kubectl(&[
        "get",
        "events",
        "-n",
        "default",
        "--field-selector",
        "involvedObject.name=holder",
        "-o",
        "name",
    ]);
    assert!(!events.is_empty(), "the holder pod has events");
    // The operator's own Events about the drain got past the chart's
    // policy on its Events (operator-policy.yaml), as its taint did.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    let reasons: Vec<String> = events
        .list(&Default::default())
        .await
        .expect("Events")
        .items
        .into_iter()
        .filter(|e| {
            e.reporting_controller.as_deref() == Some(hugepool_crds::OPERATOR_MANAGER)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.name.as_str())
        })
        .filter_map(|e| e.reason)
        .collect();
    for reason in ["DrainStarted", "Evicted", "DrainFinished"] {
        assert!(
            reasons.iter().any(|r| r == reason),
            "the operator's {reason} Event about {}: {reasons:?}",
            node.name
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_disruption_budget_holds_the_drain_until_it_times_out() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    node.with_pool(64, "20s").await;
    node.start_protected_holder().await;
    node.set_pool_pages(8);

    let reason = wait_for("DrainTimeout", Duration::from_secs(300), || async {
        match node_condition(&client, &node.name, "Draining").await {
            Some((status, reason, message)) if reason == "DrainTimeout" => Ok((status, message)),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        reason.0, "False",
        "Draining=False/DrainTimeout: {}",
        reason.1
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    assert!(
        pods.get_opt("holder").await.expect("get holder").is_some(),
        "the PDB kept the holder"
    );
    // The agent shrank to what is in use, never below it (no surplus).
    assert_eq!(
        (read_sys("nr_hugepages"), read_sys("surplus_hugepages")),
        (16, 0),
        "pool and surplus while the PDB holds the consumer"
    );
    // The pool's status follows the node's condition in a later pass.
    wait_for(
        "Degraded=True/DrainTimeout",
        Duration::from_secs(120),
        || async {
            match pool_condition(&client, "consumers-2mi", "Degraded").await {
                Some((status, reason, _)) if status == "True" && reason == "DrainTimeout" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn helm_upgrade_replaces_agent_and_operator_with_one_writer_at_a_time() {
    use futures::StreamExt;
    use kube::runtime::watcher;

    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    node.with_pool(32, "2m").await;

    // The new version's images: the same archives under another tag.
    let version = env!("CARGO_PKG_VERSION");
    for image in ["hugepool-operator", "hugepool-agent"] {
        let from = format!("ghcr.io/hugepool-dev/{image}:{version}");
        let to = format!("ghcr.io/hugepool-dev/{image}:upgrade");
        node.ctr(&["images", "tag", &from, &to]);
    }

    // Through the upgrade, sample the agent processes and the holders of
    // the writer lock on the host.
    let sampler = LockSampler::start(&node.root.join("run/hugepool/agent.lock"));
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    let lease_events = watcher(
        leases,
        watcher::Config::default().fields("metadata.name=hugepool-operator"),
    );
    let holders = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let record = std::sync::Arc::clone(&holders);
    let lease_watch = tokio::spawn(async move {
        let mut stream = std::pin::pin!(lease_events);
        while let Some(Ok(event)) = stream.next().await {
            if let watcher::Event::Apply(l) | watcher::Event::InitApply(l) = event {
                let holder = l.spec.and_then(|s| s.holder_identity).unwrap_or_default();
                let mut list = record.lock().unwrap();
                if list.last() != Some(&holder) {
                    list.push(holder);
                }
            }
        }
    });

    let chart = repo().join("charts").join("hugepool");
    node.run(
        &node.helm,
        &[
            "upgrade",
            "hugepool",
            chart.to_str().unwrap(),
            "--namespace",
            NAMESPACE,
            "--reuse-values",
            "--set",
            "operator.image.tag=upgrade",
            "--set",
            "agent.image.tag=upgrade",
            "--wait",
            "--timeout",
            "5m",
        ],
    );
    // Every pod now runs the new images and the pool is still at target.
    let running = wait_for("only new pods", Duration::from_secs(180), || async {
        let list = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let images: Vec<String> = list
            .items
            .iter()
            .flat_map(|p| {
                p.spec
                    .iter()
                    .flat_map(|s| s.containers.iter().filter_map(|c| c.image.clone()))
            })
            .collect();
        if images.len() == 3 && images.iter().all(|i| i.ends_with(":upgrade")) {
            Ok(list.items)
        } else {
            Err(format!("{images:?}"))
        }
    })
    .await;
    let new_operators: Vec<String> = running
        .iter()
        .filter(|p| {
            p.metadata.labels.as_ref().is_some_and(|l| {
                l.get("app.kubernetes.io/component").map(String::as_str) == Some("operator")
            })
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let leader = wait_for("a new leader", Duration::from_secs(120), || async {
        let holder = holders.lock().unwrap().last().cloned().unwrap_or_default();
        if new_operators.contains(&holder) {
            Ok(holder)
        } else {
            Err(format!("holder {holder}, new pods {new_operators:?}"))
        }
    })
    .await;
    lease_watch.abort();
    let samples = sampler.stop();
    assert_one_writer("helm upgrade", &samples);
    let overlapped = samples.iter().filter(|(alive, _)| alive.len() > 1).count();
    eprintln!(
        "{overlapped} of {} samples saw two agent processes at once",
        samples.len()
    );
    let (alive, lock_holders) = samples.first().cloned().expect("samples");
    assert_eq!(
        (alive.len(), lock_holders.len()),
        (1, 1),
        "one agent, holding the lock, before the upgrade"
    );
    let (new_alive, new_holders) = samples.last().cloned().expect("samples");
    assert_eq!(
        (new_alive.len(), new_holders.len()),
        (1, 1),
        "one agent, holding the lock, after the upgrade"
    );
    assert_ne!(alive, new_alive, "the upgrade replaced the agent process");
    let history = holders.lock().unwrap().clone();
    let leaders: Vec<&String> = history.iter().filter(|h| !h.is_empty()).collect();
    assert!(
        leaders.len() <= 4 && leaders.last() == Some(&&leader),
        "Lease holders over the upgrade (one at a time by construction): {history:?}"
    );
    node.kubectl(&[
        "wait",
        "--for=condition=Available",
        "hugepagepool/consumers-2mi",
        "--timeout=300s",
    ]);
    assert_eq!(
        read_sys("nr_hugepages"),
        32,
        "the pool stayed at target through the upgrade"
    );
}

/// Over `samples` of [`LockSampler`] taken through `step`: never two holders
/// of the writer lock, and while two agents were alive, one of them held it.
fn assert_one_writer(step: &str, samples: &[(Vec<u32>, Vec<u32>)]) {
    for (alive, holders) in samples {
        assert!(
            holders.len() <= 1,
            "{step}: one writer-lock holder at a time: {holders:?}"
        );
        assert!(
            alive.len() < 2 || holders.len() == 1 && alive.contains(&holders[0]),
            "{step}: two agents alive ({alive:?}) while the lock holders were {holders:?}"
        );
    }
}

/// Samples, every few milliseconds, the PIDs of the agent processes on this
/// machine and the PIDs holding the agents' writer lock (/proc/locks).
struct LockSampler {
    stop: std::sync::Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Vec<u32>, Vec<u32>)>>,
}

impl LockSampler {
    /// `lock`: the agents' writer lock, as this machine reaches it.
    fn start(lock: &Path) -> Self {
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(lock)
            .unwrap_or_else(|e| panic!("the agent created its writer lock {}: {e}", lock.display()))
            .ino();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let mut alive: Vec<u32> = std::fs::read_dir("/proc")
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                    .filter(|pid| {
                        std::fs::read_to_string(format!("/proc/{pid}/comm"))
                            .is_ok_and(|c| c.trim() == "hugepool-agent")
                    })
                    .collect();
                alive.sort_unstable();
                // "1: FLOCK  ADVISORY  WRITE 4242 00:1a:123456 0 EOF"
                let holders: Vec<u32> = std::fs::read_to_string("/proc/locks")
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|line| {
                        let fields: Vec<&str> = line.split_whitespace().collect();
                        let file_inode = fields.get(5)?.rsplit(':').next()?.parse::<u64>().ok()?;
                        (fields.get(1) == Some(&"FLOCK") && file_inode == inode)
                            .then(|| fields.get(4)?.parse().ok())
                            .flatten()
                    })
                    .collect();
                samples.push((alive, holders));
                std::thread::sleep(Duration::from_millis(5));
            }
            samples
        });
        Self { stop, thread }
    }

    fn stop(self) -> Vec<(Vec<u32>, Vec<u32>)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("sampler")
    }
}

/// The chart and images of the earlier version hack/previous.sh names (the
/// upgrade's starting point): (its chart, its image archives, their tag).
fn previous_version() -> Option<(PathBuf, Vec<PathBuf>, String)> {
    let out = Command::new("bash")
        .arg(repo().join("hack/previous.sh"))
        .output()
        .expect("running hack/previous.sh");
    if !out.status.success() {
        unavailable(format!(
            "hack/previous.sh failed (make previous): {}",
            hugepool_e2e::output_text(&out)
        ));
        return None;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let mut archives: Vec<PathBuf> = std::fs::read_dir(dir.join("images"))
        .expect("the previous version's images")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "tar"))
        .collect();
    archives.sort();
    assert_eq!(
        archives.len(),
        2,
        "operator and agent archives: {archives:?}"
    );
    let tag = archives[0]
        .file_stem()
        .and_then(|s| s.to_str()?.strip_prefix("hugepool-agent-"))
        .expect("hugepool-agent-TAG.tar")
        .to_string();
    Some((
        dir.join("src").join("charts").join("hugepool"),
        archives,
        tag,
    ))
}

/// What an upgrade or a rollback must leave as it was, read from the
/// cluster and the node.
#[derive(Debug, PartialEq)]
struct Untouched {
    /// The holder pod: UID, phase, restarts.
    holder: (String, String, i32),
    /// Which run of kubelet.service.
    kubelet_run: String,
    pool_spec: serde_json::Value,
    pool_generation: Option<i64>,
    node_spec: serde_json::Value,
    /// The agent's one-line summary of every size (pages/target).
    node_summary: Option<String>,
    /// The kernel's 2Mi pool and its free pages.
    kernel: (u64, u64),
}

impl Node {
    async fn untouched(&self, client: &Client) -> Untouched {
        let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
        let holder = pods.get("holder").await.expect("holder pod");
        let restarts = holder
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .map_or(-1, |c| c.restart_count);
        let pool = Api::<HugePagePool>::all(client.clone())
            .get("consumers-2mi")
            .await
            .expect("pool");
        let hpn = Api::<HugePageNode>::all(client.clone())
            .get(&self.name)
            .await
            .expect("HugePageNode");
        Untouched {
            holder: (
                holder.metadata.uid.unwrap_or_default(),
                holder.status.and_then(|s| s.phase).unwrap_or_default(),
                restarts,
            ),
            kubelet_run: self.kubelet_run(),
            pool_spec: serde_json::to_value(&pool.spec).expect("json"),
            pool_generation: pool.metadata.generation,
            node_spec: serde_json::to_value(&hpn.spec).expect("json"),
            node_summary: hpn.status.and_then(|s| s.summary),
            kernel: (read_sys("nr_hugepages"), read_sys("free_hugepages")),
        }
    }

    /// The operator and agent pods, by name, with their images; and the
    /// Lease's holder.
    async fn hugepool_pods(&self, client: &Client) -> (Vec<(String, String)>, String) {
        let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        let mut running: Vec<(String, String)> = pods
            .list(&ListParams::default())
            .await
            .expect("pods")
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| {
                let image = p
                    .spec
                    .and_then(|s| s.containers.first().and_then(|c| c.image.clone()))
                    .unwrap_or_default();
                (p.metadata.name.unwrap_or_default(), image)
            })
            .collect();
        running.sort();
        let lease = Api::<Lease>::namespaced(client.clone(), NAMESPACE)
            .get_opt("hugepool-operator")
            .await
            .expect("Lease");
        let holder = lease
            .and_then(|l| l.spec?.holder_identity)
            .unwrap_or_default();
        (running, holder)
    }

    /// Waits until the three hugepool pods (two operators, one agent) all
    /// run images from `repository` and, for the agent, are Ready, and one
    /// of the new operators holds the Lease; returns the pods' names.
    async fn wait_rolled_to(&self, client: &Client, repository: &str) -> Vec<String> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        wait_for(
            &format!("pods of {repository} and their leader"),
            Duration::from_secs(300),
            || async {
                let (running, holder) = self.hugepool_pods(client).await;
                let names: Vec<String> = running.iter().map(|(n, _)| n.clone()).collect();
                let ready = pods
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .all(|p| {
                        p.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|c| {
                                c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                            })
                    });
                if running.len() == 3
                    && running.iter().all(|(_, i)| i.starts_with(repository))
                    && ready
                    && names.contains(&holder)
                {
                    Ok(names)
                } else {
                    Err(format!(
                        "pods {running:?}, all Ready {ready}, Lease holder {holder}"
                    ))
                }
            },
        )
        .await
    }
}

/// The Events (UID and resourceVersion: a repeated Event is rewritten)
/// whose reason says a page moved, a pod was evicted or the kubelet was
/// restarted.
async fn disruptive_events(client: &Client) -> Vec<(String, String, String)> {
    const REASONS: &[&str] = &[
        "ResizeStarted",
        "KubeletRestarted",
        "KubeletRestartFailed",
        "OtherWriter",
        "DrainStarted",
        "Evicted",
        "EvictionBlocked",
        "EvictionFailed",
    ];
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::all(client.clone());
    let mut found: Vec<(String, String, String)> = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref().is_some_and(|r| REASONS.contains(&r)))
        .map(|e| {
            (
                e.reason.unwrap_or_default(),
                e.metadata.uid.unwrap_or_default(),
                e.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect();
    found.sort();
    found
}

/// Samples the kernel's 2Mi pool every few milliseconds; the distinct
/// values it saw, in order.
struct PoolSampler {
    stop: std::sync::Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u64>>,
}

impl PoolSampler {
    fn start() -> Self {
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let pages = read_sys("nr_hugepages");
                if seen.last() != Some(&pages) {
                    seen.push(pages);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        });
        Self { stop, thread }
    }

    fn stop(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("sampler")
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn helm_upgrade_and_rollback_from_the_previous_version_keep_pages_pods_and_kubelet() {
    let Some(node) = Node::start() else { return };
    let Some((previous_chart, archives, tag)) = previous_version() else {
        return;
    };
    let client = node.client().await;
    for archive in &archives {
        node.ctr(&["images", "import", archive.to_str().expect("utf-8 path")]);
    }

    // The previous version, installed as a user would, with a values file
    // the upgrade and the rollback are given again.
    let values = tempfile::NamedTempFile::new().expect("values file");
    std::fs::write(
        values.path(),
        format!(
            "apiServer: {{host: {}, port: {}}}\nagent:\n  kubeletRestart: {{enabled: true, rootDir: {}}}\n",
            node.pod_apiserver.0,
            node.pod_apiserver.1,
            node.kubelet_root.display()
        ),
    )
    .expect("write values");
    let values = values.path().to_str().expect("utf-8 path");
    let previous = "localhost/previous/";
    node.run(
        &node.helm,
        &[
            "install",
            "hugepool",
            previous_chart.to_str().expect("utf-8 path"),
            "--namespace",
            NAMESPACE,
            "--create-namespace",
            "-f",
            values,
            "--set",
            "operator.image.repository=localhost/previous/hugepool-operator",
            "--set",
            "agent.image.repository=localhost/previous/hugepool-agent",
            "--set",
            &format!("operator.image.tag={tag},agent.image.tag={tag}"),
            "--wait",
            "--timeout",
            "5m",
        ],
    );
    node.wait_rolled_to(&client, previous).await;
    node.kubectl(&["label", "node", &node.name, "hugepool.dev/demo=true"]);
    node.apply(
        r#"
apiVersion: hugepool.dev/v1alpha1
kind: HugePagePool
metadata: {name: consumers-2mi}
spec:
  nodeSelector: {matchLabels: {hugepool.dev/demo: "true"}}
  pageSize: 2Mi
  pages: 32
  drain: {policy: IfNeeded, timeout: 2m}
  kubelet: {restart: AfterResize}
  deletionPolicy: Release
"#,
    );
    node.wait_available("consumers-2mi");
    node.start_holder("holder", 8);
    node.wait_in_use(32, 8).await;
    // Its pages are in the kernel before the kubelet writes its status.
    node.wait_running(&Api::namespaced(client.clone(), "default"), "holder")
        .await;
    let before = node.untouched(&client).await;
    assert_eq!(
        before.kernel,
        (32, 24),
        "the previous version's pool, 8 pages held"
    );
    assert_eq!(before.holder.1, "Running", "{before:?}");
    let events = disruptive_events(&client).await;

    let chart = repo().join("charts").join("hugepool");
    let crds = chart.join("crds");
    for (step, repository) in [("upgrade", "ghcr.io/hugepool-dev/"), ("rollback", previous)] {
        let (old_pods, old_leader) = node.hugepool_pods(&client).await;
        let pool = PoolSampler::start();
        let locks = LockSampler::start(&node.root.join("run/hugepool/agent.lock"));
        if step == "upgrade" {
            // As docs/operations.md "Upgrade" says: the CRDs first, then
            // the chart with the same values file.
            node.kubectl(&[
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                crds.to_str().expect("utf-8 path"),
            ]);
            node.run(
                &node.helm,
                &[
                    "upgrade",
                    "hugepool",
                    chart.to_str().expect("utf-8 path"),
                    "--namespace",
                    NAMESPACE,
                    "-f",
                    values,
                    "--wait",
                    "--timeout",
                    "5m",
                ],
            );
        } else {
            node.run(
                &node.helm,
                &[
                    "rollback",
                    "hugepool",
                    "1",
                    "--namespace",
                    NAMESPACE,
                    "--wait",
                    "--timeout",
                    "5m",
                ],
            );
        }
        let new_pods = node.wait_rolled_to(&client, repository).await;
        node.wait_available("consumers-2mi");
        let after = node.untouched(&client).await;
        let pool = pool.stop();
        let locks = locks.stop();
        eprintln!("{step}: pods {old_pods:?} (Lease {old_leader}) -> {new_pods:?}");

        assert!(
            old_pods.iter().all(|(name, _)| !new_pods.contains(name)),
            "{step} replaced every pod: {old_pods:?} -> {new_pods:?}"
        );
        assert_eq!(pool, [32], "{step}: the kernel's 2Mi pool never moved");
        assert_eq!(
            after, before,
            "{step}: the holder, the kubelet, the pool and the node as they were"
        );
        assert_eq!(
            disruptive_events(&client).await,
            events,
            "{step}: no resize, eviction, drain or kubelet restart"
        );
        assert_one_writer(step, &locks);
    }
    let history = node.run(
        &node.helm,
        &[
            "history",
            "hugepool",
            "--namespace",
            NAMESPACE,
            "-o",
            "json",
        ],
    );
    assert!(
        history.contains(r#""revision":3"#) && history.contains("Rollback to 1"),
        "install, upgrade, rollback: {history}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_static_pod_holding_hugepages_is_never_evicted_and_the_node_names_it() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    node.with_pool(64, "2m").await;
    // A static pod: the kubelet runs it from its manifest directory.
    let manifest = node
        .cp
        .dir
        .join("node")
        .join("manifests")
        .join("holder.yaml");
    std::fs::write(
        &manifest,
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: holder, namespace: default}}
spec:
  terminationGracePeriodSeconds: 5
  containers:
  - name: holder
    image: localhost/hugepool-e2e:{}
    command: [/hugepage-holder, "16"]
    resources:
      limits: {{hugepages-2Mi: 32Mi, memory: 64Mi, cpu: 100m}}
"#,
            env!("CARGO_PKG_VERSION")
        ),
    )
    .expect("static pod manifest");
    node.wait_in_use(64, 16).await;
    node.set_pool_pages(8);

    let mirror = format!("holder-{}", node.name);
    let named = format!("default/{mirror} (static pod)");
    let message = wait_for(
        "the node names its static pod",
        Duration::from_secs(300),
        || async {
            match node_condition(&client, &node.name, "Draining").await {
                Some((_, _, message)) if message.contains(&named) => Ok(message),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    eprintln!("Draining: {message}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    assert!(
        pods.get_opt(&mirror)
            .await
            .expect("get mirror pod")
            .is_some(),
        "never evicted"
    );
    assert_eq!(
        read_sys("free_hugepages"),
        0,
        "the static pod still holds its pages"
    );
    assert_eq!(read_sys("nr_hugepages"), 16, "shrunk to what is in use");

    // Its owner, the manifest, is the only way: then the shrink completes.
    std::fs::remove_file(&manifest).expect("remove manifest");
    node.kubectl(&[
        "wait",
        "--for=condition=Available",
        "hugepagepool/consumers-2mi",
        "--timeout=300s",
    ]);
    assert_eq!(read_sys("nr_hugepages"), 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn helm_uninstall_mid_drain_leaves_no_taint_and_no_stuck_finalizer() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    node.with_pool(64, "10m").await;
    // A consumer its PDB never lets go: the Release shrink of the deleted
    // pool drains under the taint, and the pool waits on its finalizer.
    node.start_protected_holder().await;
    node.kubectl(&["delete", "hugepagepool", "consumers-2mi", "--wait=false"]);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let pools: Api<HugePagePool> = Api::all(client.clone());
    wait_for(
        "the drain taint on a deleted pool",
        Duration::from_secs(300),
        || async {
            let n = nodes.get(&node.name).await.map_err(|e| e.to_string())?;
            let pool = pools
                .get_opt("consumers-2mi")
                .await
                .map_err(|e| e.to_string())?;
            let held = pool.as_ref().is_some_and(|p| {
                p.metadata.deletion_timestamp.is_some()
                    && kube::ResourceExt::finalizers(p)
                        .iter()
                        .any(|f| f == hugepool_crds::POOL_FINALIZER)
            });
            if node_tainted_draining(&n) && held {
                Ok(())
            } else {
                Err(format!(
                    "tainted {}, pool held {held}",
                    node_tainted_draining(&n)
                ))
            }
        },
    )
    .await;
    let pages_before = read_sys("nr_hugepages");

    let out = node.run(
        &node.helm,
        &[
            "uninstall",
            "hugepool",
            "--namespace",
            NAMESPACE,
            "--wait",
            "--timeout",
            "5m",
        ],
    );
    // Nothing is left that only a running operator could clear.
    let n = nodes.get(&node.name).await.expect("Node");
    assert!(
        !node_tainted_draining(&n),
        "taint left after uninstall: {out}"
    );
    assert!(
        pools
            .get_opt("consumers-2mi")
            .await
            .expect("get pool")
            .is_none(),
        "the deleted pool is gone: its finalizer was removed"
    );
    // The operator is gone and so is the hook (deleted once it succeeded).
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    assert!(
        deployments
            .get_opt("hugepool-operator")
            .await
            .expect("get")
            .is_none()
    );
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(client.clone(), NAMESPACE);
    assert!(
        jobs.list(&ListParams::default())
            .await
            .expect("jobs")
            .items
            .is_empty(),
        "the uninstall Job is deleted once it succeeded"
    );
    // What uninstall leaves as it was: the consumer and the kernel's pages.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    assert!(pods.get_opt("holder").await.expect("get holder").is_some());
    assert_eq!(
        read_sys("nr_hugepages"),
        pages_before,
        "uninstall leaves the pages"
    );
}

/// The kubelet's Memory Manager checkpoint and the CPU Manager's, as files.
/// hugetlb limits as a real node enforces them (the test node mounts the
/// hugetlb controller and runs containerd 2.x with NRI): the kubelet keeps
/// `kubepods` unbounded and sets each pod's limit (and reservation limit)
/// to the pod's request, runc each container's. After a grow and the
/// agent's kubelet restart, a pod that requests more than the old pool
/// faults every page it requested, and the kernel refuses it one more,
/// while the pool has pages free.
#[tokio::test(flavor = "multi_thread")]
async fn after_a_grow_and_the_kubelet_restart_a_pod_faults_exactly_the_pages_it_requested() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    // The node's runtime as production runs it: containerd 2.x, NRI on (its
    // socket in the node's /run).
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let runtime = nodes
        .get(&node.name)
        .await
        .expect("Node")
        .status
        .and_then(|s| s.node_info)
        .map(|i| i.container_runtime_version)
        .unwrap_or_default();
    assert!(runtime.starts_with("containerd://2."), "{runtime}");
    let nri = std::fs::metadata(node.root.join("run/nri/nri.sock"));
    assert!(
        std::os::unix::fs::FileTypeExt::is_socket(&nri.expect("NRI's socket").file_type()),
        "NRI listens"
    );
    node.with_pool(32, "2m").await;

    node.set_pool_pages(96);
    wait_for(
        "the kubelet reports 96 pages",
        Duration::from_secs(300),
        || async {
            match node.kubelet_capacity_2mi(&client).await {
                c if c == "192Mi" => Ok(()),
                c => Err(c),
            }
        },
    )
    .await;
    node.wait_available("consumers-2mi");
    node.wait_kubepods_unbounded().await;

    // 80 pages: more than the pool had before the grow.
    node.start_holder_with("exact", 80, 80, &["--and-one-more"]);
    node.wait_in_use(96, 80).await;
    let one_more = node.wait_log_line("exact", "one more page:").await;
    assert!(
        one_more.contains("refused"),
        "the 81st page is refused by the pod's hugetlb limit: {one_more}"
    );
    assert_eq!(read_sys("nr_hugepages") - read_sys("free_hugepages"), 80);
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let (pod, container) = node.pod_cgroups(&pods, "exact").await;
    eprintln!("the 81st page: {one_more}");
    // The kubelet sets the pod's reservation limit too (kernel 5.7+), so a
    // mapping past the request fails at mmap rather than with SIGBUS at its
    // fault; runc 1.1 sets the container's fault limit only.
    assert_eq!(
        node.hugetlb_2mi(&pod, "rsvd.limit_in_bytes"),
        Some(bytes_2mi(80)),
        "{pod}: the reservation limit is the request"
    );
    for cgroup in [&pod, &container] {
        assert_eq!(
            node.hugetlb_2mi(cgroup, "limit_in_bytes"),
            Some(bytes_2mi(80)),
            "{cgroup}: the limit is the request"
        );
        assert_eq!(
            node.hugetlb_2mi(cgroup, "usage_in_bytes"),
            Some(bytes_2mi(80)),
            "{cgroup}: charged for the pages it holds"
        );
    }
    assert_eq!(
        node.hugetlb_2mi("kubepods", "usage_in_bytes"),
        Some(bytes_2mi(80))
    );

    // The agent counts what the node's pods request from those limits (its
    // own pod's is 0), and the pool sums it; the agent's own token reads
    // its HugePageNode but no pod of the cluster.
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    wait_for(
        "the agent reports 80 pages requested",
        Duration::from_secs(120),
        || async {
            let hpn = hpns.get(&node.name).await.map_err(|e| e.to_string())?;
            let requested = hpn.status.as_ref().and_then(|s| {
                s.page_sizes
                    .iter()
                    .find(|p| p.size == PageSize::SIZE_2MI)
                    .and_then(|p| p.requested)
            });
            match requested {
                Some(80) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let pools: Api<HugePagePool> = Api::all(client.clone());
    wait_for(
        "the pool sums 80 pages requested",
        Duration::from_secs(120),
        || async {
            let pool = pools
                .get("consumers-2mi")
                .await
                .map_err(|e| e.to_string())?;
            let pages = pool.status.map(|s| s.pages).unwrap_or_default();
            match (pages.requested, pages.unrequested) {
                (80, 16) => Ok(()),
                other => Err(format!("(requested, unrequested) {other:?}")),
            }
        },
    )
    .await;
    let agent = node.client_as("hugepool-agent").await;
    Api::<HugePageNode>::all(agent.clone())
        .get(&node.name)
        .await
        .expect("the agent's token reads its HugePageNode");
    match Api::<Pod>::all(agent).list(&ListParams::default()).await {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("the agent's token listed pods: {other:?}"),
    }
    assert!(
        node.hugetlb_2mi(&pod, "rsvd.failcnt").unwrap_or(0) > 0,
        "the pod's reservation limit counted the refused page"
    );
}

/// A pool consumed through DRA, end to end on the real node (containerd 2.x
/// with NRI, the hugetlb controller enforcing, the real scheduler): grown
/// with no kubelet restart, its slice shows the new pages, a claim for more
/// than the old pool is allocated and prepared by the agent's kubelet
/// plugin, and its pod, which requests no hugepages-2Mi, faults exactly the
/// claimed pages (the NRI plugin's limits) and is refused one more.
#[tokio::test(flavor = "multi_thread")]
async fn a_grown_dra_pool_is_claimed_and_faulted_at_once_with_no_kubelet_restart() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    node.with_dra_pool().await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let allocatable = || async {
        nodes
            .get(&node.name)
            .await
            .expect("Node")
            .status
            .and_then(|s| s.allocatable)
            .and_then(|a| a.get("hugepages-2Mi").map(|q| q.0.clone()))
    };
    let run = node.kubelet_run();
    let allocatable_before = allocatable().await;

    // The grow: the slice follows within seconds, the kubelet is left alone.
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "claims-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"pages":96}}"#,
    ]);
    let slices: Api<kube::api::DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceSlice"),
            "resourceslices",
        ),
    );
    let slice_name = format!("{}-hugepool", node.name);
    let advertised = allocatable_before
        .as_deref()
        .map(|q| hugepool_crds::quantity::parse_bytes(q).expect("a quantity") / bytes_2mi(1))
        .unwrap_or(0);
    let claimable = bytes_2mi(96 - advertised);
    wait_for(
        "the slice shows the grown pool",
        Duration::from_secs(300),
        || async {
            let slice = slices.get(&slice_name).await.map_err(|e| e.to_string())?;
            let memory = slice.data["spec"]["devices"][0]["capacity"]["memory"]["value"]
                .as_str()
                .map(|q| hugepool_crds::quantity::parse_bytes(q).unwrap_or(0));
            match memory {
                Some(bytes) if bytes == claimable => Ok(()),
                other => Err(format!("{other:?} of {claimable}")),
            }
        },
    )
    .await;
    assert_eq!(read_sys("nr_hugepages"), 96);

    // 80 pages claimed: more than the pool had before the grow.
    node.claim_pod("claimer", 80, &["/hugepage-holder", "80", "--and-one-more"]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    wait_for("the claimer runs", Duration::from_secs(300), || async {
        let pod = pods.get("claimer").await.map_err(|e| e.to_string())?;
        let status = pod.status.unwrap_or_default();
        if status.phase.as_deref() == Some("Running") {
            return Ok(());
        }
        let events = node.kubectl(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector",
            "involvedObject.name=claimer",
            "-o",
            "custom-columns=REASON:.reason,MESSAGE:.message",
        ]);
        let journal = Command::new(node.cp.dir.join("node").join("journalctl"))
            .args(["--unit", "kubelet", "--no-pager", "--output", "cat"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let kubelet: Vec<_> = journal
            .lines()
            .filter(|l| l.contains("hugepool.dev") || l.contains("plugin"))
            .collect();
        let agent = Command::new(hugepool_e2e::kubectl_path())
            .args([
                "--kubeconfig",
                node.cp.control_plane.kubeconfig.to_str().unwrap(),
            ])
            .args([
                "logs",
                "-n",
                NAMESPACE,
                "daemonset/hugepool-agent",
                "--all-containers",
            ])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        Err(format!(
            "{:?} {:?}\n{events}\nkubelet:\n{}\nagent:\n{agent}",
            status.phase,
            status.container_statuses,
            kubelet.join("\n")
        ))
    })
    .await;
    node.wait_in_use(96, 80).await;
    let one_more = node.wait_log_line("claimer", "one more page:").await;
    assert!(
        one_more.contains("refused"),
        "the 81st page is refused by the claim's hugetlb limits: {one_more}"
    );
    assert_eq!(
        read_sys_node0("free_hugepages"),
        16,
        "the claim's pages came off NUMA node 0, the device's"
    );
    let (pod, container) = node.pod_cgroups(&pods, "claimer").await;
    for (cgroup, file) in [
        (&pod, "limit_in_bytes"),
        (&pod, "rsvd.limit_in_bytes"),
        (&container, "limit_in_bytes"),
    ] {
        assert_eq!(
            node.hugetlb_2mi(cgroup, file),
            Some(bytes_2mi(80)),
            "{cgroup} {file}: the claim's pages, the kubelet gave 0"
        );
    }
    assert_eq!(
        node.hugetlb_2mi(&container, "usage_in_bytes"),
        Some(bytes_2mi(80))
    );
    // No kubelet restart, its allocatable untouched.
    assert_eq!(node.kubelet_run(), run, "the kubelet was not restarted");
    assert_eq!(allocatable().await, allocatable_before);

    // A claim prepared but not faulted yet holds its pages against a
    // shrink: the pool stops at them and says why; with drain IfNeeded the
    // operator evicts the claim's pod, and the shrink goes on once the
    // kubelet has let the claim go.
    node.kubectl(&["delete", "pod", "claimer", "--wait=true"]);
    node.claim_pod("sleeper", 40, &["/pause"]);
    wait_for("the sleeper runs", Duration::from_secs(300), || async {
        let phase = pods
            .get("sleeper")
            .await
            .map_err(|e| e.to_string())?
            .status
            .and_then(|s| s.phase);
        match phase.as_deref() {
            Some("Running") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "claims-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"pages":20}}"#,
    ]);
    wait_for(
        "the shrink held at the claim's 40 pages",
        Duration::from_secs(300),
        || async {
            let blocked = node_condition(&client, &node.name, "ShrinkBlocked").await;
            match (read_sys("nr_hugepages"), &blocked) {
                (40, Some((status, _, message)))
                    if status == "True"
                        && message
                            .contains("40 pages claims hold (DRA: 40 prepared by the kubelet") =>
                {
                    Ok(())
                }
                (nr, _) => Err(format!("pool {nr}, ShrinkBlocked {blocked:?}")),
            }
        },
    )
    .await;
    assert_eq!(read_sys("free_hugepages"), 40, "held, not in use");
    let sleeper_uid = pods
        .get("sleeper")
        .await
        .expect("sleeper")
        .metadata
        .uid
        .expect("uid");
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "claims-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"drain":{"policy":"IfNeeded","timeout":"5m"}}}"#,
    ]);
    wait_for(
        "the shrink done once the claim's pod is evicted",
        Duration::from_secs(300),
        || async {
            match read_sys("nr_hugepages") {
                20 => Ok(()),
                nr => Err(format!("pool {nr}")),
            }
        },
    )
    .await;
    // Evicted: gone, or still terminating (its pages came back when the
    // kubelet let its claim go, which may be before the object goes).
    assert!(
        pods.get_opt("sleeper")
            .await
            .expect("get sleeper")
            .is_none_or(|p| p.metadata.uid.as_ref() != Some(&sleeper_uid)
                || p.metadata.deletion_timestamp.is_some()),
        "the operator evicted the claim's pod"
    );
    let evicted = evicted_pods(&client, "claims-2mi").await;
    assert!(
        evicted.iter().any(|e| e.pod == "default/sleeper"
            && e.uid == sleeper_uid
            && e.pages == 40
            && e.reason.contains("held 40 pages")),
        "the pool records the eviction, its pages and why: {evicted:?}"
    );
    wait_drain_complete(&client, &node.name).await;

    // A kubelet restarted by someone else deletes the node's slices when it
    // starts, and then advertises the whole pool as hugepages-2Mi: the agent
    // publishes the slice again (a newer generation), its device no longer
    // below the 10 pages a running claim holds, and the claim keeps them;
    // the node and the pool say that the kubelet offers the claim's pages
    // too (KubeletAdvertisesClaimPool).
    node.claim_pod("keeper", 10, &["/hugepage-holder", "10"]);
    node.wait_in_use(20, 10).await;
    let generation =
        |slice: &kube::api::DynamicObject| slice.data["spec"]["pool"]["generation"].as_i64();
    let before = generation(&slices.get(&slice_name).await.expect("the slice"));
    let run = node.kubelet_run();
    node.systemctl(&["restart", "kubelet"]);
    assert_ne!(node.kubelet_run(), run, "the kubelet restarted");
    wait_for(
        "the slice published again, at the claim's pages",
        Duration::from_secs(300),
        || async {
            let slice = slices.get(&slice_name).await.map_err(|e| e.to_string())?;
            let memory = slice.data["spec"]["devices"][0]["capacity"]["memory"]["value"].clone();
            let advertised = allocatable().await;
            match (generation(&slice), memory.as_str(), advertised.as_deref()) {
                (Some(g), Some("20Mi"), Some("40Mi")) if Some(g) > before => Ok(()),
                other => Err(format!(
                    "(generation, memory, allocatable) {other:?}, before {before:?}"
                )),
            }
        },
    )
    .await;
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    let stale = wait_for(
        "the node names the kubelet that advertises the claim pool",
        Duration::from_secs(120),
        || async {
            let object = hpns.get(&node.name).await.map_err(|e| e.to_string())?;
            let condition = object
                .status
                .as_ref()
                .and_then(|s| {
                    find_condition(&s.conditions, NodeConditionType::KubeletCapacityStale)
                })
                .cloned();
            match condition {
                Some(c) if c.status == "True" && c.reason == "KubeletAdvertisesClaimPool" => Ok(c),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(
        stale
            .message
            .contains("the kubelet advertises 20 of the 20 pages of pool claims-2mi")
            && stale
                .message
                .contains("10 of the 10 pages claims hold are offered both ways"),
        "{}",
        stale.message
    );
    let pools: Api<HugePagePool> = Api::all(client.clone());
    wait_for(
        "the pool names the kubelet that advertises it",
        Duration::from_secs(120),
        || async {
            let pool = pools.get("claims-2mi").await.map_err(|e| e.to_string())?;
            let available = pool
                .status
                .as_ref()
                .and_then(|s| find_condition(&s.conditions, PoolConditionType::Available))
                .cloned();
            match available {
                Some(c)
                    if c.reason == "KubeletAdvertisesClaimPool"
                        && c.message.contains(&node.name) =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let phase = pods
        .get("keeper")
        .await
        .expect("keeper")
        .status
        .and_then(|s| s.phase);
    assert_eq!(phase.as_deref(), Some("Running"));
    node.wait_in_use(20, 10).await;
}

/// hugepool-hooks gives a container pages only from a claim the agent
/// prepared for its pod: a pod writes its own environment, so a variable
/// forged there, or copied from another pod's claim, refuses the container
/// with the reason in the pod's events, and a claim shared by two pods gives
/// its pages to the first only.
#[tokio::test(flavor = "multi_thread")]
async fn claimed_pages_go_only_to_the_pod_the_claim_was_prepared_for() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    node.with_dra_pool().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");

    // The hooks container has no API token: the service account's is the
    // agent's, and an empty directory takes its place.
    let agents: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let agent = agents
        .list(&ListParams::default().labels("app.kubernetes.io/component=agent"))
        .await
        .expect("agent pods")
        .items
        .into_iter()
        .next()
        .expect("an agent pod");
    let token_mounts = |container: &str| -> Vec<String> {
        agent
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .filter(|c| c.name == container)
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .filter(|m| m.mount_path == "/var/run/secrets/kubernetes.io/serviceaccount")
            .map(|m| m.name.clone())
            .collect()
    };
    assert_eq!(token_mounts("hooks"), ["no-api-token"]);
    assert!(
        token_mounts("agent")
            .iter()
            .all(|m| m.starts_with("kube-api-access")),
        "the agent keeps its token: {:?}",
        token_mounts("agent")
    );
    // Of the host's cgroups the hooks see only the hugetlb hierarchy, the
    // one they write (and pods faulting claims through it prove it is the
    // one that counts).
    let cgroup_mounts: Vec<String> = agent
        .spec
        .iter()
        .flat_map(|s| &s.containers)
        .filter(|c| c.name == "hooks")
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .filter(|m| m.mount_path.starts_with("/host/sys/fs/cgroup"))
        .map(|m| m.mount_path.clone())
        .collect();
    assert_eq!(cgroup_mounts, ["/host/sys/fs/cgroup/hugetlb"]);

    // A pod with no claim that names pages in its own environment.
    node.env_pod(
        "forger",
        "HUGEPOOL_PAGES_FORGED_0",
        "size=2Mi,numa=0,pages=10",
        "",
    );
    let refused = node
        .wait_event("forger", "no claim prepared on this node holds")
        .await;
    assert!(
        refused.contains("pages come only from a ResourceClaim"),
        "{refused}"
    );
    assert_eq!(read_sys("free_hugepages"), read_sys("nr_hugepages"));

    // The claimer's own variable, copied by a pod with no claim.
    node.claim_pod("claimer", 10, &["/hugepage-holder", "10"]);
    node.wait_running(&pods, "claimer").await;
    node.wait_in_use(32, 10).await;
    let claimer = pods.get("claimer").await.expect("claimer");
    let claimer_uid = claimer.metadata.uid.clone().expect("uid");
    let claim_name = claimer
        .status
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|c| c.into_iter().next())
        .and_then(|c| c.resource_claim_name)
        .expect("the claim made from the template");
    let claims: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        "default",
        &hugepool_crds::dra::resource_claims(),
    );
    let claim_uid = claims
        .get(&claim_name)
        .await
        .expect("the claimer's claim")
        .metadata
        .uid
        .expect("uid");
    let variable = format!(
        "HUGEPOOL_PAGES_{}_0",
        claim_uid.replace('-', "_").to_uppercase()
    );
    node.env_pod("copier", &variable, "size=2Mi,numa=0,pages=10", "");
    let refused = node
        .wait_event(
            "copier",
            &format!("was prepared for pod {claimer_uid}, not for this pod"),
        )
        .await;
    assert!(refused.contains(&claim_name), "{refused}");
    node.wait_in_use(32, 10).await;

    // One claim named by two pods: the first has its 4 pages, the second
    // nothing, and says why.
    node.apply(
        r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: shared, namespace: default}
spec:
  devices:
    requests:
    - name: pages
      exactly:
        deviceClassName: hugepages-2mi.hugepool.dev
        capacity: {requests: {memory: 8Mi}}
"#,
    );
    node.env_pod("first", "UNUSED", "", "shared");
    node.wait_running(&pods, "first").await;
    node.wait_in_use(32, 14).await;
    node.env_pod("second", "UNUSED", "", "shared");
    let refused = node
        .wait_event("second", "a claim's pages go to one pod")
        .await;
    eprintln!("the second holder of a shared claim: {refused}");
    let phase = pods
        .get("second")
        .await
        .expect("second")
        .status
        .and_then(|s| s.phase);
    assert_ne!(phase.as_deref(), Some("Running"));
    node.wait_in_use(32, 14).await;

    // A claim's pages are also a hugetlbfs of their size holding at most
    // them (what DPDK without --in-memory and SPDK map files in): a file
    // of the claim's 6 pages maps and faults there, one more does not.
    node.claim_pod(
        "filer",
        6,
        &[
            "/hugepage-holder",
            "6",
            "--and-one-more",
            "--hugetlbfs",
            "from-env",
        ],
    );
    node.wait_running(&pods, "filer").await;
    let mount = node.wait_log_line("filer", "hugetlbfs").await;
    assert!(
        mount.contains("/hugepages/") && mount.contains(": 6 pages of 2048kB"),
        "{mount}"
    );
    node.wait_in_use(32, 20).await;
    let one_more = node.wait_log_line("filer", "one more page:").await;
    assert!(
        one_more.contains("refused by mmap"),
        "a 7th page in the claim's hugetlbfs: {one_more}"
    );
    for pod in ["forger", "copier", "second"] {
        let status = pods.get(pod).await.expect("pod").status.unwrap_or_default();
        let started = status.container_statuses.into_iter().flatten().any(|c| {
            c.state
                .is_some_and(|s| s.running.is_some() || s.terminated.is_some())
        });
        assert!(!started, "{pod}'s container was never created");
    }
}

/// A file of NUMA node 0's 2Mi pool.
fn read_sys_node0(file: &str) -> u64 {
    let path = format!("/sys/devices/system/node/node0/hugepages/hugepages-2048kB/{file}");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .expect("a number")
}

fn kubelet_state(node: &Node, file: &str) -> Option<String> {
    std::fs::read_to_string(node.kubelet_root.join(file)).ok()
}

/// A kubelet with the Static Memory Manager refuses to start on a
/// checkpoint whose hugepages differ from the machine's: the agent removes
/// it when no pod holds memory in it, so a resize with AfterResize ends with
/// the kubelet Ready on the new capacity; while a Guaranteed pod holds an
/// assignment the restart is held and the node names the pod. The CPU
/// Manager's checkpoint never changes.
#[tokio::test(flavor = "multi_thread")]
async fn a_static_memory_manager_kubelet_is_restarted_only_when_no_pod_holds_memory() {
    let Some(node) = Node::start_with(&["--memory-manager=Static"]) else {
        return;
    };
    let client = node.client().await;
    let checkpoint = kubelet_state(&node, "memory_manager_state")
        .expect("a Static Memory Manager writes its checkpoint at start");
    assert!(
        checkpoint.contains("\"policyName\":\"Static\""),
        "{checkpoint}"
    );
    let cpu_before = kubelet_state(&node, "cpu_manager_state");
    let first_kubelet = node.kubelet_run();

    // No pod holds memory: grown, checkpoint removed, kubelet restarted once
    // and Ready with the new capacity (it would crash-loop on the old one).
    node.with_pool(64, "2m").await;
    assert_eq!(read_sys("nr_hugepages"), 64);
    assert_eq!(node.kubelet_capacity_2mi(&client).await, "128Mi");
    let restarted = node.kubelet_run();
    assert_ne!(restarted, first_kubelet, "the kubelet was restarted");
    let (status, reason, _) = node_condition(&client, &node.name, "KubeletCapacityStale")
        .await
        .expect("KubeletCapacityStale");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "CapacityMatches")
    );
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let ready = nodes
        .get(&node.name)
        .await
        .expect("Node")
        .status
        .and_then(|s| s.conditions)
        .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status);
    assert_eq!(
        ready.as_deref(),
        Some("True"),
        "the kubelet came back Ready"
    );
    let rewritten = kubelet_state(&node, "memory_manager_state").expect("a new checkpoint");
    assert!(
        rewritten.contains("134217728"),
        "the new checkpoint has the 64 x 2Mi pool (134217728 bytes): {rewritten}"
    );
    assert_eq!(
        kubelet_state(&node, "cpu_manager_state"),
        cpu_before,
        "the CPU Manager's checkpoint is left alone"
    );

    // A Guaranteed pod with a memory assignment, and drain policy Never: a
    // grow is not followed by a restart, and the node names the pod.
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "consumers-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"drain":{"policy":"Never","timeout":"2m"}}}"#,
    ]);
    node.start_holder("mm-holder", 8);
    node.wait_in_use(64, 8).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let uid = pods
        .get("mm-holder")
        .await
        .expect("holder pod")
        .metadata
        .uid
        .expect("uid");
    let assigned = kubelet_state(&node, "memory_manager_state").unwrap_or_default();
    assert!(
        assigned.contains(&uid),
        "the holder has an assignment: {assigned}"
    );
    node.set_pool_pages(96);
    let message = wait_for(
        "the restart held for the holder",
        Duration::from_secs(300),
        || async {
            match node_condition(&client, &node.name, "KubeletCapacityStale").await {
                Some((status, reason, message))
                    if status == "True" && reason == "MemoryManagerAssignments" =>
                {
                    Ok(message)
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(
        message.contains(&uid) || message.contains("mm-holder"),
        "{message}"
    );
    // The node lists the pod for the operator, which leaves it (Never).
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    let listed = hpns
        .get(&node.name)
        .await
        .expect("HugePageNode")
        .status
        .map(|s| s.memory_manager_pods)
        .unwrap_or_default();
    assert_eq!(
        listed,
        std::slice::from_ref(&uid),
        "status.memoryManagerPods"
    );
    assert_eq!(read_sys("nr_hugepages"), 96, "the pool itself grew");
    assert_eq!(
        node.kubelet_run(),
        restarted,
        "no restart while the pod holds memory"
    );
    assert_eq!(
        read_sys("free_hugepages"),
        96 - 8,
        "the holder kept its pages"
    );
    assert!(
        pods.get_opt("mm-holder").await.expect("get").is_some(),
        "drain policy Never evicts nobody"
    );

    // Drain policy IfNeeded: the operator evicts the pod, the agent then
    // removes the checkpoint and restarts the kubelet, which reports 96.
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "consumers-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"drain":{"policy":"IfNeeded"}}}"#,
    ]);
    wait_for(
        "the kubelet reports 96 pages",
        Duration::from_secs(300),
        || async {
            let capacity = node.kubelet_capacity_2mi(&client).await;
            if capacity == "192Mi" {
                Ok(())
            } else {
                Err(capacity)
            }
        },
    )
    .await;
    assert!(
        pods.get_opt("mm-holder")
            .await
            .expect("get")
            .is_none_or(|p| p.metadata.uid.as_ref() != Some(&uid)),
        "the operator evicted the holder"
    );
    assert_ne!(
        node.kubelet_run(),
        restarted,
        "restarted once the pod was gone"
    );
    let evicted = evicted_pods(&client, "consumers-2mi").await;
    assert!(
        evicted
            .iter()
            .any(|e| e.pod == "default/mm-holder" && e.reason.contains("Static Memory Manager")),
        "the pool records the eviction and why: {evicted:?}"
    );
    wait_drain_complete(&client, &node.name).await;
    assert_eq!(
        kubelet_state(&node, "cpu_manager_state"),
        cpu_before,
        "the CPU Manager's checkpoint is left alone"
    );
}

/// A Deployment's Guaranteed pod holds Memory Manager memory when the pool
/// grows: the operator evicts it once, the node keeps the draining taint
/// until the restarted kubelet reports the new capacity (no version of the
/// Node is untainted while it shows the old one), so the replacement waits
/// Pending and then runs on the new capacity without holding the restart
/// again; the kubelet is restarted once and never crash-loops.
#[tokio::test(flavor = "multi_thread")]
async fn a_replacement_pod_waits_for_the_restarted_kubelet_and_holds_nothing() {
    let Some(node) = Node::start_with(&["--memory-manager=Static"]) else {
        return;
    };
    let client = node.client().await;
    node.with_pool(64, "2m").await;
    let crash_restarts = node.systemctl(&["show", "--property=NRestarts", "--value", "kubelet"]);
    node.apply(&format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: mm-app, namespace: default}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: mm-app}}}}
  template:
    metadata: {{labels: {{app: mm-app}}}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: holder
        image: localhost/hugepool-e2e:{version}
        command: [/hugepage-holder, "8"]
        resources:
          limits: {{hugepages-2Mi: 16Mi, memory: 64Mi, cpu: 100m}}
"#,
        version = env!("CARGO_PKG_VERSION"),
    ));
    node.wait_in_use(64, 8).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let app = ListParams::default().labels("app=mm-app");
    let running = |pod: &Pod| {
        pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && pod.metadata.deletion_timestamp.is_none()
    };
    // Its pages faulted is not yet its status written: wait for Running.
    let first = wait_for(
        "the Deployment's pod runs",
        Duration::from_secs(120),
        || async {
            pods.list(&app)
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .find(running)
                .and_then(|p| p.metadata.uid)
                .ok_or_else(|| "no running pod yet".to_string())
        },
    )
    .await;
    let kubelet_before = node.kubelet_run();

    // Every version of the Node from here on: (draining taint, capacity).
    let versions = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(bool, String)>::new()));
    let recorder = {
        let versions = std::sync::Arc::clone(&versions);
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
        let config = kube::runtime::watcher::Config::default()
            .fields(&format!("metadata.name={}", node.name));
        tokio::spawn(async move {
            use futures::StreamExt;
            use kube::runtime::WatchStreamExt;
            let mut stream =
                std::pin::pin!(kube::runtime::watcher(nodes, config).applied_objects());
            while let Some(Ok(seen)) = stream.next().await {
                let capacity = seen
                    .status
                    .as_ref()
                    .and_then(|s| s.capacity.as_ref())
                    .and_then(|c| c.get("hugepages-2Mi").map(|q| q.0.clone()))
                    .unwrap_or_default();
                versions
                    .lock()
                    .expect("versions")
                    .push((node_tainted_draining(&seen), capacity));
            }
        })
    };
    node.set_pool_pages(96);
    let replacement = wait_for(
        "a replacement pod runs",
        Duration::from_secs(300),
        || async {
            let listed = pods.list(&app).await.map_err(|e| e.to_string())?;
            listed
                .items
                .into_iter()
                .find(|p| running(p) && p.metadata.uid.as_ref() != Some(&first))
                .ok_or_else(|| "not yet".to_string())
        },
    )
    .await;
    node.wait_available("consumers-2mi");
    recorder.abort();
    assert_eq!(node.kubelet_capacity_2mi(&client).await, "192Mi");
    assert_eq!(read_sys("nr_hugepages"), 96);

    let versions = versions.lock().expect("versions").clone();
    let drained = versions
        .iter()
        .position(|(tainted, _)| *tainted)
        .unwrap_or_else(|| panic!("the node was drained: {versions:?}"));
    assert!(
        versions[drained..]
            .iter()
            .all(|(tainted, capacity)| *tainted || capacity != "128Mi"),
        "a version of the Node without the taint showed the old capacity: {versions:?}"
    );
    assert!(
        versions
            .last()
            .is_some_and(|(tainted, capacity)| !tainted && capacity == "192Mi"),
        "{versions:?}"
    );
    // Evicted once, and recorded once.
    let evicted: Vec<_> = evicted_pods(&client, "consumers-2mi")
        .await
        .into_iter()
        .filter(|e| e.pod.starts_with("default/mm-app-"))
        .collect();
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    // The replacement holds its pages on the new capacity; the restart it
    // would have held happened before it was scheduled.
    let uid = replacement.metadata.uid.clone().expect("uid");
    let checkpoint = kubelet_state(&node, "memory_manager_state").unwrap_or_default();
    assert!(
        checkpoint.contains(&uid) && checkpoint.contains("201326592"),
        "the new checkpoint has the replacement and the 96 x 2Mi pool: {checkpoint}"
    );
    assert_ne!(
        node.kubelet_run(),
        kubelet_before,
        "the kubelet was restarted"
    );
    assert_eq!(
        node.systemctl(&["show", "--property=NRestarts", "--value", "kubelet"]),
        crash_restarts,
        "systemd never had to restart a failed kubelet"
    );
    let (status, reason, _) = node_condition(&client, &node.name, "KubeletCapacityStale")
        .await
        .expect("KubeletCapacityStale");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "CapacityMatches")
    );
}

/// systemd restarts a kubelet that cannot start (Restart=always), so the
/// restart command succeeds; only the Node shows that it did not come back.
#[tokio::test]
async fn a_kubelet_that_does_not_come_back_is_a_failed_restart_with_its_last_error() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    let config = node.cp.dir.join("node").join("kubelet.yaml");
    let good = std::fs::read_to_string(&config).expect("kubelet.yaml");
    // The running kubelet read its config when it started: only the next
    // one sees this.
    std::fs::write(&config, format!("{good}\nport: [unclosed\n")).expect("break kubelet.yaml");
    node.with_pool_and(
        64,
        "2m",
        "AfterResize",
        &["agent.kubeletRestart.readyTimeout=30s"],
    );
    let message = wait_for(
        "KubeletRestartFailed on the node",
        Duration::from_secs(300),
        || async {
            match node_condition(&client, &node.name, "KubeletCapacityStale").await {
                Some((status, reason, message))
                    if status == "True" && reason == "KubeletRestartFailed" =>
                {
                    Ok(message)
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert_eq!(read_sys("nr_hugepages"), 64, "the pool itself was grown");
    // The agent read the kubelet's journal through the node's systemd.
    assert!(
        message.contains("the kubelet did not report 64 x 2Mi within 30s of its restart")
            && message.contains("the kubelet's last error: ")
            && message.contains("failed to load kubelet config file"),
        "{message}"
    );
    assert!(message.contains("attempt 1, next in 10s"), "{message}");
    // Fixed, the next attempt brings it back with the pool.
    std::fs::write(&config, good).expect("restore kubelet.yaml");
    node.wait_available("consumers-2mi");
    assert_eq!(node.kubelet_capacity_2mi(&client).await, "128Mi");
    let (status, reason, _) = node_condition(&client, &node.name, "KubeletCapacityStale")
        .await
        .expect("KubeletCapacityStale");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "CapacityMatches")
    );
}

fn node_tainted(node: &k8s_openapi::api::core::v1::Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
}

/// A node that comes back with its pool short of its target (a reboot as
/// the agent sees it: the kernel's pool emptied, the kubelet and the agent
/// restarted) keeps ordinary pods off under `hugepool.dev/not-ready` until
/// the pool is back and the kubelet reports it; then they schedule. The
/// pool's memory guard holds the restore back while the test looks, so the
/// window is a state to wait for, not a race.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_back_with_its_pool_short_keeps_ordinary_pods_off_until_the_pool_is_back() {
    let Some(node) = Node::start() else {
        return;
    };
    let client = node.client().await;
    node.with_pool(64, "2m").await;
    assert_eq!(node.kubelet_capacity_2mi(&client).await, "128Mi");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let tainted = || async {
        let current = nodes.get(&node.name).await.map_err(|e| e.to_string())?;
        Ok::<bool, String>(node_tainted(&current, hugepool_crds::NOT_READY_TAINT))
    };
    assert!(!tainted().await.expect("Node"), "a converged node");
    // No memory is ever enough: growth waits for the guard to come down.
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "consumers-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"allocation":{"minMemAvailable":"100Ti"}}}"#,
    ]);
    node.wait_available("consumers-2mi");

    // The "reboot": the pool gone behind everyone's back, the kubelet
    // restarted (it registers 0 pages), the agent started anew.
    std::fs::write(Path::new(SYSFS_2MI).join("nr_hugepages"), "0").expect("empty the pool");
    let restart = Command::new(&node.systemctl)
        .args(["restart", "kubelet"])
        .output()
        .expect("restart the kubelet");
    assert!(restart.status.success(), "{restart:?}");
    wait_for(
        "the kubelet reports the emptied pool",
        Duration::from_secs(300),
        || async {
            let capacity = node.kubelet_capacity_2mi(&client).await;
            (capacity == "0").then_some(()).ok_or(capacity)
        },
    )
    .await;
    node.kubectl(&[
        "delete",
        "pod",
        "-n",
        NAMESPACE,
        "-l",
        "app.kubernetes.io/component=agent",
        "--wait=false",
    ]);
    let message = wait_for(
        "the new agent reports Restoring",
        Duration::from_secs(300),
        || async {
            match node_condition(&client, &node.name, "Restoring").await {
                Some((status, _, message)) if status == "True" => Ok(message),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(message.contains("2Mi: 0 of 64 pages"), "{message}");
    wait_for("the not-ready taint", Duration::from_secs(120), || async {
        if tainted().await? {
            Ok(())
        } else {
            Err("not tainted".to_string())
        }
    })
    .await;

    // An ordinary pod (no hugepages, no tolerations) stays Pending.
    node.apply(&format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: ordinary, namespace: default}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: localhost/hugepool-e2e:{version}
    resources:
      limits: {{memory: 32Mi, cpu: 50m}}
"#,
        version = env!("CARGO_PKG_VERSION"),
    ));
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let unschedulable = wait_for(
        "the ordinary pod refused by the scheduler",
        Duration::from_secs(120),
        || async {
            let pod = pods.get("ordinary").await.map_err(|e| e.to_string())?;
            let status = pod.status.clone().unwrap_or_default();
            status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                .and_then(|c| c.message)
                .ok_or(format!("{:?}", pod.spec.and_then(|s| s.node_name)))
        },
    )
    .await;
    // The scheduler does not name the taint: the node carries only ours.
    assert!(
        unschedulable.contains("untolerated taint"),
        "{unschedulable}"
    );
    let keys: Vec<String> = nodes
        .get(&node.name)
        .await
        .expect("Node")
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect();
    assert_eq!(keys, [hugepool_crds::NOT_READY_TAINT]);
    assert_eq!(read_sys("nr_hugepages"), 0, "the guard holds the restore");

    // The guard down: the pool comes back, the agent restarts the kubelet
    // (AfterResize), the taint goes and the pod schedules.
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "consumers-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"allocation":{"minMemAvailable":"100Mi"}}}"#,
    ]);
    wait_for(
        "the ordinary pod scheduled",
        Duration::from_secs(300),
        || async {
            let pod = pods.get("ordinary").await.map_err(|e| e.to_string())?;
            pod.spec
                .and_then(|s| s.node_name)
                .map(|_| ())
                .ok_or("pending".to_string())
        },
    )
    .await;
    assert_eq!(
        read_sys("nr_hugepages"),
        64,
        "scheduled only once the pool was back"
    );
    assert_eq!(
        node.kubelet_capacity_2mi(&client).await,
        "128Mi",
        "and the kubelet reported it"
    );
    assert!(!tainted().await.expect("Node"), "the taint is gone");
    let (status, reason, _) = node_condition(&client, &node.name, "Restoring")
        .await
        .expect("Restoring");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "PoolsReady"));
    pods.delete("ordinary", &Default::default())
        .await
        .expect("delete the pod");
}

/// Boot mode (docs/design.md, "Reboots and new nodes"): the agent keeps the
/// node's converged targets in a host file; after a "reboot" (the whole node
/// stopped, the kernel's pool emptied) `hugepool-agent boot` runs before the
/// kubelet starts, as its systemd unit would, so the kubelet registers the
/// pool at once: no Restoring, no taint, no kubelet restart.
#[tokio::test(flavor = "multi_thread")]
async fn boot_mode_gives_a_rebooted_node_its_pool_before_the_kubelet_starts() {
    let Some(mut node) = Node::start() else {
        return;
    };
    let client = node.client().await;
    let boot_dir = node.cp.dir.join("host-var-lib-hugepool");
    std::fs::create_dir_all(&boot_dir).expect("boot dir");
    let boot_dir = std::fs::canonicalize(&boot_dir).expect("canonical boot dir");
    let boot_file = boot_dir.join("boot-targets.json");
    let host_dir = format!("agent.bootFile.hostDir={}", boot_dir.display());
    node.with_pool_and(
        64,
        "2m",
        "AfterResize",
        &["agent.bootFile.enabled=true", &host_dir],
    );
    node.wait_available("consumers-2mi");
    let saved = wait_for(
        "the agent keeps the converged targets",
        Duration::from_secs(120),
        || async {
            let text = std::fs::read_to_string(&boot_file).map_err(|e| e.to_string())?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
            (json["pageSizes"][0]["pages"] == 64)
                .then_some(json)
                .ok_or(text)
        },
    )
    .await;
    assert_eq!(saved["node"], node.name.as_str());
    assert_eq!(saved["pageSizes"][0]["size"], "2Mi");

    // The reboot: everything of the node stops (pods too), the kernel's pool
    // is gone; the boot unit runs before the kubelet.
    let agent = repo().join("target/x86_64-unknown-linux-musl/release/hugepool-agent");
    let mut stopped_at = None;
    let mut boot_output = None;
    let name = node.name.clone();
    node.cp
        .restart_after(|| {
            stopped_at = Some(jiff::Timestamp::now());
            std::fs::write(Path::new(SYSFS_2MI).join("nr_hugepages"), "0").expect("empty the pool");
            assert_eq!(read_sys("nr_hugepages"), 0);
            boot_output = Some(
                Command::new(&agent)
                    .args(["boot", "--boot-file"])
                    .arg(&boot_file)
                    .args(["--node-name", &name])
                    .output()
                    .expect("run hugepool-agent boot"),
            );
        })
        .expect("the node starts again");
    let stopped_at = stopped_at.expect("stopped");
    let boot = boot_output.expect("boot ran");
    let stdout = String::from_utf8_lossy(&boot.stdout);
    assert!(boot.status.success(), "{boot:?}");
    assert!(
        stdout.contains(": 0 -> 64 of 64 pages (reached)"),
        "{stdout}"
    );
    let kubelet = node.kubelet_run();

    // The new kubelet's first report has the pool.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let capacity = wait_for(
        "a heartbeat of the new kubelet",
        Duration::from_secs(300),
        || async {
            let current = nodes.get(&node.name).await.map_err(|e| e.to_string())?;
            let status = current.status.unwrap_or_default();
            let beat = status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Ready" && c.status == "True")
                .and_then(|c| c.last_heartbeat_time)
                .ok_or("not Ready")?;
            if beat.0 <= stopped_at {
                return Err(format!("last heartbeat {} is the old kubelet's", beat.0));
            }
            Ok(status
                .capacity
                .and_then(|c| c.get("hugepages-2Mi").map(|q| q.0.clone()))
                .unwrap_or_default())
        },
    )
    .await;
    assert_eq!(
        capacity, "128Mi",
        "the kubelet registered the pool at start"
    );

    // The new agent found the pool at its target: nothing to restore.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    wait_for(
        "the agent started again and Ready",
        Duration::from_secs(300),
        || async {
            let list = pods
                .list(&ListParams::default().labels("app.kubernetes.io/component=agent"))
                .await
                .map_err(|e| e.to_string())?;
            let pod = list.items.into_iter().next().ok_or("no agent pod")?;
            let status = pod.status.unwrap_or_default();
            let started = status
                .container_statuses
                .unwrap_or_default()
                .into_iter()
                .filter_map(|c| c.state?.running?.started_at)
                .any(|t| t.0 > stopped_at);
            let ready = status
                .conditions
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            (started && ready)
                .then_some(())
                .ok_or(format!("started after the reboot {started}, ready {ready}"))
        },
    )
    .await;
    node.wait_available("consumers-2mi");
    let (status, reason, message) = node_condition(&client, &node.name, "Restoring")
        .await
        .expect("Restoring");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "PoolsReady"),
        "{message}"
    );
    let current = nodes.get(&node.name).await.expect("Node");
    assert!(!node_tainted(&current, hugepool_crds::NOT_READY_TAINT));
    assert_eq!(read_sys("nr_hugepages"), 64);
    assert_eq!(node.kubelet_run(), kubelet, "no kubelet restart was needed");
}

/// kubectl-hugepool as `make images` builds it (beside the images' binaries).
fn kubectl_hugepool_dir() -> PathBuf {
    let arch = std::env::consts::ARCH;
    repo()
        .join("target")
        .join(format!("{arch}-unknown-linux-musl"))
        .join("release")
}

/// The commands NOTES.txt gives, from `kubectl label node` to the
/// `kubectl hugepool status` after the wait, as a shell script.
fn notes_commands(notes: &str, node: &str) -> String {
    let start = notes
        .find("  kubectl label node <node>")
        .unwrap_or_else(|| panic!("NOTES has no `kubectl label node <node>`:\n{notes}"));
    let rest = &notes[start..];
    let status = "  kubectl hugepool status dpdk-2m\n";
    let end = rest
        .find(status)
        .unwrap_or_else(|| panic!("NOTES has no `kubectl hugepool status dpdk-2m`:\n{notes}"))
        + status.len();
    rest[..end]
        .lines()
        .map(|line| line.strip_prefix("  ").unwrap_or(line))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("<node>", node)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_first_install_with_the_charts_defaults_follows_its_notes_to_a_true_state() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    // The chart's defaults; only where pods reach this test's apiserver is set.
    let installed = node.helm_install_values(&[]);
    let notes = &installed[installed.find("NOTES:").expect("helm printed NOTES")..];
    // What NOTES says to run, run as written: label, apply, wait, status.
    let script = notes_commands(notes, &node.name);
    let path = format!(
        "{}:{}:{}",
        hugepool_e2e::kubectl_path()
            .parent()
            .expect("kubectl's directory")
            .display(),
        kubectl_hugepool_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .env("KUBECONFIG", &node.cp.control_plane.kubeconfig)
        .env("PATH", &path)
        .output()
        .expect("run the commands of NOTES");
    let shown = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the commands of NOTES failed:\n{script}\n---\n{shown}"
    );
    // The wait NOTES gives ended in a true state: the kernel holds the pool...
    assert_eq!(read_sys("nr_hugepages"), 1024, "after NOTES:\n{shown}");
    // ...and what the user sees says what is missing and how to finish.
    assert!(shown.contains("KubeletCapacityStale"), "{shown}");
    let (status, reason, message) = pool_condition(&client, "dpdk-2m", "Available")
        .await
        .expect("the pool's Available condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "KubeletCapacityStale")
    );
    for way in [
        node.name.as_str(),
        "systemctl restart kubelet",
        "agent.kubeletRestart.enabled=true",
        "spec.kubelet.restart: AfterResize",
    ] {
        assert!(message.contains(way), "{way} missing: {message}");
    }
    for said in [
        "systemctl restart kubelet",
        "--set agent.kubeletRestart.enabled=true",
        "agent.bootFile.enabled=true",
    ] {
        assert!(notes.contains(said), "NOTES does not say {said}:\n{notes}");
    }

    // The first way NOTES gives, then its last wait: the pool is Available
    // and the Node offers the pages.
    node.systemctl(&["restart", "kubelet"]);
    let then = notes
        .lines()
        .find_map(|line| line.trim().strip_prefix("Then: "))
        .unwrap_or_else(|| panic!("NOTES has no `Then: ` wait:\n{notes}"));
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", then])
        .env("KUBECONFIG", &node.cp.control_plane.kubeconfig)
        .env("PATH", &path)
        .output()
        .expect("run the last wait of NOTES");
    assert!(out.status.success(), "{then}: {out:?}");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client);
    let allocatable = nodes
        .get(&node.name)
        .await
        .expect("the Node")
        .status
        .and_then(|s| s.allocatable)
        .and_then(|a| a.get("hugepages-2Mi").cloned())
        .map(|q| q.0);
    assert_eq!(allocatable.as_deref(), Some("2Gi"));
}

/// The distribution registry on 127.0.0.1 (hack/tool.sh registry), its
/// storage in a temporary directory; stopped on drop.
struct Registry {
    child: std::process::Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Registry {
    fn start() -> Registry {
        let binary = hugepool_e2e::hack_tool("tool.sh", &["registry"]).expect("registry built");
        let dir = tempfile::tempdir().expect("temp dir");
        let addr = format!("127.0.0.1:{}", hugepool_e2e::free_port());
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog: {{level: warn}}\nstorage:\n  filesystem: {{rootdirectory: {}}}\nhttp: {{addr: {addr}}}\n",
                dir.path().join("data").display()
            ),
        )
        .expect("registry config");
        let log = std::fs::File::create(dir.path().join("registry.log")).expect("log");
        let child = Command::new(binary)
            .args(["serve", config.to_str().unwrap()])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("registry serve");
        let registry = Registry {
            child,
            addr,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Err(e) = hugepool_e2e::http_get(&registry.addr, "/v2/") {
            assert!(
                Instant::now() < deadline,
                "the registry never answered: {e}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        registry
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `program args` with `envs`; its stdout, or a panic with all it
/// printed.
fn run_ok(program: &Path, args: &[&str], envs: &[(&str, &str)]) -> String {
    let out = Command::new(program)
        .current_dir(repo())
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
    assert!(
        out.status.success(),
        "{} {} failed:\n{}",
        program.display(),
        args.join(" "),
        hugepool_e2e::output_text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The commands docs/operations.md gives to check a release before
/// installing it: the `sh` block after "Check them before you install:".
fn docs_verify_commands() -> String {
    let docs = std::fs::read_to_string(repo().join("docs/operations.md")).expect("operations.md");
    let after = docs
        .split_once("Check them before you install:")
        .expect("docs/operations.md: \"Check them before you install:\"")
        .1;
    let block = after
        .split_once("```sh\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("an sh block after it")
        .0;
    let commands: String = block
        .lines()
        .map(|line| format!("{}\n", line.trim_start()))
        .collect();
    assert!(
        commands.contains("cosign verify ") && commands.contains("--type slsaprovenance1"),
        "the docs check signatures and provenance: {commands}"
    );
    commands
}

/// The in-toto statement of `subject`'s attestation of cosign type `kind`
/// (`predicate_type`), verified with the key `public`; its subject is the
/// image `subject` names by digest.
fn attestation(
    cosign: &Path,
    public: &Path,
    subject: &str,
    kind: &str,
    predicate_type: &str,
) -> serde_json::Value {
    let verified = cosign_verify(
        cosign,
        &["verify-attestation", "--type", kind],
        public,
        subject,
    );
    let statement = in_toto_statement(&verified, predicate_type);
    let digest = subject.rsplit_once("@sha256:").map(|(_, digest)| digest);
    assert_eq!(
        statement["subject"][0]["digest"]["sha256"].as_str(),
        digest,
        "{statement}"
    );
    statement
}

/// The in-toto statement of `predicate_type` among the DSSE envelopes
/// `cosign verify-attestation` printed (one a line).
fn in_toto_statement(verified: &str, predicate_type: &str) -> serde_json::Value {
    let statements: Vec<serde_json::Value> = verified.lines().map(statement_of).collect();
    statements
        .iter()
        .find(|s| s["predicateType"] == predicate_type)
        .cloned()
        .unwrap_or_else(|| panic!("no {predicate_type} attestation among {statements:?}"))
}

fn statement_of(envelope: &str) -> serde_json::Value {
    let envelope: serde_json::Value = serde_json::from_str(envelope).expect("a DSSE envelope");
    let payload = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        payload.path(),
        envelope["payload"].as_str().expect("a payload"),
    )
    .unwrap();
    let decoded = Command::new("base64")
        .arg("-d")
        .arg(payload.path())
        .output()
        .expect("base64");
    serde_json::from_slice(&decoded.stdout).expect("an in-toto statement")
}

/// `cosign COMMAND --key PUBLIC REFERENCE` against the test's plain-HTTP
/// registry, with no transparency log (the release writes none); what it
/// printed, or a panic.
fn cosign_verify(cosign: &Path, command: &[&str], public: &Path, reference: &str) -> String {
    let mut args = command.to_vec();
    args.extend([
        "--key",
        public.to_str().expect("utf-8 path"),
        "--allow-http-registry",
        "--insecure-ignore-tlog",
        reference,
    ]);
    run_ok(cosign, &args, &[])
}

/// The ELF machine of a binary: 62 x86-64, 183 AArch64.
fn elf_machine(bytes: &[u8]) -> u16 {
    assert_eq!(&bytes[..4], b"\x7fELF", "not an ELF file");
    u16::from_le_bytes([bytes[18], bytes[19]])
}

/// `make release` against a real registry on 127.0.0.1, as a platform team
/// meets the result: each image one index of linux/amd64 and linux/arm64
/// whose binaries are of that machine, signed (and not by another key),
/// each platform's SBOM a verified attestation, the krew manifest's sha256
/// those of the archives, and `helm install oci://...` on the real node
/// pulling the images from the registry by digest and sizing the pool.
#[tokio::test(flavor = "multi_thread")]
async fn a_release_pushed_to_a_registry_verifies_and_installs_from_it_on_the_node() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        unavailable("containerd and the kubelet need root".into());
        return;
    }
    let version = env!("CARGO_PKG_VERSION");
    let registry = Registry::start();
    let reg = format!("{}/hugepool-dev", registry.addr);
    let cosign = hugepool_e2e::hack_tool("tool.sh", &["cosign"]).expect("cosign built");
    let crane = hugepool_e2e::hack_tool("tool.sh", &["crane"]).expect("crane built");
    let keys = tempfile::tempdir().expect("temp dir");
    let password = [("COSIGN_PASSWORD", "release-test")];
    for dir in ["release", "other"] {
        let dir = keys.path().join(dir);
        std::fs::create_dir(&dir).unwrap();
        let out = Command::new(&cosign)
            .current_dir(&dir)
            .arg("generate-key-pair")
            .envs(password)
            .output()
            .expect("cosign generate-key-pair");
        assert!(out.status.success(), "{}", hugepool_e2e::output_text(&out));
    }
    let key = keys.path().join("release/cosign.key");
    let public = keys.path().join("release/cosign.pub");
    let other = keys.path().join("other/cosign.pub");
    let head = run_ok(
        Path::new("git"),
        &["-C", repo().to_str().unwrap(), "rev-parse", "HEAD"],
        &[],
    )
    .trim()
    .to_string();

    run_ok(
        Path::new("bash"),
        &["hack/release.sh"],
        &[
            ("VERSION", version),
            ("REGISTRY", &reg),
            ("COSIGN_KEY", key.to_str().unwrap()),
            ("COSIGN_PASSWORD", "release-test"),
            ("PLAIN_HTTP", "1"),
        ],
    );
    let out = repo().join("target/release").join(version);
    assert_eq!(
        std::fs::read_to_string(out.join("cosign.pub")).expect("the release's cosign.pub"),
        std::fs::read_to_string(&public).unwrap(),
        "the release names the key that signed it"
    );

    // The test registry speaks plain HTTP.
    let insecure = "--insecure";
    let mut digests = std::collections::HashMap::new();
    for image in ["hugepool-operator", "hugepool-agent"] {
        let tag = format!("{reg}/{image}:{version}");
        let index: serde_json::Value =
            serde_json::from_str(&run_ok(&crane, &["manifest", insecure, &tag], &[]))
                .expect("an index");
        assert_eq!(
            index["mediaType"], "application/vnd.oci.image.index.v1+json",
            "{tag}: {index}"
        );
        let mut platforms: Vec<String> = index["manifests"]
            .as_array()
            .expect("manifests")
            .iter()
            .map(|m| {
                format!(
                    "{}/{}",
                    m["platform"]["os"].as_str().unwrap(),
                    m["platform"]["architecture"].as_str().unwrap()
                )
            })
            .collect();
        platforms.sort();
        assert_eq!(platforms, ["linux/amd64", "linux/arm64"], "{tag}");
        let digest = run_ok(&crane, &["digest", insecure, &tag], &[])
            .trim()
            .to_string();
        let by_digest = format!("{reg}/{image}@{digest}");

        // Each platform's binary is of its machine.
        for (arch, machine) in [("amd64", 62), ("arm64", 183)] {
            let platform = format!("linux/{arch}");
            let layer = Command::new(&crane)
                .args(["export", insecure, "--platform", &platform, &tag, "-"])
                .output()
                .expect("crane export");
            assert!(
                layer.status.success(),
                "{}",
                hugepool_e2e::output_text(&layer)
            );
            let unpacked = tempfile::tempdir().unwrap();
            let tar = unpacked.path().join("fs.tar");
            std::fs::write(&tar, &layer.stdout).unwrap();
            run_ok(
                Path::new("tar"),
                &[
                    "-xf",
                    tar.to_str().unwrap(),
                    "-C",
                    unpacked.path().to_str().unwrap(),
                ],
                &[],
            );
            let binary = std::fs::read(unpacked.path().join(image)).expect("the image's binary");
            assert_eq!(elf_machine(&binary), machine, "{image} {platform}");
            if image == "hugepool-agent" {
                let nsenter = std::fs::read(unpacked.path().join("usr/bin/nsenter")).unwrap();
                assert_eq!(elf_machine(&nsenter), machine, "nsenter {platform}");
                let hooks = std::fs::read(unpacked.path().join("hugepool-hooks")).unwrap();
                assert_eq!(elf_machine(&hooks), machine, "hugepool-hooks {platform}");
            }

            // The platform's SBOM: attested with the release key, about
            // this binary and the crates it was built from.
            let platform_digest = run_ok(
                &crane,
                &["digest", insecure, "--platform", &platform, &tag],
                &[],
            )
            .trim()
            .to_string();
            let subject = format!("{reg}/{image}@{platform_digest}");
            let statement = attestation(
                &cosign,
                &public,
                &subject,
                "cyclonedx",
                "https://cyclonedx.org/bom",
            );
            let bom = &statement["predicate"];
            assert_eq!(bom["bomFormat"], "CycloneDX", "{subject}");
            assert_eq!(bom["metadata"]["component"]["name"], image, "{subject}");
            let crates: Vec<&str> = bom["components"]
                .as_array()
                .expect("components")
                .iter()
                .filter_map(|c| c["name"].as_str())
                .collect();
            assert!(
                crates.contains(&"kube-client") && crates.contains(&"hugepool-crds"),
                "{subject}: {crates:?}"
            );
            // The agent's image holds hugepool-hooks (Go): its modules too.
            if image == "hugepool-agent" {
                let hooks = bom["components"]
                    .as_array()
                    .expect("components")
                    .iter()
                    .find(|c| c["name"] == "hugepool-hooks")
                    .unwrap_or_else(|| panic!("{subject}: no hugepool-hooks component"));
                let modules: Vec<&str> = hooks["components"]
                    .as_array()
                    .expect("hugepool-hooks' modules")
                    .iter()
                    .filter_map(|c| c["purl"].as_str())
                    .collect();
                assert!(
                    modules
                        .iter()
                        .any(|m| m.starts_with("pkg:golang/github.com/containerd/nri@"))
                        && modules
                            .iter()
                            .any(|m| m.starts_with("pkg:golang/k8s.io/kubelet@")),
                    "{subject}: {modules:?}"
                );
                assert!(
                    hooks["purl"]
                        .as_str()
                        .is_some_and(|p| p.contains(&format!("goarch={arch}"))),
                    "{subject}: built for its platform: {hooks}"
                );
            }

            // Its build provenance: attested with the release key, naming
            // the commit this repository is at and who built it.
            let statement = attestation(
                &cosign,
                &public,
                &subject,
                "slsaprovenance1",
                "https://slsa.dev/provenance/v1",
            );
            let build = &statement["predicate"]["buildDefinition"];
            assert_eq!(
                build["resolvedDependencies"][0]["digest"]["gitCommit"].as_str(),
                Some(head.as_str()),
                "{subject}: built from this commit: {statement}"
            );
            assert_eq!(
                build["externalParameters"]["version"], version,
                "{statement}"
            );
            assert_eq!(build["externalParameters"]["image"], image, "{statement}");
            assert_eq!(
                build["externalParameters"]["platform"],
                platform.as_str(),
                "{statement}"
            );
            assert!(
                statement["predicate"]["runDetails"]["builder"]["id"]
                    .as_str()
                    .is_some_and(|id| id.ends_with("/hack/release.sh")),
                "{subject}: run by hand, the builder is this machine's release.sh: {statement}"
            );
        }

        // The index is signed by the release key (each platform too), and
        // another key's check fails.
        for reference in [
            by_digest.clone(),
            format!(
                "{reg}/{image}@{}",
                run_ok(
                    &crane,
                    &["digest", insecure, "--platform", "linux/arm64", &tag],
                    &[]
                )
                .trim()
            ),
        ] {
            cosign_verify(&cosign, &["verify"], &public, &reference);
        }
        let forged = Command::new(&cosign)
            .args(["verify", "--key", other.to_str().unwrap()])
            .args(["--allow-http-registry", "--insecure-ignore-tlog"])
            .arg(&by_digest)
            .output()
            .expect("cosign verify");
        assert!(
            !forged.status.success(),
            "{image} verified with a key that did not sign it"
        );
        digests.insert(image, digest);
    }

    // The checks docs/operations.md gives, run as written against this
    // release: only its registry and version put in for the docs'
    // placeholders, in the release's directory (its cosign.pub), with the
    // test registry's plain HTTP and no transparency log said to the tools.
    let checks = docs_verify_commands();
    let script = format!(
        "set -euo pipefail\n\
         cosign() {{ command {cosign} \"$@\" --allow-http-registry --insecure-ignore-tlog; }}\n\
         crane() {{ command {crane} \"$@\" --insecure; }}\n{}",
        checks
            .replace("ghcr.io/hugepool-dev", &reg)
            .replace("X.Y.Z", version),
        cosign = cosign.display(),
        crane = crane.display(),
    );
    let ran = Command::new("bash")
        .current_dir(&out)
        .args(["-c", &script])
        .output()
        .expect("bash");
    assert!(
        ran.status.success(),
        "docs/operations.md's checks failed against the release:\n{script}\n{}",
        hugepool_e2e::output_text(&ran)
    );

    // kubectl-hugepool: both archives, the krew manifest naming their
    // sha256, each archive's binary of its machine.
    let manifest = serde_saphyr::from_str::<serde_json::Value>(
        &std::fs::read_to_string(out.join("hugepool.yaml")).expect("krew manifest"),
    )
    .expect("YAML");
    assert_eq!(manifest["spec"]["version"], format!("v{version}"));
    let platforms = manifest["spec"]["platforms"].as_array().expect("platforms");
    assert_eq!(platforms.len(), 2, "{manifest}");
    for (arch, machine) in [("amd64", 62), ("arm64", 183)] {
        let name = format!("kubectl-hugepool-linux-{arch}.tar.gz");
        let platform = platforms
            .iter()
            .find(|p| p["selector"]["matchLabels"]["arch"] == arch)
            .expect("a platform per architecture");
        let uri = platform["uri"].as_str().unwrap();
        assert_eq!(
            uri,
            format!("https://github.com/hugepool-dev/hugepool/releases/download/v{version}/{name}")
        );
        let archive = out.join(&name);
        let sum = run_ok(Path::new("sha256sum"), &[archive.to_str().unwrap()], &[]);
        assert_eq!(
            platform["sha256"].as_str(),
            sum.split_whitespace().next(),
            "{name}"
        );
        let listing = Command::new("tar")
            .args(["-xzOf", archive.to_str().unwrap(), "kubectl-hugepool"])
            .output()
            .expect("tar");
        assert_eq!(elf_machine(&listing.stdout), machine, "{name}");
    }
    let sums = Command::new("sha256sum")
        .current_dir(&out)
        .args(["--check", "--quiet", "SHA256SUMS"])
        .output()
        .expect("sha256sum");
    assert!(
        sums.status.success(),
        "{}",
        hugepool_e2e::output_text(&sums)
    );

    // The chart from the registry, on the real node: containerd pulls both
    // images from the registry (only the pause image is imported).
    let chart = format!("oci://{reg}/charts/hugepool");
    cosign_verify(
        &cosign,
        &["verify"],
        &public,
        &format!("{reg}/charts/hugepool:{version}"),
    );
    let pause_only = tempfile::tempdir().expect("temp dir");
    std::os::unix::fs::symlink(
        repo()
            .join("target/images")
            .join(format!("hugepool-e2e-{version}.tar"))
            .canonicalize()
            .unwrap(),
        pause_only
            .path()
            .join(format!("hugepool-e2e-{version}.tar")),
    )
    .unwrap();
    let Some(node) = Node::start_with(&[
        "--images",
        pause_only.path().to_str().unwrap(),
        "--registry",
        &registry.addr,
    ]) else {
        return;
    };
    let client = node.client().await;
    let root_dir = format!(
        "agent.kubeletRestart.rootDir={}",
        node.kubelet_root.display()
    );
    node.run(
        &node.helm,
        &[
            "install",
            "hugepool",
            &chart,
            "--version",
            version,
            "--plain-http",
            "--namespace",
            NAMESPACE,
            "--create-namespace",
            "--set",
            &format!("apiServer.host={}", node.pod_apiserver.0),
            "--set",
            &format!("apiServer.port={}", node.pod_apiserver.1),
            "--set",
            "agent.kubeletRestart.enabled=true",
            "--set",
            &root_dir,
            "--wait",
            "--timeout",
            "5m",
        ],
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    for (component, image) in [
        ("operator", "hugepool-operator"),
        ("agent", "hugepool-agent"),
    ] {
        let listed = pods
            .list(
                &ListParams::default().labels(&format!("app.kubernetes.io/component={component}")),
            )
            .await
            .expect("pods");
        assert!(!listed.items.is_empty(), "no {component} pod");
        let wanted = format!("{reg}/{image}@{}", digests[image]);
        for pod in listed.items {
            // The chart names the image by digest; the kubelet reports the
            // repository digest containerd pulled.
            let spec = &pod.spec.as_ref().unwrap().containers[0];
            assert_eq!(spec.image.as_deref(), Some(wanted.as_str()), "{component}");
            let status = &pod
                .status
                .as_ref()
                .unwrap()
                .container_statuses
                .as_ref()
                .unwrap()[0];
            assert_eq!(status.image_id, wanted, "{component} pod's image");
            assert!(status.ready, "{component} pod not ready");
        }
    }
    node.kubectl(&["label", "node", &node.name, "hugepool.dev/demo=true"]);
    node.apply(
        r#"
apiVersion: hugepool.dev/v1alpha1
kind: HugePagePool
metadata: {name: released}
spec:
  nodeSelector: {matchLabels: {hugepool.dev/demo: "true"}}
  pageSize: 2Mi
  pages: 8
  kubelet: {restart: AfterResize}
  deletionPolicy: Release
"#,
    );
    node.wait_available("released");
    assert_eq!(
        read_sys("nr_hugepages"),
        8,
        "the released agent sized the pool"
    );
    node.kubectl(&[
        "delete",
        "hugepagepool",
        "released",
        "--wait=true",
        "--timeout=120s",
    ]);
    assert_eq!(read_sys("nr_hugepages"), 0, "Release returned every page");
}

/// One way a grown pool reaches a pod, for the apply-to-usable benchmark.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Route {
    /// `hugepages-2Mi` requests: the agent restarts the kubelet
    /// (`AfterResize`) so that it advertises the grown pool.
    KubeletRestart,
    /// A ResourceClaim: the agent's slice follows the pool.
    Dra,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::KubeletRestart => "kubelet-restart",
            Route::Dra => "dra",
        }
    }
}

/// One measured run of a route: seconds from the patch that grows the pool
/// to the kernel holding the new pages, the pod Running, and the pod's
/// pages faulted; whether the kubelet restarted.
#[derive(Debug, serde::Serialize)]
struct UsableRun {
    route: &'static str,
    rep: usize,
    grown_seconds: f64,
    running_seconds: f64,
    usable_seconds: f64,
    kubelet_restarted: bool,
}

/// `make bench-usable`: how long a grown pool takes to reach a pod that
/// asks for more than the old pool had, through a kubelet restart
/// (`hugepages-2Mi` requests) and through DRA (a ResourceClaim), side by
/// side on the real node: for each repetition (HUGEPOOL_BENCH_REPS, 5 by
/// default) each route in turn, alternating which goes first: a pool of 32
/// pages, patched to 96, and at once a pod for 80 pages; timed to the kernel
/// showing its 80 pages faulted. Medians printed, runs in
/// target/bench-usable/runs.json.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: make bench-usable"]
async fn bench_apply_to_usable_dra_against_the_kubelet_restart() {
    let Some(node) = Node::start() else { return };
    let client = node.client().await;
    let kubelet_root = format!("dra.kubeletRootDir={}", node.kubelet_root.display());
    node.helm_install_with(&["dra.enabled=true", "dra.cgroup.version=v1", &kubelet_root]);
    node.kubectl(&["label", "node", &node.name, "hugepool.dev/demo=true"]);
    let reps: usize = std::env::var("HUGEPOOL_BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut runs = Vec::new();
    for rep in 0..reps {
        let order = if rep % 2 == 0 {
            [Route::KubeletRestart, Route::Dra]
        } else {
            [Route::Dra, Route::KubeletRestart]
        };
        for route in order {
            let run = usable_run(&node, &client, &pods, route, rep).await;
            eprintln!("{run:?}");
            runs.push(run);
        }
    }
    let median = |route: Route, field: fn(&UsableRun) -> f64| {
        let mut values: Vec<f64> = runs
            .iter()
            .filter(|r| r.route == route.name())
            .map(field)
            .collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    println!("apply of a bigger pool (32 -> 96 x 2Mi) to a pod using 80 pages, medians of {reps}:");
    println!(
        "{:<16} {:>10} {:>10} {:>10}",
        "route", "grown s", "running s", "usable s"
    );
    for route in [Route::KubeletRestart, Route::Dra] {
        println!(
            "{:<16} {:>10.2} {:>10.2} {:>10.2}",
            route.name(),
            median(route, |r| r.grown_seconds),
            median(route, |r| r.running_seconds),
            median(route, |r| r.usable_seconds),
        );
    }
    let dir = repo().join("target").join("bench-usable");
    std::fs::create_dir_all(&dir).expect("results dir");
    std::fs::write(
        dir.join("runs.json"),
        serde_json::to_string_pretty(&runs).expect("json"),
    )
    .expect("write runs.json");
    for run in &runs {
        assert_eq!(
            run.kubelet_restarted,
            run.route == Route::KubeletRestart.name(),
            "only the restart route restarts the kubelet: {run:?}"
        );
    }
}

/// One run of `route`: pool `usable-2mi` of 32 pages, grown to 96, a pod
/// for 80 at once; then the pod and the pool go (Release), and the kubelet
/// is restarted so that it advertises nothing before the next run.
async fn usable_run(
    node: &Node,
    client: &Client,
    pods: &Api<Pod>,
    route: Route,
    rep: usize,
) -> UsableRun {
    let consumption = match route {
        Route::KubeletRestart => "kubelet: {restart: AfterResize}",
        Route::Dra => "consumption: DynamicResourceAllocation",
    };
    node.apply(&format!(
        r#"
apiVersion: hugepool.dev/v1alpha1
kind: HugePagePool
metadata: {{name: usable-2mi}}
spec:
  nodeSelector: {{matchLabels: {{hugepool.dev/demo: "true"}}}}
  pageSize: 2Mi
  pages: 32
  {consumption}
  deletionPolicy: Release
"#
    ));
    node.wait_available("usable-2mi");
    let run = node.kubelet_run();
    let name = format!("usable-{}-{rep}", route.name());
    let started = Instant::now();
    node.kubectl(&[
        "patch",
        "hugepagepool",
        "usable-2mi",
        "--type=merge",
        "-p",
        r#"{"spec":{"pages":96}}"#,
    ]);
    match route {
        Route::KubeletRestart => node.start_holder_with(&name, 80, 80, &[]),
        Route::Dra => node.claim_pod(&name, 80, &["/hugepage-holder", "80"]),
    }
    let (mut grown, mut running) = (None, None);
    let deadline = started + Duration::from_secs(600);
    let usable = loop {
        let (nr, free) = (read_sys("nr_hugepages"), read_sys("free_hugepages"));
        if grown.is_none() && nr == 96 {
            grown = Some(started.elapsed());
        }
        if running.is_none() {
            let phase = pods
                .get_opt(&name)
                .await
                .ok()
                .flatten()
                .and_then(|p| p.status)
                .and_then(|s| s.phase);
            if phase.as_deref() == Some("Running") {
                running = Some(started.elapsed());
            }
        }
        if nr == 96 && free == 16 {
            break started.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "{name}: not usable within 600 s (pool {nr}, free {free})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let running = match running {
        Some(running) => running,
        None => {
            wait_for("the pod Running", Duration::from_secs(120), || async {
                let phase = pods
                    .get(&name)
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .and_then(|s| s.phase);
                match phase.as_deref() {
                    Some("Running") => Ok(started.elapsed()),
                    other => Err(format!("{other:?}")),
                }
            })
            .await
        }
    };
    let kubelet_restarted = node.kubelet_run() != run;

    // Back to nothing: the pod, its claim template, the pool; a kubelet
    // that advertises no page.
    node.kubectl(&["delete", "pod", &name, "--wait=true"]);
    if route == Route::Dra {
        node.kubectl(&[
            "delete",
            "resourceclaimtemplate",
            "-n",
            "default",
            &format!("{name}-pages"),
        ]);
    }
    node.kubectl(&["delete", "hugepagepool", "usable-2mi", "--wait=false"]);
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    wait_for(
        "Release returns every page",
        Duration::from_secs(300),
        || async {
            let nr = read_sys("nr_hugepages");
            if nr == 0 {
                return Ok(());
            }
            let status = hpns
                .get(&node.name)
                .await
                .ok()
                .and_then(|h| h.status)
                .map(|s| serde_json::to_string(&s).unwrap_or_default());
            let pods = node.kubectl(&["get", "pods,resourceclaims", "-A", "-o", "wide"]);
            Err(format!("pool {nr}; status {status:?}; {pods}"))
        },
    )
    .await;
    node.systemctl(&["restart", "kubelet"]);
    wait_for(
        "the kubelet advertises no page",
        Duration::from_secs(300),
        || async {
            match node.kubelet_capacity_2mi(client).await.as_str() {
                "" | "0" => Ok(()),
                other => Err(other.to_string()),
            }
        },
    )
    .await;
    UsableRun {
        route: route.name(),
        rep,
        grown_seconds: grown.unwrap_or(usable).as_secs_f64(),
        running_seconds: running.as_secs_f64(),
        usable_seconds: usable.as_secs_f64(),
        kubelet_restarted,
    }
}
