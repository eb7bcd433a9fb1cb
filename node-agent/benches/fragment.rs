//! Growing the 2Mi pool by N pages on fragmented memory (issue 12, point 3),
//! two ways, interleaved: one write of `nr_hugepages = N` (a DaemonSet's
//! `echo`) and the engine (`hugepool-agent resize`, cold, with its
//! compactions, retries and the default 1Gi memory guard passed
//! explicitly). Before every grow the bench fragments memory the same way:
//! page cache of a file on disk with every other 1 MiB dropped, and
//! anonymous memory (no THP, every page touched) with every other 1 MiB
//! freed, so few 2 MiB blocks are free although much memory is. It never
//! compacts between fragmenting and the grow, and records
//! /proc/buddyinfo and the /proc/vmstat compact_* counters before and after
//! each grow. A thread samples MemAvailable every 10 ms during each grow.
//! Prints medians per strategy and saves raw results to
//! node-agent/bench-results/ as JSON. Holds the real-kernel test lock, and
//! restores the 2Mi pool, its overcommit and the sysctls it changes.
//!
//! Environment: HUGEPOOL_FRAGMENT_PAGES (default 6144), HUGEPOOL_FRAGMENT_REPS
//! (default 5).

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

use hugepool_agent::kernel::{Kernel, PoolScope, SysfsKernel};
use hugepool_crds::PageSize;

const MI2: PageSize = PageSize::SIZE_2MI;
const GIB: u64 = 1 << 30;
/// The engine's default `--min-mem-available`, passed explicitly.
const ENGINE_GUARD: u64 = GIB;
const ENGINE_GUARD_ARG: &str = "1Gi";
/// The engine's default `--max-step-duration`, for counting writes past it.
const BUDGET: Duration = Duration::from_millis(50);
/// MemAvailable the bench never plans to go under, even if the one write
/// got every page it asked for.
const SAFE_FLOOR: u64 = 2 * GIB;
/// Room on top of the floor for whatever else runs on the machine (builds)
/// and for what fragmenting costs beyond the anonymous half kept (measured
/// about 1 GiB more than planned with a build beside it).
const MARGIN: u64 = 5 * GIB / 2;
/// The page-cache part of the fragmenter: a file this large (at most).
const CACHE_FILE_BYTES: u64 = 4 * GIB;
/// Alternate ranges of this size are dropped (cache) or freed (anonymous).
const HOLE: usize = 1 << 20;
const SAMPLE_EVERY: Duration = Duration::from_millis(10);
const PROACTIVENESS: &str = "/proc/sys/vm/compaction_proactiveness";
const WATERMARK_BOOST: &str = "/proc/sys/vm/watermark_boost_factor";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    OneWrite,
    Engine,
}

impl Strategy {
    fn name(self) -> &'static str {
        match self {
            Strategy::OneWrite => "one write",
            Strategy::Engine => "engine",
        }
    }
}

const STRATEGIES: [Strategy; 2] = [Strategy::OneWrite, Strategy::Engine];

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

fn compact_delta(before: &Snapshot, after: &Snapshot, name: &str) -> u64 {
    let value = |s: &Snapshot| s.compact.get(name).copied().unwrap_or(0);
    value(after).saturating_sub(value(before))
}

/// One measured grow from 0 on fragmented memory.
struct Grow {
    reached: u64,
    total: Duration,
    writes: Vec<Duration>,
    /// compact_memory writes the engine made (its summary).
    engine_compactions: Option<u32>,
    /// The engine's outcome as its summary says it.
    outcome: Option<serde_json::Value>,
    min_available: u64,
    samples: usize,
    /// The fragmenter's file bytes left in the page cache.
    cache_kept: u64,
    /// After the reset (free, drop caches, compact), before fragmenting.
    clean: Snapshot,
    /// After fragmenting, right before the grow.
    before: Snapshot,
    /// Right after the grow, pages still held.
    after: Snapshot,
}

impl Grow {
    fn max_write(&self) -> Duration {
        self.writes.iter().max().copied().unwrap_or_default()
    }
}

