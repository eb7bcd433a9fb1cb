//! What `/healthz` answers: whether the resize loop still comes round. A
//! loop wedged outside its waits (a deadlock, a call that never returns) is
//! what a liveness probe exists to restart; an agent that only serves HTTP
//! is not alive in any useful sense.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The resize loop's heartbeat. The loop beats at the top of each pass and
/// on every kernel write of a resize, and says how long it will wait before
/// its next pass; it is alive while it beat within `timeout`, or is inside
/// a wait it announced (plus `timeout`).
#[derive(Debug)]
pub struct Liveness {
    start: Instant,
    timeout: Duration,
    last_beat_ms: AtomicU64,
    idle_until_ms: AtomicU64,
}

impl Liveness {
    pub fn new(timeout: Duration) -> Self {
        Self::starting_at(Instant::now(), timeout)
    }

    fn starting_at(start: Instant, timeout: Duration) -> Self {
        Self {
            start,
            timeout,
            last_beat_ms: AtomicU64::new(0),
            idle_until_ms: AtomicU64::new(0),
        }
    }

    fn ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.start).as_millis()).unwrap_or(u64::MAX)
    }

    /// The loop is working.
    pub fn beat(&self) {
        self.beat_at(Instant::now());
    }

    fn beat_at(&self, at: Instant) {
        self.last_beat_ms.store(self.ms(at), Ordering::Relaxed);
    }

    /// The loop waits up to `wait` before its next pass.
    pub fn idle_for(&self, wait: Duration) {
        self.idle_for_at(Instant::now(), wait);
    }

    fn idle_for_at(&self, at: Instant, wait: Duration) {
        self.beat_at(at);
        let until = at
            .checked_add(wait)
            .map_or(u64::MAX, |until| self.ms(until));
        self.idle_until_ms.store(until, Ordering::Relaxed);
    }

    /// Alive, or why not.
    pub fn check(&self) -> Result<(), String> {
        self.check_at(Instant::now())
    }

    fn check_at(&self, at: Instant) -> Result<(), String> {
        let now = self.ms(at);
        let timeout = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        let last = self.last_beat_ms.load(Ordering::Relaxed);
        let idle_until = self.idle_until_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) <= timeout || now <= idle_until.saturating_add(timeout) {
            Ok(())
        } else {
            Err(format!(
                "the resize loop has not come round for {}s (limit {}s)",
                (now - last) / 1000,
                timeout / 1000
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alive_while_it_beats_or_waits_as_announced_and_not_after() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let live = Liveness::starting_at(start, Duration::from_secs(60));
        assert!(live.check_at(at(30)).is_ok(), "a fresh agent is alive");
        // Working: beats keep it alive; silence beyond the timeout does not.
        live.beat_at(at(100));
        assert!(live.check_at(at(160)).is_ok());
        let wedged = live.check_at(at(161)).unwrap_err();
        assert!(
            wedged.contains("not come round for 61s (limit 60s)"),
            "{wedged}"
        );
        // Waiting 5 min for a retry is alive, until the wait is overdue.
        live.idle_for_at(at(200), Duration::from_secs(300));
        assert!(live.check_at(at(499)).is_ok());
        assert!(live.check_at(at(560)).is_ok());
        assert!(live.check_at(at(561)).is_err());
        // Waiting without end (for the writer lock, for the first list).
        live.idle_for_at(at(600), Duration::MAX);
        assert!(live.check_at(at(1_000_000)).is_ok());
    }
}
