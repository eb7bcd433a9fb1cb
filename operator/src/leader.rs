//! Leader election over a coordination.k8s.io Lease (kube-lease-manager):
//! every replica watches and plans, only the holder of the Lease writes.

use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub lease_name: String,
    /// Unique per replica; the pod name.
    pub identity: String,
    /// How long a Lease stays valid after its last renewal.
    pub duration: Duration,
    /// How long before expiry the holder renews.
    pub grace: Duration,
}

/// Whether this replica leads, and the task that keeps it so.
pub struct Leadership {
    pub is_leader: watch::Receiver<bool>,
    task: Option<JoinHandle<Result<kube_lease_manager::LeaseManager, LeaseManagerError>>>,
    _always: Option<watch::Sender<bool>>,
}

impl Leadership {
    /// A single replica that always leads (leader election off).
    pub fn always() -> Self {
        let (sender, receiver) = watch::channel(true);
        Self {
            is_leader: receiver,
            task: None,
            _always: Some(sender),
        }
    }

    /// Starts competing for the Lease.
    pub async fn elect(client: Client, config: &LeaderConfig) -> Result<Self, LeaseManagerError> {
        // The crate panics unless 0 < grace < duration.
        let duration = config.duration.as_secs().max(2);
        let grace = config.grace.as_secs().clamp(1, duration - 1);
        // Field manager left at its per-identity default: replicas must not
        // share one, or server-side apply could not tell their writes apart.
        let manager = LeaseManagerBuilder::new(client, &config.lease_name)
            .with_namespace(&config.namespace)
            .with_identity(&config.identity)
            .with_duration(duration)
            .with_grace(grace)
            .build()
            .await?;
        let (is_leader, task) = manager.watch().await;
        Ok(Self {
            is_leader,
            task: Some(task),
            _always: None,
        })
    }

    /// Gives the Lease up (so the other replica takes over at once).
    pub async fn release(self) {
        let Self {
            is_leader, task, ..
        } = self;
        drop(is_leader);
        if let Some(task) = task {
            match task.await {
                Ok(Ok(_)) => tracing::info!("released the leader lease"),
                Ok(Err(err)) => tracing::warn!(error = %err, "releasing the leader lease"),
                Err(err) => tracing::warn!(error = %err, "leader election task ended"),
            }
        }
    }
}
