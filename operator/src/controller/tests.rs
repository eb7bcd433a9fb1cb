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
    /// A blocked shrink: Draining condition, its event, the taint, the pod
    /// list, one eviction refused by a PDB (429) and its event, then status.
    BlockedShrink { pool: HugePagePool, node: Box<Node> },
    /// The API server fails one node's write: the other node and the
    /// pool's status are still written.
    OneNodeWriteFails { pool: HugePagePool },
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
                        .await
                        .expect_finalizer_removed(&pool)
                        .await;
                }
                Scenario::OneNodeWriteFails { pool } => {
                    self.expect_node_spec_failure("w-1")
                        .await
                        .expect_node_spec("w-2", Some(64))
                        .await
                        .expect_pool_status(&pool, |status| {
                            assert_eq!(status["nodes"]["updating"], 2);
                        })
                        .await
                        .expect_event("RolloutStarted")
                        .await;
                }
                Scenario::BlockedShrink { pool, node } => {
                    // The node's pods first: the condition names those
                    // eviction cannot move.
                    self.expect_pod_list("w-1")
                        .await
                        .expect_draining_condition("w-1", "True", "EvictingPods")
                        .await
                        .expect_event("DrainStarted")
                        .await
                        .expect_taint(&node, true)
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

    async fn expect_eviction_refused(mut self, namespace: &str, pod: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/namespaces/{namespace}/pods/{pod}/eviction")
        );
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

async fn reconcile_with(
    harness: Harness,
    pool: &HugePagePool,
    scenario: Option<Scenario>,
) -> Action {
    reconcile_result(harness, pool, scenario)
        .await
        .expect("reconcile succeeded")
}

/// Reconciles `pool` while the verifier plays `scenario`; every expected
/// call must be made, and no other (an unanswered call hangs, and times out).
async fn reconcile_result(
    harness: Harness,
    pool: &HugePagePool,
    scenario: Option<Scenario>,
) -> Result<Action> {
    let Harness {
        ctx,
        verifier,
        _leader,
    } = harness;
    let server = scenario.map(|s| verifier.run(s));
    let result = tokio::time::timeout(
        Duration::from_secs(5),
        reconcile(Arc::new(pool.clone()), ctx),
    )
    .await
    .expect("reconcile finished (an unexpected API call would hang it)");
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
    let action = reconcile_with(
        harness,
        &pool,
        Some(Scenario::NewPool { pool: pool.clone() }),
    )
    .await;
    assert_eq!(action, Action::requeue(Config::default().resync));
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
    let plan = plan_at(&pools, &nodes, &states);
    fixtures::apply_statuses(&plan, &mut pools);
    let harness = harness(&pools, &nodes, &states, true);
    let action = reconcile_with(harness, &pools[0], None).await;
    assert_eq!(action, Action::requeue(Config::default().resync));
}

fn plan_at(pools: &[HugePagePool], nodes: &[Node], states: &[HugePageNode]) -> Plan {
    let nodes: Vec<&Node> = nodes.iter().collect();
    let states: Vec<&HugePageNode> = states.iter().collect();
    planner::plan(&PlanInput {
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
    let action = reconcile_with(harness, &pool, None).await;
    assert_eq!(action, Action::await_change());
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
    let harness = harness(std::slice::from_ref(&pool), &nodes, &[state], true);
    let action = reconcile_with(
        harness,
        &pool,
        Some(Scenario::RetainDeletion { pool: pool.clone() }),
    )
    .await;
    assert_eq!(action, Action::await_change());
}

#[tokio::test]
async fn blocked_shrink_taints_the_node_and_evicts_only_hugepage_consumers() {
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
    state.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: "w-1".into(),
            uid: "uid-w-1".into(),
            ..Default::default()
        },
    ]);
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
    let harness = harness(
        std::slice::from_ref(&pool),
        std::slice::from_ref(&node),
        &[state],
        true,
    );
    let action = reconcile_with(
        harness,
        &pool,
        Some(Scenario::BlockedShrink {
            pool: pool.clone(),
            node: Box::new(node.clone()),
        }),
    )
    .await;
    assert_eq!(action, Action::requeue(Config::default().drain_poll));
}

#[test]
fn node_spec_apply_names_the_node_as_owner() {
    let node = node("w-1", &[]);
    let plan = NodePlan {
        spec: hugepool_crds::HugePageNodeSpec::default(),
        spec_changed: true,
        ..NodePlan::default()
    };
    let body = node_spec_apply(&node, &plan);
    assert_eq!(body["apiVersion"], "hugepool.dev/v1alpha1");
    assert_eq!(body["metadata"]["name"], "w-1");
    assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "uid-w-1");
    assert_eq!(body["spec"]["pageSizes"], json!([]));
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
    let result = reconcile_result(
        harness,
        &pool,
        Some(Scenario::OneNodeWriteFails { pool: pool.clone() }),
    )
    .await;
    let err = result.expect_err("the failed write is reported");
    assert_eq!(err.metric_label(), "node_spec");
    assert!(err.to_string().contains("w-1"), "{err}");
}
