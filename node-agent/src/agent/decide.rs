//! What the resize loop does, decided from what the kernel reports now and
//! what the agent remembers: per pool file (a size's global pool, or one
//! NUMA node's) whether to resize, wait or leave it; whether a kubelet
//! restart is due; and when to look again. Pure, so that every case is a
//! unit or property test; `resize_loop.rs` reads the inputs and acts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hugepool_crds::PageSize;

use super::status::KubeletView;
use crate::resize::{Observation, Outcome};
use hugepool_crds::kubelet;

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

/// Decides for a file whose target is `target` pages, as `observed` now,
/// where prepared DRA claims hold `hold` pages; `last` is how the agent's
/// last resize of this file ended and for which target; `retry_due` whether
/// a short grow may be tried again.
pub fn decide(
    target: u64,
    hold: u64,
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
        Outcome::Blocked { .. } if observed.shrink_floor().max(hold) >= observed.persistent() => {
            Action::WaitBlocked
        }
        // Pages in use or claims were let go: the shrink can go on.
        Outcome::Blocked { .. } => Action::Resize,
        Outcome::Shortfall { .. } if retry_due => Action::Resize,
        Outcome::Shortfall { .. } => Action::WaitRetry,
    }
}

/// How long the loop leaves things before it looks again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waits {
    /// Nothing to wait for: look again after this long anyway.
    pub refresh: Duration,
    /// A shrink waits for pages in use to be let go.
    pub blocked_poll: Duration,
    /// A short grow waits this long before its retry.
    pub retry: Duration,
}

/// What a pass left to wait for, and so when the loop wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// A file waits for pages in use (or a pool that could not be read).
    Blocked,
    /// A short grow waits for its retry.
    Retry,
    /// A pool another writer moved is restored after this long.
    After(Duration),
}

/// When to look again: the soonest of what the pass waits for, at most the
/// refresh interval.
pub fn next_wake(waiting: impl IntoIterator<Item = Wake>, waits: &Waits) -> Duration {
    waiting
        .into_iter()
        .map(|wake| match wake {
            Wake::Blocked => waits.blocked_poll,
            Wake::Retry => waits.retry,
            Wake::After(wait) => wait,
        })
        .fold(waits.refresh, Duration::min)
}

/// Whether to restart the kubelet after a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    /// No entry asks for restarts, or the agent has no restart command.
    NotWanted,
    /// The node has not reached every target yet.
    NotConverged,
    /// The kubelet reports the pools (or it was restarted for them, or its
    /// capacity has not been read yet).
    UpToDate,
    /// A restart is running.
    Running,
    /// A restart would fail: the kubelet's Memory Manager holds memory for
    /// pods in the state it checks at start (or its state is unreadable).
    Held,
    /// The last restart for these pools failed; retry after this long.
    WaitRetry(Duration),
    /// Restart it now.
    Due,
}

