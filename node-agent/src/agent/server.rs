//! What the agent's `/metrics`, `/healthz` and `/readyz` answer (served by
//! `hugepool_runtime::serve`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::registry::Registry;

use super::liveness::Liveness;

/// The agent's probes: its registry, whether its first status is written,
/// and the resize loop's heartbeat.
pub struct AgentProbes {
    pub registry: Arc<Registry>,
    pub ready: Arc<AtomicBool>,
    pub liveness: Arc<Liveness>,
}

impl hugepool_runtime::Probes for AgentProbes {
    fn metrics(&self) -> String {
        super::metrics::encode(&self.registry)
    }

    fn live(&self) -> Result<(), String> {
        self.liveness.check()
    }

    fn ready(&self) -> Result<(), String> {
        if self.ready.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("status not written yet".into())
        }
    }
}
