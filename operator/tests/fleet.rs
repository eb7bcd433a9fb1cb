//! The operator and a fleet of in-process agents over simulated kernels on
//! the real control plane (issue 5, "Proven"): rollouts converge within
//! `maxUnavailable`, conflicts, relabelling, drains, allocation failures,
//! leader failover and Release deletion.
//!
//! No kubelet runs, so the tests play it: they force-delete evicted pods,
//! release the pages those pods held, and set pods Running/Ready for PDBs.

#[allow(dead_code)]
mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hugepool_crds::{HugePageNode, HugePagePool, HugePagePoolStatus, PageSize};
use hugepool_e2e::setup;
use hugepool_operator::LeaderConfig;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Fleet, FleetSpec, MI2, ROLE_LABEL, lease_holder, play_kubelet, pool_spec, wait_for};

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
    // At most 7 at once (how many at least depends on how fast a node
    // grows here: the shrink below, made slow, shows the waves).
    let key = (pool.clone(), MI2);
    let grow_max = watch
        .assert_bounded()
        .max_changing
        .get(&key)
        .copied()
        .unwrap_or_default();

    // 25% of 50 rounds up to 13. Nothing is changing now, so the watcher's
    // bound can move before the pool does. Each node's shrink is made to
    // last seconds (a first shrink starts from a 32 MiB probe and doubles:
    // 7 writes, 1 s apart), far longer than the operator takes to admit a
    // wave, so a wave is seen changing together however fast or loaded the
    // machine is.
    watch.set_limit(13);
    fleet
        .patch_pool(
            &pool,
            json!({
                "pages": 512,
                "rollout": {"maxUnavailable": "25%"},
                "resize": {"maxStepDuration": "50ms", "stepPause": "1s", "stallThreshold": "2s"},
            }),
        )
        .await;
    let shrunk = fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(300), |p| {
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

/// The pool's failed nodes as (name, reason).
fn failed_of(pool: &HugePagePool) -> Vec<(String, String)> {
    status_of(pool)
        .failed_nodes
        .iter()
        .map(|f| (f.name.clone(), f.reason.clone()))
        .collect()
}

fn reason_of(pool: &HugePagePool, type_: &str) -> (String, String, String) {
    let status = status_of(pool);
    support::condition(&status.conditions, type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

/// The pool named on the node's `size` entry, if any.
fn entry_pool(state: &HugePageNode, size: PageSize) -> Option<(String, i64)> {
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
            entry_pool(&state, MI2),
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
            match entry_pool(&state, MI2) {
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
            match entry_pool(&state, MI2) {
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
        .wait_kernels(
            std::slice::from_ref(&released),
            512,
            Duration::from_secs(10),
        )
        .await;
    // The other pools' nodes were never touched.
    for index in [1, 2, 4, 5] {
        assert_eq!(fleet.node(&fleet.node_name(index)).pages_2mi(), (512, 0));
    }
    fleet.shutdown().await;
}

/// A fleet of `nodes` with the operator running and a 512-page pool that
/// drains (policy IfNeeded, `timeout`) at most `max_unavailable` nodes at
/// once, Available; returns the fleet, its scope and the pool's name.
async fn drain_fleet(
    env: &hugepool_e2e::TestEnv,
    prefix: &str,
    nodes: usize,
    max_unavailable: i64,
    timeout: &str,
) -> (Fleet, String, String) {
    let mut fleet =
        Fleet::start(env, prefix, FleetSpec::new(nodes).label(ROLE_LABEL, "dpdk")).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let pool = format!("{scope}-pool");
    let mut spec = pool_spec(&scope, "dpdk", 512, json!(max_unavailable));
    spec["drain"] = json!({"policy": "IfNeeded", "timeout": timeout});
    fleet.create_pool(&pool, spec).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |_| {
            Ok(())
        })
        .await;
    (fleet, scope, pool)
}

/// A node whose shrink is blocked by pages in use is drained: the pods that
/// request hugepages-2Mi on it are evicted while it carries the draining
/// taint, a pod without hugepages and a consumer on a node that is not
/// blocked stay; once the pages are released the node converges and the
/// taint goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_shrink_drains_hugepage_consumers_under_taint() {
    let Some(env) = setup().await else { return };
    let (fleet, scope, pool) = drain_fleet(&env, "drain", 3, 1, "60s").await;

    let (blocked, free) = (fleet.node_name(0), fleet.node_name(1));
    assert_eq!(
        fleet
            .node(&blocked)
            .kernel
            .hold_pages(MI2, 0, 300)
            .expect("hold"),
        300
    );
    support::create_namespace(&fleet.client, &scope).await;
    for pod in [
        support::pod("consumer", &blocked, "dpdk", Some("600Mi")),
        support::pod("bystander", &blocked, "web", None),
        support::pod("elsewhere", &free, "dpdk", Some("600Mi")),
    ] {
        support::run_pod(&fleet.client, &scope, pod).await;
    }
    let (kubelet, kubelet_task) = play_kubelet(
        &fleet,
        &scope,
        vec![("consumer".into(), blocked.clone(), 300)],
    );

    fleet.patch_pool(&pool, json!({"pages": 100})).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |p| {
            let status = status_of(p);
            (status.nodes.converged == 3 && status.pages.current == 300)
                .then_some(())
                .ok_or(format!("{:?}", status.nodes))
        })
        .await;
    let evicted = kubelet
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .evicted
        .clone();
    assert_eq!(
        evicted,
        vec![("consumer".to_string(), true)],
        "evicted under the taint"
    );
    let pods: Api<Pod> = Api::namespaced(fleet.client.clone(), &scope);
    for name in ["bystander", "elsewhere"] {
        let pod = pods.get(name).await.expect("pod still there");
        assert!(
            pod.metadata.deletion_timestamp.is_none(),
            "{name} was not evicted"
        );
    }
    wait_for(
        "the draining taint removed",
        Duration::from_secs(10),
        || async {
            let node = fleet.node_object(&blocked).await;
            (!support::has_drain_taint(&node))
                .then_some(())
                .ok_or("still tainted".to_string())
        },
    )
    .await;
    let state = fleet.node_state(&blocked).await;
    let draining = state
        .status
        .as_ref()
        .and_then(|s| support::condition(&s.conditions, "Draining"))
        .cloned();
    let draining = draining.expect("Draining condition");
    assert_eq!(
        (draining.status.as_str(), draining.reason.as_str()),
        ("False", "DrainComplete")
    );
    fleet
        .wait_kernels(&fleet.node_names(), 100, Duration::from_secs(10))
        .await;
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// A shrink blocked on one NUMA node only drains: 150 pages in use on NUMA
/// node 0 of a node whose targets go from 200 + 200 to 100 + 100 (node-wide
/// the 150 fit in 200; NUMA node 0's 100 cannot hold them). The consumer is
/// evicted under the taint, its pages come back, and each NUMA node reaches
/// its own target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shrink_blocked_on_one_numa_node_drains_its_consumer() {
    let Some(env) = setup().await else { return };
    let spec = FleetSpec::new(1)
        .label(ROLE_LABEL, "dpdk")
        .numa_nodes(0..1, &[4 * support::GIB, 4 * support::GIB]);
    let mut fleet = Fleet::start(&env, "numa-drain", spec).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let pool = format!("{scope}-pool");
    let explicit = |per_node: i64| {
        let mut spec = pool_spec(&scope, "dpdk", 2 * per_node, json!(1));
        spec["numa"] = json!({
            "policy": "Explicit",
            "nodes": [{"id": 0, "pages": per_node}, {"id": 1, "pages": per_node}],
        });
        spec["drain"] = json!({"policy": "IfNeeded", "timeout": "60s"});
        spec
    };
    fleet.create_pool(&pool, explicit(200)).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |_| {
            Ok(())
        })
        .await;
    let node = fleet.node_name(0);
    assert_eq!(fleet.node(&node).numa_pages_2mi(), [(0, 200), (1, 200)]);
    assert_eq!(
        fleet
            .node(&node)
            .kernel
            .hold_pages(MI2, 0, 150)
            .expect("hold"),
        150
    );
    support::create_namespace(&fleet.client, &scope).await;
    support::run_pod(
        &fleet.client,
        &scope,
        support::pod("consumer", &node, "dpdk", Some("300Mi")),
    )
    .await;
    let (kubelet, kubelet_task) =
        play_kubelet(&fleet, &scope, vec![("consumer".into(), node.clone(), 150)]);

    let mut shrink = explicit(100);
    shrink.as_object_mut().expect("spec").remove("nodeSelector");
    fleet.patch_pool(&pool, shrink).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(90), |p| {
            let status = status_of(p);
            (status.nodes.converged == 1 && status.pages.current == 200)
                .then_some(())
                .ok_or(format!("{:?} {:?}", status.nodes, status.pages))
        })
        .await;
    let evicted = kubelet
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .evicted
        .clone();
    assert_eq!(
        evicted,
        vec![("consumer".to_string(), true)],
        "evicted under the taint"
    );
    assert_eq!(fleet.node(&node).numa_pages_2mi(), [(0, 100), (1, 100)]);
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// A drain evicts the fewest pods that free what the shrink needs: of three
/// consumers (8, 32 and 16 pages) a shrink that must free 30 pages evicts
/// only the 32-page one; pages no pod's requests explain evict nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_evicts_the_fewest_pods_and_never_more_than_the_pods_explain() {
    let Some(env) = setup().await else { return };
    let (fleet, scope, pool) = drain_fleet(&env, "fewest", 2, 2, "60s").await;
    let (consumers, unexplained) = (fleet.node_name(0), fleet.node_name(1));
    // Node 0: pods hold 56 pages; node 1: 40 pages held by no pod.
    fleet
        .node(&consumers)
        .kernel
        .hold_pages(MI2, 0, 56)
        .expect("hold");
    fleet
        .node(&unexplained)
        .kernel
        .hold_pages(MI2, 0, 40)
        .expect("hold");
    support::create_namespace(&fleet.client, &scope).await;
    for (name, bytes) in [("small", "16Mi"), ("large", "64Mi"), ("medium", "32Mi")] {
        support::run_pod(
            &fleet.client,
            &scope,
            support::pod(name, &consumers, "dpdk", Some(bytes)),
        )
        .await;
    }
    let (kubelet, kubelet_task) = play_kubelet(
        &fleet,
        &scope,
        vec![
            ("small".into(), consumers.clone(), 8),
            ("large".into(), consumers.clone(), 32),
            ("medium".into(), consumers.clone(), 16),
        ],
    );
    // Down to 26 pages: node 0 must free 56 - 26 = 30.
    fleet.patch_pool(&pool, json!({"pages": 26})).await;
    wait_for("node 0 shrunk to 26", Duration::from_secs(90), || async {
        let (total, _) = fleet.node(&consumers).pages_2mi();
        (total == 26).then_some(()).ok_or(format!("pool {total}"))
    })
    .await;
    let evicted: Vec<String> = kubelet
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .evicted
        .iter()
        .map(|(name, _)| name.clone())
        .collect();
    assert_eq!(evicted, ["large"], "only the pod that alone frees 30 pages");
    // The pool's status names it, with its node, its pages and why.
    let listed = wait_for(
        "the pool's status lists the evicted pod",
        Duration::from_secs(60),
        || async {
            let listed = fleet
                .pool(&pool)
                .await
                .status
                .unwrap_or_default()
                .evicted_pods;
            (!listed.is_empty())
                .then_some(listed.clone())
                .ok_or(format!("{listed:?}"))
        },
    )
    .await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (
            listed[0].pod.as_str(),
            listed[0].node.as_str(),
            listed[0].pages
        ),
        (format!("{scope}/large").as_str(), consumers.as_str(), 32),
    );
    assert_eq!(
        listed[0].reason,
        format!("held 32 pages; the shrink of {consumers} needed 30 of 2Mi back")
    );
    assert!(listed[0].evicted_at.is_some());
    // Node 1's 40 pages are held by no pod: the drain says so and waits.
    let state = wait_for(
        "node 1 says why it evicts nothing",
        Duration::from_secs(60),
        || async {
            let state = fleet.node_state(&unexplained).await;
            let draining = state
                .status
                .as_ref()
                .and_then(|s| support::condition(&s.conditions, "Draining"))
                .cloned();
            match draining {
                Some(c) if c.message.contains("not evicting") => Ok(c),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(
        state
            .message
            .contains("pods on the node request or claim 0 pages of 2Mi, but 14 must be freed"),
        "{}",
        state.message
    );
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// A PodDisruptionBudget that allows no disruption keeps the consumer in
/// place: the drain gives up after `drain.timeout`, the taint goes, and the
/// pool reports DrainTimeout with the node in `failedNodes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_blocked_by_pdb_times_out() {
    let Some(env) = setup().await else { return };
    let (fleet, scope, pool) = drain_fleet(&env, "pdb", 2, 1, "5s").await;

    let blocked = fleet.node_name(0);
    assert_eq!(
        fleet
            .node(&blocked)
            .kernel
            .hold_pages(MI2, 0, 300)
            .expect("hold"),
        300
    );
    support::create_namespace(&fleet.client, &scope).await;
    support::run_pod(
        &fleet.client,
        &scope,
        support::pod("guarded", &blocked, "guarded", Some("600Mi")),
    )
    .await;
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "guarded"}}},
    }))
    .expect("PDB object");
    Api::<PodDisruptionBudget>::namespaced(fleet.client.clone(), &scope)
        .create(&PostParams::default(), &pdb)
        .await
        .expect("create PDB");
    let (kubelet, kubelet_task) = play_kubelet(
        &fleet,
        &scope,
        vec![("guarded".into(), blocked.clone(), 300)],
    );

    fleet.patch_pool(&pool, json!({"pages": 100})).await;
    let timed_out = fleet
        .wait_pool(&pool, "Degraded", "True", Duration::from_secs(40), |p| {
            let (_, reason, _) = reason_of(p, "Degraded");
            (reason == "DrainTimeout").then_some(()).ok_or(reason)
        })
        .await;
    let failed = failed_of(&timed_out);
    assert_eq!(failed, vec![(blocked.clone(), "DrainTimeout".to_string())]);
    let (_, _, message) = reason_of(&timed_out, "Degraded");
    assert!(message.contains(&blocked), "{message}");
    let (_, progressing, _) = reason_of(&timed_out, "Progressing");
    assert_eq!(
        progressing, "RolloutHalted",
        "one failed node reaches maxUnavailable 1"
    );
    wait_for(
        "the draining taint removed",
        Duration::from_secs(10),
        || async {
            let node = fleet.node_object(&blocked).await;
            (!support::has_drain_taint(&node))
                .then_some(())
                .ok_or("still tainted".to_string())
        },
    )
    .await;
    let pod = Api::<Pod>::namespaced(fleet.client.clone(), &scope)
        .get("guarded")
        .await
        .expect("pod");
    assert!(
        pod.metadata.deletion_timestamp.is_none(),
        "the PDB kept the pod"
    );
    assert!(
        kubelet
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .evicted
            .is_empty()
    );
    // The kernel kept the pages in use; the other node waits for the halt.
    assert_eq!(fleet.node(&blocked).pages_2mi().0, 300);
    assert_eq!(fleet.node(&fleet.node_name(1)).pages_2mi(), (512, 0));
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// Two nodes with too little memory for the target come up short: with
/// `maxUnavailable: 2` their failures halt the rollout (the other nodes are
/// not touched), `status.failedNodes` names them; a target they can reach
/// clears the halt and the pool converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_failures_halt_the_rollout_at_max_unavailable() {
    let Some(env) = setup().await else { return };
    // 1024 x 2Mi is 2 GiB: no room on a 2 GiB node.
    let spec = FleetSpec::new(8)
        .label(ROLE_LABEL, "dpdk")
        .node_memory(0, 2 * support::GIB)
        .node_memory(1, 2 * support::GIB);
    let mut fleet = Fleet::start(&env, "short", spec).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let pool = format!("{scope}-pool");
    fleet
        .create_pool(&pool, pool_spec(&scope, "dpdk", 1024, json!(2)))
        .await;
    let short: Vec<String> = (0..2).map(|i| fleet.node_name(i)).collect();
    let halted = fleet
        .wait_pool(&pool, "Degraded", "True", Duration::from_secs(60), |p| {
            let (_, reason, _) = reason_of(p, "Degraded");
            (reason == "RolloutHalted").then_some(()).ok_or(reason)
        })
        .await;
    let status = status_of(&halted);
    let failed = failed_of(&halted);
    let expected: Vec<(String, String)> = short
        .iter()
        .map(|n| (n.clone(), "AllocationFailed".to_string()))
        .collect();
    assert_eq!(failed, expected);
    assert_eq!(status.nodes.failed, 2);
    assert_eq!(status.nodes.pending, 6);
    let (progressing, reason, _) = reason_of(&halted, "Progressing");
    assert_eq!(
        (progressing.as_str(), reason.as_str()),
        ("False", "RolloutHalted")
    );
    let (_, _, message) = reason_of(&halted, "Degraded");
    for name in &short {
        assert!(
            message.contains(name.as_str()),
            "Degraded names {name}: {message}"
        );
    }
    for name in &short {
        let (persistent, _) = fleet.node(name).pages_2mi();
        assert!(persistent < 1024, "{name} came up short: {persistent}");
    }
    // Halted: the rest of the fleet was never given the target.
    for index in 2..8 {
        let name = fleet.node_name(index);
        assert_eq!(fleet.node(&name).pages_2mi(), (0, 0), "{name}");
        assert_eq!(
            entry_pool(&fleet.node_state(&name).await, MI2),
            None,
            "{name}"
        );
    }

    // 256 x 2Mi fits everywhere: the new target clears the halt.
    fleet.patch_pool(&pool, json!({"pages": 256})).await;
    let recovered = fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |p| {
            let nodes = status_of(p).nodes;
            (nodes.converged == 8)
                .then_some(())
                .ok_or(format!("{nodes:?}"))
        })
        .await;
    assert!(status_of(&recovered).failed_nodes.is_empty());
    fleet
        .wait_kernels(&fleet.node_names(), 256, Duration::from_secs(10))
        .await;
    fleet.shutdown().await;
}

