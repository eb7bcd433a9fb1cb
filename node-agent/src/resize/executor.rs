//! Runs a [`Planner`] against a kernel: every write on a blocking thread with
//! a watchdog, a read-back after each, a progress [`Event`] per step, and a
//! [`Summary`] at the end. Holds no policy of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use crate::kernel::{Kernel, PoolScope};
use crate::resize::model::{CostModels, Direction};
use crate::resize::planner::{
    Decision, Observation, Outcome, PlannedWrite, Planner, Settings, StepReason, Target,
};
use crate::{Error, Result};

/// How the executor waits, beyond the planner's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// How long to keep waiting, once blocked by pages in use, for them to be
    /// released (zero: finish `Blocked` at once).
    pub blocked_wait: Duration,
    /// How often to re-read the kernel while blocked.
    pub blocked_poll: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            blocked_wait: Duration::ZERO,
            blocked_poll: Duration::from_secs(1),
        }
    }
}

/// One finished write.
#[derive(Clone, Debug, PartialEq)]
pub struct StepEvent {
    /// 1-based index of the write in this resize.
    pub step: u32,
    pub direction: Direction,
    pub target: u64,
    /// The value written to `nr_hugepages`.
    pub written: u64,
    /// Persistent pages before and after.
    pub before: u64,
    pub after: u64,
    /// Pages the write was planned to move.
    pub pages: u64,
    pub latency: Duration,
    /// Of the latency, how long the writer was ready but waited for a CPU
    /// (other work on the node's CPUs; [`crate::kernel::cpu_wait`]).
    pub cpu_wait: Option<Duration>,
    pub estimate: Option<Duration>,
    /// The write's cost to the kernel (its latency less its CPU wait) went
    /// past the budget.
    pub over_budget: bool,
    /// The write outlived the stall threshold (a `Stall` event came first).
    pub stalled: bool,
    pub guard_limited: bool,
    pub mem_available: u64,
    /// What decided the write's size.
    pub why: StepReason,
}

/// Where a resize goes and how: re-read at every step boundary, so a new
/// target or new settings (a pool's `resize` and `allocation` fields edited
/// mid-resize) take effect at the next write.
#[derive(Clone, Debug, PartialEq)]
pub struct Goal {
    pub target: Target,
    pub settings: Settings,
}

/// What happens during a resize, for logs, status and metrics.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Step(StepEvent),
    /// A write has been running for longer than the stall threshold; sent
    /// while it still runs.
    Stall {
        step: u32,
        direction: Direction,
        pages: u64,
        elapsed: Duration,
        /// The stall threshold the write outlived.
        threshold: Duration,
    },
    /// A write failed; it is retried up to `retries` times.
    WriteFailed {
        step: u32,
        error: String,
    },
    Compacted {
        scope: PoolScope,
        error: Option<String>,
    },
    /// Waiting for pages in use to be released.
    Blocked(Outcome),
    /// A new target took effect at a step boundary.
    Retargeted(Target),
    /// New settings took effect at a step boundary.
    Resettled(Settings),
}

/// How a resize went.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub page_size: String,
    pub scope: String,
    /// Persistent pages at the start.
    pub from: u64,
    /// The target at the end.
    pub to: u64,
    /// Persistent pages at the end.
    pub achieved: u64,
    pub steps: u32,
    pub stalls: u32,
    pub compactions: u32,
    pub max_write_seconds: f64,
    pub total_write_seconds: f64,
    pub duration_seconds: f64,
    pub pages_per_second: f64,
    pub hvo: Option<bool>,
    pub outcome: Outcome,
    /// Latency of every write, in order.
    pub write_seconds: Vec<f64>,
    /// Of each write's latency, the time the writer waited for a CPU
    /// (null where the kernel does not say).
    pub write_cpu_wait_seconds: Vec<Option<f64>>,
    /// Pages every write moved (as read back after it), in order.
    pub write_pages: Vec<u64>,
    /// Why each write had its size, in order.
    pub write_reasons: Vec<StepReason>,
}

impl Summary {
    pub fn reached(&self) -> bool {
        self.outcome == Outcome::Reached
    }
}

/// Reads what the planner needs, on a blocking thread.
pub async fn observe(kernel: &Arc<dyn Kernel>, target: Target) -> Result<Observation> {
    observe_with(kernel, target, None).await
}

