//! The resize engine against the real kernel of this machine (root, writable
//! hugetlb sysctls). Every test takes one global lock, so they never run
//! concurrently, and a guard restores every size's `nr_hugepages` and
//! `hugetlb_optimize_vmemmap` afterwards, also on panic. Tests keep at least
//! 4 GiB of MemAvailable. Without access they skip with a reason, except
//! under `CI=true`, where they fail. The guard and helpers are in `support`.

mod support;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hugepool_agent::kernel::freelists::FreeLists;
use hugepool_agent::kernel::{Kernel, MemInfo, NumaCounts, PoolCounts, PoolScope, SysfsKernel};
use hugepool_agent::resize::{
    self, CostModels, Event, Options, Outcome, Settings, ShortfallReason, Summary, Target,
};
use hugepool_crds::PageSize;
use support::{GIB, Helper, Hold, MI2, RealKernel, Sampler};
use tokio::sync::watch;

fn target(size: PageSize, pages: u64, scope: PoolScope) -> Target {
    Target { size, pages, scope }
}

async fn run_engine(
    kernel: Arc<dyn Kernel>,
    wanted: Target,
    settings: Settings,
    options: Options,
    mut on_event: impl FnMut(&Event) + Send,
) -> (Summary, Vec<Event>) {
    let (_tx, mut rx) = watch::channel(resize::Goal {
        target: wanted,
        settings,
    });
    let mut events = Vec::new();
    let summary = resize::run(
        kernel,
        &mut rx,
        &options,
        &mut CostModels::default(),
        |event| {
            on_event(event);
            events.push(event.clone());
        },
    )
    .await
    .expect("resize");
    (summary, events)
}

fn quick() -> Settings {
    Settings {
        step_pause: Duration::from_millis(1),
        ..Settings::default()
    }
}

#[tokio::test]
async fn grows_and_shrinks_exactly_with_hvo_off_and_on() {
    let Some(real) = RealKernel::acquire(8 * GIB) else {
        return;
    };
    for hvo in [false, true] {
        real.set_hvo(hvo);
        for wanted in [3000, 0] {
            let (summary, _) = run_engine(
                real.shared(),
                target(MI2, wanted, PoolScope::Global),
                quick(),
                Options::default(),
                |_| {},
            )
            .await;
            assert!(summary.reached(), "hvo={hvo}: {summary:?}");
            assert_eq!(summary.hvo, Some(hvo));
            let pool = real.pool();
            assert_eq!(
                (pool.total, pool.free, pool.surplus),
                (wanted, wanted, 0),
                "hvo={hvo}"
            );
            assert!(summary.steps > 1, "one write is what the engine avoids");
        }
    }
}

