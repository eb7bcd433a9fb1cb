//! What a grow can get, predicted and measured (issue 30, part 2). Over
//! states of fragmented memory of varied severity, the bench reads the
//! free lists' estimate (docs/design.md, "What a grow can get") and then
//! grows the 2Mi pool from 0 with the engine, two ways, on the same state
//! made anew each time: with the free lists (compact the node before a grow
//! they cannot cover; a foreseen shortfall ends at the first short write)
//! and as before them (`--no-free-lists`: write, then compact and retry).
//! For each state it also predicts and tries a grow of 1Gi pages. A state is
//! page cache of a file with every other 1 MiB dropped, anonymous memory
//! (no THP, every page touched) with every other 1 MiB freed, shmem (a
//! tmpfs file with every other 1 MiB punched out) and/or reclaimable slab
//! (negative dentries), in varied amounts, and some requests past the
//! memory guard. For each it also shows what a status written on the clean
//! machine would show once the state is there (the agent's rule for
//! rewriting an estimate, and a tenth either way). Nothing
//! compacts between fragmenting and the grow (`compaction_proactiveness` 0).
//! Prints a row per state and the model's error (median of |predicted -
//! achieved| / request), saves raw results to node-agent/bench-results/ as
//! JSON. Holds the real-kernel test lock, and restores both pools, the 2Mi
//! overcommit and the sysctls it changes.
//!
//! Environment: HUGEPOOL_FRAGMENT_PAGES (the base request, default 6144),
//! HUGEPOOL_FRAGMENT_STATES (state names separated by semicolons: only
//! those).

#[path = "common/raw.rs"]
mod raw;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write as _};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hugepool_agent::agent::status::moved_materially;
use hugepool_agent::kernel::freelists::GrowEstimate;
use hugepool_agent::kernel::{Kernel, PoolScope, SysfsKernel};
use hugepool_agent::resize::planner::guard_headroom;
use hugepool_crds::PageSize;

const MI2: PageSize = PageSize::SIZE_2MI;
const GI1: PageSize = PageSize::SIZE_1GI;
const GIB: u64 = 1 << 30;
/// The engine's `--min-mem-available` here: above the default 1Gi, so that
/// the grows past the guard leave room for whatever else runs (builds).
const ENGINE_GUARD: u64 = 3 * GIB;
const ENGINE_GUARD_ARG: &str = "3Gi";
/// 1Gi pages each state asks for.
const GIGANTIC_REQUEST: u64 = 4;
/// Room kept on top of the guard and the fragmenter for the rest of the
/// machine while fragmenting.
const MARGIN: u64 = 3 * GIB;
/// The page-cache part of the fragmenter: a file this large (at most).
const CACHE_FILE_BYTES: u64 = 4 * GIB;
/// Alternate ranges of this size are dropped (cache) or freed (anonymous).
const HOLE: usize = 1 << 20;
const SAMPLE_EVERY: Duration = Duration::from_millis(10);
const PROACTIVENESS: &str = "/proc/sys/vm/compaction_proactiveness";
const WATERMARK_BOOST: &str = "/proc/sys/vm/watermark_boost_factor";

/// One state of memory a grow starts from.
#[derive(Clone, Copy, Debug)]
struct State {
    name: &'static str,
    /// Share of the fragmenter's anonymous memory mapped.
    anon: f64,
    /// The page-cache file is read in, with holes.
    cache: bool,
    /// Share of the fragmenter's anonymous size written to a tmpfs file
    /// (shmem: movable, not reclaimable without swap), every other 1 MiB
    /// punched out.
    shmem: f64,
    /// `SLAB_DENTRIES` negative dentries (reclaimable slab) made first.
    slab: bool,
    /// 2Mi pages asked for, as a multiple of HUGEPOOL_FRAGMENT_PAGES.
    request: f64,
}

