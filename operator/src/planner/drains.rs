//! A node's drain: when a shrink blocked by pages in use drains its
//! consumers, when it times out, and when the taint goes.

use super::*;

/// Pages of `entry`'s size that must come back before its shrink can
/// finish: what the node has in use and reserved, or what DRA claims hold
/// there (whichever is more: a claim's pages count before they are
/// faulted), above the target; or, with per-NUMA targets, what each NUMA
/// node has in use (its total less its free pages) or claimed above its
/// own target, summed; whichever is more. A shrink held up on one NUMA node
/// counts although the node-wide total fits.
pub fn pages_to_free(
    reported: &hugepool_crds::node::PageSizeStatus,
    entry: &PageSizeTarget,
) -> u64 {
    let positive = |n: i64| u64::try_from(n).unwrap_or(0);
    let held =
        (reported.in_use.max(0) + reported.reserved.max(0)).max(reported.claimed.unwrap_or(0));
    let node_wide = positive(held - entry.pages.max(0));
    let per_numa: u64 = entry
        .numa
        .iter()
        .flatten()
        .filter_map(|target| {
            let numa = reported.numa.iter().find(|n| n.id == target.id)?;
            let held = (numa.total - numa.free).max(numa.claimed.unwrap_or(0));
            Some(positive(held - target.pages.max(0)))
        })
        .sum();
    node_wide.max(per_numa)
}

/// Whether the agent reports that `entry`'s shrink is held up by pages in
/// use or claimed (the kernel keeps them as surplus, or the agent stops at
/// the pages in use or claimed, node-wide or on one NUMA node).
pub(super) fn shrink_blocked(state: &HugePageNode, entry: &PageSizeTarget) -> bool {
    let Some(status) = &state.status else {
        return false;
    };
    is_true(&status.conditions, NodeConditionType::ShrinkBlocked)
        && status
            .page_sizes
            .iter()
            .any(|r| r.size == entry.size && (r.surplus > 0 || pages_to_free(r, entry) > 0))
}

