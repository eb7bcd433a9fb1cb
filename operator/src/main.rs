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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Cli {
        command: Command::Run(args),
    } = Cli::parse();
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
    let mut kube_config = kube::Config::infer()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    // An eviction a PodDisruptionBudget refuses is a 429 that must come back
    // at once (the drain backs off itself); kube's default retry would repeat
    // it for minutes inside the call and hold up every reconcile.
    kube_config.default_retry = false;
    let client = kube::Client::try_from(kube_config).context("building the Kubernetes client")?;
    hugepool_operator::run(client, config, shutdown_signal())
        .await
        .context("running the operator")
}