const STATES: [State; 18] = [
    State {
        name: "clean",
        anon: 0.0,
        cache: false,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "page cache",
        anon: 0.0,
        cache: true,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "anon 1/4",
        anon: 0.25,
        cache: false,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "anon 1/4, cache",
        anon: 0.25,
        cache: true,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "anon 1/2",
        anon: 0.5,
        cache: false,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "anon 1/2, cache",
        anon: 0.5,
        cache: true,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "anon 3/4, cache",
        anon: 0.75,
        cache: true,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "anon all",
        anon: 1.0,
        cache: false,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "anon all, cache",
        anon: 1.0,
        cache: true,
        shmem: 0.0,
        slab: false,
        request: 1.0,
    },
    State {
        name: "clean, past the guard",
        anon: 0.0,
        cache: false,
        shmem: 0.0,
        slab: false,
        request: 2.0,
    },
    State {
        name: "anon 1/2, cache, past the guard",
        anon: 0.5,
        cache: true,
        shmem: 0.0,
        slab: false,
        request: 2.0,
    },
    State {
        name: "anon all, cache, past the guard",
        anon: 1.0,
        cache: true,
        shmem: 0.0,
        slab: false,
        request: 2.0,
    },
    // A little shmem taken after an agent wrote its estimate: the fresh
    // figure falls by less than a tenth (what a status kept under the
    // tenth rule).
    State {
        name: "shmem 1/8, past the guard",
        anon: 0.0,
        cache: false,
        shmem: 0.125,
        slab: false,
        request: 2.0,
    },
    State {
        name: "shmem 1/4, past the guard",
        anon: 0.0,
        cache: false,
        shmem: 0.25,
        slab: false,
        request: 2.0,
    },
    State {
        name: "shmem, past the guard",
        anon: 0.0,
        cache: false,
        shmem: 1.0,
        slab: false,
        request: 1.5,
    },
    State {
        name: "shmem, cache, past the guard",
        anon: 0.0,
        cache: true,
        shmem: 1.0,
        slab: false,
        request: 1.5,
    },
    State {
        name: "slab, past the guard",
        anon: 0.0,
        cache: false,
        shmem: 0.0,
        slab: true,
        request: 1.75,
    },
    State {
        name: "slab, shmem 1/2, anon 1/4, cache",
        anon: 0.25,
        cache: true,
        shmem: 0.5,
        slab: true,
        request: 1.5,
    },
];

/// One state's grows: the 2Mi one each way, and the 1Gi one.
type Row = (State, Vec<(Way, Grow)>, Grow);

/// The engine with or without the free lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    FreeLists,
    Before,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::FreeLists => "free lists",
            Way::Before => "before",
        }
    }
}

/// What the kernel says about free memory and compaction at one moment.
#[derive(Clone, Debug)]
struct Snapshot {
    mem_free: u64,
    mem_available: u64,
    cached: u64,
    anon: u64,
    /// Free blocks of order 9 and up, in 2 MiB blocks (an order-10 block
    /// counts twice): what a 2Mi grow can take without compacting.
    free_2mi_blocks: u64,
    /// Every `compact_*` counter of /proc/vmstat.
    compact: BTreeMap<String, u64>,
}

impl Snapshot {
    fn take() -> Result<Snapshot, String> {
        let meminfo = read("/proc/meminfo")?;
        let field = |name: &str| -> Result<u64, String> {
            meminfo
                .lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
                .map(|kb| kb * 1024)
                .ok_or_else(|| format!("/proc/meminfo has no {name}"))
        };
        Ok(Snapshot {
            mem_free: field("MemFree")?,
            mem_available: field("MemAvailable")?,
            cached: field("Cached")?,
            anon: field("AnonPages")?,
            free_2mi_blocks: free_2mi_blocks(&read("/proc/buddyinfo")?)?,
            compact: read("/proc/vmstat")?
                .lines()
                .filter(|line| line.starts_with("compact_"))
                .filter_map(|line| {
                    let (name, value) = line.split_once(' ')?;
                    Some((name.to_string(), value.trim().parse().ok()?))
                })
                .collect(),
        })
    }

    /// 2 MiB blocks MemFree would make if it were not fragmented.
    fn free_allows(&self) -> u64 {
        self.mem_free / MI2.bytes()
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "memFreeBytes": self.mem_free,
            "memAvailableBytes": self.mem_available,
            "cachedBytes": self.cached,
            "anonBytes": self.anon,
            "free2MiBlocks": self.free_2mi_blocks,
            "memFreeAllows2MiBlocks": self.free_allows(),
            "compact": self.compact,
        })
    }
}

/// Sum over zones of order-9 + 2 x order-10 free blocks.
fn free_2mi_blocks(buddyinfo: &str) -> Result<u64, String> {
    let mut blocks = 0;
    for line in buddyinfo.lines().filter(|line| !line.trim().is_empty()) {
        let counts: Vec<u64> = line
            .split_whitespace()
            .skip(4)
            .map(|count| count.parse().map_err(|_| format!("buddyinfo: {line:?}")))
            .collect::<Result<_, _>>()?;
        for (order, count) in counts.iter().enumerate().skip(9) {
            blocks += count << (order - 9);
        }
    }
    Ok(blocks)
}

/// One measured grow from 0.
#[derive(Debug)]
struct Grow {
    size: PageSize,
    request: u64,
    /// What the estimate said a grow from 0 gets: min(request, after
    /// compaction within the guard).
    predicted: u64,
    /// The estimate itself: (now, after compaction).
    estimate: (u64, u64),
    /// What a status made on the clean machine showed by now: the
    /// prediction by the agent's rule and by a tenth either way.
    shown: Option<(u64, u64)>,
    reached: u64,
    total: Duration,
    writes: Vec<Duration>,
    compactions: u32,
    outcome: serde_json::Value,
    min_available: u64,
    cache_kept: u64,
    /// Medians of `READS` reads of /proc/buddyinfo and of
    /// /proc/pagetypeinfo right before the grow: what the engine's
    /// foresight costs when the free blocks decide and when the pageblock
    /// counts must be read.
    reads: (Duration, Duration),
    before: Snapshot,
    after: Snapshot,
}

