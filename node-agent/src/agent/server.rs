//! `/metrics` (OpenMetrics), `/healthz` and `/readyz` on one port.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::liveness::Liveness;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

#[derive(Clone)]
struct ServerState {
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
    liveness: Arc<Liveness>,
}

async fn metrics(State(state): State<ServerState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        super::metrics::encode(&state.registry),
    )
}

async fn healthz(State(state): State<ServerState>) -> (StatusCode, String) {
    match state.liveness.check() {
        Ok(()) => (StatusCode::OK, "ok".into()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

async fn readyz(State(state): State<ServerState>) -> (StatusCode, &'static str) {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "status not written yet")
    }
}

pub fn router(registry: Arc<Registry>, ready: Arc<AtomicBool>, liveness: Arc<Liveness>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(ServerState {
            registry,
            ready,
            liveness,
        })
}

/// Binds `addr` and serves until the process ends; returns the bound address
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
    liveness: Arc<Liveness>,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = router(registry, ready, liveness);
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(error = %err, "metrics server stopped");
        }
    });
    Ok(bound)
}
