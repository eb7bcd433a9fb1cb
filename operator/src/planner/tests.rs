use std::collections::{BTreeMap, BTreeSet};

use hugepool_crds::conditions::{find_condition, set_condition};
use hugepool_crds::node::{NumaStatus, PageSizeStatus};
use hugepool_crds::pool::NumaSpec;
use hugepool_crds::settings::{
    DeletionPolicy, DrainPolicy, KubeletRestart, NumaPolicy, NumaTarget,
};
use hugepool_crds::{
    ConditionUpdate, HugePageNode, HugePagePool, NodeConditionType, PoolConditionType, Reason,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use proptest::prelude::*;

use super::*;
use crate::fixtures::*;

fn condition<'a>(plan: &'a Plan, pool: &str, type_: PoolConditionType) -> (&'a str, &'a str) {
    let condition = find_condition(&plan.pools[pool].status.conditions, type_)
        .unwrap_or_else(|| panic!("{pool} has no {type_} condition"));
    (condition.status.as_str(), condition.reason.as_str())
}

fn target_of(plan: &Plan, node: &str, size: &str) -> Option<i64> {
    let size: PageSize = size.parse().expect("a page size");
    plan.nodes[node]
        .spec
        .page_sizes
        .iter()
        .find(|e| e.size == size)
        .map(|e| e.pages)
}

/// Runs plan -> write specs -> agents converge (except `stuck`) until
/// nothing changes; returns the last plan and the number of passes.
fn run_to_end(
    pools: &mut Vec<HugePagePool>,
    nodes: &[Node],
    hpns: &mut Vec<HugePageNode>,
    stuck: &BTreeSet<String>,
) -> (Plan, usize) {
    for pass in 0..200 {
        let plan = run_plan(pools, nodes, hpns, pass as i64);
        apply_specs(&plan, hpns);
        apply_statuses(&plan, pools);
        for hpn in hpns.iter_mut() {
            if !stuck.contains(hpn.metadata.name.as_deref().unwrap_or_default()) {
                converge(hpn);
            }
        }
        if plan.spec_writes().next().is_none() && plan.pools.values().all(|p| !p.remove_finalizer) {
            return (plan, pass);
        }
    }
    panic!("rollout did not finish in 200 passes");
}

#[test]
fn grow_admits_at_most_max_unavailable_nodes_in_name_order() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(2),
    )];
    let nodes = fleet(5, &["dpdk"]);
    let plan = run_plan(&pools, &nodes, &[], 0);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-00", "w-01"]);
    assert_eq!(target_of(&plan, "w-00", "2Mi"), Some(64));
    assert_eq!(target_of(&plan, "w-02", "2Mi"), None);
    // Every selected node gets its HugePageNode, so its agent can report.
    assert_eq!(plan.spec_writes().count(), 5);
    let counts = &plan.pools["dpdk"].status.nodes;
    assert_eq!(
        (counts.selected, counts.updating, counts.pending),
        (5, 2, 3)
    );
    assert_eq!(counts.ready, "0/5");
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Progressing),
        ("True", "MaxUnavailableReached")
    );
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("False", "NodesNotConverged")
    );
}

#[test]
fn a_node_keeps_its_slot_until_it_reports_converged_for_its_target() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let nodes = fleet(2, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    // The agent saw the generation but is not at target yet.
    status_of(&mut hpns[0]).observed_generation = Some(1);
    status_of(&mut hpns[0]).page_sizes = vec![PageSizeStatus {
        size: PageSize::SIZE_2MI,
        target: Some(64),
        total: 40,
        ..PageSizeStatus::empty(PageSize::SIZE_2MI)
    }];
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert!(plan.pools["dpdk"].admitted.is_empty());
    assert_eq!(plan.spec_writes().count(), 0);
    converge(&mut hpns[0]);
    let plan = run_plan(&pools, &nodes, &hpns, 2);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-01"]);
}

#[test]
fn failures_reaching_max_unavailable_halt_the_rollout_and_name_the_nodes() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(2),
    )];
    let nodes = fleet(4, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    fail_allocation(&mut hpns[0]);
    fail_allocation(&mut hpns[1]);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    let pool_plan = &plan.pools["dpdk"];
    assert!(pool_plan.admitted.is_empty());
    assert_eq!(plan.spec_writes().count(), 0);
    assert_eq!(pool_plan.status.nodes.failed, 2);
    let failed: Vec<&str> = pool_plan
        .status
        .failed_nodes
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(failed, ["w-00", "w-01"]);
    assert_eq!(pool_plan.status.failed_nodes[0].reason, "AllocationFailed");
    assert!(
        pool_plan.status.failed_nodes[0]
            .message
            .contains("Fragmented")
    );
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "RolloutHalted")
    );
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Progressing),
        ("False", "RolloutHalted")
    );
}

#[test]
fn one_failure_below_the_limit_degrades_but_the_rollout_goes_on() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(2),
    )];
    let nodes = fleet(4, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    fail_allocation(&mut hpns[0]);
    converge(&mut hpns[1]);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-02"]);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "AllocationFailed")
    );
}

/// What an agent reports for a target this machine cannot have.
fn invalid_target(hpn: &mut HugePageNode) {
    report(
        hpn,
        ConditionUpdate::new(
            NodeConditionType::Converged,
            false,
            Reason::InvalidTarget,
            "2Mi: NUMA node 3 not on this machine (it has 0)",
        ),
    );
}

#[test]
fn degraded_names_the_nodes_own_reason_and_a_mix_as_nodes_failed() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(3),
    )];
    let nodes = fleet(4, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    invalid_target(&mut hpns[0]);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "InvalidTarget")
    );
    fail_allocation(&mut hpns[1]);
    let plan = run_plan(&pools, &nodes, &hpns, 2);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "NodesFailed")
    );
    let degraded = degraded_message(&plan, "dpdk");
    assert!(
        degraded.contains("w-00 (InvalidTarget") && degraded.contains("w-01 (AllocationFailed"),
        "{degraded}"
    );
}

#[test]
fn a_failed_kubelet_restart_holds_its_slot_and_halts_further_restarts() {
    let mut restarting = pool("dpdk", 0, "dpdk", "2Mi", 64);
    restarting.spec.kubelet.restart = hugepool_crds::settings::KubeletRestart::AfterResize;
    let pools = vec![with_max_unavailable(restarting, IntOrString::Int(1))];
    let nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    // The kernel reached the target, but the kubelet did not come back.
    converge(&mut hpns[0]);
    report(
        &mut hpns[0],
        ConditionUpdate::new(
            NodeConditionType::KubeletCapacityStale,
            true,
            Reason::KubeletRestartFailed,
            "the kubelet did not report 64 x 2Mi within 2m of its restart",
        ),
    );
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    let pool_plan = &plan.pools["dpdk"];
    assert!(pool_plan.admitted.is_empty(), "{:?}", pool_plan.admitted);
    assert_eq!(pool_plan.status.nodes.failed, 1);
    assert_eq!(
        pool_plan.status.failed_nodes[0].reason,
        "KubeletRestartFailed"
    );
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "RolloutHalted")
    );
    // Once it reports the pool, the rollout goes on.
    converge(&mut hpns[0]);
    report(
        &mut hpns[0],
        ConditionUpdate::new(
            NodeConditionType::KubeletCapacityStale,
            false,
            Reason::CapacityMatches,
            "kubelet capacity matches the pools",
        ),
    );
    let plan = run_plan(&pools, &nodes, &hpns, 2);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-01"]);
}

#[test]
fn older_pool_wins_a_conflict_and_the_newer_touches_nothing() {
    let pools = vec![
        pool("newer", 10, "b", "2Mi", 32),
        pool("older", 5, "a", "2Mi", 64),
    ];
    let nodes = vec![node("w-1", &["a", "b"]), node("w-2", &["b"])];
    let plan = run_plan(&pools, &nodes, &[], 0);
    let entry = &plan.nodes["w-1"].spec.page_sizes[0];
    assert_eq!((entry.pool.as_str(), entry.pages), ("older", 64));
    assert_eq!(target_of(&plan, "w-2", "2Mi"), Some(32));
    assert_eq!(
        plan.pools["newer"].conflicts,
        [("w-1".to_string(), "older".to_string())]
    );
    let degraded = find_condition(
        &plan.pools["newer"].status.conditions,
        PoolConditionType::Degraded,
    )
    .unwrap();
    assert_eq!(degraded.reason, "Conflict");
    assert!(degraded.message.contains("w-1"), "{}", degraded.message);
    assert!(degraded.message.contains("older"), "{}", degraded.message);
    assert_eq!(
        condition(&plan, "older", PoolConditionType::Degraded),
        ("False", "AsExpected")
    );
}

#[test]
fn same_creation_time_breaks_the_tie_by_name() {
    let pools = vec![
        pool("b-pool", 0, "x", "2Mi", 2),
        pool("a-pool", 0, "x", "2Mi", 1),
    ];
    let plan = run_plan(&pools, &[node("w", &["x"])], &[], 0);
    assert_eq!(plan.nodes["w"].spec.page_sizes[0].pool, "a-pool");
}

#[test]
fn pools_of_different_sizes_share_a_node() {
    let pools = vec![
        pool("small", 0, "x", "2Mi", 8),
        pool("big", 1, "x", "1Gi", 2),
    ];
    let plan = run_plan(&pools, &[node("w", &["x"])], &[], 0);
    let sizes: Vec<PageSize> = plan.nodes["w"]
        .spec
        .page_sizes
        .iter()
        .map(|e| e.size)
        .collect();
    assert_eq!(sizes, [PageSize::SIZE_2MI, PageSize::SIZE_1GI]);
    assert!(plan.pools["big"].conflicts.is_empty());
}

#[test]
fn paused_pool_admits_no_new_nodes_but_keeps_changing_ones() {
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    pools[0].spec.rollout.paused = true;
    pools[0].spec.pages = Some(128);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert_eq!(
        plan.spec_writes().count(),
        0,
        "paused: the in-flight target stays"
    );
    converge(&mut hpns[0]);
    let plan = run_plan(&pools, &nodes, &hpns, 2);
    assert!(plan.pools["dpdk"].admitted.is_empty());
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Progressing),
        ("False", "Paused")
    );
}

