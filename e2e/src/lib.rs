//! Test harness for hugepool's end-to-end tests: a real kube-apiserver
//! (built by `make controlplane` from the Kubernetes Go modules in
//! `e2e/controlplane`), the CRDs installed on it, and unique names so that
//! tests can share one control plane and run in parallel.
//!
//! A test calls [`setup`] and returns early when it yields `None`: that only
//! happens outside CI when no control plane can be had. Under `CI=true` the
//! same situation panics, so CI never mistakes a skip for a pass.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config, CustomResourceExt};

/// Names a control plane that is already running (its kubeconfig), so many
/// test binaries share one. Deliberately not `KUBECONFIG`: the tests create
/// and delete Nodes, and must never land on a cluster someone really uses.
pub const KUBECONFIG_ENV: &str = "HUGEPOOL_E2E_KUBECONFIG";

#[derive(Debug, thiserror::Error)]
pub enum E2eError {
    #[error("control plane binary {0} is missing: run `make controlplane`")]
    MissingBinary(PathBuf),
    #[error("control plane did not become ready within {timeout:?}; last log lines:\n{log}")]
    NotReady { timeout: Duration, log: String },
    #[error("controlplane up exited ({status}) before it was ready; last log lines:\n{log}")]
    Exited {
        status: std::process::ExitStatus,
        log: String,
    },
    #[error("control plane process failed: {0}")]
    Process(#[from] std::io::Error),
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("kube client: {0}")]
    Kube(#[from] kube::Error),
    #[error("waiting for CRD {name} to be Established: {message}")]
    CrdNotEstablished { name: String, message: String },
}

/// A running control plane this process may use.
#[derive(Debug)]
pub struct ControlPlane {
    pub kubeconfig: PathBuf,
}

/// Where the control plane's binaries are: `HUGEPOOL_CONTROLPLANE_BIN` when
/// set (`make test-oldest-k8s` points it at `e2e/controlplane/bin-1.33`),
/// else where `make controlplane` puts them.
pub fn controlplane_bin_dir() -> PathBuf {
    match std::env::var_os("HUGEPOOL_CONTROLPLANE_BIN") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("controlplane")
            .join("bin"),
    }
}

/// The real kubectl built with the control plane.
pub fn kubectl_path() -> PathBuf {
    controlplane_bin_dir().join("kubectl")
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

impl ControlPlane {
    /// Starts `controlplane up` in `data_dir` and waits for its ready file.
    /// The control plane stops by itself when this process exits (it watches
    /// its parent), so a crashed test run leaks nothing.
    pub fn start(data_dir: &Path, timeout: Duration) -> Result<ControlPlane, E2eError> {
        let mut child = spawn_up(data_dir, &[])?;
        wait_ready(data_dir, &mut child, timeout)?;
        // Lives as long as this process; see above.
        std::mem::forget(child);
        Ok(ControlPlane {
            kubeconfig: data_dir.join("kubeconfig"),
        })
    }

    /// A client for this control plane, bound to the caller's runtime.
    pub async fn client(&self) -> Result<Client, E2eError> {
        let kubeconfig =
            Kubeconfig::read_from(&self.kubeconfig).map_err(|source| E2eError::Kubeconfig {
                path: self.kubeconfig.clone(),
                source,
            })?;
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|source| E2eError::Kubeconfig {
                path: self.kubeconfig.clone(),
                source,
            })?;
        Ok(Client::try_from(config)?)
    }

    /// Runs the real kubectl against this control plane.
    pub fn kubectl(&self, args: &[&str]) -> std::io::Result<Output> {
        Command::new(kubectl_path())
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .output()
    }
}