/// The Lease holder of `namespace/name`.
/// Two operator replicas with leader election; the leader is killed mid-
/// rollout (its runtime dropped, the Lease left to expire): the other takes
/// over, the rollout finishes, and no view of the fleet ever has more than
/// `maxUnavailable` nodes changing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_mid_rollout_the_other_replica_finishes_within_bound() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(&env, "ha", FleetSpec::new(20).label(ROLE_LABEL, "dpdk")).await;
    let scope = fleet.scope.clone();
    support::create_namespace(&fleet.client, &scope).await;
    let lease = "hugepool-operator".to_string();
    let identities: Vec<String> = (0..2).map(|i| format!("{scope}-replica-{i}")).collect();
    for identity in &identities {
        fleet
            .start_operator(Some(LeaderConfig {
                namespace: scope.clone(),
                lease_name: lease.clone(),
                identity: identity.clone(),
                duration: Duration::from_secs(3),
                grace: Duration::from_secs(1),
            }))
            .await;
    }
    let leader = wait_for("a leader", Duration::from_secs(30), || async {
        lease_holder(&fleet.client, &scope, &lease)
            .await
            .ok_or("no holder".to_string())
    })
    .await;
    let leader_index = identities
        .iter()
        .position(|i| *i == leader)
        .expect("the leader is one of ours");

    let mut watch = fleet.watch_rollout(4);
    watch.synced().await;
    let pool = format!("{scope}-pool");
    fleet
        .create_pool(&pool, pool_spec(&scope, "dpdk", 2048, json!(4)))
        .await;
    let converged_at_kill = wait_for("the rollout under way", Duration::from_secs(60), || async {
        let nodes = status_of(&fleet.pool(&pool).await).nodes;
        (nodes.converged >= 4)
            .then_some(nodes.converged)
            .ok_or(format!("{nodes:?}"))
    })
    .await;
    fleet.take_operator(leader_index).kill().await;
    assert!(
        converged_at_kill < 20,
        "killed mid-rollout ({converged_at_kill}/20)"
    );

    let survivor = identities[1 - leader_index].clone();
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |p| {
            let nodes = status_of(p).nodes;
            (nodes.converged == 20)
                .then_some(())
                .ok_or(format!("{nodes:?}"))
        })
        .await;
    assert_eq!(
        lease_holder(&fleet.client, &scope, &lease).await,
        Some(survivor)
    );
    fleet
        .wait_kernels(&fleet.node_names(), 2048, Duration::from_secs(10))
        .await;
    // Never more than 4 changing, across the handover too.
    watch.assert_bounded();
    drop(watch);
    let client = fleet.client.clone();
    // Stopped (as by SIGTERM), the survivor gives its Lease up at once.
    fleet.shutdown().await;
    assert_eq!(
        lease_holder(&client, &scope, &lease).await,
        None,
        "Lease released"
    );
    support::delete_namespace(&client, &scope).await;
}

