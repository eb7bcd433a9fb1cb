//! One writer of a node's pools: every agent holds an exclusive flock on a
//! file on the host (`--writer-lock`, a hostPath in the chart) before it
//! writes. A DaemonSet update creates the new agent pod while the old one is
//! still terminating (measured: e2e/tests/node.rs), and two releases of the
//! chart would run two agents per node; the lock makes the second wait until
//! the first has exited. The kernel drops the lock when its holder dies, even
//! by SIGKILL.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The held lock; dropping it releases it.
#[derive(Debug)]
pub struct WriterLock {
    _file: File,
    pub path: PathBuf,
}

/// Whether the lock could be taken without waiting (std's `try_lock` is
/// `flock(LOCK_EX | LOCK_NB)` on Linux).
fn try_lock(file: &File) -> std::io::Result<bool> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(std::fs::TryLockError::WouldBlock) => Ok(false),
        Err(std::fs::TryLockError::Error(error)) => Err(error),
    }
}

/// Takes the lock, polling every `poll` while another process holds it;
/// `waiting` is called once when it has to wait, and `cancelled` is checked
/// on each poll (a shutdown while waiting returns `Ok(None)`). Blocks: call
/// it from a blocking thread.
pub fn acquire(
    path: &Path,
    poll: Duration,
    waiting: impl FnOnce(),
    cancelled: impl Fn() -> bool,
) -> crate::Result<Option<WriterLock>> {
    let io = |source| crate::Error::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io)?;
    let mut waiting = Some(waiting);
    loop {
        if try_lock(&file).map_err(io)? {
            return Ok(Some(WriterLock {
                _file: file,
                path: path.to_path_buf(),
            }));
        }
        if let Some(say) = waiting.take() {
            say();
        }
        if cancelled() {
            return Ok(None);
        }
        std::thread::sleep(poll);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn a_second_agent_waits_until_the_first_releases_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.lock");
        let first = acquire(&path, Duration::from_millis(5), || {}, || false)
            .unwrap()
            .expect("free lock");
        let waited = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&waited);
        let second_path = path.clone();
        let second = std::thread::spawn(move || {
            acquire(
                &second_path,
                Duration::from_millis(5),
                move || flag.store(true, Ordering::SeqCst),
                || false,
            )
        });
        // The second is waiting (it said so) and has not got the lock.
        while !waited.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!second.is_finished(), "the second agent must wait");
        drop(first);
        let second = second.join().unwrap().unwrap();
        assert!(second.is_some(), "the second gets the lock once released");
    }

    #[test]
    fn a_shutdown_while_waiting_gives_up_without_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.lock");
        let _first = acquire(&path, Duration::from_millis(5), || {}, || false).unwrap();
        let second = acquire(&path, Duration::from_millis(5), || {}, || true).unwrap();
        assert!(second.is_none());
    }
}
