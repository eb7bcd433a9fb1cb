//! Leader election over a coordination.k8s.io Lease (kube-lease-manager):
//! every replica watches and plans, only the holder of the Lease writes.
//!
//! The Lease manager's flag alone cannot fence a leader: it turns false only
//! once the manager has *seen* another holder, so a replica whose renewals
//! fail, or that was paused past its Lease (SIGSTOP, a stalled VM), goes on
//! believing it leads. Each write therefore also asks the [`Fence`]: is the
//! last renewal of ours that the Lease shows recent enough, by the clock
//! now? The deadline is read at the write, so a replica that wakes from a
//! pause refuses its first write, before any task of it has run.

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub lease_name: String,
    /// Unique per replica; the pod name.
    pub identity: String,
    /// How long a Lease stays valid after its last renewal.
    pub duration: Duration,
    /// How long before expiry the holder renews.
    pub grace: Duration,
}

/// Whether this replica may write now.
#[derive(Clone, Debug)]
pub struct Fence {
    /// The Lease manager's word: we hold the Lease.
    held: watch::Receiver<bool>,
    /// Until when our last renewal seen on the Lease holds; None without
    /// leader election.
    until: Option<watch::Receiver<SystemTime>>,
}

impl Fence {
    /// A fence that only follows `held` (no Lease behind it): tests, and a
    /// single replica.
    pub fn following(held: watch::Receiver<bool>) -> Self {
        Self { held, until: None }
    }

    /// A fence over `held` and our last renewal's deadline (tests).
    pub fn renewed_until(held: watch::Receiver<bool>, until: watch::Receiver<SystemTime>) -> Self {
        Self {
            held,
            until: Some(until),
        }
    }

    /// True while the Lease is ours and our last renewal has not run out.
    pub fn open(&self) -> bool {
        self.remaining().is_some()
    }

    /// How long this replica may still write: until our last renewal runs
    /// out (`Duration::MAX` without a Lease); None when it may not write.
    /// A write that has not finished by then is abandoned.
    pub fn remaining(&self) -> Option<Duration> {
        if !*self.held.borrow() {
            return None;
        }
        let Some(until) = &self.until else {
            return Some(Duration::MAX);
        };
        let left = until.borrow().duration_since(SystemTime::now()).ok()?;
        (!left.is_zero()).then_some(left)
    }

    /// Resolves when this replica may no longer write: the Lease lost, or
    /// our last renewal run out with none seen since. Renewals seen while
    /// it waits keep it open, so a slow write of a healthy leader is not
    /// cut at the window it started with.
    pub async fn closed(&self) {
        let mut held = self.held.clone();
        let mut until = self.until.clone();
        loop {
            let Some(left) = self.remaining() else {
                return;
            };
            let renewed = async {
                match until.as_mut() {
                    Some(until) => until.changed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tokio::time::sleep(left) => {}
                Ok(()) = held.changed() => {}
                Ok(()) = renewed => {}
            }
        }
    }
}

/// Until when `lease` lets `identity` write: its last renewal plus the
/// Lease's duration less `margin` (time for the next renewal to be seen);
/// the epoch when the Lease is not ours or says too little.
pub fn valid_until(lease: &Lease, identity: &str, margin: Duration) -> SystemTime {
    let Some(spec) = &lease.spec else {
        return SystemTime::UNIX_EPOCH;
    };
    let ours = spec.holder_identity.as_deref() == Some(identity);
    match (ours, &spec.renew_time, spec.lease_duration_seconds) {
        (true, Some(renewed), Some(seconds)) if seconds > 0 => {
            let renewed: SystemTime = renewed.0.into();
            let holds = Duration::from_secs(seconds.unsigned_abs().into()).saturating_sub(margin);
            renewed.checked_add(holds).unwrap_or(SystemTime::UNIX_EPOCH)
        }
        _ => SystemTime::UNIX_EPOCH,
    }
}

/// Whether this replica leads, and the tasks that keep it so.
pub struct Leadership {
    /// The fenced view, for what follows leadership (metrics, the pass on
    /// becoming leader): changes when the Lease is won or lost, and when
    /// our last renewal runs out or a new one is seen.
    pub is_leader: watch::Receiver<bool>,
    fence: Fence,
    task: Option<JoinHandle<Result<kube_lease_manager::LeaseManager, LeaseManagerError>>>,
    helpers: Vec<JoinHandle<()>>,
    _always: Option<watch::Sender<bool>>,
}

impl Leadership {
    /// A single replica that always leads (leader election off).
    pub fn always() -> Self {
        let (sender, receiver) = watch::channel(true);
        Self {
            is_leader: receiver.clone(),
            fence: Fence::following(receiver),
            task: None,
            helpers: Vec::new(),
            _always: Some(sender),
        }
    }