/// A replica that loses the Lease stops publishing its pools: a former
/// leader's stale `hugepool_pool_nodes{state="failed"}` would keep
/// HugepoolPoolNodesFailed firing after the new leader saw the node recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_loses_the_lease_drops_its_pool_metrics() {
    let Some(env) = setup().await else { return };
    // 1024 x 2Mi is 2 GiB: no room on node 0, so the pool has a failed node.
    let spec = FleetSpec::new(3)
        .label(ROLE_LABEL, "dpdk")
        .node_memory(0, 2 * support::GIB);
    let mut fleet = Fleet::start(&env, "lease-metrics", spec).await;
    let scope = fleet.scope.clone();
    let support::LeadingReplica {
        lease,
        identity,
        addr,
    } = fleet.start_leading_replica().await;
    let pool = format!("{scope}-pool");
    fleet
        .create_pool(&pool, pool_spec(&scope, "dpdk", 1024, json!(3)))
        .await;
    let failed_series = format!(r#"hugepool_pool_nodes{{pool="{pool}",state="failed"}}"#);
    let scrape = || hugepool_e2e::http_get(&addr, "/metrics");
    wait_for(
        "the leader publishes one failed node",
        Duration::from_secs(120),
        || async {
            let text = scrape()?;
            text.contains(&format!("{failed_series} 1"))
                .then_some(())
                .ok_or(text)
        },
    )
    .await;
    assert_eq!(
        lease_holder(&fleet.client, &scope, &lease).await,
        Some(identity)
    );

    // Another holder takes the Lease for an hour, as a new leader would.
    let leases = Api::<Lease>::namespaced(fleet.client.clone(), &scope);
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(jiff::Timestamp::now());
    leases
        .patch(
            &lease,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {
                "holderIdentity": "another-replica",
                "leaseDurationSeconds": 3600,
                "acquireTime": now,
                "renewTime": now,
            }})),
        )
        .await
        .expect("take the Lease");
    let text = wait_for(
        "the former leader drops its pool series",
        Duration::from_secs(120),
        || async {
            let text = scrape()?;
            (text.contains("hugepool_leader 0") && !text.contains("hugepool_pool_nodes{"))
                .then_some(text.clone())
                .ok_or(text)
        },
    )
    .await;
    assert!(!text.contains("hugepool_pool_pages{"), "{text}");
    assert!(!text.contains(&failed_series), "{text}");
    assert_eq!(
        lease_holder(&fleet.client, &scope, &lease).await.as_deref(),
        Some("another-replica"),
        "the replica did not take the Lease back"
    );
    let client = fleet.client.clone();
    fleet.shutdown().await;
    support::delete_namespace(&client, &scope).await;
}