#[tokio::test]
async fn a_few_1gi_pages_grow_and_shrink() {
    let Some(real) = RealKernel::acquire(4 * GIB) else {
        return;
    };
    let gi = PageSize::SIZE_1GI;
    if let Err(err) = real.kernel.check_size_offered(gi) {
        // This machine's kernel offers them (docs/kernel.md): under CI a
        // kernel without them is a machine that cannot run this test.
        assert!(
            !hugepool_e2e::in_ci_mode(),
            "the kernel offers no 1Gi pages under CI=true: {err}"
        );
        eprintln!("skipping: the kernel offers no 1Gi pages: {err}");
        return;
    }
    // Whether a free, 1 GiB-aligned range without unmovable pages exists
    // depends on the machine's history (docs/kernel.md: after hours of
    // builds this VM had none with 23.9 GiB free, dropped caches and
    // compaction; fresh it had 8). So: either the engine reaches two pages
    // exactly, or it compacts, retries, reports exactly what it got as a
    // shortfall, and what the naive way (one write after a compaction) gets
    // beyond it, the engine gets too. Either way the shrink to 0 is exact.
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches");
    real.kernel
        .compact(PoolScope::Global)
        .expect("compact memory");
    let (summary, _) = run_engine(
        real.shared(),
        target(gi, 2, PoolScope::Global),
        quick(),
        Options::default(),
        |_| {},
    )
    .await;
    let pool = real.kernel.pool(gi).expect("read 1Gi pool");
    assert_eq!(pool.surplus, 0);
    match summary.outcome {
        Outcome::Reached => assert_eq!(pool.persistent(), 2),
        Outcome::Shortfall {
            requested: 2,
            achieved,
            reason: ShortfallReason::Fragmented | ShortfallReason::InsufficientMemory,
            ref detail,
        } => {
            eprintln!("only {achieved} x 1Gi could be allocated now: {summary:?}");
            assert_eq!(pool.persistent(), achieved);
            // The free lists never hold a 1Gi page: the engine compacts
            // before the first write. Their estimate for 1Gi is the worst
            // layout, a floor, so nothing is concluded from it: a short
            // write is compacted and retried, round after round.
            assert_eq!(detail, &None, "{summary:?}");
            assert_eq!(summary.compactions, 1 + quick().retries, "{summary:?}");
            real.kernel
                .compact(PoolScope::Global)
                .expect("compact memory");
            real.kernel
                .write_pool(gi, PoolScope::Global, 2)
                .expect("write nr_hugepages");
            let direct = real.kernel.pool(gi).expect("read 1Gi pool").persistent();
            if direct > achieved {
                // Memory moved since the engine's rounds (a process freed
                // a range). The pages one write got, freed and asked for
                // again at once, the engine takes too: no compaction in
                // between to fill the freed gigabytes.
                eprintln!("one write then got {direct} x 1Gi; the engine asks again");
                real.kernel
                    .write_pool(gi, PoolScope::Global, achieved)
                    .expect("write nr_hugepages");
                let (again, _) = run_engine(
                    real.shared(),
                    target(gi, direct, PoolScope::Global),
                    Settings {
                        compact: false,
                        ..quick()
                    },
                    Options::default(),
                    |_| {},
                )
                .await;
                assert!(
                    again.reached(),
                    "one write got {direct} x 1Gi, the engine asked again got {again:?}"
                );
            }
        }
        other => panic!("unexpected outcome {other:?}"),
    }
    let (summary, _) = run_engine(
        real.shared(),
        target(gi, 0, PoolScope::Global),
        quick(),
        Options::default(),
        |_| {},
    )
    .await;
    assert!(summary.reached(), "{summary:?}");
    assert_eq!(
        real.kernel.pool(gi).expect("read 1Gi pool"),
        PoolCounts::default()
    );
}

/// Delegates to the real kernel and records where writes went.
struct Recording {
    inner: SysfsKernel,
    writes: Mutex<Vec<PoolScope>>,
    compactions: Mutex<Vec<PoolScope>>,
}

impl Kernel for Recording {
    fn page_sizes(&self) -> hugepool_agent::Result<Vec<PageSize>> {
        self.inner.page_sizes()
    }
    fn numa_nodes(&self) -> hugepool_agent::Result<Vec<u32>> {
        self.inner.numa_nodes()
    }
    fn pool(&self, size: PageSize) -> hugepool_agent::Result<PoolCounts> {
        self.inner.pool(size)
    }
    fn numa_pool(&self, size: PageSize, node: u32) -> hugepool_agent::Result<NumaCounts> {
        self.inner.numa_pool(size, node)
    }
    fn meminfo(&self) -> hugepool_agent::Result<MemInfo> {
        self.inner.meminfo()
    }
    fn hvo(&self) -> hugepool_agent::Result<Option<bool>> {
        self.inner.hvo()
    }
    fn free_lists(&self) -> hugepool_agent::Result<FreeLists> {
        self.inner.free_lists()
    }
    fn free_blocks(&self) -> hugepool_agent::Result<FreeLists> {
        self.inner.free_blocks()
    }
    fn write_pool(
        &self,
        size: PageSize,
        scope: PoolScope,
        pages: u64,
    ) -> hugepool_agent::Result<()> {
        self.writes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(scope);
        self.inner.write_pool(size, scope, pages)
    }
    fn compact(&self, scope: PoolScope) -> hugepool_agent::Result<()> {
        self.compactions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(scope);
        self.inner.compact(scope)
    }
}