#[test]
fn a_new_target_moves_an_in_flight_node_without_taking_another_slot() {
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    pools[0].spec.pages = Some(128);
    pools[0].metadata.generation = Some(2);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-00"]);
    assert_eq!(target_of(&plan, "w-00", "2Mi"), Some(128));
    assert_eq!(plan.nodes["w-00"].spec.page_sizes[0].pool_generation, 2);
    assert_eq!(target_of(&plan, "w-01", "2Mi"), None);
}

#[test]
fn rollout_runs_to_the_end_and_the_pool_becomes_available() {
    let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let nodes = fleet(9, &["dpdk"]);
    let mut hpns = Vec::new();
    let (plan, passes) = run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    assert!(passes >= 3, "25% of 9 is 3 nodes at a time");
    assert!(hpns.iter().all(|h| h.spec.page_sizes[0].pages == 64));
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("True", "AllNodesConverged")
    );
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Progressing),
        ("False", "RolloutComplete")
    );
    let status = &plan.pools["dpdk"].status;
    assert_eq!(status.nodes.ready, "9/9");
    assert_eq!(status.pages.target, 9 * 64);
    assert_eq!(status.pages.current, 9 * 64);
    assert_eq!(status.observed_generation, Some(1));
}

#[test]
fn an_unchanged_fleet_plans_no_writes_and_keeps_transition_times() {
    let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    let (plan, _) = run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    let later = run_plan(&pools, &nodes, &hpns, 10_000);
    assert_eq!(later.spec_writes().count(), 0);
    assert_eq!(later.pools["dpdk"].status, plan.pools["dpdk"].status);
}

#[test]
fn a_settings_change_on_converged_nodes_rolls_out_like_a_target_change() {
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    pools[0].spec.allocation.retries = 7;
    pools[0].metadata.generation = Some(2);
    let plan = run_plan(&pools, &nodes, &hpns, 100);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-00"]);
    // A generation bump alone (say, maxUnavailable) rewrites nothing.
    let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let mut hpns = Vec::new();
    run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    pools[0].spec.rollout.max_unavailable = IntOrString::Int(3);
    pools[0].metadata.generation = Some(2);
    assert_eq!(
        run_plan(&pools, &nodes, &hpns, 100).spec_writes().count(),
        0
    );
}

#[test]
fn spread_splits_evenly_with_the_remainder_to_the_lowest_ids() {
    let split = spread(10, &[3, 0, 1]);
    let pages: Vec<(i32, i64)> = split.iter().map(|n| (n.id, n.pages)).collect();
    assert_eq!(pages, [(0, 4), (1, 3), (3, 3)]);
}

#[test]
fn spread_targets_numa_nodes_once_the_agent_reported_them() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 5),
        IntOrString::Int(2),
    )];
    let nodes = vec![node("w-1", &["dpdk"]), node("w-2", &["dpdk"])];
    let mut reported = hpn("w-1", 1, vec![]);
    status_of(&mut reported).page_sizes = vec![PageSizeStatus {
        size: PageSize::SIZE_2MI,
        numa: vec![
            NumaStatus {
                id: 0,
                ..NumaStatus::default()
            },
            NumaStatus {
                id: 1,
                ..NumaStatus::default()
            },
        ],
        ..PageSizeStatus::empty(PageSize::SIZE_2MI)
    }];
    let plan = run_plan(&pools, &nodes, &[reported], 0);
    let numa = plan.nodes["w-1"].spec.page_sizes[0].numa.clone().unwrap();
    assert_eq!(
        numa,
        [
            NumaTarget { id: 0, pages: 3 },
            NumaTarget { id: 1, pages: 2 }
        ]
    );
    // Not reported yet: one global target, the kernel places the pages.
    assert_eq!(plan.nodes["w-2"].spec.page_sizes[0].numa, None);
}

#[test]
fn a_global_target_the_kernel_already_spread_evenly_is_not_rolled_again() {
    let pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 4)];
    let nodes = vec![node("w-1", &["dpdk"])];
    let mut states = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &states, 0), &mut states);
    assert_eq!(states[0].spec.page_sizes[0].numa, None);
    converge(&mut states[0]);
    let numa = |totals: [i64; 2]| {
        totals
            .iter()
            .enumerate()
            .map(|(id, total)| NumaStatus {
                id: id as i32,
                total: *total,
                ..NumaStatus::default()
            })
            .collect::<Vec<_>>()
    };
    status_of(&mut states[0]).page_sizes[0].numa = numa([2, 2]);
    assert_eq!(
        run_plan(&pools, &nodes, &states, 1).spec_writes().count(),
        0
    );
    // Placed unevenly: the split is written and the node changes again.
    status_of(&mut states[0]).page_sizes[0].numa = numa([3, 1]);
    let plan = run_plan(&pools, &nodes, &states, 2);
    let split = plan.nodes["w-1"].spec.page_sizes[0].numa.clone().unwrap();
    assert_eq!(
        split,
        [
            NumaTarget { id: 0, pages: 2 },
            NumaTarget { id: 1, pages: 2 }
        ]
    );
}

#[test]
fn explicit_numa_node_the_node_lacks_fails_that_node_only() {
    let mut explicit = pool("dpdk", 0, "dpdk", "2Mi", 4);
    explicit.spec.numa = Some(NumaSpec {
        policy: NumaPolicy::Explicit,
        nodes: Some(vec![
            NumaTarget { id: 0, pages: 1 },
            NumaTarget { id: 1, pages: 3 },
        ]),
    });
    let mut single = hpn("w-1", 1, vec![]);
    status_of(&mut single).page_sizes = vec![PageSizeStatus {
        size: PageSize::SIZE_2MI,
        numa: vec![NumaStatus::default()],
        ..PageSizeStatus::empty(PageSize::SIZE_2MI)
    }];
    let nodes = vec![node("w-1", &["dpdk"]), node("w-2", &["dpdk"])];
    let explicit = with_max_unavailable(explicit, IntOrString::Int(2));
    let plan = run_plan(&[explicit], &nodes, &[single], 0);
    assert_eq!(target_of(&plan, "w-1", "2Mi"), None);
    assert_eq!(target_of(&plan, "w-2", "2Mi"), Some(4));
    let failed = &plan.pools["dpdk"].status.failed_nodes;
    assert_eq!(failed.len(), 1);
    assert_eq!(
        (failed[0].name.as_str(), failed[0].reason.as_str()),
        ("w-1", "InvalidSpec")
    );
}

#[test]
fn memory_pool_targets_memory_divided_by_page_size() {
    let mut by_memory = pool("db", 0, "db", "1Gi", 0);
    by_memory.spec.pages = None;
    by_memory.spec.memory = Some("8Gi".into());
    let by_pages = pool("dpdk", 0, "dpdk", "2Mi", 64);
    let plan = run_plan(
        &[by_memory, by_pages],
        &[node("w", &["db", "dpdk"])],
        &[],
        0,
    );
    assert_eq!(target_of(&plan, "w", "1Gi"), Some(8));
    // `kubectl get hpp` shows these as PAGES.
    assert_eq!(plan.pools["db"].status.pages_per_node, Some(8));
    assert_eq!(plan.pools["dpdk"].status.pages_per_node, Some(64));
}

#[test]
fn what_the_schema_cannot_reject_becomes_invalid_spec_and_touches_nothing() {
    let mut bad = pool("bad", 0, "x", "2Mi", 0);
    bad.spec.pages = None;
    bad.spec.memory = Some("3Mi".into());
    let held = hpn(
        "w",
        2,
        vec![pool("bad", 0, "x", "2Mi", 4).entry_for_test(4)],
    );
    let plan = run_plan(&[bad], &[node("w", &["x"])], std::slice::from_ref(&held), 0);
    assert_eq!(plan.spec_writes().count(), 0);
    assert_eq!(plan.nodes["w"].spec, held.spec);
    let (status, reason) = condition(&plan, "bad", PoolConditionType::Degraded);
    assert_eq!((status, reason), ("True", "InvalidSpec"));
    assert_eq!(plan.pools["bad"].status.pages_per_node, None);
    let message = &find_condition(
        &plan.pools["bad"].status.conditions,
        PoolConditionType::Degraded,
    )
    .unwrap()
    .message;
    assert!(message.contains("not a multiple of 2Mi"), "{message}");
}

#[test]
fn no_matching_nodes_is_reported() {
    let plan = run_plan(
        &[pool("lonely", 0, "none", "2Mi", 1)],
        &fleet(2, &["x"]),
        &[],
        0,
    );
    assert_eq!(
        condition(&plan, "lonely", PoolConditionType::Degraded),
        ("True", "NoMatchingNodes")
    );
    assert_eq!(
        condition(&plan, "lonely", PoolConditionType::Available),
        ("False", "NoMatchingNodes")
    );
    // Nothing to roll out is not a rollout complete.
    assert_eq!(
        condition(&plan, "lonely", PoolConditionType::Progressing),
        ("False", "NoMatchingNodes")
    );
}

#[test]
fn every_node_an_agent_runs_on_gets_a_node_state_before_any_pool() {
    let nodes = vec![node("w-00", &["agent"]), node("w-01", &[])];
    let agents: Selector = [("agent".to_string(), "true".to_string())]
        .into_iter()
        .collect();
    let refs: Vec<&Node> = nodes.iter().collect();
    let with = plan(&PlanInput {
        pools: &[],
        nodes: &refs,
        node_states: &[],
        observed: &Observed::default(),
        now: at(0),
        agent_nodes: Some(&agents),
    });
    // w-00 runs an agent: an empty HugePageNode is written for it.
    let made = &with.nodes["w-00"];
    assert!(
        made.spec_changed && made.spec.page_sizes.is_empty(),
        "{made:?}"
    );
    assert!(!with.nodes.contains_key("w-01"));
    // Without the selector only the nodes pools select have one.
    let without = run_plan(&[], &nodes, &[], 0);
    assert!(without.nodes.is_empty(), "{:?}", without.nodes);
    // Once it exists nothing more is written for it.
    let mut states = Vec::new();
    apply_specs(&with, &mut states);
    let state_refs: Vec<&HugePageNode> = states.iter().collect();
    let again = plan(&PlanInput {
        pools: &[],
        nodes: &refs,
        node_states: &state_refs,
        observed: &Observed::default(),
        now: at(1),
        agent_nodes: Some(&agents),
    });
    assert!(!again.nodes["w-00"].spec_changed);
}

