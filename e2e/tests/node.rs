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
use std::time::{Duration, Instant};

use hugepool_crds::{HugePageNode, HugePagePool};
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
    saved_2mi: u64,
    _kernel: std::fs::File,
}

impl Node {
    fn start() -> Option<Node> {
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
        let helm = match Command::new("bash").arg(repo().join("hack/helm.sh")).output() {
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
        let cp = OwnedControlPlane::start_with_node(&dir, &images)
            .unwrap_or_else(|e| panic!("controlplane up --node: {e}"));
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
            saved_2mi,
            _kernel: kernel,
        })
    }

    async fn client(&self) -> Client {
        self.cp.control_plane.client().await.expect("client")
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

    fn helm_install(&self) -> String {
        let chart = repo().join("charts").join("hugepool");
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
                "--wait",
                "--timeout",
                "5m",
            ],
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
    let operator = deployments.get("hugepool-operator").await.expect("operator Deployment");
    let ready = operator.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0);
    assert_eq!(ready, 2, "helm --wait returned with {ready}/2 operator replicas ready");
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
        let lease = leases.get_opt("hugepool-operator").await.map_err(|e| e.to_string())?;
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
    let agent = daemonsets.get("hugepool-agent").await.expect("agent DaemonSet");
    let status = agent.status.expect("DaemonSet status");
    assert_eq!(
        (status.desired_number_scheduled, status.number_ready),
        (1, 1),
        "agent DaemonSet scheduled/ready"
    );

    // The example pool, applied as a user would.
    node.kubectl(&["label", "node", &node.name, "hugepool.dev/demo=true"]);
    node.kubectl(&["apply", "-f", repo().join("examples/pool-2mi.yaml").to_str().unwrap()]);
    node.kubectl(&[
        "wait",
        "--for=condition=Available",
        "hugepagepool/demo-2mi",
        "--timeout=300s",
    ]);

    // What the agent reports is what the kernel has, and that is the pool.
    assert_eq!(read_sys("nr_hugepages"), 256, "the kernel's 2Mi pool");
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    let hpn = hpns.get(&node.name).await.expect("HugePageNode");
    let reported = hpn
        .status
        .as_ref()
        .and_then(|s| s.page_sizes.iter().find(|p| p.size == "2Mi"))
        .cloned()
        .expect("2Mi in the node's status");
    let sys = |file| i64::try_from(read_sys(file)).expect("fits");
    assert_eq!(reported.total, sys("nr_hugepages"), "status total vs /sys");
    assert_eq!(reported.free, sys("free_hugepages"), "status free vs /sys");
    assert_eq!(reported.surplus, sys("surplus_hugepages"), "status surplus vs /sys");

    // Release: deleting the pool returns the pages, through the agent.
    node.kubectl(&["delete", "hugepagepool", "demo-2mi", "--wait=true", "--timeout=300s"]);
    let pools: Api<HugePagePool> = Api::all(client.clone());
    assert!(pools.get_opt("demo-2mi").await.expect("get pool").is_none());
    assert_eq!(read_sys("nr_hugepages"), 0, "Release returned every page");
}