    /// Starts competing for the Lease, and watching our renewals of it.
    /// `watch_errors` counts the errors of the Lease's watch.
    pub async fn elect(
        client: Client,
        config: &LeaderConfig,
        watch_errors: prometheus_client::metrics::counter::Counter,
    ) -> Result<Self, LeaseManagerError> {
        // The crate panics unless 0 < grace < duration.
        let duration = config.duration.as_secs().max(2);
        let grace = config.grace.as_secs().clamp(1, duration - 1);
        // Field manager left at its per-identity default: replicas must not
        // share one, or server-side apply could not tell their writes apart.
        let manager = LeaseManagerBuilder::new(client.clone(), &config.lease_name)
            .with_namespace(&config.namespace)
            .with_identity(&config.identity)
            .with_duration(duration)
            .with_grace(grace)
            .build()
            .await?;
        let (held, task) = manager.watch().await;
        // A renewal is due `grace` before expiry; the fence closes half way
        // through that grace, so a renewal has that long to be seen.
        let margin = Duration::from_millis(grace * 500);
        let (until_tx, until_rx) = watch::channel(SystemTime::UNIX_EPOCH);
        let renewals = tokio::spawn(watch_renewals(
            Api::namespaced(client, &config.namespace),
            config.lease_name.clone(),
            config.identity.clone(),
            margin,
            until_tx,
            watch_errors,
        ));
        let fence = Fence {
            held,
            until: Some(until_rx),
        };
        let (leading_tx, leading_rx) = watch::channel(fence.open());
        let follow = tokio::spawn(follow_fence(fence.clone(), leading_tx));
        Ok(Self {
            is_leader: leading_rx,
            fence,
            task: Some(task),
            helpers: vec![renewals, follow],
            _always: None,
        })
    }

    /// What each write asks.
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Gives the Lease up (so the other replica takes over at once).
    pub async fn release(self) {
        let Self {
            is_leader,
            fence,
            task,
            helpers,
            ..
        } = self;
        // The Lease task gives the Lease up only once every receiver of its
        // flag is gone: the fence's and its follower's among them.
        for helper in helpers {
            helper.abort();
            let _ = helper.await;
        }
        drop((is_leader, fence));
        if let Some(task) = task {
            match task.await {
                Ok(Ok(_)) => tracing::info!("released the leader lease"),
                Ok(Err(err)) => tracing::warn!(error = %err, "releasing the leader lease"),
                Err(err) => tracing::warn!(error = %err, "leader election task ended"),
            }
        }
    }
}

/// Follows the Lease: each version of it says until when we may write.
async fn watch_renewals(
    api: Api<Lease>,
    name: String,
    identity: String,
    margin: Duration,
    until: watch::Sender<SystemTime>,
    errors: prometheus_client::metrics::counter::Counter,
) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = std::pin::pin!(watcher(api, config).default_backoff());
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                until.send_replace(valid_until(&lease, &identity, margin));
            }
            Ok(watcher::Event::Delete(_)) => {
                until.send_replace(SystemTime::UNIX_EPOCH);
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => {}
            // The watcher retries with backoff; meanwhile the deadline runs
            // out on its own.
            Err(err) => {
                tracing::warn!(error = %err, "watching the leader Lease failed; retrying with backoff");
                errors.inc();
            }
        }
    }
}

