//! Typed condition types and reasons of docs/design.md ("Conditions"), and
//! the one helper that writes them into a `metav1.Condition` list.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Declares a fieldless enum whose variants are spelled in the API exactly
/// as their Rust names.
macro_rules! api_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => stringify!($variant)),+ }
            }

            pub fn parse(text: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|v| v.as_str() == text)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

api_enum! {
    /// Conditions on a HugePageNode; all agent-owned except Draining.
    NodeConditionType {
        Converged, Resizing, Stalled, AllocationFailed, ShrinkBlocked, KubeletCapacityStale,
        KernelLogUnavailable, Restoring, Draining,
    }
}

api_enum! {
    /// Conditions on a HugePagePool; all operator-owned.
    PoolConditionType { Available, Progressing, Degraded }
}

api_enum! {
    /// Every reason either side writes. The design lists which reasons go with
    /// which type; the `False` side of each type has its own reason too,
    /// because `metav1.Condition` requires one.
    Reason {
        // Converged
        AtTarget, Resizing, PagesInUse, AllocationShortfall, Stalled, UnsupportedPageSize, InvalidTarget,
        OtherWriter,
        // Resizing
        Growing, Shrinking, Idle,
        // Stalled
        SlowKernelWrite, NoProgress, SoftLockup, RcuStall, HungTask, WritesWithinBudget,
        // AllocationFailed
        Fragmented, MemoryGuard, InsufficientMemory, WriteError, AllocationComplete,
        // ShrinkBlocked
        NotBlocked,
        // KubeletCapacityStale
        KubeletRestartRequired, KubeletRestarted, KubeletRestartFailed, CapacityMatches,
        MemoryManagerAssignments, KubeletAdvertisesClaimPool,
        // KernelLogUnavailable
        KernelLogUnreadable, KernelLogDisabled, KernelLogWatched,
        // Restoring
        PoolsShortAtStart, PoolsReady,
        // Draining
        EvictingPods, DrainTimeout, DrainComplete,
        // Pool: Available / Progressing / Degraded
        AllNodesConverged, NodesNotConverged, RollingOut, MaxUnavailableReached, Draining, Paused,
        RolloutComplete, NodesStalled, AllocationFailed, NodesFailed, Conflict, NoMatchingNodes,
        RolloutHalted, RolloutIncomplete, NodeWritesFailed, NodesUnresponsive,
        KubeletCapacityStale,
        InvalidSpec, AsExpected,
    }
}

/// Something that names a condition type.
pub trait ConditionType: Copy {
    fn as_str(self) -> &'static str;
}

impl ConditionType for NodeConditionType {
    fn as_str(self) -> &'static str {
        NodeConditionType::as_str(self)
    }
}

impl ConditionType for PoolConditionType {
    fn as_str(self) -> &'static str {
        PoolConditionType::as_str(self)
    }
}

/// The longest condition message the CRDs accept (bytes; the schema counts
/// characters, which are never more). Writers cut longer ones with
/// [`bounded_message`], so a long list of pods or an error chain never makes
/// the whole status write fail.
pub const MAX_MESSAGE: usize = 1024;
/// The most conditions a status may carry (the CRDs' maxItems).
pub const MAX_CONDITIONS: usize = 16;

/// `message` cut to at most [`MAX_MESSAGE`] bytes at a character boundary,
/// ending in "..." when cut.
pub fn bounded_message(mut message: String) -> String {
    if message.len() <= MAX_MESSAGE {
        return message;
    }
    let mut end = MAX_MESSAGE - 3;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str("...");
    message
}

/// The state a writer wants a condition to be in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionUpdate {
    pub type_: &'static str,
    pub status: bool,
    pub reason: Reason,
    pub message: String,
    pub observed_generation: Option<i64>,
}

impl ConditionUpdate {
    pub fn new(
        type_: impl ConditionType,
        status: bool,
        reason: Reason,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_: type_.as_str(),
            status,
            reason,
            message: message.into(),
            observed_generation: None,
        }
    }

    pub fn generation(mut self, generation: Option<i64>) -> Self {
        self.observed_generation = generation;
        self
    }
}

fn status_str(status: bool) -> &'static str {
    if status { "True" } else { "False" }
}

/// Sets one condition in `conditions`. `lastTransitionTime` moves to `now`
/// only when the status changes (or the condition is new). Returns whether
/// anything changed, so callers can skip a patch that would change nothing.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    mut update: ConditionUpdate,
    now: &Time,
) -> bool {
    update.message = bounded_message(update.message);
    let status = status_str(update.status);
    let existing = conditions.iter_mut().find(|c| c.type_ == update.type_);
    let Some(condition) = existing else {
        conditions.push(Condition {
            type_: update.type_.to_string(),
            status: status.to_string(),
            reason: update.reason.as_str().to_string(),
            message: update.message,
            observed_generation: update.observed_generation,
            last_transition_time: now.clone(),
        });
        return true;
    };
    let unchanged = condition.status == status
        && condition.reason == update.reason.as_str()
        && condition.message == update.message
        && condition.observed_generation == update.observed_generation;
    if unchanged {
        return false;
    }
    if condition.status != status {
        condition.last_transition_time = now.clone();
        condition.status = status.to_string();
    }
    condition.reason = update.reason.as_str().to_string();
    condition.message = update.message;
    condition.observed_generation = update.observed_generation;
    true
}

