use std::collections::BTreeMap;

use hugepool_crds::HugePageNode;
use hugepool_crds::settings::{Consumption, DrainPolicy};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::*;
use crate::fixtures::{self, at, converge, fleet, pool, run_plan, with_max_unavailable};

fn names(wave: &[NodeChange]) -> Vec<&str> {
    wave.iter().map(|c| c.node.as_str()).collect()
}

fn plan_of(
    pools: &[HugePagePool],
    nodes: &[Node],
    states: &[HugePageNode],
    candidate: &HugePagePool,
) -> PlanReport {
    simulate(
        &ClusterView {
            pools,
            nodes,
            node_states: states,
        },
        candidate,
        &BTreeMap::new(),
        at(100),
    )
}

/// Runs the real planner until nothing changes, every agent converging at
/// once: the cluster after `pools` have rolled out.
fn rolled_out(pools: &mut Vec<HugePagePool>, nodes: &[Node]) -> Vec<HugePageNode> {
    let mut states = Vec::new();
    for second in 0..50 {
        let plan = run_plan(pools, nodes, &states, second);
        fixtures::apply_statuses(&plan, pools);
        if plan.spec_writes().next().is_none() {
            break;
        }
        fixtures::apply_specs(&plan, &mut states);
        for state in &mut states {
            converge(state);
        }
    }
    states
}

#[test]
fn a_new_pool_changes_its_nodes_in_waves_of_max_unavailable_by_name() {
    let nodes = fleet(5, &["dpdk"]);
    let candidate = with_max_unavailable(pool("new", 50, "dpdk", "2Mi", 64), IntOrString::Int(2));
    let report = plan_of(&[], &nodes, &[], &candidate);
    assert!(!report.exists);
    assert_eq!(report.max_unavailable, 2);
    let waves: Vec<Vec<&str>> = report.waves.iter().map(|w| names(w)).collect();
    assert_eq!(
        waves,
        [vec!["w-00", "w-01"], vec!["w-02", "w-03"], vec!["w-04"]]
    );
    assert!(
        report
            .waves
            .iter()
            .flatten()
            .all(|c| (c.from, c.to) == (0, 64))
    );
    assert!(report.stuck.is_empty(), "{:?}", report.stuck);
    assert!(report.conflicts.is_empty());
    assert_eq!(report.estimated_seconds, None, "no measured rates yet");
}

#[test]
fn nodes_an_older_pool_owns_are_conflicts_and_never_change() {
    let mut nodes = fleet(4, &["dpdk"]);
    nodes.push(fixtures::node("w-04", &["dpdk", "old"]));
    let mut pools = vec![pool("old", 0, "old", "2Mi", 16)];
    let states = rolled_out(&mut pools, &nodes);
    let candidate = with_max_unavailable(pool("new", 50, "dpdk", "2Mi", 64), IntOrString::Int(4));
    let report = plan_of(&pools, &nodes, &states, &candidate);
    assert_eq!(
        report.conflicts,
        [Conflict {
            node: "w-04".into(),
            owner: "old".into()
        }]
    );
    let changed: Vec<&str> = report
        .waves
        .iter()
        .flatten()
        .map(|c| c.node.as_str())
        .collect();
    assert_eq!(changed, ["w-00", "w-01", "w-02", "w-03"]);
    assert_eq!(report.waves.len(), 1);
    // A dry run stamps a new pool with the current second: even a stamp as
    // old as the owner's (and a name that sorts first) leaves it the newest.
    let stamped = with_max_unavailable(pool("a-new", 0, "dpdk", "2Mi", 64), IntOrString::Int(4));
    let report = plan_of(&pools, &nodes, &states, &stamped);
    assert_eq!(report.conflicts.len(), 1, "{report:?}");
}

