//! The hugepool.dev API on a real kube-apiserver: the CRDs install, valid
//! pools get their defaults, and the API server itself rejects bad pools
//! with a message that names the offending field.

use hugepool_crds::node::{HugePageNodeStatus, PageSizeStatus, PageSizeTarget};
use hugepool_crds::pool::{HugePagePoolStatus, PoolNodeCounts};
use hugepool_crds::settings::{DeletionPolicy, DrainPolicy, KubeletRestart, NumaPolicy};
use hugepool_crds::{HugePageNode, HugePageNodeSpec, HugePagePool, PageSize};
use hugepool_e2e::{setup, unique_name};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, Resource};
use serde_json::{Value, json};

fn pools_dynamic(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(hugepool_crds::GROUP, hugepool_crds::VERSION, "HugePagePool");
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, &HugePagePool::plural(&())),
    )
}

/// Applies a pool the way `kubectl apply --server-side` does: strict field validation.
async fn apply_pool(client: &Client, name: &str, spec: Value) -> Result<HugePagePool, kube::Error> {
    let body = json!({
        "apiVersion": "hugepool.dev/v1alpha1",
        "kind": "HugePagePool",
        "metadata": {"name": name},
        "spec": spec,
    });
    let params = PatchParams::apply("hugepool-e2e").validation_strict();
    let applied = pools_dynamic(client)
        .patch(name, &params, &Patch::Apply(&body))
        .await?;
    Ok(
        serde_json::from_value(serde_json::to_value(applied).expect("object to json"))
            .expect("pool from json"),
    )
}

async fn delete_pool(client: &Client, name: &str) {
    let _ = Api::<HugePagePool>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await;
}

fn api_message(err: kube::Error) -> String {
    match err {
        kube::Error::Api(status) => status.message,
        other => panic!("expected the API server to reject the request, got {other}"),
    }
}

#[tokio::test]
async fn both_crds_are_established_and_served() {
    let Some(env) = setup().await else { return };
    // setup() waited for Established; listing proves the resources are served.
    let pools = Api::<HugePagePool>::all(env.client.clone())
        .list(&Default::default())
        .await
        .unwrap();
    let nodes = Api::<HugePageNode>::all(env.client.clone())
        .list(&Default::default())
        .await
        .unwrap();
    assert!(pools.metadata.resource_version.is_some());
    assert!(nodes.metadata.resource_version.is_some());
}

#[tokio::test]
async fn minimal_pool_gets_every_default_from_the_server() {
    let Some(env) = setup().await else { return };
    let name = unique_name("minimal");
    let pool = apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 16}))
        .await
        .unwrap();
    let spec = &pool.spec;
    assert_eq!(spec.page_size, PageSize::SIZE_2MI);
    assert_eq!(spec.pages, Some(16));
    assert_eq!(spec.memory, None);
    assert_eq!(spec.resize.max_step_duration, "50ms");
    assert_eq!(spec.resize.step_pause, "5ms");
    assert_eq!(spec.resize.stall_threshold, "2s");
    assert_eq!(spec.allocation.retries, 3);
    assert!(spec.allocation.compact);
    assert_eq!(spec.allocation.min_mem_available, "1Gi");
    assert_eq!(
        spec.rollout.max_unavailable,
        IntOrString::String("25%".into())
    );
    assert!(!spec.rollout.paused);
    assert_eq!(spec.drain.policy, DrainPolicy::IfNeeded);
    assert_eq!(spec.drain.timeout, "10m");
    assert_eq!(spec.kubelet.restart, KubeletRestart::Never);
    assert_eq!(spec.deletion_policy, DeletionPolicy::Retain);
    assert_eq!(spec.node_selector, Default::default());
    assert!(spec.numa.is_none());
    // No default is stored: pools written before the field read back as
    // they were (absent is Kubelet).
    assert_eq!(spec.consumption, None);
    delete_pool(&env.client, &name).await;
}

#[tokio::test]
async fn full_pool_is_stored_as_written() {
    let Some(env) = setup().await else { return };
    let name = unique_name("full");
    let spec = json!({
        "nodeSelector": {"matchLabels": {"pool.example/dpdk": "true"}},
        "pageSize": "2Mi",
        "pages": 4096,
        "numa": {"policy": "Explicit", "nodes": [{"id": 0, "pages": 3072}, {"id": 1, "pages": 1024}]},
        "resize": {"maxStepDuration": "20ms", "stepPause": "1ms", "stallThreshold": "1m30s"},
        "allocation": {"retries": 5, "compact": false, "minMemAvailable": "2Gi"},
        "rollout": {"maxUnavailable": 2, "paused": true},
        "drain": {"policy": "Never", "timeout": "90s"},
        "kubelet": {"restart": "AfterResize"},
        "deletionPolicy": "Release",
    });
    let pool = apply_pool(&env.client, &name, spec).await.unwrap();
    let numa = pool.spec.numa.as_ref().unwrap();
    assert_eq!(numa.policy, NumaPolicy::Explicit);
    assert_eq!(
        numa.nodes
            .as_ref()
            .unwrap()
            .iter()
            .map(|n| (n.id, n.pages))
            .collect::<Vec<_>>(),
        vec![(0, 3072), (1, 1024)]
    );
    assert_eq!(pool.spec.resize.stall_threshold, "1m30s");
    assert_eq!(pool.spec.allocation.retries, 5);
    assert!(!pool.spec.allocation.compact);
    assert_eq!(pool.spec.rollout.max_unavailable, IntOrString::Int(2));
    assert!(pool.spec.rollout.paused);
    assert_eq!(pool.spec.drain.policy, DrainPolicy::Never);
    assert_eq!(pool.spec.kubelet.restart, KubeletRestart::AfterResize);
    assert_eq!(pool.spec.deletion_policy, DeletionPolicy::Release);
    assert_eq!(
        pool.spec.node_selector.match_labels.as_ref().unwrap()["pool.example/dpdk"],
        "true"
    );
    delete_pool(&env.client, &name).await;
}

