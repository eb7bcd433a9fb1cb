//! The operator and a fleet of in-process agents over simulated kernels on
//! the real control plane (issue 5, "Proven"): rollouts converge within
//! `maxUnavailable`, conflicts, relabelling, drains, allocation failures,
//! leader failover and Release deletion.
//!
//! No kubelet runs, so the tests play it: they force-delete evicted pods,
//! release the pages those pods held, and set pods Running/Ready for PDBs.

mod support;

use std::time::Duration;

use hugepool_e2e::setup;
use serde_json::json;
use support::{Fleet, FleetSpec};

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
