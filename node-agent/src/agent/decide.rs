//! What the resize loop does about one pool file (a size's global pool, or
//! one NUMA node's), decided from what the kernel reports now and how the
//! agent's last resize of that file ended. Pure, so that every case is a
//! unit or property test; `resize_loop.rs` reads the inputs and acts.

use crate::resize::{Observation, Outcome};

/// What to do about one pool file now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// At its target: nothing to do.
    Idle,
    /// Resize it to its target.
    Resize,
    /// The last shrink to this target was blocked by pages in use and still
    /// is: look again after the blocked-shrink poll.
    WaitBlocked,
    /// The last grow to this target came up short and its retry is not due.
    WaitRetry,
    /// The agent had reached this target and the pool moved since without
    /// a write of its own: another writer (counted, then restored after a
    /// backoff by the caller).
    OtherWriter,
}

/// Decides for a file whose target is `target` pages, as `observed` now;
/// `last` is how the agent's last resize of this file ended and for which
/// target; `retry_due` whether a short grow may be tried again.
pub fn decide(
    target: u64,
    observed: &Observation,
    last: Option<&(u64, Outcome)>,
    retry_due: bool,
) -> Action {
    if observed.persistent() == target && observed.surplus() == 0 {
        return Action::Idle;
    }
    // An outcome for another target says nothing about this one.
    let Some((_, outcome)) = last.filter(|(wanted, _)| *wanted == target) else {
        return Action::Resize;
    };
    match outcome {
        Outcome::Reached => Action::OtherWriter,
        Outcome::Blocked { .. } if observed.shrink_floor() >= observed.persistent() => {
            Action::WaitBlocked
        }
        // Pages in use were let go: the shrink can go on.
        Outcome::Blocked { .. } => Action::Resize,
        Outcome::Shortfall { .. } if retry_due => Action::Resize,
        Outcome::Shortfall { .. } => Action::WaitRetry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{NumaCounts, PoolCounts};
    use crate::resize::ShortfallReason;
    use proptest::prelude::*;

    fn global(total: u64, free: u64, reserved: u64, surplus: u64) -> Observation {
        Observation {
            pool: PoolCounts {
                total,
                free,
                reserved,
                surplus,
            },
            node: None,
            mem_available: 8 << 30,
            hvo: false,
        }
    }

    fn blocked() -> Outcome {
        Outcome::Blocked {
            target: 0,
            current: 0,
            in_use: 0,
            reserved: 0,
            surplus: 0,
            floor: 0,
        }
    }

    fn short() -> Outcome {
        Outcome::Shortfall {
            requested: 0,
            achieved: 0,
            reason: ShortfallReason::Fragmented,
            detail: None,
        }
    }

    #[test]
    fn each_outcome_for_the_same_target_decides_what_comes_next() {
        let away = global(100, 100, 0, 0);
        assert_eq!(
            decide(100, &away, Some(&(64, blocked())), false),
            Action::Idle
        );
        assert_eq!(decide(64, &away, None, false), Action::Resize);
        assert_eq!(
            decide(64, &away, Some(&(64, Outcome::Reached)), false),
            Action::OtherWriter
        );
        assert_eq!(
            decide(64, &away, Some(&(64, short())), false),
            Action::WaitRetry
        );
        assert_eq!(
            decide(64, &away, Some(&(64, short())), true),
            Action::Resize
        );
        // A shrink to 10 stopped at the 60 pages in use stays blocked; once
        // they are let go it goes on.
        let held = global(60, 0, 0, 0);
        assert_eq!(
            decide(10, &held, Some(&(10, blocked())), false),
            Action::WaitBlocked
        );
        let freed = global(60, 60, 0, 0);
        assert_eq!(
            decide(10, &freed, Some(&(10, blocked())), false),
            Action::Resize
        );
        // Surplus at the target is not at target.
        assert_eq!(
            decide(10, &global(60, 0, 0, 50), None, false),
            Action::Resize
        );
    }

    #[test]
    fn a_numa_file_is_judged_by_its_own_counts() {
        let observed = Observation {
            pool: PoolCounts {
                total: 1024,
                free: 1024,
                reserved: 0,
                surplus: 0,
            },
            node: Some(NumaCounts {
                node: 1,
                total: 512,
                free: 512,
                surplus: 0,
            }),
            mem_available: 8 << 30,
            hvo: false,
        };
        assert_eq!(decide(512, &observed, None, false), Action::Idle);
        assert_eq!(decide(1024, &observed, None, false), Action::Resize);
    }

    fn outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![Just(Outcome::Reached), Just(blocked()), Just(short())]
    }

    proptest! {
        #[test]
        fn never_resizes_at_target_and_never_waits_on_another_targets_outcome(
            total in 0u64..2000,
            used in 0u64..2000,
            surplus in 0u64..500,
            target in 0u64..2000,
            last_target in 0u64..2000,
            last in outcome(),
            retry_due in any::<bool>(),
        ) {
            let surplus = surplus.min(total);
            let free = total - used.min(total);
            let observed = global(total, free, 0, surplus);
            let action = decide(target, &observed, Some(&(last_target, last.clone())), retry_due);
            let at_target = observed.persistent() == target && surplus == 0;
            prop_assert_eq!(action == Action::Idle, at_target);
            if last_target != target && !at_target {
                prop_assert_eq!(action, Action::Resize);
            }
            if action == Action::WaitBlocked {
                prop_assert!(observed.shrink_floor() >= observed.persistent());
            }
            if action == Action::WaitRetry {
                prop_assert!(!retry_due);
            }
        }
    }
}