fn spawn_up(data_dir: &Path, extra: &[&std::ffi::OsStr]) -> Result<std::process::Child, E2eError> {
    let binary = controlplane_bin_dir().join("controlplane");
    if !binary.exists() {
        return Err(E2eError::MissingBinary(binary));
    }
    std::fs::create_dir_all(data_dir)?;
    let _ = std::fs::remove_file(data_dir.join("ready"));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(data_dir.join("up.log"))?;
    Ok(Command::new(&binary)
        .arg("up")
        .arg("--data-dir")
        .arg(data_dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?)
}

/// Waits for `up`'s ready file; fails at once (with its log) when `up`
/// exited first, as on a flag it does not know.
fn wait_ready(
    data_dir: &Path,
    child: &mut std::process::Child,
    timeout: Duration,
) -> Result<(), E2eError> {
    let deadline = Instant::now() + timeout;
    while !data_dir.join("ready").exists() {
        let exited = child.try_wait()?;
        if exited.is_some() || Instant::now() > deadline {
            let log = std::fs::read_to_string(data_dir.join("up.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            return Err(match exited {
                Some(status) => E2eError::Exited { status, log: tail },
                None => E2eError::NotReady { timeout, log: tail },
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// A control plane of one test's own, which the test may stop and start
/// again (same port, certificates and data) to simulate an API outage.
pub struct OwnedControlPlane {
    pub dir: PathBuf,
    pub control_plane: ControlPlane,
    child: Option<std::process::Child>,
    up_args: Vec<std::ffi::OsString>,
}

impl OwnedControlPlane {
    pub fn start(dir: &Path) -> Result<Self, E2eError> {
        Self::start_with(dir, Vec::new())
    }

    /// `controlplane up` with more flags (`--scheduler`).
    pub fn start_with_args(dir: &Path, extra: &[&str]) -> Result<Self, E2eError> {
        Self::start_with(dir, extra.iter().map(std::ffi::OsString::from).collect())
    }

    /// `controlplane up --node`: also a real kubelet and containerd on this
    /// machine (root), with the OCI archives in `images` imported.
    pub fn start_with_node(dir: &Path, images: &Path) -> Result<Self, E2eError> {
        Self::start_with_node_args(dir, images, &[])
    }

    /// A node with more `up` flags (`--memory-manager=Static`).
    pub fn start_with_node_args(
        dir: &Path,
        images: &Path,
        extra: &[&str],
    ) -> Result<Self, E2eError> {
        let mut args: Vec<std::ffi::OsString> =
            vec!["--node".into(), "--images".into(), images.into()];
        args.extend(extra.iter().map(std::ffi::OsString::from));
        Self::start_with(dir, args)
    }

    fn start_with(dir: &Path, up_args: Vec<std::ffi::OsString>) -> Result<Self, E2eError> {
        let args: Vec<&std::ffi::OsStr> = up_args.iter().map(|a| a.as_os_str()).collect();
        let mut child = spawn_up(dir, &args)?;
        // A node's first start imports images and waits for the kubelet.
        wait_ready(dir, &mut child, Duration::from_secs(300))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            control_plane: ControlPlane {
                kubeconfig: dir.join("kubeconfig"),
            },
            child: Some(child),
            up_args,
        })
    }

    /// The `controlplane up` process; etcd, the apiserver and the
    /// controller-manager are its children.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// SIGTERM and wait until every component has exited.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    /// SIGKILL: an abrupt outage. The components die with `up` (they have a
    /// parent-death signal); a graceful stop can take the apiserver 30 s
    /// while clients hold watches open.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            // The apiserver must be gone before the outage is "on".
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::net::TcpStream::connect(self.apiserver_addr()).is_ok()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    fn apiserver_addr(&self) -> String {
        let ports = std::fs::read_to_string(self.dir.join("ports.json")).unwrap_or_default();
        let port = serde_json::from_str::<serde_json::Value>(&ports)
            .ok()
            .and_then(|v| v["apiserver"].as_u64())
            .unwrap_or(0);
        format!("127.0.0.1:{port}")
    }

    pub fn restart(&mut self) -> Result<(), E2eError> {
        self.restart_after(|| {})
    }

    /// Stops everything (with `--node`: the kubelet, containerd and every
    /// pod process, as a reboot would), runs `between`, starts again.
    pub fn restart_after(&mut self, between: impl FnOnce()) -> Result<(), E2eError> {
        self.stop();
        between();
        let args: Vec<&std::ffi::OsStr> = self.up_args.iter().map(|a| a.as_os_str()).collect();
        let child = self.child.insert(spawn_up(&self.dir, &args)?);
        wait_ready(&self.dir, child, Duration::from_secs(300))
    }
}

impl Drop for OwnedControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Exclusive use of this machine's hugetlb pools across processes: every
/// test (and `make demo`) that writes them holds this file lock.
pub fn lock_machine_kernel() -> std::fs::File {
    let file = std::fs::File::create(std::env::temp_dir().join("hugepool-real-kernel.lock"))
        .expect("lock file");
    // flock(LOCK_EX): blocks until the lock is ours.
    file.lock().expect("flock");
    file
}

/// Whether tests must fail rather than skip when something is missing.
pub fn in_ci_mode() -> bool {
    in_ci()
}

fn shared_control_plane() -> Result<&'static ControlPlane, String> {
    static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            if let Ok(path) = std::env::var(KUBECONFIG_ENV) {
                return Ok(ControlPlane {
                    kubeconfig: PathBuf::from(path),
                });
            }
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("target")
                .join("e2e")
                .join(format!("controlplane-{}", std::process::id()));
            ControlPlane::start(&dir, Duration::from_secs(180)).map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Everything a test needs: a client on a control plane with our CRDs.
pub struct TestEnv {
    pub control_plane: &'static ControlPlane,
    pub client: Client,
}

/// The shared control plane with the CRDs installed, or `None` (after saying
/// why) when there is none outside CI. Under CI a missing control plane panics.
pub async fn setup() -> Option<TestEnv> {
    let control_plane = match shared_control_plane() {
        Ok(cp) => cp,
        Err(why) if !in_ci() => {
            eprintln!("skipping: no control plane ({why})");
            return None;
        }
        Err(why) => panic!("CI=true and no control plane: {why}"),
    };
    let client = control_plane
        .client()
        .await
        .expect("client for the control plane");
    static CRDS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    CRDS.get_or_try_init(|| install_crds(client.clone()))
        .await
        .expect("CRDs installed and Established");
    Some(TestEnv {
        control_plane,
        client,
    })
}

/// Applies both CRDs (server-side, forced) and waits until each is Established.
pub async fn install_crds(client: Client) -> Result<(), E2eError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    let params = PatchParams::apply("hugepool-e2e").force();
    for crd in [
        hugepool_crds::HugePagePool::crd(),
        hugepool_crds::HugePageNode::crd(),
    ] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        crds.patch(&name, &params, &Patch::Apply(&crd)).await?;
        let established = await_condition(crds.clone(), &name, conditions::is_crd_established());
        tokio::time::timeout(Duration::from_secs(30), established)
            .await
            .map_err(|_| E2eError::CrdNotEstablished {
                name: name.clone(),
                message: "timed out after 30s".into(),
            })?
            .map_err(|e| E2eError::CrdNotEstablished {
                name: name.clone(),
                message: e.to_string(),
            })?;
    }
    Ok(())
}

/// A name no other test (in this or another process) uses: `prefix-pid-n`.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    // The pid alone repeats (pid_max is 32768 here, and a `make test` starts
    // far more processes than that): a run's objects and /tmp directories
    // then met an earlier run's of the same pid (a private control plane
    // started on that run's etcd data; a recording script's calls file
    // already holding calls). A word of this process's start time keeps
    // runs apart.
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let run = RUN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:05x}", (nanos / 1000) as u32 & 0xfffff)
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{run}-{n}", std::process::id())
}