/// The drain state of one node: drain while an IfNeeded pool's shrink is
/// blocked, fail with DrainTimeout past the deadline, untaint once converged
/// and, where a pool restarts the kubelet, once the kubelet reports it.
pub(super) fn plan_drain(
    node: Option<&Node>,
    state: Option<&HugePageNode>,
    spec: &HugePageNodeSpec,
    rules: &[PoolRules<'_>],
    now: Timestamp,
) -> DrainPlan {
    let Some(state) = state else {
        return DrainPlan::default();
    };
    let generation = state.metadata.generation;
    let conditions: &[_] = state.status.as_ref().map_or(&[], |s| &s.conditions);
    let draining = find_condition(conditions, NodeConditionType::Draining);
    let active = draining.is_some_and(|c| c.status == "True");

    let mut settled = true;
    let mut blocked: Vec<(&PoolRules<'_>, PageSize)> = Vec::new();
    // Pools whose kubelet restart waits for pods of the Memory Manager.
    let held_pods = memory_manager_pods(state);
    let mut held: Vec<&PoolRules<'_>> = Vec::new();
    for entry in &spec.page_sizes {
        // A target written this pass waits for the agent to act on it.
        let unchanged = state.spec.page_sizes.contains(entry);
        let entry_state = if unchanged {
            entry_state(state, entry)
        } else {
            EntryState::InFlight
        };
        settled &= entry_state == EntryState::Converged;
        if unchanged
            && !held_pods.is_empty()
            && entry.kubelet_restart == KubeletRestart::AfterResize
            && let Some(pool) = rules.iter().find(|r| r.name == entry.pool)
            && pool.drain_policy() == DrainPolicy::IfNeeded
            && !held.iter().any(|p| p.name == pool.name)
        {
            held.push(pool);
        }
        if !unchanged || entry_state != EntryState::InFlight || !shrink_blocked(state, entry) {
            continue;
        }
        let pool = rules.iter().find(|r| r.name == entry.pool);
        if let Some(pool) = pool
            && pool.drain_policy() == DrainPolicy::IfNeeded
        {
            blocked.push((pool, pool.size));
        }
    }

    if blocked.is_empty() && held.is_empty() {
        // A drain for a shrink or a kubelet restart ends when the Node
        // reports what the pods will be scheduled against: until then a new
        // pod would land on the old capacity, or take a Memory Manager
        // assignment the restart then holds for (or loses).
        let settled = settled && kubelet_reports(node, spec);
        return match (active, settled) {
            (true, true) => DrainPlan {
                condition: Some(
                    ConditionUpdate::new(
                        NodeConditionType::Draining,
                        false,
                        Reason::DrainComplete,
                        "the node converged; hugepage consumers may schedule again",
                    )
                    .generation(generation),
                ),
                ..DrainPlan::default()
            },
            // Evictions are done; the agent is still shrinking.
            (true, false) => DrainPlan {
                taint: true,
                pools: spec.page_sizes.iter().map(|e| e.pool.clone()).collect(),
                ..DrainPlan::default()
            },
            // Also takes off a taint left behind by an earlier drain.
            (false, _) => DrainPlan {
                taint: false,
                ..DrainPlan::default()
            },
        };
    }

    let sizes: Vec<PageSize> = blocked.iter().map(|(_, size)| *size).collect();
    let mut pools: Vec<String> = blocked.iter().map(|(p, _)| p.name.clone()).collect();
    let restarts: Vec<String> = held.iter().map(|p| p.name.clone()).collect();
    for pool in &restarts {
        if !pools.contains(pool) {
            pools.push(pool.clone());
        }
    }
    let timeout = blocked
        .iter()
        .map(|(p, _)| p)
        .chain(held.iter())
        .map(|p| p.drain_timeout())
        .min()
        .unwrap_or_default();
    let started = match draining {
        Some(condition) if active => condition.last_transition_time.0,
        _ => now,
    };
    let deadline = jiff::SignedDuration::try_from(timeout)
        .ok()
        .and_then(|d| started.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX);
    let resources: Vec<String> = sizes.iter().map(|s| s.resource_name()).collect();
    let for_shrink = (!blocked.is_empty()).then(|| {
        let shrinks: Vec<&str> = blocked.iter().map(|(p, _)| p.name.as_str()).collect();
        (resources.join(", "), shrinks.join(", "))
    });
    let for_restart = (!held.is_empty()).then(|| restarts.join(", "));
    if now >= deadline {
        let mut parts = Vec::new();
        if let Some((resources, _)) = &for_shrink {
            parts.push(format!("pods requesting {resources}"));
        }
        if for_restart.is_some() {
            parts.push(format!(
                "the pods the kubelet's Static Memory Manager holds memory for ({})",
                held_pods.join(", ")
            ));
        }
        let message = format!(
            "{} were not evicted within {} (pool {})",
            parts.join(" and "),
            hugepool_crds::duration::format(timeout),
            pools.join(", ")
        );
        return DrainPlan {
            taint: false,
            condition: Some(
                ConditionUpdate::new(
                    NodeConditionType::Draining,
                    false,
                    Reason::DrainTimeout,
                    message,
                )
                .generation(generation),
            ),
            pools,
            ..DrainPlan::default()
        };
    }
    let mut parts = Vec::new();
    if let Some((resources, shrinks)) = &for_shrink {
        parts.push(format!(
            "evicting pods that request {resources} so the shrink of pool {shrinks} can finish"
        ));
    }
    if let Some(restarts) = &for_restart {
        parts.push(format!(
            "evicting the pods the kubelet's Static Memory Manager holds memory for ({}) so \
             the kubelet can be restarted for pool {restarts}",
            held_pods.join(", ")
        ));
    }
    let message = parts.join("; ");
    DrainPlan {
        taint: true,
        condition: Some(
            ConditionUpdate::new(
                NodeConditionType::Draining,
                true,
                Reason::EvictingPods,
                message,
            )
            .generation(generation),
        ),
        evict: sizes,
        evict_pods: if held.is_empty() {
            Vec::new()
        } else {
            held_pods
        },
        shrink_pools: blocked
            .iter()
            .map(|(p, size)| (*size, p.name.clone()))
            .collect(),
        restart_pools: restarts,
        pools,
        deadline: Some(deadline),
    }
}

/// Whether the kubelet has caught up with `spec` wherever a pool restarts it
/// (`kubelet.restart: AfterResize`): the Node reports each such entry's
/// pages, by the rule that makes a pool Available (the scheduler reads the
/// Node; the agent's KubeletCapacityStale follows the same Node a moment
/// later, so waiting for it too would leave the taint on an Available pool).
pub(super) fn kubelet_reports(node: Option<&Node>, spec: &HugePageNodeSpec) -> bool {
    spec.page_sizes
        .iter()
        .filter(|e| e.kubelet_restart == KubeletRestart::AfterResize)
        .all(|e| !kubelet_capacity_stale(node, e.size, e.pages))
}

/// The pods a kubelet restart waits for, as the agent lists them while it
/// reports KubeletCapacityStale=True, reason MemoryManagerAssignments.
pub(super) fn memory_manager_pods(state: &HugePageNode) -> Vec<String> {
    let Some(status) = &state.status else {
        return Vec::new();
    };
    let held = find_condition(&status.conditions, NodeConditionType::KubeletCapacityStale)
        .is_some_and(|c| {
            c.status == "True" && c.reason == Reason::MemoryManagerAssignments.as_str()
        });
    if held {
        status.memory_manager_pods.clone()
    } else {
        Vec::new()
    }
}
