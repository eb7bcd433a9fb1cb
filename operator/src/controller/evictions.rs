//! Evictions run beside the passes, one task per pod, so that a slow or
//! hanging `pods/eviction` webhook holds up that pod alone: every other
//! node and pool goes on being planned and written.
//!
//! Each eviction is asked first as a dry run. Only once the API would
//! evict the pod is it recorded in the status of every pool it frees pages
//! for (written by the pass, like every status), and only once those
//! records landed is the real eviction sent. A record stays only if the
//! API accepted the real eviction: a refusal, a 404, an abandoned or
//! unanswered eviction takes it out again.
//!
//! ```text
//!  task: dry run ──accepted──▶ report Accepted ─▶ wait ─ack─▶ eviction ─▶ report Answered
//!  pass:                        record in statuses, then ack ▲            withdraw unless Evicted
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use hugepool_crds::conditions::bounded_message;
use hugepool_crds::pool::EvictedPod;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::{Client, ResourceExt};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::drain::{self, Eviction};
use crate::leader::Fence;

/// How long one eviction call may take. Longer than the API server's own
/// request timeout (60 s by default; a webhook is cut off after at most
/// 30 s), so an answer is nearly always had.
pub const EVICTION_TIMEOUT: Duration = Duration::from_secs(70);
/// An eviction unanswered this long is named in its node's Draining
/// condition.
pub const SLOW_EVICTION: Duration = Duration::from_secs(5);

/// One eviction a drain asks for, with the pools it is for.
#[derive(Clone, Debug)]
pub struct PlannedEviction {
    pub pod: Pod,
    pub node: String,
    pub pools: Vec<String>,
    pub record: EvictedPod,
}

impl PlannedEviction {
    pub fn uid(&self) -> &str {
        &self.record.uid
    }

    pub fn key(&self) -> &str {
        &self.record.pod
    }
}

/// An eviction that ended, for the pass to count and tell.
#[derive(Debug)]
pub struct Finished {
    pub eviction: PlannedEviction,
    pub outcome: Eviction,
    /// The first refusal of a streak (told once; retried with backoff).
    pub first_refusal: bool,
}

enum Report {
    /// The dry run was accepted: the task waits for the record.
    Accepted { uid: String },
    /// The eviction ended; `real` when the real eviction was asked (or the
    /// record was abandoned after the dry run).
    Answered {
        uid: String,
        real: bool,
        outcome: Eviction,
    },
}

struct InFlight {
    eviction: PlannedEviction,
    since: Timestamp,
    /// The dry run was accepted.
    accepted: bool,
    /// Until the records landed: tells the task to go on, or what to
    /// report instead.
    ack: Option<oneshot::Sender<Result<(), Eviction>>>,
    task: JoinHandle<()>,
}

/// The evictions in flight, the refusals waiting out their backoff and
/// the records to take back.
pub struct Evictions {
    in_flight: BTreeMap<String, InFlight>,
    sender: mpsc::UnboundedSender<Report>,
    reports: mpsc::UnboundedReceiver<Report>,
    refusals: drain::Refusals,
    /// What the last attempt of a pod met, by UID: (node, note).
    notes: BTreeMap<String, (String, String)>,
    /// Records to take out, by pod UID: the pools that may still show it.
    withdrawn: BTreeMap<String, BTreeSet<String>>,
}

impl Default for Evictions {
    fn default() -> Self {
        let (sender, reports) = mpsc::unbounded_channel();
        Self {
            in_flight: BTreeMap::new(),
            sender,
            reports,
            refusals: drain::Refusals::default(),
            notes: BTreeMap::new(),
            withdrawn: BTreeMap::new(),
        }
    }
}

impl Drop for Evictions {
    fn drop(&mut self) {
        for in_flight in self.in_flight.values() {
            in_flight.task.abort();
        }
    }
}