#[test]
fn a_rollout_that_ends_with_a_failed_node_is_incomplete_not_complete() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(3),
    )];
    let nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    let first = run_plan(&pools, &nodes, &hpns, 0);
    apply_specs(&first, &mut hpns);
    // Two converge; one fails (below maxUnavailable: nothing halts).
    converge(&mut hpns[0]);
    converge(&mut hpns[1]);
    fail_allocation(&mut hpns[2]);
    let ended = run_plan(&pools, &nodes, &hpns, 10);
    assert_eq!(
        condition(&ended, "dpdk", PoolConditionType::Progressing),
        ("False", "RolloutIncomplete")
    );
    let progressing = find_condition(
        &ended.pools["dpdk"].status.conditions,
        PoolConditionType::Progressing,
    )
    .unwrap()
    .message
    .clone();
    assert!(progressing.contains("1 failed"), "{progressing}");
    assert_eq!(
        condition(&ended, "dpdk", PoolConditionType::Degraded),
        ("True", "AllocationFailed")
    );
}

#[test]
fn relabelled_node_leaves_a_retain_pool_at_once_and_a_release_pool_at_zero() {
    for policy in [DeletionPolicy::Retain, DeletionPolicy::Release] {
        let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
        pools[0].spec.deletion_policy = policy;
        let mut nodes = fleet(2, &["dpdk"]);
        let mut hpns = Vec::new();
        run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
        nodes[1] = node("w-01", &[]);
        let plan = run_plan(&pools, &nodes, &hpns, 100);
        match policy {
            DeletionPolicy::Retain => {
                assert!(plan.nodes["w-01"].spec.page_sizes.is_empty());
                assert_eq!(plan.pools["dpdk"].status.nodes.selected, 1);
            }
            DeletionPolicy::Release => {
                assert_eq!(target_of(&plan, "w-01", "2Mi"), Some(0));
                assert_eq!(plan.pools["dpdk"].status.nodes.selected, 2);
                apply_specs(&plan, &mut hpns);
                converge(&mut hpns[1]);
                let plan = run_plan(&pools, &nodes, &hpns, 101);
                assert!(plan.nodes["w-01"].spec.page_sizes.is_empty());
                assert_eq!(plan.pools["dpdk"].status.nodes.selected, 1);
            }
        }
    }
}

#[test]
fn release_deletion_shrinks_every_node_to_zero_within_the_limit_before_the_finalizer_goes() {
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(2),
    )];
    pools[0].spec.deletion_policy = DeletionPolicy::Release;
    let nodes = fleet(5, &["dpdk"]);
    let mut hpns = Vec::new();
    run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    pools[0].metadata.deletion_timestamp = Some(Time(at(50)));
    let mut finalized = false;
    for pass in 0..20 {
        let plan = run_plan(&pools, &nodes, &hpns, 100 + pass);
        let at_zero = plan
            .nodes
            .values()
            .filter(|n| n.spec.page_sizes.iter().any(|e| e.pages == 0))
            .count();
        assert!(
            at_zero <= 2,
            "pass {pass}: {at_zero} nodes shrinking at once"
        );
        if plan.pools["dpdk"].remove_finalizer {
            assert!(plan.nodes.values().all(|n| n.spec.page_sizes.is_empty()));
            assert!(hpns.iter().all(|h| {
                h.status
                    .as_ref()
                    .is_some_and(|s| s.page_sizes.iter().all(|r| r.total == 0))
            }));
            finalized = true;
            break;
        }
        apply_specs(&plan, &mut hpns);
        hpns.iter_mut().for_each(converge);
    }
    assert!(finalized);
}

#[test]
fn retain_deletion_drops_the_entries_then_the_finalizer_once_none_is_left() {
    let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    pools[0].metadata.deletion_timestamp = Some(Time(at(50)));
    let plan = run_plan(&pools, &nodes, &hpns, 100);
    assert_eq!(plan.spec_writes().count(), 3);
    assert!(plan.nodes.values().all(|n| n.spec.page_sizes.is_empty()));
    // The writes that clear the entries may not all land: the pool stays.
    assert!(!plan.pools["dpdk"].remove_finalizer);
    // One landed, two did not (their objects changed): still kept.
    let mut partly = hpns.clone();
    partly[0].spec.page_sizes.clear();
    assert!(!run_plan(&pools, &nodes, &partly, 101).pools["dpdk"].remove_finalizer);
    // Not waited for on a node whose Node is gone.
    assert!(run_plan(&pools, &nodes[..1], &partly, 101).pools["dpdk"].remove_finalizer);
    // Every entry gone: the pool goes, with nothing more to write.
    apply_specs(&plan, &mut hpns);
    let plan = run_plan(&pools, &nodes, &hpns, 102);
    assert!(plan.pools["dpdk"].remove_finalizer);
    assert_eq!(plan.spec_writes().count(), 0);
}

#[test]
fn entries_of_a_pool_that_no_longer_exists_are_dropped() {
    let orphan = hpn(
        "w",
        1,
        vec![pool("gone", 0, "x", "2Mi", 4).entry_for_test(4)],
    );
    let plan = run_plan(&[], &[node("w", &["x"])], &[orphan], 0);
    assert!(plan.nodes["w"].spec_changed);
    assert!(plan.nodes["w"].spec.page_sizes.is_empty());
}

/// A node whose shrink to 0 is blocked by 3 pages in use.
fn blocked_shrink(policy: DrainPolicy) -> (Vec<HugePagePool>, Vec<Node>, Vec<HugePageNode>) {
    let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    pools[0].spec.drain.policy = policy;
    pools[0].spec.drain.timeout = "1m".into();
    let nodes = fleet(1, &["dpdk"]);
    let mut hpns = Vec::new();
    run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    pools[0].spec.pages = Some(0);
    pools[0].metadata.generation = Some(2);
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    let generation = hpns[0].metadata.generation;
    let status = status_of(&mut hpns[0]);
    status.observed_generation = generation;
    status.page_sizes = vec![PageSizeStatus {
        size: PageSize::SIZE_2MI,
        target: Some(0),
        total: 3,
        free: 0,
        surplus: 3,
        in_use: 3,
        ..PageSizeStatus::empty(PageSize::SIZE_2MI)
    }];
    set_condition(
        &mut status.conditions,
        ConditionUpdate::new(
            NodeConditionType::ShrinkBlocked,
            true,
            Reason::PagesInUse,
            "",
        ),
        &Time(at(0)),
    );
    (pools, nodes, hpns)
}

#[test]
fn a_shrink_blocked_on_one_numa_node_drains_what_that_node_holds() {
    // Targets 100 + 100; 150 pages in use on NUMA node 0, none on node 1.
    // Node-wide 150 in use fit the 200 pages, so only the NUMA counts show
    // the shrink cannot finish.
    let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 200)];
    pools[0].spec.numa = Some(NumaSpec {
        policy: NumaPolicy::Explicit,
        nodes: Some(vec![
            NumaTarget { id: 0, pages: 100 },
            NumaTarget { id: 1, pages: 100 },
        ]),
    });
    pools[0].spec.drain.policy = DrainPolicy::IfNeeded;
    pools[0].spec.drain.timeout = "1m".into();
    let nodes = fleet(1, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    let entry = hpns[0].spec.page_sizes[0].clone();
    assert_eq!(entry.numa.as_ref().map(Vec::len), Some(2), "{entry:?}");
    let generation = hpns[0].metadata.generation;
    let status = status_of(&mut hpns[0]);
    status.observed_generation = generation;
    status.page_sizes = vec![PageSizeStatus {
        size: PageSize::SIZE_2MI,
        target: Some(entry.pages),
        total: 250,
        free: 100,
        in_use: 150,
        numa: vec![
            NumaStatus {
                id: 0,
                total: 150,
                free: 0,
                surplus: 0,
                claimed: None,
                obtainable: None,
            },
            NumaStatus {
                id: 1,
                total: 100,
                free: 100,
                surplus: 0,
                claimed: None,
                obtainable: None,
            },
        ],
        ..PageSizeStatus::empty(PageSize::SIZE_2MI)
    }];
    set_condition(
        &mut status.conditions,
        ConditionUpdate::new(
            NodeConditionType::ShrinkBlocked,
            true,
            Reason::PagesInUse,
            "",
        )
        .generation(generation),
        &Time(at(0)),
    );
    let reported = hpns[0].status.as_ref().unwrap().page_sizes[0].clone();
    assert_eq!(
        pages_to_free(&reported, &entry),
        50,
        "NUMA node 0's 150 - 100"
    );
    let plan = run_plan(&pools, &nodes, &hpns, 10);
    let drain = &plan.nodes["w-00"].drain;
    assert!(drain.taint, "{drain:?}");
    assert_eq!(drain.evict, [PageSize::SIZE_2MI]);
    assert_eq!(drain.deadline, Some(at(70)));
    // Without NUMA targets the same node is not blocked: 150 fit in 250.
    let mut global = entry.clone();
    global.numa = None;
    global.pages = 250;
    assert_eq!(pages_to_free(&reported, &global), 0);
}

