//! The operator under the faults real clusters have, on the real apiserver
//! with simulated agents: each test injects one fault, asserts that nothing
//! was lost and the records are exact, and prints what it measured
//! ("fault: ..." lines; docs/operations.md, "Faults and recovery").
//!
//! No kubelet runs, so the tests play it (`support::play_kubelet`).

#[allow(dead_code)]
mod support;

use std::time::{Duration, Instant};

use hugepool_crds::{HugePageNode, HugePagePool, HugePagePoolStatus};
use hugepool_e2e::setup;
use hugepool_operator::LeaderConfig;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use support::{EvictionWebhook, Fleet, FleetSpec, MI2, ROLE_LABEL, play_kubelet, pool_spec};

/// The chart's Lease: 15 s, renewed 5 s before it runs out, so one write
/// may take at most 12.5 s.
fn chart_lease(scope: &str) -> LeaderConfig {
    LeaderConfig {
        namespace: scope.to_string(),
        lease_name: "hugepool-operator".into(),
        identity: format!("{scope}-a"),
        duration: Duration::from_secs(15),
        grace: Duration::from_secs(5),
    }
}

fn status_of(pool: &HugePagePool) -> HugePagePoolStatus {
    pool.status.clone().unwrap_or_default()
}

fn draining_message(state: &HugePageNode) -> String {
    state
        .status
        .as_ref()
        .and_then(|s| support::condition(&s.conditions, "Draining"))
        .map(|c| c.message.clone())
        .unwrap_or_default()
}

/// Two nodes under a 512-page pool that drains (IfNeeded, 10 minutes),
/// the operator running as `replicas` (the first leading before the others
/// start); on the first node a pod holds 300 pages (requesting 600Mi) and
/// the pool's evictions go through an eviction webhook in `mode`. Returns
/// the fleet, the pool, the blocked node, the consumer pod and the webhook.
async fn drain_behind_a_webhook(
    env: &hugepool_e2e::TestEnv,
    prefix: &str,
    mode: &str,
    replicas: impl Fn(&str) -> Vec<LeaderConfig>,
) -> (Fleet, String, String, Pod, EvictionWebhook) {
    let mut fleet = Fleet::start(env, prefix, FleetSpec::new(2).label(ROLE_LABEL, "dpdk")).await;
    let scope = fleet.scope.clone();
    support::create_namespace(&fleet.client, &scope).await;
    let mut replicas = replicas(&scope).into_iter();
    let first = replicas.next().expect("one replica at least");
    // The first serves /metrics (Fleet::operator_counter(0, ..)).
    let listen = format!("127.0.0.1:{}", hugepool_e2e::free_port())
        .parse()
        .expect("address");
    fleet
        .start_operator_serving(Some(first.clone()), Some(listen))
        .await;
    support::wait_for(
        "the first replica leads",
        Duration::from_secs(60),
        || async {
            let holder = support::lease_holder(&fleet.client, &scope, &first.lease_name).await;
            (holder.as_deref() == Some(first.identity.as_str()))
                .then_some(())
                .ok_or(format!("{holder:?}"))
        },
    )
    .await;
    for replica in replicas {
        fleet.start_operator(Some(replica)).await;
    }
    let mut spec = pool_spec(&scope, "dpdk", 512, json!(2));
    spec["drain"] = json!({"policy": "IfNeeded", "timeout": "600s"});
    let pool = fleet.create_available_pool(spec).await;
    let blocked = fleet.node_name(0);
    let held = fleet
        .node(&blocked)
        .kernel
        .hold_pages(MI2, 0, 300)
        .expect("hold");
    assert_eq!(held, 300);
    let consumer = support::run_pod(
        &fleet.client,
        &scope,
        support::pod("consumer", &blocked, "dpdk", Some("600Mi")),
    )
    .await;
    let webhook = EvictionWebhook::start(env, &scope, mode).await;
    (fleet, pool, blocked, consumer, webhook)
}

/// Plays the kubelet of [`drain_behind_a_webhook`]'s fleet: its consumer
/// holds 300 pages on the blocked node.
fn play_consumer(
    fleet: &Fleet,
    blocked: &str,
) -> (
    std::sync::Arc<std::sync::Mutex<support::KubeletRecord>>,
    tokio::task::JoinHandle<()>,
) {
    play_kubelet(
        fleet,
        &fleet.scope,
        vec![("consumer".into(), blocked.to_string(), 300)],
    )
}

/// The chart's Lease, one replica.
fn one_replica(scope: &str) -> Vec<LeaderConfig> {
    vec![chart_lease(scope)]
}

/// Waits until the pool has shrunk to 100 pages on both nodes, and returns
/// its status.
async fn wait_shrunk(fleet: &Fleet, pool: &str, timeout: Duration) -> HugePagePoolStatus {
    let shrunk = fleet
        .wait_pool(pool, "Available", "True", timeout, |p| {
            let status = status_of(p);
            (status.nodes.converged == 2 && status.pages.current == 200)
                .then_some(())
                .ok_or(format!("{:?} {:?}", status.nodes, status.pages))
        })
        .await;
    status_of(&shrunk)
}

