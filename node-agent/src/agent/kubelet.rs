//! Running the kubelet-restart command: bounded in time, its failure
//! explained, retried with backoff.

use super::*;

/// How a kubelet is restarted (from the agent's flags).
#[derive(Clone, Debug)]
pub(super) struct RestartPlan {
    pub command: Vec<String>,
    /// Prints the kubelet's recent log (empty: none), read when it does not
    /// come back.
    pub log_command: Vec<String>,
    /// How long the command may run.
    pub timeout: Duration,
    /// How long the kubelet has after the command to report the pools.
    pub ready_timeout: Duration,
    /// Where the kubelet keeps its Memory Manager checkpoint, when known.
    pub root_dir: Option<crate::kubelet_state::KubeletRootDir>,
}

/// Restarts the kubelet for `pools` on its own task, so that the resize loop
/// never waits for it: removes a Static Memory Manager's checkpoint (the
/// caller checked that it holds no assignment), runs the command (up to its
/// timeout), then waits until the Node reports the pools (up to
/// `ready_timeout`). Records how it ended: the pools it restarted for, or
/// the failure and when to try again.
pub(super) fn spawn_restart(
    shared: Arc<Shared>,
    events: EventSender,
    plan: RestartPlan,
    pools: BTreeMap<PageSize, u64>,
) {
    let (clear_state, failed_before) = {
        let mut memory = shared.memory();
        memory.kubelet.restarting = true;
        let failed_before = memory
            .kubelet
            .failure
            .as_ref()
            .filter(|f| f.pools == pools)
            .map_or(0, |f| f.attempts);
        let clear_state = matches!(
            memory.kubelet.memory_manager,
            status::MemoryManagerView::Static(_)
        );
        (clear_state, failed_before)
    };
    let command = plan.command.clone();
    info!(
        ?command,
        clear_state, "restarting kubelet so it reports the new hugepage capacity"
    );
    tokio::spawn(async move {
        let result = restart_and_verify(&shared, &plan, clear_state, &pools).await;
        if let Ok(Restart::Held(assignments)) = result {
            // A pod got a Memory Manager assignment after the decision: the
            // restart waits for it as for any holder (nothing failed).
            let pods: Vec<&str> = assignments.iter().map(|a| a.pod_uid.as_str()).collect();
            info!(
                ?pods,
                "kubelet restart held: the Memory Manager assigned memory since the last read"
            );
            {
                let mut memory = shared.memory();
                memory.kubelet.restarting = false;
                memory.kubelet.memory_manager = status::MemoryManagerView::Static(assignments);
            }
            shared.touch(true);
            return;
        }
        let result = result.map(|_| ());
        {
            let mut memory = shared.memory();
            memory.kubelet.restarting = false;
            match &result {
                Ok(()) => {
                    memory.kubelet.restarted_for = Some(pools);
                    memory.kubelet.failure = None;
                }
                Err(message) => {
                    // Not restarted for these pools: the failure's backoff decides.
                    memory.kubelet.restarted_for = None;
                    let attempts = failed_before + 1;
                    let backoff = restart_backoff(attempts);
                    memory.kubelet.failure = Some(status::RestartFailure {
                        pools,
                        attempts,
                        message: format!("{message} (attempt {attempts}, next in {backoff:?})"),
                        retry_at: Instant::now() + backoff,
                    });
                }
            }
        }
        let event = match result {
            Ok(()) => PendingEvent {
                type_: EventType::Normal,
                reason: "KubeletRestarted",
                note: format!(
                    "ran {}{}; the kubelet reports the pools",
                    command.join(" "),
                    if clear_state {
                        " after removing the Memory Manager checkpoint"
                    } else {
                        ""
                    }
                ),
            },
            Err(message) => {
                warn!(%message, "kubelet restart failed");
                PendingEvent {
                    type_: EventType::Warning,
                    reason: "KubeletRestartFailed",
                    note: message,
                }
            }
        };
        queue_event(&events, &shared.metrics, event);
        shared.touch(true);
    });
}