#[test]
fn pages_dra_claims_hold_drain_although_none_is_faulted() {
    // Pool 96 -> 20; a prepared claim holds 40 pages, none in use yet.
    let entry = PageSizeTarget::new(PageSize::SIZE_2MI, 20);
    let reported = PageSizeStatus {
        target: Some(20),
        total: 40,
        free: 40,
        claimed: Some(40),
        numa: vec![NumaStatus {
            id: 0,
            total: 40,
            free: 40,
            surplus: 0,
            claimed: Some(40),
            obtainable: None,
        }],
        ..PageSizeStatus::empty(PageSize::SIZE_2MI)
    };
    assert_eq!(pages_to_free(&reported, &entry), 20);
    // Faulted pages of the same claim count once.
    let faulted = PageSizeStatus {
        free: 10,
        in_use: 30,
        ..reported.clone()
    };
    assert_eq!(pages_to_free(&faulted, &entry), 20);
    // Per NUMA node: node 0 holds 40 claimed against its target of 10.
    let mut per_numa = entry.clone();
    per_numa.pages = 50;
    per_numa.numa = Some(vec![NumaTarget { id: 0, pages: 10 }]);
    assert_eq!(pages_to_free(&reported, &per_numa), 30);
    // Without the claim nothing has to come back.
    let unclaimed = PageSizeStatus {
        claimed: None,
        numa: vec![NumaStatus {
            claimed: None,
            ..reported.numa[0].clone()
        }],
        ..reported
    };
    assert_eq!(pages_to_free(&unclaimed, &entry), 0);
    assert_eq!(pages_to_free(&unclaimed, &per_numa), 0);
}

#[test]
fn blocked_shrink_taints_evicts_and_times_out() {
    let (pools, nodes, mut hpns) = blocked_shrink(DrainPolicy::IfNeeded);
    let plan = run_plan(&pools, &nodes, &hpns, 10);
    let drain = &plan.nodes["w-00"].drain;
    assert!(drain.taint);
    assert_eq!(drain.evict, [hugepool_crds::PageSize::SIZE_2MI]);
    assert_eq!(drain.deadline, Some(at(70)));
    assert_eq!(plan.next_deadline, Some(at(70)));
    let update = drain.condition.clone().unwrap();
    assert_eq!((update.status, update.reason), (true, Reason::EvictingPods));
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Progressing),
        ("True", "Draining")
    );
    // The controller records the condition; the deadline counts from then.
    set_condition(
        &mut status_of(&mut hpns[0]).conditions,
        update,
        &Time(at(10)),
    );
    let plan = run_plan(&pools, &nodes, &hpns, 69);
    assert!(plan.nodes["w-00"].drain.taint);
    let plan = run_plan(&pools, &nodes, &hpns, 70);
    let drain = &plan.nodes["w-00"].drain;
    assert!(!drain.taint, "a timed-out drain gives the node back");
    let update = drain.condition.clone().unwrap();
    assert_eq!(
        (update.status, update.reason),
        (false, Reason::DrainTimeout)
    );
    set_condition(
        &mut status_of(&mut hpns[0]).conditions,
        update,
        &Time(at(70)),
    );
    let plan = run_plan(&pools, &nodes, &hpns, 71);
    let pool_plan = &plan.pools["dpdk"];
    assert_eq!(pool_plan.status.failed_nodes[0].reason, "DrainTimeout");
    // The cause is named even though the one failure also halts the rollout.
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "DrainTimeout")
    );
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Progressing),
        ("False", "RolloutHalted")
    );
}

#[test]
fn drain_ends_with_the_taint_removed_once_the_node_converges() {
    let (pools, nodes, mut hpns) = blocked_shrink(DrainPolicy::IfNeeded);
    let plan = run_plan(&pools, &nodes, &hpns, 10);
    let update = plan.nodes["w-00"].drain.condition.clone().unwrap();
    set_condition(
        &mut status_of(&mut hpns[0]).conditions,
        update,
        &Time(at(10)),
    );
    // Pods gone: the kernel frees the surplus.
    set_condition(
        &mut status_of(&mut hpns[0]).conditions,
        ConditionUpdate::new(
            NodeConditionType::ShrinkBlocked,
            false,
            Reason::NotBlocked,
            "",
        ),
        &Time(at(20)),
    );
    converge(&mut hpns[0]);
    let plan = run_plan(&pools, &nodes, &hpns, 20);
    let drain = &plan.nodes["w-00"].drain;
    assert!(!drain.taint);
    let update = drain.condition.clone().unwrap();
    assert_eq!(
        (update.status, update.reason),
        (false, Reason::DrainComplete)
    );
}

/// A converged node whose agent holds the kubelet restart of pool "vm"
/// (AfterResize) for a pod of the Static Memory Manager.
fn restart_held(
    policy: DrainPolicy,
    restart: KubeletRestart,
) -> (Vec<HugePagePool>, Vec<Node>, Vec<HugePageNode>) {
    let mut pools = vec![pool("vm", 0, "vm", "2Mi", 64)];
    pools[0].spec.drain.policy = policy;
    pools[0].spec.drain.timeout = "1m".into();
    pools[0].spec.kubelet.restart = restart;
    let nodes = fleet(1, &["vm"]);
    let mut hpns = Vec::new();
    run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    report(
        &mut hpns[0],
        ConditionUpdate::new(
            NodeConditionType::KubeletCapacityStale,
            true,
            Reason::MemoryManagerAssignments,
            "not restarting the kubelet: its Static Memory Manager holds memory for pod uid-1",
        ),
    );
    status_of(&mut hpns[0]).memory_manager_pods = vec!["uid-1".into()];
    (pools, nodes, hpns)
}

#[test]
fn a_restart_held_by_the_memory_manager_drains_its_pods_under_the_drain_policy() {
    let (pools, nodes, mut hpns) = restart_held(DrainPolicy::IfNeeded, KubeletRestart::AfterResize);
    let plan = run_plan(&pools, &nodes, &hpns, 10);
    let drain = &plan.nodes["w-00"].drain;
    assert!(drain.taint);
    assert!(drain.evict.is_empty(), "no shrink: no page size to drain");
    assert_eq!(drain.evict_pods, ["uid-1"]);
    assert_eq!(drain.pools, ["vm"]);
    assert_eq!(drain.deadline, Some(at(70)));
    let update = drain.condition.clone().unwrap();
    assert_eq!((update.status, update.reason), (true, Reason::EvictingPods));
    assert!(
        update
            .message
            .contains("Static Memory Manager holds memory for (uid-1)")
            && update.message.contains("restarted for pool vm"),
        "{}",
        update.message
    );
    set_condition(
        &mut status_of(&mut hpns[0]).conditions,
        update,
        &Time(at(10)),
    );
    // Past the timeout: the node fails with DrainTimeout naming the pods.
    let drain = &run_plan(&pools, &nodes, &hpns, 70).nodes["w-00"].drain;
    let timeout = drain.condition.clone().unwrap();
    assert_eq!(
        (timeout.status, timeout.reason, drain.taint),
        (false, Reason::DrainTimeout, false)
    );
    assert!(timeout.message.contains("(uid-1)"), "{}", timeout.message);
    // The pods gone, the kubelet restarted and reporting: the drain ends.
    report(
        &mut hpns[0],
        ConditionUpdate::new(
            NodeConditionType::KubeletCapacityStale,
            false,
            Reason::CapacityMatches,
            "",
        ),
    );
    status_of(&mut hpns[0]).memory_manager_pods.clear();
    let drain = &run_plan(&pools, &nodes, &hpns, 30).nodes["w-00"].drain;
    assert!(!drain.taint && drain.evict_pods.is_empty());
    assert_eq!(
        drain.condition.clone().map(|c| c.reason),
        Some(Reason::DrainComplete)
    );
}

#[test]
fn a_restart_held_by_the_memory_manager_drains_nothing_with_policy_never_or_no_restart() {
    for (policy, restart) in [
        (DrainPolicy::Never, KubeletRestart::AfterResize),
        (DrainPolicy::IfNeeded, KubeletRestart::Never),
    ] {
        let (pools, nodes, hpns) = restart_held(policy, restart);
        let plan = run_plan(&pools, &nodes, &hpns, 10);
        assert_eq!(
            plan.nodes["w-00"].drain,
            DrainPlan::default(),
            "{policy:?} {restart:?}"
        );
    }
}

#[test]
fn a_drained_node_keeps_the_taint_until_its_restarted_kubelet_reports_the_new_capacity() {
    let (pools, nodes, mut hpns) = restart_held(DrainPolicy::IfNeeded, KubeletRestart::AfterResize);
    let evicting = run_plan(&pools, &nodes, &hpns, 10).nodes["w-00"]
        .drain
        .condition
        .clone()
        .unwrap();
    set_condition(
        &mut status_of(&mut hpns[0]).conditions,
        evicting,
        &Time(at(10)),
    );
    // The pod is gone; the agent restarts the kubelet, which still reports
    // the capacity it started with.
    status_of(&mut hpns[0]).memory_manager_pods.clear();
    report(
        &mut hpns[0],
        ConditionUpdate::new(
            NodeConditionType::KubeletCapacityStale,
            true,
            Reason::KubeletRestarted,
            "restarting",
        ),
    );
    let old = vec![with_capacity(nodes[0].clone(), "hugepages-2Mi", "0")];
    let drain = &run_plan(&pools, &old, &hpns, 20).nodes["w-00"].drain;
    assert!(drain.taint, "a new pod would land on the old capacity");
    assert_eq!(drain.condition, None, "the drain is not over");
    // The agent's word alone does not open the node while the Node shows
    // the old capacity (the scheduler reads the Node).
    report(
        &mut hpns[0],
        ConditionUpdate::new(
            NodeConditionType::KubeletCapacityStale,
            false,
            Reason::CapacityMatches,
            "",
        ),
    );
    assert!(run_plan(&pools, &old, &hpns, 21).nodes["w-00"].drain.taint);
    // The Node reports the 64 pages: the drain ends and the taint goes, in
    // the pass that makes the pool Available (even before the agent says
    // its capacity matches).
    report(
        &mut hpns[0],
        ConditionUpdate::new(
            NodeConditionType::KubeletCapacityStale,
            true,
            Reason::KubeletRestarted,
            "restarting",
        ),
    );
    let new = vec![with_capacity(nodes[0].clone(), "hugepages-2Mi", "128Mi")];
    let plan = run_plan(&pools, &new, &hpns, 22);
    let drain = &plan.nodes["w-00"].drain;
    assert!(!drain.taint);
    assert_eq!(
        drain.condition.clone().map(|c| c.reason),
        Some(Reason::DrainComplete)
    );
    assert_eq!(
        condition(&plan, "vm", PoolConditionType::Available),
        ("True", "AllNodesConverged")
    );
}

