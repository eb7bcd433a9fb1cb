//! The controller's API calls, asserted in order against a mocked API server
//! (tower-test), one [`Scenario`] per behaviour.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hugepool_crds::conditions::set_condition;
use hugepool_crds::node::PageSizeStatus;
use hugepool_crds::settings::DeletionPolicy;
use hugepool_crds::{ConditionUpdate, HugePageNode, HugePagePool, NodeConditionType, Reason};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Client;
use kube::client::Body;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::writes::{RETRY_BASE, RETRY_MAX};
use super::*;
use crate::fixtures::{self, at, converge, hpn, node, pool, status_of};
use crate::metrics::Metrics;
use crate::planner::NodePlan;
use hugepool_crds::{POOL_FINALIZER, PageSize};
use kube::ResourceExt;

type ApiServerHandle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// Plays the API server: each step expects one request and answers it.
struct ApiServerVerifier(ApiServerHandle);

/// What the API server should see, in order.
enum Scenario {
    /// A new pool: finalizer, the node's HugePageNode, the pool's status and
    /// the RolloutStarted event.
    NewPool { pool: HugePagePool },
    /// A Retain pool being deleted: the entry goes, then the finalizer.
    RetainDeletion { pool: HugePagePool },
    /// Only the finalizer is removed (no HugePageNode names the pool).
    FinalizerRemoved { pool: HugePagePool },
    /// The API server fails one node's write: the other node and the
    /// pool's status are still written.
    OneNodeWriteFails { pool: HugePagePool },
}

/// The 500 an API server answers when etcd does not.
fn internal_error() -> Response<Body> {
    let failure = json!({
        "apiVersion": "v1", "kind": "Status", "status": "Failure",
        "message": "etcdserver: request timed out", "reason": "InternalError", "code": 500,
    });
    Response::builder()
        .status(StatusCode::INTERNAL_SERVER_ERROR)
        .body(Body::from(serde_json::to_vec(&failure).unwrap()))
        .unwrap()
}

fn ok_json(value: &impl serde::Serialize) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .body(Body::from(serde_json::to_vec(value).unwrap()))
        .unwrap()
}

impl ApiServerVerifier {
    fn run(self, scenario: Scenario) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            match scenario {
                Scenario::NewPool { pool } => {
                    let (verifier, with_finalizer) = self.expect_finalizer_added(&pool).await;
                    verifier
                        .expect_node_spec("w-1", Some(64))
                        .await
                        .expect_pool_status(&with_finalizer, |status| {
                            assert_eq!(status["nodes"]["updating"], 1);
                            assert_eq!(status["nodes"]["ready"], "0/1");
                            assert_eq!(status["pages"]["target"], 64);
                        })
                        .await
                        .expect_event("RolloutStarted")
                        .await;
                }
                Scenario::RetainDeletion { pool } => {
                    self.expect_node_spec_cleared("w-1")
                        .await
                        .expect_pool_status(&pool, |status| {
                            assert_eq!(status["nodes"]["selected"], 0);
                        })
                        .await;
                }
                Scenario::FinalizerRemoved { pool } => {
                    self.expect_finalizer_removed(&pool).await;
                }
                Scenario::OneNodeWriteFails { pool } => {
                    self.expect_node_spec_failure("w-1")
                        .await
                        .expect_node_spec("w-2", Some(64))
                        .await
                        .expect_event("WriteFailed")
                        .await
                        .expect_pool_status(&pool, |status| {
                            assert_eq!(status["nodes"]["updating"], 2);
                        })
                        .await
                        .expect_event("RolloutStarted")
                        .await;
                }
            }
        })
    }

    async fn next(
        &mut self,
    ) -> (
        Request<Body>,
        tower_test::mock::SendResponse<Response<Body>>,
    ) {
        self.0
            .next_request()
            .await
            .expect("the controller made no further call")
    }

    async fn body(request: Request<Body>) -> Value {
        let bytes = request.into_body().collect_bytes().await.unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    async fn expect_finalizer_added(mut self, pool: &HugePagePool) -> (Self, HugePagePool) {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!(
                "/apis/hugepool.dev/v1alpha1/hugepagepools/{}",
                pool.name_any()
            )
        );
        let body = Self::body(request).await;
        assert_eq!(body["metadata"]["finalizers"], json!([POOL_FINALIZER]));
        let mut updated = pool.clone();
        updated.metadata.finalizers = Some(vec![POOL_FINALIZER.into()]);
        updated.metadata.resource_version = Some("11".into());
        send.send_response(ok_json(&updated));
        (self, updated)
    }

    /// A new HugePageNode: created (a creation is its own precondition),
    /// owned by its Node.
    async fn expect_node_spec(mut self, node: &str, pages: Option<i64>) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            "/apis/hugepool.dev/v1alpha1/hugepagenodes"
        );
        let query = request.uri().query().unwrap_or_default().to_string();
        assert!(query.contains("fieldManager=hugepool-operator"), "{query}");
        let body = Self::body(request).await;
        assert_eq!(body["kind"], "HugePageNode");
        assert_eq!(body["metadata"]["name"], node);
        assert_eq!(body["metadata"]["ownerReferences"][0]["kind"], "Node");
        assert_eq!(
            body["metadata"]["ownerReferences"][0]["uid"],
            format!("uid-{node}")
        );
        let entries = body["spec"]["pageSizes"].as_array().unwrap().clone();
        match pages {
            Some(pages) => {
                assert_eq!(entries.len(), 1);
                assert_eq!(entries[0]["pages"], pages);
                assert_eq!(entries[0]["pool"], "dpdk");
            }
            None => assert!(entries.is_empty(), "{entries:?}"),
        }
        let mut reply = body.clone();
        reply["metadata"]["generation"] = json!(1);
        reply["metadata"]["resourceVersion"] = json!("20");
        send.send_response(ok_json(&reply));
        self
    }

    async fn expect_finalizer_failure(mut self, pool: &HugePagePool) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!(
                "/apis/hugepool.dev/v1alpha1/hugepagepools/{}",
                pool.name_any()
            )
        );
        send.send_response(internal_error());
        self
    }

    async fn expect_node_spec_failure(mut self, node: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(
            request.uri().path(),
            "/apis/hugepool.dev/v1alpha1/hugepagenodes"
        );
        assert_eq!(Self::body(request).await["metadata"]["name"], node);
        send.send_response(internal_error());
        self
    }

    async fn expect_node_spec_cleared(mut self, node: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!("/apis/hugepool.dev/v1alpha1/hugepagenodes/{node}")
        );
        let content_type = request.headers()[http::header::CONTENT_TYPE].clone();
        assert_eq!(content_type, "application/json-patch+json");
        let query = request.uri().query().unwrap_or_default().to_string();
        assert!(query.contains("fieldManager=hugepool-operator"), "{query}");
        let body = Self::body(request).await;
        // Only if the spec is still the one the plan read (generation 1).
        assert_eq!(
            body[0],
            json!({"op": "test", "path": "/metadata/generation", "value": 1})
        );
        assert_eq!(
            body[1],
            json!({"op": "add", "path": "/spec", "value": {"pageSizes": []}})
        );
        let reply = hpn(node, 3, vec![]);
        send.send_response(ok_json(&reply));
        self
    }

    async fn expect_pool_status(mut self, pool: &HugePagePool, check: impl FnOnce(&Value)) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!(
                "/apis/hugepool.dev/v1alpha1/hugepagepools/{}/status",
                pool.name_any()
            )
        );
        assert!(
            request
                .uri()
                .query()
                .unwrap_or_default()
                .contains("fieldManager=hugepool-operator")
        );
        let body = Self::body(request).await;
        // Only on the version the pass holds.
        assert_eq!(
            body["metadata"]["resourceVersion"],
            json!(pool.metadata.resource_version)
        );
        check(&body["status"]);
        let mut reply = serde_json::to_value(pool).unwrap();
        reply["status"] = body["status"].clone();
        send.send_response(ok_json(&reply));
        self
    }

    async fn expect_finalizer_removed(mut self, pool: &HugePagePool) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!(
                "/apis/hugepool.dev/v1alpha1/hugepagepools/{}",
                pool.name_any()
            )
        );
        let body = Self::body(request).await;
        assert_eq!(body["metadata"]["finalizers"], json!([]));
        send.send_response(ok_json(pool));
        self
    }

    async fn expect_event(mut self, reason: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            "/apis/events.k8s.io/v1/namespaces/default/events"
        );
        let body = Self::body(request).await;
        assert_eq!(body["reason"], reason, "{body}");
        send.send_response(ok_json(&body));
        self
    }
}

