//! The resize loop: one pass over every target of the node, each resize run
//! by the engine and followed through spec changes, its outcome recorded.

use super::decide::{Action, Restart, Waits, Wake, decide, kubelet_restart, next_wake};
use super::*;
use crate::resize::Settings;

/// What the resize loop works with; `run` builds it.
pub(super) struct ResizeLoop {
    pub(super) kernel: Arc<dyn Kernel>,
    pub(super) config: AgentConfig,
    pub(super) shared: Arc<Shared>,
    pub(super) events: EventSender,
}

pub(super) fn find_goal(
    object: Option<&HugePageNode>,
    size: PageSize,
    scope: PoolScope,
) -> Option<Goal> {
    let entry = object?.spec.page_sizes.iter().find(|e| e.size == size)?;
    let target = targets_for(entry).into_iter().find(|t| t.scope == scope)?;
    Some(Goal {
        target,
        settings: settings_for(entry),
    })
}

impl ResizeLoop {
    /// Pages the kubelet plugin's prepared claims hold in `target`'s scope:
    /// a shrink leaves them.
    fn hold(&self, target: Target) -> u64 {
        let numa = match target.scope {
            PoolScope::Global => None,
            PoolScope::Node(node) => Some(node),
        };
        crate::dra::claimed_of(&self.shared.claimed.borrow(), target.size, numa)
    }

    /// One pass over every target; returns when to look again.
    pub(super) async fn converge(
        &mut self,
        object: Option<&HugePageNode>,
        spec_rx: &mut watch::Receiver<Option<HugePageNode>>,
        shutdown: &mut watch::Receiver<bool>,
        models: &mut CostModels,
    ) -> Duration {
        let entries = object
            .map(|o| o.spec.page_sizes.clone())
            .unwrap_or_default();
        {
            let mut memory = self.shared.memory();
            memory.generation = object.and_then(|o| o.metadata.generation);
            memory.targets = entries.clone();
        }
        self.shared.touch(true);
        let offered = match self.blocking(|k| k.page_sizes()).await {
            Ok(sizes) => sizes,
            Err(err) => {
                warn!(error = %err, "cannot read the kernel's page sizes");
                return self.config.blocked_poll;
            }
        };
        let numa_nodes = match self.blocking(|k| k.numa_nodes()).await {
            Ok(nodes) => nodes,
            Err(err) => {
                warn!(error = %err, "cannot list the NUMA nodes");
                return self.config.blocked_poll;
            }
        };
        let mut waiting = Vec::new();
        for entry in &entries {
            let size = entry.size;
            if !offered.contains(&size) {
                continue; // reported as UnsupportedPageSize by the status
            }
            if status::out_of_range(entry).is_some() {
                continue; // reported as InvalidTarget by the status
            }
            let targets = targets_for(entry);
            if targets
                .iter()
                .any(|t| matches!(t.scope, PoolScope::Node(n) if !numa_nodes.contains(&n)))
            {
                continue; // reported as InvalidTarget by the status
            }
            for target in targets {
                if *shutdown.borrow() || spec_rx.has_changed().unwrap_or(false) {
                    return Duration::ZERO;
                }
                let observed = match resize::executor::observe(&self.kernel, target).await {
                    Ok(observed) => observed,
                    Err(err) => {
                        warn!(error = %err, %size, scope = %target.scope, "cannot read the pool");
                        waiting.push(Wake::Blocked);
                        continue;
                    }
                };
                let last = self
                    .shared
                    .memory()
                    .sizes
                    .get(&size)
                    .and_then(|r| r.outcomes.get(&target.scope).cloned());
                let retry_due =
                    self.retry_due(size) || self.settings_changed(size, target.scope, entry);
                match decide(
                    target.pages,
                    self.hold(target),
                    &observed,
                    last.as_ref(),
                    retry_due,
                ) {
                    Action::Idle => continue,
                    Action::WaitBlocked => {
                        waiting.push(Wake::Blocked);
                        continue;
                    }
                    Action::WaitRetry => {
                        waiting.push(Wake::Retry);
                        continue;
                    }
                    // Someone else writes this pool (tuned, sysctl.d, a
                    // second tool): say so, and restore it only after a
                    // backoff that grows while they keep writing.
                    Action::OtherWriter => {
                        let wait = self.other_writer(size, target, observed.persistent());
                        if !wait.is_zero() {
                            waiting.push(Wake::After(wait));
                            continue;
                        }
                    }
                    Action::Resize => {}
                }
                let outcome = self.resize(entry, target, spec_rx, shutdown, models).await;
                self.save_models(models);
                match outcome {
                    Some(Outcome::Blocked { .. }) | None => waiting.push(Wake::Blocked),
                    Some(Outcome::Shortfall { .. }) => waiting.push(Wake::Retry),
                    Some(Outcome::Reached) => {}
                }
            }
        }
        if !*shutdown.borrow()
            && let Some(wait) = self.maybe_restart_kubelet(&entries).await
        {
            waiting.push(Wake::After(wait));
        }
        next_wake(
            waiting,
            &Waits {
                refresh: self.config.refresh_interval,
                blocked_poll: self.config.blocked_poll,
                retry: self.config.retry_interval,
            },
        )
    }

