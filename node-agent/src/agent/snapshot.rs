//! One read of everything the agent reports about the node's kernel.

use std::sync::Arc;

use hugepool_crds::PageSize;

use crate::kernel::freelists::FreeLists;
use crate::kernel::{Kernel, MemInfo, NumaCounts, PoolCounts};
use crate::{Error, Result};

/// A size's counts, system-wide and per NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeSnapshot {
    pub size: PageSize,
    pub pool: PoolCounts,
    pub numa: Vec<NumaCounts>,
}

/// The kernel as the agent last read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSnapshot {
    pub release: String,
    pub hvo: Option<bool>,
    pub memory: MemInfo,
    /// Every size the kernel offers, smallest first.
    pub sizes: Vec<SizeSnapshot>,
    /// The free lists, or why they could not be read (`/proc/pagetypeinfo`
    /// is root only): what a grow can get is then not reported.
    pub free_lists: std::result::Result<FreeLists, String>,
}

impl KernelSnapshot {
    pub fn read(kernel: &dyn Kernel, release: &str) -> Result<Self> {
        let mut sizes = Vec::new();
        for size in kernel.page_sizes()? {
            sizes.push(SizeSnapshot {
                size,
                pool: kernel.pool(size)?,
                numa: kernel.numa_pools(size)?,
            });
        }
        Ok(Self {
            release: release.to_string(),
            hvo: kernel.hvo()?,
            memory: kernel.meminfo()?,
            sizes,
            free_lists: kernel.free_lists().map_err(|err| err.to_string()),
        })
    }

    /// Reads on a blocking thread (sysfs reads can wait on a pool write).
    pub async fn read_blocking(kernel: &Arc<dyn Kernel>, release: &str) -> Result<Self> {
        let kernel = Arc::clone(kernel);
        let release = release.to_string();
        tokio::task::spawn_blocking(move || Self::read(kernel.as_ref(), &release))
            .await
            .map_err(|err| Error::WriteThread(err.to_string()))?
    }

    pub fn size(&self, size: PageSize) -> Option<&SizeSnapshot> {
        self.sizes.iter().find(|s| s.size == size)
    }
}
