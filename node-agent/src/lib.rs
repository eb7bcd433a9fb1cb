//! The hugepool node agent: reads and sizes this node's hugetlb pools.
//!
//! - [`kernel`]: what the agent needs from the kernel, behind one trait, with
//!   the real sysfs/procfs implementation and an in-memory simulation; the
//!   kernel log (`kernel::kmsg`: soft lockups, RCU stalls and hung tasks in
//!   the kernel's own records) and the release (`kernel::release`).
//! - [`resize`]: the budgeted resize engine (the algorithm is in
//!   `resize/planner.rs`).
//! - [`boot`]: the last converged targets kept on the host, applied before
//!   the kubelet starts (`hugepool-agent boot`).
//! - [`cli`]: the command line of the `hugepool-agent` binary.

pub mod agent;
pub mod boot;
pub mod cli;
pub mod dra;
pub mod error;
pub mod kernel;
pub mod kubelet_state;
pub mod pod_cgroups;
pub mod resize;

pub use error::{Error, Result};