impl Grow {
    fn max_write(&self) -> Duration {
        self.writes.iter().max().copied().unwrap_or_default()
    }

    fn error(&self) -> f64 {
        self.predicted.abs_diff(self.reached) as f64 / self.request.max(1) as f64
    }

    /// (predicted - reached) / request: above 0 a promise the grow broke.
    fn signed_error(&self, predicted: u64) -> f64 {
        (predicted as f64 - self.reached as f64) / self.request.max(1) as f64
    }

    fn json(&self, state: &State, way: Way) -> serde_json::Value {
        serde_json::json!({
            "state": state.name,
            "way": way.name(),
            "size": self.size.to_string(),
            "request": self.request,
            "predicted": self.predicted,
            "obtainableNow": self.estimate.0,
            "afterCompaction": self.estimate.1,
            "statusPredicted": self.shown.map(|s| s.0),
            "statusPredictedTenthRule": self.shown.map(|s| s.1),
            "reached": self.reached,
            "totalMs": ms(self.total),
            "writesMs": self.writes.iter().map(|w| ms(*w)).collect::<Vec<_>>(),
            "maxWriteMs": ms(self.max_write()),
            "compactions": self.compactions,
            "outcome": self.outcome,
            "minMemAvailableBytes": self.min_available,
            "cacheKeptBytes": self.cache_kept,
            "buddyinfoReadMs": ms(self.reads.0),
            "pagetypeinfoReadMs": ms(self.reads.1),
            "before": self.before.json(),
            "after": self.after.json(),
        })
    }
}

/// Restores the machine's settings when dropped, also on panic.
struct Restore {
    kernel: SysfsKernel,
    pools: Vec<(PageSize, u64)>,
    /// Files written as they were: overcommit, compaction sysctls.
    files: Vec<(PathBuf, String)>,
}

impl Drop for Restore {
    fn drop(&mut self) {
        for (size, pages) in &self.pools {
            if let Err(err) = self.kernel.write_pool(*size, PoolScope::Global, *pages) {
                eprintln!("could not restore {size}: {err}");
            }
        }
        for (path, value) in &self.files {
            if let Err(err) = std::fs::write(path, value) {
                eprintln!("could not restore {}: {err}", path.display());
            }
        }
    }
}

/// The page-cache half of the fragmenter: a file on disk, deleted when
/// dropped.
struct CacheFile {
    path: PathBuf,
    file: File,
    bytes: u64,
}

impl CacheFile {
    fn create(path: PathBuf, bytes: u64) -> Result<CacheFile, String> {
        let error = |e: std::io::Error| format!("{}: {e}", path.display());
        let mut file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(error)?;
        let cache = CacheFile {
            path: path.clone(),
            file: file.try_clone().map_err(error)?,
            bytes,
        };
        let chunk = vec![0x5a_u8; HOLE];
        for _ in 0..bytes / HOLE as u64 {
            file.write_all(&chunk).map_err(error)?;
        }
        file.sync_all().map_err(error)?;
        Ok(cache)
    }

