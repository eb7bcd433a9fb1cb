//! Freeing and growing hugetlb pools on the real kernel, with HVO off and
//! on, several ways, interleaved: one write, fixed steps, and the engine
//! (`hugepool-agent resize`, 50 ms budget) starting cold and starting from a
//! saved cost model. Two matrices: 1Gi pages, half as many as the kernel
//! can allocate at the start (of HUGEPOOL_BENCH_1GI_PAGES, default 8; none
//! when it gives fewer than 2), first, while memory is least fragmented;
//! then 8192 x 2Mi. Per (size, HVO,
//! direction) it fits the write cost `a + b*n` to this run's one-write and
//! fixed-step writes and prints the best any budget-keeping strategy can do,
//! T* = k*a + b*N + (k-1)*pause*w/B with k = ceil(b*N / (B - a)) writes of
//! w = a + b*N/k each (the engine's pause is in proportion), beside
//! each strategy's medians. Then it repeats the 2Mi engine resizes until
//! each engine row has HUGEPOOL_BENCH_MIN_WRITES writes (default 1000), for
//! a p99 that is not just the largest write. Raw results go to
//! node-agent/bench-results/ as JSON, with an SVG of each write's latency
//! over its resize beside them (benches/common/plot.rs). Holds the real-kernel test lock;
//! saves and restores every pool and HVO.
//!
//! Environment: HUGEPOOL_BENCH_REPS (default 5), HUGEPOOL_BENCH_PAGES
//! (default 8192), HUGEPOOL_BENCH_1GI_PAGES, HUGEPOOL_BENCH_MIN_WRITES,
//! HUGEPOOL_BENCH_COLD_RUNS (default 20: the cold engine runs this many
//! times in the interleaved matrix, a node's first resize being the one
//! whose longest write issue 30 found at three times the budget).

#[path = "common/plot.rs"]
mod plot;
#[path = "common/raw.rs"]
mod raw;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use hugepool_agent::kernel::{Kernel, PoolScope, SysfsKernel, cpu_wait};
use hugepool_crds::PageSize;

const MI2: PageSize = PageSize::SIZE_2MI;
const GI1: PageSize = PageSize::SIZE_1GI;
const KEEP_FREE: u64 = 4 << 30;
/// The engine's defaults, which T* is computed for.
const BUDGET: Duration = Duration::from_millis(50);
const PAUSE: Duration = Duration::from_millis(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Shrink,
    Grow,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::Shrink => "shrink",
            Direction::Grow => "grow",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    OneWrite,
    Fixed(u64),
    EngineCold,
    EngineWarm,
}

impl Strategy {
    fn name(self) -> String {
        match self {
            Strategy::OneWrite => "one write".into(),
            Strategy::Fixed(step) => format!("fixed steps of {step}"),
            Strategy::EngineCold => "engine, cold start".into(),
            Strategy::EngineWarm => "engine, saved model".into(),
        }
    }

    fn is_engine(self) -> bool {
        matches!(self, Strategy::EngineCold | Strategy::EngineWarm)
    }
}

/// One page size's matrix: `pages` of `size`, these strategies.
struct Matrix {
    size: PageSize,
    pages: u64,
    strategies: Vec<Strategy>,
}

/// One measured resize.
struct Run {
    total: Duration,
    /// Each write's pages and latency.
    writes: Vec<(u64, Duration)>,
    /// Of each write's latency, the writer's wait for a CPU (run queue
    /// wait, `hugepool_agent::kernel::cpu_wait`), index for index.
    cpu_waits: Vec<Option<Duration>>,
    /// Persistent pages at the end.
    reached: u64,
    peak_rss: Option<u64>,
    /// Part of the interleaved matrix (medians come from these only); the
    /// rest are the engine's extra resizes for the p99.
    interleaved: bool,
}

type Key = (PageSize, bool, Direction, Strategy);

/// Restores the machine's hugetlb settings when dropped, also on panic.
struct Restore {
    kernel: SysfsKernel,
    pools: Vec<(PageSize, u64)>,
    hvo: Option<bool>,
}