/// An eviction webhook that answers in 20 s (longer than the Lease lets one
/// write take) holds up its pod alone: while the eviction waits, the other
/// node's shrink lands and the pool's status says so, and the blocked node
/// names the pod it waits for; once the webhook is removed the eviction
/// goes through and the shrink finishes. One record, with the pod's UID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_eviction_webhook_holds_up_its_pod_alone_and_its_removal_lets_the_drain_finish() {
    let Some(env) = setup().await else { return };
    let (fleet, pool, blocked, consumer, webhook) =
        drain_behind_a_webhook(&env, "slowhook", "delay=20s", one_replica).await;
    let scope = fleet.scope.clone();
    let (kubelet, kubelet_task) = play_consumer(&fleet, &blocked);
    let shrink = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 100})).await;

    let unanswered = format!("eviction of {scope}/consumer unanswered since");
    let reconciles = || fleet.operator_counter(0, "hugepool_reconciles_total");
    let named = support::wait_for(
        "the other node's shrink in the pool's status while the eviction waits",
        Duration::from_secs(60),
        || async {
            let status = status_of(&fleet.pool(&pool).await);
            let message = draining_message(&fleet.node_state(&blocked).await);
            let evicted = !kubelet.lock().expect("kubelet").evicted.is_empty();
            if evicted {
                panic!("evicted before the pool said anything: {status:?} {message}");
            }
            (status.nodes.converged == 1 && message.contains(&unanswered))
                .then(|| shrink.elapsed())
                .ok_or(format!("{:?}; Draining: {message}", status.nodes))
        },
    )
    .await;
    // The eviction slow since: passes come on events and deadlines ahead,
    // not on its slowness (before, one every 100 ms). 10 s of it, counted
    // by the operator's own metrics; the webhook answers after 20 s. The
    // operator watches every Node and HugePageNode of the control plane, so
    // the tests running beside this one wake it too: those wakeups are
    // counted and allowed, at most one pass a second beyond them.
    let wakeups = || fleet.operator_counter(0, "hugepool_watch_wakeups_total");
    let passes_before = reconciles().expect("the operator's metrics");
    let wakeups_before = wakeups().expect("the operator's metrics");
    let slow_since = Instant::now();
    while slow_since.elapsed() < Duration::from_secs(10)
        && kubelet.lock().expect("kubelet").evicted.is_empty()
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let passes = reconciles().expect("the operator's metrics") - passes_before;
    let woken = wakeups().expect("the operator's metrics") - wakeups_before;
    let during = slow_since.elapsed();
    assert!(
        passes <= woken + during.as_secs_f64() + 5.0,
        "{passes} passes in {during:?} of a slow eviction, {woken} of them or fewer woken by watch events"
    );

    webhook.remove(&env.client).await;
    let removed = Instant::now();
    let status = wait_shrunk(&fleet, &pool, Duration::from_secs(120)).await;
    let recovered = removed.elapsed();
    eprintln!(
        "fault: eviction webhook answering in 20 s: the waiting pod named and the other node \
         reported after {named:?}; {passes} passes ({woken} watch wakeups) in {during:?} while it \
         was slow; drain \
         finished {recovered:?} after the webhook was removed ({:?} after the shrink)",
        shrink.elapsed()
    );
    let records: Vec<(String, String)> = status
        .evicted_pods
        .iter()
        .map(|e| (e.pod.clone(), e.uid.clone()))
        .collect();
    assert_eq!(
        records,
        [(
            format!("{scope}/consumer"),
            consumer.metadata.uid.clone().expect("uid")
        )]
    );
    assert_eq!(
        kubelet.lock().expect("kubelet").evicted,
        [("consumer".to_string(), true)],
        "evicted once, under the taint"
    );
    let asked = webhook.requests();
    assert!(
        asked
            .first()
            .is_some_and(|r| r.starts_with(&format!("dryRun=true {scope}/consumer"))),
        "{asked:?}"
    );
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// The Events of the operator on Node `node` with `reason`, by message.
async fn node_events(fleet: &Fleet, node: &str, reason: &str) -> Vec<String> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(fleet.client.clone());
    events
        .list(&kube::api::ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
        })
        .filter_map(|e| e.note)
        .collect()
}

