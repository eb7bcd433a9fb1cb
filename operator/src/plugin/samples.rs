//! The sample output in docs/kubectl-output.md, rendered from one fixed
//! cluster by the code that renders the real thing: the test fails when the
//! file differs, and `HUGEPOOL_BLESS=1` rewrites it.

use std::collections::BTreeMap;
use std::path::Path;

use hugepool_crds::conditions::{ConditionUpdate, set_condition};
use hugepool_crds::{HugePageNode, HugePagePool, NOT_READY_TAINT, NodeConditionType, Reason};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResourceExt;
use serde_json::{Value, json};

use super::*;
use crate::fixtures::{apply_specs, apply_statuses, at, converge, node, pool, run_plan};

const DOC: &str = "docs/kubectl-output.md";
const BLESS: &str = "HUGEPOOL_BLESS";

/// Two pools converged on three workers; worker-a's kubelet read its pool
/// before the resize (and the node keeps the not-ready taint for it);
/// worker-b's pages are partly taken by a running pod; a pod asking for
/// 512 x 2Mi is Pending.
struct Sample {
    pools: Vec<HugePagePool>,
    nodes: Vec<Node>,
    states: Vec<HugePageNode>,
    pods: Vec<Pod>,
    pending: Pod,
}

fn publish(node: &mut Node, hugepages: &[(&str, &str)]) {
    let mut capacity: BTreeMap<String, String> = hugepages
        .iter()
        .map(|(size, amount)| (format!("hugepages-{size}"), amount.to_string()))
        .collect();
    capacity.insert("cpu".into(), "16".into());
    capacity.insert("memory".into(), "64Gi".into());
    node.status = Some(
        serde_json::from_value(json!({"capacity": capacity, "allocatable": capacity}))
            .expect("NodeStatus"),
    );
}

fn pod(name: &str, node: Option<&str>, hugepages_2mi: &str, phase: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "net", "uid": format!("uid-{name}")},
        "spec": {
            "nodeName": node,
            "nodeSelector": {"dpdk": "true"},
            "containers": [{"name": "main", "resources": {
                "requests": {"memory": "1Gi", "hugepages-2Mi": hugepages_2mi},
                "limits": {"memory": "1Gi", "hugepages-2Mi": hugepages_2mi},
            }}],
        },
        "status": {"phase": phase, "conditions": if node.is_none() {
            json!([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 2 Insufficient hugepages-2Mi, 1 node(s) didn't match Pod's node affinity/selector."}])
        } else {
            json!([])
        }},
    }))
    .expect("Pod")
}

fn sample() -> Sample {
    let mut pools = vec![pool("dpdk-2m", 0, "dpdk", "2Mi", 1024), {
        let mut db = pool("db-1g", 0, "db", "1Gi", 0);
        db.spec.pages = None;
        db.spec.memory = Some("8Gi".into());
        db
    }];
    let mut nodes = vec![
        node("worker-a", &["dpdk"]),
        node("worker-b", &["dpdk"]),
        node("worker-c", &["db"]),
    ];
    let mut states = Vec::new();
    for pass in 0..20 {
        let plan = run_plan(&pools, &nodes, &states, pass);
        apply_specs(&plan, &mut states);
        apply_statuses(&plan, &mut pools);
        states.iter_mut().for_each(converge);
    }
    for state in &mut states {
        state.metadata.creation_timestamp = Some(Time(at(0)));
        let stale = state.metadata.name.as_deref() == Some("worker-a");
        let status = state.status.get_or_insert_with(Default::default);
        // What the pods bound to each node request, as its agent counts
        // them: trafficgen's 600 pages on worker-b, a 6Gi database on worker-c.
        let requested = match state.metadata.name.as_deref() {
            Some("worker-b") => 600,
            Some("worker-c") => 6,
            _ => 0,
        };
        for size in &mut status.page_sizes {
            size.requested = Some(requested);
            size.in_use = requested;
            size.free = size.total - requested;
        }
        status.summary = Some(hugepool_agent::agent::status::summary(
            &status.page_sizes,
            &state.spec.page_sizes,
        ));
        // What every agent reports besides Converged.
        let updates = [
            ConditionUpdate::new(
                NodeConditionType::Stalled,
                false,
                Reason::WritesWithinBudget,
                "every write within its budget",
            ),
            if stale {
                ConditionUpdate::new(
                    NodeConditionType::KubeletCapacityStale,
                    true,
                    Reason::KubeletRestartRequired,
                    "the kubelet reports 0 x hugepages-2Mi, the kernel holds 1024",
                )
            } else {
                ConditionUpdate::new(
                    NodeConditionType::KubeletCapacityStale,
                    false,
                    Reason::CapacityMatches,
                    "",
                )
            },
        ];
        for update in updates {
            set_condition(&mut status.conditions, update, &Time(at(300)));
        }
    }
    publish(&mut nodes[0], &[("2Mi", "0"), ("1Gi", "0")]);
    publish(&mut nodes[1], &[("2Mi", "2Gi"), ("1Gi", "0")]);
    publish(&mut nodes[2], &[("2Mi", "0"), ("1Gi", "8Gi")]);
    nodes[0].spec.get_or_insert_with(Default::default).taints = Some(vec![
        serde_json::from_value(json!({"key": NOT_READY_TAINT, "effect": "NoSchedule"}))
            .expect("Taint"),
    ]);
    // The operator's pass over the stale kubelet.
    let plan = run_plan(&pools, &nodes, &states, 20);
    apply_statuses(&plan, &mut pools);
    pools.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Sample {
        pools,
        nodes,
        states,
        pods: vec![pod("trafficgen", Some("worker-b"), "1200Mi", "Running")],
        pending: pod("l2fwd", None, "1Gi", "Pending"),
    }
}