    /// Records that another writer moved `target`'s pool to `found`, and
    /// returns how long to leave it before restoring (zero: restore now).
    fn other_writer(&self, size: PageSize, target: Target, found: u64) -> Duration {
        let now = Instant::now();
        let mut memory = self.shared.memory();
        let record = memory.sizes.entry(size).or_default();
        // A record for another target (or none) starts over.
        let writer = match &mut record.other_writer {
            Some(w) if w.target == target.pages && w.scope == target.scope => w,
            slot => slot.insert(status::OtherWriter {
                scope: target.scope,
                target: target.pages,
                found,
                times: 0,
                restore_at: now,
                restored: true,
            }),
        };
        if !writer.restored {
            // The move already counted: wait out its backoff, then restore.
            let wait = writer.restore_at.saturating_duration_since(now);
            if wait.is_zero() {
                writer.restored = true;
            }
            return wait;
        }
        // A new move: the first, or one after our last restore.
        writer.times += 1;
        writer.found = found;
        writer.restored = false;
        let wait = other_writer_backoff(writer.times);
        writer.restore_at = now + wait;
        let (times, scope) = (writer.times, writer.scope);
        drop(memory);
        self.shared
            .metrics
            .foreign_writes
            .get_or_create(&SizeLabels {
                size: size.to_string(),
            })
            .inc();
        warn!(%size, %scope, found, target = target.pages, times, restore_in = ?wait,
            "another writer changed the pool; restoring it after a backoff");
        self.event(
            EventType::Warning,
            "OtherWriter",
            format!(
                "{size} {scope}: another writer set the pool to {found} (target {}); \
                 {times} times so far, restoring in {wait:?}",
                target.pages
            ),
        );
        self.shared.touch(true);
        wait
    }

    /// Whether `entry`'s settings differ from those the last resize of this
    /// file ended with.
    fn settings_changed(&self, size: PageSize, scope: PoolScope, entry: &PageSizeTarget) -> bool {
        let memory = self.shared.memory();
        memory
            .sizes
            .get(&size)
            .and_then(|r| r.ended_with.get(&scope))
            .is_some_and(|ended| *ended != settings_for(entry))
    }

