//! `kubectl hugepool` (the release's `kubectl-hugepool` binary) against a
//! simulated fleet on the real control plane: `plan` predicts what the
//! operator then does, `status` and `why` say where pools and nodes stand.

#[allow(dead_code)]
mod support;

use std::collections::BTreeMap;
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

/// The row of `name` in `kubectl get KIND` output, by column: cells are cut
/// at the header's column offsets (a cell may hold spaces).
fn kubectl_get(
    kubeconfig: &Path,
    kind: &str,
    name: &str,
) -> std::collections::BTreeMap<String, String> {
    // The kubectl built with the control plane (its version), as api.rs runs it.
    let output = Command::new(hugepool_e2e::kubectl_path())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["get", kind, name])
        .output()
        .expect("run kubectl");
    assert!(
        output.status.success(),
        "kubectl get {kind} {name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).expect("UTF-8");
    let mut lines = text.lines();
    let header = lines.next().expect("a header");
    let row = lines.next().unwrap_or_else(|| panic!("no row: {text}"));
    let mut starts: Vec<(usize, &str)> = Vec::new();
    let mut at = 0;
    for word in header.split_whitespace() {
        let start = header[at..].find(word).expect("header word") + at;
        starts.push((start, word));
        at = start + word.len();
    }
    starts
        .iter()
        .enumerate()
        .map(|(i, (start, word))| {
            let end = starts
                .get(i + 1)
                .map_or(row.len(), |next| next.0.min(row.len()));
            let cell = row.get(*start..end).unwrap_or_default().trim();
            (word.to_string(), cell.to_string())
        })
        .collect()
}

/// Merge-patches the Node's status as its kubelet would publish hugepages:
/// `capacity` pages of each size (allocatable the same).
async fn publish_hugepages(client: &kube::Client, node: &str, pages: &[(&str, u64)]) {
    use k8s_openapi::api::core::v1::Node;
    let mut capacity = serde_json::Map::new();
    for (size, count) in pages {
        let bytes = size
            .parse::<hugepool_crds::PageSize>()
            .expect("size")
            .bytes()
            * count;
        capacity.insert(format!("hugepages-{size}"), json!(bytes.to_string()));
    }
    capacity.insert("cpu".into(), json!("4"));
    capacity.insert("memory".into(), json!("16Gi"));
    capacity.insert("pods".into(), json!("110"));
    kube::Api::<Node>::all(client.clone())
        .patch_status(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"status": {"capacity": capacity, "allocatable": capacity}}),
            ),
        )
        .await
        .expect("patch the Node's status");
}

/// A pod asking `pages_2mi` pages of 2Mi, left Pending (nothing schedules
/// here) with the scheduler's message, restricted to the fleet's nodes.
async fn pending_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    scope: &str,
    pages_2mi: u64,
) {
    use k8s_openapi::api::core::v1::Pod;
    let amount = format!("{}Mi", pages_2mi * 2);
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {SCOPE_LABEL: scope},
            "automountServiceAccountToken": false,
            "containers": [{"name": "main", "image": "registry.example/app:1", "resources": {
                "requests": {"cpu": "10m", "memory": "32Mi", "hugepages-2Mi": amount},
                "limits": {"memory": "32Mi", "hugepages-2Mi": amount},
            }}],
        },
    }))
    .expect("Pod object");
    let api: kube::Api<Pod> = kube::Api::namespaced(client.clone(), namespace);
    wait_for(
        &format!("pod {name} created"),
        Duration::from_secs(30),
        || async {
            api.create(&kube::api::PostParams::default(), &pod)
                .await
                .map_err(|e| e.to_string())
        },
    )
    .await;
    api.patch_status(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"status": {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 Insufficient hugepages-2Mi.",
        }]}})),
    )
    .await
    .expect("pod status");
}