/// While the eviction's dry run waits 20 s on a webhook, `change` makes the
/// plan stop wanting it: once the dry run is accepted the real eviction is
/// never sent, the pod stays, no record stays on the pool, and the
/// abandonment is told on the node. Returns how long after the change it
/// was told.
async fn a_change_mid_dry_run_evicts_nothing(
    prefix: &str,
    change: impl AsyncFnOnce(&Fleet, &str),
) -> Option<Duration> {
    let env = setup().await?;
    let (fleet, pool, blocked, consumer, webhook) =
        drain_behind_a_webhook(&env, prefix, "delay=20s", one_replica).await;
    let scope = fleet.scope.clone();
    let (kubelet, kubelet_task) = play_consumer(&fleet, &blocked);
    fleet.patch_pool(&pool, json!({"pages": 100})).await;
    support::wait_for("the dry run sent", Duration::from_secs(60), || async {
        let asked = webhook.requests();
        asked
            .iter()
            .any(|r| r.starts_with("dryRun=true"))
            .then_some(())
            .ok_or(format!("{asked:?}"))
    })
    .await;
    let changed = Instant::now();
    change(&fleet, &pool).await;
    let told = support::wait_for(
        "the abandonment told on the node",
        Duration::from_secs(120),
        || async {
            let told = node_events(&fleet, &blocked, "EvictionAbandoned").await;
            told.first()
                .map(|note| (note.clone(), changed.elapsed()))
                .ok_or(format!("requests: {:?}", webhook.requests()))
        },
    )
    .await;
    assert!(
        told.0
            .starts_with(&format!("eviction of pod {scope}/consumer not sent: ")),
        "{}",
        told.0
    );
    let asked = webhook.requests();
    assert!(
        asked.iter().all(|r| !r.starts_with("dryRun=false")),
        "no real eviction: {asked:?}"
    );
    assert!(kubelet.lock().expect("kubelet").evicted.is_empty());
    let pods: Api<Pod> = Api::namespaced(fleet.client.clone(), &scope);
    let still = pods.get("consumer").await.expect("the consumer stays");
    assert_eq!(still.metadata.uid, consumer.metadata.uid);
    assert!(still.metadata.deletion_timestamp.is_none());
    if let Some(pool) = fleet.pool_api().get_opt(&pool).await.expect("get pool") {
        assert!(
            status_of(&pool).evicted_pods.is_empty(),
            "{:?}",
            status_of(&pool).evicted_pods
        );
    }
    webhook.remove(&env.client).await;
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
    Some(told.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shrink_reverted_while_its_dry_run_waits_evicts_nothing_and_records_nothing() {
    let told = a_change_mid_dry_run_evicts_nothing("revert", async |fleet, pool| {
        fleet.patch_pool(pool, json!({"pages": 512})).await;
    })
    .await;
    if let Some(told) = told {
        eprintln!(
            "fault: a shrink reverted 0-1 s into a 20 s dry-run review: no real eviction, no \
             record; the abandonment told {told:?} after the revert"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_deleted_while_its_dry_run_waits_leaves_nothing_in_flight() {
    let told = a_change_mid_dry_run_evicts_nothing("gone", async |fleet, pool| {
        fleet
            .pool_api()
            .delete(pool, &DeleteParams::default())
            .await
            .expect("delete the pool");
    })
    .await;
    if let Some(told) = told {
        eprintln!(
            "fault: a pool deleted 0-1 s into a 20 s dry-run review: no real eviction; the \
             abandonment told {told:?} after the deletion"
        );
    }
}

/// A policy engine that takes 8 s to admit each write of the fleet's
/// HugePageNodes and Nodes (more than the window the chart's 15 s Lease may
/// leave a write when it starts): a rollout and a drain still finish, and
/// the pool never reads `NodeWritesFailed` while the operator leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_slowed_by_an_admission_webhook_fail_no_rollout_and_no_drain() {
    let Some(env) = setup().await else { return };
    let (fleet, pool, blocked, _consumer, webhook) =
        drain_behind_a_webhook(&env, "slowadmit", "allow", one_replica).await;
    let scope = fleet.scope.clone();
    let (kubelet, kubelet_task) = play_consumer(&fleet, &blocked);
    let slow = EvictionWebhook::start_for(
        &env,
        &format!("{scope}-slow-writes"),
        "delay=8s",
        json!({
            "rules": [
                {"operations": ["CREATE", "UPDATE"], "apiGroups": ["hugepool.dev"],
                 "apiVersions": ["*"], "resources": ["hugepagenodes"], "scope": "*"},
                {"operations": ["UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                 "resources": ["nodes"], "scope": "*"},
            ],
            "matchConditions": [{
                "name": "this-fleet",
                "expression": format!("object.metadata.name.startsWith('{scope}-')"),
            }],
            "timeoutSeconds": 15,
        }),
    )
    .await;
    // Everything the pool says while it runs.
    let said = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let watching = tokio::spawn({
        let (api, pool, said) = (fleet.pool_api(), pool.clone(), said.clone());
        async move {
            loop {
                if let Ok(pool) = api.get(&pool).await
                    && let Some(degraded) = pool
                        .status
                        .as_ref()
                        .and_then(|s| support::condition(&s.conditions, "Degraded"))
                    && degraded.status == "True"
                {
                    said.lock()
                        .unwrap()
                        .push(format!("{}: {}", degraded.reason, degraded.message));
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });
    let started = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 600})).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(300), |p| {
            let status = status_of(p);
            (status.nodes.converged == 2 && status.pages.current == 1200)
                .then_some(())
                .ok_or(format!("{:?} {:?}", status.nodes, status.pages))
        })
        .await;
    let grown = started.elapsed();
    let shrink = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 100})).await;
    let status = wait_shrunk(&fleet, &pool, Duration::from_secs(300)).await;
    let drained = shrink.elapsed();
    watching.abort();
    assert_eq!(
        kubelet.lock().expect("kubelet").evicted,
        [("consumer".to_string(), true)]
    );
    assert_eq!(status.evicted_pods.len(), 1);
    let said = said.lock().unwrap().clone();
    assert!(
        said.iter().all(|s| !s.starts_with("NodeWritesFailed")),
        "{said:?}"
    );
    assert!(
        slow.requests().len() >= 4,
        "the webhook saw the writes: {:?}",
        slow.requests()
    );
    eprintln!(
        "fault: every HugePageNode and Node write admitted in 8 s (chart's 15 s Lease): grown in \
         {grown:?}, drained and shrunk in {drained:?}, no NodeWritesFailed; {} writes admitted",
        slow.requests().len()
    );
    slow.remove(&env.client).await;
    webhook.remove(&env.client).await;
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// A webhook that lets the dry run through and refuses the real eviction:
/// the record written before the eviction is taken back and the node names
/// the refusal; once the webhook lets it through, the pod is evicted and
/// recorded once, though it was asked for (and recorded) more than once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_refused_after_its_dry_run_is_not_recorded_and_one_accepted_later_is_recorded_once()
 {
    let Some(env) = setup().await else { return };
    let (fleet, pool, blocked, consumer, webhook) =
        drain_behind_a_webhook(&env, "denyreal", "deny-real", one_replica).await;
    let scope = fleet.scope.clone();
    let (kubelet, kubelet_task) = play_consumer(&fleet, &blocked);
    fleet.patch_pool(&pool, json!({"pages": 100})).await;

    let refused = format!("eviction of {scope}/consumer refused");
    support::wait_for(
        "the refusal named, and no record",
        Duration::from_secs(60),
        || async {
            let status = status_of(&fleet.pool(&pool).await);
            let message = draining_message(&fleet.node_state(&blocked).await);
            let real_asked = webhook
                .requests()
                .iter()
                .any(|r| r.starts_with("dryRun=false"));
            (real_asked && message.contains(&refused) && status.evicted_pods.is_empty())
                .then_some(())
                .ok_or(format!("{:?}; Draining: {message}", status.evicted_pods))
        },
    )
    .await;
    assert!(kubelet.lock().expect("kubelet").evicted.is_empty());

    webhook.set_mode("allow");
    let allowed = Instant::now();
    let status = wait_shrunk(&fleet, &pool, Duration::from_secs(120)).await;
    eprintln!(
        "fault: real eviction refused after an accepted dry run: the record withdrawn; drain \
         finished {:?} after the webhook allowed it",
        allowed.elapsed()
    );
    let uid = consumer.metadata.uid.clone().expect("uid");
    let records: Vec<&str> = status.evicted_pods.iter().map(|e| e.uid.as_str()).collect();
    assert_eq!(records, [uid.as_str()]);
    let real_asked = webhook
        .requests()
        .iter()
        .filter(|r| r.starts_with("dryRun=false"))
        .count();
    assert!(real_asked >= 2, "{:?}", webhook.requests());
    assert_eq!(
        kubelet.lock().expect("kubelet").evicted,
        [("consumer".to_string(), true)]
    );
    let pods: Api<Pod> = Api::namespaced(fleet.client.clone(), &scope);
    assert!(pods.get_opt("consumer").await.expect("get").is_none());
    webhook.remove(&env.client).await;
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// The pod goes away on its own between the accepted dry run and the real
/// eviction (the webhook holds the real one 8 s; the test deletes the pod
/// meanwhile, as a job that finished would): the record written before the
/// real eviction is taken back, since no eviction of that pod was
/// accepted, and the shrink finishes on the pages the pod gave back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_gone_between_its_dry_run_and_its_eviction_is_not_recorded() {
    let Some(env) = setup().await else { return };
    let (fleet, pool, blocked, consumer, webhook) =
        drain_behind_a_webhook(&env, "podgone", "delay-real=8s", one_replica).await;
    let scope = fleet.scope.clone();
    let uid = consumer.metadata.uid.clone().expect("uid");
    fleet.patch_pool(&pool, json!({"pages": 100})).await;
    support::wait_for(
        "the real eviction asked, its record written",
        Duration::from_secs(60),
        || async {
            let status = status_of(&fleet.pool(&pool).await);
            let real_asked = webhook
                .requests()
                .iter()
                .any(|r| r.starts_with("dryRun=false"));
            (real_asked && status.evicted_pods.iter().any(|e| e.uid == uid))
                .then_some(())
                .ok_or(format!(
                    "{:?}; {:?}",
                    status.evicted_pods,
                    webhook.requests()
                ))
        },
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(fleet.client.clone(), &scope);
    pods.delete(
        "consumer",
        &kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            ..kube::api::DeleteParams::default()
        },
    )
    .await
    .expect("delete the pod");
    let gone = Instant::now();
    fleet
        .node(&blocked)
        .kernel
        .release_pages(MI2, 0, 300)
        .expect("the pod's pages given back");
    let status = wait_shrunk(&fleet, &pool, Duration::from_secs(120)).await;
    let shrunk = gone.elapsed();
    // The record goes once the real eviction is answered (404: no pod).
    support::wait_for(
        "the record taken back",
        Duration::from_secs(120),
        || async {
            let status = status_of(&fleet.pool(&pool).await);
            status
                .evicted_pods
                .is_empty()
                .then_some(())
                .ok_or(format!("{:?}", status.evicted_pods))
        },
    )
    .await;
    eprintln!(
        "fault: the pod deleted while its real eviction waited on a webhook (8 s): shrunk {:?} \
         and the record taken back {:?} after the deletion",
        shrunk,
        gone.elapsed()
    );
    assert_eq!(status.pages.current, 200);
    let real_asked = webhook
        .requests()
        .iter()
        .filter(|r| r.starts_with("dryRun=false"))
        .count();
    assert_eq!(real_asked, 1, "{:?}", webhook.requests());
    webhook.remove(&env.client).await;
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// A selected Node turns NotReady (its agent down) as the pool grows, with
/// `maxUnavailable: 1`: while it holds the one slot without answering, the
/// pool's Progressing message names it and when it will be passed over;
/// then it is passed over and named in Degraded while the node that
/// answers gets its pages. When it comes back, its agent converges and its
/// name goes. The note is waited for while `unresponsiveAfter` is an hour,
/// then the pool is patched to pass the node over after 10 s: each step
/// waits for a state, not for a window of time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_turns_not_ready_is_named_passed_over_and_converges_when_it_returns() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(
        &env,
        "notready",
        FleetSpec::new(2).label(ROLE_LABEL, "dpdk"),
    )
    .await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let mut spec = pool_spec(&scope, "dpdk", 64, json!(1));
    spec["rollout"]["unresponsiveAfter"] = json!("1h");
    let pool = fleet.create_available_pool(spec).await;
    // The first node by name is the first admitted.
    let mut names = fleet.node_names();
    names.sort();
    let (silent, answering) = (names[0].clone(), names[1].clone());
    fleet.stop_agent(&silent).await;
    fleet.set_ready(&silent, false).await;
    let grown = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 128})).await;

    let waiting = format!("waiting on nodes that do not answer yet: {silent} (passed over at");
    support::wait_for(
        "the silent node named while it holds the slot",
        Duration::from_secs(30),
        || async {
            let progressing = fleet
                .pool(&pool)
                .await
                .status
                .and_then(|s| support::condition(&s.conditions, "Progressing").cloned())
                .map(|c| c.message)
                .unwrap_or_default();
            progressing
                .contains(&waiting)
                .then_some(())
                .ok_or(progressing)
        },
    )
    .await;
    let named = grown.elapsed();
    fleet
        .patch_pool(&pool, json!({"rollout": {"unresponsiveAfter": "10s"}}))
        .await;
    let passed_over = fleet
        .wait_pool(&pool, "Degraded", "True", Duration::from_secs(60), |p| {
            let status = status_of(p);
            let degraded = support::condition(&status.conditions, "Degraded").cloned();
            let message = degraded.map(|c| c.message).unwrap_or_default();
            (message.contains(&format!("{silent} (NotReady since")) && status.nodes.converged == 1)
                .then_some(())
                .ok_or(message)
        })
        .await;
    assert_eq!(
        support::condition(&status_of(&passed_over).conditions, "Degraded")
            .map(|c| c.reason.clone()),
        Some("NodesUnresponsive".to_string())
    );
    fleet
        .wait_kernels(
            std::slice::from_ref(&answering),
            128,
            Duration::from_secs(30),
        )
        .await;
    let over = grown.elapsed();

    fleet.set_ready(&silent, true).await;
    fleet.restart_agent(&silent);
    let back = Instant::now();
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(60), |p| {
            let status = status_of(p);
            (status.nodes.converged == 2 && status.nodes.unresponsive == 0)
                .then_some(())
                .ok_or(format!("{:?}", status.nodes))
        })
        .await;
    fleet
        .wait_kernels(&names, 128, Duration::from_secs(30))
        .await;
    let degraded = fleet
        .wait_pool(&pool, "Degraded", "False", Duration::from_secs(30), |_| {
            Ok(())
        })
        .await;
    let message = support::condition(&status_of(&degraded).conditions, "Degraded")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(!message.contains(&silent), "{message}");
    eprintln!(
        "fault: a node NotReady with its agent down (unresponsiveAfter 10s): named in \
         Progressing after {named:?}, passed over and the other node grown after {over:?}; \
         back: converged {:?} after Ready and its agent returned",
        back.elapsed()
    );
    fleet.shutdown().await;
}