/// Restores the machine's settings when dropped, also on panic.
struct Restore {
    kernel: SysfsKernel,
    pool: u64,
    /// Files written as they were: overcommit, compaction sysctls.
    files: Vec<(PathBuf, String)>,
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(err) = self.kernel.write_pool(MI2, PoolScope::Global, self.pool) {
            eprintln!("could not restore {MI2}: {err}");
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

/// How much anonymous memory the fragmenter maps, from MemAvailable on a
/// clean machine: enough that most free memory ends up with holes in it,
/// little enough that a grow of every requested page still leaves
/// SAFE_FLOOR + MARGIN available. Half the mapping stays resident; the page
/// cache counts as available throughout.
struct Sizing {
    anon: u64,
    cache: u64,
    available: u64,
}

fn size_fragmenter(available: u64, wanted: u64) -> Result<Sizing, String> {
    let reserve = SAFE_FLOOR + MARGIN;
    let after_grow = available.saturating_sub(wanted + reserve);
    let while_filling = available.saturating_sub(reserve + CACHE_FILE_BYTES);
    let anon = (2 * after_grow).min(while_filling) / GIB * GIB;
    let sizing = Sizing {
        anon,
        cache: CACHE_FILE_BYTES,
        available,
    };
    let unfragmented = available.saturating_sub(sizing.anon + sizing.cache);
    if unfragmented >= wanted {
        return Err(format!(
            "{} x 2Mi ({:.1} GiB) fits in the {:.1} GiB the fragmenter can leave untouched \
             with MemAvailable {:.1} GiB and a {:.1} GiB floor; ask for more pages \
             (HUGEPOOL_FRAGMENT_PAGES)",
            wanted / MI2.bytes(),
            gib(wanted),
            gib(unfragmented),
            gib(available),
            gib(reserve)
        ));
    }
    if sizing.anon < 2 * GIB {
        return Err(format!(
            "MemAvailable {:.1} GiB leaves no room to fragment under a grow of {:.1} GiB \
             that keeps {:.1} GiB available; ask for fewer pages (HUGEPOOL_FRAGMENT_PAGES)",
            gib(available),
            gib(wanted),
            gib(reserve)
        ));
    }
    Ok(sizing)
}

/// Gives the pool back, frees the fragmenter and starts from a clean,
/// compacted machine (compacting here is before fragmenting, never between
/// fragmenting and a grow).
fn reset(kernel: &SysfsKernel, cache: &CacheFile) -> Result<(), String> {
    kernel
        .write_pool(MI2, PoolScope::Global, 0)
        .map_err(|e| e.to_string())?;
    cache.drop_all()?;
    write("/proc/sys/vm/drop_caches", "3")?;
    kernel.compact(PoolScope::Global).map_err(|e| e.to_string())
}

fn bench() -> Result<(), String> {
    let reps = env_number("HUGEPOOL_FRAGMENT_REPS", 5)?.max(1) as usize;
    let pages = env_number("HUGEPOOL_FRAGMENT_PAGES", 6144)?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (it writes the hugetlb pools and /proc/sys/vm)".into());
    }
    eprintln!("waiting for the real-kernel lock (hugepool-real-kernel.lock)");
    let _lock = hugepool_e2e::lock_machine_kernel();
    let kernel = SysfsKernel::default();
    let overcommit = format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB/nr_overcommit_hugepages",
        MI2.bytes() / 1024
    );
    let mut files = Vec::new();
    for path in [overcommit.as_str(), PROACTIVENESS, WATERMARK_BOOST] {
        files.push((PathBuf::from(path), read(path)?));
    }
    let _restore = Restore {
        kernel: kernel.clone(),
        pool: kernel.pool(MI2).map_err(|e| e.to_string())?.persistent(),
        files,
    };
    // Only the persistent pool grows; kcompactd stays out of the way between
    // fragmenting and the grow, so the counters are the grow's own.
    write(&overcommit, "0")?;
    write(PROACTIVENESS, "0")?;
    write(WATERMARK_BOOST, "0")?;

    let dir = Path::new("/var/tmp");
    let mut cache = CacheFile::create(
        dir.join(format!("hugepool-fragment-{}.dat", std::process::id())),
        CACHE_FILE_BYTES,
    )?;
    reset(&kernel, &cache)?;
    std::thread::sleep(Duration::from_millis(500));
    let wanted = pages * MI2.bytes();
    let sizing = size_fragmenter(mem_available()?, wanted)?;
    eprintln!(
        "MemAvailable {:.1} GiB clean; fragmenter: {:.1} GiB page cache and {:.1} GiB \
         anonymous, each with every other 1 MiB freed; grow of {pages} x 2Mi ({:.1} GiB)",
        gib(sizing.available),
        gib(sizing.cache),
        gib(sizing.anon),
        gib(wanted)
    );