    fn advise(&self, offset: u64, len: u64, advice: libc::c_int) -> Result<(), String> {
        // SAFETY: posix_fadvise on a descriptor we own; no memory is passed.
        let rc = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                advice,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!(
                "posix_fadvise {}: {}",
                self.path.display(),
                std::io::Error::from_raw_os_error(rc)
            ))
        }
    }

    fn drop_all(&self) -> Result<(), String> {
        self.advise(0, 0, libc::POSIX_FADV_DONTNEED)
    }

    /// Reads the whole file into the cache, then drops every other 1 MiB;
    /// returns the bytes left in the cache. Random-access advice keeps
    /// readahead from building large folios, so the cache is order-0 pages
    /// and a dropped range leaves small holes.
    fn fill_with_holes(&mut self) -> Result<u64, String> {
        self.drop_all()?;
        self.advise(0, 0, libc::POSIX_FADV_RANDOM)?;
        let error = |e: std::io::Error| format!("{}: {e}", self.path.display());
        self.file.seek(SeekFrom::Start(0)).map_err(error)?;
        let mut buffer = vec![0_u8; HOLE];
        let mut read_bytes = 0;
        while read_bytes < self.bytes {
            let n = self.file.read(&mut buffer).map_err(error)?;
            if n == 0 {
                break;
            }
            read_bytes += n as u64;
        }
        // A second pass when the first left more than half (folios still in
        // a CPU's LRU batch are skipped); the bytes kept are recorded.
        for _ in 0..3 {
            for offset in (HOLE as u64..self.bytes).step_by(2 * HOLE) {
                self.advise(offset, HOLE as u64, libc::POSIX_FADV_DONTNEED)?;
            }
            let kept = self.resident()?;
            if kept <= self.bytes / 2 + self.bytes / 32 {
                return Ok(kept);
            }
        }
        self.resident()
    }

    /// Bytes of the file in the page cache (mincore over a mapping that
    /// is never touched, so it faults nothing in).
    fn resident(&self) -> Result<u64, String> {
        let len = self.bytes as usize;
        let page = 4096;
        // SAFETY: a read-only shared mapping of our own file, only passed to
        // mincore and unmapped below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!(
                "mmap {}: {}",
                self.path.display(),
                std::io::Error::last_os_error()
            ));
        }
        let mut pages = vec![0_u8; len.div_ceil(page)];
        // SAFETY: `pages` has one byte per page of the mapping.
        let rc = unsafe { libc::mincore(base, len, pages.as_mut_ptr()) };
        let error = std::io::Error::last_os_error();
        // SAFETY: the mapping made above, unmapped once.
        unsafe { libc::munmap(base, len) };
        if rc != 0 {
            return Err(format!("mincore {}: {error}", self.path.display()));
        }
        Ok(pages.iter().filter(|p| **p & 1 == 1).count() as u64 * page as u64)
    }
}

impl Drop for CacheFile {
    fn drop(&mut self) {
        let _ = self.drop_all();
        if let Err(err) = std::fs::remove_file(&self.path) {
            eprintln!("could not delete {}: {err}", self.path.display());
        }
    }
}

/// The anonymous half of the fragmenter: a mapping without THP, every page
/// touched, then every other 1 MiB freed, so every 2 MiB range keeps half
/// its pages. Unmapped when dropped.
struct AnonHoles {
    base: *mut libc::c_void,
    len: usize,
}

impl AnonHoles {
    fn new(len: usize) -> Result<AnonHoles, String> {
        let os_error = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        let anon = AnonHoles { base, len };
        // SAFETY: advice on the mapping made above, whole.
        if unsafe { libc::madvise(base, len, libc::MADV_NOHUGEPAGE) } != 0 {
            return Err(os_error("madvise(MADV_NOHUGEPAGE)"));
        }
        let page = 4096;
        for offset in (0..len).step_by(page) {
            // SAFETY: offset < len, inside the writable mapping.
            unsafe { base.cast::<u8>().add(offset).write_volatile(1) };
        }
        for offset in (HOLE..len).step_by(2 * HOLE) {
            let hole = HOLE.min(len - offset);
            // SAFETY: a range inside the mapping; its contents are not
            // needed again.
            if unsafe {
                libc::madvise(
                    base.cast::<u8>().add(offset).cast(),
                    hole,
                    libc::MADV_DONTNEED,
                )
            } != 0
            {
                return Err(os_error("madvise(MADV_DONTNEED)"));
            }
        }
        Ok(anon)
    }
}

impl Drop for AnonHoles {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new, unmapped once.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// The shmem half of the fragmenter: a file on tmpfs (`/dev/shm`), every
/// page written, then every other 1 MiB punched out. Deleted when dropped.
struct ShmemHoles {
    path: PathBuf,
}

impl ShmemHoles {
    fn new(bytes: u64) -> Result<ShmemHoles, String> {
        let path = PathBuf::from(format!("/dev/shm/hugepool-fragment-{}", std::process::id()));
        let error = |e: std::io::Error| format!("{}: {e}", path.display());
        let mut file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(error)?;
        let shmem = ShmemHoles { path: path.clone() };
        let chunk = vec![0x5a_u8; HOLE];
        for _ in 0..bytes / HOLE as u64 {
            file.write_all(&chunk).map_err(error)?;
        }
        for offset in (HOLE as u64..bytes).step_by(2 * HOLE) {
            // SAFETY: fallocate on a descriptor we own; no memory is passed.
            let rc = unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    HOLE as libc::off_t,
                )
            };
            if rc != 0 {
                return Err(error(std::io::Error::last_os_error()));
            }
        }
        Ok(shmem)
    }
}

impl Drop for ShmemHoles {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_file(&self.path) {
            eprintln!("could not delete {}: {err}", self.path.display());
        }
    }
}

/// Negative dentries the slab state makes (about 190 bytes each in the
/// reclaimable dentry cache): names looked up in an empty directory.
const SLAB_DENTRIES: u64 = 12_000_000;

