//! The rollout planner: (pools, nodes, HugePageNodes, now) -> (the spec every
//! HugePageNode should have, every pool's status, what to drain).
//!
//! It is a pure function of its input, so the controller, the tests and a
//! future `kubectl hugepool plan` all get the same answer for the same state.
//! The rules it keeps (docs/design.md, "The operator"):
//!
//! - Per pool, a node is *changing* from the moment its target moves until it
//!   reports converged for that target; failed nodes keep their slot. A pool
//!   admits a new node only while fewer than `maxUnavailable` are changing.
//! - Each (node, page size) has one owner: the oldest pool that wants it
//!   (creationTimestamp, then name). A newer pool touches nothing there and
//!   reports Conflict.
//! - A paused pool admits no new nodes; nodes already changing keep their
//!   target and finish.
//! - A node leaving a `Release` pool (relabelled, or the pool is deleted)
//!   shrinks to 0 through the same rollout before its entry goes; a `Retain`
//!   pool drops the entry at once and leaves the kernel alone.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use hugepool_crds::conditions::{ConditionUpdate, find_condition, is_true, set_condition};
use hugepool_crds::node::{HugePageNodeSpec, PageSizeTarget};
use hugepool_crds::pool::{FailedNode, PoolNodeCounts, PoolPages};
use hugepool_crds::settings::{
    DeletionPolicy, DrainPolicy, KubeletRestart, NumaPolicy, NumaTarget,
};
use hugepool_crds::{
    HugePageNode, HugePagePool, HugePagePoolStatus, NodeConditionType, PageSize, PoolConditionType,
    Reason,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

/// At most this many nodes are listed in a pool's `status.failedNodes`.
pub const MAX_FAILED_NODES: usize = 10;
/// At most this many node names are spelled out in a condition message.
const MAX_NAMED_NODES: usize = 10;

/// Everything the planner looks at. Order of the slices does not matter.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    pub pools: &'a [HugePagePool],
    /// Borrowed from the caches: a pass copies no Node or HugePageNode.
    pub nodes: &'a [&'a Node],
    pub node_states: &'a [&'a HugePageNode],
    /// What the controller saw beyond the objects.
    pub observed: &'a Observed,
    pub now: Timestamp,
    /// The Nodes an agent runs on: each gets a HugePageNode (empty) before
    /// any pool selects it, so that its agent reports what a grow there can
    /// get and the first pool's plan is predicted too. None: only the
    /// nodes pools select have one.
    pub agent_nodes: Option<&'a Selector>,
}

/// A pool read into what the planner needs; `invalid` holds what the schema
/// could not reject.
struct PoolRules<'a> {
    pool: &'a HugePagePool,
    name: String,
    generation: i64,
    size: PageSize,
    selector: Option<Selector>,
    pages: i64,
    deleting: bool,
    invalid: Option<String>,
}

impl<'a> PoolRules<'a> {
    fn read(pool: &'a HugePagePool) -> Self {
        let spec = &pool.spec;
        let mut problems = Vec::new();
        let size = spec.page_size;
        let selector = match Selector::try_from(spec.node_selector.clone()) {
            Ok(selector) => Some(selector),
            Err(err) => {
                problems.push(format!("nodeSelector: {err}"));
                None
            }
        };
        let pages = match (&spec.pages, &spec.memory) {
            (Some(pages), None) => *pages,
            (None, Some(memory)) => match hugepool_crds::quantity::parse_bytes(memory) {
                Ok(bytes) if bytes % size.bytes() == 0 => (bytes / size.bytes()) as i64,
                Ok(_) => {
                    problems.push(format!("memory {memory} is not a multiple of {size}"));
                    0
                }
                Err(err) => {
                    problems.push(err.to_string());
                    0
                }
            },
            _ => {
                problems.push("exactly one of pages and memory must be set".into());
                0
            }
        };
        if pages < 0 {
            problems.push(format!("pages {pages} is negative"));
        }
        if let Some(numa) = &spec.numa
            && numa.policy == NumaPolicy::Explicit
        {
            let listed = numa.nodes.clone().unwrap_or_default();
            let sum: i64 = listed.iter().map(|n| n.pages).sum();
            let ids: BTreeSet<i32> = listed.iter().map(|n| n.id).collect();
            if ids.len() != listed.len() {
                problems.push("numa.nodes ids must be unique".into());
            }
            if sum != pages {
                problems.push(format!(
                    "numa.nodes add up to {sum} pages, the pool asks for {pages}"
                ));
            }
        }
        if let Err(err) =
            hugepool_crds::quantity::resolve_max_unavailable(&spec.rollout.max_unavailable, 1)
        {
            problems.push(err.to_string());
        }
        if let Err(err) = hugepool_crds::duration::parse(&spec.drain.timeout) {
            problems.push(format!("drain.timeout: {err}"));
        }
        Self {
            pool,
            name: pool.metadata.name.clone().unwrap_or_default(),
            generation: pool.metadata.generation.unwrap_or(0),
            size,
            selector,
            pages,
            deleting: pool.metadata.deletion_timestamp.is_some(),
            invalid: (!problems.is_empty()).then(|| problems.join("; ")),
        }
    }

