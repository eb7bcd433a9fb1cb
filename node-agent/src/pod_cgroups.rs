//! The huge pages this node's pods request, read from the node itself.
//!
//! The kubelet sets the hugetlb limit of every pod cgroup, for every page
//! size, to what the pod requests (`hugepages-<size>`, init containers and
//! overhead counted as the scheduler counts them; 0 when it asks for none).
//! The sum over the pod cgroups below `kubepods` is therefore what the
//! node's pods request, known without reading a single pod from the API
//! (docs/design.md, "Stranded pages").
//!
//! Layouts read, below the cgroup file system's root (`/sys/fs/cgroup`):
//!
//! | cgroup | hierarchy | limit file |
//! |---|---|---|
//! | v1 | `hugetlb/` | `hugetlb.<2MB>.limit_in_bytes` |
//! | v2 | the root itself | `hugetlb.<2MB>.max` (`max`: none) |
//!
//! with the kubelet's cgroupfs driver (`kubepods/pod<uid>`,
//! `kubepods/burstable/pod<uid>`, `kubepods/besteffort/pod<uid>`) or its
//! systemd driver (`kubepods.slice/kubepods-pod<uid>.slice`,
//! `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice`,
//! and besteffort alike). Where no hugetlb controller holds `kubepods`, the
//! kubelet limits nothing and nothing is known: [`PodCgroups::requested`]
//! says so rather than reporting 0.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use hugepool_crds::PageSize;

/// The pod cgroups below one cgroup file system root.
#[derive(Clone, Debug)]
pub struct PodCgroups {
    root: PathBuf,
}

/// Where the kubelet's pods are and how their limits are named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `kubepods` or `kubepods.slice` in the hugetlb hierarchy.
    pub kubepods: PathBuf,
    /// cgroup v2 (`hugetlb.<size>.max`) rather than v1
    /// (`hugetlb.<size>.limit_in_bytes`).
    pub v2: bool,
}

/// The QoS classes' cgroups below `kubepods`, by either driver.
const QOS_CGROUPS: [&str; 4] = [
    "burstable",
    "besteffort",
    "kubepods-burstable.slice",
    "kubepods-besteffort.slice",
];

impl PodCgroups {
    /// `root` is where the cgroup file system is mounted (a container
    /// mounts the host's `/sys/fs/cgroup` there).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// Where the hugetlb controller holds the kubelet's pods, if it does.
    pub fn layout(&self) -> Option<Layout> {
        for (hierarchy, v2) in [
            (self.root.join("hugetlb"), false),
            (self.root.clone(), true),
        ] {
            for name in ["kubepods", "kubepods.slice"] {
                let kubepods = hierarchy.join(name);
                if has_hugetlb_files(&kubepods, v2) {
                    return Some(Layout { kubepods, v2 });
                }
            }
        }
        None
    }

    /// Pages per size that the node's pods request (sizes no pod asks for
    /// are absent); `None` when no hugetlb controller holds the kubelet's
    /// pods, so their requests cannot be known here.
    pub fn requested(&self) -> io::Result<Option<BTreeMap<PageSize, u64>>> {
        let Some(layout) = self.layout() else {
            return Ok(None);
        };
        let mut total: BTreeMap<PageSize, u64> = BTreeMap::new();
        for pod in pod_dirs(&layout.kubepods)? {
            for (size, pages) in pod_limits(&pod, layout.v2)? {
                if pages > 0 {
                    let sum = total.entry(size).or_default();
                    *sum = sum.saturating_add(pages);
                }
            }
        }
        Ok(Some(total))
    }
}

/// Whether `dir` is a cgroup with hugetlb limit files of the version.
fn has_hugetlb_files(dir: &Path, v2: bool) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries
        .flatten()
        .any(|e| limit_file_size(&e.file_name().to_string_lossy(), v2).is_some())
}

/// Whether a cgroup's name is a pod's: `pod<uid>` (cgroupfs) or
/// `kubepods[-<qos>]-pod<uid>.slice` (systemd).
fn is_pod_cgroup(name: &str) -> bool {
    if name.starts_with("pod") {
        return true;
    }
    let Some(unit) = name
        .strip_prefix("kubepods-")
        .and_then(|n| n.strip_suffix(".slice"))
    else {
        return false;
    };
    let unit = unit
        .strip_prefix("burstable-")
        .or_else(|| unit.strip_prefix("besteffort-"))
        .unwrap_or(unit);
    unit.starts_with("pod")
}