fn consumer(name: &str, resource: &str) -> Pod {
    let amounts =
        std::collections::BTreeMap::from([(resource.to_string(), Quantity("4Mi".into()))]);
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("apps".into()),
            uid: Some(format!("uid-{name}")),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some("w-1".into()),
            containers: vec![Container {
                name: "main".into(),
                resources: Some(ResourceRequirements {
                    requests: Some(amounts.clone()),
                    limits: Some(amounts),
                    ..ResourceRequirements::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}

fn store_of<K>(objects: &[K]) -> Store<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let mut writer: Writer<K> = Writer::default();
    writer.apply_watcher_event(&watcher::Event::Init);
    for object in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(object.clone()));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    writer.as_reader()
}

fn fixed_now() -> Timestamp {
    at(100)
}

struct Harness {
    ctx: Arc<Context>,
    verifier: ApiServerVerifier,
    _leader: watch::Sender<bool>,
}

fn harness(
    pools: &[HugePagePool],
    nodes: &[Node],
    states: &[HugePageNode],
    leader: bool,
) -> Harness {
    let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(mock, "default");
    let (leader_tx, leader_rx) = watch::channel(leader);
    let mut ctx = Context::new(
        client,
        store_of(pools),
        store_of(nodes),
        store_of(states),
        Arc::new(Metrics::default()),
        crate::leader::Fence::following(leader_rx),
        Arc::new(AtomicBool::new(true)),
        Config::default(),
    );
    ctx.now = fixed_now;
    Harness {
        ctx: Arc::new(ctx),
        verifier: ApiServerVerifier(handle),
        _leader: leader_tx,
    }
}

async fn pass_with(harness: Harness, scenario: Option<Scenario>) -> Pass {
    pass_result(harness, &mut Worker::default(), scenario)
        .await
        .expect("the pass succeeded")
}

/// Runs one pass while the verifier plays `scenario`; every expected call
/// must be made, and no other (an unanswered call hangs, and times out).
async fn pass_result(
    harness: Harness,
    worker: &mut Worker,
    scenario: Option<Scenario>,
) -> Result<Pass> {
    let Harness {
        ctx,
        verifier,
        _leader,
    } = harness;
    let server = scenario.map(|s| verifier.run(s));
    let result = tokio::time::timeout(Duration::from_secs(5), pass(&ctx, worker))
        .await
        .expect("the pass finished (an unexpected API call would hang it)");
    if let Some(server) = server {
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("every expected call was made")
            .expect("scenario assertions hold");
    }
    result
}

fn with_finalizer(mut pool: HugePagePool) -> HugePagePool {
    pool.metadata.finalizers = Some(vec![POOL_FINALIZER.into()]);
    pool.metadata.resource_version = Some("10".into());
    pool
}

#[tokio::test]
async fn new_pool_gets_its_finalizer_then_node_targets_then_status() {
    let pool = pool("dpdk", 0, "dpdk", "2Mi", 64);
    let nodes = vec![node("w-1", &["dpdk"])];
    let harness = harness(std::slice::from_ref(&pool), &nodes, &[], true);
    let pass = pass_with(harness, Some(Scenario::NewPool { pool: pool.clone() })).await;
    assert_eq!(pass.next, Config::default().resync);
}

#[tokio::test]
async fn a_pool_whose_finalizer_did_not_land_is_not_planned() {
    let pool = pool("dpdk", 0, "dpdk", "2Mi", 64);
    let nodes = vec![node("w-1", &["dpdk"])];
    let Harness {
        ctx,
        verifier,
        _leader,
    } = harness(std::slice::from_ref(&pool), &nodes, &[], true);
    let mut worker = Worker::default();
    // The finalizer's write fails; every other call is answered (with a
    // failure) and logged, until the pass's client goes.
    let others = Arc::new(std::sync::Mutex::new(Vec::new()));
    let server = tokio::spawn({
        let others = Arc::clone(&others);
        async move {
            let ApiServerVerifier(mut handle) = verifier.expect_finalizer_failure(&pool).await;
            while let Some((request, send)) = handle.next_request().await {
                let call = format!("{} {}", request.method(), request.uri().path());
                others.lock().unwrap().push(call);
                send.send_response(internal_error());
            }
        }
    });
    let pass = tokio::time::timeout(Duration::from_secs(5), pass(&ctx, &mut worker))
        .await
        .expect("the pass finished")
        .expect("the pass goes on");
    drop(ctx);
    drop(worker);
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the client went")
        .expect("the finalizer was asked for");
    // Nothing else: no HugePageNode, no status, no Event of the pool.
    assert_eq!(*others.lock().unwrap(), Vec::<String>::new());
    // The pool is retried soon.
    assert!(pass.next <= RETRY_BASE, "{pass:?}");
}

#[tokio::test]
async fn converged_pool_writes_nothing() {
    let mut pools = vec![with_finalizer(pool("dpdk", 0, "dpdk", "2Mi", 64))];
    let nodes = vec![node("w-1", &["dpdk"])];
    let mut states = Vec::new();
    let plan = fixtures::run_plan(&pools, &nodes, &states, 0);
    fixtures::apply_specs(&plan, &mut states);
    states.iter_mut().for_each(converge);
    for state in &mut states {
        owned_by_w1(state);
    }
    let plan = plan_at(&pools, &nodes, &states);
    fixtures::apply_statuses(&plan, &mut pools);
    let harness = harness(&pools, &nodes, &states, true);
    let pass = pass_with(harness, None).await;
    assert_eq!(pass.next, Config::default().resync);
}

/// Gives `state` the owner the operator writes: the Node w-1.
fn owned_by_w1(state: &mut HugePageNode) {
    state.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: "w-1".into(),
            uid: "uid-w-1".into(),
            ..Default::default()
        },
    ]);
}