fn established(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let mut crd = crd;
    crd.status = Some(
        serde_json::from_value(json!({"conditions": [
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted"},
        ]}))
        .expect("CRD status"),
    );
    crd
}

fn install(agent_tag: &str) -> (Vec<Deployment>, Vec<DaemonSet>, Lease) {
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "hugepool-operator", "namespace": "hugepool-system"},
        "spec": {"replicas": 2, "selector": {}, "template": {"spec": {"containers": [{
            "name": "operator",
            "image": "ghcr.io/hugepool-dev/hugepool-operator:0.1.0",
            "args": ["run", "--leader-elect", "--lease-name=hugepool-operator"],
        }]}}},
        "status": {"readyReplicas": 2},
    }))
    .expect("Deployment");
    let daemonset: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "hugepool-agent", "namespace": "hugepool-system"},
        "spec": {"selector": {}, "template": {"spec": {"containers": [{
            "name": "agent",
            "image": format!("ghcr.io/hugepool-dev/hugepool-agent:{agent_tag}"),
        }]}}},
        "status": {"numberReady": 3, "desiredNumberScheduled": 3, "currentNumberScheduled": 3, "numberMisscheduled": 0},
    }))
    .expect("DaemonSet");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "hugepool-operator", "namespace": "hugepool-system"},
        "spec": {
            "holderIdentity": "hugepool-operator-7d9f8-x2k4p",
            "leaseDurationSeconds": 15,
            "renewTime": at(596).to_string(),
        },
    }))
    .expect("Lease");
    (vec![deployment], vec![daemonset], lease)
}

/// What `.a.b` or `.a[?(@.key=="value")].b` (the forms our printer
/// columns use) picks from `object`; any other form panics, so a new
/// column's path is added here before the samples can show it.
fn json_path<'a>(object: &'a Value, path: &str) -> Option<&'a Value> {
    let mut here = object;
    let mut rest = path.strip_prefix('.').expect("a path starts with .");
    while !rest.is_empty() {
        let end = rest.find(['.', '[']).unwrap_or(rest.len());
        let (field, tail) = rest.split_at(end);
        if !field.is_empty() {
            here = here.get(field)?;
        }
        rest = tail;
        if let Some(filter) = rest.strip_prefix("[?(@.") {
            let close = filter.find(")]").expect("a filter ends with )]");
            let (key, value) = filter[..close]
                .split_once("==")
                .expect("a filter is @.key==\"value\"");
            let value = value.trim_matches('"');
            here = here
                .as_array()?
                .iter()
                .find(|item| item.get(key).and_then(Value::as_str) == Some(value))?;
            rest = &filter[close + 2..];
        } else {
            assert!(!rest.starts_with('['), "json_path does not read {path} yet");
        }
        rest = rest.strip_prefix('.').unwrap_or(rest);
    }
    Some(here)
}

/// `kubectl get` of `objects` by the CRD's printer columns (those kubectl
/// shows without `-o wide`), as kubectl lays them out.
fn printer_table(
    crd: &CustomResourceDefinition,
    objects: &[Value],
    now: jiff::Timestamp,
) -> String {
    let columns: Vec<_> = crd.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .filter(|c| c.priority.unwrap_or(0) == 0)
        .collect();
    let mut rows = vec![
        std::iter::once("NAME".to_string())
            .chain(columns.iter().map(|c| c.name.to_uppercase()))
            .collect::<Vec<_>>(),
    ];
    for object in objects {
        let mut row = vec![
            object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        ];
        for column in &columns {
            let cell = match json_path(object, &column.json_path) {
                None => String::new(),
                Some(Value::String(text)) if column.type_ == "date" => {
                    let then: jiff::Timestamp = text.parse().expect("a timestamp");
                    age(Some(now.duration_since(then).as_secs()))
                }
                Some(Value::String(text)) => text.clone(),
                Some(other) => other.to_string(),
            };
            row.push(cell);
        }
        rows.push(row);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut text = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        text.push_str(line.join("   ").trim_end());
        text.push('\n');
    }
    text
}

