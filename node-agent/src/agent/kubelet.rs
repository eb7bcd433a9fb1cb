//! Running the kubelet-restart command: bounded in time, its failure
//! explained, retried with backoff.

use super::*;

/// Runs the restart command for `pools` on its own task, so that the resize
/// loop never waits for it (up to `timeout`), and records how it ended: the
/// pools it restarted for, or the failure and when to try again.
pub(super) fn spawn_restart(
    shared: Arc<Shared>,
    events: EventSender,
    command: Vec<String>,
    timeout: Duration,
    pools: BTreeMap<PageSize, u64>,
) {
    shared.memory().kubelet.restarting = true;
    info!(
        ?command,
        "restarting kubelet so it reports the new hugepage capacity"
    );
    tokio::spawn(async move {
        let result = run_bounded(&command, timeout).await;
        {
            let mut memory = shared.memory();
            memory.kubelet.restarting = false;
            match &result {
                Ok(()) => {
                    memory.kubelet.restarted_for = Some(pools);
                    memory.kubelet.failure = None;
                }
                Err(message) => {
                    let attempts = memory
                        .kubelet
                        .failure
                        .as_ref()
                        .filter(|f| f.pools == pools)
                        .map_or(1, |f| f.attempts + 1);
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
                note: format!("ran {}", command.join(" ")),
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

/// Runs `command` to its end or kills it (and everything it started) after
/// `timeout`; the error says which happened, with the end of its stderr.
pub(super) async fn run_bounded(command: &[String], timeout: Duration) -> Result<(), String> {
    let shown = command.join(" ");
    let child = tokio::process::Command::new(&command[0])
        .args(&command[1..])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("{shown}: {err}"))?;
    let group = child.id().and_then(|id| i32::try_from(id).ok());
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => {
            if let Some(group) = group {
                // SAFETY: signals only the process group this call created.
                unsafe { libc::killpg(group, libc::SIGKILL) };
            }
            Err(format!(
                "{shown} did not finish within {timeout:?} and was killed"
            ))
        }
        Ok(Err(err)) => Err(format!("{shown}: {err}")),
        Ok(Ok(output)) if output.status.success() => Ok(()),
        Ok(Ok(output)) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let stderr = stderr.trim();
            let start = stderr.char_indices().rev().nth(299).map_or(0, |(i, _)| i);
            Err(format!(
                "{shown} exited with {}: {}",
                output.status,
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
