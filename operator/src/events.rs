//! Which Events a pass emits, derived from what changed (pure): rollout
//! start, finish and halt on pools; drain start, timeout and end on nodes.

use hugepool_crds::conditions::{ConditionUpdate, bounded_message, find_condition};
use hugepool_crds::{HugePagePoolStatus, NodeConditionType, PoolConditionType, Reason};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::runtime::events::{Event, EventType};

/// An Event whose note fits the API's limit (1024 characters): an API
/// error quoted whole (a webhook's answer) would have the Event refused.
fn event(type_: EventType, reason: &str, action: &str, note: String) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: Some(bounded_message(note)),
        action: action.into(),
        secondary: None,
    }
}

/// True -> the condition of `type_` is True now and was not before, or its
/// reason changed to `reason`.
fn became(
    old: &[Condition],
    new: &[Condition],
    type_: PoolConditionType,
    status: &str,
    reasons: &[Reason],
) -> Option<String> {
    let now = find_condition(new, type_)?;
    let matches =
        |c: &Condition| c.status == status && reasons.iter().any(|r| r.as_str() == c.reason);
    if !matches(now) {
        return None;
    }
    match find_condition(old, type_) {
        Some(before) if matches(before) => None,
        _ => Some(now.message.clone()),
    }
}

/// A pool condition transition that raises an Event.
struct PoolTransition {
    type_: PoolConditionType,
    reasons: &'static [Reason],
    event_type: EventType,
    event_reason: &'static str,
    action: &'static str,
}

const POOL_TRANSITIONS: [PoolTransition; 5] = [
    PoolTransition {
        type_: PoolConditionType::Progressing,
        reasons: &[
            Reason::RollingOut,
            Reason::MaxUnavailableReached,
            Reason::Draining,
        ],
        event_type: EventType::Normal,
        event_reason: "RolloutStarted",
        action: "Rollout",
    },
    PoolTransition {
        type_: PoolConditionType::Available,
        reasons: &[Reason::AllNodesConverged],
        event_type: EventType::Normal,
        event_reason: "RolloutFinished",
        action: "Rollout",
    },
    PoolTransition {
        type_: PoolConditionType::Degraded,
        reasons: &[Reason::RolloutHalted],
        event_type: EventType::Warning,
        event_reason: "RolloutHalted",
        action: "Rollout",
    },
    PoolTransition {
        type_: PoolConditionType::Degraded,
        reasons: &[Reason::NodesUnresponsive],
        event_type: EventType::Warning,
        event_reason: "NodesUnresponsive",
        action: "Rollout",
    },
    PoolTransition {
        type_: PoolConditionType::Degraded,
        reasons: &[Reason::Conflict],
        event_type: EventType::Warning,
        event_reason: "Conflict",
        action: "Plan",
    },
];

/// Events for a pool whose status goes from `old` to `new`.
pub fn pool_events(old: &HugePagePoolStatus, new: &HugePagePoolStatus) -> Vec<Event> {
    let (old, new) = (&old.conditions, &new.conditions);
    POOL_TRANSITIONS
        .iter()
        .filter_map(|t| {
            let message = became(old, new, t.type_, "True", t.reasons)?;
            // A rollout starts once: moving between Progressing reasons is not a new start.
            let restarted = t.type_ == PoolConditionType::Progressing
                && find_condition(old, PoolConditionType::Progressing)
                    .is_some_and(|c| c.status == "True");
            (!restarted).then(|| event(t.event_type, t.event_reason, t.action, message))
        })
        .collect()
}

/// The Event for a Draining condition a node moves to, if it is new.
pub fn drain_event(old: Option<&Condition>, update: &ConditionUpdate) -> Option<Event> {
    debug_assert_eq!(update.type_, NodeConditionType::Draining.as_str());
    let unchanged = old.is_some_and(|c| {
        c.reason == update.reason.as_str() && (c.status == "True") == update.status
    });
    if unchanged {
        return None;
    }
    let (type_, reason) = match update.reason {
        Reason::EvictingPods => (EventType::Normal, "DrainStarted"),
        Reason::DrainTimeout => (EventType::Warning, "DrainTimeout"),
        _ => (EventType::Normal, "DrainFinished"),
    };
    Some(event(type_, reason, "Drain", update.message.clone()))
}