impl Drop for Restore {
    fn drop(&mut self) {
        for (size, pages) in &self.pools {
            if let Err(err) = self.kernel.write_pool(*size, PoolScope::Global, *pages) {
                eprintln!("could not restore {size}: {err}");
            }
        }
        if let Some(on) = self.hvo
            && let Err(err) = self.kernel.set_hvo(on)
        {
            eprintln!("could not restore HVO: {err}");
        }
    }
}

fn main() -> ExitCode {
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this
    // binary too, and a test run must not spend a minute resizing pools.
    if !std::env::args().any(|arg| arg == "--bench") {
        eprintln!("resize benchmark: run it with `cargo bench -p hugepool-agent --bench resize`");
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

fn model_file(size: PageSize, hvo: bool) -> PathBuf {
    std::env::temp_dir().join(format!(
        "hugepool-bench-model-{size}-hvo{}.json",
        u8::from(hvo)
    ))
}

fn bench() -> Result<(), String> {
    let reps = env_number("HUGEPOOL_BENCH_REPS", 5)?.max(1) as usize;
    let pages = env_number("HUGEPOOL_BENCH_PAGES", 8192)?;
    let min_writes = env_number("HUGEPOOL_BENCH_MIN_WRITES", 1000)? as usize;
    let cold_runs = env_number("HUGEPOOL_BENCH_COLD_RUNS", 20)? as usize;
    let kernel = SysfsKernel::default();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (it writes the hugetlb pools)".into());
    }
    // Tests that write pools take the same lock: never run beside them.
    let _lock = hugepool_e2e::lock_machine_kernel();
    let available = kernel.meminfo().map_err(|e| e.to_string())?.available_bytes;
    if available < pages * MI2.bytes() + KEEP_FREE {
        return Err(format!(
            "{pages} x 2Mi needs {} MiB plus 4 GiB free; MemAvailable is {} MiB",
            (pages * MI2.bytes()) >> 20,
            available >> 20
        ));
    }
    let mut pools = Vec::new();
    for size in kernel.page_sizes().map_err(|e| e.to_string())? {
        pools.push((
            size,
            kernel.pool(size).map_err(|e| e.to_string())?.persistent(),
        ));
    }
    let restore = Restore {
        kernel: kernel.clone(),
        pools,
        hvo: kernel.hvo().map_err(|e| e.to_string())?,
    };

    let mut results: Vec<(Key, Vec<Run>)> = Vec::new();
    let mut notes = Vec::new();
    let gi1 = probe_1gi(&kernel, env_number("HUGEPOOL_BENCH_1GI_PAGES", 8)?)?;
    match gi1 {
        Some((_, allocated)) if allocated >= 2 => {
            let matrix = Matrix {
                size: GI1,
                // Half of what the kernel gave, so that memory taken by
                // others between a shrink and the next fill does not end
                // the matrix (6 of 6 could not be refilled once).
                pages: (allocated / 2).max(2),
                strategies: vec![
                    Strategy::OneWrite,
                    Strategy::Fixed(1),
                    Strategy::EngineCold,
                    Strategy::EngineWarm,
                ],
            };
            // Memory fragments as the bench goes on: a 1Gi pool that cannot
            // be refilled ends the 1Gi matrix, not the bench.
            if let Err(err) = run_matrix(&kernel, &matrix, reps, cold_runs, &mut results) {
                notes.push(format!("1Gi matrix stopped early: {err}"));
            }
            kernel
                .write_pool(GI1, PoolScope::Global, 0)
                .map_err(|e| e.to_string())?;
        }
        _ => {}
    }
    notes.push(match gi1 {
        Some((requested, allocated)) => format!(
            "1Gi: the kernel allocated {allocated} of {requested} pages at the start (page \
             cache dropped, three compactions); the 1Gi rows use half of that, at least 2 \
             (none when it got fewer than 2)"
        ),
        None => "1Gi: this kernel offers no 1Gi pages".to_string(),
    });
    let matrix = Matrix {
        size: MI2,
        pages,
        strategies: vec![
            Strategy::OneWrite,
            Strategy::Fixed(64),
            Strategy::Fixed(1024),
            Strategy::EngineCold,
            Strategy::EngineWarm,
        ],
    };
    run_matrix(&kernel, &matrix, reps, cold_runs, &mut results)?;
    engine_writes_for_p99(&kernel, &matrix, min_writes, &mut results)?;
    drop(restore);
    let mut table = String::new();
    for size in [GI1, MI2] {
        if results.iter().any(|((s, ..), _)| *s == size) {
            table.push_str(&print_table(&results, size, reps));
        }
    }
    for note in notes {
        println!("{note}");
        table.push_str(&note);
        table.push('\n');
    }
    let saved = save_raw(&results, reps, &table)?;
    println!("\nRaw results: {}", saved.display());
    // Drawn from the saved file, as the plot-resize example redraws it.
    let document: serde_json::Value = std::fs::read_to_string(&saved)
        .map_err(|e| e.to_string())
        .and_then(|text| serde_json::from_str(&text).map_err(|e| e.to_string()))
        .map_err(|e| format!("{}: {e}", saved.display()))?;
    let picture = saved.with_extension("svg");
    plot::plot_raw(&document, &picture)?;
    println!("Write latency plot: {}", picture.display());
    Ok(())
}

/// The interleaved matrix of one size: per repetition, HVO off and on (in
/// alternating order), shrink and grow, every strategy in rotating order;
/// the cold engine as many times per repetition as makes `cold_runs` in all.
fn run_matrix(
    kernel: &SysfsKernel,
    matrix: &Matrix,
    reps: usize,
    cold_runs: usize,
    results: &mut Vec<(Key, Vec<Run>)>,
) -> Result<(), String> {
    let cold_per_rep = cold_runs.div_ceil(reps).max(1);
    let size = matrix.size;
    let pages = matrix.pages;
    for hvo in [false, true] {
        switch_hvo(kernel, size, hvo)?;
        // Seed the saved models (both directions) with untimed resizes:
        // enough for each model to hold its measured overruns (a model with
        // fewer than 16 sizes its writes as a cold one does).
        let _ = std::fs::remove_file(model_file(size, hvo));
        fill(kernel, size, pages)?;
        for _ in 0..4 {
            engine(size, Some(model_file(size, hvo)), 0)?;
            engine(size, Some(model_file(size, hvo)), pages)?;
        }
        for direction in [Direction::Shrink, Direction::Grow] {
            for strategy in &matrix.strategies {
                results.push(((size, hvo, direction, *strategy), Vec::new()));
            }
        }
    }
    let strategies = &matrix.strategies;
    for rep in 0..reps {
        for hvo in if rep % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            switch_hvo(kernel, size, hvo)?;
            for direction in [Direction::Shrink, Direction::Grow] {
                // Rotate the order so no strategy always runs first.
                let order = (0..strategies.len())
                    .map(|i| strategies[(i + rep) % strategies.len()])
                    .flat_map(|strategy| {
                        let times = if strategy == Strategy::EngineCold {
                            cold_per_rep
                        } else {
                            1
                        };
                        std::iter::repeat_n(strategy, times)
                    });
                for strategy in order {
                    let goal = prepare(kernel, size, pages, direction)?;
                    std::thread::sleep(Duration::from_millis(200));
                    let mut run = match strategy {
                        Strategy::OneWrite => fixed(kernel, size, pages - goal, goal, pages)?,
                        Strategy::Fixed(step) => fixed(kernel, size, pages - goal, goal, step)?,
                        Strategy::EngineCold => engine(size, None, goal)?,
                        Strategy::EngineWarm => engine(size, Some(model_file(size, hvo)), goal)?,
                    };
                    run.interleaved = true;
                    eprintln!(
                        "{size} rep {} hvo {} {:<6} {:<20} total {:>8.1} ms, {:>4} writes, max {:>6.1} ms, reached {}",
                        rep + 1,
                        u8::from(hvo),
                        direction.name(),
                        strategy.name(),
                        ms(run.total),
                        run.writes.len(),
                        ms(run.writes.iter().map(|w| w.1).max().unwrap_or_default()),
                        run.reached,
                    );
                    push_run(results, (size, hvo, direction, strategy), run);
                }
            }
        }
    }
    Ok(())
}