/// Refuses every renewal of `namespace`'s Leases by `identity` (a
/// ValidatingAdmissionPolicy on the real apiserver), as a leader cut off
/// from the apiserver, or paused past its Lease, would fail to renew; other
/// writes pass. Returns the policy's name (the binding shares it).
async fn refuse_renewals(client: &kube::Client, namespace: &str, identity: &str) -> String {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let name = format!("{namespace}-refuse-renewals");
    let held_by = |object: &str| {
        format!("has({object}.spec.holderIdentity) && {object}.spec.holderIdentity == '{identity}'")
    };
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["coordination.k8s.io"],
                "apiVersions": ["v1"],
                "operations": ["UPDATE"],
                "resources": ["leases"],
            }]},
            "validations": [{
                "expression": format!("!({} && {})", held_by("oldObject"), held_by("object")),
                "message": "renewals refused by the test",
            }],
        },
    }))
    .expect("policy");
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": namespace,
            }}},
        },
    }))
    .expect("binding");
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .expect("create the policy");
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .expect("create the binding");
    name
}

/// Undoes `refuse_renewals`.
async fn allow_renewals(client: &kube::Client, name: &str) {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete the binding");
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete the policy");
}

/// A leader whose renewals fail stops writing once its last renewal runs
/// out, although nobody else has taken the Lease (the Lease manager alone
/// would go on believing it leads, and writing, for as long as renewals
/// fail); renewals back, it leads and writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_renewals_fail_stops_writing_when_its_lease_runs_out() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(&env, "fence", FleetSpec::new(2).label(ROLE_LABEL, "dpdk")).await;
    let scope = fleet.scope.clone();
    let support::LeadingReplica {
        lease,
        identity,
        addr,
    } = fleet.start_leading_replica().await;
    let leading = |value: u8| {
        let addr = addr.clone();
        move || {
            let addr = addr.clone();
            async move {
                let text = hugepool_e2e::http_get(&addr, "/metrics")?;
                text.contains(&format!("\nhugepool_leader {value}\n"))
                    .then_some(())
                    .ok_or(text)
            }
        }
    };
    wait_for("the replica leads", Duration::from_secs(60), leading(1)).await;
    let pool = format!("{scope}-pool");
    fleet
        .create_pool(&pool, pool_spec(&scope, "dpdk", 64, json!(2)))
        .await;
    let names = fleet.node_names();
    fleet
        .wait_kernels(&names, 64, Duration::from_secs(60))
        .await;

    let policy = refuse_renewals(&fleet.client, &scope, &identity).await;
    wait_for(
        "the leader fenced: its renewals refused, its Lease run out",
        Duration::from_secs(60),
        leading(0),
    )
    .await;
    // Nobody took the Lease: only the fence stops this replica.
    assert_eq!(
        lease_holder(&fleet.client, &scope, &lease).await,
        Some(identity.clone())
    );
    let generation = fleet.patch_pool(&pool, json!({"pages": 128})).await;
    // The fence holds across a second boundary after the change: a write
    // made while fenced carries an earlier second (in the object's
    // managedFields) than any write once renewals are allowed again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for name in &names {
        let spec = fleet.node_state(name).await.spec;
        assert!(
            spec.page_sizes.iter().all(|e| e.pages == 64),
            "{name} written while fenced: {spec:?}"
        );
    }
    assert_eq!(fleet.node(&names[0]).pages_2mi(), (64, 0));
    assert_ne!(
        fleet
            .pool(&pool)
            .await
            .status
            .and_then(|s| s.observed_generation),
        Some(generation),
        "pool status written while fenced"
    );

    let allowed = jiff::Timestamp::now();
    allow_renewals(&fleet.client, &policy).await;
    wait_for(
        "the replica leads again",
        Duration::from_secs(60),
        leading(1),
    )
    .await;
    fleet
        .wait_kernels(&names, 128, Duration::from_secs(60))
        .await;
    // Every spec of 128 was written once renewals came back, not before.
    let allowed_second = allowed.as_second();
    for name in &names {
        let api: Api<HugePageNode> = Api::all(fleet.client.clone());
        let state = api.get(name).await.expect("HugePageNode");
        let written =
            hugepool_operator::planner::spec_written_at(&state).expect("the operator's write time");
        assert!(
            written.as_second() >= allowed_second,
            "{name}'s spec written at {written}, before renewals were allowed at {allowed}"
        );
    }
    let client = fleet.client.clone();
    fleet.shutdown().await;
    support::delete_namespace(&client, &scope).await;
}

/// The operator's own binary as a process of its own, so that a test can
/// pause it (SIGSTOP) as a frozen VM or a stalled runtime would.
struct OperatorProcess {
    child: std::process::Child,
}