#[tokio::test]
async fn memory_pools_and_percent_rollouts_are_accepted() {
    let Some(env) = setup().await else { return };
    let cases = [
        json!({"pageSize": "2Mi", "memory": "8Gi", "rollout": {"maxUnavailable": "50%"}}),
        json!({"pageSize": "1Gi", "memory": "4Gi", "rollout": {"maxUnavailable": "100%"}}),
        json!({"pageSize": "2Mi", "pages": 0, "rollout": {"maxUnavailable": "1%"}}),
        json!({"pageSize": "2Mi", "pages": 8, "numa": {"policy": "Kernel"}}),
    ];
    for spec in cases {
        let name = unique_name("valid");
        let pool = apply_pool(&env.client, &name, spec.clone())
            .await
            .unwrap_or_else(|e| panic!("{spec} rejected: {e}"));
        assert_eq!(
            serde_json::to_value(&pool.spec.rollout.max_unavailable).unwrap(),
            spec["rollout"]
                .get("maxUnavailable")
                .cloned()
                .unwrap_or(json!("25%"))
        );
        delete_pool(&env.client, &name).await;
    }
}

/// Each case: what is wrong, the spec, and the field the message must name.
fn invalid_pools() -> Vec<(&'static str, Value, &'static str)> {
    let base = |extra: Value| {
        let mut spec = json!({"pageSize": "2Mi", "pages": 16});
        for (k, v) in extra.as_object().unwrap() {
            if v.is_null() {
                spec.as_object_mut().unwrap().remove(k);
            } else {
                spec[k] = v.clone();
            }
        }
        spec
    };
    let explicit = |nodes: Value| base(json!({"numa": {"policy": "Explicit", "nodes": nodes}}));
    vec![
        (
            "neither pages nor memory",
            base(json!({"pages": null})),
            "exactly one of spec.pages and spec.memory",
        ),
        (
            "both pages and memory",
            base(json!({"memory": "32Mi"})),
            "exactly one of spec.pages and spec.memory",
        ),
        ("negative pages", base(json!({"pages": -1})), "spec.pages"),
        (
            "page size not a power of two",
            base(json!({"pageSize": "3Mi"})),
            "spec.pageSize",
        ),
        (
            "page size in decimal units",
            base(json!({"pageSize": "2MB"})),
            "spec.pageSize",
        ),
        (
            "page size not canonical",
            base(json!({"pageSize": "1000Ki"})),
            "spec.pageSize",
        ),
        (
            "negative memory",
            base(json!({"pages": null, "memory": "-1Gi"})),
            "spec.memory",
        ),
        (
            "memory not a quantity",
            base(json!({"pages": null, "memory": "lots"})),
            "spec.memory",
        ),
        (
            "memory not a multiple of the page size",
            base(json!({"pages": null, "memory": "3Mi"})),
            "spec.memory",
        ),
        (
            "unknown NUMA policy",
            base(json!({"numa": {"policy": "Random"}})),
            "spec.numa.policy",
        ),
        (
            "Explicit without nodes",
            base(json!({"numa": {"policy": "Explicit"}})),
            "spec.numa.nodes",
        ),
        (
            "duplicate NUMA ids",
            explicit(json!([{"id": 0, "pages": 8}, {"id": 0, "pages": 8}])),
            "spec.numa.nodes",
        ),
        (
            "negative NUMA id",
            explicit(json!([{"id": -1, "pages": 16}])),
            "spec.numa.nodes[0].id",
        ),
        (
            "negative NUMA pages",
            explicit(json!([{"id": 0, "pages": -16}])),
            "spec.numa.nodes[0].pages",
        ),
        (
            "NUMA pages not adding up",
            explicit(json!([{"id": 0, "pages": 8}, {"id": 1, "pages": 4}])),
            "spec.numa.nodes",
        ),
        (
            "nodes with Spread",
            base(json!({"numa": {"policy": "Spread", "nodes": [{"id": 0, "pages": 16}]}})),
            "spec.numa.nodes",
        ),
        (
            "unparsable step duration",
            base(json!({"resize": {"maxStepDuration": "fast"}})),
            "spec.resize.maxStepDuration",
        ),
        (
            "zero step duration",
            base(json!({"resize": {"maxStepDuration": "0s"}})),
            "spec.resize.maxStepDuration",
        ),
        (
            "negative step pause",
            base(json!({"resize": {"stepPause": "-5ms"}})),
            "spec.resize.stepPause",
        ),
        (
            "stall threshold below the step budget",
            base(json!({"resize": {"stallThreshold": "10ms"}})),
            "spec.resize.stallThreshold",
        ),
        (
            "drain timeout in words",
            base(json!({"drain": {"timeout": "10 minutes"}})),
            "spec.drain.timeout",
        ),
        (
            "maxUnavailable zero",
            base(json!({"rollout": {"maxUnavailable": 0}})),
            "spec.rollout.maxUnavailable",
        ),
        (
            "maxUnavailable 0%",
            base(json!({"rollout": {"maxUnavailable": "0%"}})),
            "spec.rollout.maxUnavailable",
        ),
        (
            "maxUnavailable over 100%",
            base(json!({"rollout": {"maxUnavailable": "101%"}})),
            "spec.rollout.maxUnavailable",
        ),
        (
            "maxUnavailable a word",
            base(json!({"rollout": {"maxUnavailable": "some"}})),
            "spec.rollout.maxUnavailable",
        ),
        (
            "unknown drain policy",
            base(json!({"drain": {"policy": "Always"}})),
            "spec.drain.policy",
        ),
        (
            "unknown kubelet restart",
            base(json!({"kubelet": {"restart": "Always"}})),
            "spec.kubelet.restart",
        ),
        (
            "unknown deletion policy",
            base(json!({"deletionPolicy": "Delete"})),
            "spec.deletionPolicy",
        ),
        (
            "negative retries",
            base(json!({"allocation": {"retries": -1}})),
            "spec.allocation.retries",
        ),
        (
            "guard in decimal bytes word",
            base(json!({"allocation": {"minMemAvailable": "1GB"}})),
            "spec.allocation.minMemAvailable",
        ),
        (
            "unknown top-level field",
            base(json!({"pagez": 3})),
            "spec.pagez",
        ),
        // Upper bounds on every number and duration.
        (
            "pages beyond 16777216",
            base(json!({"pages": 16_777_217})),
            "spec.pages",
        ),
        (
            "a NUMA node's pages beyond 16777216",
            base(
                json!({"pages": null, "memory": "64Gi", "numa": {"policy": "Explicit", "nodes": [{"id": 0, "pages": 16_777_217}]}}),
            ),
            "spec.numa.nodes[0].pages",
        ),
        (
            "maxUnavailable beyond 100000",
            base(json!({"rollout": {"maxUnavailable": 100_001}})),
            "maxUnavailable must be an integer 1-100000",
        ),
        (
            "maxStepDuration beyond 10s",
            base(json!({"resize": {"maxStepDuration": "11s", "stallThreshold": "1m"}})),
            "maxStepDuration must be at most 10s",
        ),
        (
            "stepPause beyond 1m",
            base(json!({"resize": {"stepPause": "2m"}})),
            "stepPause must be at most 1m",
        ),
        (
            "stallThreshold beyond 10m",
            base(json!({"resize": {"stallThreshold": "11m"}})),
            "stallThreshold must be at most 10m",
        ),
        (
            "drain timeout of 0",
            base(json!({"drain": {"timeout": "0s"}})),
            "drain.timeout must be greater than 0",
        ),
        (
            "drain timeout beyond 24h",
            base(json!({"drain": {"timeout": "25h"}})),
            "drain.timeout must be at most 24h",
        ),
        (
            "minMemAvailable below the kubelet's eviction threshold",
            base(json!({"allocation": {"minMemAvailable": "64Mi"}})),
            "minMemAvailable must be at least 100Mi",
        ),
        (
            "unknown nested field",
            base(json!({"resize": {"budget": "1s"}})),
            "spec.resize.budget",
        ),
        (
            "a kubelet restart for a pool consumed through DRA",
            base(
                json!({"consumption": "DynamicResourceAllocation", "kubelet": {"restart": "AfterResize"}}),
            ),
            "kubelet.restart AfterResize cannot be set with consumption DynamicResourceAllocation",
        ),
        (
            "an unknown consumption",
            base(json!({"consumption": "Claims"})),
            "spec.consumption",
        ),
    ]
}

