//! Fake sysfs/procfs trees with the layouts real machines have, for tests of
//! [`SysfsKernel`] and of the command line.

use std::fs;
use std::path::{Path, PathBuf};

use hugepool_crds::PageSize;

use crate::kernel::SysfsKernel;

/// A tree under `root`: `root/sys/...` and `root/proc/...`.
#[derive(Clone, Debug)]
pub struct FakeSysfs {
    root: PathBuf,
}

/// Counts written into one fake pool directory.
#[derive(Clone, Copy, Debug, Default)]
pub struct FakePool {
    pub total: u64,
    pub free: u64,
    pub reserved: u64,
    pub surplus: u64,
}

impl FakeSysfs {
    /// An empty tree with meminfo, compaction files and optionally HVO.
    pub fn empty(root: &Path, mem_available: u64, hvo: Option<bool>) -> Self {
        let fake = Self {
            root: root.to_path_buf(),
        };
        fake.write(
            "proc/meminfo",
            &format!(
                "MemTotal:       {} kB\nMemFree:        {} kB\nMemAvailable:   {} kB\nHugePages_Total:       0\n",
                24 << 20,
                mem_available / 1024,
                mem_available / 1024
            ),
        );
        fake.write("proc/sys/vm/compact_memory", "");
        if let Some(on) = hvo {
            fake.write(
                "proc/sys/vm/hugetlb_optimize_vmemmap",
                if on { "1\n" } else { "0\n" },
            );
        }
        fake
    }

    /// Two NUMA nodes, 2Mi on both and 1Gi only on node0, HVO on, 20 GiB
    /// available. 2Mi: 1024 total, 900 free, 20 reserved, 4 surplus.
    pub fn two_nodes_1gi_missing_on_node1(root: &Path) -> Self {
        let fake = Self::empty(root, 20 << 30, Some(true));
        let two = FakePool {
            total: 1024,
            free: 900,
            reserved: 20,
            surplus: 4,
        };
        fake.add_global(PageSize::SIZE_2MI, two);
        fake.add_global(PageSize::SIZE_1GI, FakePool::default());
        let half = FakePool {
            total: 512,
            free: 450,
            reserved: 0,
            surplus: 2,
        };
        fake.add_node(0, PageSize::SIZE_2MI, half);
        fake.add_node(1, PageSize::SIZE_2MI, half);
        fake.add_node(0, PageSize::SIZE_1GI, FakePool::default());
        fake
    }

    /// One size (2Mi), no NUMA directory, no HVO sysctl: an old or small kernel.
    pub fn single_size_no_numa(root: &Path) -> Self {
        let fake = Self::empty(root, 8 << 30, None);
        fake.add_global(PageSize::SIZE_2MI, FakePool::default());
        fake
    }

    pub fn add_global(&self, size: PageSize, pool: FakePool) {
        let dir = format!("sys/kernel/mm/hugepages/{}", size.sysfs_dir());
        self.write(&format!("{dir}/nr_hugepages"), &format!("{}\n", pool.total));
        self.write(
            &format!("{dir}/free_hugepages"),
            &format!("{}\n", pool.free),
        );
        self.write(
            &format!("{dir}/resv_hugepages"),
            &format!("{}\n", pool.reserved),
        );
        self.write(
            &format!("{dir}/surplus_hugepages"),
            &format!("{}\n", pool.surplus),
        );
        self.write(&format!("{dir}/nr_overcommit_hugepages"), "0\n");
    }

    pub fn add_node(&self, node: u32, size: PageSize, pool: FakePool) {
        let dir = format!(
            "sys/devices/system/node/node{node}/hugepages/{}",
            size.sysfs_dir()
        );
        self.write(&format!("{dir}/nr_hugepages"), &format!("{}\n", pool.total));
        self.write(
            &format!("{dir}/free_hugepages"),
            &format!("{}\n", pool.free),
        );
        self.write(
            &format!("{dir}/surplus_hugepages"),
            &format!("{}\n", pool.surplus),
        );
        self.write(&format!("sys/devices/system/node/node{node}/compact"), "");
        self.write("sys/devices/system/node/online", "0\n");
    }

    pub fn kernel(&self) -> SysfsKernel {
        SysfsKernel::new(self.sys_root(), self.proc_root())
    }

    pub fn sys_root(&self) -> PathBuf {
        self.root.join("sys")
    }

    pub fn proc_root(&self) -> PathBuf {
        self.root.join("proc")
    }

    /// Writes a file under the root, creating directories. Panics on I/O
    /// failure: this is test scaffolding.
    pub fn write(&self, relative: &str, content: &str) {
        let path = self.root.join(relative);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("create fake sysfs directory");
        }
        fs::write(&path, content).expect("write fake sysfs file");
    }

    pub fn read(&self, relative: &str) -> String {
        fs::read_to_string(self.root.join(relative)).expect("read fake sysfs file")
    }

    pub fn exists(&self, relative: &str) -> bool {
        self.root.join(relative).exists()
    }
}
