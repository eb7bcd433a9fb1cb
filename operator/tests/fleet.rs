//! The operator and a fleet of in-process agents over simulated kernels on
//! the real control plane (issue 5, "Proven"): rollouts converge within
//! `maxUnavailable`, conflicts, relabelling, drains, allocation failures,
//! leader failover and Release deletion.
//!
//! No kubelet runs, so the tests play it: they force-delete evicted pods,
//! release the pages those pods held, and set pods Running/Ready for PDBs.

mod support;

use std::time::Duration;

use hugepool_crds::{HugePageNode, HugePagePool, HugePagePoolStatus};
use hugepool_e2e::setup;
use serde_json::json;
use support::{Fleet, FleetSpec, wait_for};

const ROLE_LABEL: &str = "fleet.hugepool.dev/role";

fn pool_spec(
    scope: &str,
    role: &str,
    pages: i64,
    max_unavailable: serde_json::Value,
) -> serde_json::Value {
    json!({
        "nodeSelector": {"matchLabels": {support::SCOPE_LABEL: scope, ROLE_LABEL: role}},
        "pageSize": "2Mi",
        "pages": pages,
        "resize": {"maxStepDuration": "50ms", "stepPause": "5ms", "stallThreshold": "2s"},
        "rollout": {"maxUnavailable": max_unavailable},
    })
}

/// Grows a pool on 50 nodes with an integer `maxUnavailable`, then shrinks
/// it with a percentage; a watcher of every HugePageNode never sees more
/// nodes changing than the limit, and every kernel ends at the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_then_shrink_converges_within_max_unavailable() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(&env, "grow", FleetSpec::new(50).label(ROLE_LABEL, "dpdk")).await;
    let names = fleet.node_names();
    let mut watch = fleet.watch_rollout(7);
    watch.synced().await;
    fleet.start_operator(None).await;

    let scope = fleet.scope.clone();
    let pool = format!("{scope}-pool");
    fleet
        .create_pool(&pool, pool_spec(&scope, "dpdk", 2048, json!(7)))
        .await;
    let grown = fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(90), |p| {
            let nodes = &p
                .status
                .as_ref()
                .map(|s| s.nodes.clone())
                .unwrap_or_default();
            (nodes.selected == 50 && nodes.converged == 50)
                .then_some(())
                .ok_or_else(|| format!("nodes {nodes:?}"))
        })
        .await;
    let status = grown.status.clone().unwrap_or_default();
    assert_eq!(status.pages.target, 50 * 2048);
    assert_eq!(status.pages.current, 50 * 2048);
    fleet
        .wait_kernels(&names, 2048, Duration::from_secs(5))
        .await;
    let record = watch.assert_bounded();
    let key = (pool.clone(), "2Mi".to_string());
    let grow_max = record.max_changing.get(&key).copied().unwrap_or_default();
    assert!(
        (2..=7).contains(&grow_max),
        "the grow ran up to {grow_max} nodes at once; expected several, at most 7"
    );

    // 25% of 50 rounds up to 13. Nothing is changing now, so the watcher's
    // bound can move before the pool does.
    watch.set_limit(13);
    fleet
        .patch_pool(
            &pool,
            json!({"pages": 512, "rollout": {"maxUnavailable": "25%"}}),
        )
        .await;
    let shrunk = fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(90), |p| {
            let status = p.status.clone().unwrap_or_default();
            (status.nodes.converged == 50 && status.pages.current == 50 * 512)
                .then_some(())
                .ok_or_else(|| format!("{:?}", status.nodes))
        })
        .await;
    let conditions = &shrunk
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let progressing = support::condition(conditions, "Progressing").expect("Progressing");
    assert_eq!(progressing.status, "False", "{progressing:?}");
    let degraded = support::condition(conditions, "Degraded").expect("Degraded");
    assert_eq!(degraded.status, "False", "{degraded:?}");
    fleet
        .wait_kernels(&names, 512, Duration::from_secs(5))
        .await;
    let record = watch.assert_bounded();
    let shrink_max = record.max_changing.get(&key).copied().unwrap_or_default();
    assert!(
        shrink_max > 7,
        "the shrink never ran more than 7 nodes at once ({shrink_max}): the percentage was not used"
    );
    eprintln!(
        "grow/shrink: {} views, at most {grow_max} then {shrink_max} nodes changing",
        record.views
    );
    drop(watch);
    fleet.shutdown().await;
}