/// Decides the kubelet restart: `wanted` when an entry says AfterResize
/// and the agent has a restart command; `pools` what the node holds now
/// (size -> persistent pages); `view` what the agent knows of the kubelet.
pub fn kubelet_restart(
    wanted: bool,
    converged: bool,
    pools: &BTreeMap<PageSize, u64>,
    view: &KubeletView,
    now: Instant,
) -> Restart {
    if !wanted {
        return Restart::NotWanted;
    }
    if !converged {
        return Restart::NotConverged;
    }
    if view.restarting {
        return Restart::Running;
    }
    let stale = view.capacity.as_ref().is_some_and(|capacity| {
        pools
            .iter()
            .any(|(&size, &pages)| kubelet::capacity_stale(capacity, size, pages))
    });
    if !stale || view.restarted_for.as_ref() == Some(pools) {
        return Restart::UpToDate;
    }
    if view.memory_manager.holds_restart().is_some() {
        return Restart::Held;
    }
    match &view.failure {
        Some(failure) if failure.pools == *pools && now < failure.retry_at => {
            Restart::WaitRetry(failure.retry_at - now)
        }
        _ => Restart::Due,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::status::RestartFailure;
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
            estimate: None,
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
            claimed: 0,
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
            decide(100, 0, &away, Some(&(64, blocked())), false),
            Action::Idle
        );
        assert_eq!(decide(64, 0, &away, None, false), Action::Resize);
        assert_eq!(
            decide(64, 0, &away, Some(&(64, Outcome::Reached)), false),
            Action::OtherWriter
        );
        assert_eq!(
            decide(64, 0, &away, Some(&(64, short())), false),
            Action::WaitRetry
        );
        assert_eq!(
            decide(64, 0, &away, Some(&(64, short())), true),
            Action::Resize
        );
        // A shrink to 10 stopped at the 60 pages in use stays blocked; once
        // they are let go it goes on.
        let held = global(60, 0, 0, 0);
        assert_eq!(
            decide(10, 0, &held, Some(&(10, blocked())), false),
            Action::WaitBlocked
        );
        let freed = global(60, 60, 0, 0);
        assert_eq!(
            decide(10, 0, &freed, Some(&(10, blocked())), false),
            Action::Resize
        );
        // Surplus at the target is not at target.
        assert_eq!(
            decide(10, 0, &global(60, 0, 0, 50), None, false),
            Action::Resize
        );
    }

    #[test]
    fn a_shrink_held_by_claims_waits_until_they_are_let_go() {
        // 100 free pages, target 10, the last shrink stopped at the claims.
        let free = global(100, 100, 0, 0);
        assert_eq!(
            decide(10, 100, &free, Some(&(10, blocked())), false),
            Action::WaitBlocked
        );
        assert_eq!(
            decide(10, 0, &free, Some(&(10, blocked())), false),
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
            estimate: None,
        };
        assert_eq!(decide(512, 0, &observed, None, false), Action::Idle);
        assert_eq!(decide(1024, 0, &observed, None, false), Action::Resize);
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
            let action = decide(target, 0, &observed, Some(&(last_target, last.clone())), retry_due);
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

    fn pools(pages: u64) -> BTreeMap<PageSize, u64> {
        BTreeMap::from([(PageSize::SIZE_2MI, pages)])
    }

    fn kubelet_reports(pages: u64) -> KubeletView {
        KubeletView {
            capacity: Some(BTreeMap::from([(
                PageSize::SIZE_2MI,
                pages * PageSize::SIZE_2MI.bytes(),
            )])),
            ..KubeletView::default()
        }
    }

    #[test]
    fn the_kubelet_is_restarted_once_per_change_after_the_node_converged() {
        let now = Instant::now();
        let stale = kubelet_reports(0);
        assert_eq!(
            kubelet_restart(false, true, &pools(64), &stale, now),
            Restart::NotWanted
        );
        assert_eq!(
            kubelet_restart(true, false, &pools(64), &stale, now),
            Restart::NotConverged
        );
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &stale, now),
            Restart::Due
        );
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &kubelet_reports(64), now),
            Restart::UpToDate
        );
        let unread = KubeletView::default();
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &unread, now),
            Restart::UpToDate,
            "capacity not read yet"
        );
        let running = KubeletView {
            restarting: true,
            ..stale.clone()
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &running, now),
            Restart::Running
        );
        // Restarted for 64 and the Node still says 0 (the kubelet has not
        // posted it yet): not again for the same pools, but for the next.
        let done = KubeletView {
            restarted_for: Some(pools(64)),
            ..stale.clone()
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &done, now),
            Restart::UpToDate
        );
        assert_eq!(
            kubelet_restart(true, true, &pools(8), &done, now),
            Restart::Due
        );
        // A failure waits out its backoff, for these pools only.
        let failed = KubeletView {
            failure: Some(RestartFailure {
                pools: pools(64),
                attempts: 1,
                message: "exit 1".into(),
                retry_at: now + Duration::from_secs(10),
            }),
            ..stale
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &failed, now),
            Restart::WaitRetry(Duration::from_secs(10))
        );
        assert_eq!(
            kubelet_restart(
                true,
                true,
                &pools(64),
                &failed,
                now + Duration::from_secs(10)
            ),
            Restart::Due
        );
        assert_eq!(
            kubelet_restart(true, true, &pools(8), &failed, now),
            Restart::Due
        );
    }

    #[test]
    fn a_node_that_does_not_list_the_size_is_not_restarted_for_it() {
        // The one rule both sides share (hugepool_crds::kubelet): no kubelet
        // publishes a size its Node does not list, so a restart cannot help.
        let lists_1gi_only = KubeletView {
            capacity: Some(BTreeMap::from([(PageSize::SIZE_1GI, 0)])),
            ..KubeletView::default()
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &lists_1gi_only, Instant::now()),
            Restart::UpToDate
        );
    }

    #[test]
    fn a_static_memory_manager_holding_memory_for_pods_holds_the_restart() {
        use crate::agent::status::MemoryManagerView;
        use crate::kubelet_state::Assignment;
        let now = Instant::now();
        let holder = Assignment {
            pod_uid: "uid-1".into(),
            containers: vec!["holder".into()],
            resources: vec!["hugepages-2Mi".into(), "memory".into()],
        };
        let held = KubeletView {
            memory_manager: MemoryManagerView::Static(vec![holder]),
            ..kubelet_reports(0)
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &held, now),
            Restart::Held
        );
        let unreadable = KubeletView {
            memory_manager: MemoryManagerView::Unreadable("bad json".into()),
            ..kubelet_reports(0)
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &unreadable, now),
            Restart::Held
        );
        // No assignments: the restart goes ahead (the checkpoint is cleared
        // first); held or not, nothing is due while the kubelet reports the pools.
        let empty = KubeletView {
            memory_manager: MemoryManagerView::Static(Vec::new()),
            ..kubelet_reports(0)
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &empty, now),
            Restart::Due
        );
        let reporting = KubeletView {
            memory_manager: held.memory_manager.clone(),
            ..kubelet_reports(64)
        };
        assert_eq!(
            kubelet_restart(true, true, &pools(64), &reporting, now),
            Restart::UpToDate
        );
    }

    #[test]
    fn the_loop_wakes_for_the_soonest_wait_and_at_least_every_refresh() {
        let waits = Waits {
            refresh: Duration::from_secs(15),
            blocked_poll: Duration::from_secs(2),
            retry: Duration::from_secs(300),
        };
        assert_eq!(next_wake([], &waits), Duration::from_secs(15));
        assert_eq!(next_wake([Wake::Retry], &waits), Duration::from_secs(15));
        assert_eq!(
            next_wake([Wake::Retry, Wake::Blocked], &waits),
            Duration::from_secs(2)
        );
        assert_eq!(
            next_wake(
                [Wake::After(Duration::from_millis(500)), Wake::Blocked],
                &waits
            ),
            Duration::from_millis(500)
        );
    }

    /// Two NUMA nodes of one size: node `id` has `(total, free, surplus)`,
    /// the other `other`; `reserved` is the size's (it is global).
    fn numa_observation(
        id: u32,
        own: (u64, u64, u64),
        other: (u64, u64, u64),
        reserved: u64,
    ) -> Observation {
        let (total, free, surplus) = own;
        let free_all = free + other.1;
        Observation {
            pool: PoolCounts {
                total: total + other.0,
                free: free_all,
                reserved: reserved.min(free_all),
                surplus: surplus + other.2,
            },
            node: Some(NumaCounts {
                node: id,
                total,
                free,
                surplus,
            }),
            mem_available: 8 << 30,
            hvo: false,
            estimate: None,
        }
    }

    fn counts() -> impl Strategy<Value = (u64, u64, u64)> {
        (0u64..600, 0u64..600, 0u64..100).prop_map(|(total, used, surplus)| {
            let surplus = surplus.min(total);
            (total, total - used.min(total), surplus)
        })
    }

    proptest! {
        /// Each NUMA node's file is judged by that node's own counts: the
        /// other node (its total, its surplus, pages in use there) never
        /// makes this one idle or blocked, and a blocked wait is only kept
        /// while this node's shrink floor still holds the pool.
        #[test]
        fn a_numa_file_never_takes_its_state_from_the_other_numa_node(
            id in 0u32..2,
            own in counts(),
            other in counts(),
            reserved in 0u64..200,
            target in 0u64..600,
            last in proptest::option::of(outcome()),
            retry_due in any::<bool>(),
        ) {
            let observed = numa_observation(id, own, other, reserved);
            let last = last.map(|o| (target, o));
            let action = decide(target, 0, &observed, last.as_ref(), retry_due);
            let at_target = own.0 - own.2 == target && own.2 == 0;
            prop_assert_eq!(action == Action::Idle, at_target);
            if action == Action::WaitBlocked {
                prop_assert!(observed.shrink_floor() >= own.0 - own.2);
            }
            if last.is_none() && !at_target {
                prop_assert_eq!(action, Action::Resize);
            }
        }
    }

    fn restart_view() -> impl Strategy<Value = (KubeletView, u64, u64)> {
        (
            proptest::option::of(0u64..4),
            proptest::option::of(0u64..4),
            proptest::option::of((0u64..4, 0u64..20)),
            any::<bool>(),
            0u64..4,
            0u64..20,
        )
            .prop_map(
                |(reports, restarted, failed, restarting, node_pages, now_s)| {
                    let view = KubeletView {
                        capacity: reports.map(|pages| kubelet_reports(pages).capacity.unwrap()),
                        restarted_for: restarted.map(pools),
                        failure: failed.map(|(pages, at)| RestartFailure {
                            pools: pools(pages),
                            attempts: 1,
                            message: String::new(),
                            retry_at: base() + Duration::from_secs(at),
                        }),
                        restarts_disabled: false,
                        restarting,
                        ..KubeletView::default()
                    };
                    (view, node_pages, now_s)
                },
            )
    }

    fn base() -> Instant {
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *BASE.get_or_init(Instant::now)
    }

    proptest! {
        #[test]
        fn a_restart_is_due_only_for_a_converged_node_the_kubelet_misreports(
            (view, pages, now_s) in restart_view(),
            wanted in any::<bool>(),
            converged in any::<bool>(),
        ) {
            let now = base() + Duration::from_secs(now_s);
            let decision = kubelet_restart(wanted, converged, &pools(pages), &view, now);
            if decision == Restart::Due {
                prop_assert!(wanted && converged && !view.restarting);
                let reported = view.capacity.as_ref().unwrap()[&PageSize::SIZE_2MI];
                prop_assert_ne!(reported, pages * PageSize::SIZE_2MI.bytes());
                prop_assert_ne!(view.restarted_for.as_ref(), Some(&pools(pages)));
                if let Some(failure) = &view.failure && failure.pools == pools(pages) {
                    prop_assert!(now >= failure.retry_at);
                }
            }
            if let Restart::WaitRetry(wait) = decision {
                prop_assert!(!wait.is_zero());
            }
        }
    }
}
