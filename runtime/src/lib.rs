//! The runtime both binaries share (docs/design.md, "Both binaries"):
//! logging, the signals that stop them, the Kubernetes client, and the one
//! HTTP port with `/metrics`, `/healthz` and `/readyz`.

pub mod http;
pub mod metrics_doc;

use std::time::Duration;

use anyhow::Context as _;
use clap::ValueEnum;

pub use http::{Probes, serve};

/// How log lines are written (to stderr).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line, fields flattened (for log pipelines).
    Json,
}

/// Logs to stderr at `RUST_LOG`, or `default_level` when it is unset.
pub fn init_logging(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .init(),
    }
}

/// Completes on the first SIGTERM (what the kubelet sends) or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut terminate) => {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(err) => {
            tracing::error!(error = %err, "cannot listen for SIGTERM; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// A clap value parser for Go durations (`50ms`, `2m`, `1h30m`).
pub fn duration_arg(text: &str) -> Result<Duration, String> {
    hugepool_crds::duration::parse(text).map_err(|e| e.to_string())
}

/// The Kubernetes client from the in-cluster config or `KUBECONFIG`, with
/// kube's own retry layer off: both binaries back off themselves (with
/// jitter), and a refused eviction (429) must come back at once rather than
/// be repeated for minutes inside one call.
pub async fn kube_client() -> anyhow::Result<kube::Client> {
    let mut config = kube::Config::infer()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    config.default_retry = false;
    // A write has its own deadline (the operator's fence); a connection that
    // does not open in this long is an error, not a wait.
    config.connect_timeout = Some(Duration::from_secs(10));
    kube::Client::try_from(config).context("building the Kubernetes client")
}