/// The printer columns, `status` (Available and its reason; `-w`), `why
/// NODE` (every hugepool taint) and `why pod/NAME` on one node with pools
/// of two sizes and one with a stale kubelet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_shows_every_size_the_blocking_reason_and_why_a_pod_is_pending() {
    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    let mut fleet = Fleet::start(&env, "truth", FleetSpec::new(2)).await;
    let scope = fleet.scope.clone();
    let names = fleet.node_names();
    fleet.start_operator(None).await;
    let selector = json!({"matchLabels": {SCOPE_LABEL: scope}});
    let small = format!("{scope}-2m");
    let large = format!("{scope}-1g");
    fleet
        .create_pool(&small, json!({"nodeSelector": selector, "pageSize": "2Mi", "pages": 64, "rollout": {"maxUnavailable": 2}}))
        .await;
    fleet
        .create_pool(&large, json!({"nodeSelector": selector, "pageSize": "1Gi", "memory": "2Gi", "rollout": {"maxUnavailable": 2}}))
        .await;
    for pool in [&small, &large] {
        fleet
            .wait_pool(pool, "Available", "True", Duration::from_secs(120), |_| {
                Ok(())
            })
            .await;
    }

    // kubectl get: one column for both sizes; PAGES of the memory-sized pool.
    let hpn = kubectl_get(&kubeconfig, "hpn", &names[0]);
    assert_eq!(hpn["PAGES"], "2Mi:64/64 1Gi:2/2", "{hpn:?}");
    assert_eq!(hpn["CONVERGED"], "True", "{hpn:?}");
    assert!(!hpn.contains_key("SIZE"), "{hpn:?}");
    let hpp = kubectl_get(&kubeconfig, "hpp", &large);
    assert_eq!(
        (
            hpp["SIZE"].as_str(),
            hpp["PAGES"].as_str(),
            hpp["AVAILABLE"].as_str(),
            hpp["REASON"].as_str()
        ),
        ("1Gi", "2", "True", "AllNodesConverged"),
        "{hpp:?}"
    );

    // status: Available and its reason.
    let status = plugin_json(&kubeconfig, &["status", &small]);
    assert_eq!(status[0]["available"]["status"], "True", "{status}");
    assert_eq!(
        status[0]["available"]["reason"], "AllNodesConverged",
        "{status}"
    );
    assert_eq!(status[0]["pages"], 64);

    // status -w: prints now, then again on a change; ends after --updates.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-hugepool"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["status", &small, "-w", "--updates", "2", "-o", "json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run status -w");
    let stdout = child.stdout.take().expect("stdout");
    let (lines_tx, mut lines_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    let first = tokio::time::timeout(Duration::from_secs(30), lines_rx.recv())
        .await
        .expect("a first print within 30s")
        .expect("a line");
    let first: Value = serde_json::from_str(&first).expect("JSON rows");
    assert_eq!(
        (&first[0]["pages"], &first[0]["converged"]),
        (&json!(64), &json!(2)),
        "{first}"
    );
    fleet.patch_pool(&small, json!({"pages": 32})).await;
    let second = tokio::time::timeout(Duration::from_secs(30), lines_rx.recv())
        .await
        .expect("a print on the change within 30s")
        .expect("a line");
    let second: Value = serde_json::from_str(&second).expect("JSON rows");
    assert_eq!(second[0]["pages"], 32, "{second}");
    let exited = wait_for(
        "status -w to end after 2 updates",
        Duration::from_secs(10),
        || {
            let status = child.try_wait().expect("try_wait");
            std::future::ready(status.ok_or_else(|| "running".to_string()))
        },
    )
    .await;
    assert!(exited.success(), "{exited:?}");
    // Without --updates it runs until asked to stop (SIGTERM, as Ctrl-C).
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-hugepool"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["status", &small, "-w"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run status -w");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut header = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut header).expect("read");
    assert!(header.starts_with("POOL"), "{header}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let exited = wait_for(
        "status -w to end on SIGTERM",
        Duration::from_secs(10),
        || {
            let status = child.try_wait().expect("try_wait");
            std::future::ready(status.ok_or_else(|| "running".to_string()))
        },
    )
    .await;
    assert!(exited.success(), "{exited:?}");
    fleet
        .wait_pool(
            &small,
            "Available",
            "True",
            Duration::from_secs(120),
            |_| Ok(()),
        )
        .await;

    // A kubelet that read the pool before the resize: Available=False,
    // KubeletCapacityStale, in kubectl get and in status.
    publish_hugepages(&fleet.client, &names[0], &[("2Mi", 0), ("1Gi", 2)]).await;
    publish_hugepages(&fleet.client, &names[1], &[("2Mi", 32), ("1Gi", 2)]).await;
    fleet
        .wait_pool(
            &small,
            "Available",
            "False",
            Duration::from_secs(60),
            |_| Ok(()),
        )
        .await;
    let hpp = kubectl_get(&kubeconfig, "hpp", &small);
    assert_eq!(
        (
            hpp["PAGES"].as_str(),
            hpp["AVAILABLE"].as_str(),
            hpp["REASON"].as_str()
        ),
        ("32", "False", "KubeletCapacityStale"),
        "{hpp:?}"
    );
    let status = plugin_json(&kubeconfig, &["status", &small]);
    assert_eq!(
        status[0]["available"]["reason"], "KubeletCapacityStale",
        "{status}"
    );
    let text = plugin(&kubeconfig, &["status", &small]);
    assert!(text.contains("False/KubeletCapacityStale"), "{text}");
    assert!(
        text.contains(&format!("{small}: Available False/KubeletCapacityStale: ")),
        "{text}"
    );

    // why pod/NAME: too large for any target, then stale here and taken there.
    support::create_namespace(&fleet.client, &scope).await;
    pending_pod(&fleet.client, &scope, "big", &scope, 100).await;
    let why = plugin_json(&kubeconfig, &["why", "pod/big", "-n", &scope]);
    assert_eq!(
        why["requests"],
        json!([{"size": "2Mi", "pages": 100}]),
        "{why}"
    );
    let targets: Vec<(&str, &Value)> = why["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| (n["node"].as_str().unwrap(), &n["target"]))
        .collect();
    assert_eq!(
        targets,
        [
            (names[0].as_str(), &json!(32)),
            (names[1].as_str(), &json!(32))
        ],
        "{why}"
    );
    assert_eq!(
        why["verdict"],
        format!(
            "the pod asks for 100 pages of 2Mi, the largest target is 32: grow the pool {small}"
        ),
        "{why}"
    );
    let holder = support::pod("holder", &names[1], "app", Some("40Mi"));
    support::run_pod(&fleet.client, &scope, holder).await;
    pending_pod(&fleet.client, &scope, "small", &scope, 16).await;
    let why = plugin_json(&kubeconfig, &["why", "pod/small", "-n", &scope]);
    let rows = why["nodes"].as_array().expect("nodes");
    assert_eq!(
        (
            &rows[0]["kernel"],
            &rows[0]["allocatable"],
            &rows[0]["stale"]
        ),
        (&json!(32), &json!(0), &json!(true)),
        "{why}"
    );
    assert_eq!(
        (
            &rows[1]["allocatable"],
            &rows[1]["requested"],
            &rows[1]["blockedBy"]
        ),
        (
            &json!(32),
            &json!(20),
            &json!("20 of 32 requested by other pods")
        ),
        "{why}"
    );
    assert_eq!(
        why["verdict"],
        format!(
            "node {}: the kernel holds 32 pages of 2Mi but the kubelet publishes 0 (stale: it reads the pool only when it starts): restart the kubelet there, or set the pool's kubelet.restart: AfterResize (needs the chart's agent.kubeletRestart.enabled=true) (1 other node(s) blocked otherwise: see BLOCKED BY)",
            names[0]
        ),
        "{why}"
    );
    let text = plugin(&kubeconfig, &["why", "pod/small", "-n", &scope]);
    assert!(
        text.contains("scheduler: Unschedulable: 0/2 nodes are available"),
        "{text}"
    );
    assert!(text.contains("\nverdict: node "), "{text}");

    // why NODE names every hugepool taint (the operator stopped, so the
    // taints stay as set).
    let operator = fleet.take_operator(0);
    operator.stop().await;
    kube::Api::<k8s_openapi::api::core::v1::Node>::all(fleet.client.clone())
        .patch(
            &names[0],
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"taints": [
                {"key": hugepool_crds::DRAINING_TAINT, "effect": "NoSchedule"},
                {"key": hugepool_crds::NOT_READY_TAINT, "effect": "NoSchedule"},
            ]}})),
        )
        .await
        .expect("taint the Node");
    let why = plugin_json(&kubeconfig, &["why", &names[0]]);
    let taints: Vec<&str> = why["taints"]
        .as_array()
        .expect("taints")
        .iter()
        .map(|t| t["taint"].as_str().unwrap())
        .collect();
    assert_eq!(
        taints,
        [
            "hugepool.dev/draining:NoSchedule",
            "hugepool.dev/not-ready:NoSchedule"
        ],
        "{why}"
    );
    let text = plugin(&kubeconfig, &["why", &names[0]]);
    assert!(
        text.starts_with(&format!(
            "Node {} (tainted hugepool.dev/draining:NoSchedule, hugepool.dev/not-ready:NoSchedule)\n",
            names[0]
        )),
        "{text}"
    );
    let why = plugin_json(&kubeconfig, &["why", "pod/small", "-n", &scope]);
    assert_eq!(
        why["nodes"][0]["taints"],
        json!([
            "hugepool.dev/draining:NoSchedule",
            "hugepool.dev/not-ready:NoSchedule"
        ]),
        "{why}"
    );
    assert!(
        why["verdict"].as_str().unwrap().starts_with("node ")
            && why["verdict"]
                .as_str()
                .unwrap()
                .contains("the kubelet publishes 0"),
        "{why}"
    );

    let client = fleet.client.clone();
    fleet.shutdown().await;
    support::delete_namespace(&client, &scope).await;
}

