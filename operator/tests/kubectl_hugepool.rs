//! `kubectl hugepool` (the release's `kubectl-hugepool` binary) against a
//! simulated fleet on the real control plane: `plan` predicts what the
//! operator then does, `status` and `why` say where pools and nodes stand.

#[allow(dead_code)]
mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use hugepool_e2e::setup;
use serde_json::{Value, json};
use support::{Fleet, FleetSpec, SCOPE_LABEL, wait_for};

const ROLE_LABEL: &str = "fleet.hugepool.dev/role";
const OLD_LABEL: &str = "fleet.hugepool.dev/old";

/// Runs `kubectl-hugepool ARGS -o json` and parses its output.
fn plugin_json(kubeconfig: &Path, args: &[&str]) -> Value {
    let text = plugin(kubeconfig, &[args, &["-o", "json"]].concat());
    serde_json::from_str(&text).unwrap_or_else(|err| panic!("{args:?}: {err}: {text}"))
}

/// Runs `kubectl-hugepool ARGS`; its standard output.
fn plugin(kubeconfig: &Path, args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_kubectl-hugepool"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .expect("run kubectl-hugepool");
    assert!(
        output.status.success(),
        "kubectl-hugepool {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

fn nodes_of(wave: &Value) -> Vec<String> {
    let mut nodes: Vec<String> = wave
        .as_array()
        .expect("a wave")
        .iter()
        .map(|c| c["node"].as_str().expect("node").to_string())
        .collect();
    nodes.sort();
    nodes
}

/// `plan` of a new pool over 6 nodes, one of them owned by an older pool:
/// the operator then targets the plan's nodes, its first wave first and
/// the rest in the plan's order up to one rolling window, the conflict is the node the operator leaves alone, and nothing is
/// written by the plan. Then `status` and `why` describe the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_predicts_the_rollout_and_status_and_why_describe_it() {
    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    let spec = FleetSpec::new(6)
        .label(ROLE_LABEL, "dpdk")
        .label_nodes(5..6, OLD_LABEL, "yes");
    let mut fleet = Fleet::start(&env, "plugin", spec).await;
    let scope = fleet.scope.clone();
    let names = fleet.node_names();
    fleet.start_operator(None).await;
    let mut watch = fleet.watch_rollout(6);
    watch.synced().await;

    // Named so that even a tie of creation seconds goes to the older pool.
    let old = format!("{scope}-a-old");
    fleet
        .create_pool(
            &old,
            json!({
                "nodeSelector": {"matchLabels": {SCOPE_LABEL: scope, OLD_LABEL: "yes"}},
                "pageSize": "2Mi",
                "pages": 32,
            }),
        )
        .await;
    fleet
        .wait_pool(&old, "Available", "True", Duration::from_secs(120), |_| {
            Ok(())
        })
        .await;

    let new = format!("{scope}-b-new");
    let spec = json!({
        "nodeSelector": {"matchLabels": {SCOPE_LABEL: scope, ROLE_LABEL: "dpdk"}},
        "pageSize": "2Mi",
        "pages": 64,
        "rollout": {"maxUnavailable": 2},
    });
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        file.path(),
        format!(
            "apiVersion: hugepool.dev/v1alpha1\nkind: HugePagePool\nmetadata:\n  name: {new}\n  labels:\n    {SCOPE_LABEL}: {scope}\nspec: {spec}\n"
        ),
    )
    .expect("write the pool file");
    let path = file.path().to_str().expect("path");
    let plan = plugin_json(&kubeconfig, &["plan", "-f", path]);
    assert_eq!(plan["exists"], false);
    assert_eq!(plan["maxUnavailable"], 2);
    let waves: Vec<Vec<String>> = plan["waves"]
        .as_array()
        .expect("waves")
        .iter()
        .map(nodes_of)
        .collect();
    assert_eq!(
        waves,
        [
            names[0..2].to_vec(),
            names[2..4].to_vec(),
            names[4..5].to_vec()
        ],
        "{plan}"
    );
    for change in plan["waves"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w.as_array().unwrap())
    {
        assert_eq!(
            (&change["from"], &change["to"]),
            (&json!(0), &json!(64)),
            "{change}"
        );
        assert_eq!(change["drain"], Value::Null);
    }
    assert_eq!(plan["conflicts"], json!([{"node": names[5], "owner": old}]));
    let text = plugin(&kubeconfig, &["plan", "-f", path]);
    assert!(
        text.contains("5 node(s) change in 3 wave(s) of at most 2"),
        "{text}"
    );
    assert!(text.contains("Nothing was written."), "{text}");
    assert!(
        fleet.pool_api().get_opt(&new).await.expect("get").is_none(),
        "the plan created the pool"
    );

    fleet.create_pool(&new, spec).await;
    wait_for(
        "5 nodes converged for the new pool",
        Duration::from_secs(120),
        || async {
            let nodes = fleet.pool(&new).await.status.unwrap_or_default().nodes;
            (nodes.converged == 5)
                .then_some(())
                .ok_or(format!("{nodes:?}"))
        },
    )
    .await;
    let targeted: Vec<String> = watch
        .record()
        .first_targeted
        .into_iter()
        .filter(|(pool, _)| *pool == new)
        .map(|(_, node)| node)
        .collect();
    // The operator admits the plan's nodes and no others, the first wave
    // first. Later admissions are rolling (a slot frees as one node
    // converges, and the nodes admitted in one pass are written
    // concurrently), so past the first wave the order may differ from
    // the names' only within one maxUnavailable window.
    let planned: Vec<String> = waves.concat();
    let mut sorted = targeted.clone();
    sorted.sort();
    assert_eq!(sorted, planned, "targeted: {targeted:?}");
    let mut first: Vec<String> = targeted[..waves[0].len()].to_vec();
    first.sort();
    assert_eq!(first, waves[0], "targeted in this order: {targeted:?}");
    let window = 2;
    for (at, node) in targeted.iter().enumerate() {
        let rank = planned.iter().position(|n| n == node).expect("planned");
        assert!(
            rank.abs_diff(at) < window,
            "{node} targeted {at}th, planned {rank}th: {targeted:?}"
        );
    }
    watch.assert_bounded();

    // status: the pool's counts, and the conflict by name.
    let status = plugin_json(&kubeconfig, &["status", &new]);
    let row = &status[0];
    assert_eq!(
        (
            &row["selected"],
            &row["converged"],
            &row["pending"],
            &row["failed"]
        ),
        (&json!(6), &json!(5), &json!(1), &json!(0)),
        "{row}"
    );
    let conflict = row["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["node"] == names[5].as_str())
        .expect("the conflicting node is listed");
    assert_eq!(conflict["state"], "Conflict");
    assert_eq!(conflict["reason"], format!("owned by the older pool {old}"));
    let converged: Vec<&Value> = row["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["state"] == "Converged")
        .collect();
    assert_eq!(converged.len(), 5);
    assert!(
        converged
            .iter()
            .all(|n| n["current"] == 64 && n["target"] == 64)
    );
    let text = plugin(&kubeconfig, &["status", &new]);
    assert!(text.starts_with("POOL"), "{text}");
    assert!(text.contains(&format!("{}  Conflict", names[5])), "{text}");

    // why: the node's target, its last resize, its conditions, the pods holding pages.
    support::create_namespace(&fleet.client, &scope).await;
    let pod = support::pod("holder", &names[0], "app", Some("8Mi"));
    support::run_pod(&fleet.client, &scope, pod).await;
    let why = plugin_json(&kubeconfig, &["why", &names[0]]);
    let size = why["sizes"]
        .as_array()
        .expect("sizes")
        .iter()
        .find(|s| s["size"] == "2Mi")
        .expect("2Mi");
    assert_eq!(
        (&size["pool"], &size["target"], &size["total"]),
        (&json!(new), &json!(64), &json!(64))
    );
    assert_eq!(size["lastResize"]["to"], 64, "{why}");
    let converged = why["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|c| c["type"] == "Converged")
        .expect("Converged");
    assert_eq!(converged["status"], "True");
    assert_eq!(
        why["pods"],
        json!([{"pod": format!("{scope}/holder"), "size": "2Mi", "pages": 4, "unevictable": ""}])
    );
    let text = plugin(&kubeconfig, &["why", &names[0]]);
    assert!(
        text.contains("Conditions:") && text.contains("Pods holding pages:"),
        "{text}"
    );

    let client = fleet.client.clone();
    drop(watch);
    fleet.shutdown().await;
    support::delete_namespace(&client, &scope).await;
}

/// A pool the server would refuse is refused by `plan` with the server's
/// message, and nothing is planned.
#[tokio::test]
async fn plan_refuses_a_pool_the_server_refuses() {
    let Some(env) = setup().await else { return };
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        file.path(),
        "apiVersion: hugepool.dev/v1alpha1\nkind: HugePagePool\nmetadata: {name: refused}\nspec: {pageSize: 2Mi, pages: 8, memory: 16Mi}\n",
    )
    .expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_kubectl-hugepool"))
        .arg("--kubeconfig")
        .arg(&env.control_plane.kubeconfig)
        .args(["plan", "-f", file.path().to_str().unwrap()])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("exactly one of spec.pages and spec.memory must be set"),
        "{stderr}"
    );
}