#[test]
fn a_change_of_pages_shows_from_to_and_a_same_spec_changes_nothing() {
    let nodes = fleet(3, &["dpdk"]);
    let mut pools = vec![with_max_unavailable(
        pool("p", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let states = rolled_out(&mut pools, &nodes);
    let same = plan_of(&pools, &nodes, &states, &pools[0]);
    assert!(same.exists);
    assert!(same.waves.is_empty(), "{:?}", same.waves);
    assert_eq!(same.unchanged, ["w-00", "w-01", "w-02"]);

    let bigger = resized(&pools[0], 128);
    let report = plan_of(&pools, &nodes, &states, &bigger);
    assert_eq!(report.waves.len(), 3, "maxUnavailable 1: one node a wave");
    for change in report.waves.iter().flatten() {
        assert_eq!((change.from, change.to), (64, 128), "{change:?}");
    }
    assert!(report.unchanged.is_empty());
}

/// What `state`'s agent reports of 2Mi pages.
fn reported_2mi(state: &mut HugePageNode) -> &mut PageSizeStatus {
    fixtures::status_of(state)
        .page_sizes
        .iter_mut()
        .find(|r| r.size.to_string() == "2Mi")
        .expect("2Mi status")
}

/// `pool` changed to `pages` (its next generation).
fn resized(pool: &HugePagePool, pages: i64) -> HugePagePool {
    let mut pool = pool.clone();
    pool.spec.pages = Some(pages);
    pool.metadata.generation = Some(pool.metadata.generation.unwrap_or(1) + 1);
    pool
}

#[test]
fn a_shrink_below_the_pages_in_use_names_the_pods_a_drain_would_evict() {
    let nodes = fleet(2, &["dpdk"]);
    let mut pools = vec![pool("p", 0, "dpdk", "2Mi", 64)];
    let mut states = rolled_out(&mut pools, &nodes);
    // w-00 has 40 pages in use by two pods (30 + 10); w-01 has none.
    let reported = reported_2mi(&mut states[0]);
    reported.in_use = 40;
    reported.free = 24;
    let pod = |name: &str, pages: u64| -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "apps"},
            "spec": {"nodeName": "w-00", "containers": [{"name": "c", "resources": {
                "requests": {"hugepages-2Mi": format!("{}Mi", pages * 2)},
                "limits": {"hugepages-2Mi": format!("{}Mi", pages * 2)},
            }}]},
        }))
        .expect("pod")
    };
    let pods = BTreeMap::from([(
        "w-00".to_string(),
        drain::OnNode {
            pods: vec![pod("big", 30), pod("small", 10)],
            claims: drain::Claims::default(),
        },
    )]);
    let smaller = resized(&pools[0], 16);
    let view = ClusterView {
        pools: &pools,
        nodes: &nodes,
        node_states: &states,
    };
    let without_pods = simulate(&view, &smaller, &BTreeMap::new(), at(100));
    assert_eq!(nodes_to_drain(&without_pods), ["w-00"]);
    let report = simulate(&view, &smaller, &pods, at(100));
    let changes: Vec<&NodeChange> = report.waves.iter().flatten().collect();
    let w0 = changes
        .iter()
        .find(|c| c.node == "w-00")
        .expect("w-00 changes");
    let need = w0.drain.as_ref().expect("w-00 needs a drain");
    assert_eq!(need.held, 40);
    assert_eq!(need.policy, DrainPolicy::IfNeeded);
    // 24 pages must come back: the larger holder alone frees them.
    assert_eq!(need.evict, ["apps/big"]);
    let w1 = changes
        .iter()
        .find(|c| c.node == "w-01")
        .expect("w-01 changes");
    assert_eq!(w1.drain, None);
}

#[test]
fn a_shrink_below_what_dra_claims_hold_names_the_claim_holders() {
    let nodes = fleet(1, &["dpdk"]);
    let mut dra = pool("p", 0, "dpdk", "2Mi", 64);
    dra.spec.consumption = Some(Consumption::DynamicResourceAllocation);
    let mut pools = vec![dra];
    let mut states = rolled_out(&mut pools, &nodes);
    // Two pods' claims hold 30 + 10 pages, none of them faulted yet: nothing
    // is in use, and no pod requests hugepages-2Mi.
    let reported = reported_2mi(&mut states[0]);
    reported.claimed = Some(40);
    let pod = |name: &str| -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "apps", "uid": format!("u-{name}")},
            "spec": {"nodeName": "w-00", "containers": [{"name": "c"}],
                     "resourceClaims": [{"name": "pages", "resourceClaimName": name}]},
        }))
        .expect("pod")
    };
    let claims = drain::Claims::on_node(
        &[
            fixtures::claim(&["u-big"], "w-00", "hugepages-2mi-numa0", "60Mi"),
            fixtures::claim(&["u-small"], "w-00", "hugepages-2mi-numa0", "20Mi"),
        ],
        "w-00",
    );
    let pods = BTreeMap::from([(
        "w-00".to_string(),
        drain::OnNode {
            pods: vec![pod("big"), pod("small")],
            claims,
        },
    )]);
    let smaller = resized(&pools[0], 16);
    let view = ClusterView {
        pools: &pools,
        nodes: &nodes,
        node_states: &states,
    };
    assert_eq!(
        nodes_to_drain(&simulate(&view, &smaller, &BTreeMap::new(), at(100))),
        ["w-00"]
    );
    let report = simulate(&view, &smaller, &pods, at(100));
    let need = report.waves[0][0]
        .drain
        .as_ref()
        .expect("w-00 needs a drain");
    assert_eq!(need.held, 40);
    // 24 pages must come back: the larger claim holder alone frees them.
    assert_eq!(need.evict, ["apps/big"]);
    // A shrink to what the claims hold needs none.
    let report = simulate(&view, &resized(&pools[0], 40), &pods, at(100));
    assert_eq!(report.waves[0][0].drain, None);
}