/// Runs `kubectl-hugepool ARGS`, whatever its exit code.
fn plugin_output(kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kubectl-hugepool"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .expect("run kubectl-hugepool")
}

/// Runs `kubectl-hugepool ARGS`; its exit code and standard output.
fn plugin_exit(kubeconfig: &Path, args: &[&str]) -> (i32, String) {
    let output = plugin_output(kubeconfig, args);
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

/// The operator's Deployment and the agent's DaemonSet as the chart labels
/// them (nothing runs their pods here: the check reads the Lease and the
/// HugePageNodes, not the pods).
async fn install_objects(
    client: &kube::Client,
    namespace: &str,
    operator_tag: &str,
    agent_tag: &str,
) {
    use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
    let labels = |component: &str| json!({"app.kubernetes.io/name": "hugepool", "app.kubernetes.io/part-of": "hugepool", "app.kubernetes.io/component": component});
    let deployment: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "hugepool-operator", "labels": labels("operator")},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels("operator")},
            "template": {
                "metadata": {"labels": labels("operator")},
                "spec": {"containers": [{
                    "name": "operator",
                    "image": format!("ghcr.io/hugepool-dev/hugepool-operator:{operator_tag}"),
                    "args": ["run", "--leader-elect", "--lease-name=hugepool-operator"],
                }]},
            },
        },
    }))
    .expect("Deployment");
    let daemonset: DaemonSet = serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "hugepool-agent", "labels": labels("agent")},
        "spec": {
            "selector": {"matchLabels": labels("agent")},
            "template": {
                "metadata": {"labels": labels("agent")},
                "spec": {
                    "nodeSelector": {"hugepool.dev/no-such-node": "true"},
                    "containers": [{
                        "name": "agent",
                        "image": format!("ghcr.io/hugepool-dev/hugepool-agent:{agent_tag}"),
                    }],
                },
            },
        },
    }))
    .expect("DaemonSet");
    let params = kube::api::PatchParams::apply("kubectl-hugepool-test").force();
    kube::Api::<Deployment>::namespaced(client.clone(), namespace)
        .patch(
            "hugepool-operator",
            &params,
            &kube::api::Patch::Apply(&deployment),
        )
        .await
        .expect("apply the Deployment");
    kube::Api::<DaemonSet>::namespaced(client.clone(), namespace)
        .patch(
            "hugepool-agent",
            &params,
            &kube::api::Patch::Apply(&daemonset),
        )
        .await
        .expect("apply the DaemonSet");
}