/// [`observe`], and for a grow what the free lists say it can get, keeping
/// `guard_bytes` free (unreadable free lists leave it out).
async fn observe_with(
    kernel: &Arc<dyn Kernel>,
    target: Target,
    guard_bytes: Option<u64>,
) -> Result<Observation> {
    let kernel = Arc::clone(kernel);
    tokio::task::spawn_blocking(move || {
        let pool = kernel.pool(target.size)?;
        let node = match target.scope {
            PoolScope::Global => None,
            PoolScope::Node(id) => Some(kernel.numa_pool(target.size, id)?),
        };
        let persistent = node.map_or(pool.persistent(), |n| n.persistent());
        let estimate = guard_bytes
            .filter(|_| target.pages > persistent)
            .and_then(|guard| {
                // The free blocks first: when they cover the grow, what a
                // compaction adds does not matter, and the pageblock counts
                // (the costly read) are left unread.
                let blocks = kernel.free_blocks().ok()?;
                let estimate = blocks.for_scope(target.size, target.scope, guard);
                if blocks.pagetypeinfo.is_some()
                    || estimate.obtainable_now >= target.pages - persistent
                {
                    return Some(estimate);
                }
                let lists = kernel.free_lists().ok()?;
                Some(lists.for_scope(target.size, target.scope, guard))
            });
        Ok(Observation {
            pool,
            node,
            mem_available: kernel.meminfo()?.available_bytes,
            hvo: kernel.hvo()?.unwrap_or(false),
            estimate,
        })
    })
    .await
    .map_err(|err| Error::WriteThread(err.to_string()))?
}

/// The memory a grow's estimate keeps free, when the engine reads one.
fn estimate_guard(settings: &Settings) -> Option<u64> {
    settings.free_lists.then(|| settings.kept_free())
}

/// Compacts what `scope` names; for the whole machine, only the NUMA nodes
/// where the free lists say compaction adds pages of `size` (all of them
/// when the free lists cannot be read). Returns the scopes compacted and
/// the first error.
fn compact_where_it_helps(
    kernel: &dyn Kernel,
    size: hugepool_crds::PageSize,
    scope: PoolScope,
) -> (Vec<PoolScope>, Option<Error>) {
    let scopes = match (scope, kernel.free_lists()) {
        (PoolScope::Global, Ok(lists)) => {
            let nodes: Vec<PoolScope> = lists
                .estimates(size, 0)
                .numa
                .iter()
                .filter(|(_, e)| e.after_compaction > e.obtainable_now)
                .map(|(node, _)| PoolScope::Node(*node))
                .collect();
            if nodes.is_empty() {
                vec![PoolScope::Global]
            } else {
                nodes
            }
        }
        _ => vec![scope],
    };
    let mut first_error = None;
    for scope in &scopes {
        if let Err(err) = kernel.compact(*scope) {
            first_error.get_or_insert(err);
        }
    }
    (scopes, first_error)
}