fn plan_at(pools: &[HugePagePool], nodes: &[Node], states: &[HugePageNode]) -> planner::Plan {
    let nodes: Vec<&Node> = nodes.iter().collect();
    let states: Vec<&HugePageNode> = states.iter().collect();
    planner::plan(&PlanInput {
        observed: &Default::default(),
        pools,
        nodes: &nodes,
        node_states: &states,
        now: fixed_now(),
        agent_nodes: None,
    })
}

#[tokio::test]
async fn a_replica_that_does_not_lead_writes_nothing() {
    let pool = pool("dpdk", 0, "dpdk", "2Mi", 64);
    let nodes = vec![node("w-1", &["dpdk"])];
    let harness = harness(std::slice::from_ref(&pool), &nodes, &[], false);
    let result = pass_result(harness, &mut Worker::default(), None).await;
    assert!(matches!(result, Err(Error::NotLeader)), "{result:?}");
}

#[tokio::test]
async fn retain_deletion_drops_the_entries_then_the_finalizer() {
    let mut pool = with_finalizer(pool("dpdk", 0, "dpdk", "2Mi", 64));
    pool.spec.deletion_policy = DeletionPolicy::Retain;
    pool.metadata.deletion_timestamp = Some(Time(at(50)));
    let nodes = vec![node("w-1", &["dpdk"])];
    let mut state = hpn(
        "w-1",
        1,
        vec![fixtures::EntryForTest::entry_for_test(&pool, 64)],
    );
    converge(&mut state);
    // The pass that clears the entry keeps the finalizer: its write might
    // not land.
    let clearing = harness(std::slice::from_ref(&pool), &nodes, &[state.clone()], true);
    let pass = pass_with(
        clearing,
        Some(Scenario::RetainDeletion { pool: pool.clone() }),
    )
    .await;
    assert_eq!(pass.next, Config::default().resync);
    // Once the cache shows no entry for it, the next pass lets it go.
    state.spec.page_sizes.clear();
    owned_by_w1(&mut state);
    let states = [state];
    let plan = plan_at(std::slice::from_ref(&pool), &nodes, &states);
    assert!(plan.pools["dpdk"].remove_finalizer);
    pool.status = Some(plan.pools["dpdk"].status.clone());
    let cleared = harness(std::slice::from_ref(&pool), &nodes, &states, true);
    pass_with(cleared, Some(Scenario::FinalizerRemoved { pool })).await;
}