impl Evictions {
    /// Nothing in flight, refused, noted or to withdraw.
    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
            && self.refusals.is_empty()
            && self.notes.is_empty()
            && self.withdrawn.is_empty()
    }

    /// Whether `uid` may be asked for now: not in flight, not waiting out
    /// a refusal.
    pub fn may_ask(&self, uid: &str, now: Timestamp) -> bool {
        !self.in_flight.contains_key(uid)
            && self.refusals.get(uid).is_none_or(|b| b.next_try <= now)
    }

    /// Starts evicting: the dry run, then (once recorded) the eviction.
    pub fn start(
        &mut self,
        client: &Client,
        fence: &Fence,
        wake: &Arc<Notify>,
        eviction: PlannedEviction,
        now: Timestamp,
    ) {
        let (ack, acked) = oneshot::channel();
        let task = tokio::spawn(evict(
            client.clone(),
            fence.clone(),
            eviction.pod.clone(),
            self.sender.clone(),
            Arc::clone(wake),
            acked,
        ));
        self.in_flight.insert(
            eviction.uid().to_string(),
            InFlight {
                eviction,
                since: now,
                accepted: false,
                ack: Some(ack),
                task,
            },
        );
    }

    /// Takes in what the tasks reported since the last pass: accepted dry
    /// runs wait for their records, ended evictions are returned.
    pub fn collect(&mut self, now: Timestamp) -> Vec<Finished> {
        let mut finished = Vec::new();
        while let Ok(report) = self.reports.try_recv() {
            match report {
                Report::Accepted { uid } => {
                    // (Abandoned meanwhile: it ends when its task reports.)
                    if let Some(entry) = self.in_flight.get_mut(&uid)
                        && entry.ack.is_some()
                    {
                        entry.accepted = true;
                        // Asked anew and accepted: its record is wanted again.
                        self.withdrawn.remove(&uid);
                    }
                }
                Report::Answered { uid, real, outcome } => {
                    let Some(entry) = self.in_flight.remove(&uid) else {
                        continue;
                    };
                    finished.push(self.ended(entry.eviction, real, outcome, now));
                }
            }
        }
        finished
    }

    fn ended(
        &mut self,
        eviction: PlannedEviction,
        real: bool,
        outcome: Eviction,
        now: Timestamp,
    ) -> Finished {
        let uid = eviction.uid().to_string();
        let mut first_refusal = false;
        match &outcome {
            Eviction::Evicted | Eviction::Abandoned(_) => {
                self.refusals.forget(&uid);
                self.notes.remove(&uid);
            }
            Eviction::Gone => {
                self.refusals.forget(&uid);
                self.notes.remove(&uid);
            }
            Eviction::Blocked(message) | Eviction::Failed(message) => {
                first_refusal = self.refusals.get(&uid).is_none();
                self.refusals.refused(&uid, &eviction.node, now);
                let note = format!(
                    "eviction of {} refused: {}",
                    eviction.key(),
                    bounded_message(message.clone())
                );
                self.notes
                    .insert(uid.clone(), (eviction.node.clone(), note));
            }
        }
        // Recorded before it was asked for real, but not evicted after all:
        // the record goes again.
        if real && outcome != Eviction::Evicted {
            self.withdrawn
                .entry(uid)
                .or_default()
                .extend(eviction.pools.iter().cloned());
        }
        Finished {
            eviction,
            outcome,
            first_refusal,
        }
    }

    /// The records waiting to be written to `pool`'s status before their
    /// real eviction.
    pub fn to_record<'a>(&'a self, pool: &'a str) -> impl Iterator<Item = &'a EvictedPod> + 'a {
        self.in_flight
            .values()
            .filter(|e| e.accepted && e.ack.is_some())
            .filter(move |e| e.eviction.pools.iter().any(|p| p == pool))
            .map(|e| &e.eviction.record)
    }

    /// Whether `pool`'s status must not show the record of pod `uid`.
    pub fn is_withdrawn(&self, pool: &str, uid: &str) -> bool {
        self.withdrawn
            .get(uid)
            .is_some_and(|pools| pools.contains(pool))
    }

    /// `pool`'s status as written (or found already so): the records it
    /// holds are no longer to be withdrawn from it.
    pub fn pool_written(&mut self, pool: &str) {
        self.withdrawn.retain(|_, pools| {
            pools.remove(pool);
            !pools.is_empty()
        });
    }

    /// After the pass wrote the statuses: an eviction whose every pool now
    /// records it goes ahead; one whose record failed to land in a pool is
    /// abandoned (and its records withdrawn when its task reports); the
    /// others wait for the next pass (a status that found its pool changed
    /// is written again soon).
    pub fn release_recorded(
        &mut self,
        landed: impl Fn(&str, &str) -> bool,
        failed: impl Fn(&str) -> bool,
    ) {
        for entry in self.in_flight.values_mut() {
            if !entry.accepted || entry.ack.is_none() {
                continue;
            }
            let uid = entry.eviction.uid();
            let pools = &entry.eviction.pools;
            let go = if pools.iter().all(|pool| landed(pool, uid)) {
                true
            } else if pools.iter().any(|pool| failed(pool)) {
                false
            } else {
                continue;
            };
            if let Some(ack) = entry.ack.take() {
                let _ = ack.send(if go {
                    Ok(())
                } else {
                    Err(Eviction::Failed(
                        "its record did not land in every pool's status".into(),
                    ))
                });
            }
        }
    }

    /// Abandons each eviction not sent for real yet that the plan no longer
    /// asks for: one of its pools is gone (`pool_exists`), its node is in no
    /// pool's plan (`node_planned`), or its node's drain was carried out in
    /// this pass (`judged`: the pods it chose, by node) without choosing it
    /// (the shrink was reverted, or other pods freed the pages). Its task
    /// reports it abandoned, its records are withdrawn. Nodes not judged (a
    /// drain step that failed, a node in backoff) keep theirs waiting.
    pub fn abandon_unwanted(
        &mut self,
        judged: &BTreeMap<String, BTreeSet<String>>,
        node_planned: impl Fn(&str) -> bool,
        pool_exists: impl Fn(&str) -> bool,
    ) {
        for entry in self.in_flight.values_mut() {
            if entry.ack.is_none() {
                continue;
            }
            let eviction = &entry.eviction;
            let why = if let Some(pool) = eviction.pools.iter().find(|p| !pool_exists(p)) {
                format!("pool {pool} is gone")
            } else if !node_planned(&eviction.node) {
                format!("node {} is in no pool any more", eviction.node)
            } else if judged
                .get(&eviction.node)
                .is_some_and(|wanted| !wanted.contains(eviction.uid()))
            {
                format!(
                    "the drain of {} no longer needs it (the shrink changed, or its pages came back)",
                    eviction.node
                )
            } else {
                continue;
            };
            if let Some(ack) = entry.ack.take() {
                let _ = ack.send(Err(Eviction::Abandoned(why)));
            }
        }
    }

    /// Forgets withdrawals from pools that are gone.
    pub fn forget_pools(&mut self, pool_exists: impl Fn(&str) -> bool) {
        self.withdrawn.retain(|_, pools| {
            pools.retain(|p| pool_exists(p));
            !pools.is_empty()
        });
    }

    /// What the node's Draining condition says of its evictions: those
    /// unanswered for `SLOW_EVICTION` and the last refusals.
    pub fn notes(&self, node: &str, now: Timestamp) -> Vec<String> {
        let slow = jiff::SignedDuration::try_from(SLOW_EVICTION).unwrap_or_default();
        let mut notes: Vec<String> = self
            .in_flight
            .values()
            .filter(|e| e.eviction.node == node)
            .filter(|e| now.duration_since(e.since) >= slow)
            .map(|e| {
                format!(
                    "eviction of {} unanswered since {}",
                    e.eviction.key(),
                    e.since.strftime("%H:%M:%SZ")
                )
            })
            .collect();
        notes.extend(
            self.notes
                .iter()
                .filter(|(uid, (on, _))| on == node && !self.in_flight.contains_key(*uid))
                .map(|(_, (_, note))| note.clone()),
        );
        notes
    }

    /// When a pass must look again without an event: a refusal's backoff
    /// ends, or an eviction in flight turns slow; only what lies after
    /// `now`. An eviction slow already, or a refusal whose backoff ended
    /// while its node waits out a backoff of its own, wakes nothing: its
    /// answer comes as an event, its node's retry has its own deadline.
    pub fn next_deadline(&self, now: Timestamp) -> Option<Timestamp> {
        let slow = jiff::SignedDuration::try_from(SLOW_EVICTION).unwrap_or_default();
        let turns_slow = self
            .in_flight
            .values()
            .filter_map(|e| e.since.checked_add(slow).ok());
        self.refusals
            .next_tries()
            .chain(turns_slow)
            .filter(|deadline| *deadline > now)
            .min()
    }

    /// Forgets the refusals and notes of `node`'s pods that are not in
    /// `pods` (its pods now; none when it is not draining).
    pub fn prune(&mut self, node: &str, pods: &[Pod]) {
        self.refusals.prune(node, pods);
        self.notes.retain(|uid, (on, _)| {
            on != node
                || pods
                    .iter()
                    .any(|p| p.metadata.uid.as_deref() == Some(uid.as_str()))
        });
    }
}