#[test]
fn a_node_the_operator_cannot_write_to_degrades_its_pool_and_names_the_error() {
    let pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let nodes = fleet(2, &["dpdk"]);
    let node_refs: Vec<&Node> = nodes.iter().collect();
    let observed = Observed {
        write_errors: BTreeMap::from([(
            "w-01".to_string(),
            "writing HugePageNode w-01: etcdserver: request timed out".to_string(),
        )]),
        ..Observed::default()
    };
    let errors = &observed.write_errors;
    let plan = plan(&PlanInput {
        pools: &pools,
        nodes: &node_refs,
        node_states: &[],
        observed: &observed,
        now: at(0),
        agent_nodes: None,
    });
    assert_eq!(
        plan.pools["dpdk"].write_errors,
        [("w-01".to_string(), errors["w-01"].clone())]
    );
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "NodeWritesFailed")
    );
    let degraded = degraded_message(&plan, "dpdk");
    assert!(
        degraded.contains("w-01: writing HugePageNode w-01: etcdserver"),
        "{degraded}"
    );
    // The other node is planned as if nothing happened.
    assert!(plan.nodes["w-00"].spec_changed);
}

/// The message of the pool's Degraded condition.
fn degraded_message(plan: &Plan, pool: &str) -> String {
    find_condition(
        &plan.pools[pool].status.conditions,
        PoolConditionType::Degraded,
    )
    .map(|c| c.message.clone())
    .unwrap_or_default()
}

/// Plans with what the controller observed.
fn plan_observed(
    pools: &[HugePagePool],
    nodes: &[Node],
    hpns: &[HugePageNode],
    observed: &Observed,
    second: i64,
) -> Plan {
    let nodes: Vec<&Node> = nodes.iter().collect();
    let hpns: Vec<&HugePageNode> = hpns.iter().collect();
    plan(&PlanInput {
        pools,
        nodes: &nodes,
        node_states: &hpns,
        observed,
        now: at(second),
        agent_nodes: None,
    })
}

#[test]
fn a_node_whose_agent_does_not_answer_gives_back_its_slot_and_is_named() {
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    pools[0].spec.rollout.unresponsive_after = "1m".into();
    let nodes = fleet(2, &["dpdk"]);
    let mut hpns = Vec::new();
    let first = run_plan(&pools, &nodes, &hpns, 0);
    apply_specs(&first, &mut hpns);
    // w-00 took the one slot; w-01's agent acknowledges its empty spec,
    // w-00's never answers.
    assert_eq!(target_of(&first, "w-00", "2Mi"), Some(64));
    status_of(&mut hpns[1]).observed_generation = Some(1);
    let mut observed = Observed::default();
    observed.track_acknowledgements(&hpns, at(0));
    assert_eq!(observed.unacknowledged.keys().collect::<Vec<_>>(), ["w-00"]);
    // Within the bound it keeps the slot, and the plan wakes at the bound;
    // the pool already names whom it waits on, and until when.
    let waiting = plan_observed(&pools, &nodes, &hpns, &observed, 30);
    assert_eq!(target_of(&waiting, "w-01", "2Mi"), None);
    assert_eq!(waiting.pools["dpdk"].status.nodes.unresponsive, 0);
    assert_eq!(waiting.next_deadline, Some(at(60)));
    let progressing = waiting.pools["dpdk"]
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Progressing")
        .unwrap()
        .message
        .clone();
    let until = at(60).strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    assert!(
        progressing.contains(&format!(
            "waiting on nodes that do not answer yet: w-00 (passed over at {until}"
        )),
        "{progressing}"
    );
    // Past it: the slot goes to w-01, w-00 is counted apart and named.
    let silent = plan_observed(&pools, &nodes, &hpns, &observed, 60);
    assert_eq!(target_of(&silent, "w-01", "2Mi"), Some(64));
    let counts = &silent.pools["dpdk"].status.nodes;
    assert_eq!(
        (counts.unresponsive, counts.updating, counts.pending),
        (1, 1, 0)
    );
    assert_eq!(
        condition(&silent, "dpdk", PoolConditionType::Degraded),
        ("True", "NodesUnresponsive")
    );
    let degraded = degraded_message(&silent, "dpdk");
    assert!(
        degraded.contains("w-00 (its agent has not acknowledged generation 1")
            && degraded.contains("the rollout goes on without them"),
        "{degraded}"
    );
    // It answers: it converges like any node.
    converge(&mut hpns[0]);
    observed.track_acknowledgements(&hpns, at(61));
    assert!(observed.unacknowledged.is_empty());
    let back = plan_observed(&pools, &nodes, &hpns, &observed, 61);
    assert_eq!(back.pools["dpdk"].status.nodes.unresponsive, 0);
    assert_eq!(back.pools["dpdk"].status.nodes.converged, 1);
}

#[test]
fn a_node_not_ready_past_the_bound_gets_no_slot() {
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    pools[0].spec.rollout.unresponsive_after = "1m".into();
    let mut nodes = fleet(2, &["dpdk"]);
    nodes[0].status = Some(NodeStatus {
        conditions: Some(vec![NodeCondition {
            type_: "Ready".into(),
            status: "Unknown".into(),
            reason: Some("NodeStatusUnknown".into()),
            last_transition_time: Some(Time(at(0))),
            ..NodeCondition::default()
        }]),
        ..NodeStatus::default()
    });
    // Not ready for 30 s: still within the bound, it takes the slot.
    let early = run_plan(&pools, &nodes, &[], 30);
    assert_eq!(target_of(&early, "w-00", "2Mi"), Some(64));
    assert_eq!(early.next_deadline, Some(at(60)));
    // For a minute: passed over, the next node gets the slot.
    let late = run_plan(&pools, &nodes, &[], 60);
    assert_eq!(target_of(&late, "w-00", "2Mi"), None);
    assert_eq!(target_of(&late, "w-01", "2Mi"), Some(64));
    let degraded = degraded_message(&late, "dpdk");
    assert!(
        degraded.contains("w-00 (NotReady since") && degraded.contains("NodeStatusUnknown"),
        "{degraded}"
    );
}

#[test]
fn nodes_that_do_not_answer_are_named_beside_failed_nodes() {
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(2),
    )];
    pools[0].spec.rollout.unresponsive_after = "1m".into();
    let mut nodes = fleet(3, &["dpdk"]);
    nodes[2].status = Some(NodeStatus {
        conditions: Some(vec![NodeCondition {
            type_: "Ready".into(),
            status: "False".into(),
            reason: Some("KubeletNotReady".into()),
            last_transition_time: Some(Time(at(0))),
            ..NodeCondition::default()
        }]),
        ..NodeStatus::default()
    });
    let mut hpns = Vec::new();
    let first = run_plan(&pools, &nodes, &hpns, 0);
    apply_specs(&first, &mut hpns);
    // w-00 fails its grow; w-02 has been NotReady for two minutes.
    fail_allocation(&mut hpns[0]);
    let later = run_plan(&pools, &nodes, &hpns, 120);
    assert_eq!(
        condition(&later, "dpdk", PoolConditionType::Degraded).1,
        "AllocationFailed"
    );
    let degraded = degraded_message(&later, "dpdk");
    assert!(
        degraded.contains("1 nodes do not answer: w-02 (NotReady since"),
        "{degraded}"
    );
}

#[test]
fn the_acknowledgement_clock_starts_when_the_spec_was_written_whoever_leads_now() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
    let mut waiting = hpn("w-00", 3, vec![]);
    let entry = |manager: &str, subresource: Option<&str>, second: i64| ManagedFieldsEntry {
        manager: Some(manager.into()),
        operation: Some("Update".into()),
        subresource: subresource.map(str::to_string),
        time: Some(Time(at(second))),
        ..ManagedFieldsEntry::default()
    };
    waiting.metadata.managed_fields = Some(vec![
        entry(hugepool_crds::OPERATOR_MANAGER, None, 40),
        // Its Draining condition, and the agent's status: not the spec.
        entry(hugepool_crds::OPERATOR_MANAGER, Some("status"), 90),
        entry("hugepool-agent", Some("status"), 95),
    ]);
    // A replica that has just become leader sees it for the first time at
    // 100: the generation has waited since 40, when the spec was written.
    let mut observed = Observed::default();
    observed.track_acknowledgements([&waiting], at(100));
    assert_eq!(observed.unacknowledged["w-00"], (3, at(40)));
}

#[test]
fn an_acknowledgement_clock_starts_per_generation() {
    let mut hpns = vec![hpn("w-00", 1, vec![]), hpn("w-01", 1, vec![])];
    status_of(&mut hpns[1]).observed_generation = Some(1);
    let mut observed = Observed::default();
    observed.track_acknowledgements(&hpns, at(5));
    assert_eq!(observed.unacknowledged["w-00"], (1, at(5)));
    // Still waiting at a later pass: the clock keeps its start.
    observed.track_acknowledgements(&hpns, at(9));
    assert_eq!(observed.unacknowledged["w-00"], (1, at(9 - 4)));
    // A new generation starts it again; w-01 falls behind too.
    hpns[0].metadata.generation = Some(2);
    hpns[1].metadata.generation = Some(2);
    observed.track_acknowledgements(&hpns, at(12));
    assert_eq!(observed.unacknowledged["w-00"], (2, at(12)));
    assert_eq!(observed.unacknowledged["w-01"], (2, at(12)));
}