/// A pool shrunk to 0 on w-1, whose 2 pages a pod holds: the agent
/// reports the shrink blocked. The Node carries another taint.
fn blocked_shrink() -> (HugePagePool, Node, HugePageNode) {
    let mut pool = with_finalizer(pool("dpdk", 0, "dpdk", "2Mi", 0));
    pool.metadata.generation = Some(2);
    let mut node = node("w-1", &["dpdk"]);
    node.metadata.resource_version = Some("5".into());
    node.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        taints: Some(vec![k8s_openapi::api::core::v1::Taint {
            key: "other".into(),
            effect: "NoExecute".into(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    let mut state = hpn(
        "w-1",
        2,
        vec![fixtures::EntryForTest::entry_for_test(&pool, 0)],
    );
    owned_by_w1(&mut state);
    let status = status_of(&mut state);
    status.observed_generation = Some(2);
    status.page_sizes = vec![PageSizeStatus {
        size: PageSize::SIZE_2MI,
        target: Some(0),
        total: 2,
        surplus: 2,
        in_use: 2,
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
    (pool, node, state)
}

/// One call the API server saw.
#[derive(Clone, Debug)]
struct Call {
    method: Method,
    path: String,
    query: String,
    body: Value,
}

impl Call {
    fn is_eviction(&self, dry_run: bool) -> bool {
        self.method == Method::POST
            && self.path.ends_with("/eviction")
            && self.query.contains("dryRun=All") == dry_run
    }

    fn event(&self) -> Option<&str> {
        (self.method == Method::POST && self.path.contains("/events"))
            .then(|| self.body["reason"].as_str())
            .flatten()
    }

    fn pool_status(&self) -> Option<&Value> {
        (self.method == Method::PATCH && self.path.ends_with("/hugepagepools/dpdk/status"))
            .then_some(&self.body["status"])
    }

    /// The pods a pool status write records as evicted.
    fn recorded(&self) -> Option<Vec<String>> {
        self.pool_status().map(|status| {
            status["evictedPods"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| {
                    format!(
                        "{} {}",
                        e["pod"].as_str().unwrap(),
                        e["uid"].as_str().unwrap()
                    )
                })
                .collect()
        })
    }

    fn draining_message(&self) -> Option<&str> {
        (self.method == Method::PATCH && self.path.ends_with("/hugepagenodes/w-1/status"))
            .then(|| self.body["status"]["conditions"][0]["message"].as_str())
            .flatten()
    }
}

/// How the API server answers the evictions of apps/dpdk.
#[derive(Clone, Default)]
struct Evictions {
    dry_run: Option<StatusCode>,
    real: Option<StatusCode>,
    /// The dry run's answer waits for this (a slow webhook the test ends).
    dry_run_held: Option<Arc<tokio::sync::Notify>>,
    /// The node's pods list is refused (403: RBAC).
    pods_forbidden: bool,
}

/// Plays an API server by route (a drain's calls come from a pass and from
/// the eviction tasks beside it, in no fixed order): lists w-1's pods,
/// takes every write, answers apps/dpdk's evictions as `evictions` says
/// (None: never answered), and logs every call.
fn serve(
    mut handle: ApiServerHandle,
    node: Node,
    pool: HugePagePool,
    evictions: Evictions,
) -> (
    Arc<std::sync::Mutex<Vec<Call>>>,
    tokio::task::JoinHandle<()>,
) {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let calls = Arc::clone(&log);
    let task = tokio::spawn(async move {
        let mut unanswered = Vec::new();
        let mut watches = 0;
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap();
            let call = Call {
                method: parts.method,
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or_default().to_string(),
                body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            };
            calls.lock().unwrap().push(call.clone());
            // The drain's watch of the node's pods: the first one sees
            // "web" go; later ones stay open.
            if call.query.contains("watch=true") {
                watches += 1;
                if watches > 1 {
                    unanswered.push(send);
                    continue;
                }
                let mut gone = consumer("web", "memory");
                gone.metadata.resource_version = Some("41".into());
                let event = json!({"type": "DELETED", "object": gone});
                send.send_response(
                    Response::builder()
                        .status(StatusCode::OK)
                        .body(Body::from(format!("{event}\n").into_bytes()))
                        .unwrap(),
                );
                continue;
            }
            let (code, reply) = if call.path == "/api/v1/pods" && evictions.pods_forbidden {
                let refusal = json!({
                    "apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "message": "pods is forbidden: User \"hugepool-operator\" cannot list resource \"pods\"",
                    "reason": "Forbidden", "code": 403,
                });
                (StatusCode::FORBIDDEN, refusal)
            } else if call.path == "/api/v1/pods" {
                let pods = json!({
                    "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "40"},
                    "items": [consumer("dpdk", "hugepages-2Mi"), consumer("web", "memory")],
                });
                (StatusCode::OK, pods)
            } else if call.path.ends_with("/eviction") {
                let dry_run = call.is_eviction(true);
                let answer = if dry_run {
                    evictions.dry_run
                } else {
                    evictions.real
                };
                let Some(code) = answer else {
                    unanswered.push(send);
                    continue;
                };
                let reason = match code.as_u16() {
                    404 => "NotFound",
                    429 => "TooManyRequests",
                    _ => "",
                };
                let status = if code.is_success() {
                    "Success"
                } else {
                    "Failure"
                };
                let reply = json!({
                    "apiVersion": "v1", "kind": "Status", "status": status,
                    "message": format!("answered {}", code.as_u16()), "reason": reason,
                    "code": code.as_u16(),
                });
                if let (true, Some(held)) = (dry_run, evictions.dry_run_held.clone()) {
                    tokio::spawn(async move {
                        held.notified().await;
                        send.send_response(
                            Response::builder()
                                .status(code)
                                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                                .unwrap(),
                        );
                    });
                    continue;
                }
                (code, reply)
            } else if call.path.starts_with("/api/v1/nodes/") {
                (StatusCode::OK, serde_json::to_value(&node).unwrap())
            } else if call.pool_status().is_some() {
                let mut reply = serde_json::to_value(&pool).unwrap();
                reply["status"] = call.body["status"].clone();
                (StatusCode::OK, reply)
            } else if call.path.ends_with("/hugepagenodes/w-1/status") {
                let mut reply = call.body.clone();
                reply["metadata"] =
                    json!({"name": "w-1", "generation": 2, "resourceVersion": "30"});
                reply["spec"] = json!({"pageSizes": []});
                (StatusCode::OK, reply)
            } else {
                (StatusCode::OK, call.body.clone())
            };
            send.send_response(
                Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap(),
            );
        }
    });
    (log, task)
}

thread_local! {
    /// The tests' clock, in seconds after `fixtures::T0` (per test thread:
    /// each `#[tokio::test]` runs on its own).
    static CLOCK: std::cell::Cell<i64> = const { std::cell::Cell::new(100) };
}

fn test_clock() -> Timestamp {
    at(CLOCK.with(std::cell::Cell::get))
}

/// A blocked shrink whose evictions run against [`serve`]: passes run one
/// after another (each after the worker is woken, as `run` does) until
/// `done` holds of the calls; the pool's cache follows its status writes,
/// as the watch would.
struct Drain {
    ctx: Arc<Context>,
    worker: Worker,
    log: Arc<std::sync::Mutex<Vec<Call>>>,
    pools: Writer<HugePagePool>,
    pool: HugePagePool,
    _leader: watch::Sender<bool>,
    _server: tokio::task::JoinHandle<()>,
}

impl Drain {
    fn start(evictions: Evictions) -> Drain {
        CLOCK.with(|c| c.set(100));
        let (pool, node, state) = blocked_shrink();
        let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(mock, "default");
        let (leader, leading) = watch::channel(true);
        let mut pools: Writer<HugePagePool> = Writer::default();
        pools.apply_watcher_event(&watcher::Event::Init);
        pools.apply_watcher_event(&watcher::Event::InitApply(pool.clone()));
        pools.apply_watcher_event(&watcher::Event::InitDone);
        let mut ctx = Context::new(
            client,
            pools.as_reader(),
            store_of(std::slice::from_ref(&node)),
            store_of(&[state]),
            Arc::new(Metrics::default()),
            crate::leader::Fence::following(leading),
            Arc::new(AtomicBool::new(true)),
            Config::default(),
        );
        ctx.now = test_clock;
        let (log, server) = serve(handle, node, pool.clone(), evictions);
        Drain {
            ctx: Arc::new(ctx),
            worker: Worker::default(),
            log,
            pools,
            pool,
            _leader: leader,
            _server: server,
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.log.lock().unwrap().clone()
    }

    /// A drain whose dry run (then real eviction) is accepted, the dry run
    /// sent and held until the returned Notify is notified.
    async fn dry_run_held() -> (Drain, Arc<tokio::sync::Notify>) {
        let held = Arc::new(tokio::sync::Notify::new());
        let mut drain = Drain::start(Evictions {
            dry_run: Some(StatusCode::CREATED),
            real: Some(StatusCode::CREATED),
            dry_run_held: Some(Arc::clone(&held)),
            ..Evictions::default()
        });
        drain
            .until("the dry run sent", |calls| {
                calls.iter().any(|c| c.is_eviction(true))
            })
            .await;
        (drain, held)
    }

    async fn pass(&mut self) -> Pass {
        let pass = tokio::time::timeout(Duration::from_secs(5), pass(&self.ctx, &mut self.worker))
            .await
            .expect("the pass finished: it waits for no eviction")
            .expect("the pass succeeded");
        // The pool's watch delivers its last status; nothing else is awaited.
        let last_status = self
            .calls()
            .iter()
            .rev()
            .find_map(|c| c.pool_status().cloned());
        let pool_there = !self.pools.as_reader().state().is_empty();
        if let Some(status) = last_status.filter(|_| pool_there) {
            let mut pool = self.pool.clone();
            pool.status = Some(serde_json::from_value(status).unwrap());
            self.pools.apply_watcher_event(&watcher::Event::Apply(pool));
        }
        self.ctx.deliveries.give_up();
        pass
    }

    /// Passes, each after a wake-up, until `done` holds of the calls.
    async fn until(&mut self, what: &str, done: impl Fn(&[Call]) -> bool) {
        for _ in 0..10 {
            self.pass().await;
            if done(&self.calls()) {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), self.ctx.wake.notified()).await;
        }
        panic!("{what}: not seen in 10 passes; calls: {:#?}", self.calls());
    }
}

fn position(calls: &[Call], what: &str, found: impl Fn(&Call) -> bool) -> usize {
    calls
        .iter()
        .position(found)
        .unwrap_or_else(|| panic!("{what}: not among {calls:#?}"))
}

const DPDK: &str = "apps/dpdk uid-dpdk";

#[tokio::test]
async fn an_eviction_is_recorded_in_its_pools_status_before_it_is_made() {
    let mut drain = Drain::start(Evictions {
        dry_run: Some(StatusCode::CREATED),
        real: Some(StatusCode::CREATED),
        ..Evictions::default()
    });
    drain
        .until("the Evicted event", |calls| {
            calls.iter().any(|c| c.event() == Some("Evicted"))
        })
        .await;
    let calls = drain.calls();
    // The drain starts: its condition, event and taint; only the hugepage
    // consumer is asked for, never "web".
    let condition = position(&calls, "Draining=True", |c| c.draining_message().is_some());
    assert_eq!(
        calls[condition].body["status"]["conditions"][0]["reason"],
        "EvictingPods"
    );
    position(&calls, "DrainStarted", |c| {
        c.event() == Some("DrainStarted")
    });
    assert!(calls.iter().all(|c| !c.path.contains("/pods/web/")));
    let dry_run = position(&calls, "the dry run", |c| c.is_eviction(true));
    let recorded = position(&calls, "the record", |c| {
        c.recorded().is_some_and(|r| r == [DPDK])
    });
    let evicted = position(&calls, "the eviction", |c| c.is_eviction(false));
    let told = position(&calls, "the event", |c| c.event() == Some("Evicted"));
    assert!(
        dry_run < recorded && recorded < evicted && evicted < told,
        "{calls:#?}"
    );
    // Asked for once, recorded once.
    assert_eq!(calls.iter().filter(|c| c.is_eviction(false)).count(), 1);
    let status = &calls[recorded].pool_status().unwrap()["evictedPods"][0];
    assert_eq!(status["node"], "w-1");
    assert_eq!(status["pages"], 2);
    let metrics = drain.ctx.metrics.encode();
    assert!(
        metrics.contains(r#"hugepool_evictions_total{pool="dpdk",result="evicted"} 1"#),
        "{metrics}"
    );
}

/// The real eviction answers `real` after an accepted dry run: the record
/// written before it goes again, and the pod is not counted evicted.
async fn record_withdrawn_when_the_real_eviction_answers(real: StatusCode, result: &str) {
    let mut drain = Drain::start(Evictions {
        dry_run: Some(StatusCode::CREATED),
        real: Some(real),
        ..Evictions::default()
    });
    drain
        .until("the record withdrawn", |calls| {
            let Some(evicted) = calls.iter().position(|c| c.is_eviction(false)) else {
                return false;
            };
            calls[evicted..]
                .iter()
                .any(|c| c.recorded().is_some_and(|r| r.is_empty()))
        })
        .await;
    let calls = drain.calls();
    let recorded = position(&calls, "the record", |c| {
        c.recorded().is_some_and(|r| r == [DPDK])
    });
    let evicted = position(&calls, "the eviction", |c| c.is_eviction(false));
    assert!(recorded < evicted, "{calls:#?}");
    let status = drain.ctx.pools.state()[0].status.clone().unwrap();
    assert!(status.evicted_pods.is_empty(), "{status:?}");
    let metrics = drain.ctx.metrics.encode();
    assert!(
        metrics.contains(&format!(
            r#"hugepool_evictions_total{{pool="dpdk",result="{result}"}} 1"#
        )),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"result="evicted""#), "{metrics}");
}

#[tokio::test]
async fn a_real_eviction_refused_after_an_accepted_dry_run_is_not_recorded() {
    record_withdrawn_when_the_real_eviction_answers(StatusCode::TOO_MANY_REQUESTS, "blocked").await;
}

#[tokio::test]
async fn a_pod_gone_between_the_dry_run_and_the_eviction_is_not_recorded() {
    record_withdrawn_when_the_real_eviction_answers(StatusCode::NOT_FOUND, "gone").await;
}

/// The dry run is accepted only after `change` made the plan no longer
/// want the eviction: the real eviction is never sent, no record stays, and
/// the abandonment is told (Event, metric).
async fn an_eviction_the_plan_no_longer_wants_is_not_sent(change: impl FnOnce(&mut Drain)) {
    let (mut drain, held) = Drain::dry_run_held().await;
    change(&mut drain);
    drain.pass().await;
    drain.pass().await;
    held.notify_one();
    drain
        .until("the abandonment told", |calls| {
            calls.iter().any(|c| c.event() == Some("EvictionAbandoned"))
        })
        .await;
    drain.pass().await;
    let calls = drain.calls();
    assert!(calls.iter().all(|c| !c.is_eviction(false)), "{calls:#?}");
    let recorded = calls.iter().rev().find_map(Call::recorded);
    assert!(
        recorded.as_ref().is_none_or(|r| r.is_empty()),
        "the last record written: {recorded:?}"
    );
    assert!(
        drain.worker.evictions.may_ask("uid-dpdk", test_clock()),
        "nothing stays in flight"
    );
}

#[tokio::test]
async fn a_reverted_shrink_sends_no_eviction_its_dry_run_accepted_late() {
    an_eviction_the_plan_no_longer_wants_is_not_sent(|drain| {
        let mut pool = drain.pool.clone();
        pool.spec.pages = Some(2);
        pool.metadata.generation = Some(3);
        drain.pool = pool.clone();
        drain
            .pools
            .apply_watcher_event(&watcher::Event::Apply(pool));
    })
    .await;
}

#[tokio::test]
async fn a_pool_deleted_mid_drain_leaves_no_eviction_waiting() {
    an_eviction_the_plan_no_longer_wants_is_not_sent(|drain| {
        drain
            .pools
            .apply_watcher_event(&watcher::Event::Delete(drain.pool.clone()));
    })
    .await;
}

#[tokio::test]
async fn a_replica_deposed_mid_eviction_uses_nothing_from_before_when_it_leads_again() {
    let (mut drain, held) = Drain::dry_run_held().await;
    // Deposed while its dry run waits: it stands by, and the dry run is
    // accepted only then.
    drain._leader.send_replace(false);
    super::stand_by(&mut drain.worker);
    assert!(drain.worker.is_fresh());
    held.notify_one();
    let before = drain.calls().len();
    // Leading again: the old acceptance is not used. The pod is asked for
    // anew (a dry run first), and no record or real eviction comes before.
    drain._leader.send_replace(true);
    drain
        .until("the pod asked for again", |calls| {
            calls[before..]
                .iter()
                .any(|c| c.is_eviction(true) || c.is_eviction(false))
        })
        .await;
    let calls = drain.calls()[before..].to_vec();
    let asked_again = position(&calls, "a new dry run", |c| c.is_eviction(true));
    assert!(
        calls[..asked_again]
            .iter()
            .all(|c| !c.is_eviction(false) && c.recorded().is_none_or(|r| r.is_empty())),
        "{calls:#?}"
    );
}

#[tokio::test]
async fn a_pod_already_gone_is_not_recorded_as_evicted() {
    let mut drain = Drain::start(Evictions {
        dry_run: Some(StatusCode::NOT_FOUND),
        real: None,
        ..Evictions::default()
    });
    drain
        .until("the dry run answered", |calls| {
            calls.iter().any(|c| c.is_eviction(true))
        })
        .await;
    // One more pass takes the answer in.
    drain.pass().await;
    let calls = drain.calls();
    assert!(calls.iter().all(|c| !c.is_eviction(false)), "{calls:#?}");
    assert!(
        calls
            .iter()
            .all(|c| c.recorded().is_none_or(|r| r.is_empty())),
        "{calls:#?}"
    );
    let metrics = drain.ctx.metrics.encode();
    assert!(
        metrics.contains(r#"hugepool_evictions_total{pool="dpdk",result="gone"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_refused_eviction_is_told_once_named_on_the_node_and_retried_with_backoff() {
    let mut drain = Drain::start(Evictions {
        dry_run: Some(StatusCode::TOO_MANY_REQUESTS),
        real: None,
        ..Evictions::default()
    });
    drain
        .until("EvictionBlocked", |calls| {
            calls.iter().any(|c| c.event() == Some("EvictionBlocked"))
        })
        .await;
    // The next pass names the refusal on the node and looks again when its
    // backoff ends, not before.
    let pass = drain.pass().await;
    assert!(
        pass.next <= crate::drain::FIRST_BACKOFF + Duration::from_millis(100),
        "{pass:?}"
    );
    let calls = drain.calls();
    let message = calls.iter().rev().find_map(Call::draining_message).unwrap();
    assert!(
        message.contains("eviction of apps/dpdk refused: answered 429"),
        "{message}"
    );
    assert!(calls.iter().all(|c| !c.is_eviction(false)));
    assert!(
        calls
            .iter()
            .all(|c| c.recorded().is_none_or(|r| r.is_empty()))
    );
    // Within the backoff nothing is asked again.
    let asked = calls.iter().filter(|c| c.is_eviction(true)).count();
    drain.pass().await;
    assert_eq!(
        drain.calls().iter().filter(|c| c.is_eviction(true)).count(),
        asked
    );
    let status = drain.ctx.pools.state()[0].status.clone().unwrap();
    let progressing = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Progressing")
        .unwrap();
    assert_eq!(progressing.reason, "Draining");
    // Told once per streak.
    CLOCK.with(|c| c.set(100 + 2));
    drain
        .until("asked again after the backoff", |calls| {
            calls.iter().filter(|c| c.is_eviction(true)).count() > asked
        })
        .await;
    drain.pass().await;
    let told = drain
        .calls()
        .iter()
        .filter(|c| c.event() == Some("EvictionBlocked"))
        .count();
    assert_eq!(told, 1);
}

#[tokio::test]
async fn an_eviction_nobody_answers_holds_up_no_pass_and_is_named_on_its_node() {
    let mut drain = Drain::start(Evictions {
        dry_run: None,
        real: None,
        ..Evictions::default()
    });
    drain
        .until("the dry run sent", |calls| {
            calls.iter().any(|c| c.is_eviction(true))
        })
        .await;
    // Passes go on while it hangs: the pool's status is written, and the
    // pass looks again when the eviction turns slow.
    let pass = drain.pass().await;
    assert!(
        pass.next <= SLOW_EVICTION + Duration::from_millis(100),
        "{pass:?}"
    );
    assert!(drain.calls().iter().any(|c| c.pool_status().is_some()));
    CLOCK.with(|c| c.set(100 + SLOW_EVICTION.as_secs() as i64));
    drain.pass().await;
    let calls = drain.calls();
    let message = calls.iter().rev().find_map(Call::draining_message).unwrap();
    assert!(
        message.contains("eviction of apps/dpdk unanswered since"),
        "{message}"
    );
    // The pool says so too, where the engineer paged for it looks first.
    drain.pass().await;
    let status = drain.ctx.pools.state()[0].status.clone().unwrap();
    let progressing = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Progressing")
        .unwrap();
    assert!(
        progressing.reason == "Draining"
            && progressing
                .message
                .contains("eviction of apps/dpdk unanswered since"),
        "{progressing:?}"
    );
    // Asked once: an eviction in flight is not asked for again.
    assert_eq!(calls.iter().filter(|c| c.is_eviction(true)).count(), 1);
    // A minute of it hanging, each pass at the time it asked to look again:
    // no more than one pass a second (its slowness is no deadline ahead).
    let mut elapsed = Duration::ZERO;
    let mut passes = 0;
    while elapsed < Duration::from_secs(60) && passes <= 60 {
        let pass = drain.pass().await;
        passes += 1;
        elapsed += pass.next;
        CLOCK.with(|c| c.set(100 + (SLOW_EVICTION + elapsed).as_secs() as i64));
    }
    assert!(
        passes <= 60,
        "{passes} passes in {elapsed:?} of a slow eviction"
    );
}

#[tokio::test]
async fn a_pod_that_goes_from_a_draining_node_wakes_the_worker() {
    // The eviction hangs: nothing but the watch of w-1's pods can wake it.
    let mut drain = Drain::start(Evictions {
        dry_run: None,
        real: None,
        ..Evictions::default()
    });
    drain.pass().await;
    tokio::time::timeout(Duration::from_secs(5), drain.ctx.wake.notified())
        .await
        .expect("woken by the pod that went");
    let calls = drain.calls();
    let watch = calls
        .iter()
        .find(|c| c.path == "/api/v1/pods" && c.query.contains("watch=true"))
        .expect("w-1's pods watched");
    assert!(
        watch.query.contains("fieldSelector=spec.nodeName%3Dw-1"),
        "only w-1's pods: {}",
        watch.query
    );
}

// A drain step that fails (the node's pods cannot be listed) backs off
// that node's drain, not its spec writes, and is shown on the pool as a
// write error like theirs.
#[tokio::test]
async fn a_failed_drain_step_backs_off_the_drain_alone() {
    let mut drain = Drain::start(Evictions {
        pods_forbidden: true,
        ..Evictions::default()
    });
    let pass = drain.pass().await;
    let errors = drain.worker.drain_retries.errors();
    assert_eq!(errors.keys().collect::<Vec<_>>(), ["w-1"]);
    assert!(errors["w-1"].contains("forbidden"), "{}", errors["w-1"]);
    assert!(
        drain.worker.node_retries.is_empty(),
        "the spec writes of w-1 wait for nothing: {:?}",
        drain.worker.node_retries.errors()
    );
    assert!(pass.next <= RETRY_BASE, "{:?}", pass.next);
    // The next pass (before the retry is due) plans with the failure: the
    // pool names it. No eviction without the node's pods.
    drain.pass().await;
    let calls = drain.calls();
    assert!(!calls.iter().any(|c| c.is_eviction(true)), "{calls:#?}");
    let status = calls
        .iter()
        .rev()
        .find_map(Call::pool_status)
        .expect("the pool's status written");
    assert!(
        status.to_string().contains("forbidden"),
        "the pool's status names the failed drain step: {status}"
    );
}

#[test]
fn a_spec_is_written_only_on_the_generation_the_plan_read() {
    let node = node("w-1", &[]);
    let plan = NodePlan {
        spec: hugepool_crds::HugePageNodeSpec::default(),
        spec_changed: true,
        ..NodePlan::default()
    };
    let created = new_node_state(&node, &plan);
    assert_eq!(created.metadata.name.as_deref(), Some("w-1"));
    assert_eq!(
        created.metadata.owner_references.as_ref().unwrap()[0].uid,
        "uid-w-1"
    );
    let mut current = hpn("w-1", 41, vec![]);
    let patch = serde_json::to_value(node_spec_patch(&current, &node, &plan, true)).unwrap();
    assert_eq!(
        patch[0],
        json!({"op": "test", "path": "/metadata/generation", "value": 41})
    );
    assert_eq!(patch[1]["path"], "/spec");
    assert_eq!(patch[2]["value"][0]["uid"], "uid-w-1");
    // Without a generation (never so on a real server), the version.
    current.metadata.generation = None;
    current.metadata.resource_version = Some("7".into());
    let patch = serde_json::to_value(node_spec_patch(&current, &node, &plan, false)).unwrap();
    assert_eq!(patch[0]["path"], "/metadata/resourceVersion");
    assert_eq!(patch.as_array().unwrap().len(), 2);
}

#[test]
fn taint_patch_adds_and_removes_only_the_draining_taint() {
    let mut tainted = node("w-1", &[]);
    tainted.metadata.resource_version = Some("7".into());
    tainted.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        taints: Some(vec![k8s_openapi::api::core::v1::Taint {
            key: "other".into(),
            effect: "NoExecute".into(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    let on = taint_patch(&tainted, true);
    assert_eq!(on["metadata"]["resourceVersion"], "7");
    let keys: Vec<&str> = on["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["other", hugepool_crds::DRAINING_TAINT]);
    tainted.spec.as_mut().unwrap().taints =
        Some(serde_json::from_value(on["spec"]["taints"].clone()).unwrap());
    let off = taint_patch(&tainted, false);
    assert_eq!(
        off["spec"]["taints"],
        json!([{"key": "other", "effect": "NoExecute"}])
    );
}

#[tokio::test]
async fn a_failed_node_write_does_not_hold_up_the_others_and_is_retried() {
    let pool = fixtures::with_max_unavailable(
        with_finalizer(pool("dpdk", 0, "dpdk", "2Mi", 64)),
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(2),
    );
    let nodes = vec![node("w-1", &["dpdk"]), node("w-2", &["dpdk"])];
    let harness = harness(std::slice::from_ref(&pool), &nodes, &[], true);
    let mut worker = Worker::default();
    let pass = pass_result(
        harness,
        &mut worker,
        Some(Scenario::OneNodeWriteFails { pool: pool.clone() }),
    )
    .await
    .expect("one node's failure does not fail the pass");
    // Only w-1 waits for its retry, about a second (jittered).
    let errors = worker.node_retries.errors();
    assert_eq!(errors.keys().collect::<Vec<_>>(), ["w-1"]);
    assert!(errors["w-1"].contains("etcdserver"), "{}", errors["w-1"]);
    assert!(pass.next <= RETRY_BASE, "{:?}", pass.next);
    assert!(pass.next >= RETRY_BASE / 4, "{:?}", pass.next);
}

#[test]
fn retries_double_up_to_the_cap_and_jitter_takes_off_at_most_half() {
    assert_eq!(retry_delay(1, 0.0), RETRY_BASE);
    assert_eq!(retry_delay(2, 0.0), RETRY_BASE * 2);
    assert_eq!(retry_delay(4, 0.0), RETRY_BASE * 8);
    assert_eq!(retry_delay(30, 0.0), RETRY_MAX);
    assert_eq!(retry_delay(2, 1.0), RETRY_BASE);
    assert_eq!(retry_delay(30, 1.0), RETRY_MAX / 2);
    // Two nodes that failed together come back apart.
    assert_ne!(retry_delay(3, 0.1), retry_delay(3, 0.7));
}

#[test]
fn a_relist_forgets_the_nodes_it_no_longer_lists() {
    let mut trigger = NodeTrigger::default();
    for name in ["w-1", "w-2"] {
        assert!(trigger.wakes(&watcher::Event::Apply(node(name, &[]))));
    }
    // The same Node again (a heartbeat): nothing to plan.
    assert!(!trigger.wakes(&watcher::Event::Apply(node("w-1", &[]))));
    assert!(!trigger.wakes(&watcher::Event::Init));
    assert!(!trigger.wakes(&watcher::Event::InitApply(node("w-1", &[]))));
    // w-2 went while the watch was down: the re-list ends in a plan.
    assert!(trigger.wakes(&watcher::Event::InitDone));
    assert_eq!(trigger.len(), 1);
}

#[test]
fn a_write_waits_for_the_cache_until_its_version_a_relist_or_its_deletion_is_delivered() {
    let deliveries = Deliveries::default();
    let version = |v: &str| {
        let mut state = hpn("w-1", 1, vec![]);
        state.metadata.resource_version = Some(v.into());
        state
    };
    deliveries.await_write("HugePageNode", &version("b"));
    assert_eq!(deliveries.outstanding(), 1);
    // Another version is not ours (versions are compared for equality only).
    deliveries.record("HugePageNode", &version("a"));
    assert_eq!(deliveries.outstanding(), 1);
    deliveries.record("HugePageNode", &version("b"));
    assert_eq!(deliveries.outstanding(), 0);
    // Delivered before it was awaited, however many versions came after.
    for v in ["c", "d", "e", "f", "g"] {
        deliveries.record("HugePageNode", &version(v));
    }
    deliveries.await_write("HugePageNode", &version("c"));
    assert_eq!(deliveries.outstanding(), 0);
    // Awaited first: seen once delivered, whatever follows it.
    deliveries.await_write("HugePageNode", &version("h"));
    for v in ["h", "i", "j", "k", "l", "m"] {
        deliveries.record("HugePageNode", &version(v));
    }
    assert_eq!(deliveries.outstanding(), 0);
    // A re-list of the kind makes the cache at least as new.
    deliveries.await_write("HugePageNode", &version("x"));
    deliveries.relisted("Node");
    assert_eq!(deliveries.outstanding(), 1);
    deliveries.relisted("HugePageNode");
    assert_eq!(deliveries.outstanding(), 0);
    // So does the object's deletion.
    deliveries.await_write("HugePageNode", &version("y"));
    deliveries.forget("HugePageNode", &version("y"));
    assert_eq!(deliveries.outstanding(), 0);
}

#[tokio::test]
async fn a_write_still_in_flight_when_the_leases_window_closes_is_abandoned() {
    let pool = pool("dpdk", 0, "dpdk", "2Mi", 64);
    let nodes = vec![node("w-1", &["dpdk"])];
    let Harness {
        mut ctx,
        mut verifier,
        _leader,
    } = harness(std::slice::from_ref(&pool), &nodes, &[], true);
    // The API server takes the first write (the finalizer) and never answers.
    let (received_tx, received) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(async move {
        let (request, held) = verifier.next().await;
        assert_eq!(request.method(), Method::PATCH);
        let _ = received_tx.send(());
        tokio::time::sleep(Duration::from_secs(3600)).await;
        drop(held);
    });
    // Our last renewal holds for 2 s more, from right before the pass.
    let (_renewals, until) = watch::channel(std::time::SystemTime::now() + Duration::from_secs(2));
    Arc::get_mut(&mut ctx).expect("one owner").leader =
        crate::leader::Fence::renewed_until(_leader.subscribe(), until);
    let result = tokio::time::timeout(Duration::from_secs(20), pass(&ctx, &mut Worker::default()))
        .await
        .expect("the write was abandoned, not waited for");
    assert!(matches!(result, Err(Error::NotLeader)), "{result:?}");
    // It was sent, then abandoned when the window closed (not refused
    // before it was sent).
    tokio::time::timeout(Duration::from_secs(5), received)
        .await
        .expect("the write reached the API server")
        .expect("the server saw it");
    server.abort();
}

#[tokio::test]
async fn a_refused_pod_watch_is_counted_not_swallowed() {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(mock, "default");
    let metrics = Metrics::default();
    let mut watches = PodWatches::default();
    watches.keep(
        &client,
        &Arc::new(tokio::sync::Notify::new()),
        &metrics.watch_of("Pod"),
        std::collections::BTreeSet::from(["w-1".to_string()]),
    );
    // The operator's service account may not list pods (an RBAC slip).
    let (request, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .expect("the pods of w-1 listed")
        .expect("a request");
    assert!(
        request
            .uri()
            .query()
            .unwrap_or_default()
            .contains("spec.nodeName%3Dw-1")
    );
    let forbidden = json!({
        "apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "Forbidden",
        "message": "pods is forbidden: User \"system:serviceaccount:hugepool-system:hugepool-operator\" cannot list resource \"pods\"",
        "code": 403,
    });
    send.send_response(
        Response::builder()
            .status(StatusCode::FORBIDDEN)
            .body(Body::from(serde_json::to_vec(&forbidden).unwrap()))
            .unwrap(),
    );
    let counted = r#"hugepool_watch_errors_total{watch="Pod"} 1"#;
    for _ in 0..100 {
        if metrics.encode().contains(counted) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("not counted: {}", metrics.encode());
}

// An API server whose HugePageNode CRD predates `status.allocatedClaims`
// prunes it from every write: the operator says so once and stops writing
// it, rather than writing every node with claims at every pass.
#[tokio::test]
async fn allocated_claims_pruned_by_an_older_crd_are_said_once_and_not_written_again() {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(mock, "default");
    let (_leader, leading) = watch::channel(true);
    let node = node("w-1", &[]);
    let state = hpn("w-1", 1, vec![]);
    let mut ctx = Context::new(
        client,
        Writer::<HugePagePool>::default().as_reader(),
        store_of(std::slice::from_ref(&node)),
        store_of(std::slice::from_ref(&state)),
        Arc::new(Metrics::default()),
        crate::leader::Fence::following(leading),
        Arc::new(AtomicBool::new(true)),
        Config::default(),
    );
    let mut claims = Writer::new(hugepool_crds::dra::resource_claims());
    claims.apply_watcher_event(&watcher::Event::Apply(
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "apps", "name": "pages"},
            "status": {"allocation": {"devices": {"results": [{
                "request": "pages", "driver": hugepool_crds::dra::DRIVER, "pool": "w-1",
                "device": "hugepages-2mi-numa0", "consumedCapacity": {"memory": "8Mi"},
            }]}}},
        }))
        .unwrap(),
    ));
    ctx.claims = Some(claims.as_reader());
    let writes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&writes);
    let server = tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let body: Value = serde_json::from_slice(&body.collect_bytes().await.unwrap()).unwrap();
            seen.lock()
                .unwrap()
                .push((parts.uri.path().to_string(), body["status"].clone()));
            // Written, and the field pruned from what comes back.
            let reply = json!({
                "apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePageNode",
                "metadata": {"name": "w-1", "generation": 1, "resourceVersion": "2"},
                "spec": {"pageSizes": []}, "status": {},
            });
            send.send_response(
                Response::builder()
                    .status(StatusCode::OK)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap(),
            );
        }
    });
    let snapshot = Snapshot {
        nodes: ctx.nodes.state(),
        states: ctx.node_states.state(),
    };
    let mut worker = Worker::default();
    tell_allocated_claims(&ctx, &mut worker, &snapshot, Instant::now())
        .await
        .expect("told");
    assert_eq!(
        *writes.lock().unwrap(),
        [(
            "/apis/hugepool.dev/v1alpha1/hugepagenodes/w-1/status".to_string(),
            json!({"allocatedClaims": [{"size": "2Mi", "numa": 0, "pages": 4}]})
        )]
    );
    assert!(worker.claims_field_unknown);
    // The next pass writes nothing.
    tell_allocated_claims(&ctx, &mut worker, &snapshot, Instant::now())
        .await
        .expect("told");
    assert_eq!(writes.lock().unwrap().len(), 1);
    server.abort();
}

// A draining node's pods are listed once: its watch, started by the pass
// that found it evicting, holds them for the passes after (a wave of 1,000
// draining nodes was 1,000 lists a pass).
#[tokio::test]
async fn a_draining_nodes_pods_come_from_its_watch_after_the_first_list() {
    let mut drain = Drain::start(Evictions {
        dry_run: None,
        real: None,
        ..Evictions::default()
    });
    let lists = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| c.path == "/api/v1/pods" && !c.query.contains("watch=true"))
            .count()
    };
    drain.pass().await;
    // The pass's list, and perhaps already its watch's first.
    assert!(
        (1..=2).contains(&lists(&drain.calls())),
        "{:#?}",
        drain.calls()
    );
    // The watch's own first list fills its cache.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while drain.worker.pod_watches.pods("w-1").is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pod watch never listed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = lists(&drain.calls());
    for _ in 0..3 {
        drain.pass().await;
    }
    assert_eq!(lists(&drain.calls()), before, "{:#?}", drain.calls());
    let pods = drain.worker.pod_watches.pods("w-1").expect("watched");
    assert!(pods.iter().any(|p| p.name_any() == "dpdk"), "{pods:?}");
}