/// `check` passes on a working install, one line a check; then fails, with
/// exit code 1, for a stopped operator, a selected node no agent reports
/// for, and an agent of another version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_a_working_install_and_names_each_failure() {
    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    let mut fleet = Fleet::start(&env, "check", FleetSpec::new(2)).await;
    let scope = fleet.scope.clone();
    let replica = fleet.start_leading_replica().await;
    let pool = format!("{scope}-pool");
    fleet
        .create_pool(
            &pool,
            json!({"nodeSelector": {"matchLabels": {SCOPE_LABEL: scope}}, "pageSize": "2Mi", "pages": 16}),
        )
        .await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |_| {
            Ok(())
        })
        .await;
    install_objects(&fleet.client, &scope, "0.1.0", "0.1.0").await;
    let only = format!("{SCOPE_LABEL}={scope}");
    let args = ["check", "-n", scope.as_str(), "-l", only.as_str()];

    let (code, text) = plugin_exit(&kubeconfig, &args);
    assert_eq!(code, 0, "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert_eq!(
        lines[0],
        "OK    CRD hugepagepools.hugepool.dev: v1alpha1 served, Established"
    );
    assert_eq!(
        lines[1],
        "OK    CRD hugepagenodes.hugepool.dev: v1alpha1 served, Established"
    );
    assert!(
        lines[2].starts_with(&format!(
            "OK    operator leading: Deployment {scope}/hugepool-operator, 0/1 ready; Lease {scope}/{} held by {}, renewed ",
            replica.lease, replica.identity
        )),
        "{text}"
    );
    assert!(
        lines[3].starts_with(&format!(
            "OK    agents report: 2 of 2 selected nodes report their current spec; DaemonSet {scope}/hugepool-agent, "
        )),
        "{text}"
    );
    assert_eq!(
        lines[4], "OK    versions match: operator 0.1.0, agent 0.1.0",
        "{text}"
    );
    assert_eq!(lines[5], "all 5 checks passed");

    // A selected node with no agent, an agent of another version.
    let bare = format!("{scope}-bare");
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": bare, "labels": {SCOPE_LABEL: scope}},
    }))
    .expect("Node");
    kube::Api::<k8s_openapi::api::core::v1::Node>::all(fleet.client.clone())
        .create(&kube::api::PostParams::default(), &node)
        .await
        .expect("create the Node");
    install_objects(&fleet.client, &scope, "0.1.0", "0.0.9").await;
    let text = wait_for(
        "check to find the agentless node",
        Duration::from_secs(60),
        || {
            let (code, text) = plugin_exit(&kubeconfig, &args);
            std::future::ready(
                (code == 1 && text.contains("FAIL  agents report"))
                    .then_some(text.clone())
                    .ok_or(text),
            )
        },
    )
    .await;
    assert!(
        text.contains(&format!(
            "FAIL  agents report: 1 of 3 selected nodes have no agent reporting their spec: {bare} (no status: no agent has reported)"
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "FAIL  versions match: operator 0.1.0, agent 0.0.9: upgrade both to one release"
        ),
        "{text}"
    );
    assert!(text.contains("OK    operator leading"), "{text}");
    assert!(text.ends_with("2 of 5 checks failed\n"), "{text}");

    // The operator stopped: its Lease is let go, nobody leads.
    let operator = fleet.take_operator(0);
    operator.stop().await;
    let text = wait_for("check to see no leader", Duration::from_secs(30), || {
        let (code, text) = plugin_exit(&kubeconfig, &args);
        std::future::ready(
            (code == 1 && text.contains("FAIL  operator leading"))
                .then_some(text.clone())
                .ok_or(text),
        )
    })
    .await;
    let leading = text
        .lines()
        .find(|l| l.contains("operator leading"))
        .expect("the leading line");
    assert!(
        leading.contains("has no holder: no replica leads") || leading.contains("expired"),
        "{leading}"
    );

    let client = fleet.client.clone();
    fleet.shutdown().await;
    support::delete_namespace(&client, &scope).await;
}

