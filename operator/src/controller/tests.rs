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

use super::*;
use crate::fixtures::{self, at, converge, hpn, node, pool, status_of};
use crate::metrics::Metrics;

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
    /// A blocked shrink: Draining condition, its event, the taint, the pod
    /// list, one eviction refused by a PDB (429) and its event, then status.
    BlockedShrink { pool: HugePagePool, node: Box<Node> },
    /// The API server fails one node's write: the other node and the
    /// pool's status are still written.
    OneNodeWriteFails { pool: HugePagePool },
    /// A blocked shrink whose eviction the API allows: the pool's status
    /// records it before the eviction is made.
    EvictionRecordedFirst { pool: HugePagePool, node: Box<Node> },
    /// The pod is gone when the eviction is asked for: nothing is recorded.
    PodAlreadyGone { pool: HugePagePool, node: Box<Node> },
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
                Scenario::EvictionRecordedFirst { pool, node } => {
                    self.expect_drain_started(&node)
                        .await
                        .expect_eviction("apps", "dpdk", true, StatusCode::CREATED)
                        .await
                        .expect_pool_status(&pool, |status| {
                            let evicted = status["evictedPods"].as_array().unwrap();
                            assert_eq!(evicted.len(), 1, "{evicted:?}");
                            assert_eq!(evicted[0]["pod"], "apps/dpdk");
                            assert_eq!(evicted[0]["node"], "w-1");
                            assert_eq!(evicted[0]["pages"], 2);
                        })
                        .await
                        .expect_eviction("apps", "dpdk", false, StatusCode::CREATED)
                        .await
                        .expect_event("Evicted")
                        .await;
                }
                Scenario::PodAlreadyGone { pool, node } => {
                    self.expect_drain_started(&node)
                        .await
                        .expect_eviction("apps", "dpdk", true, StatusCode::NOT_FOUND)
                        .await
                        .expect_pool_status(&pool, |status| {
                            assert!(status["evictedPods"].is_null(), "{status}");
                        })
                        .await;
                }
                Scenario::BlockedShrink { pool, node } => {
                    // The node's pods first: the condition names those
                    // eviction cannot move.
                    self.expect_drain_started(&node)
                        .await
                        .expect_eviction_refused("apps", "dpdk")
                        .await
                        .expect_event("EvictionBlocked")
                        .await
                        .expect_pool_status(&pool, |status| {
                            let progressing = status["conditions"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .find(|c| c["type"] == "Progressing")
                                .unwrap();
                            assert_eq!(progressing["reason"], "Draining");
                        })
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

    /// A drain starting on w-1: its pods listed, Draining=True with its
    /// Event, then the taint.
    async fn expect_drain_started(self, node: &Node) -> Self {
        self.expect_pod_list("w-1")
            .await
            .expect_draining_condition("w-1", "True", "EvictingPods")
            .await
            .expect_event("DrainStarted")
            .await
            .expect_taint(node, true)
            .await
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

    async fn expect_node_spec(mut self, node: &str, pages: Option<i64>) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!("/apis/hugepool.dev/v1alpha1/hugepagenodes/{node}")
        );
        let query = request.uri().query().unwrap_or_default().to_string();
        assert!(query.contains("fieldManager=hugepool-operator"), "{query}");
        assert!(query.contains("force=true"), "{query}");
        let body = Self::body(request).await;
        assert_eq!(body["kind"], "HugePageNode");
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
        reply["metadata"]["generation"] = json!(2);
        reply["metadata"]["resourceVersion"] = json!("20");
        send.send_response(ok_json(&reply));
        self
    }

    async fn expect_node_spec_failure(mut self, node: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(
            request.uri().path(),
            format!("/apis/hugepool.dev/v1alpha1/hugepagenodes/{node}")
        );
        let failure = json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure",
            "message": "etcdserver: request timed out", "reason": "InternalError", "code": 500,
        });
        send.send_response(
            Response::builder()
                .status(StatusCode::INTERNAL_SERVER_ERROR)
                .body(Body::from(serde_json::to_vec(&failure).unwrap()))
                .unwrap(),
        );
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
        assert_eq!(content_type, "application/merge-patch+json");
        let query = request.uri().query().unwrap_or_default().to_string();
        assert!(query.contains("fieldManager=hugepool-operator"), "{query}");
        let body = Self::body(request).await;
        assert_eq!(body["spec"], json!({"pageSizes": []}));
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

    async fn expect_draining_condition(mut self, node: &str, status: &str, reason: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!("/apis/hugepool.dev/v1alpha1/hugepagenodes/{node}/status")
        );
        let body = Self::body(request).await;
        // Only the operator's own condition: the agent owns the rest.
        let status_body = body["status"].as_object().unwrap();
        assert_eq!(status_body.keys().collect::<Vec<_>>(), ["conditions"]);
        let conditions = body["status"]["conditions"].as_array().unwrap();
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0]["type"], "Draining");
        assert_eq!(conditions[0]["status"], status);
        assert_eq!(conditions[0]["reason"], reason);
        let mut reply = body.clone();
        reply["metadata"] = json!({"name": node, "generation": 2, "resourceVersion": "30"});
        reply["spec"] = json!({"pageSizes": []});
        send.send_response(ok_json(&reply));
        self
    }

    async fn expect_taint(mut self, node: &Node, present: bool) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/nodes/{}", node.name_any())
        );
        let body = Self::body(request).await;
        let taints = body["spec"]["taints"].as_array().unwrap();
        let ours = taints
            .iter()
            .any(|t| t["key"] == hugepool_crds::DRAINING_TAINT && t["effect"] == "NoSchedule");
        assert_eq!(ours, present, "{taints:?}");
        assert!(
            taints.iter().any(|t| t["key"] == "other"),
            "other taints stay"
        );
        assert_eq!(body["metadata"]["resourceVersion"], "5");
        send.send_response(ok_json(node));
        self
    }

    async fn expect_pod_list(mut self, node: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::GET);
        assert_eq!(request.uri().path(), "/api/v1/pods");
        let query = request.uri().query().unwrap_or_default();
        assert!(
            query.contains(&format!("fieldSelector=spec.nodeName%3D{node}")),
            "{query}"
        );
        let pods = json!({
            "apiVersion": "v1",
            "kind": "PodList",
            "metadata": {},
            "items": [consumer("dpdk", "hugepages-2Mi"), consumer("web", "memory")],
        });
        send.send_response(ok_json(&pods));
        self
    }

    async fn expect_eviction(
        mut self,
        namespace: &str,
        pod: &str,
        dry_run: bool,
        answer: StatusCode,
    ) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/namespaces/{namespace}/pods/{pod}/eviction")
        );
        let query = request.uri().query().unwrap_or_default().to_string();
        assert_eq!(query.contains("dryRun=All"), dry_run, "{query}");
        let body = if answer.is_success() {
            json!({"apiVersion": "v1", "kind": "Status", "status": "Success", "code": answer.as_u16()})
        } else {
            json!({
                "apiVersion": "v1", "kind": "Status", "status": "Failure",
                "message": format!("pods \"{pod}\" not found"), "reason": "NotFound",
                "code": answer.as_u16(),
            })
        };
        send.send_response(
            Response::builder()
                .status(answer)
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
        self
    }

    async fn expect_eviction_refused(mut self, namespace: &str, pod: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/namespaces/{namespace}/pods/{pod}/eviction")
        );
        // Asked without effect first: a refusal is never recorded.
        let query = request.uri().query().unwrap_or_default().to_string();
        assert!(query.contains("dryRun=All"), "{query}");
        let refusal = json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure",
            "message": "Cannot evict pod as it would violate the pod's disruption budget.",
            "reason": "TooManyRequests", "code": 429,
        });
        send.send_response(
            Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .body(Body::from(serde_json::to_vec(&refusal).unwrap()))
                .unwrap(),
        );
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

