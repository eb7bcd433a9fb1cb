//! The status writer: reads the kernel, builds the status (status.rs) and
//! patches it, with jittered backoff; also the gauges of what it read.

use super::*;

/// The longest wait between retries of a status write or a kernel read.
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A random wait in `[backoff / 2, backoff]` ("equal jitter").
pub(super) fn jittered(backoff: Duration) -> Duration {
    let half = backoff / 2;
    half + half.mul_f64(fastrand::f64())
}

/// The part of a status whose change is worth a patch: everything but the
/// ever-moving MemAvailable.
pub(super) fn significant(status: &HugePageNodeStatus) -> HugePageNodeStatus {
    HugePageNodeStatus {
        memory: None,
        ..status.clone()
    }
}

/// Builds and writes the status whenever something changed (at most once
/// per `min_patch_interval` unless urgent), and re-reads the kernel every
/// `refresh_interval`. Failed writes are retried with backoff; meanwhile
/// the resize loop goes on.
pub(super) async fn write_status(
    api: Api<HugePageNode>,
    kernel: Arc<dyn Kernel>,
    config: AgentConfig,
    shared: Arc<Shared>,
    mut done: watch::Receiver<bool>,
) {
    // Seeded from the object as the agent found it at start (see
    // `AgentMemory::reported_conditions`).
    let mut conditions: Vec<Condition> = Vec::new();
    let mut last_sent: Option<HugePageNodeStatus> = None;
    let mut last_patch = Instant::now() - config.min_patch_interval;
    let mut backoff = Duration::from_millis(250);
    let mut kernel_backoff = Duration::from_millis(250);
    let mut retry = false;
    // What the boot file holds now (None: not written by this agent yet).
    let mut saved_for_boot: Option<Vec<PageSizeTarget>> = None;
    // Said once per change: unreadable free lists are a deployment matter.
    let mut free_lists_error: Option<String> = None;
    loop {
        let stopping = *done.borrow();
        if !stopping && !retry {
            tokio::select! {
                _ = shared.changed.notified() => {}
                _ = tokio::time::sleep(config.refresh_interval) => {}
                _ = done.changed() => {}
            }
        }
        let urgent = shared.urgent.swap(false, Ordering::Relaxed) || *done.borrow();
        let since = last_patch.elapsed();
        if !urgent && since < config.min_patch_interval {
            tokio::time::sleep(config.min_patch_interval - since).await;
        }
        let snapshot = match KernelSnapshot::read_blocking(&kernel, &config.kernel_release).await {
            Ok(snapshot) => {
                kernel_backoff = Duration::from_millis(250);
                snapshot
            }
            Err(err) => {
                warn!(error = %err, retry_in_ms = kernel_backoff.as_millis() as u64, "cannot read the kernel for status");
                tokio::time::sleep(kernel_backoff).await;
                kernel_backoff = (kernel_backoff * 2).min(MAX_BACKOFF);
                if *done.borrow() {
                    return;
                }
                continue;
            }
        };
        let memory = {
            let mut memory = shared.memory();
            status::settle_restoring(&snapshot, &mut memory);
            let error = snapshot.free_lists.as_ref().err();
            if error != free_lists_error.as_ref() {
                match error {
                    Some(err) => {
                        warn!(error = %err, "cannot read the free lists: what a grow can get is not reported")
                    }
                    None => info!("reading the free lists: what a grow can get is reported"),
                }
                free_lists_error = error.cloned();
            }
            let fresh = status::obtainable(&snapshot, &memory.targets);
            shared
                .metrics
                .set_obtainable(snapshot.free_lists.is_ok(), &fresh);
            status::settle_obtainable(&mut memory, &fresh, std::time::Instant::now());
            if let Some(reported) = memory.reported_conditions.take() {
                conditions = reported;
            }
            memory.clone()
        };
        update_gauges(&shared.metrics, &snapshot, &memory);
        // Known only once the agent has read its HugePageNode: before, no
        // target says whether a slice is wanted.
        if memory.generation.is_some() {
            let want = slice::desired(
                &snapshot,
                &memory.targets,
                memory.kubelet.capacity.as_ref(),
                &memory.claimed,
            );
            match &want {
                slice::Desired::Devices(devices) => shared.metrics.set_claimable(devices),
                slice::Desired::Absent => shared.metrics.set_claimable(&[]),
                slice::Desired::Unknown => {}
            }
            shared.slice.send_if_modified(|current| {
                let changed = *current != want;
                *current = want;
                changed
            });
        }
        let now = Time(jiff::Timestamp::now());
        let status = status::build(&snapshot, &memory, &mut conditions, &now);
        if let Some(path) = &config.boot_file {
            keep_for_boot(
                path,
                &config.node_name,
                &status,
                &memory,
                &mut saved_for_boot,
            );
        }
        let has_object = memory.generation.is_some();
        let changed = last_sent.as_ref().map(significant) != Some(significant(&status));
        if has_object && changed {
            let body = serde_json::json!({
                "apiVersion": "hugepool.dev/v1alpha1",
                "kind": "HugePageNode",
                "status": status,
            });
            let params = PatchParams::apply(AGENT_MANAGER).force();
            match api
                .patch_status(&config.node_name, &params, &Patch::Apply(&body))
                .await
            {
                Ok(_) => {
                    shared
                        .metrics
                        .status_writes
                        .get_or_create(&metrics::ResultLabels::ok())
                        .inc();
                    last_sent = Some(status);
                    last_patch = Instant::now();
                    backoff = Duration::from_millis(250);
                    retry = false;
                    shared.patches.fetch_add(1, Ordering::Relaxed);
                    shared.ready.store(true, Ordering::Relaxed);
                }
                Err(err) => {
                    shared
                        .metrics
                        .status_writes
                        .get_or_create(&metrics::ResultLabels::error())
                        .inc();
                    // Jittered, so that a fleet of agents does not retry in
                    // step after an API outage.
                    let wait = jittered(backoff);
                    warn!(error = ?err, retry_in_ms = wait.as_millis() as u64, "status write failed");
                    tokio::time::sleep(wait).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    retry = true;
                    if *done.borrow() && backoff >= Duration::from_secs(2) {
                        return;
                    }
                    continue;
                }
            }
        }
        shared.reports.fetch_add(1, Ordering::Relaxed);
        if *done.borrow() {
            return;
        }
    }
}