/// The API server fails every write of the pool's status (500) for 30 s
/// while the pool grows: the nodes are written and converge meanwhile (the
/// failure stays with the pool's status), the operator's error counter
/// names it, and once writes succeed again the status catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundreds_on_a_pools_status_for_30_s_hold_up_only_its_status() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(
        &env,
        "status5xx",
        FleetSpec::new(3).label(ROLE_LABEL, "dpdk"),
    )
    .await;
    let replica = fleet.start_leading_replica().await;
    let scope = fleet.scope.clone();
    let pool = fleet
        .create_available_pool(pool_spec(&scope, "dpdk", 64, json!(3)))
        .await;
    let failing = support::fail_writes(
        &fleet.client,
        (support::SCOPE_LABEL, &scope),
        "hugepool.dev",
        "hugepagepools/status",
    )
    .await;
    let started = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 128})).await;
    // The nodes go on while the pool's status cannot be written.
    fleet
        .wait_kernels(&fleet.node_names(), 128, Duration::from_secs(60))
        .await;
    let kernels_done = started.elapsed();
    let metrics_addr = replica.addr.clone();
    support::wait_for(
        "the failed status writes counted",
        Duration::from_secs(30),
        || {
            let addr = metrics_addr.clone();
            async move {
                let text = hugepool_e2e::http_get(&addr, "/metrics")?;
                text.lines()
                    .any(|l| {
                        l.starts_with("hugepool_reconcile_errors_total{error=\"pool_status\"}")
                    })
                    .then_some(())
                    .ok_or(text)
            }
        },
    )
    .await;
    let stale = status_of(&fleet.pool(&pool).await);
    assert_eq!(
        stale.pages.target,
        3 * 64,
        "the status stayed as it was: {stale:?}"
    );
    // 30 s of failures in all, then writes succeed again.
    let left = Duration::from_secs(30).saturating_sub(started.elapsed());
    tokio::time::sleep(left).await;
    support::stop_failing_writes(&fleet.client, &failing).await;
    let healed = Instant::now();
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |p| {
            let status = status_of(p);
            (status.pages.target == 3 * 128 && status.nodes.converged == 3)
                .then_some(())
                .ok_or(format!("{:?}", status.pages))
        })
        .await;
    eprintln!(
        "fault: 500 on every write of a pool's status for 30 s: the kernels reached the new \
         target after {kernels_done:?} meanwhile; the status caught up {:?} after writes \
         succeeded again",
        healed.elapsed()
    );
    fleet.shutdown().await;
}