/// Stranded pages on the real apiserver: what each node's pods request, as
/// its agent reads it from the pods' cgroups (the hugetlb limits a kubelet
/// sets; here a cgroup v2 tree of the systemd driver per node), shows in
/// each node's HugePageNode status, summed into the pool's status, and
/// `top` ranks the pool's nodes by the memory no pod requests; a pod that
/// goes is taken off again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_requests_show_in_node_and_pool_status_and_top_ranks_unrequested_memory() {
    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    let mut fleet = Fleet::start(&env, "strand", FleetSpec::new(2)).await;
    let scope = fleet.scope.clone();
    let names = fleet.node_names();
    fleet.start_operator(None).await;
    let pool = format!("{scope}-2m");
    fleet
        .create_pool(
            &pool,
            json!({"nodeSelector": {"matchLabels": {SCOPE_LABEL: scope}}, "pageSize": "2Mi", "pages": 64, "rollout": {"maxUnavailable": 2}}),
        )
        .await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |_| {
            Ok(())
        })
        .await;

    // 20 pages on the first node; on the second, two pods of 8 and 0.
    fleet.node(&names[0]).set_pod_pages_2mi("dpdk", 20);
    fleet.node(&names[1]).set_pod_pages_2mi("staged", 8);
    fleet.node(&names[1]).set_pod_pages_2mi("web", 0);

    let requested = |state: &hugepool_crds::HugePageNode| {
        state.status.as_ref().and_then(|s| {
            s.page_sizes
                .iter()
                .find(|p| p.size == hugepool_crds::PageSize::SIZE_2MI)
                .and_then(|p| p.requested)
        })
    };
    for (node, pages) in [(&names[0], 20), (&names[1], 8)] {
        wait_for(
            &format!("{node} reports {pages} pages requested"),
            Duration::from_secs(60),
            || async {
                let state = fleet.node_state(node).await;
                match requested(&state) {
                    Some(found) if found == pages => Ok(()),
                    other => Err(format!("requested {other:?}")),
                }
            },
        )
        .await;
    }
    let pages_of = |status: &Option<hugepool_crds::HugePagePoolStatus>| {
        status
            .as_ref()
            .map(|s| (s.pages.current, s.pages.requested, s.pages.unrequested))
    };
    wait_for(
        "the pool sums the requests",
        Duration::from_secs(60),
        || async {
            let found = pages_of(&fleet.pool(&pool).await.status);
            if found == Some((128, 28, 100)) {
                Ok(())
            } else {
                Err(format!("(current, requested, unrequested) {found:?}"))
            }
        },
    )
    .await;

    let selector = format!("{SCOPE_LABEL}={scope}");
    let top = plugin_json(&kubeconfig, &["top", "-l", &selector]);
    assert_eq!(top["pools"].as_array().map(Vec::len), Some(1), "{top}");
    assert_eq!(top["pools"][0]["name"], pool.as_str(), "{top}");
    assert_eq!(top["pools"][0]["requested"], 28, "{top}");
    assert_eq!(top["pools"][0]["unrequestedBytes"], 100u64 << 21, "{top}");
    let ranked: Vec<(&str, &Value)> = top["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| (n["node"].as_str().unwrap_or_default(), &n["unrequested"]))
        .collect();
    assert_eq!(
        ranked,
        [
            (names[1].as_str(), &json!(56)),
            (names[0].as_str(), &json!(44))
        ],
        "{top}"
    );
    let text = plugin(&kubeconfig, &["top", "-l", &selector]);
    assert!(text.contains("UNREQUESTED"), "{text}");
    assert!(text.contains("200Mi"), "{text}");

    // The consumer goes: its pages are no longer requested.
    fleet.node(&names[0]).remove_pod("dpdk");
    wait_for(
        "the pool drops the gone pod's request",
        Duration::from_secs(60),
        || async {
            let found = pages_of(&fleet.pool(&pool).await.status);
            if found == Some((128, 8, 120)) {
                Ok(())
            } else {
                Err(format!("(current, requested, unrequested) {found:?}"))
            }
        },
    )
    .await;

    fleet.shutdown().await;
}

/// `plan` of a grow predicts, per node, from the estimates the agents put
/// in their HugePageNode statuses (what a grow can get): the 16 GiB node
/// reaches the target, the 4 GiB one comes short by what its memory guard
/// keeps; applied, the pool lands where the plan said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_predicts_which_nodes_a_grow_leaves_short_from_the_agents_estimates() {
    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    let spec = FleetSpec::new(2).node_memory(1, 4 * support::GIB);
    let mut fleet = Fleet::start(&env, "foresee", spec).await;
    let scope = fleet.scope.clone();
    let names = fleet.node_names();
    fleet.start_operator(None).await;
    let pool = format!("{scope}-2m");
    let pool_spec = |pages: i64| {
        json!({
            "nodeSelector": {"matchLabels": {SCOPE_LABEL: scope}},
            "pageSize": "2Mi",
            "pages": pages,
            "rollout": {"maxUnavailable": 2},
        })
    };
    fleet.create_pool(&pool, pool_spec(16)).await;
    fleet
        .wait_pool(&pool, "Available", "True", Duration::from_secs(120), |_| {
            Ok(())
        })
        .await;
    let estimate = |state: &hugepool_crds::HugePageNode| {
        state.status.as_ref().and_then(|s| {
            s.page_sizes
                .iter()
                .find(|p| p.size == hugepool_crds::PageSize::SIZE_2MI)
                .and_then(|p| p.obtainable)
        })
    };
    let mut after = Vec::new();
    for node in &names {
        let found = wait_for(
            &format!("{node} reports what a grow can get"),
            Duration::from_secs(60),
            || async {
                estimate(&fleet.node_state(node).await).ok_or_else(|| "no estimate".to_string())
            },
        )
        .await;
        after.push(found.after_compaction);
    }
    // 4 GiB less the 1Gi guard and its 32Mi of headroom: about 1500 pages.
    assert!(
        after[0] > 3000 && (1400..1600).contains(&after[1]),
        "{after:?}"
    );

    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        file.path(),
        format!(
            "apiVersion: hugepool.dev/v1alpha1\nkind: HugePagePool\nmetadata:\n  name: {pool}\n  labels:\n    {SCOPE_LABEL}: {scope}\nspec: {}\n",
            pool_spec(3000)
        ),
    )
    .expect("write the pool file");
    let path = file.path().to_str().expect("path");
    let plan = plugin_json(&kubeconfig, &["plan", "-f", path]);
    let predicted = predicted_by_node(&plan);
    assert_eq!(predicted[&names[0]], json!(3000), "{plan}");
    assert_eq!(predicted[&names[1]], json!(16 + after[1]), "{plan}");
    let text = plugin(&kubeconfig, &["plan", "-f", path]);
    let short = 3000 - 16 - after[1];
    assert!(
        text.contains(&format!("{} (short {short})", 16 + after[1])),
        "{text}"
    );
    assert!(
        text.contains("1 node(s) predicted to come short")
            && text.contains(&format!("{} by {short}", names[1])),
        "{text}"
    );

    // Applied: the small node stops where the plan said (the estimate in
    // its status moves only by a tenth, so within that of what it got).
    fleet.patch_pool(&pool, pool_spec(3000)).await;
    let reached = wait_for(
        &format!("{} grows as far as it can", names[1]),
        Duration::from_secs(120),
        || async {
            let state = fleet.node_state(&names[1]).await;
            let status = state.status.as_ref().ok_or("no status")?;
            let failed = status
                .conditions
                .iter()
                .any(|c| c.type_ == "AllocationFailed" && c.status == "True");
            let total = status
                .page_sizes
                .iter()
                .find(|p| p.size == hugepool_crds::PageSize::SIZE_2MI)
                .map_or(0, |p| p.total);
            if failed {
                Ok(total)
            } else {
                Err(format!("at {total}, no AllocationFailed yet"))
            }
        },
    )
    .await;
    let planned = 16 + after[1];
    assert!(
        planned.abs_diff(reached) * 10 <= planned as u64,
        "planned {planned}, reached {reached}"
    );
    wait_for(
        &format!("{} reaches 3000", names[0]),
        Duration::from_secs(120),
        || async {
            let state = fleet.node_state(&names[0]).await;
            let total = state.status.as_ref().and_then(|s| {
                s.page_sizes
                    .iter()
                    .find(|p| p.size == hugepool_crds::PageSize::SIZE_2MI)
                    .map(|p| p.total)
            });
            if total == Some(3000) {
                Ok(())
            } else {
                Err(format!("at {total:?}"))
            }
        },
    )
    .await;
    fleet.shutdown().await;
}