/// Turns HVO on or off with the pool empty. HVO applies when pages are
/// allocated, so pages kept across a switch free at the other state's cost:
/// before this, the first shrink after a switch to HVO on freed pages grown
/// with it off (8192 in 74 ms where the others took 150-250 ms), its warm
/// model learnt that cost, and the next warm resize wrote 4096 pages in one
/// 90 ms write; pages grown with HVO on made the first HVO-off shrink twice
/// as slow.
fn switch_hvo(kernel: &SysfsKernel, size: PageSize, on: bool) -> Result<(), String> {
    kernel
        .write_pool(size, PoolScope::Global, 0)
        .map_err(|e| e.to_string())?;
    kernel.set_hvo(on).map_err(|e| e.to_string())
}

/// Sets the pool up for a resize in `direction` and returns its goal: a
/// shrink starts from a full pool, a grow from an empty, compacted one (the
/// memory a shrink would have left).
fn prepare(
    kernel: &SysfsKernel,
    size: PageSize,
    pages: u64,
    direction: Direction,
) -> Result<u64, String> {
    match direction {
        Direction::Shrink => {
            fill(kernel, size, pages)?;
            Ok(0)
        }
        Direction::Grow => {
            kernel
                .write_pool(size, PoolScope::Global, 0)
                .map_err(|e| e.to_string())?;
            kernel
                .compact(PoolScope::Global)
                .map_err(|e| e.to_string())?;
            Ok(pages)
        }
    }
}