fn as_json<T: serde::Serialize>(objects: &[T]) -> Vec<Value> {
    objects
        .iter()
        .map(|o| serde_json::to_value(o).expect("JSON"))
        .collect()
}

fn section(out: &mut String, command: &str, title: &str, body: &str) {
    let _ = write!(
        out,
        "## `{command}`{title}\n\n```text\n$ {command}\n{body}```\n\n"
    );
}

fn render_samples() -> String {
    let sample = sample();
    let now = at(600);
    let view = plan::ClusterView {
        pools: &sample.pools,
        nodes: &sample.nodes,
        node_states: &sample.states,
    };
    let mut out = String::from(
        "# kubectl hugepool: sample output\n\n\
         <!-- Generated by `HUGEPOOL_BLESS=1 cargo test -p hugepool-operator --lib plugin::samples`\n\
         from the fixed cluster in operator/src/plugin/samples.rs; a test fails when it differs. -->\n\n\
         One cluster: pool `dpdk-2m` (1024 x 2Mi) on worker-a and worker-b, pool `db-1g`\n\
         (8Gi of 1Gi pages) on worker-c. Every kernel holds its target, but worker-a's\n\
         kubelet read its pool before the resize, so `dpdk-2m` is not Available and\n\
         worker-a keeps the `hugepool.dev/not-ready` taint. A pod `trafficgen` holds 600\n\
         pages on worker-b; the pod `net/l2fwd`, asking for 512, is Pending.\n\n",
    );
    section(
        &mut out,
        "kubectl get hpp",
        "",
        &printer_table(&HugePagePool::crd(), &as_json(&sample.pools), now),
    );
    section(
        &mut out,
        "kubectl get hpn",
        "",
        &printer_table(&HugePageNode::crd(), &as_json(&sample.states), now),
    );
    let rows = status::report(&view, None, now);
    section(
        &mut out,
        "kubectl hugepool status",
        "",
        &render_status(&rows, false),
    );
    let rows = status::report(&view, Some("dpdk-2m"), now);
    section(
        &mut out,
        "kubectl hugepool status dpdk-2m",
        "",
        &render_status(&rows, true),
    );
    section(
        &mut out,
        "kubectl hugepool top",
        "",
        &render_top(&top::report(&view, now)),
    );
    let node = sample
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some("worker-a"));
    let state = sample
        .states
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("worker-a"));
    let why = why::report("worker-a", node, state, &[], &Default::default(), now);
    section(
        &mut out,
        "kubectl hugepool why worker-a",
        "",
        &render_why(&why),
    );
    let report = pod::report(
        &sample.pending,
        &sample.nodes,
        &sample.states,
        &sample.pods,
        &Default::default(),
    );
    section(
        &mut out,
        "kubectl hugepool why pod/l2fwd -n net",
        "",
        &render_why_pod(&report),
    );
    for (agent_tag, title) in [("0.1.0", ""), ("0.0.9", " (an agent left behind)")] {
        let (operators, agents, lease) = install(agent_tag);
        let input = check::CheckInput {
            crds: vec![
                (
                    HugePagePool::crd_name().to_string(),
                    Some(established(HugePagePool::crd())),
                ),
                (
                    HugePageNode::crd_name().to_string(),
                    Some(established(HugePageNode::crd())),
                ),
            ],
            operators,
            agents,
            lease: Some((
                "hugepool-system".into(),
                "hugepool-operator".into(),
                Some(lease),
            )),
            pools: status::report(&view, None, now),
            unreadable: None,
            node_states: sample.states.clone(),
            plugin_version: "0.1.0".into(),
        };
        let report = check::report(&input, now);
        let mut body = render_check(&report);
        if !report.passed() {
            body.push_str("$ echo $?\n1\n");
        }
        section(&mut out, "kubectl hugepool check", title, &body);
    }
    out
}

#[test]
fn the_docs_samples_are_what_the_plugin_prints() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(DOC);
    let rendered = render_samples();
    if std::env::var_os(BLESS).is_some() {
        std::fs::write(&path, &rendered).expect("write the samples");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "{DOC} is not what the plugin prints now; regenerate it with \
         `{BLESS}=1 cargo test -p hugepool-operator --lib plugin::samples`"
    );
}