/// Fills the dentry cache with `SLAB_DENTRIES` negative entries; the
/// reset's drop_caches frees them.
fn fill_slab(dir: &Path) -> Result<(), String> {
    let dir = dir.join(format!("hugepool-fragment-slab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for i in 0..SLAB_DENTRIES {
        match std::fs::symlink_metadata(dir.join(format!("{i:x}"))) {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            other => return Err(format!("{}: {other:?}", dir.display())),
        }
    }
    std::fs::remove_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))
}

/// MemAvailable every 10 ms on a thread until finished: the lowest value.
struct Sampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<(u64, usize)>,
}

impl Sampler {
    fn start() -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            let mut lowest = u64::MAX;
            let mut samples = 0;
            loop {
                if let Ok(available) = mem_available() {
                    lowest = lowest.min(available);
                    samples += 1;
                }
                if flag.load(Ordering::Relaxed) {
                    return (lowest, samples);
                }
                std::thread::sleep(SAMPLE_EVERY);
            }
        });
        Sampler { stop, handle }
    }

    fn finish(self) -> (u64, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or((u64::MAX, 0))
    }
}

fn mem_available() -> Result<u64, String> {
    read("/proc/meminfo")?
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "/proc/meminfo has no MemAvailable".to_string())
}

fn read(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))
}

fn write(path: &str, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("{path}: {e}"))
}

fn main() -> ExitCode {
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this
    // binary too, and a test run must not fragment the machine's memory.
    if !std::env::args().any(|arg| arg == "--bench") {
        eprintln!(
            "fragmented-grow benchmark: run it with `cargo bench -p hugepool-agent --bench fragment`"
        );
        return ExitCode::SUCCESS;
    }
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("bench: {err}");
            ExitCode::FAILURE
        }
    }
}

fn env_number(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .map_err(|_| format!("{name}={text:?} is not a number")),
        Err(_) => Ok(default),
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB as f64
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// The fragmenter's anonymous memory at its largest: what MemAvailable on
/// a clean machine leaves above the guard, the page-cache file and a
/// margin. Half of it stays resident.
fn anon_bytes(available: u64) -> Result<u64, String> {
    let anon = available.saturating_sub(ENGINE_GUARD + MARGIN + CACHE_FILE_BYTES) / GIB * GIB;
    if anon < 2 * GIB {
        return Err(format!(
            "MemAvailable {:.1} GiB leaves no room to fragment above a {:.0} GiB guard",
            gib(available),
            gib(ENGINE_GUARD)
        ));
    }
    Ok(anon)
}

/// Gives both pools back, frees the fragmenter and starts from a clean,
/// compacted machine (compacting here is before fragmenting, never between
/// fragmenting and a grow).
fn reset(kernel: &SysfsKernel, cache: &CacheFile) -> Result<(), String> {
    for size in [MI2, GI1] {
        kernel
            .write_pool(size, PoolScope::Global, 0)
            .map_err(|e| e.to_string())?;
    }
    cache.drop_all()?;
    write("/proc/sys/vm/drop_caches", "3")?;
    kernel
        .compact(PoolScope::Global)
        .map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_millis(500));
    Ok(())
}

/// Resets, then makes `state`: the fragmenter's memory, held until dropped.
fn make_state(
    kernel: &SysfsKernel,
    cache: &mut CacheFile,
    state: &State,
    anon_max: u64,
) -> Result<(Held, u64), String> {
    reset(kernel, cache)?;
    if state.slab {
        fill_slab(Path::new("/var/tmp"))?;
    }
    let shmem_len =
        ((anon_max as f64 * state.shmem) as u64) / (2 * HOLE as u64) * (2 * HOLE as u64);
    let shmem = (shmem_len > 0)
        .then(|| ShmemHoles::new(shmem_len))
        .transpose()?;
    let cache_kept = if state.cache {
        cache.fill_with_holes()?
    } else {
        0
    };
    let anon_len = ((anon_max as f64 * state.anon) as u64) / (2 * HOLE as u64) * (2 * HOLE as u64);
    let anon = (anon_len > 0)
        .then(|| AnonHoles::new(anon_len as usize))
        .transpose()?;
    std::thread::sleep(Duration::from_millis(200));
    Ok(((anon, shmem), cache_kept))
}

/// The fragmenter's memory a state holds until dropped.
type Held = (Option<AnonHoles>, Option<ShmemHoles>);

/// What a status showed for a grow of `request` from 0, as (the agent's
/// rule, a tenth either way), when it showed `clean` and the lists now give
/// `fresh` (now, after compaction).
fn shown(clean: (u64, u64), fresh: (u64, u64), request: u64) -> (u64, u64) {
    let estimate = |(now, after): (u64, u64)| GrowEstimate {
        obtainable_now: now,
        after_compaction: after,
    };
    let (clean, fresh) = (estimate(clean), estimate(fresh));
    let tenth = |a: u64, b: u64| a.abs_diff(b).saturating_mul(10) > a.max(b);
    let old_moved = tenth(clean.obtainable_now, fresh.obtainable_now)
        || tenth(clean.after_compaction, fresh.after_compaction);
    let pick = |moved: bool| request.min(if moved { fresh } else { clean }.after_compaction);
    (pick(moved_materially(clean, fresh)), pick(old_moved))
}

