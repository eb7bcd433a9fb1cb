//! How the worker writes: every write fenced by the Lease and bounded in
//! time, a failed write retried with backoff for its node or pool alone,
//! and the worker's own writes awaited in the caches before it plans again.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::time::{Duration, Instant};

use hugepool_crds::conditions::bounded_message;
use kube::Resource;
use tokio::sync::Notify;
use tracing::warn;

use super::Context;
use crate::error::{Error, Result};

/// How long one write may take when the Lease does not bound it sooner.
pub(super) const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// The first retry of a failed write comes after about this long, doubling.
pub(super) const RETRY_BASE: Duration = Duration::from_secs(1);
/// The first retry of a write that found its object changed (409) comes
/// sooner: nothing failed, the cache was behind.
const CONFLICT_RETRY_BASE: Duration = Duration::from_millis(200);
/// ... up to this for a node (thousands of them retrying must not load the
/// API server that just came back) ...
pub(super) const RETRY_MAX: Duration = Duration::from_secs(300);
/// ... and up to this for a pool (few, and their status is what people
/// read).
pub(super) const POOL_RETRY_MAX: Duration = Duration::from_secs(30);

/// How long to wait before the `attempts`-th retry: `RETRY_BASE` doubled
/// per attempt up to `RETRY_MAX`, of which `jitter` (0..1) takes off up to
/// half, so nodes that failed together do not retry together.
pub fn retry_delay(attempts: u32, jitter: f64) -> Duration {
    backoff(RETRY_BASE, RETRY_MAX, attempts, jitter)
}

fn backoff(base: Duration, max: Duration, attempts: u32, jitter: f64) -> Duration {
    let full = base
        .saturating_mul(1 << attempts.saturating_sub(1).min(16))
        .min(max);
    full.mul_f64(1.0 - jitter.clamp(0.0, 1.0) / 2.0)
}

/// A node or pool whose last write failed or found its object changed.
#[derive(Clone, Debug)]
pub(super) struct Retry {
    pub attempts: u32,
    pub next_try: Instant,
    pub error: String,
    /// The last attempt found the object changed (409): the cache was
    /// behind, nothing failed, and the pool does not report it, unless it
    /// keeps happening (`CONFLICTS_NAMED` in a row).
    pub conflict: bool,
    /// Conflicts in a row.
    pub conflicts: u32,
}

/// Conflicts in a row after which a node's (or pool's) writes are named
/// as failing: with the conflict backoff (200 ms doubling) about 25 s of
/// writes that each found the object changed again (another writer, or a
/// cache that does not catch up).
pub const CONFLICTS_NAMED: u32 = 8;

/// Nodes (or pools) whose last write did not land, each with its backoff.
#[derive(Debug)]
pub(super) struct Retries {
    retries: BTreeMap<String, Retry>,
    max: Duration,
}

impl Retries {
    pub fn is_empty(&self) -> bool {
        self.retries.is_empty()
    }

    /// Retries backing off up to `max`.
    pub fn up_to(max: Duration) -> Self {
        Self {
            retries: BTreeMap::new(),
            max,
        }
    }

    /// Records a failed write of `name`; true on the first failure of a
    /// streak (a conflict is not one).
    pub fn fail(&mut self, name: &str, error: &Error) -> bool {
        let conflict = error.is_conflict();
        let retry = self.retries.entry(name.to_string()).or_insert(Retry {
            attempts: 0,
            next_try: Instant::now(),
            error: String::new(),
            conflict,
            conflicts: 0,
        });
        let first_failure = !conflict && (retry.attempts == 0 || retry.conflict);
        retry.attempts += 1;
        retry.conflict = conflict;
        retry.conflicts = if conflict { retry.conflicts + 1 } else { 0 };
        let base = if conflict {
            CONFLICT_RETRY_BASE
        } else {
            RETRY_BASE
        };
        retry.next_try = Instant::now() + backoff(base, self.max, retry.attempts, fastrand::f64());
        retry.error = bounded_message(error.to_string());
        if conflict {
            tracing::debug!(%name, attempts = retry.attempts, "object changed since the plan read it; retried");
        } else {
            warn!(%name, %error, attempts = retry.attempts, "write failed; retried with backoff");
        }
        first_failure
    }

    /// The write of `name` landed.
    pub fn succeeded(&mut self, name: &str) {
        self.retries.remove(name);
    }