/// The Event for one eviction attempt; none for a pod that was already
/// gone (not an eviction, nothing to tell).
pub fn eviction_event(pod: &str, outcome: &crate::drain::Eviction) -> Option<Event> {
    use crate::drain::Eviction;
    match outcome {
        Eviction::Evicted => Some(event(
            EventType::Normal,
            "Evicted",
            "Evict",
            format!("evicted pod {pod} to free its huge pages"),
        )),
        Eviction::Blocked(message) => Some(event(
            EventType::Warning,
            "EvictionBlocked",
            "Evict",
            format!("eviction of pod {pod} refused, will retry: {message}"),
        )),
        Eviction::Failed(message) => Some(event(
            EventType::Warning,
            "EvictionFailed",
            "Evict",
            format!("eviction of pod {pod} failed: {message}"),
        )),
        Eviction::Abandoned(why) => Some(event(
            EventType::Normal,
            "EvictionAbandoned",
            "Evict",
            format!("eviction of pod {pod} not sent: {why}"),
        )),
        Eviction::Gone => None,
    }
}

/// The Event on a Node the operator could not write to (the first failure
/// of a streak; it retries with backoff).
pub fn write_failed(error: &crate::error::Error) -> Event {
    event(
        EventType::Warning,
        "WriteFailed",
        "Write",
        format!("{error}; retrying with backoff"),
    )
}

#[cfg(test)]
mod tests {
    use hugepool_crds::conditions::set_condition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn status(updates: &[(PoolConditionType, bool, Reason)]) -> HugePagePoolStatus {
        let mut status = HugePagePoolStatus::default();
        for (type_, value, reason) in updates {
            set_condition(
                &mut status.conditions,
                ConditionUpdate::new(*type_, *value, *reason, "3/4 nodes converged"),
                &Time(jiff::Timestamp::UNIX_EPOCH),
            );
        }
        status
    }

    fn reasons(events: &[Event]) -> Vec<&str> {
        events.iter().map(|e| e.reason.as_str()).collect()
    }

    #[test]
    fn a_write_failure_quoting_a_long_api_error_fits_the_events_limit() {
        let error = crate::error::Error::Timeout(std::time::Duration::from_secs(1));
        let short = write_failed(&error).note.expect("a note");
        assert!(short.ends_with("; retrying with backoff"), "{short}");
        let long = event(EventType::Warning, "WriteFailed", "Write", "x".repeat(3000));
        let note = long.note.expect("a note");
        assert_eq!(note.len(), hugepool_crds::conditions::MAX_MESSAGE);
        assert!(note.ends_with("..."));
    }

    #[test]
    fn a_rollout_starts_finishes_and_halts_once_each() {
        use PoolConditionType::*;
        let idle = status(&[(Progressing, false, Reason::RolloutComplete)]);
        let rolling = status(&[(Progressing, true, Reason::RollingOut)]);
        let limited = status(&[(Progressing, true, Reason::MaxUnavailableReached)]);
        let done = status(&[
            (Progressing, false, Reason::RolloutComplete),
            (Available, true, Reason::AllNodesConverged),
        ]);
        let halted = status(&[
            (Progressing, false, Reason::RolloutHalted),
            (Degraded, true, Reason::RolloutHalted),
        ]);
        assert_eq!(reasons(&pool_events(&idle, &rolling)), ["RolloutStarted"]);
        assert!(
            pool_events(&rolling, &limited).is_empty(),
            "still the same rollout"
        );
        assert_eq!(reasons(&pool_events(&limited, &done)), ["RolloutFinished"]);
        assert!(pool_events(&done, &done).is_empty());
        assert_eq!(reasons(&pool_events(&rolling, &halted)), ["RolloutHalted"]);
        assert!(pool_events(&halted, &halted).is_empty());
    }
}