/// Runs the plugin; its exit code and what it wrote to stdout and stderr.
fn plugin_run(kubeconfig: &Path, args: &[&str]) -> (i32, String) {
    let output = plugin_output(kubeconfig, args);
    (
        output.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

/// `kubectl hugepool wait` succeeds only when every selected node holds
/// the pages, and fails at once with the reason for a pool that selects no
/// node and for one whose rollout ended with a node that could not grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_succeeds_only_when_every_selected_node_holds_the_pages() {
    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    // The second node has 2 GiB (1 GiB of it the agent's guard): 128 MiB
    // of pages fit there, 2 GiB cannot.
    let spec = FleetSpec::new(2)
        .label(ROLE_LABEL, "dpdk")
        .node_memory(1, 2 << 30);
    let mut fleet = Fleet::start(&env, "waitcmd", spec).await;
    fleet.start_operator(None).await;
    let scope = fleet.scope.clone();
    let pool_of = |role: &str, pages: i64| {
        json!({
            "nodeSelector": {"matchLabels": {SCOPE_LABEL: scope, ROLE_LABEL: role}},
            "pageSize": "2Mi",
            "pages": pages,
            "rollout": {"maxUnavailable": 2},
        })
    };

    let fits = format!("{scope}-fits");
    fleet.create_pool(&fits, pool_of("dpdk", 64)).await;
    let (code, said) = plugin_run(&kubeconfig, &["wait", &fits, "--timeout", "120s"]);
    assert_eq!(code, 0, "{said}");
    for name in fleet.node_names() {
        assert_eq!(fleet.node(&name).pages_2mi().0, 64, "{name}: {said}");
    }

    // Nothing selected: not "complete", and said at once (long before the
    // 10 minutes it would wait).
    let lonely = format!("{scope}-lonely");
    fleet.create_pool(&lonely, pool_of("nothing", 8)).await;
    let started = std::time::Instant::now();
    let (code, said) = plugin_run(&kubeconfig, &["wait", &lonely, "--timeout", "10m"]);
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("NoMatchingNodes"), "{said}");
    assert!(
        started.elapsed() < Duration::from_secs(300),
        "{:?}",
        started.elapsed()
    );

    // One node cannot grow: the rollout ends incomplete, said at once.
    fleet.patch_pool(&fits, json!({"pages": 1024})).await;
    let (code, said) = plugin_run(&kubeconfig, &["wait", &fits, "--timeout", "10m"]);
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("RolloutIncomplete"), "{said}");
    assert!(said.contains("1 failed"), "{said}");
    fleet.shutdown().await;
}

/// What `plan -o json` predicts each node reaches, by node.
fn predicted_by_node(plan: &Value) -> BTreeMap<String, Value> {
    plan["waves"]
        .as_array()
        .expect("waves")
        .iter()
        .flat_map(|w| w.as_array().expect("a wave").iter())
        .map(|c| {
            (
                c["node"].as_str().unwrap_or_default().to_string(),
                c["predicted"].clone(),
            )
        })
        .collect()
}

/// Before any pool: the operator gives every node an agent runs on a
/// HugePageNode, its agent reports what a grow can get, and `plan` of the
/// first pool predicts each node (the 4 GiB one short by its guard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_pools_plan_is_predicted_from_every_agents_estimate() {
    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    let spec = FleetSpec::new(2).node_memory(1, 4 * support::GIB);
    let mut fleet = Fleet::start(&env, "firstplan", spec).await;
    let scope = fleet.scope.clone();
    let names = fleet.node_names();
    fleet.agent_nodes = Some(
        [(SCOPE_LABEL.to_string(), scope.clone())]
            .into_iter()
            .collect(),
    );
    fleet.start_operator(None).await;
    let mut after = Vec::new();
    for node in &names {
        let found = wait_for(
            &format!("{node} reports what a grow can get, with no pool"),
            Duration::from_secs(60),
            || async {
                let api: kube::Api<hugepool_crds::HugePageNode> =
                    kube::Api::all(fleet.client.clone());
                let state = api
                    .get_opt(node)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("no HugePageNode yet")?;
                assert!(state.spec.page_sizes.is_empty(), "{:?}", state.spec);
                state
                    .status
                    .as_ref()
                    .and_then(|s| {
                        s.page_sizes
                            .iter()
                            .find(|p| p.size == hugepool_crds::PageSize::SIZE_2MI)
                            .and_then(|p| p.obtainable)
                    })
                    .ok_or_else(|| "no estimate".to_string())
            },
        )
        .await;
        after.push(found.after_compaction);
    }
    let pool = format!("{scope}-first");
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        file.path(),
        format!(
            "apiVersion: hugepool.dev/v1alpha1\nkind: HugePagePool\nmetadata:\n  name: {pool}\n  labels:\n    {SCOPE_LABEL}: {scope}\nspec: {}\n",
            json!({
                "nodeSelector": {"matchLabels": {SCOPE_LABEL: scope}},
                "pageSize": "2Mi",
                "pages": 3000,
            })
        ),
    )
    .expect("write the pool file");
    let plan = plugin_json(
        &kubeconfig,
        &["plan", "-f", file.path().to_str().expect("path")],
    );
    let predicted = predicted_by_node(&plan);
    assert_eq!(predicted[&names[0]], json!(3000), "{plan}");
    assert_eq!(predicted[&names[1]], json!(after[1]), "{plan}");
    assert!(after[1] < 3000, "{after:?}");
    fleet.shutdown().await;
}