impl OperatorProcess {
    fn start(kubeconfig: &std::path::Path, log: &std::path::Path, args: &[&str]) -> Self {
        let log = std::fs::File::create(log).expect("operator log");
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_hugepool-operator"))
            .arg("run")
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start hugepool-operator");
        Self { child }
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: signalling our own child.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({signal})");
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A leader paused (SIGSTOP) mid-rollout past its Lease: the other replica
/// takes over and rolls a changed pool out; the old leader, resumed
/// (SIGCONT) with its plan and caches of before the pause, writes nothing
/// of that plan, and no view of the fleet ever has more than
/// `maxUnavailable` nodes changing. Then, leading alone, it is paused past
/// its Lease again and wakes with its renewals refused: it writes nothing
/// until a renewal goes through (without the fence it wrote at once). On a
/// control plane of the test's own, since the paused replica is the
/// operator's binary, unscoped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_paused_past_its_lease_writes_nothing_of_its_old_plan_when_it_resumes() {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};

    if setup().await.is_none() {
        return;
    }
    let (own, env, dir) = support::own_control_plane("paused-leader").await;
    let client = env.client.clone();
    let mut fleet = Fleet::start(&env, "paused", FleetSpec::new(6).label(ROLE_LABEL, "dpdk")).await;
    let scope = fleet.scope.clone();
    support::create_namespace(&client, &scope).await;
    let lease = "hugepool-operator";
    let port = hugepool_e2e::free_port();
    let paused = OperatorProcess::start(
        &own.control_plane.kubeconfig,
        &dir.join("paused-operator.log"),
        &[
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--leader-elect",
            "--lease-namespace",
            &scope,
            "--lease-name",
            lease,
            "--identity",
            "paused",
            "--lease-duration",
            "3s",
            "--lease-grace",
            "1s",
        ],
    );
    wait_for("the process leads", Duration::from_secs(60), || async {
        match lease_holder(&client, &scope, lease).await.as_deref() {
            Some("paused") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    fleet
        .start_operator(Some(LeaderConfig {
            namespace: scope.clone(),
            lease_name: lease.into(),
            identity: "survivor".into(),
            duration: Duration::from_secs(3),
            grace: Duration::from_secs(1),
        }))
        .await;

    let mut watch = fleet.watch_rollout(2);
    watch.synced().await;
    let pool = format!("{scope}-pool");
    // Slow steps, so that the rollout is under way at the pause.
    let mut spec = pool_spec(&scope, "dpdk", 1024, json!(2));
    spec["resize"]["stepPause"] = json!("200ms");
    fleet.create_pool(&pool, spec).await;
    wait_for("the rollout under way", Duration::from_secs(60), || async {
        let nodes = status_of(&fleet.pool(&pool).await).nodes;
        (nodes.converged >= 1)
            .then_some(())
            .ok_or(format!("{nodes:?}"))
    })
    .await;
    paused.signal(libc::SIGSTOP);
    wait_for(
        "the other replica takes over",
        Duration::from_secs(60),
        || async {
            match lease_holder(&client, &scope, lease).await.as_deref() {
                Some("survivor") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    // A new plan the paused replica has not seen: every node at 512.
    fleet.patch_pool(&pool, json!({"pages": 512})).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |p| {
            let nodes = status_of(p).nodes;
            (nodes.converged == 6)
                .then_some(())
                .ok_or(format!("{nodes:?}"))
        })
        .await;
    let names = fleet.node_names();
    fleet
        .wait_kernels(&names, 512, Duration::from_secs(10))
        .await;

    // Every HugePageNode spec written from now on, and the marker below.
    const MARKER: &str = "hugepool.dev/test-marker";
    let seen = Arc::new(Mutex::new(Vec::<(String, i64)>::new()));
    let marked = Arc::new(Mutex::new(false));
    let recorder = {
        let (seen, marked) = (seen.clone(), marked.clone());
        let events = watcher(
            Api::<HugePageNode>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .applied_objects();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(Ok(state)) = events.next().await {
                for entry in &state.spec.page_sizes {
                    seen.lock()
                        .expect("seen")
                        .push((state.name_any(), entry.pages));
                }
                if state.annotations().contains_key(MARKER) {
                    *marked.lock().expect("marked") = true;
                }
            }
        })
    };
    paused.signal(libc::SIGCONT);
    wait_for(
        "the resumed replica knows it follows",
        Duration::from_secs(60),
        || async {
            let text = hugepool_e2e::http_get(&format!("127.0.0.1:{port}"), "/metrics")?;
            text.contains("\nhugepool_leader 0\n")
                .then_some(())
                .ok_or(text)
        },
    )
    .await;
    // The metric turns only in the worker's loop, between passes: the pass
    // the process was paused in has ended, every write it tried has been
    // answered, and no write starts while the fence is closed (its clock
    // ran through the pause). A marker written now comes after all of them
    // in the watch's order: once the recorder sees it, it has seen them.
    Api::<HugePageNode>::all(client.clone())
        .patch(
            &names[0],
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {MARKER: "1"}}})),
        )
        .await
        .expect("mark a HugePageNode");
    wait_for(
        "the recorder sees the marker",
        Duration::from_secs(60),
        || async {
            (*marked.lock().expect("marked"))
                .then_some(())
                .ok_or("not yet".to_string())
        },
    )
    .await;
    recorder.abort();
    let stale: Vec<(String, i64)> = seen
        .lock()
        .expect("seen")
        .iter()
        .filter(|(_, pages)| *pages != 512)
        .cloned()
        .collect();
    assert!(stale.is_empty(), "written from the old plan: {stale:?}");
    assert_eq!(
        lease_holder(&client, &scope, lease).await.as_deref(),
        Some("survivor")
    );
    fleet
        .wait_kernels(&names, 512, Duration::from_secs(10))
        .await;
    watch.assert_bounded();
    drop(watch);

    // Now the process leads alone (the other replica stopped gives the
    // Lease up), is paused past its Lease again and wakes unable to renew:
    // its Lease manager, still the holder, goes on saying "leader"; the
    // fence alone keeps it from writing.
    fleet.take_operator(0).stop().await;
    wait_for(
        "the process leads again",
        Duration::from_secs(60),
        || async {
            match lease_holder(&client, &scope, lease).await.as_deref() {
                Some("paused") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let leader_metric = |value: u8| {
        move || async move {
            let text = hugepool_e2e::http_get(&format!("127.0.0.1:{port}"), "/metrics")?;
            text.contains(&format!("\nhugepool_leader {value}\n"))
                .then_some(())
                .ok_or(text)
        }
    };
    wait_for(
        "the process says it leads",
        Duration::from_secs(60),
        leader_metric(1),
    )
    .await;
    paused.signal(libc::SIGSTOP);
    let policy = refuse_renewals(&client, &scope, "paused").await;
    let expired = |lease: Option<Lease>| {
        lease
            .and_then(|l| l.spec)
            .and_then(|s| s.renew_time.zip(s.lease_duration_seconds))
            .is_some_and(|(renewed, seconds)| {
                renewed.0 + jiff::SignedDuration::from_secs(seconds.into()) < jiff::Timestamp::now()
            })
    };
    let leases = Api::<Lease>::namespaced(client.clone(), &scope);
    wait_for(
        "the paused process's Lease runs out",
        Duration::from_secs(60),
        || async {
            let current = leases.get_opt(lease).await.map_err(|e| e.to_string())?;
            expired(current.clone())
                .then_some(())
                .ok_or(format!("{current:?}"))
        },
    )
    .await;
    fleet.patch_pool(&pool, json!({"pages": 256})).await;
    paused.signal(libc::SIGCONT);
    wait_for(
        "the woken process fenced",
        Duration::from_secs(60),
        leader_metric(0),
    )
    .await;
    // As above: the metric turns between passes, so whatever the woken
    // process tried has been answered; a read now sees it.
    for name in &names {
        let spec = fleet.node_state(name).await.spec;
        assert!(
            spec.page_sizes.iter().all(|e| e.pages == 512),
            "{name} written by a replica whose Lease ran out: {spec:?}"
        );
    }
    assert_eq!(
        lease_holder(&client, &scope, lease).await.as_deref(),
        Some("paused"),
        "nobody else took the Lease"
    );
    allow_renewals(&client, &policy).await;
    wait_for(
        "the process leads once it renews",
        Duration::from_secs(60),
        leader_metric(1),
    )
    .await;
    fleet
        .wait_kernels(&names, 256, Duration::from_secs(120))
        .await;
    drop(paused);
    fleet.shutdown().await;
    drop(own);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Deleting a Release pool shrinks every node to 0 through the rollout
/// before the pool object goes: whenever the pool is seen gone, every
/// kernel is already at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_deletion_returns_every_node_to_zero_before_the_pool_goes() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(
        &env,
        "release",
        FleetSpec::new(10).label(ROLE_LABEL, "dpdk"),
    )
    .await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let pool = format!("{scope}-pool");
    let mut spec = pool_spec(&scope, "dpdk", 512, json!(3));
    spec["deletionPolicy"] = json!("Release");
    fleet.create_pool(&pool, spec).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |_| {
            Ok(())
        })
        .await;
    fleet
        .wait_kernels(&fleet.node_names(), 512, Duration::from_secs(10))
        .await;

    let mut watch = fleet.watch_rollout(3);
    watch.synced().await;
    fleet
        .pool_api()
        .delete(&pool, &DeleteParams::default())
        .await
        .expect("delete the pool");
    // Every kernel held 512 pages when the pool was deleted (above). Look
    // at the pool first, then the kernels: pages never come back, so a
    // kernel above 0 once the pool is seen gone is a real violation.
    wait_for("the pool gone", Duration::from_secs(60), || async {
        let gone = fleet
            .pool_api()
            .get_opt(&pool)
            .await
            .expect("get pool")
            .is_none();
        let above_zero: Vec<String> = fleet
            .nodes
            .iter()
            .filter(|n| n.pages_2mi().0 > 0)
            .map(|n| n.name.clone())
            .collect();
        if gone {
            assert!(
                above_zero.is_empty(),
                "the pool went while {above_zero:?} held pages"
            );
            return Ok(());
        }
        Err(format!("{} nodes above 0", above_zero.len()))
    })
    .await;
    fleet
        .wait_kernels(&fleet.node_names(), 0, Duration::from_secs(1))
        .await;
    for name in fleet.node_names() {
        assert_eq!(
            entry_pool(&fleet.node_state(&name).await, MI2),
            None,
            "{name}"
        );
    }
    watch.assert_bounded();
    drop(watch);
    fleet.shutdown().await;
}

/// Per-NUMA pools on nodes whose NUMA nodes each have memory of their own:
/// a Spread pool reaches an even split on every NUMA node, and the one node
/// whose second NUMA node is too small is failed for that NUMA node alone
/// (the others converge); an Explicit pool reaches its exact split, and the
/// node without the NUMA node it names fails alone and is not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numa_pools_reach_each_numa_nodes_own_share_and_fail_only_where_one_cannot() {
    let Some(env) = setup().await else { return };
    // Nodes 0-3 "spread", 4-5 "explicit". Node 3's NUMA node 1 has 1 GiB:
    // room for at most 512 x 2Mi of its 1024. Node 5 has one NUMA node.
    let spec = FleetSpec::new(6)
        .label_nodes(0..4, ROLE_LABEL, "spread")
        .label_nodes(4..6, ROLE_LABEL, "explicit")
        .numa_nodes(0..3, &[8 * support::GIB, 8 * support::GIB])
        .numa_nodes(3..4, &[8 * support::GIB, support::GIB])
        .numa_nodes(4..5, &[8 * support::GIB, 8 * support::GIB]);
    let mut fleet = Fleet::start(&env, "numa", spec).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();

    let spread = format!("{scope}-spread");
    let mut spread_spec = pool_spec(&scope, "spread", 2048, json!("100%"));
    spread_spec["numa"] = json!({"policy": "Spread"});
    fleet.create_pool(&spread, spread_spec).await;
    let explicit = format!("{scope}-explicit");
    let mut explicit_spec = pool_spec(&scope, "explicit", 400, json!("100%"));
    explicit_spec["numa"] = json!({
        "policy": "Explicit",
        "nodes": [{"id": 0, "pages": 100}, {"id": 1, "pages": 300}],
    });
    fleet.create_pool(&explicit, explicit_spec).await;

    let short = fleet.node_name(3);
    let spread_done = fleet
        .wait_pool(&spread, "Degraded", "True", Duration::from_secs(90), |p| {
            let status = status_of(p);
            (status.nodes.converged == 3 && status.nodes.failed == 1)
                .then_some(())
                .ok_or(format!("{:?}", status.nodes))
        })
        .await;
    let failed = failed_of(&spread_done);
    assert_eq!(failed, [(short.clone(), "AllocationFailed".to_string())]);
    for index in 0..3 {
        let name = fleet.node_name(index);
        assert_eq!(
            fleet.node(&name).numa_pages_2mi(),
            [(0, 1024), (1, 1024)],
            "{name}"
        );
    }
    // The short NUMA node got what fits in its 1 GiB; its sibling reached
    // its own share.
    let numa = fleet.node(&short).numa_pages_2mi();
    assert_eq!(numa[0], (0, 1024), "{short}: {numa:?}");
    assert!(numa[1].1 <= 512, "{short}: {numa:?}");
    let state = fleet.node_state(&short).await;
    let status = state.status.clone().unwrap_or_default();
    let failed = status
        .conditions
        .iter()
        .find(|c| c.type_ == "AllocationFailed")
        .expect("AllocationFailed condition");
    assert_eq!(failed.status, "True", "{failed:?}");
    assert!(
        failed.message.contains("2Mi NUMA node 1: requested 1024"),
        "names the NUMA node: {}",
        failed.message
    );

    let whole = fleet.node_name(4);
    let single = fleet.node_name(5);
    let explicit_done = fleet
        .wait_pool(
            &explicit,
            "Degraded",
            "True",
            Duration::from_secs(90),
            |p| {
                let status = status_of(p);
                (status.nodes.converged == 1 && status.nodes.failed == 1)
                    .then_some(())
                    .ok_or(format!("{:?}", status.nodes))
            },
        )
        .await;
    // The operator learns from the agent's report that the node has no NUMA
    // node 1 (its first target went out before that report: the agent
    // refuses it as InvalidTarget and touches nothing).
    let failed: Vec<(String, String, String)> = status_of(&explicit_done)
        .failed_nodes
        .iter()
        .map(|f| (f.name.clone(), f.reason.clone(), f.message.clone()))
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        (&failed[0].0, failed[0].1.as_str()),
        (&single, "InvalidSpec")
    );
    assert!(failed[0].2.contains('1'), "names the NUMA node: {failed:?}");
    let agent_says = wait_for(
        "the agent to refuse the target",
        Duration::from_secs(30),
        || {
            let fleet = &fleet;
            let single = &single;
            async move {
                let state = fleet.node_state(single).await;
                let conditions = state.status.map(|s| s.conditions).unwrap_or_default();
                conditions
                    .iter()
                    .find(|c| c.reason == "InvalidTarget")
                    .map(|c| c.message.clone())
                    .ok_or(format!("{conditions:?}"))
            }
        },
    )
    .await;
    assert!(agent_says.contains("NUMA node 1"), "{agent_says}");
    assert_eq!(
        fleet.node(&whole).numa_pages_2mi(),
        [(0, 100), (1, 300)],
        "{whole}"
    );
    assert_eq!(
        fleet.node(&single).pages_2mi(),
        (0, 0),
        "{single} untouched"
    );
    fleet.shutdown().await;
}