    fn drain_policy(&self) -> DrainPolicy {
        self.pool.spec.drain.policy
    }

    fn unresponsive_after(&self) -> Duration {
        hugepool_crds::duration::parse(&self.pool.spec.rollout.unresponsive_after)
            .unwrap_or(Duration::from_secs(300))
    }

    fn drain_timeout(&self) -> Duration {
        hugepool_crds::duration::parse(&self.pool.spec.drain.timeout)
            .unwrap_or(Duration::from_secs(600))
    }

    fn release(&self) -> bool {
        self.pool.spec.deletion_policy == DeletionPolicy::Release
    }

    fn selects(&self, node: &Node) -> bool {
        let empty = BTreeMap::new();
        let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
        self.selector
            .as_ref()
            .is_some_and(|selector| selector.matches(labels))
    }

    /// The entry this pool writes for `target` pages (settings copied).
    fn entry(&self, pages: i64, numa: Option<Vec<NumaTarget>>) -> PageSizeTarget {
        let spec = &self.pool.spec;
        PageSizeTarget {
            size: self.size,
            pages,
            numa,
            pool: self.name.clone(),
            pool_generation: self.generation,
            resize: spec.resize.clone(),
            allocation: spec.allocation.clone(),
            kubelet_restart: spec.kubelet.restart,
            consumption: spec.consumption,
        }
    }

    /// The entry this pool wants on a node whose agent reports `numa_ids`
    /// (empty before it reported), or why it cannot target the node.
    fn desired_entry(&self, numa_ids: &[i32]) -> Result<PageSizeTarget, String> {
        let policy = self.pool.spec.numa.as_ref().map(|n| n.policy);
        let numa = match policy.unwrap_or_default() {
            NumaPolicy::Kernel => None,
            NumaPolicy::Spread if numa_ids.is_empty() => None,
            NumaPolicy::Spread => Some(spread(self.pages, numa_ids)),
            NumaPolicy::Explicit => {
                let mut listed = self
                    .pool
                    .spec
                    .numa
                    .as_ref()
                    .and_then(|n| n.nodes.clone())
                    .unwrap_or_default();
                listed.sort_by_key(|n| n.id);
                let missing: Vec<String> = listed
                    .iter()
                    .filter(|n| !numa_ids.is_empty() && !numa_ids.contains(&n.id))
                    .map(|n| n.id.to_string())
                    .collect();
                if !missing.is_empty() {
                    return Err(format!(
                        "the node has no NUMA node {} (it has {:?})",
                        missing.join(", "),
                        numa_ids
                    ));
                }
                Some(listed)
            }
        };
        Ok(self.entry(self.pages, numa))
    }
}

/// Even split of `pages` over `ids`, the remainder to the lowest ids.
pub fn spread(pages: i64, ids: &[i32]) -> Vec<NumaTarget> {
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    let count = ids.len() as i64;
    ids.iter()
        .enumerate()
        .map(|(index, id)| NumaTarget {
            id: *id,
            pages: pages / count + i64::from((index as i64) < pages % count),
        })
        .collect()
}

/// Two entries ask the agent for the same thing (the pool generation they
/// were written at does not matter: rewriting it alone would move nothing).
fn same_target(a: &PageSizeTarget, b: &PageSizeTarget) -> bool {
    let normalise = |entry: &PageSizeTarget| PageSizeTarget {
        pool_generation: 0,
        ..entry.clone()
    };
    normalise(a) == normalise(b)
}

