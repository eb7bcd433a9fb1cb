//! The one HTTP port of each binary: `/metrics` (OpenMetrics), `/healthz`
//! (liveness) and `/readyz` (readiness), answered from a [`Probes`].

use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the endpoints answer; each binary implements it over its state.
pub trait Probes: Send + Sync + 'static {
    /// The registry in OpenMetrics text.
    fn metrics(&self) -> String;
    /// `Err(why)` when the process should be restarted.
    fn live(&self) -> Result<(), String>;
    /// `Err(why)` while the process should get no traffic or work.
    fn ready(&self) -> Result<(), String>;
}

type Shared = Arc<dyn Probes>;

async fn metrics(State(probes): State<Shared>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        probes.metrics(),
    )
}

fn answer(result: Result<(), String>) -> (StatusCode, String) {
    match result {
        Ok(()) => (StatusCode::OK, "ok".into()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

async fn healthz(State(probes): State<Shared>) -> (StatusCode, String) {
    answer(probes.live())
}

async fn readyz(State(probes): State<Shared>) -> (StatusCode, String) {
    answer(probes.ready())
}

/// The three routes over `probes`.
pub fn router(probes: Arc<dyn Probes>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(probes)
}

/// Binds `addr`; the IPv6 any-address (`[::]`, the default, which also
/// takes IPv4 on a dual-stack host) falls back to `0.0.0.0` on a host
/// without IPv6.
pub async fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    match TcpListener::bind(addr).await {
        Err(err) if addr.ip().is_unspecified() && addr.is_ipv6() && no_ipv6(&err) => {
            let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, addr.port()));
            tracing::info!(%addr, fallback = %v4, error = %err, "no IPv6 on this host");
            TcpListener::bind(v4).await
        }
        other => other,
    }
}

fn no_ipv6(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL | libc::EPROTONOSUPPORT)
    )
}

/// Serves the three routes on `addr` until `shutdown` completes; returns
/// the bound address (useful with port 0) and the server's task.
pub async fn serve(
    addr: SocketAddr,
    probes: Arc<dyn Probes>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = router(probes);
    let task = tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %err, "the metrics server stopped");
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Fake {
        ready: AtomicBool,
    }

    impl Probes for Fake {
        fn metrics(&self) -> String {
            "# TYPE up gauge\nup 1\n# EOF\n".into()
        }
        fn live(&self) -> Result<(), String> {
            Err("the loop has not come round for 6m".into())
        }
        fn ready(&self) -> Result<(), String> {
            if self.ready.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("caches not synced".into())
            }
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    }

    #[tokio::test]
    async fn each_route_answers_from_the_probes_on_the_ipv6_any_address_or_its_fallback() {
        let probes = Arc::new(Fake {
            ready: AtomicBool::new(false),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (bound, task) = serve("[::]:0".parse().unwrap(), probes.clone(), async move {
            let _ = stop_rx.await;
        })
        .await
        .unwrap();
        // An IPv4 client reaches the any-address either way.
        let local = SocketAddr::from((Ipv4Addr::LOCALHOST, bound.port()));
        let metrics = get(local, "/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(
            metrics.contains("application/openmetrics-text"),
            "{metrics}"
        );
        assert!(metrics.contains("up 1"), "{metrics}");
        let health = get(local, "/healthz").await;
        assert!(health.starts_with("HTTP/1.1 503"), "{health}");
        assert!(health.contains("has not come round"), "{health}");
        assert!(get(local, "/readyz").await.contains("caches not synced"));
        probes.ready.store(true, Ordering::Relaxed);
        assert!(get(local, "/readyz").await.starts_with("HTTP/1.1 200"));
        stop_tx.send(()).unwrap();
        task.await.unwrap();
    }
}