/// A selected Node that no agent serves (a large fleet always has some):
/// it holds the one rollout slot only until `rollout.unresponsiveAfter`,
/// then the rollout goes on with the nodes that answer and the pool counts
/// and names it; a Release deletion returns the answering nodes to 0, says
/// it waits for the silent one, and ends once that Node is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_no_agent_serves_is_passed_over_named_and_not_waited_for_once_deleted() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(&env, "silent", FleetSpec::new(2).label(ROLE_LABEL, "dpdk")).await;
    let scope = fleet.scope.clone();
    // Sorts before the fleet's nodes, so the rollout admits it first.
    let silent = format!("{scope}-a-silent");
    let node_api: Api<Node> = Api::all(env.client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": silent,
            "labels": {support::SCOPE_LABEL: scope, ROLE_LABEL: "dpdk"},
        },
    }))
    .expect("Node object");
    node_api
        .create(&PostParams::default(), &node)
        .await
        .expect("create the silent Node");
    fleet.start_operator(None).await;
    let pool = format!("{scope}-pool");
    let mut spec = pool_spec(&scope, "dpdk", 64, json!(1));
    spec["rollout"]["unresponsiveAfter"] = json!("3s");
    spec["deletionPolicy"] = json!("Release");
    fleet.create_pool(&pool, spec).await;

    let answering = fleet.node_names();
    fleet
        .wait_pool(&pool, "Degraded", "True", Duration::from_secs(90), |pool| {
            let status = status_of(pool);
            let (_, reason, message) = reason_of(pool, "Degraded");
            if reason != "NodesUnresponsive" || status.nodes.converged != 2 {
                return Err(format!("{reason}: {message}; {:?}", status.nodes));
            }
            assert_eq!(status.nodes.unresponsive, 1, "{:?}", status.nodes);
            assert_eq!(status.nodes.selected, 3, "{:?}", status.nodes);
            assert!(
                message.contains(&silent) && message.contains("has not acknowledged"),
                "{message}"
            );
            Ok(())
        })
        .await;
    fleet
        .wait_kernels(&answering, 64, Duration::from_secs(10))
        .await;

    fleet
        .pool_api()
        .delete(&pool, &DeleteParams::default())
        .await
        .expect("delete the pool");
    fleet
        .wait_kernels(&answering, 0, Duration::from_secs(60))
        .await;
    wait_for(
        "the deletion to say it waits for the silent node",
        Duration::from_secs(60),
        || async {
            let pool = fleet.pool(&pool).await;
            let (_, reason, message) = reason_of(&pool, "Degraded");
            if reason == "NodesUnresponsive"
                && message.contains(&silent)
                && message.contains("the deletion waits for them")
            {
                Ok(())
            } else {
                Err(format!("{reason}: {message}"))
            }
        },
    )
    .await;
    node_api
        .delete(&silent, &DeleteParams::default())
        .await
        .expect("delete the silent Node");
    wait_for("the pool gone", Duration::from_secs(60), || async {
        match fleet.pool_api().get_opt(&pool).await.expect("get pool") {
            None => Ok(()),
            Some(pool) => Err(format!("{:?}", pool.status)),
        }
    })
    .await;
    fleet.shutdown().await;
}