#[test]
fn a_paused_pool_or_a_failed_node_holding_the_only_slot_is_reported_stuck() {
    let nodes = fleet(3, &["dpdk"]);
    let mut paused = pool("p", 0, "dpdk", "2Mi", 64);
    paused.spec.rollout.paused = true;
    let report = plan_of(&[], &nodes, &[], &paused);
    assert!(report.waves.is_empty());
    assert_eq!(report.stuck.len(), 3);
    assert!(
        report
            .stuck
            .iter()
            .all(|s| s.reason == "the rollout is paused")
    );

    // maxUnavailable 1 and w-00 failed at the live target: its slot stays
    // taken, so a change that does not touch it moves no other node.
    let mut pools = vec![with_max_unavailable(
        pool("q", 0, "dpdk", "2Mi", 64),
        IntOrString::Int(1),
    )];
    let mut states = rolled_out(&mut pools, &nodes);
    let failed = &mut states[0];
    failed.metadata.generation = Some(failed.metadata.generation.unwrap_or(1) + 1);
    fixtures::fail_allocation(failed);
    let same = plan_of(&pools, &nodes, &states, &pools[0]);
    let stuck: Vec<(&str, bool)> = same
        .stuck
        .iter()
        .map(|s| {
            (
                s.node.as_str(),
                s.reason.starts_with("failed (AllocationFailed"),
            )
        })
        .collect();
    assert_eq!(stuck, [("w-00", true)], "{:?}", same.stuck);
}

#[test]
fn estimates_come_from_each_nodes_last_measured_rate() {
    let nodes = fleet(2, &["dpdk"]);
    let mut pools = vec![with_max_unavailable(
        pool("p", 0, "dpdk", "2Mi", 100),
        IntOrString::Int(1),
    )];
    let mut states = rolled_out(&mut pools, &nodes);
    for (state, rate) in states.iter_mut().zip([50.0, 100.0]) {
        let reported = &mut fixtures::status_of(state).page_sizes[0];
        reported.last_resize = Some(hugepool_crds::node::ResizeSummary {
            pages_per_second: rate,
            ..Default::default()
        });
    }
    let bigger = resized(&pools[0], 300);
    let report = plan_of(&pools, &nodes, &states, &bigger);
    let estimates: Vec<Option<f64>> = report
        .waves
        .iter()
        .flatten()
        .map(|c| c.estimated_seconds)
        .collect();
    assert_eq!(estimates, [Some(4.0), Some(2.0)]);
    assert_eq!(
        report.estimated_seconds,
        Some(6.0),
        "one node a wave: they add up"
    );
}

#[test]
fn a_grow_is_predicted_per_node_from_its_agents_free_lists() {
    let nodes = fleet(3, &["dpdk"]);
    let mut pools = vec![pool("p", 0, "dpdk", "2Mi", 100)];
    let mut states = rolled_out(&mut pools, &nodes);
    let obtainable = |now, after_compaction| {
        Some(hugepool_crds::node::ObtainablePages {
            now,
            after_compaction,
        })
    };
    // Node 0 can take 500 more, node 1 only 120; node 2's agent says nothing.
    for (state, estimate) in states
        .iter_mut()
        .zip([obtainable(50, 500), obtainable(0, 120), None])
    {
        fixtures::status_of(state).page_sizes[0].obtainable = estimate;
    }
    let bigger = resized(&pools[0], 300);
    let report = plan_of(&pools, &nodes, &states, &bigger);
    let predicted: Vec<(&str, Option<i64>, Option<i64>)> = report
        .waves
        .iter()
        .flatten()
        .map(|c| (c.node.as_str(), c.predicted, c.short()))
        .collect();
    assert_eq!(
        predicted,
        [
            ("w-00", Some(300), None),
            ("w-01", Some(220), Some(80)),
            ("w-02", None, None)
        ]
    );
    let text = crate::plugin::render_plan(&report);
    assert!(text.contains("220 (short 80)"), "{text}");
    assert!(
        text.contains("1 node(s) predicted to come short by their agents' free lists (after compaction, within minMemAvailable): w-01 by 80"),
        "{text}"
    );

    // A shrink is not a grow: nothing predicted.
    let smaller = resized(&pools[0], 50);
    let report = plan_of(&pools, &nodes, &states, &smaller);
    assert!(report.waves.iter().flatten().all(|c| c.predicted.is_none()));
}

#[test]
fn a_split_target_is_predicted_per_numa_node() {
    let mut entry = PageSizeTarget::new(PageSize::SIZE_2MI, 200);
    entry.numa = Some(vec![
        hugepool_crds::settings::NumaTarget { id: 0, pages: 100 },
        hugepool_crds::settings::NumaTarget { id: 1, pages: 100 },
    ]);
    let numa = |id, total, after| NumaStatus {
        id,
        total,
        obtainable: Some(hugepool_crds::node::ObtainablePages {
            now: 0,
            after_compaction: after,
        }),
        ..NumaStatus::default()
    };
    let mut reported = PageSizeStatus::empty(PageSize::SIZE_2MI);
    reported.total = 150;
    // Node 0 has 50 and can take 20 more; node 1 is there already though
    // it could take nothing.
    reported.numa = vec![numa(0, 50, 20), numa(1, 100, 0)];
    assert_eq!(predicted_reach(&entry, Some(&reported)), Some(170));
    // A NUMA node that needs pages and reports no estimate: no prediction.
    reported.numa[0].obtainable = None;
    assert_eq!(predicted_reach(&entry, Some(&reported)), None);
    assert_eq!(predicted_reach(&entry, None), None);
}