/// The pod cgroups below `kubepods`: right below it (Guaranteed) and below
/// each QoS class's cgroup.
fn pod_dirs(kubepods: &Path) -> io::Result<Vec<PathBuf>> {
    let mut pods = Vec::new();
    let mut scan = |dir: &Path, top: bool| -> io::Result<()> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            // A QoS cgroup may not exist yet.
            Err(err) if err.kind() == io::ErrorKind::NotFound && !top => return Ok(()),
            Err(err) => return Err(err),
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.file_type().is_ok_and(|t| t.is_dir()) && is_pod_cgroup(&name) {
                pods.push(entry.path());
            }
        }
        Ok(())
    };
    scan(kubepods, true)?;
    for qos in QOS_CGROUPS {
        scan(&kubepods.join(qos), false)?;
    }
    Ok(pods)
}

/// The size a limit file is for: `hugetlb.2MB.limit_in_bytes` (v1) or
/// `hugetlb.2MB.max` (v2), sizes as the kernel names them (KB, MB, GB).
fn limit_file_size(name: &str, v2: bool) -> Option<PageSize> {
    let suffix = if v2 { ".max" } else { ".limit_in_bytes" };
    let size = name.strip_prefix("hugetlb.")?.strip_suffix(suffix)?;
    // `hugetlb.2MB.rsvd.max` and the like are not the fault limit.
    let (number, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
    let shift = match unit {
        "KB" => 10,
        "MB" => 20,
        "GB" => 30,
        _ => return None,
    };
    PageSize::from_bytes(number.parse::<u64>().ok()?.checked_shl(shift)?)
}

/// A pod's limit per size, in pages; a size the kubelet left unlimited
/// (`max`, or v1's page counter maximum) counts as no request. A pod that
/// went while it was read counts as nothing.
fn pod_limits(pod: &Path, v2: bool) -> io::Result<Vec<(PageSize, u64)>> {
    let entries = match std::fs::read_dir(pod) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(err),
    };
    let mut limits = Vec::new();
    for entry in entries.flatten() {
        let Some(size) = limit_file_size(&entry.file_name().to_string_lossy(), v2) else {
            continue;
        };
        let text = match std::fs::read_to_string(entry.path()) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        };
        let text = text.trim();
        if text == "max" {
            continue;
        }
        let bytes: u64 = text.parse().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: not a number of bytes: {text:?}",
                    entry.path().display()
                ),
            )
        })?;
        // v1 shows "no limit" as the page counter's maximum (about 2^63).
        if bytes >= 1 << 62 {
            continue;
        }
        limits.push((size, bytes / size.bytes()));
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI2: PageSize = PageSize::SIZE_2MI;
    const GI1: PageSize = PageSize::SIZE_1GI;

    /// Writes `files` (path below root, content) into a new tree.
    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, content) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, content).expect("write");
        }
        dir
    }

    #[test]
    fn cgroup_v1_with_the_cgroupfs_driver_sums_every_qos_class() {
        let root = tree(&[
            ("hugetlb/kubepods/hugetlb.2MB.limit_in_bytes", "201326592"),
            ("hugetlb/kubepods/hugetlb.1GB.limit_in_bytes", "2147483648"),
            // Guaranteed: 80 x 2Mi and one 1Gi page.
            (
                "hugetlb/kubepods/pod1/hugetlb.2MB.limit_in_bytes",
                "167772160",
            ),
            (
                "hugetlb/kubepods/pod1/hugetlb.2MB.rsvd.limit_in_bytes",
                "167772160",
            ),
            (
                "hugetlb/kubepods/pod1/hugetlb.1GB.limit_in_bytes",
                "1073741824",
            ),
            // Its container's limit is the same pages, not more of them.
            (
                "hugetlb/kubepods/pod1/abc/hugetlb.2MB.limit_in_bytes",
                "167772160",
            ),
            // Burstable, 4 pages; besteffort, none.
            (
                "hugetlb/kubepods/burstable/pod2/hugetlb.2MB.limit_in_bytes",
                "8388608",
            ),
            (
                "hugetlb/kubepods/besteffort/pod3/hugetlb.2MB.limit_in_bytes",
                "0",
            ),
        ]);
        let cgroups = PodCgroups::new(root.path());
        assert_eq!(
            cgroups.layout(),
            Some(Layout {
                kubepods: root.path().join("hugetlb/kubepods"),
                v2: false
            })
        );
        assert_eq!(
            cgroups.requested().expect("read"),
            Some(BTreeMap::from([(MI2, 84), (GI1, 1)]))
        );
    }

    #[test]
    fn cgroup_v2_with_the_systemd_driver_reads_max_files() {
        let root = tree(&[
            ("cgroup.controllers", "cpuset cpu io memory hugetlb pids"),
            ("kubepods.slice/hugetlb.2MB.max", "max"),
            (
                "kubepods.slice/kubepods-podaa_bb.slice/hugetlb.2MB.max",
                "33554432",
            ),
            (
                "kubepods.slice/kubepods-podaa_bb.slice/hugetlb.2MB.rsvd.max",
                "33554432",
            ),
            (
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podcc.slice/hugetlb.2MB.max",
                "4194304",
            ),
            // Unlimited: no kubelet set it, so it asks for nothing known.
            (
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-poddd.slice/hugetlb.2MB.max",
                "max",
            ),
            // Not a pod: the QoS slice's own limit is not counted.
            (
                "kubepods.slice/kubepods-burstable.slice/hugetlb.2MB.max",
                "max",
            ),
        ]);
        let cgroups = PodCgroups::new(root.path());
        assert_eq!(cgroups.layout().map(|l| l.v2), Some(true));
        assert_eq!(
            cgroups.requested().expect("read"),
            Some(BTreeMap::from([(MI2, 18)]))
        );
    }

    #[test]
    fn v1_unlimited_and_absent_sizes_count_as_no_request() {
        let root = tree(&[
            (
                "hugetlb/kubepods/hugetlb.2MB.limit_in_bytes",
                "9223372036854771712",
            ),
            (
                "hugetlb/kubepods/pod1/hugetlb.2MB.limit_in_bytes",
                "9223372036854771712",
            ),
            ("hugetlb/kubepods/pod2/hugetlb.2MB.limit_in_bytes", "0"),
        ]);
        assert_eq!(
            PodCgroups::new(root.path()).requested().expect("read"),
            Some(BTreeMap::new())
        );
    }

    #[test]
    fn without_a_hugetlb_controller_nothing_is_known() {
        // This machine's cgroup v1 without hugetlb: pods' cgroups exist in
        // other hierarchies only.
        let v1 = tree(&[
            ("memory/kubepods/pod1/memory.limit_in_bytes", "67108864"),
            ("unified/cgroup.controllers", ""),
        ]);
        assert_eq!(PodCgroups::new(v1.path()).requested().expect("read"), None);
        // cgroup v2 where hugetlb is not enabled for kubepods.
        let v2 = tree(&[
            ("cgroup.controllers", "cpu memory pids"),
            ("kubepods.slice/memory.max", "max"),
        ]);
        assert_eq!(PodCgroups::new(v2.path()).requested().expect("read"), None);
        // No cgroup file system at all.
        assert_eq!(
            PodCgroups::new("/nonexistent/hugepool")
                .requested()
                .expect("read"),
            None
        );
    }

    #[test]
    fn a_garbled_limit_is_an_error_that_names_its_file() {
        let root = tree(&[
            ("hugetlb/kubepods/hugetlb.2MB.limit_in_bytes", "0"),
            ("hugetlb/kubepods/pod1/hugetlb.2MB.limit_in_bytes", "lots"),
        ]);
        let err = PodCgroups::new(root.path())
            .requested()
            .expect_err("garbled");
        assert!(
            err.to_string().contains("pod1/hugetlb.2MB.limit_in_bytes"),
            "{err}"
        );
    }

    #[test]
    fn size_names_are_the_kernels() {
        assert_eq!(
            limit_file_size("hugetlb.2MB.limit_in_bytes", false),
            Some(MI2)
        );
        assert_eq!(limit_file_size("hugetlb.1GB.max", true), Some(GI1));
        assert_eq!(
            limit_file_size("hugetlb.64KB.max", true),
            PageSize::from_bytes(64 << 10)
        );
        assert_eq!(limit_file_size("hugetlb.2MB.rsvd.max", true), None);
        assert_eq!(limit_file_size("hugetlb.2MB.max", false), None);
        assert_eq!(limit_file_size("hugetlb.2MB.usage_in_bytes", false), None);
        assert!(is_pod_cgroup("pod0f1e"));
        assert!(is_pod_cgroup("kubepods-burstable-pod0f1e.slice"));
        assert!(!is_pod_cgroup("kubepods-burstable.slice"));
        assert!(!is_pod_cgroup("burstable"));
    }
}