/// One pod's eviction: the dry run, then, once the pass says its records
/// landed, the real eviction. Each call is bounded by `EVICTION_TIMEOUT`;
/// a real eviction left unanswered is judged by the pod: terminating means
/// the API accepted it.
async fn evict(
    client: Client,
    fence: Fence,
    pod: Pod,
    reports: mpsc::UnboundedSender<Report>,
    wake: Arc<Notify>,
    acked: oneshot::Receiver<Result<(), Eviction>>,
) {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let report = |report: Report| {
        let _ = reports.send(report);
        wake.notify_one();
    };
    let answered = |real: bool, outcome: Eviction| Report::Answered {
        uid: uid.clone(),
        real,
        outcome,
    };
    let dry_run = ask(&client, &fence, &pod, true)
        .await
        .unwrap_or_else(unanswered);
    if dry_run != Eviction::Evicted {
        report(answered(false, dry_run));
        return;
    }
    report(Report::Accepted { uid: uid.clone() });
    match acked.await {
        Ok(Ok(())) => {}
        Ok(Err(instead)) => {
            report(answered(true, instead));
            return;
        }
        Err(_) => {
            report(answered(
                true,
                Eviction::Failed("its record did not land in every pool's status".into()),
            ));
            return;
        }
    }
    let outcome = match ask(&client, &fence, &pod, false).await {
        Some(outcome) => outcome,
        None => judge_by_pod(&client, &pod).await,
    };
    report(answered(true, outcome));
}

fn unanswered() -> Eviction {
    Eviction::Failed(format!("no answer in {} s", EVICTION_TIMEOUT.as_secs()))
}

/// One eviction call, fenced at its start and bounded by
/// `EVICTION_TIMEOUT`; None when it was not answered in time.
async fn ask(client: &Client, fence: &Fence, pod: &Pod, dry_run: bool) -> Option<Eviction> {
    if !fence.open() {
        return Some(Eviction::Failed("this replica no longer leads".into()));
    }
    tokio::time::timeout(EVICTION_TIMEOUT, drain::evict(client, pod, dry_run))
        .await
        .ok()
}

/// Whether an eviction left unanswered took effect: the pod is going.
async fn judge_by_pod(client: &Client, pod: &Pod) -> Eviction {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
    match tokio::time::timeout(EVICTION_TIMEOUT, api.get_opt(&pod.name_any())).await {
        Ok(Ok(Some(now))) if now.metadata.uid == pod.metadata.uid => {
            if now.metadata.deletion_timestamp.is_some() {
                Eviction::Evicted
            } else {
                unanswered()
            }
        }
        Ok(Ok(_)) => Eviction::Gone,
        _ => unanswered(),
    }
}