/// How a restart ended when it did not fail.
enum Restart {
    /// The Node reports every pool.
    Done,
    /// Not restarted: read once more right before its removal, the
    /// checkpoint held these assignments.
    Held(Vec<crate::kubelet_state::Assignment>),
}

/// The restart itself, verified: Done once the Node reports every pool.
async fn restart_and_verify(
    shared: &Shared,
    plan: &RestartPlan,
    clear_state: bool,
    pools: &BTreeMap<PageSize, u64>,
) -> Result<Restart, String> {
    if clear_state && let Some(root) = &plan.root_dir {
        let root = root.clone();
        let held = tokio::task::spawn_blocking(move || root.clear_unless_assigned())
            .await
            .map_err(|e| e.to_string())??;
        if !held.is_empty() {
            return Ok(Restart::Held(held));
        }
    }
    run_bounded(&plan.command, plan.timeout).await?;
    // The status says KubeletRestarted while the kubelet comes back, not the
    // failure of an attempt before this one (its count is kept by the caller).
    {
        let mut memory = shared.memory();
        memory.kubelet.restarted_for = Some(pools.clone());
        memory.kubelet.failure = None;
    }
    shared.touch(true);
    let deadline = Instant::now() + plan.ready_timeout;
    loop {
        let (reports, ready) = {
            let memory = shared.memory();
            let reports = memory.kubelet.capacity.as_ref().is_some_and(|capacity| {
                pools.iter().all(|(&size, &pages)| {
                    !hugepool_crds::kubelet::capacity_stale(capacity, size, pages)
                })
            });
            (reports, memory.kubelet.node_ready.clone())
        };
        if reports {
            return Ok(Restart::Done);
        }
        if Instant::now() >= deadline {
            let want: Vec<String> = pools
                .iter()
                .map(|(size, pages)| format!("{pages} x {size}"))
                .collect();
            let last_error = match last_kubelet_error(&plan.log_command).await {
                Ok(Some(line)) => format!("; the kubelet's last error: {line}"),
                Ok(None) => String::new(),
                Err(why) => format!("; its log could not be read: {why}"),
            };
            return Err(format!(
                "the kubelet did not report {} within {:?} of its restart (the Node's Ready: {}){last_error}",
                want.join(", "),
                plan.ready_timeout,
                ready.as_deref().unwrap_or("not reported")
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How long the kubelet's log command may run.
const LOG_TIMEOUT: Duration = Duration::from_secs(20);

/// The last error in the kubelet's recent log (from `command`), if any.
async fn last_kubelet_error(command: &[String]) -> Result<Option<String>, String> {
    let Some((program, args)) = command.split_first() else {
        return Ok(None);
    };
    let shown = command.join(" ");
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("{shown}: {err}"))?;
    let group = child.id().and_then(|id| i32::try_from(id).ok());
    match tokio::time::timeout(LOG_TIMEOUT, child.wait_with_output()).await {
        Err(_) => {
            if let Some(group) = group {
                // SAFETY: signals only the process group this call created.
                unsafe { libc::killpg(group, libc::SIGKILL) };
            }
            Err(format!("{shown} did not finish within {LOG_TIMEOUT:?}"))
        }
        Ok(Err(err)) => Err(format!("{shown}: {err}")),
        Ok(Ok(output)) => Ok(last_error(&String::from_utf8_lossy(&output.stdout))),
    }
}

/// Characters of a log line kept in a condition's message.
const ERROR_KEPT: usize = 400;

/// The last error line of a kubelet log: a klog error or fatal line
/// (`E1204 11:38:19.123456 ...`), else the last line that names an error.
pub(super) fn last_error(log: &str) -> Option<String> {
    let klog_error = |line: &str| {
        let bytes = line.as_bytes();
        matches!(bytes.first(), Some(b'E' | b'F'))
            && bytes
                .get(1..5)
                .is_some_and(|digits| digits.iter().all(u8::is_ascii_digit))
    };
    let lines = || {
        log.lines()
            .rev()
            .map(str::trim)
            .filter(|line| !line.is_empty())
    };
    let line = lines()
        .find(|line| klog_error(line))
        .or_else(|| lines().find(|line| line.to_ascii_lowercase().contains("err")))?;
    Some(match line.char_indices().nth(ERROR_KEPT) {
        Some((end, _)) => format!("{}...", &line[..end]),
        None => line.to_string(),
    })
}

/// Bytes of a command's stderr kept (its end): a command that writes without
/// end costs the agent no more than this.
const STDERR_KEPT: usize = 4096;

/// Runs `command` to its end or kills it (and everything it started) after
/// `timeout`; the error says which happened, with the end of its stderr.
pub(super) async fn run_bounded(command: &[String], timeout: Duration) -> Result<(), String> {
    use tokio::io::AsyncReadExt;
    let shown = command.join(" ");
    let mut child = tokio::process::Command::new(&command[0])
        .args(&command[1..])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("{shown}: {err}"))?;
    let group = child.id().and_then(|id| i32::try_from(id).ok());
    let mut stderr = child.stderr.take();
    // Reads stderr to its end, keeping only its last STDERR_KEPT bytes.
    let tail = async move {
        let mut kept: Vec<u8> = Vec::new();
        let mut chunk = [0u8; 8192];
        if let Some(stderr) = stderr.as_mut() {
            while let Ok(n) = stderr.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                kept.extend_from_slice(&chunk[..n]);
                if kept.len() > STDERR_KEPT {
                    kept.drain(..kept.len() - STDERR_KEPT);
                }
            }
        }
        kept
    };
    let finished = async { tokio::join!(child.wait(), tail) };
    match tokio::time::timeout(timeout, finished).await {
        Err(_) => {
            if let Some(group) = group {
                // SAFETY: signals only the process group this call created.
                unsafe { libc::killpg(group, libc::SIGKILL) };
            }
            Err(format!(
                "{shown} did not finish within {timeout:?} and was killed"
            ))
        }
        Ok((Err(err), _)) => Err(format!("{shown}: {err}")),
        Ok((Ok(status), _)) if status.success() => Ok(()),
        Ok((Ok(status), kept)) => {
            let stderr = String::from_utf8_lossy(&kept);
            let stderr = stderr.trim();
            let start = stderr.char_indices().rev().nth(299).map_or(0, |(i, _)| i);
            Err(format!(
                "{shown} exited with {status}: {}",
                &stderr[start..]
            ))
        }
    }
}

/// Wait before retrying a failed kubelet restart: 10 s doubling to 10 min.
pub(super) fn restart_backoff(attempts: u32) -> Duration {
    let base = Duration::from_secs(10);
    base.saturating_mul(1 << attempts.saturating_sub(1).min(6))
        .min(Duration::from_secs(600))
}

#[cfg(test)]
mod tests {
    use super::last_error;

    #[test]
    fn the_last_error_of_a_kubelet_log_is_its_last_klog_error_line() {
        let log = "\
I1204 11:40:01.000001  812 server.go:530] \"Kubelet version\" kubeletVersion=\"v1.37.2\"
E1204 11:40:01.000002  812 run.go:72] \"command failed\" err=\"first\"
W1204 11:40:01.000003  812 server.go:610] \"no error here\"
E1204 11:40:02.000004  812 run.go:72] \"command failed\" err=\"start memory manager error\"
I1204 11:40:02.000005  812 server.go:700] \"Shutting down\"
";
        assert_eq!(
            last_error(log).as_deref(),
            Some(
                "E1204 11:40:02.000004  812 run.go:72] \"command failed\" err=\"start memory manager error\""
            )
        );
        // Without klog lines, the last line that names an error.
        let plain = "starting\nError: failed to load kubelet config file\nexiting\n";
        assert_eq!(
            last_error(plain).as_deref(),
            Some("Error: failed to load kubelet config file")
        );
        assert_eq!(last_error("I1204 fine\nall good\n"), None);
        assert_eq!(last_error(""), None);
        // A long line is cut, on a character boundary.
        let long = format!("E1204 {}", "é".repeat(1000));
        let kept = last_error(&long).expect("an error line");
        assert_eq!(kept.chars().count(), 403);
        assert!(kept.ends_with("..."));
    }
}
