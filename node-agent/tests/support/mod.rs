//! Shared by the tests that write this machine's real hugetlb pools: the
//! guard that takes the machine's kernel exclusively (one test at a time in a
//! binary) and restores its settings, a helper process that holds pages or
//! memory, and a sampler of kernel values.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use hugepool_agent::kernel::{Kernel, PoolCounts, PoolScope, SysfsKernel};
use hugepool_crds::PageSize;

pub const MI2: PageSize = PageSize::SIZE_2MI;
pub const GIB: u64 = 1 << 30;
/// Never let a test take MemAvailable below this.
pub const KEEP_FREE: u64 = 4 * GIB;

pub static KERNEL_LOCK: Mutex<()> = Mutex::new(());

/// Exclusive use of the real kernel; restores the hugetlb settings on drop.
pub struct RealKernel {
    pub kernel: SysfsKernel,
    saved_pools: Vec<(PageSize, u64)>,
    saved_hvo: Option<bool>,
    _lock: MutexGuard<'static, ()>,
    _machine_lock: std::fs::File,
}

impl RealKernel {
    /// The kernel, or `None` (skip) when this machine cannot run the test;
    /// under `CI=true` that is a failure instead.
    pub fn acquire(needs_bytes: u64) -> Option<Self> {
        let lock = KERNEL_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        // Test binaries run one after another, but a developer may run two
        // cargo commands at once: the file lock keeps them apart too.
        let machine_lock = hugepool_e2e::lock_machine_kernel();
        let kernel = SysfsKernel::default();
        match Self::check(&kernel, needs_bytes) {
            Ok(()) => {}
            Err(reason) if hugepool_e2e::in_ci_mode() => {
                panic!("real-kernel test cannot run under CI=true: {reason}")
            }
            Err(reason) => {
                eprintln!("skipping real-kernel test: {reason}");
                return None;
            }
        }
        let mut saved_pools = Vec::new();
        for size in kernel.page_sizes().expect("list page sizes") {
            saved_pools.push((size, kernel.pool(size).expect("read pool").persistent()));
        }
        let saved_hvo = kernel.hvo().expect("read hugetlb_optimize_vmemmap");
        Some(Self {
            kernel,
            saved_pools,
            saved_hvo,
            _lock: lock,
            _machine_lock: machine_lock,
        })
    }

    fn check(kernel: &SysfsKernel, needs_bytes: u64) -> Result<(), String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not running as root".into());
        }
        let sizes = kernel.page_sizes().map_err(|e| e.to_string())?;
        if !sizes.contains(&MI2) {
            return Err("the kernel offers no 2Mi pages".into());
        }
        let file = kernel.pool_file(MI2, PoolScope::Global);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        match kernel.hvo() {
            Ok(Some(_)) => {}
            Ok(None) => return Err("no /proc/sys/vm/hugetlb_optimize_vmemmap".into()),
            Err(err) => return Err(err.to_string()),
        }
        let available = kernel.meminfo().map_err(|e| e.to_string())?.available_bytes;
        if available < KEEP_FREE + needs_bytes {
            return Err(format!(
                "MemAvailable {} GiB is less than the {} GiB this test needs plus 4 GiB",
                available / GIB,
                needs_bytes / GIB
            ));
        }
        Ok(())
    }

    pub fn pool(&self) -> PoolCounts {
        self.kernel.pool(MI2).expect("read the 2Mi pool")
    }

    /// A starting state, written directly (not through the engine). Right
    /// after a memory hog exits the kernel may need a few compacting tries.
    pub fn set_pool(&self, size: PageSize, pages: u64) {
        let mut got = 0;
        for _ in 0..10 {
            self.kernel
                .write_pool(size, PoolScope::Global, pages)
                .expect("write nr_hugepages");
            got = self.kernel.pool(size).expect("read pool").persistent();
            if got == pages {
                return;
            }
            // Page cache from builds on the same machine can outrun what a
            // hugetlb allocation reclaims; a set-up may drop it.
            let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
            self.kernel
                .compact(PoolScope::Global)
                .expect("compact memory");
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("could not set up {pages} x {size}: got {got}");
    }

    pub fn set_hvo(&self, on: bool) {
        self.kernel
            .set_hvo(on)
            .expect("write hugetlb_optimize_vmemmap");
    }

    pub fn shared(&self) -> Arc<dyn Kernel> {
        Arc::new(self.kernel.clone())
    }
}

impl Drop for RealKernel {
    fn drop(&mut self) {
        for (size, pages) in &self.saved_pools {
            if let Err(err) = self.kernel.write_pool(*size, PoolScope::Global, *pages) {
                eprintln!("could not restore {size} pool to {pages}: {err}");
            }
        }
        if let Some(on) = self.saved_hvo
            && let Err(err) = self.kernel.set_hvo(on)
        {
            eprintln!("could not restore hugetlb_optimize_vmemmap: {err}");
        }
    }
}

/// A forked process that holds memory until dropped (SIGKILL).
pub struct Helper {
    pid: libc::pid_t,
}

pub enum Hold {
    /// `pages` x 2Mi mapped with MAP_HUGETLB, the first `touched` faulted in.
    HugePages { pages: usize, touched: usize },
    /// Anonymous memory, populated.
    Anonymous { bytes: usize },
}

impl Helper {
    pub fn start(hold: Hold) -> Helper {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: fds has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
        // SAFETY: the child only calls async-signal-safe functions (mmap,
        // write, pause, _exit) and touches its own mapping.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            unsafe { child(hold, fds[1]) }
        }
        // SAFETY: closing our copy of the write end; reading one byte.
        unsafe { libc::close(fds[1]) };
        let mut status = [0u8; 1];
        let read = unsafe { libc::read(fds[0], status.as_mut_ptr().cast(), 1) };
        unsafe { libc::close(fds[0]) };
        let helper = Helper { pid };
        assert!(
            read == 1 && status[0] == b'R',
            "helper could not map its memory"
        );
        helper
    }
}

/// The forked child: map, touch, report, wait to be killed.
unsafe fn child(hold: Hold, ready: libc::c_int) -> ! {
    const PAGE: usize = 2 << 20;
    let (len, flags, touched) = match hold {
        Hold::HugePages { pages, touched } => (pages * PAGE, libc::MAP_HUGETLB, touched),
        Hold::Anonymous { bytes } => (bytes, libc::MAP_POPULATE, 0),
    };
    unsafe {
        let addr = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        );
        if addr == libc::MAP_FAILED {
            libc::write(ready, b"E".as_ptr().cast(), 1);
            libc::_exit(1);
        }
        for page in 0..touched {
            std::ptr::write_volatile(addr.cast::<u8>().add(page * PAGE), 1);
        }
        libc::write(ready, b"R".as_ptr().cast(), 1);
        loop {
            libc::pause();
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // SAFETY: our own child; reaped so its memory is back when we return.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// Samples a kernel value every millisecond on a thread until stopped.
pub struct Sampler<T: Send + 'static> {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Vec<T>>>,
}

impl<T: Send + 'static> Sampler<T> {
    pub fn start(read: impl Fn() -> Option<T> + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                if let Some(sample) = read() {
                    samples.push(sample);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            samples
        });
        Self {
            stop,
            handle: Some(handle),
        }
    }

    pub fn finish(mut self) -> Vec<T> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .map(|h| h.join().expect("sampler thread"))
            .unwrap_or_default()
    }
}
