//! Freeing 8192 x 2Mi pages on the real kernel, with HVO off and on, five
//! ways, interleaved: one write (`echo 0`), fixed steps of 64 and of 1024,
//! and the engine (`hugepool-agent resize`, 50 ms budget) starting cold and
//! starting from a saved cost model. Prints medians over the repetitions and
//! the agent's peak RSS. Saves and restores every pool and HVO.
//!
//! Environment: HUGEPOOL_BENCH_REPS (default 5), HUGEPOOL_BENCH_PAGES
//! (default 8192).

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use hugepool_agent::kernel::{Kernel, PoolScope, SysfsKernel};
use hugepool_crds::PageSize;

const MI2: PageSize = PageSize::SIZE_2MI;
const KEEP_FREE: u64 = 4 << 30;

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
            Strategy::OneWrite => "one write (echo 0)".into(),
            Strategy::Fixed(step) => format!("fixed steps of {step}"),
            Strategy::EngineCold => "engine, cold start".into(),
            Strategy::EngineWarm => "engine, saved model".into(),
        }
    }
}

const STRATEGIES: [Strategy; 5] = [
    Strategy::OneWrite,
    Strategy::Fixed(64),
    Strategy::Fixed(1024),
    Strategy::EngineCold,
    Strategy::EngineWarm,
];

/// One measured shrink.
struct Run {
    total: Duration,
    writes: Vec<Duration>,
    peak_rss: Option<u64>,
}

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

