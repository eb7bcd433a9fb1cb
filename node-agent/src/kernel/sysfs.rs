//! The real kernel: the sysfs and procfs files of docs/kernel.md, under injected
//! roots so tests can point it at a fake tree.

use std::fs;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hugepool_crds::PageSize;

use crate::kernel::freelists::{self, FreeLists, PageTypeInfo};
use crate::kernel::{Kernel, MemInfo, NumaCounts, PoolCounts, PoolScope, parse};
use crate::{Error, Result};

/// How long the pageblock counts of `/proc/pagetypeinfo` are reused. To
/// print that file the kernel walks every free list with interrupts off and
/// the zone locked (14 ms here with 24 GiB, more the more fragmented and the
/// larger the node; the kernel asks not to read it constantly), while the
/// counts it is read for change only when a pageblock changes migrate type.
pub const PAGEBLOCK_COUNTS_MAX_AGE: Duration = Duration::from_secs(300);

/// Reads and writes `<sys_root>/...` and `<proc_root>/...`.
#[derive(Clone, Debug)]
pub struct SysfsKernel {
    sys_root: PathBuf,
    proc_root: PathBuf,
    /// The last `/proc/pagetypeinfo` read and when (shared by clones).
    pageblock_counts: Arc<Mutex<Option<(Instant, PageTypeInfo)>>>,
    pageblock_counts_max_age: Duration,
}

impl Default for SysfsKernel {
    fn default() -> Self {
        Self::new("/sys", "/proc")
    }
}

impl SysfsKernel {
    pub fn new(sys_root: impl Into<PathBuf>, proc_root: impl Into<PathBuf>) -> Self {
        Self {
            sys_root: sys_root.into(),
            proc_root: proc_root.into(),
            pageblock_counts: Arc::default(),
            pageblock_counts_max_age: PAGEBLOCK_COUNTS_MAX_AGE,
        }
    }

    /// Reuses the pageblock counts this long ([`PAGEBLOCK_COUNTS_MAX_AGE`]
    /// by default; zero reads them every time, as a benchmark that makes
    /// each state anew must).
    pub fn with_pageblock_counts_max_age(mut self, max_age: Duration) -> Self {
        self.pageblock_counts_max_age = max_age;
        self
    }

    /// The pageblock counts, read again when older than the max age.
    fn pageblock_counts(&self) -> Result<PageTypeInfo> {
        let mut cached = self
            .pageblock_counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((at, info)) = cached.as_ref()
            && at.elapsed() < self.pageblock_counts_max_age
        {
            return Ok(info.clone());
        }
        let path = self.proc_root.join("pagetypeinfo");
        let info = freelists::pagetypeinfo(&path, &read(&path)?)?;
        *cached = Some((Instant::now(), info.clone()));
        Ok(info)
    }

    /// The pageblock counts when a read younger than the max age has them.
    fn cached_pageblock_counts(&self) -> Option<PageTypeInfo> {
        let cached = self
            .pageblock_counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        cached
            .as_ref()
            .filter(|(at, _)| at.elapsed() < self.pageblock_counts_max_age)
            .map(|(_, info)| info.clone())
    }

    /// `/proc/buddyinfo`, the page cache per NUMA node and MemAvailable,
    /// with `pagetypeinfo` as given.
    fn read_free_lists(&self, pagetypeinfo: Option<PageTypeInfo>) -> Result<FreeLists> {
        let buddyinfo = self.proc_root.join("buddyinfo");
        let zones = freelists::buddyinfo(&buddyinfo, &read(&buddyinfo)?)?;
        let nodes = self.numa_nodes()?;
        let file_bytes = if nodes.is_empty() {
            let path = self.proc_root.join("meminfo");
            vec![(0, freelists::file_bytes(&path, &read(&path)?)?)]
        } else {
            nodes
                .into_iter()
                .map(|node| {
                    let path = self.nodes_dir().join(format!("node{node}/meminfo"));
                    Ok((node, freelists::file_bytes(&path, &read(&path)?)?))
                })
                .collect::<Result<_>>()?
        };
        Ok(FreeLists {
            zones,
            pagetypeinfo,
            file_bytes,
            mem_available: self.meminfo()?.available_bytes,
        })
    }

    fn hugepages_dir(&self) -> PathBuf {
        self.sys_root.join("kernel/mm/hugepages")
    }

    fn size_dir(&self, size: PageSize) -> PathBuf {
        self.hugepages_dir().join(size.sysfs_dir())
    }