/// A node's cgroup file system as a kubelet leaves it, for an agent's
/// `--cgroup-root` in tests: cgroup v2, the systemd driver, the hugetlb
/// controller enabled, `kubepods.slice` unlimited, and no pod yet.
pub struct KubeletCgroups {
    pub root: PathBuf,
}

impl KubeletCgroups {
    pub fn create(root: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(root.join("kubepods.slice"))?;
        std::fs::write(root.join("cgroup.controllers"), "cpu memory hugetlb pids")?;
        std::fs::write(root.join("kubepods.slice/hugetlb.2MB.max"), "max")?;
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    /// A Burstable pod's cgroup whose 2Mi hugetlb limit is `pages`, as its
    /// kubelet sets it from the pod's request.
    pub fn set_pod_pages_2mi(&self, uid: &str, pages: u64) -> std::io::Result<()> {
        let pod = self.pod(uid);
        std::fs::create_dir_all(&pod)?;
        std::fs::write(
            pod.join("hugetlb.2MB.max"),
            (pages * 2 * 1024 * 1024).to_string(),
        )
    }

    /// The pod's cgroup goes, as the kubelet removes it when the pod ends.
    pub fn remove_pod(&self, uid: &str) -> std::io::Result<()> {
        std::fs::remove_dir_all(self.pod(uid))
    }

    fn pod(&self, uid: &str) -> PathBuf {
        self.root.join(format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
            uid.replace('-', "_")
        ))
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (for a server a test
/// starts and then scrapes).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A plain HTTP/1.0 GET of `path` from `addr` (`host:port`): the body of a
/// 200 response, or what went wrong (connection error, or the status line).
pub fn http_get(addr: &str, path: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("{addr}{path}: {e}"))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr}{path}: not an HTTP response: {response}"))?;
    if head.starts_with("HTTP/1.") && head.contains(" 200 ") {
        Ok(body.to_string())
    } else {
        Err(format!(
            "{addr}{path}: {}",
            head.lines().next().unwrap_or(head)
        ))
    }
}

/// The tool a `hack/` build script builds and prints the path of (helm,
/// promtool, prometheus, krew), or what went wrong.
pub fn hack_tool(script: &str, args: &[&str]) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = Command::new("bash")
        .arg(root.join("hack").join(script))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running hack/{script}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "hack/{script} {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "hack/{script} printed {path:?}, which is not a file"
        ))
    }
}