/// The estimate for a grow of `size` from 0 on the whole machine, as the
/// engine takes it (its guard and headroom).
fn predict(
    kernel: &SysfsKernel,
    size: PageSize,
    request: u64,
) -> Result<(u64, (u64, u64)), String> {
    let lists = kernel.free_lists().map_err(|e| e.to_string())?;
    let guard = ENGINE_GUARD + guard_headroom(ENGINE_GUARD);
    let estimate = lists.for_scope(size, PoolScope::Global, guard);
    Ok((
        request.min(estimate.after_compaction),
        (estimate.obtainable_now, estimate.after_compaction),
    ))
}

fn bench() -> Result<(), String> {
    let base = env_number("HUGEPOOL_FRAGMENT_PAGES", 6144)?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (it writes the hugetlb pools and /proc/sys/vm)".into());
    }
    eprintln!("waiting for the real-kernel lock (hugepool-real-kernel.lock)");
    let _lock = hugepool_e2e::lock_machine_kernel();
    // Each state is made anew: its pageblock counts too.
    let kernel = SysfsKernel::default().with_pageblock_counts_max_age(Duration::ZERO);
    let overcommit = format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB/nr_overcommit_hugepages",
        MI2.bytes() / 1024
    );
    let mut files = Vec::new();
    for path in [overcommit.as_str(), PROACTIVENESS, WATERMARK_BOOST] {
        files.push((PathBuf::from(path), read(path)?));
    }
    let mut pools = Vec::new();
    for size in [MI2, GI1] {
        pools.push((
            size,
            kernel.pool(size).map_err(|e| e.to_string())?.persistent(),
        ));
    }
    let _restore = Restore {
        kernel: kernel.clone(),
        pools,
        files,
    };
    write(&overcommit, "0")?;
    write(PROACTIVENESS, "0")?;
    write(WATERMARK_BOOST, "0")?;

    let dir = Path::new("/var/tmp");
    let mut cache = CacheFile::create(
        dir.join(format!("hugepool-fragment-{}.dat", std::process::id())),
        CACHE_FILE_BYTES,
    )?;
    reset(&kernel, &cache)?;
    let available = mem_available()?;
    let anon_max = anon_bytes(available)?;
    eprintln!(
        "MemAvailable {:.1} GiB clean; states up to {:.1} GiB page cache and {:.1} GiB anonymous, \
         every other 1 MiB freed; {base} x 2Mi asked ({:.1} GiB), twice that past the guard; \
         guard {ENGINE_GUARD_ARG}",
        gib(available),
        gib(CACHE_FILE_BYTES),
        gib(anon_max),
        gib(base * MI2.bytes()),
    );

    // HUGEPOOL_FRAGMENT_STATES: state names separated by semicolons, to
    // run (all when unset).
    let only: Option<Vec<String>> = std::env::var("HUGEPOOL_FRAGMENT_STATES")
        .ok()
        .map(|names| names.split(';').map(|n| n.trim().to_string()).collect());
    let mut rows: Vec<Row> = Vec::new();
    for (index, state) in STATES.iter().enumerate() {
        if only
            .as_ref()
            .is_some_and(|only| !only.iter().any(|n| n == state.name))
        {
            continue;
        }
        let request = (base as f64 * state.request) as u64;
        // What an agent's status showed before the state was made: the
        // clean machine's estimate, kept or replaced as the agent's status
        // writer settles it (status::moved_materially) and as it did before
        // (a tenth either way).
        reset(&kernel, &cache)?;
        let clean = predict(&kernel, MI2, request)?.1;
        let ways = if index % 2 == 0 {
            [Way::FreeLists, Way::Before]
        } else {
            [Way::Before, Way::FreeLists]
        };
        let mut grows = Vec::new();
        for way in ways {
            let (held, cache_kept) = make_state(&kernel, &mut cache, state, anon_max)?;
            let mut grow = engine(&kernel, MI2, request, way, cache_kept)?;
            drop(held);
            grow.shown = Some(shown(clean, grow.estimate, request));
            eprintln!(
                "{:<32} {:<10} predicted {:>5} reached {:>5} of {request} in {:>7.1} ms, {:>3} writes, \
                 max {:>6.1} ms, {} compactions; estimate now {} after {}; MemAvailable {:.1} GiB, cache kept {:.1} GiB",
                state.name,
                way.name(),
                grow.predicted,
                grow.reached,
                ms(grow.total),
                grow.writes.len(),
                ms(grow.max_write()),
                grow.compactions,
                grow.estimate.0,
                grow.estimate.1,
                gib(grow.before.mem_available),
                gib(cache_kept),
            );
            grows.push((way, grow));
        }
        grows.sort_by_key(|(way, _)| *way != Way::FreeLists);
        let (held, cache_kept) = make_state(&kernel, &mut cache, state, anon_max)?;
        let gigantic = engine(&kernel, GI1, GIGANTIC_REQUEST, Way::FreeLists, cache_kept)?;
        drop(held);
        eprintln!(
            "{:<32} 1Gi        predicted {:>5} reached {:>5} of {GIGANTIC_REQUEST} in {:>7.1} ms",
            state.name,
            gigantic.predicted,
            gigantic.reached,
            ms(gigantic.total),
        );
        rows.push((*state, grows, gigantic));
    }
    reset(&kernel, &cache)?;
    drop(cache);
    let table = print_table(&rows, base);
    let saved = save_raw(&rows, base, anon_max, available, &table)?;
    println!("\nRaw results: {}", saved.display());
    Ok(())
}