    fn nodes_dir(&self) -> PathBuf {
        self.sys_root.join("devices/system/node")
    }

    fn node_size_dir(&self, size: PageSize, node: u32) -> PathBuf {
        self.nodes_dir()
            .join(format!("node{node}/hugepages"))
            .join(size.sysfs_dir())
    }

    fn hvo_path(&self) -> PathBuf {
        self.proc_root.join("sys/vm/hugetlb_optimize_vmemmap")
    }

    /// The file a pool write goes to.
    pub fn pool_file(&self, size: PageSize, scope: PoolScope) -> PathBuf {
        match scope {
            PoolScope::Global => self.size_dir(size).join("nr_hugepages"),
            PoolScope::Node(node) => self.node_size_dir(size, node).join("nr_hugepages"),
        }
    }

    /// Turns HVO on or off (tests and the benchmark; the agent never does).
    pub fn set_hvo(&self, on: bool) -> Result<()> {
        write_value(&self.hvo_path(), if on { "1" } else { "0" })
    }

    fn read_count(&self, path: &Path) -> Result<u64> {
        parse::count(path, &read(path)?)
    }
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// One `write(2)` of `value`, without creating the file: a missing sysfs file
/// is an error, never a new file.
fn write_value(path: &Path, value: &str) -> Result<()> {
    let err = |source| Error::Write {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(err)?;
    file.write_all(format!("{value}\n").as_bytes()).map_err(err)
}

fn list_dir(path: &Path) -> Result<Vec<String>> {
    let entries = match fs::read_dir(path) {
        Ok(entries) => entries,
        Err(source) if source.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(Error::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| Error::Read {
            path: path.to_path_buf(),
            source,
        })?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    Ok(names)
}

impl Kernel for SysfsKernel {
    /// `<proc_root>/buddyinfo`, `<proc_root>/pagetypeinfo` (root only; its
    /// pageblock counts reused for [`PAGEBLOCK_COUNTS_MAX_AGE`]), each NUMA
    /// node's page cache from `node<N>/meminfo` (`/proc/meminfo` as node 0
    /// on a kernel without NUMA sysfs), and MemAvailable, read one after the
    /// other: they may differ by what moved between.
    fn free_lists(&self) -> Result<FreeLists> {
        let pagetypeinfo = self.pageblock_counts()?;
        self.read_free_lists(Some(pagetypeinfo))
    }

    /// As [`Kernel::free_lists`], without reading `/proc/pagetypeinfo`
    /// (its pageblock counts only when a recent read has them): buddyinfo
    /// prints counters the kernel keeps, 0.02 ms here.
    fn free_blocks(&self) -> Result<FreeLists> {
        self.read_free_lists(self.cached_pageblock_counts())
    }

    fn page_sizes(&self) -> Result<Vec<PageSize>> {
        let mut sizes: Vec<PageSize> = list_dir(&self.hugepages_dir())?
            .iter()
            .filter_map(|name| PageSize::from_sysfs_dir(name))
            .collect();
        sizes.sort();
        Ok(sizes)
    }

    fn numa_nodes(&self) -> Result<Vec<u32>> {
        let mut nodes: Vec<u32> = list_dir(&self.nodes_dir())?
            .iter()
            .filter_map(|name| parse::node_dir(name))
            .collect();
        nodes.sort_unstable();
        Ok(nodes)
    }

    fn pool(&self, size: PageSize) -> Result<PoolCounts> {
        let dir = self.size_dir(size);
        if !dir.is_dir() {
            self.check_size_offered(size)?;
        }
        Ok(PoolCounts {
            total: self.read_count(&dir.join("nr_hugepages"))?,
            free: self.read_count(&dir.join("free_hugepages"))?,
            reserved: self.read_count(&dir.join("resv_hugepages"))?,
            surplus: self.read_count(&dir.join("surplus_hugepages"))?,
        })
    }

    fn numa_pool(&self, size: PageSize, node: u32) -> Result<NumaCounts> {
        let dir = self.node_size_dir(size, node);
        if !dir.is_dir() {
            return Err(Error::NoNumaPool { node, size });
        }
        Ok(NumaCounts {
            node,
            total: self.read_count(&dir.join("nr_hugepages"))?,
            free: self.read_count(&dir.join("free_hugepages"))?,
            surplus: self.read_count(&dir.join("surplus_hugepages"))?,
        })
    }

    fn meminfo(&self) -> Result<MemInfo> {
        let path = self.proc_root.join("meminfo");
        parse::meminfo(&path, &read(&path)?)
    }

    fn hvo(&self) -> Result<Option<bool>> {
        let path = self.hvo_path();
        match fs::read_to_string(&path) {
            Ok(text) => parse::flag(&path, &text).map(Some),
            Err(source) if source.kind() == ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Error::Read { path, source }),
        }
    }

    fn write_pool(&self, size: PageSize, scope: PoolScope, pages: u64) -> Result<()> {
        write_value(&self.pool_file(size, scope), &pages.to_string())
    }

    fn compact(&self, scope: PoolScope) -> Result<()> {
        let path = match scope {
            PoolScope::Global => self.proc_root.join("sys/vm/compact_memory"),
            PoolScope::Node(node) => self.nodes_dir().join(format!("node{node}/compact")),
        };
        write_value(&path, "1")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::fixture::FakeSysfs;

    const MI2: PageSize = PageSize::SIZE_2MI;
    const GI1: PageSize = PageSize::SIZE_1GI;

    #[test]
    fn reads_a_two_node_layout_with_a_size_missing_on_one_node() {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeSysfs::two_nodes_1gi_missing_on_node1(dir.path());
        let kernel = fake.kernel();
        assert_eq!(kernel.page_sizes().unwrap(), vec![MI2, GI1]);
        assert_eq!(kernel.numa_nodes().unwrap(), vec![0, 1]);
        let pool = kernel.pool(MI2).unwrap();
        assert_eq!(
            pool,
            PoolCounts {
                total: 1024,
                free: 900,
                reserved: 20,
                surplus: 4
            }
        );
        assert_eq!(pool.persistent(), 1020);
        assert_eq!(pool.in_use(), 124);
        let nodes = kernel.numa_pools(MI2).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[1].total, 512);
        let gi_nodes = kernel.numa_pools(GI1).unwrap();
        assert_eq!(gi_nodes.iter().map(|n| n.node).collect::<Vec<_>>(), vec![0]);
        assert!(matches!(
            kernel.numa_pool(GI1, 1),
            Err(Error::NoNumaPool { node: 1, .. })
        ));
        let mem = kernel.meminfo().unwrap();
        assert_eq!(mem.available_bytes, 20 << 30);
        assert_eq!(kernel.hvo().unwrap(), Some(true));
    }

    #[test]
    fn writes_go_to_the_global_or_the_node_file() {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeSysfs::two_nodes_1gi_missing_on_node1(dir.path());
        let kernel = fake.kernel();
        kernel.write_pool(MI2, PoolScope::Global, 2048).unwrap();
        kernel.write_pool(MI2, PoolScope::Node(1), 7).unwrap();
        assert_eq!(
            fake.read("sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),
            "2048\n"
        );
        assert_eq!(
            fake.read("sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages"),
            "7\n"
        );
        kernel.compact(PoolScope::Node(0)).unwrap();
        kernel.compact(PoolScope::Global).unwrap();
        assert_eq!(fake.read("sys/devices/system/node/node0/compact"), "1\n");
        assert_eq!(fake.read("proc/sys/vm/compact_memory"), "1\n");
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it_and_never_created() {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeSysfs::two_nodes_1gi_missing_on_node1(dir.path());
        let kernel = fake.kernel();
        let err = kernel.write_pool(GI1, PoolScope::Node(1), 1).unwrap_err();
        assert!(
            err.to_string()
                .contains("node1/hugepages/hugepages-1048576kB"),
            "{err}"
        );
        assert!(!fake.exists("sys/devices/system/node/node1/hugepages/hugepages-1048576kB"));
        let err = kernel.pool("64Ki".parse().unwrap()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the kernel does not offer 64Ki huge pages (offered: 2Mi, 1Gi)"
        );
    }

    #[test]
    fn kernel_without_numa_or_hvo() {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeSysfs::single_size_no_numa(dir.path());
        let kernel = fake.kernel();
        assert!(kernel.numa_nodes().unwrap().is_empty());
        assert!(kernel.numa_pools(MI2).unwrap().is_empty());
        assert_eq!(kernel.hvo().unwrap(), None);
    }

    #[test]
    fn garbage_in_a_counter_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeSysfs::two_nodes_1gi_missing_on_node1(dir.path());
        fake.write(
            "sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages",
            "lots\n",
        );
        let err = fake.kernel().pool(MI2).unwrap_err();
        assert!(err.to_string().contains("free_hugepages"), "{err}");
    }
}