#[tokio::test]
async fn numa_target_writes_the_node_file() {
    let Some(real) = RealKernel::acquire(2 * GIB) else {
        return;
    };
    let recording = Arc::new(Recording {
        inner: real.kernel.clone(),
        writes: Mutex::new(Vec::new()),
        compactions: Mutex::new(Vec::new()),
    });
    for wanted in [700, 0] {
        let (summary, _) = run_engine(
            recording.clone(),
            target(MI2, wanted, PoolScope::Node(0)),
            quick(),
            Options::default(),
            |_| {},
        )
        .await;
        assert!(summary.reached(), "{summary:?}");
        assert_eq!(summary.scope, "node0");
        let node = real.kernel.numa_pool(MI2, 0).expect("node0 pool");
        assert_eq!((node.total, node.surplus), (wanted, 0));
    }
    let writes = recording
        .writes
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    assert!(!writes.is_empty());
    assert!(
        writes.iter().all(|scope| *scope == PoolScope::Node(0)),
        "{writes:?}"
    );
}

#[tokio::test]
async fn shrink_below_pages_in_use_blocks_without_surplus_then_completes_when_released() {
    let Some(real) = RealKernel::acquire(2 * GIB) else {
        return;
    };
    real.set_pool(MI2, 600);
    // 300 pages mapped, 200 of them faulted in: 200 in use, 100 reserved.
    let holder = Helper::start(Hold::HugePages {
        pages: 300,
        touched: 200,
    });
    let pool = real.pool();
    assert_eq!((pool.in_use(), pool.reserved), (200, 100));
    let surplus = Sampler::start(|| SysfsKernel::default().pool(MI2).ok().map(|p| p.surplus));

    let (summary, _) = run_engine(
        real.shared(),
        target(MI2, 100, PoolScope::Global),
        quick(),
        Options::default(),
        |_| {},
    )
    .await;
    assert_eq!(
        summary.outcome,
        Outcome::Blocked {
            target: 100,
            current: 300,
            in_use: 200,
            reserved: 100,
            surplus: 0,
            floor: 300,
            claimed: 0,
        }
    );
    assert_eq!(real.pool().total, 300);

    // The command line says the same, with exit code 2.
    let output = Command::new(env!("CARGO_BIN_EXE_hugepool-agent"))
        .args([
            "resize",
            "--page-size",
            "2Mi",
            "--pages",
            "100",
            "--output",
            "json",
        ])
        .output()
        .expect("run hugepool-agent");
    assert_eq!(output.status.code(), Some(2));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON summary");
    assert_eq!(report["outcome"]["kind"], "blocked");
    assert_eq!(report["outcome"]["inUse"], 200);
    assert_eq!(report["outcome"]["reserved"], 100);

    // Waiting: once the holder exits, the shrink finishes by itself.
    let mut holder = Some(holder);
    let options = Options {
        blocked_wait: Duration::from_secs(60),
        blocked_poll: Duration::from_millis(20),
    };
    let (summary, events) = run_engine(
        real.shared(),
        target(MI2, 100, PoolScope::Global),
        quick(),
        options,
        |event| {
            if matches!(event, Event::Blocked(_)) {
                holder.take();
            }
        },
    )
    .await;
    assert!(summary.reached(), "{summary:?}");
    assert!(events.iter().any(|e| matches!(e, Event::Blocked(_))));
    let pool = real.pool();
    assert_eq!((pool.total, pool.free, pool.surplus), (100, 100, 0));
    let surplus = surplus.finish();
    assert!(surplus.len() > 10);
    assert_eq!(surplus.iter().max(), Some(&0), "surplus appeared");
}