fn bench() -> Result<(), String> {
    let reps = env_number("HUGEPOOL_BENCH_REPS", 5)?.max(1) as usize;
    let pages = env_number("HUGEPOOL_BENCH_PAGES", 8192)?;
    let kernel = SysfsKernel::default();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (it writes the hugetlb pools)".into());
    }
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
    let dir = std::env::temp_dir();
    let model_file =
        |hvo: bool| dir.join(format!("hugepool-bench-model-hvo{}.json", u8::from(hvo)));

    let mut results: Vec<((bool, Strategy), Vec<Run>)> = Vec::new();
    for hvo in [false, true] {
        kernel.set_hvo(hvo).map_err(|e| e.to_string())?;
        // Seed the saved model with one untimed resize.
        let _ = std::fs::remove_file(model_file(hvo));
        fill(&kernel, pages)?;
        engine(Some(model_file(hvo)))?;
        for strategy in STRATEGIES {
            results.push(((hvo, strategy), Vec::new()));
        }
    }
    for rep in 0..reps {
        for hvo in if rep % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            kernel.set_hvo(hvo).map_err(|e| e.to_string())?;
            // Rotate the order so no strategy always runs first.
            for i in 0..STRATEGIES.len() {
                let strategy = STRATEGIES[(i + rep) % STRATEGIES.len()];
                fill(&kernel, pages)?;
                std::thread::sleep(Duration::from_millis(200));
                let run = match strategy {
                    Strategy::OneWrite => fixed(&kernel, pages, pages)?,
                    Strategy::Fixed(step) => fixed(&kernel, pages, step)?,
                    Strategy::EngineCold => engine(None)?,
                    Strategy::EngineWarm => engine(Some(model_file(hvo)))?,
                };
                let left = kernel.pool(MI2).map_err(|e| e.to_string())?;
                if left.total != 0 {
                    return Err(format!("{} left {} pages", strategy.name(), left.total));
                }
                eprintln!(
                    "rep {} hvo {} {:<22} total {:>8.1} ms, {:>4} writes, max {:>6.1} ms",
                    rep + 1,
                    u8::from(hvo),
                    strategy.name(),
                    ms(run.total),
                    run.writes.len(),
                    ms(run.writes.iter().max().copied().unwrap_or_default())
                );
                if let Some((_, runs)) = results.iter_mut().find(|(key, _)| *key == (hvo, strategy))
                {
                    runs.push(run);
                }
            }
        }
    }
    drop(restore);
    print_table(&results, pages, reps);
    Ok(())
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// Grows the pool to `pages` in one write (untimed). If the kernel comes up
/// short, compacts, and from the second try drops the page cache (builds on
/// the same machine can fill it faster than hugetlb allocation reclaims it).
fn fill(kernel: &SysfsKernel, pages: u64) -> Result<(), String> {
    for attempt in 0..10 {
        kernel
            .write_pool(MI2, PoolScope::Global, pages)
            .map_err(|e| e.to_string())?;
        if kernel.pool(MI2).map_err(|e| e.to_string())?.persistent() == pages {
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
    Err(format!("could not allocate {pages} x 2Mi to start from"))
}

/// Frees the pool in fixed steps (one step of everything is `echo 0`).
fn fixed(kernel: &SysfsKernel, pages: u64, step: u64) -> Result<Run, String> {
    let mut writes = Vec::new();
    let started = Instant::now();
    let mut current = pages;
    while current > 0 {
        current = current.saturating_sub(step);
        let write = Instant::now();
        kernel
            .write_pool(MI2, PoolScope::Global, current)
            .map_err(|e| e.to_string())?;
        writes.push(write.elapsed());
    }
    Ok(Run {
        total: started.elapsed(),
        writes,
        peak_rss: None,
    })
}

/// `hugepool-agent resize --pages 0` with the default 50 ms budget; times
/// and peak RSS come from its JSON summary.
fn engine(model_file: Option<PathBuf>) -> Result<Run, String> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hugepool-agent"));
    command.args([
        "resize",
        "--page-size",
        "2Mi",
        "--pages",
        "0",
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
    let writes = report["writeSeconds"]
        .as_array()
        .map(|all| all.iter().filter_map(seconds).collect())
        .unwrap_or_default();
    Ok(Run {
        total: seconds(&report["durationSeconds"]).ok_or("summary has no durationSeconds")?,
        writes,
        peak_rss: report["peakRssBytes"].as_u64(),
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

fn print_table(results: &[((bool, Strategy), Vec<Run>)], pages: u64, reps: usize) {
    println!(
        "\nFreeing {pages} x 2Mi, medians of {reps} interleaved repetitions (p99 over all writes)\n"
    );
    println!("| HVO | strategy | total ms | vs one write | writes | max write ms | p99 write ms |");
    println!("|---|---|---|---|---|---|---|");
    for hvo in [false, true] {
        let one_write = results
            .iter()
            .find(|(key, _)| *key == (hvo, Strategy::OneWrite))
            .map(|(_, runs)| median(runs.iter().map(|r| ms(r.total)).collect()))
            .unwrap_or(f64::NAN);
        for ((run_hvo, strategy), runs) in results {
            if *run_hvo != hvo {
                continue;
            }
            let total = median(runs.iter().map(|r| ms(r.total)).collect());
            let all_writes: Vec<f64> = runs
                .iter()
                .flat_map(|r| r.writes.iter().map(|w| ms(*w)))
                .collect();
            println!(
                "| {} | {} | {:.1} | {:.2}x | {:.0} | {:.1} | {:.1} |",
                if hvo { "on" } else { "off" },
                strategy.name(),
                total,
                total / one_write,
                median(runs.iter().map(|r| r.writes.len() as f64).collect()),
                median(
                    runs.iter()
                        .map(|r| r.writes.iter().map(|w| ms(*w)).fold(0.0, f64::max))
                        .collect()
                ),
                percentile(all_writes, 0.99),
            );
        }
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
    println!(
        "\nAgent peak RSS during a resize: {} MiB (VmHWM in its summary); largest child maxrss {} MiB",
        peak.map_or("?".into(), |b| format!(
            "{:.1}",
            b as f64 / (1 << 20) as f64
        )),
        children_max_kb.map_or("?".into(), |kb| format!("{:.1}", kb as f64 / 1024.0)),
    );
}