/// Moves the pool to the target in `goal`, with its settings (both re-read
/// at every step boundary), and reports each step through `on_event`.
///
/// `models` carries the cost fits between resizes; pass the same value to
/// every resize of an agent.
pub async fn run(
    kernel: Arc<dyn Kernel>,
    goal: &mut watch::Receiver<Goal>,
    options: &Options,
    models: &mut CostModels,
    mut on_event: impl FnMut(&Event) + Send,
) -> Result<Summary> {
    let started = Instant::now();
    let Goal {
        target: initial,
        settings,
    } = goal.borrow_and_update().clone();
    let hvo = {
        let kernel = Arc::clone(&kernel);
        tokio::task::spawn_blocking(move || kernel.hvo())
            .await
            .map_err(|err| Error::WriteThread(err.to_string()))??
    };
    let mut observed = observe_with(&kernel, initial, estimate_guard(&settings)).await?;
    let mut planner = Planner::new(initial, settings);
    let from = observed.persistent();
    // Pages moved and latency of every write.
    let mut writes: Vec<Written> = Vec::new();
    let mut stalls = 0;
    let mut compactions = 0;
    let mut blocked_since: Option<Instant> = None;
    // The pause runs between writes, from the end of one to the start of
    // the next (reading the kernel back overlaps it); none after the last.
    // Kept as the last write's end and latency, so that new settings change
    // a pause already begun.
    let mut last_write: Option<(Instant, Duration)> = None;
    loop {
        let wanted = goal.borrow_and_update().clone();
        if wanted.settings != *planner.settings() {
            planner.set_settings(wanted.settings.clone());
            on_event(&Event::Resettled(wanted.settings));
        }
        if wanted.target != planner.target() {
            planner.retarget(wanted.target);
            on_event(&Event::Retargeted(wanted.target));
            observed =
                observe_with(&kernel, wanted.target, estimate_guard(planner.settings())).await?;
        }
        match planner.next(&observed, models) {
            Decision::Write(write) => {
                blocked_since = None;
                if let Some((ended, latency)) = last_write {
                    let due = ended + planner.settings().pause_after(latency);
                    if wait_or_change(goal, due).await {
                        // New settings or target: plan again with them.
                        continue;
                    }
                }
                let step = writes.len() as u32 + 1;
                let (result, latency, cpu_wait, stalled) = write_with_watchdog(
                    &kernel,
                    planner.target(),
                    &write,
                    planner.settings(),
                    step,
                    &mut on_event,
                )
                .await?;
                last_write = Some((Instant::now(), latency));
                if stalled {
                    stalls += 1;
                }
                match result {
                    Ok(()) => {
                        let after = observe(&kernel, planner.target()).await?;
                        planner.record_write(
                            &write,
                            kernel_time(latency, cpu_wait),
                            &after,
                            models,
                        );
                        writes.push(Written {
                            pages: write.from.abs_diff(after.persistent()),
                            latency,
                            cpu_wait,
                            why: write.why,
                        });
                        on_event(&Event::Step(StepEvent {
                            step,
                            direction: write.direction,
                            target: planner.target().pages,
                            written: write.value,
                            before: write.from,
                            after: after.persistent(),
                            pages: write.pages,
                            latency,
                            cpu_wait,
                            estimate: write.estimate,
                            over_budget: kernel_time(latency, cpu_wait)
                                > planner.settings().max_step_duration,
                            stalled,
                            guard_limited: write.guard_limited,
                            mem_available: after.mem_available,
                            why: write.why,
                        }));
                        observed = after;
                    }
                    Err(err) => {
                        on_event(&Event::WriteFailed {
                            step,
                            error: err.to_string(),
                        });
                        planner.record_write_error(&write, err.to_string());
                        observed = observe(&kernel, planner.target()).await?;
                    }
                }
            }
            Decision::Compact(scope) => {
                let size = planner.target().size;
                let targeted = planner.settings().free_lists;
                let (scopes, error) = {
                    let kernel = Arc::clone(&kernel);
                    tokio::task::spawn_blocking(move || {
                        if targeted {
                            compact_where_it_helps(kernel.as_ref(), size, scope)
                        } else {
                            (vec![scope], kernel.compact(scope).err())
                        }
                    })
                    .await
                    .map_err(|err| Error::WriteThread(err.to_string()))?
                };
                compactions += 1;
                let error = error.map(|err| err.to_string());
                for scope in scopes {
                    on_event(&Event::Compacted {
                        scope,
                        error: error.clone(),
                    });
                }
                observed = observe_with(
                    &kernel,
                    planner.target(),
                    estimate_guard(planner.settings()),
                )
                .await?;
            }
            Decision::Finish(outcome) => {
                if matches!(outcome, Outcome::Blocked { .. }) && !options.blocked_wait.is_zero() {
                    let since = *blocked_since.get_or_insert_with(|| {
                        on_event(&Event::Blocked(outcome.clone()));
                        Instant::now()
                    });
                    let waited = since.elapsed();
                    if waited < options.blocked_wait {
                        let nap = options.blocked_poll.min(options.blocked_wait - waited);
                        wait_or_change(goal, Instant::now() + nap).await;
                        observed = observe(&kernel, planner.target()).await?;
                        continue;
                    }
                }
                return Ok(summarize(
                    planner.target(),
                    from,
                    &observed,
                    &writes,
                    stalls,
                    compactions,
                    started.elapsed(),
                    hvo,
                    outcome,
                ));
            }
        }
    }
}

/// Sleeps until `due`, or less if a different goal arrives; says which.
async fn wait_or_change(goal: &mut watch::Receiver<Goal>, due: Instant) -> bool {
    let current = goal.borrow().clone();
    let changed = async {
        // Resolves on a new value; if the sender is gone, never.
        while goal.changed().await.is_ok() {
            if *goal.borrow() != current {
                return;
            }
        }
        std::future::pending::<()>().await;
    };
    tokio::select! {
        () = tokio::time::sleep_until(due.into()) => false,
        () = changed => true,
    }
}