/// Waits until the pool is Available with `pages` per node as its target.
async fn wait_available_at(fleet: &Fleet, pool: &str, pages: i64) {
    fleet
        .wait_pool(pool, "Available", "True", Duration::from_secs(60), |pool| {
            let target = status_of(pool).pages.target;
            if target == pages {
                Ok(())
            } else {
                Err(format!("target {target}"))
            }
        })
        .await;
}

/// A write still in flight when its replica's Lease window closes is not
/// applied after another replica led. Replica A reaches the apiserver
/// through a proxy the test holds right after A renewed: A's renewals and
/// its spec write for the pool's change to 128 pages stay in the proxy;
/// B takes over and writes the next change, 256; then the proxy lets A's
/// bytes through. The HugePageNode never goes back to 128.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_held_past_the_lease_is_not_applied_after_another_replica_led() {
    let Some(env) = setup().await else { return };
    let (mut fleet, proxy, pool) = replica_a_through_a_proxy(&env, "held").await;
    let node = fleet.node_names()[0].clone();

    // Every spec the HugePageNode carries from here on.
    let targets = Arc::new(std::sync::Mutex::new(Vec::<i64>::new()));
    let recorder = {
        let targets = Arc::clone(&targets);
        let api: Api<HugePageNode> = Api::all(env.client.clone());
        let config =
            kube::runtime::watcher::Config::default().fields(&format!("metadata.name={node}"));
        tokio::spawn(async move {
            use futures::StreamExt;
            use kube::runtime::WatchStreamExt;
            let mut stream = std::pin::pin!(kube::runtime::watcher(api, config).applied_objects());
            while let Some(Ok(state)) = stream.next().await {
                if let Some((_, pages)) = entry_pool(&state, MI2) {
                    let mut seen = targets.lock().expect("targets");
                    if seen.last() != Some(&pages) {
                        seen.push(pages);
                    }
                }
            }
        })
    };

    changed_while_a_is_held(&fleet, &proxy, &pool, json!({"pages": 128})).await;

    // B takes over once A's Lease runs out, and writes the next change.
    replica_b_takes_over(&mut fleet).await;
    fleet.patch_pool(&pool, json!({"pages": 256})).await;
    wait_available_at(&fleet, &pool, 256).await;

    // A's held bytes go through now; whatever A left in flight must not
    // land on B's spec.
    release_what_is_held(&proxy).await;
    // A write that lands is seen by the watch; let the apiserver answer
    // every forwarded request (B's next write would follow any of A's).
    fleet.patch_pool(&pool, json!({"pages": 320})).await;
    wait_available_at(&fleet, &pool, 320).await;
    recorder.abort();
    let seen = targets.lock().expect("targets").clone();
    let b_wrote = seen
        .iter()
        .position(|&pages| pages == 256)
        .unwrap_or_else(|| panic!("B's target was written: {seen:?}"));
    assert!(
        !seen[b_wrote..].contains(&128),
        "A's stale write of 128 landed after B led: {seen:?}"
    );
    drop(proxy);
    fleet.shutdown().await;
}