    let mut results: Vec<(Strategy, Vec<Grow>)> =
        STRATEGIES.iter().map(|s| (*s, Vec::new())).collect();
    for rep in 0..reps {
        // Alternate which strategy goes first.
        for i in 0..STRATEGIES.len() {
            let strategy = STRATEGIES[(i + rep) % STRATEGIES.len()];
            reset(&kernel, &cache)?;
            std::thread::sleep(Duration::from_millis(500));
            let clean = Snapshot::take()?;
            let cache_kept = cache.fill_with_holes()?;
            let anon = AnonHoles::new(sizing.anon as usize)?;
            std::thread::sleep(Duration::from_millis(200));
            let before = Snapshot::take()?;
            if before.mem_available < wanted + SAFE_FLOOR {
                return Err(format!(
                    "MemAvailable {:.1} GiB after fragmenting: a grow of {:.1} GiB could take it \
                     under {:.1} GiB (something else uses memory now); stopped",
                    gib(before.mem_available),
                    gib(wanted),
                    gib(SAFE_FLOOR)
                ));
            }
            let grow = match strategy {
                Strategy::OneWrite => one_write(&kernel, pages, clean, before, cache_kept)?,
                Strategy::Engine => engine(pages, clean, before, cache_kept)?,
            };
            drop(anon);
            eprintln!(
                "rep {} {:<9} reached {:>5} of {pages} in {:>7.1} ms, {:>3} writes, max {:>7.1} ms, \
                 start: cache kept {:.2} GiB, {} free 2Mi blocks of {} MemFree allows, MemAvailable {:.2} GiB, \
                 end {:.2} GiB, min {:.2} GiB; compact_stall +{}, engine compactions {}",
                rep + 1,
                strategy.name(),
                grow.reached,
                ms(grow.total),
                grow.writes.len(),
                ms(grow.max_write()),
                gib(grow.cache_kept),
                grow.before.free_2mi_blocks,
                grow.before.free_allows(),
                gib(grow.before.mem_available),
                gib(grow.after.mem_available),
                gib(grow.min_available),
                compact_delta(&grow.before, &grow.after, "compact_stall"),
                grow.engine_compactions
                    .map_or("-".to_string(), |c| c.to_string()),
            );
            if let Some((_, runs)) = results.iter_mut().find(|(s, _)| *s == strategy) {
                runs.push(grow);
            }
        }
    }
    reset(&kernel, &cache)?;
    drop(cache);
    let table = print_table(&results, pages, reps, &sizing);
    let saved = save_raw(&results, pages, reps, &sizing, &table)?;
    println!("\nRaw results: {}", saved.display());
    Ok(())
}

/// `echo N > nr_hugepages`: one write, whatever the kernel gives.
fn one_write(
    kernel: &SysfsKernel,
    pages: u64,
    clean: Snapshot,
    before: Snapshot,
    cache_kept: u64,
) -> Result<Grow, String> {
    let sampler = Sampler::start();
    let started = Instant::now();
    let written = kernel.write_pool(MI2, PoolScope::Global, pages);
    let write = started.elapsed();
    let reached = kernel.pool(MI2).map_err(|e| e.to_string());
    let total = started.elapsed();
    let (min_available, samples) = sampler.finish();
    written.map_err(|e| e.to_string())?;
    Ok(Grow {
        reached: reached?.persistent(),
        total,
        writes: vec![write],
        engine_compactions: None,
        outcome: None,
        min_available,
        samples,
        cache_kept,
        clean,
        before,
        after: Snapshot::take()?,
    })
}

