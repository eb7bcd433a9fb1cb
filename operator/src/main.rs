//! `hugepool-operator run`: the cluster controller (docs/design.md, "The operator").

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use hugepool_operator::{Config, LeaderConfig};

#[derive(Parser, Debug)]
#[command(name = "hugepool-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Watch HugePagePools, Nodes and HugePageNodes and roll pools out.
    Run(RunArgs),
    /// Before the operator is removed (the chart's pre-delete hook): scale it
    /// to 0, wait for its pods to exit, then remove the draining taint from
    /// every Node and the release finalizer from every pool.
    Uninstall(UninstallArgs),
}

#[derive(Args, Debug)]
struct UninstallArgs {
    /// Namespace of the operator Deployment.
    #[arg(long, env = "POD_NAMESPACE", default_value = "hugepool-system")]
    namespace: String,
    /// Name of the operator Deployment.
    #[arg(long, default_value = "hugepool-operator")]
    deployment: String,
    /// How long the operator's pods may take to exit (Go duration).
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    timeout: Duration,
    #[arg(long, env = "HUGEPOOL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Args, Debug)]
struct RunArgs {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "HUGEPOOL_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    #[command(flatten)]
    leader: LeaderArgs,
    /// Re-plan at least this often without events (Go duration).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    resync: Duration,
    #[arg(long, env = "HUGEPOOL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Args, Debug)]
struct LeaderArgs {
    /// Elect a leader through a Lease (run with 2 replicas).
    #[arg(long, env = "HUGEPOOL_LEADER_ELECT")]
    leader_elect: bool,
    /// Namespace of the Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "hugepool-system")]
    lease_namespace: String,
    #[arg(long, default_value = "hugepool-operator")]
    lease_name: String,
    /// This replica's identity in the Lease; the pod name.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long a Lease holds after its last renewal (Go duration).
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    lease_duration: Duration,
    /// How long before expiry the holder renews (Go duration).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    lease_grace: Duration,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    hugepool_crds::duration::parse(text).map_err(|e| e.to_string())
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

async fn client() -> anyhow::Result<kube::Client> {
    let mut kube_config = kube::Config::infer()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    // An eviction a PodDisruptionBudget refuses is a 429 that must come back
    // at once (the drain backs off itself); kube's default retry would repeat
    // it for minutes inside the call and hold up every reconcile.
    kube_config.default_retry = false;
    kube::Client::try_from(kube_config).context("building the Kubernetes client")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => run(args).await,
        Command::Uninstall(args) => uninstall(args).await,
    }
}

async fn uninstall(args: UninstallArgs) -> anyhow::Result<()> {
    init_logging(args.log_format);
    let config = hugepool_operator::uninstall::UninstallConfig {
        namespace: args.namespace,
        deployment: args.deployment,
        timeout: args.timeout,
    };
    let report = hugepool_operator::uninstall::uninstall(client().await?, &config)
        .await
        .context("uninstalling")?;
    println!(
        "stopped {} operator pods; draining taint removed from {} nodes {:?}; \
         release finalizer removed from {} pools {:?}",
        report.stopped_pods,
        report.untainted.len(),
        report.untainted,
        report.released.len(),
        report.released
    );
    Ok(())
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    init_logging(args.log_format);
    let identity = args
        .leader
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| format!("hugepool-operator-{}", std::process::id()));
    let config = Config {
        listen: Some(args.listen),
        leader: args.leader.leader_elect.then(|| LeaderConfig {
            namespace: args.leader.lease_namespace.clone(),
            lease_name: args.leader.lease_name.clone(),
            identity: identity.clone(),
            duration: args.leader.lease_duration,
            grace: args.leader.lease_grace,
        }),
        instance: identity,
        resync: args.resync,
        ..Config::default()
    };
    hugepool_operator::run(client().await?, config, shutdown_signal())
        .await
        .context("running the operator")
}