#[tokio::test]
async fn invalid_pools_are_rejected_naming_the_field() {
    let Some(env) = setup().await else { return };
    let cases = invalid_pools();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for (what, spec, field) in cases {
        let name = unique_name("invalid");
        match apply_pool(&env.client, &name, spec.clone()).await {
            Ok(_) => {
                failures.push(format!("{what}: accepted {spec}"));
                delete_pool(&env.client, &name).await;
            }
            Err(err) => {
                let message = api_message(err);
                if !message.contains(field) {
                    failures.push(format!(
                        "{what}: message does not name {field:?}: {message}"
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A selector requirement Kubernetes would refuse only when the selector is
/// used (an operator that does not exist, values where they make no sense)
/// is refused at admission, naming the requirement's field; the four
/// operators with the values each takes are accepted.
#[tokio::test]
async fn selector_operators_and_values_are_checked_at_admission() {
    let Some(env) = setup().await else { return };
    let pool = |expressions: Value| json!({"pageSize": "2Mi", "pages": 16, "nodeSelector": {"matchExpressions": expressions}});
    let in_zone = json!({"key": "zone", "operator": "In", "values": ["a"]});
    let refused = [
        (
            "an operator that does not exist",
            pool(json!([{"key": "zone", "operator": "Near", "values": ["a"]}])),
            "spec.nodeSelector.matchExpressions[0].operator: Unsupported value: \"Near\"",
        ),
        (
            "In without values",
            pool(json!([{"key": "zone", "operator": "In"}])),
            "spec.nodeSelector.matchExpressions[0].values",
        ),
        (
            "NotIn with no value",
            pool(json!([in_zone, {"key": "zone", "operator": "NotIn", "values": []}])),
            "spec.nodeSelector.matchExpressions[1].values",
        ),
        (
            "Exists with values",
            pool(json!([{"key": "gpu", "operator": "Exists", "values": ["x"]}])),
            "spec.nodeSelector.matchExpressions[0].values",
        ),
        (
            "DoesNotExist with values",
            pool(json!([{"key": "gpu", "operator": "DoesNotExist", "values": ["x"]}])),
            "spec.nodeSelector.matchExpressions[0].values",
        ),
        (
            "an operator of another selector kind (node affinity's Gt)",
            pool(json!([{"key": "cores", "operator": "Gt", "values": ["8"]}])),
            "spec.nodeSelector.matchExpressions[0].operator",
        ),
    ];
    let mut failures = Vec::new();
    for (what, spec, field) in refused {
        let name = unique_name("selector");
        match apply_pool(&env.client, &name, spec.clone()).await {
            Ok(_) => {
                failures.push(format!("{what}: accepted {spec}"));
                delete_pool(&env.client, &name).await;
            }
            Err(err) => {
                let message = api_message(err);
                if !message.contains(field) {
                    failures.push(format!(
                        "{what}: message does not name {field:?}: {message}"
                    ));
                }
                if field.ends_with(".values")
                    && !message.contains("values must be non-empty for operator In and NotIn")
                {
                    failures.push(format!(
                        "{what}: message does not say what values take: {message}"
                    ));
                }
            }
        }
    }
    let accepted = [
        pool(json!([in_zone])),
        pool(json!([{"key": "zone", "operator": "NotIn", "values": ["b", "c"]}])),
        pool(json!([{"key": "gpu", "operator": "Exists"}])),
        pool(json!([{"key": "gpu", "operator": "DoesNotExist"}])),
        // What a client that writes empty lists sends.
        pool(json!([{"key": "gpu", "operator": "Exists", "values": []}])),
        pool(json!([in_zone, {"key": "gpu", "operator": "DoesNotExist"}])),
    ];
    for spec in accepted {
        let name = unique_name("selector");
        match apply_pool(&env.client, &name, spec.clone()).await {
            Ok(stored) => {
                let expressions = stored
                    .spec
                    .node_selector
                    .match_expressions
                    .unwrap_or_default();
                if serde_json::to_value(&expressions).unwrap()
                    != spec["nodeSelector"]["matchExpressions"]
                {
                    failures.push(format!("{spec}: stored as {expressions:?}"));
                }
                delete_pool(&env.client, &name).await;
            }
            Err(err) => failures.push(format!("refused {spec}: {err}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test]
async fn page_size_cannot_change_after_creation() {
    let Some(env) = setup().await else { return };
    let name = unique_name("immutable");
    apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 4}))
        .await
        .unwrap();
    let message = api_message(
        apply_pool(&env.client, &name, json!({"pageSize": "1Gi", "pages": 4}))
            .await
            .unwrap_err(),
    );
    assert!(
        message.contains("spec.pageSize") && message.contains("immutable"),
        "{message}"
    );
    // Other fields still change.
    let pool = apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 8}))
        .await
        .unwrap();
    assert_eq!(pool.spec.pages, Some(8));
    delete_pool(&env.client, &name).await;
}

/// How pods take a pool's pages is fixed when it is created, in both
/// directions (set, changed, or removed).
#[tokio::test]
async fn consumption_cannot_change_after_creation() {
    let Some(env) = setup().await else { return };
    let name = unique_name("consumption");
    let dra = json!({"pageSize": "2Mi", "pages": 4, "consumption": "DynamicResourceAllocation"});
    let pool = apply_pool(&env.client, &name, dra.clone()).await.unwrap();
    assert_eq!(
        pool.spec.consumption,
        Some(hugepool_crds::settings::Consumption::DynamicResourceAllocation)
    );
    for changed in [
        json!({"pageSize": "2Mi", "pages": 4, "consumption": "Kubelet"}),
        json!({"pageSize": "2Mi", "pages": 4}),
    ] {
        let message = api_message(apply_pool(&env.client, &name, changed).await.unwrap_err());
        assert!(
            message.contains("spec.consumption") && message.contains("immutable"),
            "{message}"
        );
    }
    let grown = apply_pool(
        &env.client,
        &name,
        json!({"pageSize": "2Mi", "pages": 8, "consumption": "DynamicResourceAllocation"}),
    )
    .await
    .unwrap();
    assert_eq!(grown.spec.pages, Some(8));
    delete_pool(&env.client, &name).await;
    let name = unique_name("consumption");
    apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 4}))
        .await
        .unwrap();
    let message = api_message(apply_pool(&env.client, &name, dra).await.unwrap_err());
    assert!(message.contains("immutable"), "{message}");
    delete_pool(&env.client, &name).await;
}

fn condition(type_: &str, status: &str, reason: &str) -> Condition {
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: String::new(),
        observed_generation: Some(1),
        last_transition_time: Time(jiff::Timestamp::now()),
    }
}

/// The status is bounded (docs/design.md, "Status size"): at the limits it
/// is stored, one past any of them the server refuses it, naming the field.
#[tokio::test]
async fn statuses_past_their_size_limits_are_refused() {
    use hugepool_crds::conditions::{MAX_CONDITIONS, MAX_MESSAGE};
    let Some(env) = setup().await else { return };
    let name = unique_name("bounded");
    let pools = Api::<HugePagePool>::all(env.client.clone());
    apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 4}))
        .await
        .unwrap();
    let nodes = Api::<HugePageNode>::all(env.client.clone());
    nodes
        .create(
            &PostParams::default(),
            &HugePageNode::new(&name, HugePageNodeSpec::default()),
        )
        .await
        .unwrap();
    let conditions = |count: usize, message_len: usize| -> Vec<Condition> {
        (0..count)
            .map(|i| Condition {
                message: "m".repeat(message_len),
                ..condition(&format!("Type{i}"), "True", "AsExpected")
            })
            .collect()
    };
    let failed = |count: usize, message_len: usize| -> Value {
        (0..count)
            .map(|i| json!({"name": format!("n{i}"), "reason": "AllocationFailed", "message": "m".repeat(message_len)}))
            .collect()
    };
    let write_pool = |status: Value| {
        let pools = pools.clone();
        let name = name.clone();
        async move {
            let patch = json!({"apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePagePool", "status": status});
            pools
                .patch_status(
                    &name,
                    &PatchParams::apply("hugepool-operator").force(),
                    &Patch::Apply(&patch),
                )
                .await
                .map(|_| ())
                .map_err(api_message)
        }
    };
    let sizes = |count: usize| -> Value {
        (0..count)
            .map(|i| json!({"size": format!("{}Mi", 2 << i), "total": 0, "free": 0, "reserved": 0, "surplus": 0, "inUse": 0}))
            .collect()
    };
    let write_node = |status: Value| {
        let nodes = nodes.clone();
        let name = name.clone();
        async move {
            let patch = json!({"apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePageNode", "status": status});
            nodes
                .patch_status(
                    &name,
                    &PatchParams::apply("hugepool-agent").force(),
                    &Patch::Apply(&patch),
                )
                .await
                .map(|_| ())
                .map_err(api_message)
        }
    };
    // At the limits: stored.
    write_pool(json!({"conditions": conditions(MAX_CONDITIONS, MAX_MESSAGE), "failedNodes": failed(10, 1024)}))
        .await
        .expect("a pool status at its limits");
    write_node(
        json!({"conditions": conditions(MAX_CONDITIONS, MAX_MESSAGE), "pageSizes": sizes(8)}),
    )
    .await
    .expect("a node status at its limits");
    // One past: refused, naming the field.
    let refusals = [
        (
            write_pool(json!({"conditions": conditions(MAX_CONDITIONS + 1, 0)})).await,
            "status.conditions: Too many: 17",
        ),
        (
            write_pool(json!({"conditions": conditions(1, MAX_MESSAGE + 1)})).await,
            "a condition message is at most 1024 characters",
        ),
        (
            write_pool(json!({"failedNodes": failed(11, 0)})).await,
            "status.failedNodes: Too many: 11",
        ),
        (
            write_pool(json!({"failedNodes": failed(1, 1025)})).await,
            "status.failedNodes[0].message: Too long",
        ),
        (
            write_node(json!({"conditions": conditions(MAX_CONDITIONS + 1, 0)})).await,
            "status.conditions: Too many: 17",
        ),
        (
            write_node(json!({"conditions": conditions(1, MAX_MESSAGE + 1)})).await,
            "a condition message is at most 1024 characters",
        ),
        (
            write_node(json!({"pageSizes": sizes(9)})).await,
            "status.pageSizes: Too many: 9",
        ),
    ];
    for (i, (result, expected)) in refusals.into_iter().enumerate() {
        let message = result.expect_err(&format!("refusal {i} ({expected}) was stored"));
        assert!(message.contains(expected), "refusal {i}: {message}");
    }
    let _ = nodes.delete(&name, &Default::default()).await;
    delete_pool(&env.client, &name).await;
}