/// 500 on every spec write of one node's HugePageNode for 30 s (an admission
/// webhook that cannot be reached): the other nodes of the rollout go on,
/// the pool names the failing node with its error, and once writes succeed
/// again its backoff brings it to the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundreds_on_one_nodes_spec_for_30_s_hold_up_only_that_node() {
    let Some(env) = setup().await else { return };
    let mut fleet =
        Fleet::start(&env, "spec5xx", FleetSpec::new(3).label(ROLE_LABEL, "dpdk")).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let pool = fleet
        .create_available_pool(pool_spec(&scope, "dpdk", 64, json!(3)))
        .await;
    let names = fleet.node_names();
    let (failing_node, others) = names.split_first().expect("three nodes");
    let label = ("hugepool-fault", "spec-writes");
    Api::<HugePageNode>::all(fleet.client.clone())
        .patch(
            failing_node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {label.0: label.1}}})),
        )
        .await
        .expect("label the failing node's HugePageNode");
    let failing = support::fail_writes(&fleet.client, label, "hugepool.dev", "hugepagenodes").await;
    let started = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 128})).await;
    fleet
        .wait_kernels(others, 128, Duration::from_secs(60))
        .await;
    let others_done = started.elapsed();
    fleet
        .wait_pool(&pool, "Degraded", "True", Duration::from_secs(60), |p| {
            let status = status_of(p);
            let degraded = support::condition(&status.conditions, "Degraded")
                .map(|c| (c.reason.clone(), c.message.clone()))
                .unwrap_or_default();
            (degraded.0 == "NodeWritesFailed"
                && degraded.1.contains(failing_node.as_str())
                && degraded.1.contains("500"))
            .then_some(())
            .ok_or(format!("{degraded:?}"))
        })
        .await;
    assert_eq!(fleet.node(failing_node).pages_2mi().0, 64);
    assert!(
        fleet
            .node_state(failing_node)
            .await
            .spec
            .page_sizes
            .iter()
            .all(|e| e.pages == 64),
        "a write got through the failing webhook"
    );
    let left = Duration::from_secs(30).saturating_sub(started.elapsed());
    tokio::time::sleep(left).await;
    support::stop_failing_writes(&fleet.client, &failing).await;
    let healed = Instant::now();
    let status = fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(360), |p| {
            let status = status_of(p);
            let degraded = support::condition(&status.conditions, "Degraded")
                .is_some_and(|c| c.status == "True");
            (status.nodes.converged == 3 && !degraded)
                .then_some(())
                .ok_or(format!("{:?} {:?}", status.nodes, status.conditions))
        })
        .await;
    fleet
        .wait_kernels(&names, 128, Duration::from_secs(30))
        .await;
    eprintln!(
        "fault: 500 on every spec write of one node for 30 s: the other nodes reached the new \
         target after {others_done:?}; the failing node was named, and converged {:?} after \
         writes succeeded again",
        healed.elapsed()
    );
    assert_eq!(status_of(&status).pages.current, 3 * 128);
    fleet.shutdown().await;
}

