//! A pool's conditions (Available, Progressing, Degraded) and how their
//! messages name nodes.

use super::*;

/// Spells out up to [`MAX_NAMED_NODES`] names.
pub(super) fn name_nodes(names: &[String]) -> String {
    let mut text = names
        .iter()
        .take(MAX_NAMED_NODES)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX_NAMED_NODES {
        text.push_str(&format!(" and {} more", names.len() - MAX_NAMED_NODES));
    }
    text
}

/// What finishes a pool whose kernels converged while kubelets still report
/// the old capacity, for the pool's `kubelet.restart` (docs/user-guide.md,
/// "Kubelet restart").
pub(super) fn ways_to_refresh_the_kubelet(restart: KubeletRestart) -> &'static str {
    match restart {
        KubeletRestart::Never => {
            "To finish, either restart the kubelet on each (`systemctl restart kubelet`), or let \
             the agents do it: set spec.kubelet.restart: AfterResize (the chart needs \
             agent.kubeletRestart.enabled=true), or set the pool at boot (agent.bootFile.enabled)"
        }
        KubeletRestart::AfterResize => {
            "The agents restart it (kubelet.restart: AfterResize); `kubectl hugepool why NODE` \
             says what a node waits for (an agent installed without \
             agent.kubeletRestart.enabled=true cannot restart it)"
        }
    }
}