/// One kernel write on a blocking thread. A write still running after the
/// stall threshold is reported while it runs; a kernel write cannot be
/// cancelled, so the watchdog waits for it to end.
async fn write_with_watchdog(
    kernel: &Arc<dyn Kernel>,
    target: Target,
    write: &PlannedWrite,
    settings: &Settings,
    step: u32,
    on_event: &mut (impl FnMut(&Event) + Send),
) -> Result<(Result<()>, Duration, Option<Duration>, bool)> {
    let kernel = Arc::clone(kernel);
    let value = write.value;
    let started = Instant::now();
    let mut handle = tokio::task::spawn_blocking(move || {
        let before = crate::kernel::cpu_wait();
        let result = kernel.write_pool(target.size, target.scope, value);
        let cpu_wait = before
            .zip(crate::kernel::cpu_wait())
            .map(|(before, after)| after.saturating_sub(before));
        (result, cpu_wait)
    });
    let mut stalled = false;
    let joined = tokio::select! {
        joined = &mut handle => joined,
        () = tokio::time::sleep(settings.stall_threshold) => {
            stalled = true;
            on_event(&Event::Stall {
                step,
                direction: write.direction,
                pages: write.pages,
                elapsed: started.elapsed(),
                threshold: settings.stall_threshold,
            });
            handle.await
        }
    };
    let (result, cpu_wait) = joined.map_err(|err| Error::WriteThread(err.to_string()))?;
    Ok((result, started.elapsed(), cpu_wait, stalled))
}

/// What a write cost the kernel: its latency less the time its writer
/// waited for a CPU (the whole latency where the kernel does not say). The
/// cost model and the step sizes learn this, not the latency: the wait is
/// other work on the node's CPUs, which runs meanwhile (the write holds up
/// nobody while it waits), which no step size changes, and which, learnt
/// as cost, made a busy node's first resize take more and smaller writes
/// (docs/design.md, "A node's first resize").
pub fn kernel_time(latency: Duration, cpu_wait: Option<Duration>) -> Duration {
    latency.saturating_sub(cpu_wait.unwrap_or_default())
}

/// One write done: pages moved (read back), latency, CPU wait within it.
struct Written {
    pages: u64,
    latency: Duration,
    cpu_wait: Option<Duration>,
    why: StepReason,
}