/// A pool-status write still in flight when its replica's Lease window
/// closes lands nothing over the next leader's: replica A reaches the
/// apiserver through a proxy the test holds right after A renewed, then
/// the pool changes in a way that needs only a status write (its
/// maxUnavailable, the nodes being converged); B takes over and writes the
/// status of a later generation; A's held write, released after, must not
/// set the status back (it is conditioned on the resourceVersion A read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_status_write_held_past_the_lease_lands_nothing_over_the_next_leaders() {
    let Some(env) = setup().await else { return };
    let (mut fleet, proxy, pool) = replica_a_through_a_proxy(&env, "heldstatus").await;

    // Every observedGeneration the pool's status carries from here on.
    let generations = Arc::new(std::sync::Mutex::new(Vec::<i64>::new()));
    let recorder = {
        let generations = Arc::clone(&generations);
        let api: Api<HugePagePool> = Api::all(env.client.clone());
        let config =
            kube::runtime::watcher::Config::default().fields(&format!("metadata.name={pool}"));
        tokio::spawn(async move {
            use futures::StreamExt;
            use kube::runtime::WatchStreamExt;
            let mut stream = std::pin::pin!(kube::runtime::watcher(api, config).applied_objects());
            while let Some(Ok(pool)) = stream.next().await {
                if let Some(generation) = pool.status.and_then(|s| s.observed_generation) {
                    let mut seen = generations.lock().expect("generations");
                    if seen.last() != Some(&generation) {
                        seen.push(generation);
                    }
                }
            }
        })
    };
    let stale = changed_while_a_is_held(
        &fleet,
        &proxy,
        &pool,
        json!({"rollout": {"maxUnavailable": 2}}),
    )
    .await;

    replica_b_takes_over(&mut fleet).await;
    let newer = fleet
        .patch_pool(&pool, json!({"rollout": {"maxUnavailable": 3}}))
        .await;
    wait_observed(&fleet, &pool, newer).await;

    release_what_is_held(&proxy).await;
    // B's next status write follows whatever of A's the apiserver took.
    let last = fleet
        .patch_pool(&pool, json!({"rollout": {"maxUnavailable": 4}}))
        .await;
    wait_observed(&fleet, &pool, last).await;
    recorder.abort();
    let seen = generations.lock().expect("generations").clone();
    let b_wrote = seen
        .iter()
        .position(|&g| g == newer)
        .unwrap_or_else(|| panic!("B's status was written: {seen:?}"));
    assert!(
        !seen[b_wrote..].contains(&stale),
        "A's stale status (generation {stale}) landed after B's: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&last), "{seen:?}");
    eprintln!("pool status generations seen: {seen:?} (A's held write was for {stale})");
    drop(proxy);
    fleet.shutdown().await;
}

async fn wait_observed(fleet: &Fleet, pool: &str, generation: i64) {
    fleet
        .wait_pool(pool, "Available", "True", Duration::from_secs(60), |p| {
            let seen = status_of(p).observed_generation;
            (seen == Some(generation))
                .then_some(())
                .ok_or(format!("observedGeneration {seen:?}"))
        })
        .await;
}

/// The held-write tests' Lease: 3 s, renewed 1 s before it runs out.
const HELD_LEASE: &str = "hugepool-operator";

fn held_replica(scope: &str, identity: &str) -> LeaderConfig {
    LeaderConfig {
        namespace: scope.to_string(),
        lease_name: HELD_LEASE.to_string(),
        identity: identity.to_string(),
        duration: Duration::from_secs(3),
        grace: Duration::from_secs(1),
    }
}

/// One node, replica A leading through a holding proxy, and a 64-page pool
/// Available: the fleet, the proxy and the pool's name.
async fn replica_a_through_a_proxy(
    env: &hugepool_e2e::TestEnv,
    prefix: &str,
) -> (Fleet, support::HoldingProxy, String) {
    let mut fleet = Fleet::start(env, prefix, FleetSpec::new(1).label(ROLE_LABEL, "dpdk")).await;
    let scope = fleet.scope.clone();
    support::create_namespace(&env.client, &scope).await;
    let proxy = support::HoldingProxy::start(fleet.apiserver_addr().await).await;
    fleet
        .start_operator_through(Some(held_replica(&scope, "replica-a")), proxy.url())
        .await;
    wait_for_holder(&fleet, "replica-a").await;
    let pool = format!("{scope}-pool");
    fleet
        .create_pool(&pool, pool_spec(&scope, "dpdk", 64, json!(1)))
        .await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |_| {
            Ok(())
        })
        .await;
    (fleet, proxy, pool)
}

async fn wait_for_holder(fleet: &Fleet, identity: &str) {
    wait_for(
        &format!("{identity} leads"),
        Duration::from_secs(60),
        || async {
            match lease_holder(&fleet.client, &fleet.scope, HELD_LEASE).await {
                Some(holder) if holder == identity => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

/// Holds A's traffic right after a renewal of its, so that A has most of
/// its window left, then patches the pool's spec with `spec` and waits until
/// A's write for it is held. Returns the pool's new generation.
async fn changed_while_a_is_held(
    fleet: &Fleet,
    proxy: &support::HoldingProxy,
    pool: &str,
    spec: serde_json::Value,
) -> i64 {
    hold_right_after_a_renewal(fleet, proxy).await;
    let generation = fleet.patch_pool(pool, spec).await;
    wait_for(
        "A's write held in the proxy",
        Duration::from_secs(30),
        || async {
            if proxy.held() > 0 {
                Ok(())
            } else {
                Err("nothing held".into())
            }
        },
    )
    .await;
    generation
}

async fn hold_right_after_a_renewal(fleet: &Fleet, proxy: &support::HoldingProxy) {
    let leases: Api<Lease> = Api::namespaced(fleet.client.clone(), &fleet.scope);
    let renewed = |lease: &Lease| lease.spec.as_ref().and_then(|s| s.renew_time.clone());
    let before = renewed(&leases.get(HELD_LEASE).await.expect("Lease"));
    wait_for("a renewal by A", Duration::from_secs(30), || async {
        let now = renewed(&leases.get(HELD_LEASE).await.map_err(|e| e.to_string())?);
        if now != before {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
    proxy.hold();
}

/// Replica B starts and takes the Lease once A's runs out.
async fn replica_b_takes_over(fleet: &mut Fleet) {
    let scope = fleet.scope.clone();
    fleet
        .start_operator(Some(held_replica(&scope, "replica-b")))
        .await;
    wait_for_holder(fleet, "replica-b").await;
}

/// Lets the held request of each connection reach the apiserver, and
/// nothing its client sent after (see `HoldingProxy::release_held_only`).
async fn release_what_is_held(proxy: &support::HoldingProxy) {
    proxy.release_held_only();
    wait_for(
        "the proxy forwarded what it held",
        Duration::from_secs(30),
        || async {
            if proxy.held() == 0 {
                Ok(())
            } else {
                Err(format!("{} bytes", proxy.held()))
            }
        },
    )
    .await;
}