#[tokio::test]
async fn growth_under_a_memory_hog_stops_at_the_guard() {
    let Some(real) = RealKernel::acquire(8 * GIB) else {
        return;
    };
    let guard = 6 * GIB;
    // MemAvailable counts page cache a hugetlb allocation may not reclaim in
    // time (builds on the same machine refill it); without it the guard is
    // the limit that binds, which is what this test is about.
    std::fs::write("/proc/sys/vm/drop_caches", "1").expect("drop the page cache");
    real.kernel
        .compact(PoolScope::Global)
        .expect("compact memory");
    let available = real.kernel.meminfo().expect("meminfo").available_bytes;
    // Leave room for about 2 GiB of pages above the guard, then ask for
    // 2 GiB more than what is left once the hog holds its memory.
    let hog_bytes = available - guard - 2 * GIB;
    let _hog = Helper::start(Hold::Anonymous {
        bytes: hog_bytes as usize,
    });
    let room = real
        .kernel
        .meminfo()
        .expect("meminfo")
        .available_bytes
        .saturating_sub(guard);
    let wanted = room / (2 << 20) + 1024;
    let mem = Sampler::start(|| {
        SysfsKernel::default()
            .meminfo()
            .ok()
            .map(|m| m.available_bytes)
    });
    let settings = Settings {
        min_mem_available: guard,
        ..quick()
    };
    let (summary, _) = run_engine(
        real.shared(),
        target(MI2, wanted, PoolScope::Global),
        settings,
        Options::default(),
        |_| {},
    )
    .await;
    let samples = mem.finish();
    eprintln!("memory hog: {summary:?}");
    let lowest = samples.iter().copied().min().unwrap_or(0);
    assert!(
        lowest >= guard,
        "MemAvailable fell to {} MiB, below the {} MiB guard",
        lowest >> 20,
        guard >> 20
    );
    let Outcome::Shortfall {
        requested,
        achieved,
        reason,
        ..
    } = summary.outcome.clone()
    else {
        panic!("expected a shortfall: {summary:?}");
    };
    assert_eq!(requested, wanted);
    assert_eq!(reason, ShortfallReason::MemoryGuard, "{summary:?}");
    assert!(achieved > 0 && achieved < wanted, "achieved {achieved}");
    // Stopped because the next step would cross the guard: it took the room
    // there was, less the headroom. Counted in pages, not by what MemAvailable
    // shows afterwards: other processes and the balloon's free page reporting
    // move it by hundreds of MiB in a few milliseconds (a CI run stopped
    // correctly, then read 636 MiB above the guard).
    let taken = achieved * MI2.bytes();
    let slack = 256 << 20;
    let floor = room.saturating_sub(hugepool_agent::resize::planner::guard_headroom(guard) + slack);
    assert!(
        taken >= floor,
        "took {} MiB of the {} MiB above the guard",
        taken >> 20,
        room >> 20
    );
    assert_eq!(real.pool().persistent(), achieved);
}

#[test]
fn killed_mid_resize_then_restarted_reaches_the_target() {
    let Some(real) = RealKernel::acquire(8 * GIB) else {
        return;
    };
    real.set_hvo(true);
    real.set_pool(MI2, 8192);
    let agent = env!("CARGO_BIN_EXE_hugepool-agent");
    let mut child = Command::new(agent)
        .args([
            "resize",
            "--page-size",
            "2Mi",
            "--pages",
            "0",
            "--step-pause",
            "100ms",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start hugepool-agent");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = real.pool().persistent();
        if now < 8192 - 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no progress before the deadline");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().expect("SIGKILL the agent");
    child.wait().expect("reap the agent");
    let mut progress = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut progress);
    }
    let interrupted = real.pool();
    assert!(
        interrupted.persistent() > 0 && interrupted.persistent() < 8192,
        "not mid-resize: {interrupted:?}\n{progress}"
    );
    assert_eq!(interrupted.surplus, 0);

    let output = Command::new(agent)
        .args([
            "resize",
            "--page-size",
            "2Mi",
            "--pages",
            "0",
            "--output",
            "json",
        ])
        .output()
        .expect("restart hugepool-agent");
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON summary");
    assert_eq!(report["from"], interrupted.persistent());
    assert_eq!(report["achieved"], 0);
    assert_eq!(report["outcome"]["kind"], "reached");
    assert_eq!(real.pool(), PoolCounts::default());
}