fn selector(scope: &str, key: &str) -> serde_json::Value {
    json!({"matchLabels": {support::SCOPE_LABEL: scope, key: "true"}})
}

fn status_of(pool: &HugePagePool) -> HugePagePoolStatus {
    pool.status.clone().unwrap_or_default()
}

fn reason_of(pool: &HugePagePool, type_: &str) -> (String, String, String) {
    let status = status_of(pool);
    support::condition(&status.conditions, type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

/// The pool named on the node's `size` entry, if any.
fn entry_pool(state: &HugePageNode, size: &str) -> Option<(String, i64)> {
    state
        .spec
        .page_sizes
        .iter()
        .find(|e| e.size == size)
        .map(|e| (e.pool.clone(), e.pages))
}

/// Two pools select four nodes in common: the older keeps them and its
/// targets are the ones written; the newer reports Degraded/Conflict
/// naming exactly those nodes and converges only on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_pools_older_wins_newer_reports_conflict() {
    let Some(env) = setup().await else { return };
    // Nodes 0-7 are in pool a, 4-9 in pool b: 4-7 are shared.
    let spec = FleetSpec::new(10)
        .label_nodes(0..8, "fleet.hugepool.dev/a", "true")
        .label_nodes(4..10, "fleet.hugepool.dev/b", "true");
    let mut fleet = Fleet::start(&env, "overlap", spec).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let (older, newer) = (format!("{scope}-a"), format!("{scope}-b"));
    fleet
        .create_pool(
            &older,
            json!({"nodeSelector": selector(&scope, "fleet.hugepool.dev/a"), "pageSize": "2Mi",
                   "pages": 1024, "rollout": {"maxUnavailable": "50%"}}),
        )
        .await;
    // Creation timestamps have a resolution of a second; the name breaks
    // a tie the same way ("-a" < "-b").
    fleet
        .create_pool(
            &newer,
            json!({"nodeSelector": selector(&scope, "fleet.hugepool.dev/b"), "pageSize": "2Mi",
                   "pages": 256, "rollout": {"maxUnavailable": "50%"}}),
        )
        .await;

    fleet
        .wait_pool(&older, "Available", "True", Duration::from_secs(60), |p| {
            let nodes = status_of(p).nodes;
            (nodes.converged == 8)
                .then_some(())
                .ok_or(format!("{nodes:?}"))
        })
        .await;
    let shared: Vec<String> = (4..8).map(|i| fleet.node_name(i)).collect();
    let conflicted = fleet
        .wait_pool(&newer, "Degraded", "True", Duration::from_secs(60), |p| {
            let nodes = status_of(p).nodes;
            let (_, reason, _) = reason_of(p, "Degraded");
            (reason == "Conflict" && nodes.converged == 2)
                .then_some(())
                .ok_or(format!("{reason} {nodes:?}"))
        })
        .await;
    let (_, _, message) = reason_of(&conflicted, "Degraded");
    for name in &shared {
        assert!(
            message.contains(name.as_str()),
            "Conflict names {name}: {message}"
        );
    }
    for other in [0, 1, 2, 3, 8, 9].map(|i| fleet.node_name(i)) {
        assert!(
            !message.contains(&format!("{other},")) && !message.ends_with(&other),
            "{message}"
        );
    }
    let (available, _, _) = reason_of(&conflicted, "Available");
    assert_eq!(available, "False");
    assert_eq!(status_of(&conflicted).nodes.selected, 6);

    let own: Vec<String> = (0..8).map(|i| fleet.node_name(i)).collect();
    fleet
        .wait_kernels(&own, 1024, Duration::from_secs(10))
        .await;
    let newer_only: Vec<String> = (8..10).map(|i| fleet.node_name(i)).collect();
    fleet
        .wait_kernels(&newer_only, 256, Duration::from_secs(10))
        .await;
    for name in &shared {
        let state = fleet.node_state(name).await;
        assert_eq!(
            entry_pool(&state, "2Mi"),
            Some((older.clone(), 1024)),
            "{name}"
        );
    }
    fleet.shutdown().await;
}

/// Relabelling moves nodes out of and into pools: a Retain pool drops the
/// node's entry and leaves its pages; a Release pool shrinks it to 0 first;
/// a node labelled back in grows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relabelled_nodes_leave_and_join_as_deletion_policy_says() {
    let Some(env) = setup().await else { return };
    let spec = FleetSpec::new(6)
        .label_nodes(0..3, "fleet.hugepool.dev/retain", "true")
        .label_nodes(3..6, "fleet.hugepool.dev/release", "true");
    let mut fleet = Fleet::start(&env, "relabel", spec).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let (retain, release) = (format!("{scope}-retain"), format!("{scope}-release"));
    for (pool, key, policy) in [
        (&retain, "fleet.hugepool.dev/retain", "Retain"),
        (&release, "fleet.hugepool.dev/release", "Release"),
    ] {
        fleet
            .create_pool(
                pool,
                json!({"nodeSelector": selector(&scope, key), "pageSize": "2Mi", "pages": 512,
                       "deletionPolicy": policy, "rollout": {"maxUnavailable": 3}}),
            )
            .await;
    }
    for pool in [&retain, &release] {
        fleet
            .wait_pool(pool, "Available", "True", Duration::from_secs(60), |p| {
                let nodes = status_of(p).nodes;
                (nodes.converged == 3)
                    .then_some(())
                    .ok_or(format!("{nodes:?}"))
            })
            .await;
    }
    fleet
        .wait_kernels(&fleet.node_names(), 512, Duration::from_secs(10))
        .await;

    let (kept, released) = (fleet.node_name(0), fleet.node_name(3));
    fleet
        .label_node(&kept, json!({"fleet.hugepool.dev/retain": null}))
        .await;
    fleet
        .label_node(&released, json!({"fleet.hugepool.dev/release": null}))
        .await;

    // Retain: the entry goes and the kernel keeps its pages.
    wait_for(
        "the Retain entry removed",
        Duration::from_secs(30),
        || async {
            let state = fleet.node_state(&kept).await;
            match entry_pool(&state, "2Mi") {
                None => Ok(()),
                Some(entry) => Err(format!("{entry:?}")),
            }
        },
    )
    .await;
    assert_eq!(fleet.node(&kept).pages_2mi(), (512, 0));
    // Release: the entry goes only once the kernel is at 0.
    wait_for(
        "the Release entry removed",
        Duration::from_secs(30),
        || async {
            let state = fleet.node_state(&released).await;
            match entry_pool(&state, "2Mi") {
                None => Ok(()),
                Some(entry) => Err(format!("{entry:?}")),
            }
        },
    )
    .await;
    assert_eq!(
        fleet.node(&released).pages_2mi(),
        (0, 0),
        "released before the entry went"
    );
    for (pool, converged) in [(&retain, 2), (&release, 2)] {
        fleet
            .wait_pool(pool, "Available", "True", Duration::from_secs(30), |p| {
                let nodes = status_of(p).nodes;
                (nodes.selected == 2 && nodes.converged == converged)
                    .then_some(())
                    .ok_or(format!("{nodes:?}"))
            })
            .await;
    }

    // Labelled back in: the Release node grows again.
    fleet
        .label_node(&released, json!({"fleet.hugepool.dev/release": "true"}))
        .await;
    fleet
        .wait_pool(
            &release,
            "Available",
            "True",
            Duration::from_secs(30),
            |p| {
                let nodes = status_of(p).nodes;
                (nodes.converged == 3)
                    .then_some(())
                    .ok_or(format!("{nodes:?}"))
            },
        )
        .await;
    fleet
        .wait_kernels(&[released.clone()], 512, Duration::from_secs(10))
        .await;
    // The other pools' nodes were never touched.
    for index in [1, 2, 4, 5] {
        assert_eq!(fleet.node(&fleet.node_name(index)).pages_2mi(), (512, 0));
    }
    fleet.shutdown().await;
}