/// An eviction webhook that never answers: the API server gives up at the
/// webhook's timeout (30 s) and refuses the eviction; the pod is named on
/// its node meanwhile and the refusal after; once the webhook answers, the
/// eviction goes through on its next try, recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_webhook_that_hangs_to_its_timeout_is_named_and_retried() {
    let Some(env) = setup().await else { return };
    let (fleet, pool, blocked, consumer, webhook) =
        drain_behind_a_webhook(&env, "hanghook", "hang", one_replica).await;
    let scope = fleet.scope.clone();
    let (kubelet, kubelet_task) = play_consumer(&fleet, &blocked);
    let shrink = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 100})).await;
    let unanswered = format!("eviction of {scope}/consumer unanswered since");
    let refused = format!("eviction of {scope}/consumer refused");
    support::wait_for(
        "the hanging eviction named",
        Duration::from_secs(60),
        || async {
            let message = draining_message(&fleet.node_state(&blocked).await);
            message.contains(&unanswered).then_some(()).ok_or(message)
        },
    )
    .await;
    support::wait_for(
        "the refusal at the webhook's timeout named",
        Duration::from_secs(90),
        || async {
            let message = draining_message(&fleet.node_state(&blocked).await);
            message.contains(&refused).then_some(()).ok_or(message)
        },
    )
    .await;
    let timed_out = shrink.elapsed();
    assert!(kubelet.lock().expect("kubelet").evicted.is_empty());
    webhook.set_mode("allow");
    let allowed = Instant::now();
    let status = wait_shrunk(&fleet, &pool, Duration::from_secs(120)).await;
    eprintln!(
        "fault: eviction webhook that never answers (timeoutSeconds 30): refused and named \
         after {timed_out:?}; the drain finished {:?} after the webhook answered again",
        allowed.elapsed()
    );
    let uids: Vec<&str> = status.evicted_pods.iter().map(|e| e.uid.as_str()).collect();
    assert_eq!(uids, [consumer.metadata.uid.as_deref().expect("uid")]);
    assert_eq!(
        kubelet.lock().expect("kubelet").evicted,
        [("consumer".to_string(), true)]
    );
    webhook.remove(&env.client).await;
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// The leader is killed while its real eviction waits on a slow webhook
/// (the record already written): the other replica takes over and finishes
/// the drain; the pod is evicted once and recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_mid_drain_the_other_replica_finishes_it_with_one_eviction_and_one_record()
 {
    let Some(env) = setup().await else { return };
    let lease = "hugepool-operator";
    let replicas = |scope: &str| {
        ["replica-a", "replica-b"]
            .map(|identity| LeaderConfig {
                namespace: scope.to_string(),
                lease_name: lease.to_string(),
                identity: identity.to_string(),
                duration: Duration::from_secs(3),
                grace: Duration::from_secs(1),
            })
            .to_vec()
    };
    let (mut fleet, pool, blocked, consumer, webhook) =
        drain_behind_a_webhook(&env, "killdrain", "delay=8s", replicas).await;
    let scope = fleet.scope.clone();
    let (kubelet, kubelet_task) = play_consumer(&fleet, &blocked);
    fleet.patch_pool(&pool, json!({"pages": 100})).await;
    // A's real eviction is at the webhook: its record is written.
    support::wait_for(
        "A's real eviction sent",
        Duration::from_secs(60),
        || async {
            let asked = webhook.requests();
            asked
                .iter()
                .any(|r| r.starts_with("dryRun=false"))
                .then_some(())
                .ok_or(format!("{asked:?}"))
        },
    )
    .await;
    let recorded = status_of(&fleet.pool(&pool).await).evicted_pods.len();
    fleet.take_operator(0).kill().await;
    let killed = Instant::now();
    let status = wait_shrunk(&fleet, &pool, Duration::from_secs(120)).await;
    eprintln!(
        "fault: the leader killed while its eviction waited on an 8 s webhook (record {}): \
         the other replica finished the drain {:?} after the kill",
        if recorded == 1 {
            "written"
        } else {
            "not yet seen"
        },
        killed.elapsed()
    );
    let uids: Vec<&str> = status.evicted_pods.iter().map(|e| e.uid.as_str()).collect();
    assert_eq!(uids, [consumer.metadata.uid.as_deref().expect("uid")]);
    assert_eq!(
        kubelet.lock().expect("kubelet").evicted,
        [("consumer".to_string(), true)],
        "evicted once"
    );
    assert_eq!(
        support::lease_holder(&fleet.client, &scope, lease)
            .await
            .as_deref(),
        Some("replica-b")
    );
    webhook.remove(&env.client).await;
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// The API server (and etcd) killed mid-rollout and started again on a
/// control plane of this test's own: the operator's watches, writes and
/// the agents reconnect, the rollout finishes within `maxUnavailable`
/// and every kernel reaches the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apiserver_killed_mid_rollout_and_started_again_the_rollout_finishes() {
    if setup().await.is_none() {
        return;
    }
    let (mut own, env, dir) = support::own_control_plane("apiserver-restart").await;
    let mut fleet =
        Fleet::start(&env, "restart", FleetSpec::new(6).label(ROLE_LABEL, "dpdk")).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let pool = fleet
        .create_available_pool(pool_spec(&scope, "dpdk", 64, json!(1)))
        .await;
    let names = fleet.node_names();
    fleet.patch_pool(&pool, json!({"pages": 2048})).await;
    support::wait_for("the first node grown", Duration::from_secs(60), || async {
        names
            .iter()
            .any(|n| fleet.node(n).pages_2mi().0 == 2048)
            .then_some(())
            .ok_or("none yet".to_string())
    })
    .await;
    tokio::task::block_in_place(|| own.kill());
    let grown_at_kill = names
        .iter()
        .filter(|n| fleet.node(n).pages_2mi().0 == 2048)
        .count();
    tokio::task::block_in_place(|| own.restart()).expect("the control plane started again");
    let back = Instant::now();
    let status = fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |p| {
            let status = status_of(p);
            (status.nodes.converged == 6 && status.pages.current == 6 * 2048)
                .then_some(())
                .ok_or(format!("{:?} {:?}", status.nodes, status.pages))
        })
        .await;
    fleet
        .wait_kernels(&names, 2048, Duration::from_secs(30))
        .await;
    eprintln!(
        "fault: apiserver and etcd killed mid-rollout ({grown_at_kill}/6 nodes grown) and \
         started again: the rollout finished {:?} after the apiserver was back",
        back.elapsed()
    );
    assert_eq!(status_of(&status).pages.target, 6 * 2048);
    fleet.shutdown().await;
    drop(own);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The operator killed in the middle of a `Release` deletion and started