#[test]
fn the_kernel_log_device_yields_records_the_parser_reads() {
    let path = std::path::Path::new("/dev/kmsg");
    if let Err(err) = std::fs::File::open(path) {
        let reason = format!("cannot open /dev/kmsg: {err}");
        assert!(!hugepool_e2e::in_ci_mode(), "{reason}");
        eprintln!("skipping: {reason}");
        return;
    }
    // The ring buffer holds at least the boot messages; read a few from the
    // start (the read would block only after the last one).
    let mut headers = Vec::new();
    hugepool_agent::kernel::kmsg::read_lines(path, false, |line| {
        if let Some((header, message)) = hugepool_agent::kernel::kmsg::split_record(line) {
            assert!(!message.is_empty() || header.sequence > 0, "{line:?}");
            headers.push(header);
        }
        headers.len() < 5
    })
    .expect("read /dev/kmsg");
    assert_eq!(headers.len(), 5);
    assert!(headers.windows(2).all(|w| w[0].sequence < w[1].sequence));
}

/// The kernel's own records (facility 0) count; the same text written from
/// user space into /dev/kmsg (which the kernel stores with the user
/// facility) does not, so no process can fake a kernel stall.
#[test]
fn a_real_kernel_record_counts_and_a_user_space_imitation_does_not() {
    use hugepool_agent::kernel::kmsg::{from_kernel, parse_record, split_record};
    let path = std::path::Path::new("/dev/kmsg");
    let writable = std::fs::OpenOptions::new().write(true).open(path).is_ok()
        && std::fs::OpenOptions::new()
            .write(true)
            .open("/proc/sys/vm/drop_caches")
            .is_ok();
    if !writable {
        let reason = "cannot write /dev/kmsg and /proc/sys/vm/drop_caches (run as root)";
        assert!(!hugepool_e2e::in_ci_mode(), "{reason}");
        eprintln!("skipping: {reason}");
        return;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let imitation = format!("watchdog: BUG: soft lockup - CPU#0 stuck for 23s! [imitation:{tid}]");
    std::fs::write(path, format!("<4>{imitation}\n")).expect("write /dev/kmsg");
    // The kernel logs "<comm> (<tid>): drop_caches: <value>" itself, at
    // facility 0. The value is the sysctl's as the kernel reads it when it
    // logs, which another test writing it at the same moment can change, so
    // only this thread's id identifies the record.
    std::fs::write("/proc/sys/vm/drop_caches", "1").expect("write drop_caches");
    let kernel_text = format!("({tid}): drop_caches: ");
    let (mut kernel, mut user) = (None, None);
    hugepool_agent::kernel::kmsg::read_lines(path, false, |line| {
        if let Some((header, message)) = split_record(line) {
            if message.contains(&kernel_text) {
                kernel = Some(header.priority);
            } else if message == imitation {
                user = Some((header.priority, parse_record(line)));
            }
        }
        kernel.is_none() || user.is_none()
    })
    .expect("read /dev/kmsg");
    let kernel = kernel.expect("the kernel's drop_caches record");
    assert!(
        from_kernel(kernel),
        "drop_caches logged at priority {kernel}"
    );
    let (priority, parsed) = user.expect("the imitation");
    assert_eq!(priority, 12, "user facility (1 << 3), level 4");
    assert_eq!(
        parsed, None,
        "a user-space lockup line is not a kernel stall"
    );
    // The same text as a kernel record would be one.
    assert!(parse_record(&format!("4,1,1,-;{imitation}")).is_some());
}

/// The simulated kernel's pool semantics, checked against the real one on
/// the same sequence: pages in use and reserved, a write below them, their
/// release, and growth promoting surplus.
#[test]
fn simulated_kernel_matches_the_real_kernel_on_pages_in_use() {
    use hugepool_agent::kernel::{SimConfig, SimulatedKernel};
    let Some(real) = RealKernel::acquire(2 * GIB) else {
        return;
    };
    let sim = SimulatedKernel::new(SimConfig {
        time_scale: 0.0,
        ..SimConfig::single_node(16 * GIB)
    });
    let counts = |kernel: &dyn Kernel| kernel.pool(MI2).expect("read pool");
    let both = |pages: u64| {
        real.kernel
            .write_pool(MI2, PoolScope::Global, pages)
            .expect("write real pool");
        sim.write_pool(MI2, PoolScope::Global, pages)
            .expect("write simulated pool");
    };
    both(100);
    // 80 pages mapped, 60 faulted in: 60 in use, 20 reserved.
    let holder = Helper::start(Hold::HugePages {
        pages: 80,
        touched: 60,
    });
    sim.hold_pages(MI2, 0, 60).expect("hold");
    sim.reserve_pages(MI2, 20).expect("reserve");
    let mut steps = vec![("held", counts(&real.kernel), counts(&sim))];
    both(10);
    steps.push(("written below", counts(&real.kernel), counts(&sim)));
    both(70);
    steps.push(("grown into surplus", counts(&real.kernel), counts(&sim)));
    both(10);
    drop(holder);
    sim.release_pages(MI2, 0, 60).expect("release");
    sim.unreserve_pages(MI2, 20).expect("unreserve");
    steps.push(("released", counts(&real.kernel), counts(&sim)));
    both(0);
    steps.push(("emptied", counts(&real.kernel), counts(&sim)));
    for (step, real_counts, sim_counts) in &steps {
        eprintln!(
            "{step:>20}: real {real_counts:?}\n{:>20}  sim  {sim_counts:?}",
            ""
        );
    }
    for (step, real_counts, sim_counts) in steps {
        assert_eq!(real_counts, sim_counts, "after {step}");
    }
}

/// The agent's reader of pod cgroups (what the node's pods request) on this
/// kernel's own cgroup2 hierarchy with the hugetlb controller: mounted in a
/// mount namespace of the test's thread, hugetlb freed from a v1 hierarchy
/// a test node left. The kernel's file names and values (`hugetlb.2MB.max`,
/// `max`, bytes rounded to pages), not a fixture's.
#[test]
fn pod_cgroups_are_read_from_a_real_cgroup2_hierarchy() {
    let Some(real) = RealKernel::acquire(GIB) else {
        return;
    };
    let requested = std::thread::spawn(read_pod_cgroups_on_cgroup2)
        .join()
        .expect("the cgroup2 thread");
    let requested = requested.unwrap_or_else(|why| panic!("{why}"));
    // Pod a asks 4 x 2Mi (burstable), pod b 1 x 1Gi and no 2Mi (max), pod
    // c nothing (0).
    let want: std::collections::BTreeMap<PageSize, u64> =
        if std::path::Path::new("/sys/kernel/mm/hugepages/hugepages-1048576kB").exists() {
            [(MI2, 4), (PageSize::SIZE_1GI, 1)].into()
        } else {
            [(MI2, 4)].into()
        };
    assert_eq!(requested, want);
    drop(real);
}

/// In a mount namespace of this thread: frees hugetlb for v2, mounts
/// cgroup2, lays out pod cgroups as a kubelet with the cgroupfs driver
/// does, reads them with `PodCgroups`, and takes it all down again.
fn read_pod_cgroups_on_cgroup2() -> Result<std::collections::BTreeMap<PageSize, u64>, String> {
    use std::ffi::CString;
    let c = |s: &str| CString::new(s).expect("a C string");
    // SAFETY: unshare and mount with valid C strings; the new namespace is
    // this thread's alone (CLONE_NEWNS implies CLONE_FS).
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(format!("unshare: {}", std::io::Error::last_os_error()));
    }
    let root = c("/");
    // SAFETY: as above.
    if unsafe {
        libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    } != 0
    {
        return Err(format!(
            "make / private: {}",
            std::io::Error::last_os_error()
        ));
    }
    let mount = |fs: &str, dir: &std::path::Path, data: &str| -> Result<(), String> {
        let (none, target, fs, data) =
            (c("none"), c(dir.to_str().expect("a path")), c(fs), c(data));
        // SAFETY: valid C strings.
        let done = unsafe {
            libc::mount(
                none.as_ptr(),
                target.as_ptr(),
                fs.as_ptr(),
                0,
                data.as_ptr().cast(),
            )
        };
        (done == 0)
            .then_some(())
            .ok_or_else(|| format!("mount {dir:?}: {}", std::io::Error::last_os_error()))
    };
    let umount = |dir: &std::path::Path| {
        let target = c(dir.to_str().expect("a path"));
        // SAFETY: a valid C string.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    };
    let hierarchy = || -> u32 {
        std::fs::read_to_string("/proc/cgroups")
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                let mut fields = l.split_whitespace();
                (fields.next() == Some("hugetlb")).then(|| fields.next()?.parse().ok())?
            })
            .unwrap_or(0)
    };
    let remove_empty = |top: &std::path::Path| {
        let mut dirs = Vec::new();
        let mut stack = vec![top.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(entry.path());
                    dirs.push(entry.path());
                }
            }
        }
        dirs.sort_by_key(|d| std::cmp::Reverse(d.as_os_str().len()));
        for dir in dirs {
            let _ = std::fs::remove_dir(dir);
        }
    };
    let scratch = tempfile::tempdir().map_err(|e| e.to_string())?;
    for _ in 0..50 {
        if hierarchy() == 0 {
            break;
        }
        let v1 = scratch.path().join("v1");
        std::fs::create_dir_all(&v1).map_err(|e| e.to_string())?;
        mount("cgroup", &v1, "hugetlb")?;
        remove_empty(&v1);
        umount(&v1);
        std::thread::sleep(Duration::from_millis(100));
    }
    if hierarchy() != 0 {
        return Err(
            "the hugetlb controller is held by a v1 hierarchy (a test node running?)".into(),
        );
    }
    let unified = scratch.path().join("v2");
    std::fs::create_dir_all(&unified).map_err(|e| e.to_string())?;
    mount("cgroup2", &unified, "")?;
    let write = |path: std::path::PathBuf, value: &str| {
        std::fs::write(&path, value).map_err(|e| format!("write {value} to {path:?}: {e}"))
    };
    let subtree = unified.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&subtree).unwrap_or_default();
    if !enabled.contains("hugetlb") {
        write(subtree.clone(), "+hugetlb")?;
    }
    let top = unified.join(format!("hugepool-test-{}", std::process::id()));
    let result = (|| {
        for dir in ["", "kubepods", "kubepods/burstable"] {
            let dir = top.join(dir);
            std::fs::create_dir_all(&dir).map_err(|e| format!("{dir:?}: {e}"))?;
            write(dir.join("cgroup.subtree_control"), "+hugetlb")?;
        }
        let pod = |path: &str, two_mi: &str, one_gi: &str| -> Result<(), String> {
            let dir = top.join(path);
            std::fs::create_dir(&dir).map_err(|e| format!("{dir:?}: {e}"))?;
            write(dir.join("hugetlb.2MB.max"), two_mi)?;
            if dir.join("hugetlb.1GB.max").exists() {
                write(dir.join("hugetlb.1GB.max"), one_gi)?;
            }
            Ok(())
        };
        // As the kubelet writes them: a request in bytes, none as 0.
        pod(
            "kubepods/burstable/poda",
            &(4 * MI2.bytes()).to_string(),
            "0",
        )?;
        pod(
            "kubepods/podb",
            "max",
            &PageSize::SIZE_1GI.bytes().to_string(),
        )?;
        pod("kubepods/burstable/podc", "0", "0")?;
        hugepool_agent::pod_cgroups::PodCgroups::new(&top)
            .requested()
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "no hugetlb controller found below kubepods".to_string())
    })();
    remove_empty(&top);
    let _ = std::fs::remove_dir(&top);
    if !enabled.contains("hugetlb") {
        let _ = write(subtree, "-hugetlb");
    }
    umount(&unified);
    result
}

