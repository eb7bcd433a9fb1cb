//! Whether a node answers: its Node's Ready condition and its agent's
//! acknowledgement of its spec, each within `rollout.unresponsiveAfter`.

use super::*;

/// What the controller saw of the fleet beyond the objects themselves.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observed {
    /// Nodes whose last write by the operator failed, with the error (the
    /// controller retries them with backoff; their pools say so).
    pub write_errors: BTreeMap<String, String>,
    /// Nodes whose agent has not acknowledged its HugePageNode's spec: the
    /// generation waiting, and since when the controller has seen it wait.
    pub unacknowledged: BTreeMap<String, (i64, Timestamp)>,
}

impl Observed {
    /// Keeps `unacknowledged` up to date with `states` at `now`: a
    /// generation waits since the operator wrote it, as the object says
    /// (its managedFields entry's time, so a new leader does not start the
    /// clock again), else since first seen waiting; one acknowledged (or
    /// gone) leaves.
    pub fn track_acknowledgements<'s>(
        &mut self,
        states: impl IntoIterator<Item = &'s HugePageNode>,
        now: Timestamp,
    ) {
        let mut waiting = BTreeMap::new();
        for state in states {
            let Some(name) = state.metadata.name.clone() else {
                continue;
            };
            let generation = state.metadata.generation.unwrap_or(0);
            let observed = state
                .status
                .as_ref()
                .and_then(|s| s.observed_generation)
                .unwrap_or(0);
            if observed >= generation {
                continue;
            }
            let since = match (spec_written_at(state), self.unacknowledged.get(&name)) {
                (Some(written), _) => written.min(now),
                (None, Some(&(seen, since))) if seen == generation => since,
                _ => now,
            };
            waiting.insert(name, (generation, since));
        }
        self.unacknowledged = waiting;
    }
}

/// When the operator last wrote the HugePageNode's spec, as the API server
/// recorded it (the operator's managedFields entry of the object itself,
/// not of its status).
pub fn spec_written_at(state: &HugePageNode) -> Option<Timestamp> {
    state
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.manager.as_deref() == Some(hugepool_crds::OPERATOR_MANAGER))
        .filter(|m| m.subresource.as_deref().unwrap_or_default().is_empty())
        .filter_map(|m| m.time.as_ref().map(|t| t.0))
        .max()
}

/// Whether a node answers: its Node is not NotReady (a Node that reports no
/// Ready condition, like one no kubelet runs, is judged by its agent alone)
/// and its agent has acknowledged its spec, each within `after`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Answers,
    /// Silent for now: unresponsive from this time on unless it answers.
    SilentSince(Timestamp),
    Unresponsive(String),
}

pub(super) fn unresponsive(
    node: Option<&Node>,
    state: Option<&HugePageNode>,
    unacknowledged: Option<&(i64, Timestamp)>,
    after: Duration,
    now: Timestamp,
) -> Answer {
    let after = jiff::SignedDuration::try_from(after).unwrap_or(jiff::SignedDuration::MAX);
    let past = |since: Timestamp| since.checked_add(after).unwrap_or(Timestamp::MAX);
    let mut silent: Option<Timestamp> = None;
    let not_ready = node
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .filter(|ready| ready.status != "True");
    if let Some(ready) = not_ready {
        let since = ready
            .last_transition_time
            .as_ref()
            .map_or(Timestamp::UNIX_EPOCH, |t| t.0);
        if past(since) <= now {
            return Answer::Unresponsive(format!(
                "NotReady since {since} ({})",
                ready.reason.as_deref().unwrap_or("no reason")
            ));
        }
        silent = Some(past(since));
    }
    let generation = state.and_then(|s| s.metadata.generation);
    if let Some(&(waiting, since)) = unacknowledged
        && generation == Some(waiting)
    {
        if past(since) <= now {
            return Answer::Unresponsive(format!(
                "its agent has not acknowledged generation {waiting} since {since}"
            ));
        }
        silent = Some(silent.map_or(past(since), |s| s.min(past(since))));
    }
    silent.map_or(Answer::Answers, Answer::SilentSince)
}