    /// Whether `name` may be written at `now` (no retry pending before).
    pub fn due(&self, name: &str, now: Instant) -> bool {
        self.retries.get(name).is_none_or(|r| r.next_try <= now)
    }

    /// When the first retry after `now` is due (one due already was tried
    /// by the pass, or waits on something else: no deadline).
    pub fn next_after(&self, now: Instant) -> Option<Instant> {
        self.retries
            .values()
            .map(|r| r.next_try)
            .filter(|t| *t > now)
            .min()
    }

    /// The failures by name, for the pools' status: not a conflict, but a
    /// streak of `CONFLICTS_NAMED` of them.
    pub fn errors(&self) -> BTreeMap<String, String> {
        self.retries
            .iter()
            .filter(|(_, r)| !r.conflict || r.conflicts >= CONFLICTS_NAMED)
            .map(|(name, r)| {
                let error = if r.conflict {
                    bounded_message(format!(
                        "{} writes in a row found the object changed since it was read \
                         (another writer changes it?): {}",
                        r.conflicts, r.error
                    ))
                } else {
                    r.error.clone()
                };
                (name.clone(), error)
            })
            .collect()
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.retries.retain(|name, _| keep(name));
    }
}

/// Counts a write that did not land: a conflict as one (nothing failed:
/// the cache was behind), anything else as an error of its kind. True for
/// a failure.
pub(super) fn count_unlanded(ctx: &Context, error: &Error) -> bool {
    if error.is_conflict() {
        ctx.metrics.write_conflicts.inc();
        false
    } else {
        ctx.metrics.count_error(error.metric_label());
        true
    }
}

/// Runs `write` only while this replica may write, and abandons it (not
/// done) if the fence closes before it finished (the Lease lost, or no
/// renewal seen in time: renewals during the write keep it going) or
/// after `WRITE_TIMEOUT`. `NotLeader` only when the Lease is no longer
/// ours; a write that ran out of time while it still is, is `Timeout`:
/// that write's failure, retried for its node or pool.
pub(super) async fn fenced<T>(ctx: &Context, write: impl Future<Output = Result<T>>) -> Result<T> {
    fenced_by(&ctx.leader, write).await
}

async fn fenced_by<T>(
    fence: &crate::leader::Fence,
    write: impl Future<Output = Result<T>>,
) -> Result<T> {
    if !fence.open() {
        return Err(Error::NotLeader);
    }
    tokio::select! {
        result = tokio::time::timeout(WRITE_TIMEOUT, write) => match result {
            Ok(result) => result,
            Err(_) if !fence.open() => Err(Error::NotLeader),
            Err(_) => Err(Error::Timeout(WRITE_TIMEOUT)),
        },
        () = fence.closed() => Err(Error::NotLeader),
    }
}

/// A server-side apply of `status` to `object`'s status, on the condition
/// that the object is still at the resourceVersion it was read at: a
/// deposed leader's late write lands nothing over what the new one wrote
/// since (a 409 instead).
pub(super) async fn apply_status_where_read<K>(
    api: &kube::Api<K>,
    object: &K,
    status: impl serde::Serialize,
) -> kube::Result<K>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    use kube::ResourceExt;
    api.patch_status(
        &object.name_any(),
        &kube::api::PatchParams::apply(hugepool_crds::OPERATOR_MANAGER).force(),
        &kube::api::Patch::Apply(serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "metadata": {"resourceVersion": object.resource_version()},
            "status": status,
        })),
    )
    .await
}

/// What the watches delivered, per object, so that a pass can tell that the
/// caches show the writes of the pass before it. resourceVersions are
/// opaque: they are compared for equality only.
#[derive(Default)]
pub struct Deliveries {
    log: std::sync::Mutex<DeliveryLog>,
    pub(super) delivered: Notify,
}

#[derive(Default)]
struct DeliveryLog {
    /// "Kind/name" -> the last few resourceVersions delivered, for a write
    /// whose version arrived before the worker asked for it.
    recent: HashMap<String, VecDeque<String>>,
    /// Writes awaited: ("Kind/name", version). A delivery of that version,
    /// the object's deletion or a re-list of its kind settles one, however
    /// many versions come after it.
    awaited: HashSet<(String, String)>,
}

/// How many resourceVersions are kept per object: a write is registered
/// right after it returns, so only what came in between matters.
const RECENT_VERSIONS: usize = 8;