/// Available, Progressing and Degraded for one pool (docs/design.md).
pub(super) fn pool_conditions(pool: &PoolRules<'_>, plan: &PoolPlan) -> [ConditionUpdate; 3] {
    use PoolConditionType::{Available, Degraded, Progressing};
    let generation = Some(pool.generation);
    let update = |type_, status, reason, message: String| {
        ConditionUpdate::new(type_, status, reason, message).generation(generation)
    };
    let counts = &plan.status.nodes;
    let mut summary = format!(
        "{}/{} nodes converged, {} updating, {} pending, {} failed",
        counts.converged, counts.selected, counts.updating, counts.pending, counts.failed
    );
    if counts.unresponsive > 0 {
        summary.push_str(&format!(", {} unresponsive", counts.unresponsive));
    }
    if let Some(problem) = &pool.invalid {
        let message = format!("invalid spec: {problem}");
        return [
            update(Available, false, Reason::InvalidSpec, message.clone()),
            update(Progressing, false, Reason::InvalidSpec, message.clone()),
            update(Degraded, true, Reason::InvalidSpec, message),
        ];
    }
    let failed: Vec<&FailedNode> = plan.status.failed_nodes.iter().collect();
    let halted = counts.failed > 0 && counts.failed as usize >= plan.max_unavailable;
    let conflict_nodes: Vec<String> = plan.conflicts.iter().map(|(n, _)| n.clone()).collect();
    let conflict_owners: BTreeSet<&str> = plan.conflicts.iter().map(|(_, o)| o.as_str()).collect();

    let available = if counts.selected == 0 {
        let message = if pool.deleting {
            "no node holds pages of this pool".to_string()
        } else {
            "no node matches the nodeSelector".to_string()
        };
        update(Available, false, Reason::NoMatchingNodes, message)
    } else if counts.converged == counts.selected && !plan.capacity_stale.is_empty() {
        update(
            Available,
            false,
            Reason::KubeletCapacityStale,
            format!(
                "{summary}; the kubelet on {} still reports the old {} capacity (a kubelet \
                 reads it only when it starts). {}",
                name_nodes(&plan.capacity_stale),
                pool.size.resource_name(),
                ways_to_refresh_the_kubelet(pool.pool.spec.kubelet.restart),
            ),
        )
    } else if counts.converged == counts.selected && !plan.advertising_claim_pool.is_empty() {
        update(
            Available,
            false,
            Reason::KubeletAdvertisesClaimPool,
            format!(
                "{summary}; the kubelet on {} advertises this pool's pages as {} (it \
                 restarted after they were grown): pods that request {} may be placed on \
                 them, and claims get only the rest (the node's KubeletCapacityStale says how \
                 many; troubleshooting.md, KubeletAdvertisesClaimPool)",
                name_nodes(&plan.advertising_claim_pool),
                pool.size.resource_name(),
                pool.size.resource_name(),
            ),
        )
    } else if counts.converged == counts.selected && !plan.tainted.is_empty() {
        update(
            Available,
            false,
            Reason::NodesNotConverged,
            format!(
                "{summary}; the draining taint is still on {}",
                name_nodes(&plan.tainted)
            ),
        )
    } else if counts.converged == counts.selected {
        update(Available, true, Reason::AllNodesConverged, summary.clone())
    } else {
        update(Available, false, Reason::NodesNotConverged, summary.clone())
    };

    let changing = counts.updating + counts.failed;
    let waiting = counts.pending - conflict_nodes.len() as i64;
    let mut blocked_note = if plan.blocked.is_empty() {
        String::new()
    } else {
        format!(
            "; shrink blocked by pages in use on {} (drain policy Never)",
            name_nodes(&plan.blocked)
        )
    };
    if !plan.held_by_claims.is_empty() {
        blocked_note.push_str(&format!(
            "; shrink held by claims on {} (pages ResourceClaims hold there, prepared or \
             allocated by the scheduler: they come back when the claims are deallocated)",
            name_nodes(&plan.held_by_claims)
        ));
    }
    // Nodes that hold a slot and have not answered yet: named before they
    // are passed over, so a rollout that waits on them says on whom.
    let silent_note = if plan.silent.is_empty() {
        String::new()
    } else {
        let named: Vec<String> = plan
            .silent
            .iter()
            .take(MAX_NAMED_NODES)
            .map(|(node, until)| {
                let until = until.strftime("%Y-%m-%dT%H:%M:%SZ");
                format!("{node} (passed over at {until} unless it answers)")
            })
            .collect();
        format!(
            "; waiting on nodes that do not answer yet: {}",
            named.join(", ")
        )
    };
    let progressing = if halted {
        update(
            Progressing,
            false,
            Reason::RolloutHalted,
            format!(
                "rollout halted: {} failed nodes reach maxUnavailable {}",
                counts.failed, plan.max_unavailable
            ),
        )
    } else if counts.updating == 0 && waiting <= 0 && counts.selected == 0 && !pool.deleting {
        // Nothing to roll out is not a rollout done: nothing holds pages.
        update(
            Progressing,
            false,
            Reason::NoMatchingNodes,
            "no node matches the nodeSelector".to_string(),
        )
    } else if counts.updating == 0
        && waiting <= 0
        && (counts.failed > 0 || counts.unresponsive > 0 || !conflict_nodes.is_empty())
    {
        // Nothing left the rollout can do, but some selected nodes do not
        // hold the pool's pages.
        let mut short = Vec::new();
        if counts.failed > 0 {
            short.push(format!("{} failed", counts.failed));
        }
        if counts.unresponsive > 0 {
            short.push(format!("{} do not answer", counts.unresponsive));
        }
        if !conflict_nodes.is_empty() {
            short.push(format!("{} belong to an older pool", conflict_nodes.len()));
        }
        update(
            Progressing,
            false,
            Reason::RolloutIncomplete,
            format!(
                "rollout ended without every node: {} (see Degraded); {summary}",
                short.join(", ")
            ),
        )
    } else if counts.updating == 0 && waiting <= 0 {
        update(Progressing, false, Reason::RolloutComplete, summary.clone())
    } else if pool.pool.spec.rollout.paused {
        update(
            Progressing,
            counts.updating > 0,
            Reason::Paused,
            format!("rollout paused: {summary}{blocked_note}{silent_note}"),
        )
    } else if !plan.draining.is_empty() {
        update(
            Progressing,
            true,
            Reason::Draining,
            format!(
                "draining {} for the shrink; {summary}{blocked_note}{silent_note}",
                name_nodes(&plan.draining)
            ),
        )
    } else if waiting > 0 && changing as usize >= plan.max_unavailable {
        update(
            Progressing,
            true,
            Reason::MaxUnavailableReached,
            format!(
                "{changing}/{} nodes changing (maxUnavailable), {waiting} waiting; \
                 {summary}{blocked_note}{silent_note}",
                plan.max_unavailable
            ),
        )
    } else {
        update(
            Progressing,
            true,
            Reason::RollingOut,
            format!(
                "{summary}; maxUnavailable {}{blocked_note}{silent_note}",
                plan.max_unavailable
            ),
        )
    };

    let describe_failed = || {
        failed
            .iter()
            .map(|f| format!("{} ({}: {})", f.name, f.reason, f.message))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let halt_note = if halted {
        format!(
            "; rollout halted at maxUnavailable {}",
            plan.max_unavailable
        )
    } else {
        String::new()
    };
    let described_unresponsive = || {
        let described: Vec<String> = plan
            .unresponsive
            .iter()
            .take(MAX_NAMED_NODES)
            .map(|(node, why)| format!("{node} ({why})"))
            .collect();
        let more = plan.unresponsive.len().saturating_sub(MAX_NAMED_NODES);
        format!(
            "{}{}",
            described.join("; "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        )
    };
    // Nodes that do not answer are named whatever else the pool reports.
    let unresponsive_note = if plan.unresponsive.is_empty() {
        String::new()
    } else {
        format!(
            "; {} nodes do not answer: {}",
            plan.unresponsive.len(),
            described_unresponsive()
        )
    };
    // A timed-out drain names its own cause (a PodDisruptionBudget, most
    // likely) even when it is also what halted the rollout.
    let degraded = if !plan.drain_timeouts.is_empty() {
        update(
            Degraded,
            true,
            Reason::DrainTimeout,
            format!(
                "drain timed out on {}{halt_note}: {}{unresponsive_note}",
                name_nodes(&plan.drain_timeouts),
                describe_failed()
            ),
        )
    } else if halted {
        update(
            Degraded,
            true,
            Reason::RolloutHalted,
            format!(
                "{} nodes failed, rollout halted at maxUnavailable {}: {}{unresponsive_note}",
                counts.failed,
                plan.max_unavailable,
                describe_failed()
            ),
        )
    } else if !conflict_nodes.is_empty() {
        update(
            Degraded,
            true,
            Reason::Conflict,
            format!(
                "{} nodes selected by this pool belong for {} pages to the older pool {}, \
                 this pool leaves them alone: {}{unresponsive_note}",
                conflict_nodes.len(),
                pool.size,
                conflict_owners.into_iter().collect::<Vec<_>>().join(", "),
                name_nodes(&conflict_nodes)
            ),
        )
    } else if counts.failed > 0 {
        // The nodes' own reason when they share one (AllocationFailed,
        // InvalidTarget, UnsupportedPageSize), NodesFailed when they differ.
        let mut reasons = failed.iter().map(|f| f.reason.as_str());
        let first = reasons.next();
        let reason = match first.and_then(Reason::parse) {
            Some(reason) if reasons.all(|r| Some(r) == first) => reason,
            _ => Reason::NodesFailed,
        };
        update(
            Degraded,
            true,
            reason,
            format!(
                "{} nodes failed: {}{unresponsive_note}",
                counts.failed,
                describe_failed()
            ),
        )
    } else if !plan.unresponsive.is_empty() {
        let waits = if pool.deleting {
            "the deletion waits for them"
        } else {
            "the rollout goes on without them"
        };
        update(
            Degraded,
            true,
            Reason::NodesUnresponsive,
            format!(
                "{} nodes do not answer, {waits}: {}",
                plan.unresponsive.len(),
                described_unresponsive()
            ),
        )
    } else if !plan.stalled.is_empty() {
        update(
            Degraded,
            true,
            Reason::NodesStalled,
            format!("kernel writes stalled on {}", name_nodes(&plan.stalled)),
        )
    } else if !plan.write_errors.is_empty() {
        let described: Vec<String> = plan
            .write_errors
            .iter()
            .take(MAX_NAMED_NODES)
            .map(|(node, error)| format!("{node}: {error}"))
            .collect();
        update(
            Degraded,
            true,
            Reason::NodeWritesFailed,
            format!(
                "the operator's writes to {} nodes failed (retried with backoff): {}",
                plan.write_errors.len(),
                described.join("; ")
            ),
        )
    } else if counts.selected == 0 && !pool.deleting {
        update(
            Degraded,
            true,
            Reason::NoMatchingNodes,
            "no node matches the nodeSelector".to_string(),
        )
    } else {
        update(Degraded, false, Reason::AsExpected, String::new())
    };
    [available, progressing, degraded]
}