    fn retry_due(&self, size: PageSize) -> bool {
        let memory = self.shared.memory();
        let finished = memory
            .sizes
            .get(&size)
            .and_then(|r| r.last_resize.as_ref())
            .and_then(|s| s.finished_at.clone());
        match finished {
            Some(at) => {
                let age = jiff::Timestamp::now().duration_since(at.0);
                age.as_secs_f64() >= self.config.retry_interval.as_secs_f64()
            }
            None => true,
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        read: impl FnOnce(&dyn Kernel) -> crate::Result<T> + Send + 'static,
    ) -> crate::Result<T> {
        let kernel = Arc::clone(&self.kernel);
        tokio::task::spawn_blocking(move || read(kernel.as_ref()))
            .await
            .map_err(|err| crate::Error::WriteThread(err.to_string()))?
    }

    /// Runs one resize to `target`, following spec changes at step boundaries.
    async fn resize(
        &mut self,
        entry: &PageSizeTarget,
        target: Target,
        spec_rx: &mut watch::Receiver<Option<HugePageNode>>,
        shutdown: &mut watch::Receiver<bool>,
        models: &mut CostModels,
    ) -> Option<Outcome> {
        let size = target.size;
        let size_label = size.to_string();
        let from = resize::executor::observe(&self.kernel, target)
            .await
            .map(|o| o.persistent())
            .unwrap_or(0);
        let direction = if target.pages >= from {
            Direction::Grow
        } else {
            Direction::Shrink
        };
        {
            let mut memory = self.shared.memory();
            let record = memory.sizes.entry(size).or_default();
            record.running = Some(Running {
                direction,
                from,
                target: target.pages,
            });
            record.stall = None;
        }
        self.shared.touch(true);
        self.event(
            EventType::Normal,
            "ResizeStarted",
            format!("{size} {}: {from} -> {} pages", target.scope, target.pages),
        );

        let span = info_span!("resize", node = %self.config.node_name, size = %size_label, scope = %target.scope, from, target = target.pages, direction = direction.as_str());
        let (goal_tx, mut goal_rx) = watch::channel(Goal {
            target,
            settings: Settings {
                hold: self.hold(target),
                ..settings_for(entry)
            },
        });
        let mut claimed_rx = self.shared.claimed.subscribe();
        let stopping = Arc::new(AtomicBool::new(false));
        let options = resize::Options::default();
        let on_event = {
            let shared = Arc::clone(&self.shared);
            let events = self.events.clone();
            let goal_tx = goal_tx.clone();
            let stopping = Arc::clone(&stopping);
            let size_label = size_label.clone();
            move |event: &Event| {
                on_resize_event(
                    event,
                    &shared,
                    &events,
                    &goal_tx,
                    &stopping,
                    size,
                    &size_label,
                )
            }
        };
        let engine = resize::run(
            Arc::clone(&self.kernel),
            &mut goal_rx,
            &options,
            models,
            on_event,
        )
        .instrument(span.clone());
        tokio::pin!(engine);
        let result = loop {
            tokio::select! {
                result = &mut engine => break result,
                changed = spec_rx.changed(), if !stopping.load(Ordering::Relaxed) => {
                    let object = if changed.is_ok() { spec_rx.borrow().clone() } else { None };
                    match find_goal(object.as_ref(), size, target.scope) {
                        Some(new_goal) => {
                            let mut memory = self.shared.memory();
                            memory.generation = object.as_ref().and_then(|o| o.metadata.generation);
                            memory.targets = object.as_ref().map(|o| o.spec.page_sizes.clone()).unwrap_or_default();
                            if let Some(running) = memory.sizes.get_mut(&size).and_then(|r| r.running.as_mut()) {
                                running.target = new_goal.target.pages;
                            }
                            drop(memory);
                            let new_goal = Goal {
                                settings: Settings { hold: self.hold(target), ..new_goal.settings },
                                ..new_goal
                            };
                            goal_tx.send_if_modified(|goal| {
                                let modified = *goal != new_goal;
                                *goal = new_goal;
                                modified
                            });
                        }
                        None => {
                            // The entry is gone: stop after the write in flight.
                            span.in_scope(|| info!("target removed mid-resize; stopping at the next step boundary"));
                            stopping.store(true, Ordering::Relaxed);
                        }
                    }
                }
                // A claim prepared or let go mid-resize: a shrink leaves
                // its pages from the next write on.
                Ok(()) = claimed_rx.changed() => {
                    let hold = self.hold(target);
                    goal_tx.send_if_modified(|goal| {
                        let modified = goal.settings.hold != hold;
                        goal.settings.hold = hold;
                        modified
                    });
                }
                _ = shutdown.changed(), if !stopping.load(Ordering::Relaxed) => {
                    span.in_scope(|| info!("shutdown requested; stopping at the next step boundary"));
                    stopping.store(true, Ordering::Relaxed);
                }
            }
        };
        let outcome = match result {
            Ok(summary) => {
                self.record_summary(&summary, target.scope, &span);
                // The entry's settings, not the claims' hold, which
                // changes on its own (settings_changed compares these).
                let settings = Settings {
                    hold: 0,
                    ..goal_tx.borrow().settings.clone()
                };
                if let Some(record) = self.shared.memory().sizes.get_mut(&size) {
                    record.ended_with.insert(target.scope, settings);
                }
                Some(summary.outcome)
            }
            Err(err) => {
                span.in_scope(|| warn!(error = %err, "resize failed"));
                self.event(
                    EventType::Warning,
                    "ResizeFailed",
                    format!("{size} {}: {err}", target.scope),
                );
                let mut memory = self.shared.memory();
                if let Some(record) = memory.sizes.get_mut(&size) {
                    record.running = None;
                }
                None
            }
        };
        self.shared.touch(true);
        outcome
    }

    /// Keeps what this resize measured for the next agent (a small file on
    /// the host's tmpfs: written in place of the loop's next step).
    fn save_models(&self, models: &CostModels) {
        let Some(path) = &self.config.model_file else {
            return;
        };
        if let Err(err) = crate::resize::model_file::save(path, models, &self.config.kernel_release)
        {
            warn!(path = %path.display(), error = %err, "cannot save the cost models");
        }
    }

    fn record_summary(&self, summary: &Summary, scope: PoolScope, span: &tracing::Span) {
        let size: Option<PageSize> = summary.page_size.parse().ok();
        let outcome_name = match &summary.outcome {
            Outcome::Reached => "Reached",
            Outcome::Blocked { .. } => "Blocked",
            Outcome::Shortfall { .. } => "Short",
        };
        span.in_scope(|| {
            info!(
                achieved = summary.achieved,
                to = summary.to,
                steps = summary.steps,
                max_write_seconds = summary.max_write_seconds,
                duration_seconds = summary.duration_seconds,
                outcome = outcome_name,
                "resize finished"
            )
        });
        let api_summary = ResizeSummary {
            from: summary.from as i64,
            to: summary.to as i64,
            achieved: summary.achieved as i64,
            steps: i64::from(summary.steps),
            max_step_seconds: summary.max_write_seconds,
            duration_seconds: summary.duration_seconds,
            pages_per_second: summary.pages_per_second,
            outcome: outcome_name.to_string(),
            finished_at: Some(Time(jiff::Timestamp::now())),
        };
        let note = format!(
            "{} {}: {} -> {} pages (target {}) in {} steps, {:.3}s, max write {:.3}s",
            summary.page_size,
            summary.scope,
            summary.from,
            summary.achieved,
            summary.to,
            summary.steps,
            summary.duration_seconds,
            summary.max_write_seconds
        );
        let previous = size.and_then(|s| {
            self.shared
                .memory()
                .sizes
                .get(&s)
                .and_then(|r| r.outcomes.get(&scope).cloned())
        });
        let repeated = previous.as_ref().is_some_and(|(t, o)| {
            *t == summary.to
                && std::mem::discriminant(o) == std::mem::discriminant(&summary.outcome)
        });
        match &summary.outcome {
            Outcome::Reached => self.event(EventType::Normal, "ResizeFinished", note),
            Outcome::Blocked { in_use, reserved, .. } if !repeated => self.event(
                EventType::Warning,
                "ShrinkBlocked",
                format!("{note}; {in_use} pages in use and {reserved} reserved keep the pool above target"),
            ),
            Outcome::Shortfall { requested, achieved, reason, .. } if !repeated => self.event(
                EventType::Warning,
                "AllocationShort",
                format!("{note}; requested {requested}, achieved {achieved} ({reason:?})"),
            ),
            _ => {}
        }
        if let Some(size) = size {
            let shortfall = match &summary.outcome {
                Outcome::Shortfall {
                    requested,
                    achieved,
                    ..
                } => requested.saturating_sub(*achieved),
                _ => 0,
            };
            self.shared
                .metrics
                .shortfall_pages
                .get_or_create(&SizeLabels {
                    size: size.to_string(),
                })
                .set(shortfall as i64);
            let mut memory = self.shared.memory();
            let record = memory.sizes.entry(size).or_default();
            record.running = None;
            record
                .outcomes
                .insert(scope, (summary.to, summary.outcome.clone()));
            record.last_resize = Some(api_summary);
        }
    }

    fn event(&self, type_: EventType, reason: &'static str, note: String) {
        queue_event(
            &self.events,
            &self.shared.metrics,
            PendingEvent {
                type_,
                reason,
                note,
            },
        );
    }

    /// With `kubeletRestart: AfterResize`, restarts kubelet once the node has
    /// converged and kubelet's capacity is stale, at most once per change
    /// (`decide::kubelet_restart`); returns when a failed restart is retried.
    async fn maybe_restart_kubelet(&self, entries: &[PageSizeTarget]) -> Option<Duration> {
        use hugepool_crds::settings::KubeletRestart;
        let wanted = !self.config.kubelet_restart_command.is_empty()
            && entries
                .iter()
                .any(|e| e.kubelet_restart == KubeletRestart::AfterResize);
        if !wanted {
            return None;
        }
        let snapshot = KernelSnapshot::read_blocking(&self.kernel, &self.config.kernel_release)
            .await
            .ok()?;
        let memory_manager = match self.config.kubelet_root_dir.clone() {
            Some(root) => status::MemoryManagerView::from_read(
                tokio::task::spawn_blocking(move || root.read())
                    .await
                    .unwrap_or_else(|e| Err(e.to_string())),
            ),
            None => status::MemoryManagerView::NotRead,
        };
        let (pools, decision) = {
            let mut memory = self.shared.memory();
            if memory.kubelet.memory_manager != memory_manager {
                memory.kubelet.memory_manager = memory_manager;
                self.shared.touch(true);
            }
            let converged = memory.targets.iter().all(|e| {
                status::progress(e, &snapshot, &memory.claimed) == status::Progress::AtTarget
            });
            let pools = status::kubelet_pools(&snapshot, &memory);
            let decision =
                kubelet_restart(wanted, converged, &pools, &memory.kubelet, Instant::now());
            (pools, decision)
        };
        match decision {
            Restart::Due => {}
            Restart::WaitRetry(wait) => return Some(wait),
            _ => return None,
        }
        super::kubelet::spawn_restart(
            Arc::clone(&self.shared),
            self.events.clone(),
            super::kubelet::RestartPlan {
                command: self.config.kubelet_restart_command.clone(),
                log_command: self.config.kubelet_log_command.clone(),
                timeout: self.config.kubelet_restart_timeout,
                ready_timeout: self.config.kubelet_ready_timeout,
                root_dir: self.config.kubelet_root_dir.clone(),
            },
            pools,
        );
        None
    }
}

/// How long a pool another writer moved is left before it is restored: 10 s
/// the first time, doubling while they keep writing, at most 30 min.
pub fn other_writer_backoff(times: u32) -> Duration {
    Duration::from_secs(10)
        .saturating_mul(1 << times.saturating_sub(1).min(8))
        .min(Duration::from_secs(1800))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn on_resize_event(
    event: &Event,
    shared: &Shared,
    events: &EventSender,
    goal_tx: &watch::Sender<Goal>,
    stopping: &AtomicBool,
    size: PageSize,
    size_label: &str,
) {
    match event {
        Event::Step(step) => {
            shared.liveness.beat();
            let labels = StepLabels {
                size: size_label.to_string(),
                direction: step.direction.as_str().to_string(),
            };
            shared
                .metrics
                .step_seconds
                .get_or_create(&labels)
                .observe(step.latency.as_secs_f64());
            shared
                .metrics
                .pages_moved
                .get_or_create(&labels)
                .inc_by(step.after.abs_diff(step.before));
            debug!(
                step = step.step,
                written = step.written,
                after = step.after,
                latency_ms = step.latency.as_secs_f64() * 1e3,
                cpu_wait_ms = step.cpu_wait.map(|wait| wait.as_secs_f64() * 1e3),
                "step"
            );
            if step.stalled {
                // The stall was reported while the write ran; now it says
                // how it ended and how much of it the node's CPUs were busy.
                if let Some(stall) = shared
                    .memory()
                    .sizes
                    .entry(size)
                    .or_default()
                    .stall
                    .as_mut()
                {
                    stall.message = format!("{}; {}", stall.message, ended_after(step));
                }
            }
            if stopping.load(Ordering::Relaxed) {
                // Make the pool as it is now the target: the engine finishes here.
                goal_tx.send_modify(|goal| goal.target.pages = step.after);
            }
            shared.touch(false);
        }
        Event::Stall {
            step,
            direction,
            pages,
            elapsed,
            threshold,
        } => {
            shared
                .metrics
                .stalls
                .get_or_create(&StallLabels {
                    reason: "SlowKernelWrite".into(),
                })
                .inc();
            let message = format!(
                "{size_label} {} write {step} of {pages} pages has taken {:.2}s (stall threshold {})",
                direction.as_str(),
                elapsed.as_secs_f64(),
                duration::format(*threshold)
            );
            warn!(%message, "slow kernel write");
            shared.memory().sizes.entry(size).or_default().stall = Some(StallRecord {
                reason: Reason::SlowKernelWrite,
                message: message.clone(),
            });
            queue_event(
                events,
                &shared.metrics,
                PendingEvent {
                    type_: EventType::Warning,
                    reason: "Stalled",
                    note: message,
                },
            );
            shared.touch(true);
        }
        Event::WriteFailed { step, error } => warn!(step, %error, "kernel write failed"),
        Event::Compacted { scope, error } => {
            info!(%scope, ?error, "compacted memory for a grow")
        }
        Event::Blocked(outcome) => debug!(?outcome, "waiting for pages in use"),
        Event::Retargeted(target) => info!(pages = target.pages, "retargeted at a step boundary"),
        Event::Resettled(settings) => info!(?settings, "new settings at a step boundary"),
    }
}

/// How a stalled write ended: its latency, and the share of it the writer
/// waited for a CPU (other work on the node's CPUs, not the kernel's pool
/// code) when the kernel says.
fn ended_after(step: &crate::resize::StepEvent) -> String {
    let ended = format!("it ended after {:.2}s", step.latency.as_secs_f64());
    match step.cpu_wait {
        Some(wait) => format!(
            "{ended}, {:.2}s of it waiting for a CPU",
            wait.as_secs_f64()
        ),
        None => ended,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::ended_after;
    use crate::resize::{Direction, StepEvent};

    #[test]
    fn a_stalled_write_says_how_much_of_it_was_waiting_for_a_cpu() {
        let mut step = StepEvent {
            step: 1,
            direction: Direction::Shrink,
            target: 0,
            written: 0,
            before: 1024,
            after: 0,
            pages: 1024,
            latency: Duration::from_millis(2480),
            cpu_wait: Some(Duration::from_millis(2290)),
            estimate: None,
            over_budget: true,
            stalled: true,
            guard_limited: false,
            mem_available: 0,
            why: crate::resize::planner::StepReason {
                limit: crate::resize::planner::StepLimit::Probe,
                aim: Duration::from_millis(30),
                cold: true,
            },
        };
        assert_eq!(
            ended_after(&step),
            "it ended after 2.48s, 2.29s of it waiting for a CPU"
        );
        step.cpu_wait = None;
        assert_eq!(ended_after(&step), "it ended after 2.48s");
    }
}
