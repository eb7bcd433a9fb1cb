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
    #[error("control plane process failed: {0}")]
    Process(#[from] std::io::Error),
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig { path: PathBuf, source: kube::config::KubeconfigError },
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

/// Where `make controlplane` puts its binaries.
pub fn controlplane_bin_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("controlplane").join("bin")
}

/// The real kubectl built with the control plane.
pub fn kubectl_path() -> PathBuf {
    controlplane_bin_dir().join("kubectl")
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

impl ControlPlane {
    /// Starts `controlplane up` in a fresh directory and waits for its ready
    /// file. The child dies with this process (the control plane watches its
    /// parent), and it is spawned from a thread that lives as long as the
    /// process, because a parent-death signal follows the spawning thread.
    pub fn start(data_dir: &Path, timeout: Duration) -> Result<ControlPlane, E2eError> {
        let binary = controlplane_bin_dir().join("controlplane");
        if !binary.exists() {
            return Err(E2eError::MissingBinary(binary));
        }
        std::fs::create_dir_all(data_dir)?;
        let ready = data_dir.join("ready");
        let _ = std::fs::remove_file(&ready);
        let log_path = data_dir.join("up.log");
        let log = std::fs::File::create(&log_path)?;
        let data_dir_arg = data_dir.to_path_buf();
        let (spawned_tx, spawned_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new().name("controlplane".into()).spawn(move || {
            let child = Command::new(&binary)
                .arg("up")
                .arg("--data-dir")
                .arg(&data_dir_arg)
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log file handle"))
                .stderr(log)
                .spawn();
            match child {
                Ok(mut child) => {
                    let _ = spawned_tx.send(Ok(()));
                    let _ = child.wait();
                }
                Err(err) => {
                    let _ = spawned_tx.send(Err(err));
                }
            }
            // Keep the spawning thread alive for the life of the process.
            loop {
                std::thread::park();
            }
        })?;
        spawned_rx.recv().map_err(|_| std::io::Error::other("controlplane thread died"))??;
        let deadline = Instant::now() + timeout;
        while !ready.exists() {
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                return Err(E2eError::NotReady { timeout, log: tail.join("\n") });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(ControlPlane { kubeconfig: data_dir.join("kubeconfig") })
    }

    /// A client for this control plane, bound to the caller's runtime.
    pub async fn client(&self) -> Result<Client, E2eError> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .map_err(|source| E2eError::Kubeconfig { path: self.kubeconfig.clone(), source })?;
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|source| E2eError::Kubeconfig { path: self.kubeconfig.clone(), source })?;
        Ok(Client::try_from(config)?)
    }

    /// Runs the real kubectl against this control plane.
    pub fn kubectl(&self, args: &[&str]) -> std::io::Result<Output> {
        Command::new(kubectl_path()).arg("--kubeconfig").arg(&self.kubeconfig).args(args).output()
    }
}

fn shared_control_plane() -> Result<&'static ControlPlane, String> {
    static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            if let Ok(path) = std::env::var(KUBECONFIG_ENV) {
                return Ok(ControlPlane { kubeconfig: PathBuf::from(path) });
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
    let client = control_plane.client().await.expect("client for the control plane");
    static CRDS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    CRDS.get_or_try_init(|| install_crds(client.clone()))
        .await
        .expect("CRDs installed and Established");
    Some(TestEnv { control_plane, client })
}

/// Applies both CRDs (server-side, forced) and waits until each is Established.
pub async fn install_crds(client: Client) -> Result<(), E2eError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    let params = PatchParams::apply("hugepool-e2e").force();
    for crd in [hugepool_crds::HugePagePool::crd(), hugepool_crds::HugePageNode::crd()] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        crds.patch(&name, &params, &Patch::Apply(&crd)).await?;
        let established = await_condition(crds.clone(), &name, conditions::is_crd_established());
        tokio::time::timeout(Duration::from_secs(30), established)
            .await
            .map_err(|_| E2eError::CrdNotEstablished { name: name.clone(), message: "timed out after 30s".into() })?
            .map_err(|e| E2eError::CrdNotEstablished { name: name.clone(), message: e.to_string() })?;
    }
    Ok(())
}

/// A name no other test (in this or another process) uses: `prefix-pid-n`.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{}-{n}", std::process::id())
}