fn blocked_shrink_harness() -> (HugePagePool, Node, Harness) {
    let (pool, node, state) = blocked_shrink();
    let harness = harness(
        std::slice::from_ref(&pool),
        std::slice::from_ref(&node),
        &[state],
        true,
    );
    (pool, node, harness)
}

#[tokio::test]
async fn blocked_shrink_taints_the_node_and_evicts_only_hugepage_consumers() {
    let (pool, node, harness) = blocked_shrink_harness();
    let pass = pass_with(
        harness,
        Some(Scenario::BlockedShrink {
            pool: pool.clone(),
            node: Box::new(node.clone()),
        }),
    )
    .await;
    assert_eq!(pass.next, Config::default().drain_poll);
}

#[tokio::test]
async fn an_eviction_is_recorded_in_its_pools_status_before_it_is_made() {
    let (pool, node, harness) = blocked_shrink_harness();
    pass_with(
        harness,
        Some(Scenario::EvictionRecordedFirst {
            pool: pool.clone(),
            node: Box::new(node.clone()),
        }),
    )
    .await;
}

#[tokio::test]
async fn a_pod_already_gone_is_not_recorded_as_evicted() {
    let (pool, node, harness) = blocked_shrink_harness();
    let metrics = Arc::clone(&harness.ctx.metrics);
    pass_with(
        harness,
        Some(Scenario::PodAlreadyGone {
            pool: pool.clone(),
            node: Box::new(node.clone()),
        }),
    )
    .await;
    let text = metrics.encode();
    assert!(
        text.contains(r#"hugepool_evictions_total{pool="dpdk",result="gone"} 1"#),
        "{text}"
    );
    assert!(!text.contains(r#"result="evicted""#), "{text}");
}

#[test]
fn node_spec_apply_names_the_node_as_owner() {
    let node = node("w-1", &[]);
    let plan = NodePlan {
        spec: hugepool_crds::HugePageNodeSpec::default(),
        spec_changed: true,
        ..NodePlan::default()
    };
    let body = node_spec_apply(&node, &plan, Some("41"));
    assert_eq!(body["apiVersion"], "hugepool.dev/v1alpha1");
    assert_eq!(body["metadata"]["name"], "w-1");
    assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "uid-w-1");
    assert_eq!(body["spec"]["pageSizes"], json!([]));
    // Planned from version 41: the write fails if the object moved on.
    assert_eq!(body["metadata"]["resourceVersion"], "41");
    assert!(node_spec_apply(&node, &plan, None)["metadata"]["resourceVersion"].is_null());
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
    let retry = worker.node_retries.get("w-1").expect("w-1 is retried");
    assert_eq!(retry.attempts, 1);
    assert!(retry.error.contains("etcdserver"), "{}", retry.error);
    assert_eq!(worker.node_retries.len(), 1);
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
fn a_write_waits_for_the_cache_until_its_version_or_a_relist_is_delivered() {
    let deliveries = Deliveries::default();
    let mut state = hpn("w-1", 1, vec![]);
    state.metadata.resource_version = Some("b".into());
    let written = Written {
        kind: "HugePageNode",
        key: "HugePageNode/w-1".into(),
        version: "b".into(),
        relists: deliveries.relists("HugePageNode"),
    };
    assert!(!deliveries.seen(&written));
    // Another version is not ours (versions are compared for equality only).
    let mut other = state.clone();
    other.metadata.resource_version = Some("a".into());
    deliveries.record("HugePageNode", &other);
    assert!(!deliveries.seen(&written));
    deliveries.record("HugePageNode", &state);
    assert!(deliveries.seen(&written));
    // A re-list of the kind also makes the cache at least as new.
    let unseen = Written {
        version: "c".into(),
        ..written.clone()
    };
    deliveries.relisted("Node");
    assert!(!deliveries.seen(&unseen));
    deliveries.relisted("HugePageNode");
    assert!(deliveries.seen(&unseen));
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
    // Our last renewal holds for 300 ms more.
    let window = Duration::from_millis(300);
    let (_renewals, until) = watch::channel(std::time::SystemTime::now() + window);
    Arc::get_mut(&mut ctx).expect("one owner").leader =
        crate::leader::Fence::renewed_until(_leader.subscribe(), until);
    // The API server takes the first write (the finalizer) and never answers.
    let server = tokio::spawn(async move {
        let (request, held) = verifier.next().await;
        assert_eq!(request.method(), Method::PATCH);
        tokio::time::sleep(Duration::from_secs(3600)).await;
        drop(held);
    });
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(20), pass(&ctx, &mut Worker::default()))
        .await
        .expect("the write was abandoned, not waited for");
    assert!(matches!(result, Err(Error::NotLeader)), "{result:?}");
    assert!(started.elapsed() >= window / 2, "{:?}", started.elapsed());
    server.abort();
}