/// The conditions of `object` this agent writes: all but the operator's
/// Draining.
pub(super) fn own_conditions(object: &HugePageNode) -> Vec<Condition> {
    object
        .status
        .iter()
        .flat_map(|s| s.conditions.iter())
        .filter(|c| c.type_ != hugepool_crds::NodeConditionType::Draining.as_str())
        .cloned()
        .collect()
}

/// Writes the targets to the boot file when the node has converged on
/// them and the file does not hold them yet (crate::boot).
fn keep_for_boot(
    path: &std::path::Path,
    node: &str,
    status: &HugePageNodeStatus,
    memory: &AgentMemory,
    saved: &mut Option<Vec<PageSizeTarget>>,
) {
    let converged = memory.generation.is_some()
        && status.observed_generation == memory.generation
        && hugepool_crds::conditions::is_true(
            &status.conditions,
            hugepool_crds::NodeConditionType::Converged,
        );
    if !converged || saved.as_ref() == Some(&memory.targets) {
        return;
    }
    let targets = crate::boot::BootTargets::new(node, memory.targets.clone());
    match crate::boot::save(path, &targets) {
        Ok(()) => {
            info!(path = %path.display(), entries = memory.targets.len(), "boot targets saved");
            *saved = Some(memory.targets.clone());
        }
        Err(err) => warn!(error = %err, "cannot save the boot targets"),
    }
}

pub(super) fn update_gauges(metrics: &Metrics, snapshot: &KernelSnapshot, memory: &AgentMemory) {
    metrics
        .mem_available_bytes
        .set(snapshot.memory.available_bytes as i64);
    for sizes in &snapshot.sizes {
        metrics.set_kernel_pages(sizes.size, &sizes.pool, &sizes.numa);
        // At 0 for every size the kernel offers once the pods are listed.
        if let Some(requested) = &memory.requested {
            let pages = requested.get(&sizes.size).copied().unwrap_or(0);
            metrics.set_requested_pages(sizes.size, pages);
        }
    }
    metrics.set_targets(&memory.targets);
}