/// A HugePageNode's targets are bounded as a pool's pages are: the operator
/// never writes more, and the server refuses it from anyone else.
#[tokio::test]
async fn node_targets_past_the_pool_maximum_are_refused() {
    let Some(env) = setup().await else { return };
    let name = unique_name("node-bound");
    let nodes = Api::<HugePageNode>::all(env.client.clone());
    let write = |pages: i64| {
        let nodes = nodes.clone();
        let name = name.clone();
        async move {
            let patch = json!({
                "apiVersion": "hugepool.dev/v1alpha1",
                "kind": "HugePageNode",
                "metadata": {"name": name},
                "spec": {"pageSizes": [{"size": "2Mi", "pages": pages, "pool": "p", "poolGeneration": 1}]},
            });
            nodes
                .patch(
                    &name,
                    &PatchParams::apply("hugepool-operator").force(),
                    &Patch::Apply(&patch),
                )
                .await
                .map(|_| ())
                .map_err(api_message)
        }
    };
    write(16_777_216).await.expect("the maximum is stored");
    let refused = write(16_777_217)
        .await
        .expect_err("one past the maximum was stored");
    assert!(
        refused.contains("spec.pageSizes[0].pages") && refused.contains("16777216"),
        "{refused}"
    );
    let refused = write(-1).await.expect_err("a negative target was stored");
    assert!(refused.contains("spec.pageSizes[0].pages"), "{refused}");
    let _ = nodes.delete(&name, &Default::default()).await;
}