/// A node's first resize as an operator's first pool runs it (issue 49): the
/// CLI in a fresh process with no model file, HVO on, 4096 x 2Mi freed and
/// grown again with the page cache dropped before each (the free memory a
/// new node has). No write may run past the 50 ms budget for anything but
/// what the engine cannot foresee: the time its writer waited for a CPU,
/// and, after the first write, a cost a page that jumped past twice the
/// median of the resize's other writes (seen on this VM in 1 run of 8:
/// 1316 pages in 77 ms of kernel time after writes at 14 us a page;
/// docs/design.md, "A node's first resize"), which the test names instead.
/// A failure lists every write with its CPU wait and what sized it.
#[test]
fn a_nodes_first_resize_keeps_every_write_within_the_budget() {
    const PAGES: u64 = 4096;
    const RUNS: usize = 3;
    let budget = Duration::from_millis(50);
    let Some(real) = RealKernel::acquire(PAGES * 2 * (1 << 20)) else {
        return;
    };
    real.set_pool(MI2, 0);
    real.set_hvo(true);
    let mut over = Vec::new();
    let (mut writes, mut jumps) = (0, 0);
    for run in 0..RUNS {
        for (from, to) in [(PAGES, 0), (0, PAGES)] {
            real.set_pool(MI2, from);
            let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
            let output = Command::new(env!("CARGO_BIN_EXE_hugepool-agent"))
                .args(["resize", "--page-size", "2Mi", "--pages"])
                .arg(to.to_string())
                .args(["--output", "json"])
                .output()
                .expect("run hugepool-agent resize");
            let report: serde_json::Value =
                serde_json::from_slice(&output.stdout).unwrap_or_else(|err| {
                    panic!(
                        "{err}: {}{}",
                        String::from_utf8_lossy(&output.stdout),
                        String::from_utf8_lossy(&output.stderr)
                    )
                });
            assert_eq!(report["outcome"]["kind"], "reached", "{report}");
            assert_eq!(real.pool().persistent(), to);
            let list = |key: &str| report[key].as_array().cloned().unwrap_or_default();
            let (seconds, waits, pages, reasons) = (
                list("writeSeconds"),
                list("writeCpuWaitSeconds"),
                list("writePages"),
                list("writeReasons"),
            );
            assert!(
                seconds.len() > 1,
                "one write is what the engine avoids: {report}"
            );
            assert_eq!(reasons.len(), seconds.len(), "{report}");
            writes += seconds.len();
            let described: Vec<String> = (0..seconds.len())
                .map(|i| {
                    format!(
                        "{} pages in {:.1} ms ({:.1} ms waiting for a CPU; sized by {} at {:.1} ms)",
                        pages[i],
                        seconds[i].as_f64().unwrap_or(0.0) * 1000.0,
                        waits[i].as_f64().unwrap_or(0.0) * 1000.0,
                        reasons[i]["limit"],
                        reasons[i]["aim"].as_f64().unwrap_or(0.0) * 1000.0,
                    )
                })
                .collect();
            // Each write's kernel time (less its CPU wait) a page.
            let kernel_time: Vec<f64> = (0..seconds.len())
                .map(|i| seconds[i].as_f64().expect("a latency") - waits[i].as_f64().unwrap_or(0.0))
                .collect();
            let per_page: Vec<f64> = (0..seconds.len())
                .map(|i| kernel_time[i] / pages[i].as_f64().unwrap_or(1.0).max(1.0))
                .collect();
            for i in 0..seconds.len() {
                if kernel_time[i] <= budget.as_secs_f64() {
                    continue;
                }
                let mut others: Vec<f64> = (0..per_page.len())
                    .filter(|j| *j != i)
                    .map(|j| per_page[j])
                    .collect();
                others.sort_by(f64::total_cmp);
                let median = others.get(others.len() / 2).copied().unwrap_or(0.0);
                let what = format!(
                    "run {} {from} -> {to}, write {} of {described:?}",
                    run + 1,
                    i + 1
                );
                // The first write's size is the engine's alone (nothing
                // measured yet): no exemption for it.
                if i > 0 && median > 0.0 && per_page[i] > 2.0 * median {
                    eprintln!(
                        "not the engine's: {:.1} us a page against a median of {:.1}: {what}",
                        per_page[i] * 1e6,
                        median * 1e6
                    );
                    jumps += 1;
                } else {
                    over.push(what);
                }
            }
            eprintln!("run {} {from} -> {to}: {described:?}", run + 1);
        }
    }
    assert!(
        over.is_empty(),
        "{} of {writes} cold writes ran past the budget less their CPU wait: {over:#?}",
        over.len()
    );
    // The exemption is for the odd write: a cost that jumps in most runs
    // is the engine's to foresee.
    assert!(
        jumps * 10 <= writes,
        "{jumps} of {writes} cold writes ran past the budget at more than twice their resize's cost a page"
    );
}