/// A global target the kernel already placed exactly as the NUMA split now
/// asks (the split became known after the write): rewriting it would move
/// no page, so it does not cost the node another pass through the rollout.
fn placed_as_desired(
    state: &HugePageNode,
    held: &PageSizeTarget,
    desired: &PageSizeTarget,
) -> bool {
    let Some(split) = &desired.numa else {
        return false;
    };
    let as_split = PageSizeTarget {
        numa: Some(split.clone()),
        ..held.clone()
    };
    if held.numa.is_some() || !same_target(&as_split, desired) {
        return false;
    }
    if entry_state(state, held) != EntryState::Converged {
        return false;
    }
    let Some(reported) = state
        .status
        .as_ref()
        .and_then(|s| s.page_sizes.iter().find(|r| r.size == held.size))
    else {
        return false;
    };
    let mut placed: Vec<(i32, i64)> = reported
        .numa
        .iter()
        .map(|n| (n.id, n.total - n.surplus))
        .collect();
    placed.sort_unstable();
    let wanted: Vec<(i32, i64)> = split.iter().map(|n| (n.id, n.pages)).collect();
    placed == wanted
}

/// The NUMA node ids the agent reports, preferring the entry of `size`.
fn reported_numa_ids(node_state: Option<&HugePageNode>, size: PageSize) -> Vec<i32> {
    let Some(status) = node_state.and_then(|n| n.status.as_ref()) else {
        return Vec::new();
    };
    let ids_of = |reported: &hugepool_crds::node::PageSizeStatus| {
        reported.numa.iter().map(|n| n.id).collect::<Vec<_>>()
    };
    let mut ids = status
        .page_sizes
        .iter()
        .find(|reported| reported.size == size && !reported.numa.is_empty())
        .or_else(|| status.page_sizes.iter().find(|r| !r.numa.is_empty()))
        .map(ids_of)
        .unwrap_or_default();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// What a pool wants of one (node, size).
#[derive(Clone, Debug)]
enum Want {
    /// The node is selected: reach this entry (or it cannot be targeted).
    Active(Result<PageSizeTarget, String>),
    /// The node is leaving a Release pool: shrink to 0, then drop the entry.
    Release(PageSizeTarget),
    /// The pool's spec is invalid: keep the entry it has, change nothing.
    Frozen,
}

/// What the owner decides for its entry on a node.
#[derive(Clone, Debug, PartialEq)]
enum Decision {
    /// Leave whatever entry is there.
    Keep,
    Write(PageSizeTarget),
    /// Released to 0: the entry goes.
    Remove,
}

struct Member {
    node: String,
    state: NodeState,
    decision: Decision,
    /// The entry admission writes; None when the node cannot be targeted.
    desired: Option<PageSizeTarget>,
    /// Pages the node reports for the size (`total`).
    current: i64,
    /// Pages of the size its pods request, once its agent reports them.
    requested: Option<i64>,
    /// Pages of the size mapped by processes.
    in_use: i64,
    stalled: bool,
    shrink_blocked: bool,
    /// ResourceClaims hold more of the size than pods have in use: what
    /// holds up a blocked shrink is claims (prepared, or allocated by the
    /// scheduler and not prepared yet).
    held_by_claims: bool,
    /// Converged, but the Node's capacity for the size is not the target.
    capacity_stale: bool,
    /// A pool taken through claims, converged, whose pages the node's
    /// kubelet advertises as `hugepages-<size>` (it restarted after they
    /// were grown): claims get only the rest.
    advertises_claim_pool: bool,
    /// Why the node does not answer (see [`unresponsive`]), if it does not.
    unresponsive: Option<String>,
    /// Silent for now: passed over from this time on unless it answers.
    silent_until: Option<Timestamp>,
}

type NodeStates<'a> = BTreeMap<&'a str, &'a HugePageNode>;

/// Computes the plan. Pure: the same input gives the same plan.
pub fn plan(input: &PlanInput<'_>) -> Plan {
    let now = Time(input.now);
    let mut rules: Vec<PoolRules<'_>> = input.pools.iter().map(PoolRules::read).collect();
    // Oldest first: creationTimestamp, then name; a pool not yet created is newest.
    rules.sort_by(|a, b| {
        let key = |r: &PoolRules<'_>| {
            let created = r.pool.metadata.creation_timestamp.clone();
            (created.is_none(), created, r.name.clone())
        };
        key(a).cmp(&key(b))
    });
    let nodes: BTreeMap<&str, &Node> = input
        .nodes
        .iter()
        .filter_map(|&n| n.metadata.name.as_deref().map(|name| (name, n)))
        .collect();
    let node_states: NodeStates<'_> = input
        .node_states
        .iter()
        .filter_map(|&n| n.metadata.name.as_deref().map(|name| (name, n)))
        .collect();

    let Ownership {
        owners,
        mut conflicts,
        shadowed,
    } = assign_owners(&rules, &nodes, &node_states);

    let mut members: BTreeMap<usize, Vec<Member>> = BTreeMap::new();
    let mut unresponsive_deadline: Option<Timestamp> = None;
    for ((node_name, size), (index, want)) in &owners {
        let pool = &rules[*index];
        let node = nodes.get(node_name).copied();
        let state = node_states.get(node_name).copied();
        let mut member = classify(pool, node_name, *size, want, state, node);
        if member.state != NodeState::Converged {
            match unresponsive(
                node,
                state,
                input.observed.unacknowledged.get(*node_name),
                pool.unresponsive_after(),
                input.now,
            ) {
                Answer::Answers => {}
                Answer::SilentSince(deadline) => {
                    member.silent_until = Some(deadline);
                    // Wake up when it would count as unresponsive.
                    unresponsive_deadline = Some(
                        unresponsive_deadline.map_or(deadline, |d: Timestamp| d.min(deadline)),
                    );
                }
                Answer::Unresponsive(why) => {
                    if matches!(member.decision, Decision::Write(_)) {
                        // Not written while it does not answer.
                        member.decision = Decision::Keep;
                    }
                    member.unresponsive = Some(why);
                }
            }
        }
        members.entry(*index).or_default().push(member);
    }

    let mut plan = Plan {
        next_deadline: unresponsive_deadline,
        ..Plan::default()
    };
    let mut decisions: BTreeMap<(&str, PageSize), Decision> = BTreeMap::new();
    for (index, pool) in rules.iter().enumerate() {
        let pool_members = members.remove(&index).unwrap_or_default();
        let pool_conflicts = conflicts.remove(&index).unwrap_or_default();
        // Its entries still in flight on nodes an older pool took over keep
        // their slots until that pool writes its own target there.
        let shadow_busy = shadowed
            .iter()
            .filter(|(node, size, wanting)| {
                *wanting == index
                    && node_states.get(node).is_some_and(|state| {
                        state.spec.page_sizes.iter().any(|e| {
                            e.pool == pool.name
                                && e.size == *size
                                && entry_state(state, e) != EntryState::Converged
                        })
                    })
            })
            .count();
        let (mut pool_plan, pool_decisions) =
            settle_pool(pool, pool_members, pool_conflicts, shadow_busy);
        // The pool goes only once no HugePageNode names it any more: the
        // pass that removes the last entries may not land them all (a write
        // that found the object changed is planned again), and an entry left
        // behind would outlive its pool. One whose Node is gone is not
        // waited for (the garbage collector takes it with its Node).
        pool_plan.remove_finalizer &= !node_states.iter().any(|(name, state)| {
            nodes.contains_key(name)
                && state
                    .spec
                    .page_sizes
                    .iter()
                    .any(|entry| entry.pool == pool.name)
        });
        for (node, decision) in pool_decisions {
            if let Some((&name, _)) = nodes.get_key_value(node.as_str()) {
                decisions.insert((name, pool.size), decision);
            }
        }
        plan.pools.insert(pool.name.clone(), pool_plan);
    }

    // Assemble every node's spec from its owners' decisions.
    let mut owned_sizes: BTreeMap<&str, Vec<PageSize>> = BTreeMap::new();
    for (node_name, size) in owners.keys() {
        owned_sizes.entry(node_name).or_default().push(*size);
    }
    for &node_name in nodes.keys() {
        let state = node_states.get(node_name).copied();
        let current: &[PageSizeTarget] = state.map_or(&[], |s| &s.spec.page_sizes);
        let mut sizes: BTreeSet<PageSize> = current.iter().map(|e| e.size).collect();
        sizes.extend(owned_sizes.get(node_name).into_iter().flatten().copied());
        let mut entries = Vec::new();
        for size in sizes {
            let existing = current.iter().find(|e| e.size == size);
            // An entry stays while its pool still wants it: as owner, or as
            // a loser the owner has not taken the size from yet. Entries
            // nobody wants (Retain, or the pool is gone) are dropped and the
            // kernel left alone.
            let wanted = existing.is_some_and(|entry| {
                rules
                    .iter()
                    .position(|r| r.name == entry.pool)
                    .is_some_and(|index| {
                        owners
                            .get(&(node_name, size))
                            .is_some_and(|(owner, _)| *owner == index)
                            || shadowed.contains(&(node_name, size, index))
                    })
            });
            match decisions.get(&(node_name, size)) {
                Some(Decision::Write(entry)) => entries.push(entry.clone()),
                Some(Decision::Remove) => {}
                _ if wanted => entries.extend(existing.cloned()),
                _ => {}
            }
        }
        entries.sort_by_key(|e| e.size);
        let spec = HugePageNodeSpec {
            page_sizes: entries,
        };
        let node = nodes.get(node_name).copied();
        let agent_runs = input
            .agent_nodes
            .zip(node)
            .is_some_and(|(selector, n)| selector.matches(n.labels()));
        if state.is_none()
            && spec.page_sizes.is_empty()
            && !owned_sizes.contains_key(node_name)
            && !agent_runs
        {
            // No pool wants this node: a not-ready taint it was registered
            // with has nothing to wait for.
            if node.is_some_and(|n| has_taint(n, hugepool_crds::NOT_READY_TAINT)) {
                plan.nodes
                    .insert(node_name.to_string(), NodePlan::default());
            }
            continue;
        }
        let spec_changed = state.is_none_or(|s| s.spec != spec);
        let owned = owned_sizes.get(node_name).map_or(&[][..], Vec::as_slice);
        let not_ready_taint = not_ready_taint(node, state, &spec, spec_changed, owned);
        let drain = plan_drain(node, state, &spec, &rules, input.now);
        if let Some(deadline) = drain.deadline {
            plan.next_deadline = Some(plan.next_deadline.map_or(deadline, |d| d.min(deadline)));
        }
        plan.nodes.insert(
            node_name.to_string(),
            NodePlan {
                spec,
                spec_changed,
                drain,
                not_ready_taint,
            },
        );
    }

    for pool in &rules {
        let Some(pool_plan) = plan.pools.get_mut(&pool.name) else {
            continue;
        };
        pool_plan.draining = plan
            .nodes
            .iter()
            .filter(|(_, n)| n.drain.taint && n.drain.pools.contains(&pool.name))
            .map(|(name, _)| name.clone())
            .collect();
        pool_plan.tainted = pool_plan
            .members
            .iter()
            .filter(|m| {
                nodes
                    .get(m.node.as_str())
                    .is_some_and(|n| has_taint(n, hugepool_crds::DRAINING_TAINT))
            })
            .map(|m| m.node.clone())
            .collect();
        pool_plan.write_errors = pool_plan
            .members
            .iter()
            .filter_map(|m| {
                let error = input.observed.write_errors.get(&m.node)?;
                Some((m.node.clone(), error.clone()))
            })
            .collect();
        let mut conditions = pool
            .pool
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        for update in pool_conditions(pool, pool_plan) {
            set_condition(&mut conditions, update, &now);
        }
        pool_plan.status.conditions = conditions;
    }
    plan
}