/// Publishes the fence's state whenever it changes: on the Lease manager's
/// word, on a renewal seen, and when the last renewal runs out.
async fn follow_fence(fence: Fence, leading: watch::Sender<bool>) {
    let Fence { mut held, until } = fence.clone();
    let Some(mut until) = until else { return };
    loop {
        let open = fence.open();
        leading.send_if_modified(|was| std::mem::replace(was, open) != open);
        let runs_out = until
            .borrow()
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO);
        tokio::select! {
            changed = held.changed() => if changed.is_err() { return },
            changed = until.changed() => if changed.is_err() { return },
            // Only worth waking for while open; a closed fence reopens on a
            // change above.
            () = tokio::time::sleep(runs_out), if open => {}
            () = leading.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    use super::*;

    fn lease(holder: &str, renewed: SystemTime, seconds: i32) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                renew_time: Some(MicroTime(renewed.try_into().expect("timestamp"))),
                lease_duration_seconds: Some(seconds),
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        }
    }

    #[test]
    fn our_renewal_holds_for_the_duration_less_the_margin() {
        let renewed = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let until = valid_until(&lease("a", renewed, 15), "a", Duration::from_millis(2500));
        assert_eq!(until, renewed + Duration::from_millis(12_500));
    }

    #[test]
    fn anothers_lease_or_a_lease_without_renewal_holds_nothing() {
        let renewed = SystemTime::now();
        let margin = Duration::from_secs(1);
        assert_eq!(
            valid_until(&lease("b", renewed, 15), "a", margin),
            SystemTime::UNIX_EPOCH
        );
        assert_eq!(
            valid_until(&lease("a", renewed, 0), "a", margin),
            SystemTime::UNIX_EPOCH
        );
        let mut unrenewed = lease("a", renewed, 15);
        unrenewed.spec.as_mut().expect("spec").renew_time = None;
        assert_eq!(valid_until(&unrenewed, "a", margin), SystemTime::UNIX_EPOCH);
        assert_eq!(
            valid_until(&Lease::default(), "a", margin),
            SystemTime::UNIX_EPOCH
        );
    }

    #[test]
    fn the_fence_closes_when_the_renewal_runs_out_even_while_the_lease_is_held() {
        let (_held_tx, held) = watch::channel(true);
        let (until_tx, until) = watch::channel(SystemTime::now() + Duration::from_secs(3600));
        let fence = Fence {
            held,
            until: Some(until),
        };
        assert!(fence.open());
        // A renewal an hour old: the manager still says held, writes stop.
        until_tx.send_replace(SystemTime::now() - Duration::from_secs(1));
        assert!(!fence.open());
        until_tx.send_replace(SystemTime::now() + Duration::from_secs(3600));
        assert!(fence.open());
    }

    #[tokio::test]
    async fn the_fence_stays_open_while_renewals_come_and_closes_when_they_stop() {
        let (held_tx, held) = watch::channel(true);
        let (until_tx, until) = watch::channel(SystemTime::now() + Duration::from_millis(600));
        let fence = Fence {
            held,
            until: Some(until),
        };
        // Renewed every 100 ms for 2 s: open all that time, past the 600 ms
        // the first window gave.
        let renewing = tokio::spawn(async move {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                until_tx.send_replace(SystemTime::now() + Duration::from_millis(600));
            }
            until_tx
        });
        let started = std::time::Instant::now();
        fence.closed().await;
        let open_for = started.elapsed();
        assert!(
            open_for >= Duration::from_secs(2),
            "closed after {open_for:?} while renewals came"
        );
        assert!(!fence.open());
        // Renewed again, then the Lease lost: closed at once.
        let until_tx = renewing.await.unwrap();
        until_tx.send_replace(SystemTime::now() + Duration::from_secs(3600));
        let lose = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            held_tx.send_replace(false);
            held_tx
        });
        tokio::time::timeout(Duration::from_secs(60), fence.closed())
            .await
            .expect("closed when the Lease was lost, not an hour later");
        drop(lose.await);
    }

    #[test]
    fn a_lost_lease_closes_the_fence_whatever_the_renewal_says() {
        let (held_tx, held) = watch::channel(true);
        let (_until_tx, until) = watch::channel(SystemTime::now() + Duration::from_secs(3600));
        let fence = Fence {
            held,
            until: Some(until),
        };
        held_tx.send_replace(false);
        assert!(!fence.open());
        assert!(Fence::following(watch::channel(true).1).open());
    }
}