#[test]
fn drain_policy_never_leaves_the_node_blocked_and_says_so() {
    let (pools, nodes, hpns) = blocked_shrink(DrainPolicy::Never);
    let plan = run_plan(&pools, &nodes, &hpns, 10);
    assert_eq!(plan.nodes["w-00"].drain, DrainPlan::default());
    assert_eq!(plan.pools["dpdk"].blocked, ["w-00"]);
    let progressing = find_condition(
        &plan.pools["dpdk"].status.conditions,
        PoolConditionType::Progressing,
    )
    .unwrap();
    assert!(
        progressing.message.contains("drain policy Never"),
        "{}",
        progressing.message
    );
}

#[test]
fn a_shrink_held_by_claims_says_claims_not_pages_in_use() {
    // No page in use: 10 held by claims (prepared, or allocated and not
    // prepared yet), on a pool that never drains.
    let (pools, nodes, mut hpns) = blocked_shrink(DrainPolicy::Never);
    let reported = &mut status_of(&mut hpns[0]).page_sizes[0];
    (reported.in_use, reported.surplus, reported.total) = (0, 0, 10);
    reported.claimed = Some(10);
    let plan = run_plan(&pools, &nodes, &hpns, 10);
    assert!(plan.pools["dpdk"].blocked.is_empty());
    assert_eq!(plan.pools["dpdk"].held_by_claims, ["w-00"]);
    let progressing = find_condition(
        &plan.pools["dpdk"].status.conditions,
        PoolConditionType::Progressing,
    )
    .unwrap();
    assert!(
        progressing
            .message
            .contains("shrink held by claims on w-00")
            && !progressing.message.contains("pages in use"),
        "{}",
        progressing.message
    );
}

// ---- property tests ----

/// A random fleet: pools over labels a/b, sizes 2Mi/1Gi, random limits,
/// pause and deletion; HugePageNodes with random entries and agent reports.
#[derive(Clone, Debug)]
struct World {
    pools: Vec<HugePagePool>,
    nodes: Vec<Node>,
    hpns: Vec<HugePageNode>,
}

const LABELS: [&str; 2] = ["a", "b"];
const SIZES: [&str; 2] = ["2Mi", "1Gi"];

fn arb_pool(index: usize) -> impl Strategy<Value = HugePagePool> {
    (
        0..2usize,
        0..2usize,
        0..5i64,
        0..4i64,
        prop_oneof![
            (1..4i32).prop_map(IntOrString::Int),
            (1..=100u32).prop_map(|p| IntOrString::String(format!("{p}%"))),
        ],
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.2),
        prop::bool::ANY,
    )
        .prop_map(
            move |(label, size, pages, created, limit, paused, deleting, release)| {
                let mut pool = with_max_unavailable(
                    pool(
                        &format!("p{index}"),
                        created,
                        LABELS[label],
                        SIZES[size],
                        pages,
                    ),
                    limit,
                );
                pool.spec.rollout.paused = paused;
                if deleting {
                    pool.metadata.deletion_timestamp = Some(Time(at(1)));
                }
                if release {
                    pool.spec.deletion_policy = DeletionPolicy::Release;
                }
                pool
            },
        )
}

/// Random entry (pool index, size index, pages) and random agent report.
fn arb_node(index: usize, pools: usize) -> impl Strategy<Value = (Node, Option<HugePageNode>)> {
    (
        prop::sample::subsequence(LABELS.to_vec(), 0..=2),
        prop::collection::vec((0..pools, 0..2usize, 0..5i64), 0..3),
        prop::bool::ANY,
        0..4u8,
        prop::bool::weighted(0.2),
    )
        .prop_map(move |(labels, entries, exists, report, failed)| {
            let name = format!("w-{index}");
            let node = node(&name, &labels);
            if !exists {
                return (node, None);
            }
            let mut seen = BTreeSet::new();
            let entries = entries
                .into_iter()
                .filter(|(_, size, _)| seen.insert(*size))
                .map(|(pool_index, size, pages)| {
                    pool(&format!("p{pool_index}"), 0, "a", SIZES[size], pages)
                        .entry_for_test(pages)
                })
                .collect();
            let mut hpn = hpn(&name, 3, entries);
            match report {
                0 => {}
                1 => converge(&mut hpn),
                2 => {
                    converge(&mut hpn);
                    hpn.metadata.generation = Some(4);
                }
                _ => {
                    converge(&mut hpn);
                    for reported in &mut status_of(&mut hpn).page_sizes {
                        reported.total += 1;
                    }
                }
            }
            if failed {
                fail_allocation(&mut hpn);
            }
            (node, Some(hpn))
        })
}

fn arb_world() -> impl Strategy<Value = World> {
    (1..4usize, 1..8usize)
        .prop_flat_map(|(pools, nodes)| {
            (
                (0..pools).map(arb_pool).collect::<Vec<_>>(),
                (0..nodes).map(|i| arb_node(i, pools)).collect::<Vec<_>>(),
            )
        })
        .prop_map(|(pools, nodes)| {
            let (nodes, hpns): (Vec<_>, Vec<_>) = nodes.into_iter().unzip();
            World {
                pools,
                nodes,
                hpns: hpns.into_iter().flatten().collect(),
            }
        })
}

/// Nodes where `pool`'s entry is changing: not converged for its target
/// (failed ones included) before, or written by the plan.
fn changing(world: &World, plan: Option<&Plan>, pool: &str) -> BTreeSet<String> {
    let size = world
        .pools
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(pool))
        .map(|p| p.spec.page_size)
        .expect("the pool is in the world");
    let ours = |e: &&hugepool_crds::node::PageSizeTarget| e.pool == pool && e.size == size;
    let mut nodes = BTreeSet::new();
    for hpn in &world.hpns {
        let name = hpn.metadata.name.clone().unwrap();
        let before = hpn.spec.page_sizes.iter().find(ours);
        let changing_before = before.is_some_and(|e| entry_state(hpn, e) != EntryState::Converged);
        let changing = match plan.and_then(|p| p.nodes.get(&name)) {
            None => changing_before,
            Some(node_plan) => {
                let after = node_plan.spec.page_sizes.iter().find(ours);
                match (before, after) {
                    (_, None) => false,
                    (Some(b), Some(a)) if b == a => changing_before,
                    (_, Some(_)) => true,
                }
            }
        };
        if changing {
            nodes.insert(name);
        }
    }
    if let Some(plan) = plan {
        for (name, node_plan) in &plan.nodes {
            let fresh = !world
                .hpns
                .iter()
                .any(|h| h.metadata.name.as_ref() == Some(name));
            if fresh && node_plan.spec.page_sizes.iter().any(|e| ours(&e)) {
                nodes.insert(name.clone());
            }
        }
    }
    nodes
}

impl World {
    /// One line per object, for failure messages.
    fn describe(&self) -> String {
        let mut lines = Vec::new();
        for p in &self.pools {
            lines.push(format!(
                "pool {} created={:?} sel={:?} size={} pages={:?} limit={:?} paused={} deleting={} {:?}",
                p.metadata.name.clone().unwrap(),
                p.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second() - T0),
                p.spec.node_selector.match_labels.as_ref().map(|l| l.keys().cloned().collect::<Vec<_>>()),
                p.spec.page_size, p.spec.pages, p.spec.rollout.max_unavailable, p.spec.rollout.paused,
                p.metadata.deletion_timestamp.is_some(), p.spec.deletion_policy,
            ));
        }
        for n in &self.nodes {
            lines.push(format!(
                "node {} labels={:?}",
                n.metadata.name.clone().unwrap(),
                n.metadata
                    .labels
                    .as_ref()
                    .map(|l| l.keys().cloned().collect::<Vec<_>>())
            ));
        }
        for h in &self.hpns {
            let status = h.status.as_ref();
            lines.push(format!(
                "hpn {} gen={:?} observed={:?} entries={:?} reported={:?} conditions={:?}",
                h.metadata.name.clone().unwrap(),
                h.metadata.generation,
                status.and_then(|s| s.observed_generation),
                h.spec
                    .page_sizes
                    .iter()
                    .map(|e| (e.pool.clone(), e.size, e.pages))
                    .collect::<Vec<_>>(),
                status.map(|s| s
                    .page_sizes
                    .iter()
                    .map(|r| (r.size, r.target, r.total))
                    .collect::<Vec<_>>()),
                status.map(|s| s
                    .conditions
                    .iter()
                    .map(|c| (c.type_.clone(), c.status.clone()))
                    .collect::<Vec<_>>()),
            ));
        }
        lines.join("\n")
    }
}