#[allow(clippy::too_many_arguments)]
fn summarize(
    target: Target,
    from: u64,
    observed: &Observation,
    writes: &[Written],
    stalls: u32,
    compactions: u32,
    elapsed: Duration,
    hvo: Option<bool>,
    outcome: Outcome,
) -> Summary {
    let achieved = observed.persistent();
    let duration_seconds = elapsed.as_secs_f64();
    Summary {
        page_size: target.size.to_string(),
        scope: target.scope.to_string(),
        from,
        to: target.pages,
        achieved,
        steps: writes.len() as u32,
        stalls,
        compactions,
        max_write_seconds: writes
            .iter()
            .map(|w| w.latency)
            .max()
            .unwrap_or_default()
            .as_secs_f64(),
        total_write_seconds: writes
            .iter()
            .map(|w| w.latency)
            .sum::<Duration>()
            .as_secs_f64(),
        duration_seconds,
        pages_per_second: if duration_seconds > 0.0 {
            from.abs_diff(achieved) as f64 / duration_seconds
        } else {
            0.0
        },
        hvo,
        outcome,
        write_seconds: writes.iter().map(|w| w.latency.as_secs_f64()).collect(),
        write_cpu_wait_seconds: writes
            .iter()
            .map(|w| w.cpu_wait.map(|wait| wait.as_secs_f64()))
            .collect(),
        write_pages: writes.iter().map(|w| w.pages).collect(),
        write_reasons: writes.iter().map(|w| w.why).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writes_cost_is_its_latency_less_its_cpu_wait() {
        let ms = Duration::from_millis;
        assert_eq!(kernel_time(ms(45), Some(ms(15))), ms(30));
        assert_eq!(kernel_time(ms(45), None), ms(45));
        assert_eq!(kernel_time(ms(5), Some(ms(7))), Duration::ZERO);
    }
    use crate::kernel::{SimConfig, SimulatedKernel};
    use crate::resize::planner::ShortfallReason;
    use hugepool_crds::PageSize;
    use std::sync::Mutex;

    const MI2: PageSize = PageSize::SIZE_2MI;
    const GIB: u64 = 1 << 30;

    fn sim(time_scale: f64, hvo: bool) -> SimulatedKernel {
        let mut config = SimConfig::single_node(16 * GIB);
        config.time_scale = time_scale;
        config.hvo = hvo;
        SimulatedKernel::new(config)
    }

    fn target(pages: u64) -> Target {
        Target {
            size: MI2,
            pages,
            scope: PoolScope::Global,
        }
    }

    /// Settings scaled like the kernel's time: a 50 ms budget at `scale`.
    fn scaled(scale: f64) -> Settings {
        Settings {
            max_step_duration: Duration::from_millis(50).mul_f64(scale),
            step_pause: Duration::ZERO,
            stall_threshold: Duration::from_secs(2),
            min_mem_available: GIB,
            ..Settings::default()
        }
    }

    async fn resize(
        kernel: &SimulatedKernel,
        wanted: u64,
        settings: Settings,
        options: Options,
    ) -> (Summary, Vec<Event>) {
        let goal = Goal {
            target: target(wanted),
            settings,
        };
        resize_with(kernel, goal, options, |_, _| {}).await
    }

    /// A resize whose `on_event` sees every event and may send a new goal.
    async fn resize_with(
        kernel: &SimulatedKernel,
        goal: Goal,
        options: Options,
        mut on_event: impl FnMut(&Event, &watch::Sender<Goal>) + Send,
    ) -> (Summary, Vec<Event>) {
        let (tx, mut rx) = watch::channel(goal);
        let mut events = Vec::new();
        let summary = run(
            Arc::new(kernel.clone()),
            &mut rx,
            &options,
            &mut CostModels::default(),
            |event| {
                on_event(event, &tx);
                events.push(event.clone());
            },
        )
        .await
        .unwrap();
        (summary, events)
    }

    /// One node of 16 GiB: `now` of its memory usable for huge pages as it
    /// starts, `after` of its free memory once compacted.
    fn fragmented(now: f64, after: f64) -> SimulatedKernel {
        let mut config = SimConfig::single_node(16 * GIB);
        config.time_scale = 0.0;
        config.nodes[0].contiguous_fraction = now;
        config.nodes[0].contiguous_after_compaction = after;
        SimulatedKernel::new(config)
    }

    fn kinds(events: &[Event]) -> Vec<String> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Step(_) => Some("write".to_string()),
                Event::Compacted { scope, .. } => Some(format!("compact {scope}")),
                _ => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn a_grow_the_free_lists_cannot_cover_compacts_its_node_before_the_first_write() {
        // 5% of 16 GiB is 409 pages now; 2048 wanted; compaction frees all.
        let kernel = fragmented(0.05, 1.0);
        let (summary, events) = resize(&kernel, 2048, scaled(1.0), Options::default()).await;
        assert!(summary.reached(), "{summary:?}");
        let seen = kinds(&events);
        assert_eq!(seen[0], "compact node0", "{seen:?}");
        assert!(seen[1..].iter().all(|k| k == "write"), "{seen:?}");
        assert_eq!(kernel.compactions(), [PoolScope::Node(0)]);
        assert_eq!(summary.compactions, 1);
        // Whether compaction helps is what the pageblock counts tell.
        assert!(kernel.pageblock_reads() >= 1);
        // Without the free lists (as before): a short write first, then the
        // compaction of the whole machine, then the retry.
        let kernel = fragmented(0.05, 1.0);
        let settings = Settings {
            free_lists: false,
            ..scaled(1.0)
        };
        let (summary, events) = resize(&kernel, 2048, settings, Options::default()).await;
        assert!(summary.reached(), "{summary:?}");
        let seen = kinds(&events);
        assert_eq!(seen[0], "write", "{seen:?}");
        assert_eq!(kernel.compactions(), [PoolScope::Global]);
    }

    #[tokio::test]
    async fn a_grow_the_free_lists_cover_never_compacts() {
        let kernel = fragmented(1.0, 1.0);
        let (summary, _) = resize(&kernel, 2048, scaled(1.0), Options::default()).await;
        assert!(summary.reached(), "{summary:?}");
        assert_eq!(kernel.compactions(), []);
        // The free blocks decided it: the pageblock counts (a real kernel's
        // costly pagetypeinfo) were never read.
        assert_eq!(kernel.pageblock_reads(), 0);
    }

    #[tokio::test]
    async fn a_foreseen_shortfall_is_reported_at_the_first_short_write_with_the_estimate() {
        // 409 pages now; compaction makes 20% of the free 16 GiB usable:
        // 1638 pages, all in free blocks by then (the guard never takes
        // from what the free lists hold).
        let kernel = fragmented(0.05, 0.2);
        let settings = Settings {
            retries: 3,
            ..scaled(1.0)
        };
        let (summary, events) = resize(&kernel, 4096, settings, Options::default()).await;
        let Outcome::Shortfall {
            requested,
            achieved,
            reason,
            detail,
        } = &summary.outcome
        else {
            panic!("{summary:?}");
        };
        assert_eq!((*requested, *reason), (4096, ShortfallReason::Fragmented));
        assert_eq!(*achieved, kernel.pool(MI2).unwrap().persistent());
        assert!((1600..=1640).contains(achieved), "{summary:?}");
        assert_eq!(
            detail.as_deref(),
            Some(
                "foreseen: 4096 more pages needed, the free lists gave 1638 now and 1638 after compaction"
            )
        );
        // Compacted once, before the grow: no rounds of compact and retry.
        assert_eq!(
            kernel.compactions(),
            [PoolScope::Node(0)],
            "{:?}",
            kinds(&events)
        );
    }

    #[tokio::test]
    async fn a_machine_wide_grow_compacts_only_the_numa_nodes_where_it_helps() {
        let mut config = SimConfig::two_nodes(8 * GIB);
        config.time_scale = 0.0;
        // Node 0 gains from compaction; node 1 cannot.
        config.nodes[0].contiguous_fraction = 0.05;
        config.nodes[0].contiguous_after_compaction = 1.0;
        config.nodes[1].contiguous_fraction = 0.05;
        config.nodes[1].contiguous_after_compaction = 0.05;
        let kernel = SimulatedKernel::new(config);
        let (summary, _) = resize(&kernel, 2048, scaled(1.0), Options::default()).await;
        assert!(summary.reached(), "{summary:?}");
        assert_eq!(kernel.compactions(), [PoolScope::Node(0)]);
    }

    #[tokio::test]
    async fn reaches_the_target_and_reports_every_step() {
        let kernel = sim(0.2, true);
        kernel.preset(MI2, PoolScope::Global, 8192).unwrap();
        let (summary, events) = resize(&kernel, 0, scaled(0.2), Options::default()).await;
        assert!(summary.reached(), "{summary:?}");
        assert_eq!((summary.from, summary.to, summary.achieved), (8192, 0, 0));
        assert_eq!(kernel.pool(MI2).unwrap(), Default::default());
        let steps: Vec<&StepEvent> = events
            .iter()
            .filter_map(|e| match e {
                Event::Step(step) => Some(step),
                _ => None,
            })
            .collect();
        assert_eq!(steps.len() as u32, summary.steps);
        assert_eq!(steps.last().map(|s| s.after), Some(0));
        assert!(steps.iter().skip(1).all(|s| s.estimate.is_some()));
        assert_eq!(summary.write_seconds.len() as u32, summary.steps);
        assert_eq!(summary.write_pages.iter().sum::<u64>(), 8192);
        assert_eq!(summary.hvo, Some(true));
        assert!(summary.pages_per_second > 0.0);
    }

    #[tokio::test]
    async fn the_pause_runs_between_writes_and_not_after_the_last() {
        // The first write runs past the 50 ms budget: the whole pause
        // follows it before the next write, so the resize lasts at least
        // that long (a lower bound, whatever the machine's speed).
        let kernel = sim(0.0, false);
        kernel.preset(MI2, PoolScope::Global, 300).unwrap();
        kernel.hang_next_write(Duration::from_millis(60));
        let pause = Duration::from_secs(1);
        let settings = Settings {
            step_pause: pause,
            ..scaled(1.0)
        };
        let (summary, _) = resize(&kernel, 0, settings.clone(), Options::default()).await;
        assert!(summary.reached() && summary.steps >= 2, "{summary:?}");
        assert!(
            summary.duration_seconds >= pause.as_secs_f64(),
            "no pause between the writes: {summary:?}"
        );

        // The same slow write, made the last one (the target moves to where
        // it left the pool): the resize returns without its pause.
        kernel.preset(MI2, PoolScope::Global, 300).unwrap();
        kernel.hang_next_write(Duration::from_millis(60));
        let pause = Duration::from_secs(5);
        let goal = Goal {
            target: target(0),
            settings: Settings {
                step_pause: pause,
                ..settings
            },
        };
        let mut last_write = None;
        let (summary, _) = resize_with(&kernel, goal, Options::default(), |event, goal| {
            if let Event::Step(step) = event {
                last_write = Some(Instant::now());
                goal.send_modify(|g| g.target.pages = step.after);
            }
        })
        .await;
        let returned = Instant::now();
        assert!(summary.reached() && summary.steps == 1, "{summary:?}");
        let after_last = returned - last_write.expect("a write");
        // Only a read of the simulated kernel runs here; a pause would be 5 s.
        assert!(
            after_last < pause,
            "returned {after_last:?} after the last write: a pause followed it"
        );
    }

    #[tokio::test]
    async fn a_short_write_is_followed_by_a_short_pause() {
        let kernel = sim(0.0, false);
        kernel.preset(MI2, PoolScope::Global, 300).unwrap();
        // An instant probe uses next to none of its 50 ms budget, so next to
        // none of the 10 s pause follows it (a write of 25 ms, on the
        // slowest machine, would be followed by 5 s).
        let settings = Settings {
            step_pause: Duration::from_secs(10),
            ..scaled(1.0)
        };
        let (summary, _) = resize(&kernel, 0, settings, Options::default()).await;
        assert_eq!(summary.steps, 2, "{summary:?}");
        assert!(summary.duration_seconds < 5.0, "{summary:?}");
    }

    #[tokio::test]
    async fn new_settings_take_effect_in_the_pause_they_arrive_in() {
        let kernel = sim(0.0, false);
        kernel.preset(MI2, PoolScope::Global, 300).unwrap();
        // The first write takes its whole budget, so an hour's pause follows
        // it; settings without a pause arrive during it.
        kernel.hang_next_write(Duration::from_millis(60));
        let slow = Settings {
            step_pause: Duration::from_secs(3600),
            ..scaled(1.0)
        };
        let goal = Goal {
            target: target(0),
            settings: slow,
        };
        let run = resize_with(&kernel, goal, Options::default(), |event, tx| {
            if let Event::Step(StepEvent { step: 1, .. }) = event {
                tx.send_modify(|goal| goal.settings.step_pause = Duration::ZERO);
            }
        });
        let (summary, events) = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("the pause of the old settings ran on");
        assert!(summary.reached(), "{summary:?}");
        assert!(summary.steps >= 2, "{summary:?}");
        assert!(
            events
                .iter()
                .any(|e| matches!(e, Event::Resettled(settings) if settings.step_pause.is_zero())),
            "{events:?}"
        );
    }

    #[tokio::test]
    async fn a_write_past_the_stall_threshold_is_reported_while_it_runs() {
        let kernel = sim(0.0, false);
        kernel.preset(MI2, PoolScope::Global, 1024).unwrap();
        kernel.hang_next_write(Duration::from_millis(300));
        let settings = Settings {
            stall_threshold: Duration::from_millis(100),
            ..scaled(1.0)
        };
        let (summary, events) = resize(&kernel, 0, settings, Options::default()).await;
        assert!(summary.reached());
        assert_eq!(summary.stalls, 1);
        let Some(Event::Stall {
            step: 1,
            pages: 256,
            elapsed,
            ..
        }) = events.first()
        else {
            panic!("first event is not a stall: {events:?}");
        };
        assert!(*elapsed >= Duration::from_millis(100));
        assert!(summary.max_write_seconds >= 0.3);
        assert!(matches!(&events[1], Event::Step(StepEvent { step: 1, .. })));
        // The write slept (a kernel that is slow, not a busy CPU): little
        // or none of its 300 ms was spent waiting for a CPU, and the wait
        // is the write's own, not the thread's since it started.
        if std::path::Path::new("/proc/thread-self/schedstat").exists() {
            let Event::Step(stalled) = &events[1] else {
                unreachable!()
            };
            let wait = stalled.cpu_wait.expect("schedstat is readable here");
            assert!(wait < Duration::from_millis(200), "{stalled:?}");
            assert_eq!(summary.write_cpu_wait_seconds.len() as u32, summary.steps);
        }
        // The step after the stall is smaller than the stalled one.
        let Some(Event::Step(second)) = events.get(2) else {
            panic!("{events:?}");
        };
        assert!(second.pages <= 256 / 4, "{second:?}");
    }

    #[tokio::test]
    async fn failed_writes_are_retried_then_reported() {
        let kernel = sim(0.0, false);
        kernel.fail_next_writes(2);
        let (summary, events) = resize(&kernel, 100, scaled(1.0), Options::default()).await;
        assert!(summary.reached());
        let failures = events
            .iter()
            .filter(|e| matches!(e, Event::WriteFailed { .. }))
            .count();
        assert_eq!(failures, 2);

        kernel.fail_next_writes(100);
        let (summary, _) = resize(&kernel, 200, scaled(1.0), Options::default()).await;
        let Outcome::Shortfall {
            reason: ShortfallReason::WriteError,
            requested: 200,
            achieved: 100,
            detail: Some(detail),
        } = &summary.outcome
        else {
            panic!("{summary:?}");
        };
        assert!(detail.contains("Input/output error"), "{detail}");
    }

    #[tokio::test]
    async fn a_new_target_takes_effect_at_the_next_step() {
        let kernel = sim(0.0, false);
        let goal = Goal {
            target: target(4096),
            settings: scaled(1.0),
        };
        let (summary, _) = resize_with(&kernel, goal, Options::default(), |event, tx| {
            if let Event::Step(StepEvent { step: 2, .. }) = event {
                tx.send_modify(|goal| goal.target = target(20));
            }
        })
        .await;
        assert!(summary.reached());
        assert_eq!((summary.to, summary.achieved), (20, 20));
        assert_eq!(kernel.pool(MI2).unwrap().total, 20);
    }

    #[tokio::test]
    async fn blocked_shrink_finishes_by_itself_when_pages_are_released() {
        let kernel = sim(0.0, false);
        kernel.preset(MI2, PoolScope::Global, 100).unwrap();
        kernel.hold_pages(MI2, 0, 60).unwrap();
        let (summary, _) = resize(&kernel, 10, scaled(1.0), Options::default()).await;
        assert_eq!(
            summary.outcome,
            Outcome::Blocked {
                target: 10,
                current: 60,
                in_use: 60,
                reserved: 0,
                surplus: 0,
                floor: 60,
                claimed: 0,
            }
        );
        assert_eq!(summary.achieved, 60);

        let releaser = kernel.clone();
        let max_surplus = Mutex::new(0);
        let options = Options {
            blocked_wait: Duration::from_secs(10),
            blocked_poll: Duration::from_millis(5),
        };
        let goal = Goal {
            target: target(10),
            settings: scaled(1.0),
        };
        let (summary, _) = resize_with(&kernel, goal, options, |event, _| {
            if let Ok(pool) = releaser.pool(MI2) {
                let mut max = max_surplus.lock().unwrap();
                *max = (*max).max(pool.surplus);
            }
            if matches!(event, Event::Blocked(_)) {
                releaser.release_pages(MI2, 0, 60).unwrap();
            }
        })
        .await;
        assert!(summary.reached(), "{summary:?}");
        assert_eq!(kernel.pool(MI2).unwrap().total, 10);
        assert_eq!(*max_surplus.lock().unwrap(), 0);
    }

    #[tokio::test]
    async fn growth_stops_at_the_memory_guard() {
        let kernel = sim(0.0, false);
        kernel.set_other_memory(0, 14 * GIB);
        let (summary, events) = resize(&kernel, 2048, scaled(1.0), Options::default()).await;
        // 16 GiB - 14 GiB used - 1 GiB guard - 32 MiB headroom leaves room
        // for 496 pages.
        assert_eq!(summary.achieved, 496);
        assert!(matches!(
            summary.outcome,
            Outcome::Shortfall {
                reason: ShortfallReason::MemoryGuard,
                requested: 2048,
                achieved: 496,
                ..
            }
        ));
        assert!(events.iter().all(|e| match e {
            Event::Step(step) => step.mem_available >= GIB,
            _ => true,
        }));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fifty_simulated_agents_resize_side_by_side() {
        let mut tasks = Vec::new();
        for agent in 0..50u64 {
            let kernel = sim(0.01, agent % 2 == 0);
            tasks.push(tokio::spawn(async move {
                let wanted = 1000 + agent * 10;
                let (summary, _) = resize(&kernel, wanted, scaled(0.01), Options::default()).await;
                (wanted, summary)
            }));
        }
        for task in tasks {
            let (wanted, summary) = task.await.unwrap();
            assert!(summary.reached());
            assert_eq!(summary.achieved, wanted);
        }
    }
}