/// again: the new one finishes the release, and the pool goes only once
/// every node is back at 0 (a finalizer removed early would leave pages on
/// the nodes for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_restarted_mid_release_deletion_returns_every_node_to_zero() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(
        &env,
        "releasekill",
        FleetSpec::new(4).label(ROLE_LABEL, "dpdk"),
    )
    .await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let mut spec = pool_spec(&scope, "dpdk", 2048, json!(1));
    spec["deletionPolicy"] = json!("Release");
    let pool = fleet.create_available_pool(spec).await;
    let names = fleet.node_names();
    fleet
        .pool_api()
        .delete(&pool, &kube::api::DeleteParams::default())
        .await
        .expect("delete the pool");
    support::wait_for(
        "the first node released",
        Duration::from_secs(60),
        || async {
            names
                .iter()
                .any(|n| fleet.node(n).pages_2mi().0 == 0)
                .then_some(())
                .ok_or("none yet".to_string())
        },
    )
    .await;
    fleet.take_operator(0).kill().await;
    let released_at_kill = names
        .iter()
        .filter(|n| fleet.node(n).pages_2mi().0 == 0)
        .count();
    fleet.start_operator(None).await;
    let restarted = Instant::now();
    support::wait_for("the pool gone", Duration::from_secs(120), || async {
        match fleet.pool_api().get_opt(&pool).await {
            Ok(None) => Ok(()),
            other => Err(format!(
                "{:?}",
                other.map(|p| p.map(|p| status_of(&p).nodes))
            )),
        }
    })
    .await;
    let gone = restarted.elapsed();
    fleet.wait_kernels(&names, 0, Duration::from_secs(30)).await;
    eprintln!(
        "fault: the operator killed mid-Release deletion ({released_at_kill}/4 nodes released) \
         and started again: the pool went {gone:?} after the restart, every node at 0"
    );
    fleet.shutdown().await;
}

/// Something writes every HugePageNode of the fleet all the time (here
/// their annotations, which move the objects' resourceVersion as the
/// agents' status writes do at every refresh) while a rollout runs: the
/// spec writes, conditioned on the generation, never conflict with them,
/// and the rollout finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_beside_the_operators_never_make_its_spec_writes_conflict() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(
        &env,
        "chatter",
        FleetSpec::new(10).label(ROLE_LABEL, "dpdk"),
    )
    .await;
    let replica = fleet.start_leading_replica().await;
    let scope = fleet.scope.clone();
    let pool = fleet
        .create_available_pool(pool_spec(&scope, "dpdk", 64, json!(3)))
        .await;
    let names = fleet.node_names();
    let writes = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    // One writer per node, each writing its node's object again as soon
    // as the last write returned.
    let chatter: Vec<_> = names
        .iter()
        .map(|name| {
            let api: Api<HugePageNode> = Api::all(fleet.client.clone());
            let name = name.clone();
            let writes = std::sync::Arc::clone(&writes);
            tokio::spawn(async move {
                for round in 0u64.. {
                    let patch = json!({"metadata": {"annotations": {
                        "faults.hugepool.dev/chatter": round.to_string(),
                    }}});
                    let params = kube::api::PatchParams::default();
                    if api
                        .patch(&name, &params, &kube::api::Patch::Merge(&patch))
                        .await
                        .is_ok()
                    {
                        writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    support::wait_for("the chatter running", Duration::from_secs(30), || async {
        (writes.load(std::sync::atomic::Ordering::Relaxed) >= 20)
            .then_some(())
            .ok_or("not yet".to_string())
    })
    .await;
    let started = Instant::now();
    let before = writes.load(std::sync::atomic::Ordering::Relaxed);
    fleet.patch_pool(&pool, json!({"pages": 512})).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |p| {
            let status = status_of(p);
            (status.nodes.converged == 10 && status.pages.current == 10 * 512)
                .then_some(())
                .ok_or(format!("{:?}", status.nodes))
        })
        .await;
    let took = started.elapsed();
    let beside = writes.load(std::sync::atomic::Ordering::Relaxed) - before;
    for writer in &chatter {
        writer.abort();
    }
    fleet
        .wait_kernels(&names, 512, Duration::from_secs(30))
        .await;
    let metrics = hugepool_e2e::http_get(&replica.addr, "/metrics").expect("metrics");
    let conflicts = metrics
        .lines()
        .find_map(|l| l.strip_prefix("hugepool_write_conflicts_total "))
        .expect("the conflicts counter")
        .trim()
        .to_string();
    eprintln!(
        "fault: {beside} writes to the fleet's HugePageNodes beside a 10-node rollout: it \
         finished in {took:?} with {conflicts} write conflicts"
    );
    assert!(beside > 0);
    assert_eq!(conflicts, "0", "{metrics}");
    fleet.shutdown().await;
}

/// One pod holds pages of two pools (2Mi and 1Gi) on a node both shrink,
/// and every status write of the second pool fails: the record that landed
/// in the first is taken back and the pod is not evicted (nothing would
/// say why it went); once the writes succeed, it is evicted and both pools
/// record it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_whose_record_fails_in_one_of_its_pools_waits_and_is_withdrawn_from_the_other()
{
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(
        &env,
        "twopools",
        FleetSpec::new(1).label(ROLE_LABEL, "dpdk"),
    )
    .await;
    let scope = fleet.scope.clone();
    support::create_namespace(&fleet.client, &scope).await;
    fleet.start_operator(None).await;
    let node = fleet.node_name(0);
    let drained = |size: &str, pages: i64| {
        let mut spec = pool_spec(&scope, "dpdk", pages, json!(1));
        spec["pageSize"] = json!(size);
        spec["drain"] = json!({"policy": "IfNeeded", "timeout": "600s"});
        spec
    };
    let small = fleet.create_available_pool(drained("2Mi", 512)).await;
    let large = format!("{scope}-large");
    fleet.create_pool(&large, drained("1Gi", 4)).await;
    fleet
        .wait_pool(
            &large,
            "Available",
            "True",
            Duration::from_secs(120),
            |_| Ok(()),
        )
        .await;
    // The large pool alone carries the label the failing writes select.
    let failing_label = format!("{scope}-large");
    fleet
        .pool_api()
        .patch(
            &large,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"labels": {"faults.hugepool.dev/fail": failing_label}}}),
            ),
        )
        .await
        .expect("label the large pool");
    let kernel = &fleet.node(&node).kernel;
    assert_eq!(kernel.hold_pages(MI2, 0, 300).expect("hold 2Mi"), 300);
    assert_eq!(
        kernel
            .hold_pages(hugepool_crds::PageSize::SIZE_1GI, 0, 3)
            .expect("hold 1Gi"),
        3
    );
    let mut pod = support::pod("consumer", &node, "dpdk", Some("600Mi"));
    let resources = pod.spec.as_mut().expect("spec").containers[0]
        .resources
        .as_mut()
        .expect("resources");
    for amounts in [resources.requests.as_mut(), resources.limits.as_mut()]
        .into_iter()
        .flatten()
    {
        amounts.insert(
            "hugepages-1Gi".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("3Gi".into()),
        );
    }
    let consumer = support::run_pod(&fleet.client, &scope, pod).await;
    // A budget that allows no disruption holds the pod until both shrinks
    // are blocked, so that its one eviction is for both pools (the agent
    // may report one size blocked a pass before the other).
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(fleet.client.clone(), &scope);
    let budget: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "hold"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "dpdk"}}},
    }))
    .expect("a PodDisruptionBudget");
    budgets
        .create(&PostParams::default(), &budget)
        .await
        .expect("create the budget");
    let (kubelet, kubelet_task) =
        play_kubelet(&fleet, &scope, vec![("consumer".into(), node.clone(), 300)]);
    let failing = support::fail_writes(
        &fleet.client,
        ("faults.hugepool.dev/fail", &failing_label),
        "hugepool.dev",
        "hugepagepools/status",
    )
    .await;
    fleet.patch_pool(&small, json!({"pages": 100})).await;
    fleet.patch_pool(&large, json!({"pages": 1})).await;
    support::wait_for("both sizes drained", Duration::from_secs(60), || async {
        let message = draining_message(&fleet.node_state(&node).await);
        (message.contains("hugepages-2Mi") && message.contains("hugepages-1Gi"))
            .then_some(())
            .ok_or(message)
    })
    .await;
    budgets
        .delete("hold", &DeleteParams::default())
        .await
        .expect("delete the budget");

    let abandoned = format!("eviction of {scope}/consumer refused: its record did not land");
    support::wait_for(
        "the eviction abandoned",
        Duration::from_secs(90),
        || async {
            let message = draining_message(&fleet.node_state(&node).await);
            message.contains(&abandoned).then_some(()).ok_or(message)
        },
    )
    .await;
    // Taken back from the pool where it landed; the pod still runs.
    support::wait_for("the record withdrawn", Duration::from_secs(30), || async {
        let records = status_of(&fleet.pool(&small).await).evicted_pods;
        records
            .is_empty()
            .then_some(())
            .ok_or(format!("{records:?}"))
    })
    .await;
    assert!(kubelet.lock().expect("kubelet").evicted.is_empty());

    support::stop_failing_writes(&fleet.client, &failing).await;
    let uid = consumer.metadata.uid.clone().expect("uid");
    support::wait_for(
        "evicted and recorded in both pools",
        Duration::from_secs(120),
        || async {
            let small_uids: Vec<String> = status_of(&fleet.pool(&small).await)
                .evicted_pods
                .into_iter()
                .map(|e| e.uid)
                .collect();
            let large_uids: Vec<String> = status_of(&fleet.pool(&large).await)
                .evicted_pods
                .into_iter()
                .map(|e| e.uid)
                .collect();
            let evicted = !kubelet.lock().expect("kubelet").evicted.is_empty();
            (evicted && small_uids == [uid.clone()] && large_uids == [uid.clone()])
                .then_some(())
                .ok_or(format!("evicted {evicted}; {small_uids:?} {large_uids:?}"))
        },
    )
    .await;
    // The pod's 1Gi pages come back as its process would end.
    kernel
        .release_pages(hugepool_crds::PageSize::SIZE_1GI, 0, 3)
        .expect("release 1Gi");
    fleet
        .wait_pool(
            &large,
            "Available",
            "True",
            Duration::from_secs(120),
            |_| Ok(()),
        )
        .await;
    assert_eq!(
        kubelet.lock().expect("kubelet").evicted,
        [("consumer".to_string(), true)]
    );
    kubelet_task.abort();
    support::delete_namespace(&fleet.client, &scope).await;
    fleet.shutdown().await;
}