/// `hugepool-agent resize` of `size` to `pages` from 0 (cold: no model
/// file), with the bench's guard, and the estimate read right before.
/// Exit 2 (short of the target) is a result, not an error.
fn engine(
    kernel: &SysfsKernel,
    size: PageSize,
    pages: u64,
    way: Way,
    cache_kept: u64,
) -> Result<Grow, String> {
    let reads = (
        read_time("/proc/buddyinfo")?,
        read_time("/proc/pagetypeinfo")?,
    );
    let before = Snapshot::take()?;
    let (predicted, estimate) = predict(kernel, size, pages)?;
    let goal = pages.to_string();
    let size_arg = size.to_string();
    let mut command = Command::new(env!("CARGO_BIN_EXE_hugepool-agent"));
    command.args([
        "resize",
        "--page-size",
        &size_arg,
        "--pages",
        &goal,
        "--min-mem-available",
        ENGINE_GUARD_ARG,
        "--output",
        "json",
    ]);
    if way == Way::Before {
        command.arg("--no-free-lists");
    }
    let sampler = Sampler::start();
    let started = Instant::now();
    let output = command.output();
    let wall = started.elapsed();
    let (min_available, _) = sampler.finish();
    let after = Snapshot::take()?;
    let output = output.map_err(|e| format!("run hugepool-agent: {e}"))?;
    if !matches!(output.status.code(), Some(0 | 2)) {
        return Err(format!(
            "hugepool-agent failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| format!("agent summary: {e}"))?;
    let seconds = |value: &serde_json::Value| value.as_f64().map(Duration::from_secs_f64);
    Ok(Grow {
        size,
        request: pages,
        predicted,
        estimate,
        shown: None,
        reached: report["achieved"]
            .as_u64()
            .ok_or("summary has no achieved")?,
        total: seconds(&report["durationSeconds"]).unwrap_or(wall),
        writes: report["writeSeconds"]
            .as_array()
            .map(|all| all.iter().filter_map(seconds).collect())
            .unwrap_or_default(),
        compactions: report["compactions"].as_u64().unwrap_or(0) as u32,
        outcome: report["outcome"].clone(),
        min_available,
        cache_kept,
        reads,
        before,
        after,
    })
}

/// Reads of each free-list file timed per grow.
const READS: usize = 5;

/// The median time of `READS` whole reads of `path`.
fn read_time(path: &str) -> Result<Duration, String> {
    let mut times = Vec::with_capacity(READS);
    for _ in 0..READS {
        let started = Instant::now();
        std::fs::read(path).map_err(|e| format!("read {path}: {e}"))?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times[READS / 2])
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn print_table(rows: &[Row], base: u64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nGrow of 2Mi pages from 0 ({base} asked, {} past the guard) and of {GIGANTIC_REQUEST} x 1Gi, \
         per state of memory; guard --min-mem-available {ENGINE_GUARD_ARG}; each grow on the state made anew\n",
        2 * base
    );
    let _ = writeln!(
        out,
        "| state | asked | predicted | reached (free lists) | error | status showed (error): agent / a tenth either way | reached (before) | time free lists / before (ms) | writes | compactions | max write (ms) | 1Gi predicted / reached | read buddyinfo / pagetypeinfo (ms) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    // Signed errors, (predicted - reached) / asked: fresh, the agent's
    // status, the tenth rule's.
    let mut signed: [Vec<f64>; 3] = Default::default();
    let mut errors = Vec::new();
    let mut ratios = Vec::new();
    let mut zeros = (0, 0);
    for (state, grows, gigantic) in rows {
        let [(_, with), (_, before)] = &grows[..] else {
            continue;
        };
        errors.push(with.error());
        let (status, tenth) = with.shown.unwrap_or((with.predicted, with.predicted));
        signed[0].push(with.signed_error(with.predicted));
        signed[1].push(with.signed_error(status));
        signed[2].push(with.signed_error(tenth));
        ratios.push(with.total.as_secs_f64() / before.total.as_secs_f64().max(1e-9));
        for grow in [with, gigantic] {
            if grow.reached == 0 {
                zeros.1 += 1;
                if grow.predicted == 0 {
                    zeros.0 += 1;
                }
            }
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.1}% | {} ({:+.1}%) / {} ({:+.1}%) | {} | {:.0} / {:.0} | {} / {} | {} / {} | {:.0} / {:.0} | {} / {} | {:.2} / {:.1} |",
            state.name,
            with.request,
            with.predicted,
            with.reached,
            100.0 * with.error(),
            status,
            100.0 * with.signed_error(status),
            tenth,
            100.0 * with.signed_error(tenth),
            before.reached,
            ms(with.total),
            ms(before.total),
            with.writes.len(),
            before.writes.len(),
            with.compactions,
            before.compactions,
            ms(with.max_write()),
            ms(before.max_write()),
            gigantic.predicted,
            gigantic.reached,
            ms(with.reads.0),
            ms(with.reads.1),
        );
    }
    let gigantic_errors: Vec<f64> = rows.iter().map(|(_, _, g)| g.error()).collect();
    let _ = writeln!(
        out,
        "\n2Mi: median |predicted - reached| / asked {:.1}% (max {:.1}%) over {} states; 1Gi: median {:.1}% (max {:.1}%).\n\
         Grows the kernel gave nothing (2Mi and 1Gi): {}, predicted 0 in {}.\n\
         Time with the free lists against before: median {:.2}x (min {:.2}x, max {:.2}x).",
        100.0 * median(errors.clone()),
        100.0 * errors.iter().copied().fold(0.0, f64::max),
        errors.len(),
        100.0 * median(gigantic_errors.clone()),
        100.0 * gigantic_errors.iter().copied().fold(0.0, f64::max),
        zeros.1,
        zeros.0,
        median(ratios.clone()),
        ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratios.iter().copied().fold(0.0, f64::max),
    );
    for (name, errors) in [
        ("fresh estimate", &signed[0]),
        ("the agent's status", &signed[1]),
        ("a status settled a tenth either way", &signed[2]),
    ] {
        let over: Vec<f64> = errors.iter().copied().filter(|e| *e > 0.0).collect();
        let _ = writeln!(
            out,
            "2Mi, {name}: (predicted - reached) / asked median {:+.1}%, mean {:+.1}%, most over {:+.1}%; over-predicted in {} of {} states.",
            100.0 * median(errors.clone()),
            100.0 * errors.iter().sum::<f64>() / errors.len().max(1) as f64,
            100.0 * over.iter().copied().fold(0.0, f64::max),
            over.len(),
            errors.len(),
        );
    }
    let reads = |pick: fn(&Grow) -> Duration| -> Vec<f64> {
        rows.iter()
            .flat_map(|(_, grows, _)| grows.iter().map(move |(_, g)| ms(pick(g))))
            .collect()
    };
    let (buddy, types) = (reads(|g| g.reads.0), reads(|g| g.reads.1));
    let _ = writeln!(
        out,
        "Reading the free lists before a grow: /proc/buddyinfo median {:.2} ms (max {:.2}), \
         /proc/pagetypeinfo median {:.1} ms (max {:.1}).",
        median(buddy.clone()),
        buddy.iter().copied().fold(0.0, f64::max),
        median(types.clone()),
        types.iter().copied().fold(0.0, f64::max),
    );
    print!("{out}");
    out
}

/// Every grow of this run as JSON, next to BENCH.md (one file per run of
/// the bench, named by its start time), with the table it printed.
fn save_raw(
    rows: &[Row],
    base: u64,
    anon_max: u64,
    available: u64,
    table: &str,
) -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    let mut runs = Vec::new();
    for (state, grows, gigantic) in rows {
        for (way, grow) in grows {
            runs.push(grow.json(state, *way));
        }
        runs.push(gigantic.json(state, Way::FreeLists));
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let now = jiff::Timestamp::now();
    let document = serde_json::json!({
        "bench": "fragment",
        "at": now.to_string(),
        "kernel": release.trim(),
        "pages": base,
        "engineGuardBytes": ENGINE_GUARD,
        "cleanMemAvailableBytes": available,
        "cacheFileBytes": CACHE_FILE_BYTES,
        "anonMaxBytes": anon_max,
        "holeBytes": HOLE,
        "table": table,
        "runs": runs,
    });
    raw::write(
        &dir,
        &format!("fragment-{}.json", now.strftime("%Y%m%dT%H%M%SZ")),
        &document,
    )
}
