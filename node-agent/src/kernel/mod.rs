//! What the agent needs from the kernel, behind one trait.
//!
//! [`SysfsKernel`] reads and writes the real files (docs/design.md, "The
//! node agent", has what was measured); [`SimulatedKernel`] is an in-memory
//! kernel with the same pool semantics for tests and fleet simulations.
//! Parsing lives in [`parse`] and is pure; [`kmsg`] reads the kernel log and
//! [`release`] names the running kernel.

// Fake sysfs trees for tests: this crate's own, and its integration tests
// through the `test-fixtures` feature (the crate's dev-dependency on
// itself turns it on), never in a build that ships.
#[cfg(any(test, feature = "test-fixtures"))]
pub mod fixture;
pub mod freelists;
pub mod kmsg;
pub mod parse;
mod simulated;
mod sysfs;

use std::fmt;

use hugepool_crds::PageSize;
use serde::Serialize;

use crate::Result;

/// How long the calling thread has waited for a CPU (run queue wait, from
/// `/proc/thread-self/schedstat`); None where the kernel does not keep it
/// (`CONFIG_SCHED_INFO`). A pool write times its wall clock: taking this
/// before and after says how much of it the writer was ready but not
/// running (other work on the CPUs), which no step size changes.
pub fn cpu_wait() -> Option<std::time::Duration> {
    let path = std::path::Path::new("/proc/thread-self/schedstat");
    let text = std::fs::read_to_string(path).ok()?;
    let (_, waiting) = parse::schedstat(path, &text).ok()?;
    Some(std::time::Duration::from_nanos(waiting))
}

/// The running kernel's release (`uname -r`). A container shares the host's
/// kernel, so this needs no mount of the host's procfs.
pub fn release() -> String {
    // SAFETY: uname fills the zeroed struct we own.
    let mut name: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut name) } != 0 {
        return "unknown".into();
    }
    // SAFETY: uname NUL-terminates release within the array.
    unsafe { std::ffi::CStr::from_ptr(name.release.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

pub use simulated::{SimConfig, SimNode, SimSize, SimulatedKernel, WriteCost};
pub use sysfs::SysfsKernel;

/// Counts of one size's pool as the kernel reports them, system-wide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolCounts {
    /// `nr_hugepages`: the persistent pool plus surplus.
    pub total: u64,
    /// `free_hugepages`; includes reserved pages.
    pub free: u64,
    /// `resv_hugepages`: promised to mappings, not yet faulted in.
    pub reserved: u64,
    /// `surplus_hugepages`: in use beyond the persistent pool.
    pub surplus: u64,
}

impl PoolCounts {
    /// The pool the administrator asked for: `nr_hugepages - surplus`.
    pub fn persistent(&self) -> u64 {
        self.total.saturating_sub(self.surplus)
    }

    /// Pages mapped by processes.
    pub fn in_use(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }
}

/// Counts of one size's pool on one NUMA node (reserve is only global).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NumaCounts {
    pub node: u32,
    pub total: u64,
    pub free: u64,
    pub surplus: u64,
}

impl NumaCounts {
    pub fn persistent(&self) -> u64 {
        self.total.saturating_sub(self.surplus)
    }

    pub fn in_use(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }
}

/// The two `/proc/meminfo` values the agent uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemInfo {
    pub total_bytes: u64,
    pub available_bytes: u64,
}

/// Which pool file a write goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum PoolScope {
    /// The size's global `nr_hugepages`; the kernel spreads over nodes.
    Global,
    /// `node<N>/hugepages/.../nr_hugepages`: that NUMA node only.
    Node(u32),
}

impl fmt::Display for PoolScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolScope::Global => f.write_str("global"),
            PoolScope::Node(id) => write!(f, "node{id}"),
        }
    }
}

/// Everything the agent reads from and writes to the kernel.
///
/// Calls block (a pool write can take seconds); async callers run them on a
/// blocking thread.
pub trait Kernel: Send + Sync {
    /// Huge page sizes the kernel offers, smallest first.
    fn page_sizes(&self) -> Result<Vec<PageSize>>;
    /// NUMA node ids, ascending; empty on kernels without NUMA sysfs.
    fn numa_nodes(&self) -> Result<Vec<u32>>;
    /// System-wide counts of one size.
    fn pool(&self, size: PageSize) -> Result<PoolCounts>;
    /// Counts of one size on one NUMA node.
    fn numa_pool(&self, size: PageSize, node: u32) -> Result<NumaCounts>;
    fn meminfo(&self) -> Result<MemInfo>;
    /// HugeTLB Vmemmap Optimisation; `None` when the kernel lacks the sysctl.
    fn hvo(&self) -> Result<Option<bool>>;
    /// Writes a pool size; returns when the kernel is done. Read back to learn
    /// what it did.
    fn write_pool(&self, size: PageSize, scope: PoolScope, pages: u64) -> Result<()>;
    /// Compacts memory of all zones (`Global`) or of one NUMA node.
    fn compact(&self, scope: PoolScope) -> Result<()>;
    /// The free lists a grow takes its pages from (`freelists`), with the
    /// pageblock counts that say what a compaction can add.
    fn free_lists(&self) -> Result<freelists::FreeLists>;

    /// The free lists without reading the pageblock counts when that is
    /// costly (`FreeLists::pagetypeinfo` may be None): enough to know what a
    /// grow gets without compaction.
    fn free_blocks(&self) -> Result<freelists::FreeLists> {
        self.free_lists()
    }

    /// Counts of one size on every NUMA node that has a pool of it.
    fn numa_pools(&self, size: PageSize) -> Result<Vec<NumaCounts>> {
        let mut pools = Vec::new();
        for node in self.numa_nodes()? {
            match self.numa_pool(size, node) {
                Ok(counts) => pools.push(counts),
                Err(crate::Error::NoNumaPool { .. }) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(pools)
    }

    /// Fails with a message listing the offered sizes unless `size` is one.
    fn check_size_offered(&self, size: PageSize) -> Result<()> {
        let offered = self.page_sizes()?;
        if offered.contains(&size) {
            return Ok(());
        }
        let offered = offered
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        Err(crate::Error::SizeNotOffered { size, offered })
    }
}
