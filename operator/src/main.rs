//! `hugepool-operator run`: the cluster controller (docs/design.md, "The operator").

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use hugepool_operator::{Config, LeaderConfig};
use hugepool_runtime::{LogFormat, init_logging, kube_client, shutdown_signal};

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
    #[arg(long, default_value = "2m", value_parser = hugepool_runtime::duration_arg)]
    timeout: Duration,
    #[arg(long, env = "HUGEPOOL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Args, Debug)]
struct RunArgs {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "HUGEPOOL_LISTEN", default_value = "[::]:8080")]
    listen: SocketAddr,
    #[command(flatten)]
    leader: LeaderArgs,
    /// Re-plan at least this often without events (Go duration).
    #[arg(long, default_value = "5m", value_parser = hugepool_runtime::duration_arg)]
    resync: Duration,
    /// The Nodes the agents run on, by the labels of the agents'
    /// nodeSelector (`key=value,...`; "" for every Node): each gets a
    /// HugePageNode before a pool selects it, so that its agent reports what
    /// a grow can get. Unset: only the nodes pools select.
    #[arg(long, value_parser = parse_node_labels)]
    agent_node_labels: Option<kube::core::Selector>,
    /// Follow every ResourceClaim and tell each node's agent the pages the
    /// claims allocated there hold (`status.allocatedClaims`), so that a
    /// shrink never frees pages the scheduler gave a pod the kubelet has
    /// not started yet (the chart's `dra.enabled`; needs `list` and
    /// `watch` on resourceclaims.resource.k8s.io).
    #[arg(long)]
    watch_claims: bool,
    #[arg(long, env = "HUGEPOOL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// `key=value,...` (a DaemonSet's nodeSelector) as a selector.
fn parse_node_labels(text: &str) -> Result<kube::core::Selector, String> {
    text.split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                Ok((key.trim().to_string(), value.trim().to_string()))
            }
            _ => Err(format!("{pair:?} is not key=value")),
        })
        .collect()
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
    #[arg(long, default_value = "15s", value_parser = hugepool_runtime::duration_arg)]
    lease_duration: Duration,
    /// How long before expiry the holder renews (Go duration).
    #[arg(long, default_value = "5s", value_parser = hugepool_runtime::duration_arg)]
    lease_grace: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => run(args).await,
        Command::Uninstall(args) => uninstall(args).await,
    }
}

async fn uninstall(args: UninstallArgs) -> anyhow::Result<()> {
    init_logging(args.log_format, "info");
    let config = hugepool_operator::uninstall::UninstallConfig {
        namespace: args.namespace,
        deployment: args.deployment,
        timeout: args.timeout,
    };
    let report = hugepool_operator::uninstall::uninstall(kube_client().await?, &config)
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
    init_logging(args.log_format, "info");
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
        agent_nodes: args.agent_node_labels,
        watch_claims: args.watch_claims,
    };
    hugepool_operator::run(kube_client().await?, config, shutdown_signal())
        .await
        .context("running the operator")
}