impl Deliveries {
    fn log(&self) -> std::sync::MutexGuard<'_, DeliveryLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The watch of `kind` delivered `object` (it is in the cache now).
    pub fn record<K: Resource>(&self, kind: &'static str, object: &K) {
        let (Some(name), Some(version)) = (&object.meta().name, &object.meta().resource_version)
        else {
            return;
        };
        {
            let mut log = self.log();
            let key = format!("{kind}/{name}");
            log.awaited.remove(&(key.clone(), version.clone()));
            let recent = log.recent.entry(key).or_default();
            if recent.len() == RECENT_VERSIONS {
                recent.pop_front();
            }
            recent.push_back(version.clone());
        }
        self.delivered.notify_waiters();
    }

    /// The object is gone from the cache: no write of it is awaited.
    pub fn forget<K: Resource>(&self, kind: &'static str, object: &K) {
        if let Some(name) = &object.meta().name {
            let key = format!("{kind}/{name}");
            let mut log = self.log();
            log.awaited.retain(|(awaited, _)| *awaited != key);
            log.recent.remove(&key);
        }
        self.delivered.notify_waiters();
    }

    /// The watch of `kind` listed everything anew: its cache is newer than
    /// any write made before.
    pub fn relisted(&self, kind: &'static str) {
        let prefix = format!("{kind}/");
        self.log()
            .awaited
            .retain(|(key, _)| !key.starts_with(&prefix));
        self.delivered.notify_waiters();
    }

    /// A write of `object` as `kind` returned: awaited until delivered.
    pub(super) fn await_write<K: Resource>(&self, kind: &'static str, object: &K) {
        let (Some(name), Some(version)) = (&object.meta().name, &object.meta().resource_version)
        else {
            return;
        };
        let key = format!("{kind}/{name}");
        let mut log = self.log();
        let arrived = log
            .recent
            .get(&key)
            .is_some_and(|versions| versions.contains(version));
        if !arrived {
            log.awaited.insert((key, version.clone()));
        }
    }

    /// How many writes the caches have not shown yet.
    pub(super) fn outstanding(&self) -> usize {
        self.log().awaited.len()
    }

    /// Gives up on the writes awaited (they are planned from as they are).
    pub(super) fn give_up(&self) {
        self.log().awaited.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use tokio::sync::watch;

    use super::*;
    use crate::leader::Fence;

    #[test]
    fn conflicts_that_keep_coming_are_named_a_failure_does_not_wait() {
        let conflict = Error::NodeSpec {
            node: "w-1".into(),
            source: kube::Error::Api(Box::new(
                kube::core::Status::failure("the object has been modified", "Conflict")
                    .with_code(409),
            )),
        };
        assert!(conflict.is_conflict());
        let mut retries = Retries::up_to(RETRY_MAX);
        for _ in 1..CONFLICTS_NAMED {
            retries.fail("w-1", &conflict);
        }
        assert!(
            retries.errors().is_empty(),
            "a few conflicts are no failure"
        );
        retries.fail("w-1", &conflict);
        let named = &retries.errors()["w-1"];
        assert!(
            named.starts_with("8 writes in a row found the object changed"),
            "{named}"
        );
        // One that landed ends the streak.
        retries.succeeded("w-1");
        retries.fail("w-1", &conflict);
        assert!(retries.errors().is_empty());
    }

    #[tokio::test]
    async fn a_write_slower_than_the_window_it_started_with_lands_while_the_lease_is_renewed() {
        let (_held_tx, held) = watch::channel(true);
        let window = Duration::from_millis(500);
        let (until_tx, until) = watch::channel(SystemTime::now() + window);
        let fence = Fence::renewed_until(held, until);
        let renewing = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if until_tx.send(SystemTime::now() + window).is_err() {
                    return;
                }
            }
        });
        // Three windows long (a policy webhook in no hurry).
        let written = fenced_by(&fence, async {
            tokio::time::sleep(3 * window).await;
            Ok(7)
        })
        .await;
        renewing.abort();
        assert_eq!(written.ok(), Some(7));
        // With no renewal, the same write is abandoned as not the leader's.
        let (_held_tx, held) = watch::channel(true);
        let (_until_tx, until) = watch::channel(SystemTime::now() + window);
        let fence = Fence::renewed_until(held, until);
        let abandoned = fenced_by(&fence, async {
            tokio::time::sleep(3 * window).await;
            Ok(7)
        })
        .await;
        assert!(matches!(abandoned, Err(Error::NotLeader)), "{abandoned:?}");
    }
}
