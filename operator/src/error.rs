//! The operator's one error type. Each variant names the metric label it is
//! counted under (`hugepool_reconcile_errors_total{error}`).

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing HugePageNode {node}: {source}")]
    NodeSpec { node: String, source: kube::Error },
    #[error("writing the Draining condition of HugePageNode {node}: {source}")]
    DrainCondition { node: String, source: kube::Error },
    #[error("writing the allocated claims of HugePageNode {node}: {source}")]
    AllocatedClaims { node: String, source: kube::Error },
    #[error("updating the draining taint of Node {node}: {source}")]
    Taint { node: String, source: kube::Error },
    #[error("listing the pods on Node {node}: {source}")]
    ListPods { node: String, source: kube::Error },
    #[error("listing the ResourceClaims of Node {node}'s pods in namespace {namespace}: {source}")]
    ListClaims {
        node: String,
        namespace: String,
        source: kube::Error,
    },
    #[error("writing the status of HugePagePool {pool}: {source}")]
    PoolStatus { pool: String, source: kube::Error },
    #[error("updating the finalizer of HugePagePool {pool}: {source}")]
    Finalizer { pool: String, source: kube::Error },
    #[error("this replica lost the leader Lease; writes stopped")]
    NotLeader,
    #[error("publishing an Event: {source}")]
    Event { source: kube::Error },
    #[error("the API server did not answer within {0:?} (the write may or may not have landed)")]
    Timeout(std::time::Duration),
    #[error("leader election: {0}")]
    Leader(#[from] kube_lease_manager::LeaseManagerError),
    #[error("serving metrics and health on {addr}: {source}")]
    Serve {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl Error {
    /// The `error` label of `hugepool_reconcile_errors_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::NodeSpec { .. } => "node_spec",
            Error::DrainCondition { .. } => "drain_condition",
            Error::AllocatedClaims { .. } => "allocated_claims",
            Error::Taint { .. } => "taint",
            Error::ListPods { .. } => "list_pods",
            Error::ListClaims { .. } => "list_claims",
            Error::PoolStatus { .. } => "pool_status",
            Error::Finalizer { .. } => "finalizer",
            Error::NotLeader => "not_leader",
            Error::Event { .. } => "event",
            Error::Timeout(_) => "timeout",
            Error::Leader(_) => "leader",
            Error::Serve { .. } => "serve",
        }
    }
}

impl Error {
    /// A write refused because what it was planned from changed: 409, or
    /// 422 from a JSON patch whose `test` of the generation failed.
    pub fn is_conflict(&self) -> bool {
        let source = match self {
            Error::NodeSpec { source, .. }
            | Error::DrainCondition { source, .. }
            | Error::AllocatedClaims { source, .. }
            | Error::Taint { source, .. }
            | Error::PoolStatus { source, .. }
            | Error::Finalizer { source, .. } => source,
            _ => return false,
        };
        matches!(source, kube::Error::Api(status)
            if status.code == 409 || (status.code == 422 && status.message.contains("test failed")))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