#[tokio::test]
async fn status_is_written_only_through_the_status_subresource() {
    let Some(env) = setup().await else { return };
    let name = unique_name("status");
    let pools = Api::<HugePagePool>::all(env.client.clone());
    apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 4}))
        .await
        .unwrap();

    let status = HugePagePoolStatus {
        observed_generation: Some(1),
        nodes: PoolNodeCounts {
            selected: 4,
            converged: 3,
            updating: 1,
            ready: "3/4".into(),
            ..Default::default()
        },
        conditions: vec![condition("Available", "False", "NodesNotConverged")],
        ..Default::default()
    };
    let patch =
        json!({"apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePagePool", "status": status});
    let params = PatchParams::apply("hugepool-operator").force();
    let after_status = pools
        .patch_status(&name, &params, &Patch::Apply(&patch))
        .await
        .unwrap();
    assert_eq!(after_status.status.as_ref().unwrap().nodes.converged, 3);
    assert_eq!(
        after_status.spec.pages,
        Some(4),
        "a status write must not touch spec"
    );
    assert_eq!(
        after_status.metadata.generation,
        Some(1),
        "a status write must not bump generation"
    );

    // A status sent to the main endpoint is ignored, and spec changes bump generation.
    let mut pool = pools.get(&name).await.unwrap();
    pool.spec.pages = Some(6);
    pool.status.as_mut().unwrap().nodes.converged = 0;
    let replaced = pools
        .replace(&name, &PostParams::default(), &pool)
        .await
        .unwrap();
    assert_eq!(replaced.spec.pages, Some(6));
    assert_eq!(replaced.status.unwrap().nodes.converged, 3);
    assert_eq!(replaced.metadata.generation, Some(2));
    delete_pool(&env.client, &name).await;
}