/// [`hack_tool`], or `None` after saying why outside CI; under `CI=true` a
/// missing tool fails the test.
pub fn hack_tool_or_skip(script: &str, args: &[&str]) -> Option<PathBuf> {
    match hack_tool(script, args) {
        Ok(path) => Some(path),
        Err(why) if in_ci() => panic!("CI=true and no hack/{script} {args:?}: {why}"),
        Err(why) => {
            eprintln!("skipping: {why}");
            None
        }
    }
}

/// A command's stdout then stderr, for assertion messages.
pub fn output_text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The Kubernetes minor version the apiserver serves, as `(minor,
/// "1.MINOR.0")` for `helm template --kube-version`.
pub async fn server_minor(client: &Client) -> (u32, String) {
    let version = client
        .apiserver_version()
        .await
        .expect("the apiserver's version");
    let minor = version.minor.trim_end_matches('+');
    (
        minor.parse().expect("a numeric minor version"),
        format!("{}.{minor}.0", version.major),
    )
}

/// The first Kubernetes minor version that serves DRA consumable capacity
/// (beta and on by default), which pools claimed through DRA need.
pub const DRA_MINOR: u32 = 36;

/// `helm template` values that turn on every optional part of the chart
/// (e2e/tests/manifests.rs renders with them, lint_manifests.rs lints them).
pub const CHART_EVERYTHING_ON: &[&str] = &[
    "--set",
    "agent.kubeletRestart.enabled=true,agent.bootFile.enabled=true",
    "--set",
    "monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true,monitoring.kubeStateMetrics.enabled=true",
    "--set",
    "monitoring.prometheusRule.reservedUnrequested.enabled=true",
    "--set",
    "monitoring.kubeStateMetrics.rbac.serviceAccountName=kube-state-metrics",
    "--set",
    "monitoring.kubeStateMetrics.rbac.serviceAccountNamespace=monitoring",
    "--set",
    "namespace.create=true,apiServer.host=10.88.0.1,apiServer.port=6443",
    // DRA needs 1.36 or later; helm template assumes its own client's.
    "--set",
    "dra.enabled=true",
    "--kube-version",
    "1.37.0",
];

/// `helm template hugepool charts/hugepool -n hugepool-system EXTRA...`.
pub fn helm_template(helm: &Path, extra: &[&str]) -> String {
    let output = Command::new(helm)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .args(["template", "hugepool", "charts/hugepool"])
        .args(["--namespace", "hugepool-system"])
        .args(extra)
        .output()
        .expect("run helm template");
    assert!(
        output.status.success(),
        "helm template {extra:?} failed: {}",
        output_text(&output)
    );
    String::from_utf8(output.stdout).expect("helm output is UTF-8")
}

/// Every document of a multi-document YAML stream, as JSON values.
pub fn yaml_documents(yaml: &str) -> Vec<serde_json::Value> {
    serde_saphyr::from_multiple::<serde_json::Value>(yaml)
        .expect("valid YAML documents")
        .into_iter()
        .filter(|doc| !doc.is_null())
        .collect()
}