/// The condition of `type_`, if present.
pub fn find_condition(conditions: &[Condition], type_: impl ConditionType) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == type_.as_str())
}

/// Whether the condition of `type_` is present with status True.
pub fn is_true(conditions: &[Condition], type_: impl ConditionType) -> bool {
    find_condition(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_at_a_character_boundary() {
        let short = "x".repeat(MAX_MESSAGE);
        assert_eq!(bounded_message(short.clone()), short);
        // 'é' is two bytes: a cut at byte 1021 would split one.
        let long = "é".repeat(MAX_MESSAGE);
        let cut = bounded_message(long);
        assert!(cut.len() <= MAX_MESSAGE, "{}", cut.len());
        assert!(cut.ends_with("..."));
        assert_eq!(cut.trim_end_matches("...").chars().count(), 510);
        let mut conditions = Vec::new();
        let update = ConditionUpdate::new(
            NodeConditionType::ShrinkBlocked,
            true,
            Reason::PagesInUse,
            "pod ".repeat(1000),
        );
        set_condition(&mut conditions, update, &at(0));
        assert_eq!(conditions[0].message.len(), MAX_MESSAGE);
    }

    fn at(second: i64) -> Time {
        Time(jiff::Timestamp::from_second(1_700_000_000 + second).unwrap())
    }

    #[test]
    fn new_condition_gets_now_as_transition_time() {
        let mut conditions = Vec::new();
        let update = ConditionUpdate::new(
            NodeConditionType::Converged,
            false,
            Reason::Resizing,
            "0/4096 pages",
        );
        assert!(set_condition(&mut conditions, update, &at(0)));
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].type_, "Converged");
        assert_eq!(conditions[0].status, "False");
        assert_eq!(conditions[0].reason, "Resizing");
        assert_eq!(conditions[0].last_transition_time, at(0));
    }

    #[test]
    fn same_status_keeps_transition_time_but_takes_new_message() {
        let mut conditions = Vec::new();
        let step = |msg: &str| {
            ConditionUpdate::new(NodeConditionType::Converged, false, Reason::Resizing, msg)
        };
        set_condition(&mut conditions, step("0/4096"), &at(0));
        assert!(set_condition(&mut conditions, step("2048/4096"), &at(5)));
        assert_eq!(conditions[0].message, "2048/4096");
        assert_eq!(conditions[0].last_transition_time, at(0));
    }

    #[test]
    fn identical_update_reports_no_change() {
        let mut conditions = Vec::new();
        let update = ConditionUpdate::new(
            PoolConditionType::Available,
            true,
            Reason::AllNodesConverged,
            "3/3",
        )
        .generation(Some(2));
        set_condition(&mut conditions, update.clone(), &at(0));
        let before = conditions.clone();
        assert!(!set_condition(&mut conditions, update, &at(9)));
        assert_eq!(conditions, before);
    }

    #[test]
    fn status_flip_moves_transition_time() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            ConditionUpdate::new(NodeConditionType::Converged, false, Reason::Resizing, ""),
            &at(0),
        );
        set_condition(
            &mut conditions,
            ConditionUpdate::new(
                NodeConditionType::Stalled,
                false,
                Reason::WritesWithinBudget,
                "",
            ),
            &at(0),
        );
        assert!(set_condition(
            &mut conditions,
            ConditionUpdate::new(NodeConditionType::Converged, true, Reason::AtTarget, ""),
            &at(7)
        ));
        assert_eq!(conditions.len(), 2);
        assert_eq!(conditions[0].last_transition_time, at(7));
        assert_eq!(conditions[0].reason, "AtTarget");
        assert_eq!(conditions[1].last_transition_time, at(0));
        assert!(is_true(&conditions, NodeConditionType::Converged));
        assert!(!is_true(&conditions, NodeConditionType::Stalled));
    }

    #[test]
    fn enums_round_trip_through_their_api_spelling() {
        for reason in Reason::ALL {
            assert_eq!(Reason::parse(reason.as_str()), Some(*reason));
        }
        assert_eq!(
            NodeConditionType::parse("ShrinkBlocked"),
            Some(NodeConditionType::ShrinkBlocked)
        );
        assert_eq!(PoolConditionType::parse("Nope"), None);
    }
}