fn push_run(results: &mut [(Key, Vec<Run>)], key: Key, run: Run) {
    if let Some((_, runs)) = results.iter_mut().find(|(k, _)| *k == key) {
        runs.push(run);
    }
}

/// More engine resizes of the matrix's size, shrink and grow alternating
/// (HVO off and on, cold and warm), until every engine row holds
/// `min_writes` writes: a p99 over fewer than 100 writes is their maximum.
fn engine_writes_for_p99(
    kernel: &SysfsKernel,
    matrix: &Matrix,
    min_writes: usize,
    results: &mut [(Key, Vec<Run>)],
) -> Result<(), String> {
    let size = matrix.size;
    let writes_of = |results: &[(Key, Vec<Run>)], key: Key| -> usize {
        results
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, runs)| runs.iter().map(|r| r.writes.len()).sum())
    };
    for hvo in [false, true] {
        switch_hvo(kernel, size, hvo)?;
        for strategy in [Strategy::EngineCold, Strategy::EngineWarm] {
            let started = Instant::now();
            let mut resizes = 0;
            loop {
                let wanted: Vec<Direction> = [Direction::Shrink, Direction::Grow]
                    .into_iter()
                    .filter(|d| writes_of(results, (size, hvo, *d, strategy)) < min_writes)
                    .collect();
                if wanted.is_empty() {
                    break;
                }
                for direction in wanted {
                    let goal = prepare(kernel, size, matrix.pages, direction)?;
                    let model = (strategy == Strategy::EngineWarm).then(|| model_file(size, hvo));
                    let run = engine(size, model, goal)?;
                    push_run(results, (size, hvo, direction, strategy), run);
                    resizes += 1;
                }
            }
            eprintln!(
                "{size} hvo {} {}: {resizes} more resizes for the p99 in {:.0} s",
                u8::from(hvo),
                strategy.name(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// How many of `requested` 1Gi pages the kernel can allocate now, with the
/// help a grow gets (page cache dropped, memory compacted), then freed
/// again; None when the kernel has no 1Gi pool.
fn probe_1gi(kernel: &SysfsKernel, requested: u64) -> Result<Option<(u64, u64)>, String> {
    if !kernel
        .page_sizes()
        .map_err(|e| e.to_string())?
        .contains(&GI1)
    {
        return Ok(None);
    }
    // The 2Mi pool the matrix left is given back first.
    kernel
        .write_pool(MI2, PoolScope::Global, 0)
        .map_err(|e| e.to_string())?;
    let mut allocated = 0;
    for _ in 0..3 {
        std::fs::write("/proc/sys/vm/drop_caches", "3")
            .map_err(|e| format!("/proc/sys/vm/drop_caches: {e}"))?;
        kernel
            .compact(PoolScope::Global)
            .map_err(|e| e.to_string())?;
        kernel
            .write_pool(GI1, PoolScope::Global, requested)
            .map_err(|e| e.to_string())?;
        allocated = kernel.pool(GI1).map_err(|e| e.to_string())?.persistent();
        if allocated == requested {
            break;
        }
    }
    kernel
        .write_pool(GI1, PoolScope::Global, 0)
        .map_err(|e| e.to_string())?;
    Ok(Some((requested, allocated)))
}

/// Grows the pool to `pages` in one write (untimed). If the kernel comes up
/// short, compacts, and from the second try drops the page cache (builds on
/// the same machine can fill it faster than hugetlb allocation reclaims it).
fn fill(kernel: &SysfsKernel, size: PageSize, pages: u64) -> Result<(), String> {
    for attempt in 0..10 {
        kernel
            .write_pool(size, PoolScope::Global, pages)
            .map_err(|e| e.to_string())?;
        if kernel.pool(size).map_err(|e| e.to_string())?.persistent() == pages {
            return Ok(());
        }
        if attempt > 0 {
            std::fs::write("/proc/sys/vm/drop_caches", "1")
                .map_err(|e| format!("/proc/sys/vm/drop_caches: {e}"))?;
        }
        kernel
            .compact(PoolScope::Global)
            .map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_millis(500));
    }
    Err(format!("could not allocate {pages} x {size} to start from"))
}

/// Moves the pool from `start` to `goal` in fixed steps (one step of
/// everything is `echo N`).
fn fixed(
    kernel: &SysfsKernel,
    size: PageSize,
    start: u64,
    goal: u64,
    step: u64,
) -> Result<Run, String> {
    let mut writes = Vec::new();
    let mut cpu_waits = Vec::new();
    let started = Instant::now();
    let mut current = start;
    while current != goal {
        let next = if goal < current {
            current.saturating_sub(step).max(goal)
        } else {
            (current + step).min(goal)
        };
        let waited = cpu_wait();
        let write = Instant::now();
        kernel
            .write_pool(size, PoolScope::Global, next)
            .map_err(|e| e.to_string())?;
        writes.push((current.abs_diff(next), write.elapsed()));
        cpu_waits.push(waited.zip(cpu_wait()).map(|(before, after)| after - before));
        let now = kernel.pool(size).map_err(|e| e.to_string())?.persistent();
        if now != next {
            // A grow the kernel could not satisfy: stop where it is.
            current = now;
            break;
        }
        current = next;
    }
    Ok(Run {
        total: started.elapsed(),
        writes,
        cpu_waits,
        reached: current,
        peak_rss: None,
        interleaved: false,
    })
}

/// `hugepool-agent resize --pages GOAL` with the default 50 ms budget; times,
/// the pages of each write and peak RSS come from its JSON summary.
fn engine(size: PageSize, model_file: Option<PathBuf>, goal: u64) -> Result<Run, String> {
    let goal = goal.to_string();
    let size = size.to_string();
    let mut command = Command::new(env!("CARGO_BIN_EXE_hugepool-agent"));
    command.args([
        "resize",
        "--page-size",
        &size,
        "--pages",
        &goal,
        "--output",
        "json",
    ]);
    if let Some(path) = model_file {
        command.arg("--model-file").arg(path);
    }
    let output = command
        .output()
        .map_err(|e| format!("run hugepool-agent: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "hugepool-agent failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| format!("agent summary: {e}"))?;
    let seconds = |value: &serde_json::Value| value.as_f64().map(Duration::from_secs_f64);
    let latencies = report["writeSeconds"]
        .as_array()
        .ok_or("summary has no writeSeconds")?;
    let pages = report["writePages"]
        .as_array()
        .ok_or("summary has no writePages")?;
    let writes: Vec<(u64, Duration)> = pages
        .iter()
        .zip(latencies)
        .filter_map(|(pages, latency)| Some((pages.as_u64()?, seconds(latency)?)))
        .collect();
    let cpu_waits = report["writeCpuWaitSeconds"]
        .as_array()
        .ok_or("summary has no writeCpuWaitSeconds")?
        .iter()
        .map(seconds)
        .collect();
    Ok(Run {
        total: seconds(&report["durationSeconds"]).ok_or("summary has no durationSeconds")?,
        writes,
        cpu_waits,
        reached: report["achieved"]
            .as_u64()
            .ok_or("summary has no achieved")?,
        peak_rss: report["peakRssBytes"].as_u64(),
        interleaved: false,
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

fn percentile(mut values: Vec<f64>, share: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    if values.is_empty() {
        return f64::NAN;
    }
    let rank = ((share * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// The write cost `a + b*n` (seconds, seconds per page): least squares over
/// one point per step size, the median latency of that size's writes (one
/// write of N and the fixed steps). Medians, because single writes
/// here have outliers (a build on the other core) that would tilt a fit
/// over all writes.
fn fit(runs: &[&Run]) -> Option<(f64, f64)> {
    let mut by_size: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for (pages, latency) in runs.iter().flat_map(|r| r.writes.iter()) {
        by_size
            .entry(*pages)
            .or_default()
            .push(latency.as_secs_f64());
    }
    let points: Vec<(f64, f64)> = by_size
        .into_iter()
        .map(|(pages, latencies)| (pages as f64, median(latencies)))
        .collect();
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(x, y), p| (x + p.0, y + p.1));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if points.len() < 2 || sxx == 0.0 {
        return None;
    }
    let b = (sxy / sxx).max(0.0);
    Some(((my - b * mx).max(0.0), b))
}

/// The fewest writes that keep each within `budget` (seconds), and the best
/// total any such strategy can reach, the engine's pauses between its writes
/// included: T* = k*a + b*N + (k-1)*pause*w/B, with k equal writes of w =
/// a + b*N/k each (the engine pauses in proportion to the share of its 50 ms
/// budget B a write took).
fn best_budgeted(a: f64, b: f64, pages: u64, budget: f64) -> Option<(u64, f64)> {
    let room = budget - a;
    // No strategy keeps the budget when a write of one page breaks it.
    if room <= b {
        return None;
    }
    let k = ((b * pages as f64) / room).ceil().max(1.0) as u64;
    let write = a + b * pages as f64 / k as f64;
    let pause = PAUSE.as_secs_f64() * (write / BUDGET.as_secs_f64()).min(1.0);
    Some((k, k as f64 * a + b * pages as f64 + (k - 1) as f64 * pause))
}

/// The table of one page size: medians over the interleaved runs, p99 and
/// writes over the budget over every run (the engine's extra ones too).
fn print_table(results: &[(Key, Vec<Run>)], size: PageSize, reps: usize) -> String {
    let mut out = String::new();
    let pages = results
        .iter()
        .filter(|((s, _, _, strategy), _)| *s == size && *strategy == Strategy::OneWrite)
        .flat_map(|(_, runs)| runs.iter())
        .filter_map(|run| run.writes.first().map(|w| w.0))
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        out,
        "\n{pages} x {size}, medians of {reps} interleaved repetitions; p99 and writes over the \
         budget over every write of the row (engine rows: repeated to the write count shown); \
         T* from a + b*n fitted to this run's one-write and fixed-step writes; T*(p99) the \
         same with the budget divided by the p99 of the engine's writes over that fit; \
         max write ms the median of each resize's longest write, longest write ms the \
         longest of the row's every write, with the time its writer waited for a CPU; \
         in parentheses after the writes over budget, how many stay over less that wait; \
         resizes: how many the medians are of; \
         budget {} ms, pause {} ms\n",
        ms(BUDGET),
        ms(PAUSE)
    );
    let _ = writeln!(
        out,
        "| size | HVO | direction | strategy | total ms | vs one write | vs T* | vs T*(p99) | writes | max write ms | p99 write ms | longest write ms (CPU wait) | writes over budget (less CPU wait) | reached | resizes |"
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut fits = Vec::new();
    for hvo in [false, true] {
        for direction in [Direction::Shrink, Direction::Grow] {
            let group: Vec<&(Key, Vec<Run>)> = results
                .iter()
                .filter(|((s, h, d, _), _)| *s == size && *h == hvo && *d == direction)
                .collect();
            let measured: Vec<&Run> = group
                .iter()
                .filter(|((.., s), _)| !s.is_engine())
                .flat_map(|(_, runs)| runs.iter())
                .collect();
            let fitted = fit(&measured);
            let best = fitted
                .and_then(|(a, b)| Some((a, b, best_budgeted(a, b, pages, BUDGET.as_secs_f64())?)));
            let t_star = best.map(|(_, _, (_, t))| t * 1000.0).unwrap_or(f64::NAN);
            // T* with the noise: the latency of the engine's writes of at
            // least N/8 pages (the sizes T* is made of; probes are mostly
            // fixed cost) over what the fit says for their size, at p99. A
            // strategy whose writes must stay in the budget at p99 can plan
            // on at most B / spread.
            let spread = fitted.map(|(a, b)| {
                let ratios: Vec<f64> = group
                    .iter()
                    .filter(|((.., s), _)| s.is_engine())
                    .flat_map(|(_, runs)| runs.iter().flat_map(|r| r.writes.iter()))
                    .filter(|(written, _)| written * 8 >= pages)
                    .map(|(written, latency)| latency.as_secs_f64() / (a + b * *written as f64))
                    .collect();
                percentile(ratios, 0.99).max(1.0)
            });
            let noisy = fitted.zip(spread).and_then(|((a, b), spread)| {
                Some((
                    spread,
                    best_budgeted(a, b, pages, BUDGET.as_secs_f64() / spread)?,
                ))
            });
            let t_noisy = noisy.map(|(_, (_, t))| t * 1000.0).unwrap_or(f64::NAN);
            let hvo_name = if hvo { "on" } else { "off" };
            if let Some((a, b, (k, t))) = best {
                let with_noise = noisy.map_or(String::new(), |(spread, (k, t))| {
                    format!(
                        "; p99 of the engine's writes over the fit {spread:.2}x, so within the budget at \
                         p99 k = {k}, T*(p99) = {:.1} ms",
                        t * 1000.0
                    )
                });
                fits.push(format!(
                    "{size} HVO {hvo_name} {}: a = {:.2} ms, b = {:.2} us/page, k = {k}, T* = {:.1} ms{with_noise}",
                    direction.name(),
                    a * 1000.0,
                    b * 1e6,
                    t * 1000.0
                ));
            } else {
                fits.push(format!(
                    "{size} HVO {hvo_name} {}: no T* (the fit leaves no room in the budget: one page \
                     costs more than {} ms)",
                    direction.name(),
                    ms(BUDGET)
                ));
            }
            let one_write = group
                .iter()
                .find(|((.., s), _)| *s == Strategy::OneWrite)
                .map(|(_, runs)| median(interleaved(runs).iter().map(|r| ms(r.total)).collect()))
                .unwrap_or(f64::NAN);
            for ((.., strategy), runs) in &group {
                let medians_of = interleaved(runs);
                let total = median(medians_of.iter().map(|r| ms(r.total)).collect());
                let all_writes: Vec<f64> = runs
                    .iter()
                    .flat_map(|r| r.writes.iter().map(|w| ms(w.1)))
                    .collect();
                let over = all_writes.iter().filter(|&&w| w > ms(BUDGET)).count();
                // The same, each less its wait for a CPU: what the writes'
                // sizes put over the budget, not the other work on the CPUs.
                let waits: Vec<(f64, f64)> = runs
                    .iter()
                    .flat_map(|r| {
                        r.writes
                            .iter()
                            .zip(&r.cpu_waits)
                            .map(|((_, latency), wait)| (ms(*latency), wait.map_or(0.0, ms)))
                    })
                    .collect();
                let over_less_wait = waits
                    .iter()
                    .filter(|(w, wait)| w - wait > ms(BUDGET))
                    .count();
                let longest_wait = waits
                    .iter()
                    .copied()
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map_or(0.0, |(_, wait)| wait);
                let _ = writeln!(
                    out,
                    "| {size} | {hvo_name} | {} | {} | {:.1} | {:.2}x | {:.2}x | {:.2}x | {:.0} | {:.1} | {:.1} | {:.1} ({:.1}) | {} of {} ({}) | {:.0} | {} |",
                    direction.name(),
                    strategy.name(),
                    total,
                    total / one_write,
                    total / t_star,
                    total / t_noisy,
                    median(medians_of.iter().map(|r| r.writes.len() as f64).collect()),
                    median(
                        medians_of
                            .iter()
                            .map(|r| r.writes.iter().map(|w| ms(w.1)).fold(0.0, f64::max))
                            .collect()
                    ),
                    percentile(all_writes.clone(), 0.99),
                    all_writes.iter().copied().fold(0.0, f64::max),
                    longest_wait,
                    over,
                    all_writes.len(),
                    over_less_wait,
                    median(medians_of.iter().map(|r| r.reached as f64).collect()),
                    medians_of.len(),
                );
            }
        }
    }
    out.push('\n');
    for line in fits {
        let _ = writeln!(out, "{line}");
    }
    let peak = results
        .iter()
        .flat_map(|(_, runs)| runs.iter().filter_map(|r| r.peak_rss))
        .max();
    // SAFETY: getrusage fills the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let children_max_kb = if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) } == 0 {
        Some(usage.ru_maxrss)
    } else {
        None
    };
    let _ = writeln!(
        out,
        "\nAgent peak RSS during a resize: {} MiB (VmHWM in its summary); largest child maxrss {} MiB",
        peak.map_or("?".into(), |b| format!(
            "{:.1}",
            b as f64 / (1 << 20) as f64
        )),
        children_max_kb.map_or("?".into(), |kb| format!("{:.1}", kb as f64 / 1024.0)),
    );
    print!("{out}");
    out
}

/// Every run of this bench as JSON, next to BENCH.md (one file per run of
/// the bench, named by its start time), with the table it printed.
/// The runs of the interleaved matrix (the ones medians are taken over).
fn interleaved(runs: &[Run]) -> Vec<&Run> {
    runs.iter().filter(|r| r.interleaved).collect()
}

fn save_raw(results: &[(Key, Vec<Run>)], reps: usize, table: &str) -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    let runs: Vec<serde_json::Value> = results
        .iter()
        .flat_map(|((size, hvo, direction, strategy), runs)| {
            runs.iter().map(move |run| {
                serde_json::json!({
                    "size": size.to_string(),
                    "hvo": hvo,
                    "direction": direction.name(),
                    "strategy": strategy.name(),
                    "totalMs": ms(run.total),
                    "reached": run.reached,
                    "writes": run.writes.iter().zip(&run.cpu_waits).map(|((pages, latency), wait)| {
                        serde_json::json!({"pages": pages, "ms": ms(*latency), "cpuWaitMs": wait.map(ms)})
                    }).collect::<Vec<_>>(),
                    "peakRssBytes": run.peak_rss,
                    "interleaved": run.interleaved,
                })
            })
        })
        .collect();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let now = jiff::Timestamp::now();
    let document = serde_json::json!({
        "bench": "resize",
        "at": now.to_string(),
        "kernel": release.trim(),
        "repetitions": reps,
        "budgetMs": ms(BUDGET),
        "pauseMs": ms(PAUSE),
        "table": table,
        "runs": runs,
    });
    raw::write(
        &dir,
        &format!("resize-{}.json", now.strftime("%Y%m%dT%H%M%SZ")),
        &document,
    )
}