/// Every connection of the operator's cut (its watches and any write in
/// flight) right before the pool changes, and again each time a node
/// converges: each watch opens again, resumes or re-lists, and no change
/// made while it was down is missed; the rollout finishes with every node at
/// its target and the pool's counts exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_cut_again_and_again_miss_no_change() {
    let Some(env) = setup().await else { return };
    let mut fleet = Fleet::start(
        &env,
        "watchcut",
        FleetSpec::new(6).label(ROLE_LABEL, "dpdk"),
    )
    .await;
    let proxy = support::HoldingProxy::start(fleet.apiserver_addr().await).await;
    fleet.start_operator_through(None, proxy.url()).await;
    let scope = fleet.scope.clone();
    let pool = fleet
        .create_available_pool(pool_spec(&scope, "dpdk", 64, json!(1)))
        .await;
    let names = fleet.node_names();
    let connections = proxy.connections();
    // The change is made through the test's own client while the
    // operator's watches are down: it learns of it only from a watch
    // opened again.
    proxy.cut();
    let changed = Instant::now();
    fleet.patch_pool(&pool, json!({"pages": 512})).await;
    let (mut cuts, mut converged) = (1, 0);
    let rollout = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let now = names
                .iter()
                .filter(|n| fleet.node(n).pages_2mi().0 == 512)
                .count();
            if now == names.len() {
                return;
            }
            if now > converged {
                converged = now;
                proxy.cut();
                cuts += 1;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        rollout.is_ok(),
        "{converged}/6 nodes at 512 after 120 s and {cuts} cuts"
    );
    let status = fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |p| {
            let status = status_of(p);
            (status.nodes.converged == 6 && status.pages.current == 6 * 512)
                .then_some(())
                .ok_or(format!("{:?} {:?}", status.nodes, status.pages))
        })
        .await;
    eprintln!(
        "fault: every connection of the operator cut {cuts} times during a 6-node rollout at \
         maxUnavailable 1: Available {:?} after the change ({} connections opened again)",
        changed.elapsed(),
        proxy.connections() - connections
    );
    assert_eq!(status_of(&status).pages.target, 6 * 512);
    for name in &names {
        let spec = fleet.node_state(name).await.spec;
        assert!(
            spec.page_sizes.iter().all(|e| e.pages == 512),
            "{name}: {spec:?}"
        );
    }
    // Each cut closed the watches, which the operator opened again.
    assert!(
        proxy.connections() - connections >= cuts,
        "{} connections after {cuts} cuts",
        proxy.connections() - connections
    );
    fleet.shutdown().await;
}