/// `hugepool-agent resize --pages N` with its defaults (cold: no model
/// file) and the guard named; writes and compactions from its summary.
/// Exit 2 (short of the target) is a result, not an error.
fn engine(pages: u64, clean: Snapshot, before: Snapshot, cache_kept: u64) -> Result<Grow, String> {
    let goal = pages.to_string();
    let mut command = Command::new(env!("CARGO_BIN_EXE_hugepool-agent"));
    command.args([
        "resize",
        "--page-size",
        "2Mi",
        "--pages",
        &goal,
        "--min-mem-available",
        ENGINE_GUARD_ARG,
        "--output",
        "json",
    ]);
    let sampler = Sampler::start();
    let started = Instant::now();
    let output = command.output();
    let wall = started.elapsed();
    let (min_available, samples) = sampler.finish();
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
        reached: report["achieved"]
            .as_u64()
            .ok_or("summary has no achieved")?,
        total: seconds(&report["durationSeconds"]).unwrap_or(wall),
        writes: report["writeSeconds"]
            .as_array()
            .map(|all| all.iter().filter_map(seconds).collect())
            .unwrap_or_default(),
        engine_compactions: report["compactions"].as_u64().map(|c| c as u32),
        outcome: Some(report["outcome"].clone()),
        min_available,
        samples,
        cache_kept,
        clean,
        before,
        after,
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn print_table(
    results: &[(Strategy, Vec<Grow>)],
    pages: u64,
    reps: usize,
    sizing: &Sizing,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nGrow 0 -> {pages} x 2Mi ({:.1} GiB) on fragmented memory ({:.1} GiB page cache and \
         {:.1} GiB anonymous, every other 1 MiB freed), medians of {reps} interleaved \
         repetitions; engine guard --min-mem-available {ENGINE_GUARD_ARG}\n",
        gib(pages * MI2.bytes()),
        gib(sizing.cache),
        gib(sizing.anon),
    );
    let _ = writeln!(
        out,
        "| strategy | reached | % of N | fewest reached | runs at N | total ms | writes | max write ms | writes over 50 ms | engine compactions | \
         kernel direct compactions | free 2Mi blocks at start | MemFree allows | cache kept GiB | \
         MemAvailable start GiB | MemAvailable end GiB | min MemAvailable GiB | runs under guard |"
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (strategy, runs) in results {
        let med = |f: &dyn Fn(&Grow) -> f64| median(runs.iter().map(f).collect());
        let reached = med(&|g| g.reached as f64);
        let under = runs
            .iter()
            .filter(|g| g.min_available < ENGINE_GUARD)
            .count();
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.1}% | {} | {} of {} | {:.1} | {:.0} | {:.1} | {:.0} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {under} of {} |",
            strategy.name(),
            reached,
            100.0 * reached / pages as f64,
            runs.iter().map(|g| g.reached).min().unwrap_or(0),
            runs.iter().filter(|g| g.reached == pages).count(),
            runs.len(),
            med(&|g| ms(g.total)),
            med(&|g| g.writes.len() as f64),
            med(&|g| ms(g.max_write())),
            med(&|g| g.writes.iter().filter(|w| **w > BUDGET).count() as f64),
            match strategy {
                Strategy::OneWrite => "-".to_string(),
                Strategy::Engine => format!(
                    "{:.0}",
                    med(&|g| f64::from(g.engine_compactions.unwrap_or(0)))
                ),
            },
            med(&|g| compact_delta(&g.before, &g.after, "compact_stall") as f64),
            med(&|g| g.before.free_2mi_blocks as f64),
            med(&|g| g.before.free_allows() as f64),
            med(&|g| gib(g.cache_kept)),
            med(&|g| gib(g.before.mem_available)),
            med(&|g| gib(g.after.mem_available)),
            med(&|g| gib(g.min_available)),
            runs.len(),
        );
    }
    let all: Vec<&Grow> = results.iter().flat_map(|(_, runs)| runs.iter()).collect();
    let lowest = all.iter().map(|g| g.min_available).min().unwrap_or(0);
    let background = all
        .iter()
        .map(|g| compact_delta(&g.clean, &g.before, "compact_daemon_wake"))
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        out,
        "\nFree 2Mi blocks: order >= 9 in /proc/buddyinfo (order 10 counts 2), right before the \
         grow; MemFree allows: MemFree / 2 MiB. Kernel direct compactions: compact_stall in \
         /proc/vmstat during the grow. Fewest reached and runs at N: over all repetitions, \
         not medians. Lowest MemAvailable sampled in any grow: {:.2} GiB \
         (every {} ms); kcompactd woke at most {background} times between the clean start and \
         a grow (compaction_proactiveness and watermark_boost_factor 0 during the bench).",
        gib(lowest),
        SAMPLE_EVERY.as_millis(),
    );
    print!("{out}");
    out
}

/// Every grow of this run as JSON, next to BENCH.md (one file per run of
/// the bench, named by its start time), with the table it printed.
fn save_raw(
    results: &[(Strategy, Vec<Grow>)],
    pages: u64,
    reps: usize,
    sizing: &Sizing,
    table: &str,
) -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    let runs: Vec<serde_json::Value> = results
        .iter()
        .flat_map(|(strategy, runs)| {
            runs.iter().map(move |grow| {
                serde_json::json!({
                    "strategy": strategy.name(),
                    "reached": grow.reached,
                    "totalMs": ms(grow.total),
                    "writesMs": grow.writes.iter().map(|w| ms(*w)).collect::<Vec<_>>(),
                    "maxWriteMs": ms(grow.max_write()),
                    "engineCompactions": grow.engine_compactions,
                    "outcome": grow.outcome,
                    "minMemAvailableBytes": grow.min_available,
                    "memAvailableSamples": grow.samples,
                    "cacheKeptBytes": grow.cache_kept,
                    "clean": grow.clean.json(),
                    "before": grow.before.json(),
                    "after": grow.after.json(),
                })
            })
        })
        .collect();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let now = jiff::Timestamp::now();
    let document = serde_json::json!({
        "bench": "fragment",
        "at": now.to_string(),
        "kernel": release.trim(),
        "pages": pages,
        "repetitions": reps,
        "engineGuardBytes": ENGINE_GUARD,
        "safeFloorBytes": SAFE_FLOOR,
        "cleanMemAvailableBytes": sizing.available,
        "cacheFileBytes": sizing.cache,
        "anonBytes": sizing.anon,
        "holeBytes": HOLE,
        "sampleEveryMs": ms(SAMPLE_EVERY),
        "table": table,
        "runs": runs,
    });
    raw::write(
        &dir,
        &format!("fragment-{}.json", now.strftime("%Y%m%dT%H%M%SZ")),
        &document,
    )
}