fn world_plan(world: &World) -> Plan {
    run_plan(&world.pools, &world.nodes, &world.hpns, 5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn never_more_than_max_unavailable_nodes_changing(world in arb_world()) {
        let plan = world_plan(&world);
        for pool in &world.pools {
            let name = pool.metadata.name.clone().unwrap();
            let limit = plan.pools[&name].max_unavailable;
            let after = changing(&world, Some(&plan), &name);
            // A node that left the pool (its entry dropped) frees its slot.
            let still_in: BTreeSet<String> = plan.nodes.iter()
                .filter(|(_, n)| n.spec.page_sizes.iter().any(|e| e.pool == name && e.size == pool.spec.page_size))
                .map(|(node, _)| node.clone())
                .collect();
            let before: BTreeSet<String> = changing(&world, None, &name).intersection(&still_in).cloned().collect();
            if before.len() >= limit {
                prop_assert!(after.is_subset(&before), "{name}: {before:?} -> {after:?}\n{}", world.describe());
            } else {
                prop_assert!(after.len() <= limit, "{name}: {before:?} -> {after:?} > {limit}\n{}", world.describe());
            }
            if pool.spec.rollout.paused {
                prop_assert!(after.is_subset(&before), "paused {name} admitted {after:?}\n{}", world.describe());
            }
        }
    }

    #[test]
    fn each_node_size_has_one_owner_and_it_is_the_oldest_pool_wanting_it(world in arb_world()) {
        let plan = world_plan(&world);
        for (node_name, node_plan) in &plan.nodes {
            let sizes: BTreeSet<PageSize> = node_plan.spec.page_sizes.iter().map(|e| e.size).collect();
            prop_assert_eq!(sizes.len(), node_plan.spec.page_sizes.len());
            let before = world.hpns.iter().find(|h| h.metadata.name.as_ref() == Some(node_name));
            let node = world.nodes.iter().find(|n| n.metadata.name.as_ref() == Some(node_name)).unwrap();
            for entry in &node_plan.spec.page_sizes {
                let unchanged = before.is_some_and(|b| b.spec.page_sizes.contains(entry));
                if unchanged {
                    continue;
                }
                // A written entry belongs to the oldest live pool selecting the node (or releasing it).
                let mut candidates: Vec<&HugePagePool> = world.pools.iter().filter(|p| {
                    p.spec.page_size == entry.size
                        && ((p.metadata.deletion_timestamp.is_none()
                            && node.metadata.labels.as_ref().unwrap().contains_key(
                                p.spec.node_selector.match_labels.as_ref().unwrap().keys().next().unwrap()))
                            || (p.spec.deletion_policy == DeletionPolicy::Release
                                && before.is_some_and(|b| b.spec.page_sizes.iter().any(|e| e.pool == p.metadata.name.clone().unwrap() && e.size == entry.size))))
                }).collect();
                candidates.sort_by_key(|p| (p.metadata.creation_timestamp.clone(), p.metadata.name.clone()));
                prop_assert_eq!(Some(&entry.pool), candidates.first().and_then(|p| p.metadata.name.as_ref()), "{}", world.describe());
            }
        }
        for (pool_name, pool_plan) in &plan.pools {
            for (node, owner) in &pool_plan.conflicts {
                prop_assert_ne!(owner, pool_name);
                // The loser's entry there stays as it was until the owner takes the size over.
                let size = &world.pools.iter().find(|p| p.metadata.name.as_ref() == Some(pool_name)).unwrap().spec.page_size;
                let entry = plan.nodes[node].spec.page_sizes.iter().find(|e| &e.pool == pool_name && &e.size == size);
                let before = world.hpns.iter().find(|h| h.metadata.name.as_ref() == Some(node))
                    .and_then(|h| h.spec.page_sizes.iter().find(|e| &e.pool == pool_name && &e.size == size));
                if entry != before {
                    let size = &before.unwrap().size;
                    let now_there = plan.nodes[node].spec.page_sizes.iter().find(|e| &e.size == size);
                    prop_assert_eq!(now_there.map(|e| &e.pool), Some(owner), "loser {} touched {}\n{}", pool_name, node, world.describe());
                }
                let degraded = find_condition(&pool_plan.status.conditions, PoolConditionType::Degraded).unwrap();
                prop_assert!(degraded.status == "True");
            }
        }
    }

    #[test]
    fn the_plan_does_not_depend_on_input_order(world in arb_world(), seed in any::<u64>()) {
        let mut shuffled = world.clone();
        let rotate = |len: usize| if len == 0 { 0 } else { (seed as usize) % len };
        let (p, n, h) = (rotate(shuffled.pools.len()), rotate(shuffled.nodes.len()), rotate(shuffled.hpns.len()));
        shuffled.pools.rotate_left(p);
        shuffled.pools.reverse();
        shuffled.nodes.rotate_left(n);
        shuffled.hpns.rotate_left(h);
        shuffled.hpns.reverse();
        prop_assert_eq!(world_plan(&world), world_plan(&shuffled));
    }

    #[test]
    fn rollouts_finish_and_never_exceed_the_limit_at_any_step(
        nodes in 1..12usize,
        limit in 1..4i32,
        first in 0..5i64,
        second in 0..5i64,
        stuck_mask in any::<u16>(),
    ) {
        let mut pools = vec![with_max_unavailable(pool("p", 0, "a", "2Mi", first), IntOrString::Int(limit))];
        let fleet = fleet(nodes, &["a"]);
        let mut hpns = Vec::new();
        run_to_end(&mut pools, &fleet, &mut hpns, &BTreeSet::new());
        pools[0].spec.pages = Some(second);
        pools[0].metadata.generation = Some(2);
        // Each pass, agents of a random subset are slow and report nothing.
        let mut changing_now: BTreeMap<String, bool> = BTreeMap::new();
        // A node's agent reports in one pass out of 16 at worst (the mask
        // rotates), so a one-at-a-time rollout of 11 nodes needs up to ~200.
        for pass in 0..400 {
            let plan = run_plan(&pools, &fleet, &hpns, pass);
            let world = World { pools: pools.clone(), nodes: fleet.clone(), hpns: hpns.clone() };
            let after = changing(&world, Some(&plan), "p");
            prop_assert!(after.len() <= limit as usize, "pass {}: {:?}", pass, after);
            apply_specs(&plan, &mut hpns);
            apply_statuses(&plan, &mut pools);
            for (index, hpn) in hpns.iter_mut().enumerate() {
                if (stuck_mask >> ((index + pass as usize) % 16)) & 1 == 0 {
                    converge(hpn);
                }
            }
            changing_now.clear();
            if hpns.iter().all(|h| h.spec.page_sizes[0].pages == second
                && entry_state(h, &h.spec.page_sizes[0]) == EntryState::Converged)
            {
                let plan = run_plan(&pools, &fleet, &hpns, pass + 1);
                prop_assert_eq!(condition(&plan, "p", PoolConditionType::Available), ("True", "AllNodesConverged"));
                return Ok(());
            }
        }
        prop_assert!(stuck_mask == u16::MAX, "rollout did not finish");
    }
}

#[test]
fn a_stalled_node_degrades_the_pool_but_is_not_failed() {
    let pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let nodes = fleet(1, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    set_condition(
        &mut status_of(&mut hpns[0]).conditions,
        ConditionUpdate::new(
            NodeConditionType::Stalled,
            true,
            Reason::SlowKernelWrite,
            "3.1s",
        ),
        &Time(at(0)),
    );
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert_eq!(plan.pools["dpdk"].status.nodes.failed, 0);
    assert_eq!(plan.pools["dpdk"].status.nodes.updating, 1);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Degraded),
        ("True", "NodesStalled")
    );
}

#[test]
fn node_deletion_frees_its_slot_and_a_new_node_joins_the_rollout() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let mut nodes = fleet(2, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    // w-00 is changing and goes away (its HugePageNode lingers until GC).
    nodes.remove(0);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-01"]);
    assert!(!plan.nodes.contains_key("w-00"));
    assert_eq!(plan.pools["dpdk"].status.nodes.selected, 1);
    apply_specs(&plan, &mut hpns);
    hpns.iter_mut().for_each(converge);
    nodes.push(node("w-02", &["dpdk"]));
    let plan = run_plan(&pools, &nodes, &hpns, 2);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-02"]);
    assert_eq!(plan.pools["dpdk"].status.nodes.ready, "1/2");
}

#[test]
fn a_node_whose_kernel_lacks_the_page_size_fails_with_the_agents_reason() {
    let pools = vec![pool("giant", 0, "x", "1Gi", 2)];
    let nodes = fleet(1, &["x"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    let generation = hpns[0].metadata.generation;
    let status = status_of(&mut hpns[0]);
    status.observed_generation = generation;
    set_condition(
        &mut status.conditions,
        ConditionUpdate::new(
            NodeConditionType::Converged,
            false,
            Reason::UnsupportedPageSize,
            "the kernel offers 2Mi only",
        )
        .generation(generation),
        &Time(at(0)),
    );
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    let failed = &plan.pools["giant"].status.failed_nodes;
    assert_eq!(failed[0].reason, "UnsupportedPageSize");
    assert_eq!(failed[0].message, "the kernel offers 2Mi only");
}

/// Sets the Node's `hugepages-<size>` capacity as a kubelet would report it.
fn with_capacity(mut node: Node, resource: &str, quantity: &str) -> Node {
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    node.status
        .get_or_insert_with(NodeStatus::default)
        .capacity
        .get_or_insert_with(BTreeMap::new)
        .insert(resource.to_string(), Quantity(quantity.to_string()));
    node
}

/// Pods claim a DRA pool's pages from the agent's ResourceSlice: a kubelet
/// that advertises none of them is as it should be, and the entries carry
/// the consumption to the agent. One that advertises them (restarted after
/// the grow) offers them to pods that request the size: named.
#[test]
fn a_dra_pool_is_available_while_no_kubelet_advertises_its_pages() {
    use hugepool_crds::settings::Consumption;
    let mut claimed =
        with_max_unavailable(pool("claims", 0, "dpdk", "2Mi", 64), IntOrString::Int(2));
    claimed.spec.consumption = Some(Consumption::DynamicResourceAllocation);
    let mut pools = vec![claimed];
    let nodes: Vec<Node> = fleet(2, &["dpdk"])
        .into_iter()
        .map(|n| with_capacity(n, "hugepages-2Mi", "0"))
        .collect();
    let mut hpns = Vec::new();
    let (plan, _) = run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    assert_eq!(plan.pools["claims"].status.nodes.converged, 2);
    assert!(plan.pools["claims"].capacity_stale.is_empty());
    assert_eq!(
        condition(&plan, "claims", PoolConditionType::Available),
        ("True", "AllNodesConverged")
    );
    for hpn in &hpns {
        assert_eq!(
            hpn.spec.page_sizes[0].consumption,
            Some(Consumption::DynamicResourceAllocation)
        );
    }
    // w-01's kubelet restarted and advertises 10 of the pages.
    let nodes = vec![
        nodes[0].clone(),
        with_capacity(nodes[1].clone(), "hugepages-2Mi", "20Mi"),
    ];
    let plan = run_plan(&pools, &nodes, &hpns, 10);
    assert_eq!(plan.pools["claims"].advertising_claim_pool, ["w-01"]);
    assert_eq!(
        condition(&plan, "claims", PoolConditionType::Available),
        ("False", "KubeletAdvertisesClaimPool")
    );
}

#[test]
fn a_pool_is_not_available_while_a_kubelet_reports_the_old_capacity() {
    let mut pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(2),
    )];
    let fresh = fleet(2, &["dpdk"]);
    // w-00's kubelet started before the grow (the kubelet reads the pools
    // only at start); w-01's has restarted since and reports 64 x 2Mi.
    let stale = vec![
        with_capacity(fresh[0].clone(), "hugepages-2Mi", "0"),
        with_capacity(fresh[1].clone(), "hugepages-2Mi", "128Mi"),
    ];
    let mut hpns = Vec::new();
    let (plan, _) = run_to_end(&mut pools, &stale, &mut hpns, &BTreeSet::new());
    assert_eq!(plan.pools["dpdk"].status.nodes.converged, 2);
    assert_eq!(plan.pools["dpdk"].capacity_stale, ["w-00"]);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("False", "KubeletCapacityStale")
    );
    let message = &find_condition(
        &plan.pools["dpdk"].status.conditions,
        PoolConditionType::Available,
    )
    .unwrap()
    .message;
    assert!(
        message.contains("the kubelet on w-00 still reports the old hugepages-2Mi"),
        "{message}"
    );
    // The pool restarts no kubelet (kubelet.restart: Never): the message
    // names every way to finish.
    for way in [
        "systemctl restart kubelet",
        "spec.kubelet.restart: AfterResize",
        "agent.kubeletRestart.enabled=true",
        "agent.bootFile.enabled",
    ] {
        assert!(message.contains(way), "{way} missing: {message}");
    }
    // The rollout itself is done: only the kubelet is behind.
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Progressing),
        ("False", "RolloutComplete")
    );

    // After w-00's kubelet restarts, the pool is Available.
    let restarted = vec![
        with_capacity(fresh[0].clone(), "hugepages-2Mi", "128Mi"),
        stale[1].clone(),
    ];
    let plan = run_plan(&pools, &restarted, &hpns, 300);
    assert!(plan.pools["dpdk"].capacity_stale.is_empty());
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("True", "AllNodesConverged")
    );
    // A Node that does not list the resource publishes no hugepages of the
    // size: nothing there can be stale.
    let plan = run_plan(&pools, &fresh, &hpns, 301);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("True", "AllNodesConverged")
    );
    // Capacity of another size never counts against this pool.
    let other = vec![
        with_capacity(restarted[0].clone(), "hugepages-1Gi", "3Gi"),
        restarted[1].clone(),
    ];
    let plan = run_plan(&pools, &other, &hpns, 302);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("True", "AllNodesConverged")
    );
}