fn table_row<'a>(output: &'a str, name: &str) -> (Vec<&'a str>, Vec<&'a str>) {
    let mut lines = output.lines();
    let header = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let row = lines
        .find(|l| l.starts_with(name))
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    (header, row)
}

#[tokio::test]
async fn kubectl_get_prints_the_printer_columns() {
    let Some(env) = setup().await else { return };
    let name = unique_name("columns");
    apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 64}))
        .await
        .unwrap();
    let pools = Api::<HugePagePool>::all(env.client.clone());
    let status = HugePagePoolStatus {
        pages_per_node: Some(64),
        nodes: PoolNodeCounts {
            selected: 4,
            converged: 3,
            ready: "3/4".into(),
            ..Default::default()
        },
        conditions: vec![
            condition("Available", "False", "NodesNotConverged"),
            condition("Degraded", "True", "NodesStalled"),
        ],
        ..Default::default()
    };
    let patch =
        json!({"apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePagePool", "status": status});
    pools
        .patch_status(
            &name,
            &PatchParams::apply("hugepool-operator").force(),
            &Patch::Apply(&patch),
        )
        .await
        .unwrap();

    let output = env.control_plane.kubectl(&["get", "hpp", &name]).unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (header, row) = table_row(&stdout, &name);
    assert_eq!(
        header,
        [
            "NAME",
            "SIZE",
            "PAGES",
            "CONVERGED",
            "AVAILABLE",
            "DEGRADED",
            "REASON",
            "AGE"
        ],
        "{stdout}"
    );
    // REASON: Available's, picked by a JSONPath filter.
    assert_eq!(
        &row[..7],
        [
            name.as_str(),
            "2Mi",
            "64",
            "3/4",
            "False",
            "True",
            "NodesNotConverged"
        ],
        "{stdout}"
    );

    let nodes = Api::<HugePageNode>::all(env.client.clone());
    let node_name = unique_name("columns-node");
    let mut hpn = HugePageNode::new(
        &node_name,
        HugePageNodeSpec {
            page_sizes: vec![PageSizeTarget {
                size: PageSize::SIZE_2MI,
                pages: 64,
                numa: None,
                pool: name.clone(),
                pool_generation: 1,
                resize: Default::default(),
                allocation: Default::default(),
                kubelet_restart: KubeletRestart::Never,
                consumption: None,
            }],
        },
    );
    hpn.metadata.managed_fields = None;
    nodes.create(&PostParams::default(), &hpn).await.unwrap();
    let node_status = HugePageNodeStatus {
        summary: Some("2Mi:64/64 1Gi:0/4".into()),
        page_sizes: vec![PageSizeStatus {
            target: Some(64),
            total: 64,
            free: 60,
            in_use: 4,
            ..PageSizeStatus::empty(PageSize::SIZE_2MI)
        }],
        conditions: vec![
            condition("Converged", "True", "AtTarget"),
            condition("Stalled", "False", "WritesWithinBudget"),
        ],
        ..Default::default()
    };
    let patch = json!({"apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePageNode", "status": node_status});
    nodes
        .patch_status(
            &node_name,
            &PatchParams::apply("hugepool-agent").force(),
            &Patch::Apply(&patch),
        )
        .await
        .unwrap();
    let output = env
        .control_plane
        .kubectl(&["get", "hpn", &node_name])
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (header, row) = table_row(&stdout, &node_name);
    assert_eq!(
        header,
        ["NAME", "PAGES", "CONVERGED", "STALLED", "AGE"],
        "{stdout}"
    );
    // Every size in the one PAGES column (a cell with a space: two words).
    assert_eq!(
        &row[..5],
        [node_name.as_str(), "2Mi:64/64", "1Gi:0/4", "True", "False"],
        "{stdout}"
    );
    let _ = nodes.delete(&node_name, &DeleteParams::default()).await;
    delete_pool(&env.client, &name).await;
}

