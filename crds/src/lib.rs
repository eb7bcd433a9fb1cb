//! The `hugepool.dev/v1alpha1` API: the contract between the operator and the
//! node agents (see docs/design.md, "API"), plus the small value helpers both
//! sides need to read it the same way.

pub mod conditions;
#[cfg(feature = "crdgen")]
pub mod crdgen;
pub mod dra;
pub mod duration;
pub mod kubelet;
pub mod node;
pub mod page_size;
pub mod pod;
pub mod pool;
pub mod quantity;
pub mod settings;

pub use conditions::{
    ConditionUpdate, NodeConditionType, PoolConditionType, Reason, set_condition,
};
pub use node::{HugePageNode, HugePageNodeSpec, HugePageNodeStatus};
pub use page_size::PageSize;
pub use pool::{HugePagePool, HugePagePoolSpec, HugePagePoolStatus};

/// API group of every hugepool resource.
pub const GROUP: &str = "hugepool.dev";
/// The one served and stored version.
pub const VERSION: &str = "v1alpha1";
/// Field manager of the operator: it owns HugePageNode `.spec` and pool status.
pub const OPERATOR_MANAGER: &str = "hugepool-operator";
/// Field manager of the operator's `status.allocatedClaims` of each
/// HugePageNode (a manager of its own: an apply by the operator's manager
/// without its Draining condition would take that condition away).
pub const CLAIMS_MANAGER: &str = "hugepool-operator-claims";
/// Field manager of the node agent: it owns HugePageNode `.status`.
pub const AGENT_MANAGER: &str = "hugepool-agent";
/// Taint the operator puts on a node while it evicts hugepage consumers.
pub const DRAINING_TAINT: &str = "hugepool.dev/draining";
/// Taint that keeps ordinary pods off a node whose pools are not back yet
/// (a reboot, a new node): the agent says `Restoring`, the operator taints,
/// and removes the taint once the pools are at target and the kubelet
/// reports them. Node images may register kubelets with it.
pub const NOT_READY_TAINT: &str = "hugepool.dev/not-ready";
/// Finalizer that lets a `Release` pool shrink its nodes before it goes.
pub const POOL_FINALIZER: &str = "hugepool.dev/release";

/// Errors of parsing the API's value formats (sizes, durations, quantities).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("invalid page size {0:?}: expected a power of two such as 2Mi or 1Gi")]
    PageSize(String),
    #[error("invalid duration {0:?}: expected a Go duration such as 50ms, 2s or 1m30s")]
    Duration(String),
    #[error("invalid quantity {0:?}: expected a non-negative quantity such as 1Gi or 512Mi")]
    Quantity(String),
    #[error("invalid maxUnavailable {0:?}: expected an integer >= 1 or a percentage 1%-100%")]
    IntOrPercent(String),
}