#[test]
fn the_right_total_in_the_wrong_numa_split_is_not_converged() {
    let target = PageSizeTarget {
        numa: Some(vec![
            NumaTarget { id: 0, pages: 512 },
            NumaTarget { id: 1, pages: 512 },
        ]),
        pool: "p".into(),
        pool_generation: 1,
        ..PageSizeTarget::new(PageSize::SIZE_2MI, 1024)
    };
    let mut state = hpn("w-00", 1, vec![target.clone()]);
    converge(&mut state);
    assert_eq!(entry_state(&state, &target), EntryState::Converged);
    // The kernel put all 1024 on NUMA node 0: the total is right, the split
    // is not, so the node is still changing.
    let reported = &mut state.status.as_mut().unwrap().page_sizes[0];
    reported.numa = vec![
        NumaStatus {
            id: 0,
            total: 1024,
            free: 1024,
            surplus: 0,
            claimed: None,
            obtainable: None,
        },
        NumaStatus {
            id: 1,
            total: 0,
            free: 0,
            surplus: 0,
            claimed: None,
            obtainable: None,
        },
    ];
    assert_eq!(entry_state(&state, &target), EntryState::InFlight);
}

fn with_taint(mut node: Node, key: &str) -> Node {
    node.spec
        .get_or_insert_with(Default::default)
        .taints
        .get_or_insert_with(Vec::new)
        .push(k8s_openapi::api::core::v1::Taint {
            key: key.into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        });
    node
}

fn with_capacity_2mi(mut node: Node, bytes: u64) -> Node {
    node.status
        .get_or_insert_with(Default::default)
        .capacity
        .get_or_insert_with(BTreeMap::new)
        .insert(
            "hugepages-2Mi".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(bytes.to_string()),
        );
    node
}

fn restoring(hpn: &mut HugePageNode, status: bool) {
    let reason = if status {
        Reason::PoolsShortAtStart
    } else {
        Reason::PoolsReady
    };
    report(
        hpn,
        ConditionUpdate::new(NodeConditionType::Restoring, status, reason, ""),
    );
}

#[test]
fn a_node_restoring_its_pools_is_tainted_until_they_are_back_and_the_kubelet_reports_them() {
    let pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let mut nodes = vec![with_capacity_2mi(node("w-00", &["dpdk"]), 64 << 21)];
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    converge(&mut hpns[0]);
    restoring(&mut hpns[0], false);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert!(!plan.nodes["w-00"].not_ready_taint, "a converged node");

    // Rebooted: the agent found the pool short; the kubelet reports 0.
    nodes[0] = with_capacity_2mi(node("w-00", &["dpdk"]), 0);
    restoring(&mut hpns[0], true);
    let plan = run_plan(&pools, &nodes, &hpns, 2);
    assert!(plan.nodes["w-00"].not_ready_taint);
    nodes[0] = with_taint(nodes[0].clone(), hugepool_crds::NOT_READY_TAINT);

    // The pool is back but the kubelet still reports 0: the taint stays,
    // even once the agent no longer says Restoring.
    converge(&mut hpns[0]);
    restoring(&mut hpns[0], false);
    let plan = run_plan(&pools, &nodes, &hpns, 3);
    assert!(plan.nodes["w-00"].not_ready_taint, "capacity still stale");

    // The kubelet reports the pool: the taint goes.
    nodes[0] = with_taint(
        with_capacity_2mi(node("w-00", &["dpdk"]), 64 << 21),
        hugepool_crds::NOT_READY_TAINT,
    );
    let plan = run_plan(&pools, &nodes, &hpns, 4);
    assert!(!plan.nodes["w-00"].not_ready_taint);
}

#[test]
fn a_node_registered_with_the_taint_keeps_it_until_its_pool_is_written_and_reached() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let taint = hugepool_crds::NOT_READY_TAINT;
    // w-00 takes the rollout's one slot; w-01 (a new node, registered with
    // the taint) waits for admission and keeps it.
    let nodes = vec![
        node("w-00", &["dpdk"]),
        with_taint(with_capacity_2mi(node("w-01", &["dpdk"]), 0), taint),
    ];
    let mut hpns = vec![hpn("w-01", 1, vec![])];
    converge(&mut hpns[0]);
    let plan = run_plan(&pools, &nodes, &hpns, 0);
    assert_eq!(plan.pools["dpdk"].admitted, ["w-00"]);
    assert!(plan.nodes["w-01"].not_ready_taint, "pending admission");
    // A node no pool selects has nothing to wait for.
    let lone = vec![with_taint(node("w-09", &["web"]), taint)];
    let plan = run_plan(&pools, &lone, &[], 0);
    assert_eq!(plan.nodes["w-09"], NodePlan::default());
}

#[test]
fn pool_status_sums_allocated_requested_in_use_and_unrequested_per_node() {
    let pools = vec![with_max_unavailable(
        pool("dpdk", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(4),
    )];
    let nodes = fleet(4, &["dpdk"]);
    let mut hpns = Vec::new();
    apply_specs(&run_plan(&pools, &nodes, &hpns, 0), &mut hpns);
    for hpn in hpns.iter_mut() {
        converge(hpn);
    }
    // w-00: 40 of 64 requested, 30 mapped; w-01: pods ask 100, more than it
    // holds (that does not hide w-00's idle pages); w-02: nothing asked;
    // w-03: its agent has not reported requests yet.
    for (index, requested, in_use) in [(0, Some(40), 30), (1, Some(100), 64), (2, Some(0), 0)] {
        let entry = &mut status_of(&mut hpns[index]).page_sizes[0];
        entry.requested = requested;
        entry.in_use = in_use;
        entry.free = 64 - in_use;
    }
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    let pages = &plan.pools["dpdk"].status.pages;
    assert_eq!(
        (
            pages.current,
            pages.requested,
            pages.in_use,
            pages.unrequested
        ),
        (256, 140, 94, 24 + 64)
    );
    let members: Vec<(&str, Option<i64>, i64)> = plan.pools["dpdk"]
        .members
        .iter()
        .map(|m| (m.node.as_str(), m.requested, m.in_use))
        .collect();
    assert_eq!(
        members,
        [
            ("w-00", Some(40), 30),
            ("w-01", Some(100), 64),
            ("w-02", Some(0), 0),
            ("w-03", None, 0)
        ]
    );
    assert_eq!(plan.pools["dpdk"].page_size, Some(PageSize::SIZE_2MI));
}

#[test]
fn a_pool_is_not_available_while_its_draining_taint_is_still_on_a_node() {
    let mut pools = vec![pool("dpdk", 0, "dpdk", "2Mi", 64)];
    let mut nodes = fleet(3, &["dpdk"]);
    let mut hpns = Vec::new();
    run_to_end(&mut pools, &nodes, &mut hpns, &BTreeSet::new());
    // Every node converged, but the taint's removal from w-01 has not
    // landed (its write failed): pods would still be kept off a node the
    // pool calls done.
    nodes[1] = with_taint(nodes[1].clone(), hugepool_crds::DRAINING_TAINT);
    let plan = run_plan(&pools, &nodes, &hpns, 1);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("False", "NodesNotConverged")
    );
    let available = plan.pools["dpdk"]
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Available")
        .expect("Available");
    assert!(
        available
            .message
            .contains("the draining taint is still on w-01"),
        "{}",
        available.message
    );
    // The plan takes it off, and once it is gone the pool is Available.
    assert!(!plan.nodes["w-01"].drain.taint);
    nodes = fleet(3, &["dpdk"]);
    let plan = run_plan(&pools, &nodes, &hpns, 2);
    assert_eq!(
        condition(&plan, "dpdk", PoolConditionType::Available),
        ("True", "AllNodesConverged")
    );
}