/// `kubectl explain` reads the descriptions the types carry, and `kubectl get
/// hugepool` lists both kinds (their category).
#[tokio::test]
async fn kubectl_explain_describes_fields_and_the_category_lists_both_kinds() {
    let Some(env) = setup().await else { return };
    let name = unique_name("category");
    apply_pool(&env.client, &name, json!({"pageSize": "2Mi", "pages": 8}))
        .await
        .unwrap();
    let run = |args: &[&str]| {
        let output = env.control_plane.kubectl(args).unwrap();
        assert!(
            output.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    // The apiserver publishes the CRD's OpenAPI a moment after it is
    // established; explain reads it from there.
    let explained = {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let output = env
                .control_plane
                .kubectl(&["explain", "hugepagepool.spec.rollout"])
                .unwrap();
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            if output.status.success() && text.contains("maxUnavailable") {
                break text;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "kubectl explain never described spec.rollout: {text}{}",
                String::from_utf8_lossy(&output.stderr)
            );
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    };
    assert!(
        explained.contains("How many nodes change at once"),
        "{explained}"
    );
    let listed = run(&["get", "hugepool", "-o", "name"]);
    assert!(
        listed.contains(&format!("hugepagepool.hugepool.dev/{name}")),
        "{listed}"
    );
    delete_pool(&env.client, &name).await;
}

/// The DPDK-style pod of examples/workloads/ is one the real API server
/// accepts as written (strict field validation, server-side dry run), with
/// its huge pages requested equal to their limits and mounted from the
/// size's hugetlbfs medium; the KubeVirt example asks for the 1Gi pages of
/// the 1Gi example pool (its CRD is KubeVirt's, not installed here).
#[tokio::test]
async fn the_workload_examples_ask_for_the_example_pools_pages() {
    let Some(env) = setup().await else { return };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let read = |file: &str| -> Value {
        serde_saphyr::from_str(&std::fs::read_to_string(dir.join(file)).expect(file))
            .unwrap_or_else(|err| panic!("{file}: {err}"))
    };
    let pod = read("workloads/dpdk-pod.yaml");
    let pool = read("pool-2mi.yaml");
    let params = PatchParams::apply("hugepool-e2e")
        .validation_strict()
        .dry_run();
    // Admission looks up the pod's ServiceAccount, which the controller
    // manager creates shortly after a control plane starts.
    let accounts = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(
        env.client.clone(),
        "default",
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while accounts.get_opt("default").await.unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "no default ServiceAccount after 60 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(env.client.clone(), "default");
    let stored = pods
        .patch("dpdk-forwarder", &params, &Patch::Apply(&pod))
        .await
        .unwrap_or_else(|err| panic!("dpdk-pod.yaml refused: {err}"));
    let resources = stored.spec.as_ref().expect("spec").containers[0]
        .resources
        .clone()
        .expect("resources");
    let requested = resources.requests.expect("requests")["hugepages-2Mi"]
        .0
        .clone();
    assert_eq!(
        resources.limits.expect("limits")["hugepages-2Mi"].0,
        requested
    );
    let bytes = hugepool_crds::quantity::parse_bytes(&requested).expect("a quantity");
    let pool_pages = pool["spec"]["pages"].as_u64().expect("pages");
    assert!(
        bytes <= pool_pages * (2 << 20),
        "the pod asks for {requested}, the pool holds {pool_pages} x 2Mi"
    );
    assert_eq!(
        pod["spec"]["nodeSelector"], pool["spec"]["nodeSelector"]["matchLabels"],
        "the pod goes where the pool is"
    );
    assert!(pods.get_opt("dpdk-forwarder").await.unwrap().is_none());

    // The claim template asks the DeviceClass the chart installs for the DRA
    // pool's size for at most the pool's pages, and the pod goes where the
    // pool is; the apiserver takes both (1.36+: consumable capacity).
    let documents: Vec<Value> = serde_saphyr::from_multiple(
        &std::fs::read_to_string(dir.join("workloads/dra-pod.yaml")).expect("dra-pod.yaml"),
    )
    .expect("dra-pod.yaml");
    let pool = read("pool-dra.yaml");
    let [template, pod] = &documents[..] else {
        panic!("dra-pod.yaml: a ResourceClaimTemplate and a Pod")
    };
    let request = &template["spec"]["spec"]["devices"]["requests"][0]["exactly"];
    let size = pool["spec"]["pageSize"].as_str().expect("pageSize");
    assert_eq!(
        request["deviceClassName"],
        format!("hugepages-{}.hugepool.dev", size.to_lowercase())
    );
    let memory = request["capacity"]["requests"]["memory"]
        .as_str()
        .expect("memory");
    let bytes = hugepool_crds::quantity::parse_bytes(memory).expect("a quantity");
    let page = hugepool_crds::quantity::parse_bytes(size).expect("a size");
    assert!(
        bytes.is_multiple_of(page)
            && bytes <= pool["spec"]["pages"].as_u64().expect("pages") * page
    );
    assert_eq!(
        pod["spec"]["nodeSelector"], pool["spec"]["nodeSelector"]["matchLabels"],
        "the pod goes where the pool is"
    );
    assert_eq!(
        pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
        template["metadata"]["name"]
    );
    if hugepool_e2e::server_minor(&env.client).await.0 >= hugepool_e2e::DRA_MINOR {
        let templates = Api::<DynamicObject>::namespaced_with(
            env.client.clone(),
            "default",
            &kube::api::ApiResource::from_gvk_with_plural(
                &kube::api::GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaimTemplate"),
                "resourceclaimtemplates",
            ),
        );
        templates
            .patch("hugepages-512mi", &params, &Patch::Apply(template))
            .await
            .unwrap_or_else(|err| panic!("dra-pod.yaml's template refused: {err}"));
        pods.patch("dpdk-claims", &params, &Patch::Apply(pod))
            .await
            .unwrap_or_else(|err| panic!("dra-pod.yaml's pod refused: {err}"));
    }

    let vm = read("workloads/kubevirt-vm.yaml");
    let pool = read("pool-1gi.yaml");
    let domain = &vm["spec"]["template"]["spec"]["domain"];
    assert_eq!(
        domain["memory"]["hugepages"]["pageSize"],
        pool["spec"]["pageSize"]
    );
    let guest = domain["memory"]["guest"].as_str().expect("guest memory");
    let guest = hugepool_crds::quantity::parse_bytes(guest).expect("a quantity");
    assert!(guest <= pool["spec"]["pages"].as_u64().expect("pages") << 30);
    assert_eq!(
        vm["spec"]["template"]["spec"]["nodeSelector"],
        pool["spec"]["nodeSelector"]["matchLabels"]
    );
}

/// Every pool in examples/ is one the real API server accepts as written
/// (strict validation, server-side dry run), and between them they show each
/// kind of pool a user asks about.
#[tokio::test]
async fn every_example_pool_is_accepted_and_the_examples_cover_each_kind() {
    let Some(env) = setup().await else { return };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut shown = std::collections::BTreeSet::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("examples/")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    for path in &files {
        let file = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let body: Value = serde_saphyr::from_str(&std::fs::read_to_string(path).expect("read"))
            .unwrap_or_else(|err| panic!("{file}: {err}"));
        assert_eq!(body["kind"], "HugePagePool", "{file}");
        let name = body["metadata"]["name"].as_str().expect("name");
        let params = PatchParams::apply("hugepool-e2e")
            .validation_strict()
            .dry_run();
        let stored = pools_dynamic(&env.client)
            .patch(name, &params, &Patch::Apply(&body))
            .await
            .unwrap_or_else(|err| panic!("{file} refused: {err}"));
        let pool: HugePagePool = serde_json::from_value(serde_json::to_value(stored).unwrap())
            .unwrap_or_else(|err| panic!("{file} as a HugePagePool: {err}"));
        let spec = &pool.spec;
        if spec.page_size == PageSize::from_bytes(1 << 30).unwrap() {
            shown.insert("1Gi");
        }
        if spec.memory.is_some() {
            shown.insert("memory");
        }
        if spec
            .numa
            .as_ref()
            .is_some_and(|numa| numa.policy == NumaPolicy::Explicit)
        {
            shown.insert("Explicit NUMA");
        }
        if spec.deletion_policy == DeletionPolicy::Release {
            shown.insert("Release");
        }
        if spec.consumption == Some(hugepool_crds::settings::Consumption::DynamicResourceAllocation)
        {
            shown.insert("DRA");
        }
    }
    assert_eq!(
        shown.into_iter().collect::<Vec<_>>(),
        ["1Gi", "DRA", "Explicit NUMA", "Release", "memory"]
    );
    // A dry run stores nothing.
    let pools = Api::<HugePagePool>::all(env.client.clone());
    for name in ["dpdk-1gi", "memory-8gi", "numa-explicit", "batch-2mi"] {
        assert!(
            pools.get_opt(name).await.unwrap().is_none(),
            "{name} was stored"
        );
    }
}