/// `why NODE` on a node whose pool is consumed through DRA: a pod holds
/// what its ResourceClaim's allocation there consumed (read from the API:
/// the claim's namespace is the pod's), beside a pod that requests
/// `hugepages-2Mi`; a pod with a claim of another node's pool holds nothing.
/// Then `why pod/NAME` for a Pending pod whose claim asks more than the
/// node's device has left after that allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn why_counts_what_a_pods_resource_claims_hold_on_a_dra_pool() {
    use hugepool_crds::node::{PageSizeStatus, PageSizeTarget};
    use hugepool_crds::settings::Consumption;
    use hugepool_crds::{HugePageNode, HugePageNodeSpec, HugePageNodeStatus, PageSize};
    use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
    use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};

    let Some(env) = setup().await else { return };
    let kubeconfig = env.control_plane.kubeconfig.clone();
    let client = env.client.clone();
    let name = hugepool_e2e::unique_name("claims");
    let node: Node =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {SCOPE_LABEL: name}}}))
            .expect("Node");
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("create the Node");
    let mut target = PageSizeTarget::new(PageSize::SIZE_2MI, 64);
    target.pool = format!("{name}-pool");
    target.consumption = Some(Consumption::DynamicResourceAllocation);
    let states: Api<HugePageNode> = Api::all(client.clone());
    states
        .create(
            &PostParams::default(),
            &HugePageNode::new(
                &name,
                HugePageNodeSpec {
                    page_sizes: vec![target],
                },
            ),
        )
        .await
        .expect("create the HugePageNode");
    let status = HugePageNodeStatus {
        page_sizes: vec![PageSizeStatus {
            target: Some(64),
            total: 64,
            free: 60,
            in_use: 4,
            claimed: Some(12),
            ..PageSizeStatus::empty(PageSize::SIZE_2MI)
        }],
        ..Default::default()
    };
    states
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .expect("write the HugePageNode's status");
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}})).expect("Namespace"),
        )
        .await
        .expect("create the namespace");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &name);
    let pod = |pod: &str, claim: Option<&str>, hugepages: Option<&str>| -> Pod {
        let mut resources = json!({});
        if let Some(amount) = hugepages {
            resources = json!({"requests": {"memory": "32Mi", "hugepages-2Mi": amount},
                               "limits": {"memory": "32Mi", "hugepages-2Mi": amount}});
        }
        let mut spec = json!({
            "nodeName": name,
            "automountServiceAccountToken": false,
            "containers": [{"name": "main", "image": "registry.example/app:1", "resources": resources}],
        });
        if let Some(claim) = claim {
            spec["resourceClaims"] = json!([{"name": "pages", "resourceClaimName": claim}]);
            spec["containers"][0]["resources"]["claims"] = json!([{"name": "pages"}]);
        }
        serde_json::from_value(json!({"metadata": {"name": pod}, "spec": spec})).expect("Pod")
    };
    let mut uids = BTreeMap::new();
    for pod in [
        pod("claimer", Some("claimer-pages"), None),
        pod("classic", None, Some("8Mi")),
        pod("elsewhere", Some("elsewhere-pages"), None),
    ] {
        let created = pods
            .create(&PostParams::default(), &pod)
            .await
            .expect("create a pod");
        uids.insert(
            created.metadata.name.clone().expect("name"),
            created.metadata.uid.clone().expect("uid"),
        );
    }
    let claimer = format!("{name}/claimer");
    let classic = format!("{name}/classic");
    let held = |why: &Value| -> Vec<(String, Value)> {
        why["pods"]
            .as_array()
            .expect("pods")
            .iter()
            .map(|p| {
                (
                    p["pod"].as_str().unwrap_or_default().to_string(),
                    p["pages"].clone(),
                )
            })
            .collect()
    };
    let (minor, _) = hugepool_e2e::server_minor(&client).await;
    if minor < hugepool_e2e::DRA_MINOR {
        // No resource.k8s.io/v1 to list claims from (a 404): why still
        // answers, with what the pods request.
        let why = plugin_json(&kubeconfig, &["why", &name]);
        assert_eq!(held(&why), [(classic.clone(), json!(4))], "{why}");
        let why = plugin_json(&kubeconfig, &["why", "pod/claimer", "-n", &name]);
        assert!(why["verdict"].is_string(), "{why}");
        delete_claims_test_objects(&client, &name).await;
        return;
    }
    // Each claim allocated (as the scheduler writes it) on `pool`'s device,
    // consuming 24Mi, and reserved for its pod.
    let claims: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &name,
        &hugepool_crds::dra::resource_claims(),
    );
    for (claim, pod, pool) in [
        ("claimer-pages", "claimer", name.as_str()),
        ("elsewhere-pages", "elsewhere", "another-node"),
    ] {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": claim},
            "spec": {"devices": {"requests": [{"name": "pages", "exactly": {
                "deviceClassName": "hugepages-2mi.hugepool.dev",
                "capacity": {"requests": {"memory": "24Mi"}},
            }}]}},
        }))
        .expect("ResourceClaim");
        claims
            .create(&PostParams::default(), &object)
            .await
            .expect("create a ResourceClaim");
        claims
            .patch_status(
                claim,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "allocation": {"devices": {"results": [{
                        "request": "pages",
                        "driver": hugepool_crds::dra::DRIVER,
                        "pool": pool,
                        "device": hugepool_crds::dra::device_name(PageSize::SIZE_2MI, 0),
                        "consumedCapacity": {"memory": "24Mi"},
                    }]}},
                    "reservedFor": [{"resource": "pods", "name": pod, "uid": uids[pod]}],
                }})),
            )
            .await
            .expect("allocate the ResourceClaim");
    }

    let why = plugin_json(&kubeconfig, &["why", &name]);
    assert_eq!(
        held(&why),
        [(claimer.clone(), json!(12)), (classic.clone(), json!(4))],
        "{why}"
    );
    let text = plugin(&kubeconfig, &["why", &name]);
    assert!(text.contains(&claimer), "{text}");

    // The node's slice (as its agent publishes it): 32 pages on NUMA node 0,
    // of which the claimer's allocation consumes 12.
    let slices: Api<DynamicObject> =
        Api::all_with(client.clone(), &hugepool_crds::dra::resource_slices());
    let slice: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": format!("{name}-hugepool")},
        "spec": {
            "driver": hugepool_crds::dra::DRIVER,
            "nodeName": name,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": [{
                "name": hugepool_crds::dra::device_name(PageSize::SIZE_2MI, 0),
                "allowMultipleAllocations": true,
                "capacity": {"memory": {"value": "64Mi", "requestPolicy": {
                    "default": "2Mi", "validRange": {"min": "2Mi", "step": "2Mi"},
                }}},
            }],
        },
    }))
    .expect("ResourceSlice");
    slices
        .create(&PostParams::default(), &slice)
        .await
        .expect("create the ResourceSlice");
    // A pod for this node only whose claim asks 21 pages: 20 are left.
    let waiting: Pod = serde_json::from_value(json!({
        "metadata": {"name": "waiting"},
        "spec": {
            "nodeSelector": {SCOPE_LABEL: name},
            "automountServiceAccountToken": false,
            "containers": [{"name": "main", "image": "registry.example/app:1",
                            "resources": {"claims": [{"name": "pages"}]}}],
            "resourceClaims": [{"name": "pages", "resourceClaimName": "waiting-pages"}],
        },
    }))
    .expect("Pod");
    pods.create(&PostParams::default(), &waiting)
        .await
        .expect("create the waiting pod");
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "waiting-pages"},
        "spec": {"devices": {"requests": [{"name": "pages", "exactly": {
            "deviceClassName": hugepool_crds::dra::device_class_name(PageSize::SIZE_2MI),
            "capacity": {"requests": {"memory": "42Mi"}},
        }}]}},
    }))
    .expect("ResourceClaim");
    claims
        .create(&PostParams::default(), &object)
        .await
        .expect("create the waiting pod's claim");
    let why = plugin_json(&kubeconfig, &["why", "pod/waiting", "-n", &name]);
    assert_eq!(why["claims"][0]["claim"], "waiting-pages", "{why}");
    assert_eq!(why["claims"][0]["pages"], 21, "{why}");
    let on_node: Vec<&Value> = why["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .filter(|d| d["node"] == name.as_str())
        .collect();
    assert_eq!(on_node.len(), 1, "{why}");
    assert_eq!(on_node[0]["capacity"], 32, "{why}");
    assert_eq!(on_node[0]["allocated"], 12, "{why}");
    assert_eq!(on_node[0]["blockedBy"], "20 pages free < 21", "{why}");
    assert_eq!(
        why["verdict"],
        format!(
            "claim waiting-pages asks 21 pages of 2Mi from one device, and no device has them free: the most is 20 on node {name} (hugepages-2mi-numa0); grow the pool there, or wait for claims to be released"
        ),
        "{why}"
    );
    let text = plugin(&kubeconfig, &["why", "pod/waiting", "-n", &name]);
    assert!(text.contains("20 pages free < 21"), "{text}");
    slices
        .delete(
            &format!("{name}-hugepool"),
            &kube::api::DeleteParams::default(),
        )
        .await
        .expect("delete the ResourceSlice");
    delete_claims_test_objects(&client, &name).await;
}

/// The namespace, HugePageNode and Node named `name`.
async fn delete_claims_test_objects(client: &kube::Client, name: &str) {
    use hugepool_crds::HugePageNode;
    use k8s_openapi::api::core::v1::{Namespace, Node};
    use kube::api::Api;

    let delete = kube::api::DeleteParams::default();
    Api::<Namespace>::all(client.clone())
        .delete(name, &delete)
        .await
        .expect("delete the namespace");
    Api::<HugePageNode>::all(client.clone())
        .delete(name, &delete)
        .await
        .expect("delete the HugePageNode");
    Api::<Node>::all(client.clone())
        .delete(name, &delete)
        .await
        .expect("delete the Node");
}