struct Ownership<'a> {
    /// For every (node, size) the oldest pool that wants it.
    owners: BTreeMap<(&'a str, PageSize), (usize, Want)>,
    /// Per losing pool, the nodes it selects but does not get, with the owner.
    conflicts: BTreeMap<usize, Vec<(String, String)>>,
    /// (node, size, pool) a pool wants but an older pool owns.
    shadowed: BTreeSet<(&'a str, PageSize, usize)>,
}

fn assign_owners<'a>(
    rules: &[PoolRules<'_>],
    nodes: &BTreeMap<&'a str, &Node>,
    node_states: &NodeStates<'_>,
) -> Ownership<'a> {
    let mut owners: BTreeMap<(&'a str, PageSize), (usize, Want)> = BTreeMap::new();
    let mut conflicts: BTreeMap<usize, Vec<(String, String)>> = BTreeMap::new();
    let mut shadowed = BTreeSet::new();
    for (&node_name, &node) in nodes {
        let state = node_states.get(node_name).copied();
        let entries: &[PageSizeTarget] = state.map_or(&[], |s| &s.spec.page_sizes);
        for (index, pool) in rules.iter().enumerate() {
            let held = entries
                .iter()
                .any(|e| e.pool == pool.name && e.size == pool.size);
            let selected = pool.invalid.is_none() && !pool.deleting && pool.selects(node);
            let want = if selected {
                let ids = reported_numa_ids(state, pool.size);
                Want::Active(pool.desired_entry(&ids))
            } else if !held {
                continue;
            } else if pool.invalid.is_some() && !pool.deleting {
                Want::Frozen
            } else if pool.release() {
                Want::Release(pool.entry(0, None))
            } else {
                continue;
            };
            let key = (node_name, pool.size);
            if let Some((owner, _)) = owners.get(&key) {
                shadowed.insert((node_name, pool.size, index));
                if selected {
                    let owner = rules[*owner].name.clone();
                    conflicts
                        .entry(index)
                        .or_default()
                        .push((node_name.to_string(), owner));
                }
                continue;
            }
            owners.insert(key, (index, want));
        }
    }
    Ownership {
        owners,
        conflicts,
        shadowed,
    }
}

/// Where one owned (node, size) stands for its pool before admission.
fn classify(
    pool: &PoolRules<'_>,
    node_name: &str,
    size: PageSize,
    want: &Want,
    state: Option<&HugePageNode>,
    node: Option<&Node>,
) -> Member {
    let held = state.and_then(|s| {
        s.spec
            .page_sizes
            .iter()
            .find(|e| e.pool == pool.name && e.size == size)
    });
    let held_state = match (state, held) {
        (Some(state), Some(entry)) => Some(entry_state(state, entry)),
        _ => None,
    };
    let status = state.and_then(|s| s.status.as_ref());
    let reported = status.and_then(|s| s.page_sizes.iter().find(|r| r.size == size));
    let mut member = Member {
        node: node_name.to_string(),
        state: match &held_state {
            Some(EntryState::Converged) => NodeState::Converged,
            Some(EntryState::InFlight) => NodeState::Updating,
            Some(EntryState::Failed { reason, message }) => NodeState::Failed {
                reason: reason.clone(),
                message: message.clone(),
            },
            None => NodeState::Pending,
        },
        decision: Decision::Keep,
        desired: None,
        current: reported.map_or(0, |r| r.total),
        requested: reported.and_then(|r| r.requested),
        in_use: reported.map_or(0, |r| r.in_use),
        stalled: status.is_some_and(|s| is_true(&s.conditions, NodeConditionType::Stalled)),
        shrink_blocked: match (state, held) {
            (Some(state), Some(entry)) => shrink_blocked(state, entry),
            _ => false,
        },
        held_by_claims: reported
            .is_some_and(|r| r.claimed.unwrap_or(0) > r.in_use.max(0) + r.reserved.max(0)),
        capacity_stale: false,
        advertises_claim_pool: false,
        unresponsive: None,
        silent_until: None,
    };
    let desired = match want {
        Want::Frozen => {
            member.desired = held.cloned();
            return member;
        }
        Want::Active(Err(message)) => {
            member.state = NodeState::Failed {
                reason: Reason::InvalidSpec.to_string(),
                message: message.clone(),
            };
            return member;
        }
        Want::Active(Ok(entry)) | Want::Release(entry) => entry,
    };
    member.desired = Some(desired.clone());
    if matches!(want, Want::Active(_)) && member.state == NodeState::Converged {
        // Pods claim a DRA pool's pages from the agent's ResourceSlice; the
        // kubelet is not meant to advertise them.
        member.capacity_stale =
            !desired.by_claims() && kubelet_capacity_stale(node, pool.size, desired.pages);
        member.advertises_claim_pool = desired.by_claims()
            && node
                .and_then(hugepool_crds::kubelet::hugepage_capacity)
                .is_some_and(|capacity| capacity.get(&pool.size).copied().unwrap_or(0) > 0);
    }
    if matches!(want, Want::Release(_))
        && held.is_some_and(|e| e.pages == 0)
        && held_state == Some(EntryState::Converged)
    {
        // Released: the node leaves the pool with its pages at 0.
        member.decision = Decision::Remove;
        return member;
    }
    let up_to_date = held.is_some_and(|e| {
        same_target(e, desired) || state.is_some_and(|s| placed_as_desired(s, e, desired))
    });
    let in_flight = matches!(
        held_state,
        Some(EntryState::InFlight | EntryState::Failed { .. })
    );
    if up_to_date {
        return member;
    }
    if in_flight {
        if !pool.pool.spec.rollout.paused {
            // Already changing: a new target keeps the slot it holds.
            member.state = NodeState::Updating;
            member.decision = Decision::Write(desired.clone());
        }
        return member;
    }
    member.state = NodeState::Pending;
    member
}

/// Admits pending nodes (by name) while fewer than `maxUnavailable` are
/// changing, and counts the pool's status.
fn settle_pool(
    pool: &PoolRules<'_>,
    mut members: Vec<Member>,
    conflicts: Vec<(String, String)>,
    shadow_busy: usize,
) -> (PoolPlan, Vec<(String, Decision)>) {
    members.sort_by(|a, b| a.node.cmp(&b.node));
    let managed = members
        .iter()
        .filter(|m| m.decision != Decision::Remove)
        .count();
    let max_unavailable = hugepool_crds::quantity::resolve_max_unavailable(
        &pool.pool.spec.rollout.max_unavailable,
        managed,
    )
    .unwrap_or(1);
    // A node that does not answer holds no slot (it gives back one it had).
    let mut busy = shadow_busy
        + members
            .iter()
            .filter(|m| m.unresponsive.is_none())
            .filter(|m| matches!(m.state, NodeState::Updating | NodeState::Failed { .. }))
            .count();
    let paused = pool.pool.spec.rollout.paused;
    let mut admitted = Vec::new();
    for member in &mut members {
        if member.state == NodeState::Pending
            && member.unresponsive.is_none()
            && !paused
            && busy < max_unavailable
            && let Some(desired) = &member.desired
        {
            busy += 1;
            member.state = NodeState::Updating;
            member.decision = Decision::Write(desired.clone());
        }
        if let Decision::Write(_) = member.decision {
            admitted.push(member.node.clone());
        }
    }
    let decisions = members
        .iter()
        .map(|m| (m.node.clone(), m.decision.clone()))
        .collect();

    let active: Vec<&Member> = members
        .iter()
        .filter(|m| m.decision != Decision::Remove)
        .collect();
    let count = |f: fn(&NodeState) -> bool| {
        active
            .iter()
            .filter(|m| m.unresponsive.is_none() && f(&m.state))
            .count() as i64
    };
    let unresponsive: Vec<(String, String)> = active
        .iter()
        .filter_map(|m| Some((m.node.clone(), m.unresponsive.clone()?)))
        .collect();
    let selected = (active.len() + conflicts.len()) as i64;
    let converged = count(|s| *s == NodeState::Converged);
    let nodes = PoolNodeCounts {
        selected,
        converged,
        updating: count(|s| *s == NodeState::Updating),
        pending: count(|s| *s == NodeState::Pending) + conflicts.len() as i64,
        failed: count(|s| matches!(s, NodeState::Failed { .. })),
        unresponsive: unresponsive.len() as i64,
        ready: format!("{converged}/{selected}"),
    };
    let failed_nodes = active
        .iter()
        .filter(|m| m.unresponsive.is_none())
        .filter_map(|m| match &m.state {
            NodeState::Failed { reason, message } => Some(FailedNode {
                name: m.node.clone(),
                reason: reason.clone(),
                message: hugepool_crds::conditions::bounded_message(message.clone()),
            }),
            _ => None,
        })
        .take(MAX_FAILED_NODES)
        .collect();
    let pages = PoolPages {
        target: active
            .iter()
            .filter_map(|m| m.desired.as_ref().map(|d| d.pages))
            .sum(),
        current: active.iter().map(|m| m.current).sum(),
        requested: active.iter().filter_map(|m| m.requested).sum(),
        in_use: active.iter().map(|m| m.in_use).sum(),
        // Per node: pods that request more than one node holds do not make
        // up for pages nobody asked for on another.
        unrequested: active
            .iter()
            .filter_map(|m| Some((m.current - m.requested?).max(0)))
            .sum(),
    };
    let names = |f: &dyn Fn(&Member) -> bool| -> Vec<String> {
        active
            .iter()
            .filter(|m| f(m))
            .map(|m| m.node.clone())
            .collect()
    };
    let stalled = names(&|m| m.stalled);
    let capacity_stale = names(&|m| m.capacity_stale && m.state == NodeState::Converged);
    let advertising_claim_pool =
        names(&|m| m.advertises_claim_pool && m.state == NodeState::Converged);
    let drain_timeouts = names(
        &|m| matches!(&m.state, NodeState::Failed { reason, .. } if reason == Reason::DrainTimeout.as_str()),
    );
    let blocked = if pool.drain_policy() == DrainPolicy::Never {
        names(&|m| m.shrink_blocked && m.state == NodeState::Updating && !m.held_by_claims)
    } else {
        Vec::new()
    };
    let held_by_claims =
        names(&|m| m.shrink_blocked && m.state == NodeState::Updating && m.held_by_claims);
    let status = HugePagePoolStatus {
        observed_generation: Some(pool.generation),
        pages_per_node: pool.invalid.is_none().then_some(pool.pages),
        nodes,
        pages,
        failed_nodes,
        // The controller appends what its drains evict; the planner keeps it.
        evicted_pods: pool
            .pool
            .status
            .as_ref()
            .map(|s| s.evicted_pods.clone())
            .unwrap_or_default(),
        conditions: Vec::new(),
    };
    let pool_plan = PoolPlan {
        status,
        page_size: Some(pool.size),
        remove_finalizer: pool.deleting && active.is_empty(),
        max_unavailable,
        admitted,
        conflicts,
        blocked,
        held_by_claims,
        stalled,
        capacity_stale,
        advertising_claim_pool,
        draining: Vec::new(),
        tainted: Vec::new(),
        drain_timeouts,
        write_errors: Vec::new(),
        unresponsive,
        silent: active
            .iter()
            .filter(|m| matches!(m.state, NodeState::Updating | NodeState::Failed { .. }))
            .filter_map(|m| Some((m.node.clone(), m.silent_until?)))
            .collect(),
        members: active
            .iter()
            .map(|m| PoolMember {
                node: m.node.clone(),
                state: m.state.clone(),
                current: m.current,
                requested: m.requested,
                in_use: m.in_use,
                target: m.desired.as_ref().map(|d| d.pages),
                stalled: m.stalled,
                shrink_blocked: m.shrink_blocked,
            })
            .collect(),
    };
    (pool_plan, decisions)
}

/// Whether the Node carries the taint `key` (any value, any effect).
pub(crate) fn has_taint(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
}

/// Whether ordinary pods must be kept off the node: its agent says its
/// pools were short when it started (`Restoring`: a reboot, a new node), or
/// the node has the taint (the operator's, or the kubelet's
/// `--register-with-taints`) and is not ready yet. Ready: every size a pool
/// owns on it has its entry written, the agent has seen that spec and
/// reached each entry, and the kubelet reports each pool.
fn not_ready_taint(
    node: Option<&Node>,
    state: Option<&HugePageNode>,
    spec: &HugePageNodeSpec,
    spec_changed: bool,
    owned: &[PageSize],
) -> bool {
    let restoring = state
        .and_then(|s| s.status.as_ref())
        .is_some_and(|s| is_true(&s.conditions, NodeConditionType::Restoring));
    if restoring {
        return true;
    }
    let Some(node) = node.filter(|n| has_taint(n, hugepool_crds::NOT_READY_TAINT)) else {
        return false;
    };
    let ready = state.is_some_and(|state| {
        !spec_changed
            && owned
                .iter()
                .all(|size| spec.page_sizes.iter().any(|e| e.size == *size))
            && spec.page_sizes.iter().all(|entry| {
                entry_state(state, entry) == EntryState::Converged
                    && !kubelet_capacity_stale(Some(node), entry.size, entry.pages)
            })
    });
    !ready
}

/// Whether the Node's kubelet misreports `pages` of `size`, by the rule the
/// agent restarts kubelets by (`hugepool_crds::kubelet::capacity_stale`).
fn kubelet_capacity_stale(node: Option<&Node>, size: PageSize, pages: i64) -> bool {
    node.and_then(hugepool_crds::kubelet::hugepage_capacity)
        .is_some_and(|capacity| {
            hugepool_crds::kubelet::capacity_stale(
                &capacity,
                size,
                u64::try_from(pages).unwrap_or(0),
            )
        })
}

mod answers;
mod conditions;
mod drains;
mod types;

use answers::unresponsive;
pub use answers::{Answer, Observed, spec_written_at};
use conditions::pool_conditions;
pub use drains::pages_to_free;
use drains::{plan_drain, shrink_blocked};
pub use types::*;

#[cfg(test)]
mod tests;
