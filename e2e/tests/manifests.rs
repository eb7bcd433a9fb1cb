//! The Helm chart and the plain manifests rendered from it (deploy/):
//! deploy/ is exactly what `make manifests` renders, `helm lint` passes,
//! the agent DaemonSet has exactly the privileges of docs/design.md
//! ("DaemonSet privileges"), the RBAC is the design's list, and the
//! manifests are accepted by a real kube-apiserver (server-side dry run).
//!
//! helm comes from `hack/helm.sh` (built once from the Go module proxy into
//! target/tools/). Without Go or the proxy the helm tests skip, except under
//! CI=true, where they fail.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hugepool_e2e::yaml_documents as documents;
use hugepool_e2e::{helm_template, kubectl_path, output_text, setup, unique_name};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

fn chart() -> PathBuf {
    repo().join("charts").join("hugepool")
}

/// The helm binary from hack/helm.sh, or `None` (after saying why) outside CI.
fn helm() -> Option<PathBuf> {
    hugepool_e2e::hack_tool_or_skip("helm.sh", &[])
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the manifests"))
}

fn committed_manifests() -> Vec<Value> {
    let path = repo().join("deploy").join("hugepool.yaml");
    documents(&std::fs::read_to_string(&path).expect("read deploy/hugepool.yaml"))
}

/// Files under `dir`, relative path -> contents.
fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                walk(base, &path, out);
            } else {
                let rel = path.strip_prefix(base).expect("under base");
                out.insert(
                    rel.to_string_lossy().into_owned(),
                    std::fs::read(&path).expect("read file"),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

#[test]
fn deploy_is_what_make_manifests_renders() {
    if helm().is_none() {
        return;
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(unique_name("manifests"));
    let _ = std::fs::remove_dir_all(&out);
    let output = Command::new("bash")
        .arg(repo().join("hack").join("manifests.sh"))
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .expect("run hack/manifests.sh");
    assert!(
        output.status.success(),
        "hack/manifests.sh failed: {}",
        output_text(&output)
    );
    let rendered = tree(&out);
    let committed = tree(&repo().join("deploy"));
    let _ = std::fs::remove_dir_all(&out);
    let drifted: BTreeSet<&str> = rendered
        .keys()
        .chain(committed.keys())
        .filter(|name| rendered.get(*name) != committed.get(*name))
        .map(String::as_str)
        .collect();
    assert!(
        drifted.is_empty(),
        "deploy/ is out of date with charts/hugepool: {drifted:?} differ. run `make manifests`."
    );
}

#[test]
fn helm_lint_passes() {
    let Some(helm) = helm() else { return };
    let everything_on = [
        "--set",
        "agent.kubeletRestart.enabled=true",
        "--set",
        "monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true,monitoring.kubeStateMetrics.enabled=true",
        "--set",
        "monitoring.kubeStateMetrics.rbac.serviceAccountName=kube-state-metrics",
        "--set",
        "monitoring.kubeStateMetrics.rbac.serviceAccountNamespace=monitoring",
        "--set",
        "namespace.create=true",
    ];
    for extra in [&[][..], &everything_on[..]] {
        let output = Command::new(&helm)
            .arg("lint")
            .arg("--strict")
            .arg(chart())
            .args(extra)
            .output()
            .expect("run helm lint");
        assert!(
            output.status.success(),
            "helm lint --strict {extra:?} failed: {}",
            output_text(&output)
        );
    }
    // The schema rejects what the templates would not understand.
    for bad in [
        "operator.replicas=0",
        "agent.logFormat=xml",
        "operator.nosuchkey=1",
        "operator.leaderElection.leaseDuration=15",
        "agent.kubeletRestart.capabilities={SYSLOG}",
    ] {
        let output = Command::new(&helm)
            .arg("lint")
            .arg(chart())
            .args(["--set", bad])
            .output()
            .expect("run helm lint");
        assert!(
            !output.status.success(),
            "helm lint accepted --set {bad}: {}",
            output_text(&output)
        );
    }
}

/// The agent container's securityContext and mounts, exactly the design's.
fn assert_agent_privileges(docs: &[Value], restart: bool) {
    let ds = find(docs, "DaemonSet", "hugepool-agent");
    let pod = &ds["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "one agent container");
    let agent = &containers[0];

    let mut expected = json!({
        "runAsUser": 0,
        "privileged": false,
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"drop": ["ALL"], "add": ["SYSLOG"]},
    });
    if restart {
        // nsenter into PID 1: setns(2) needs SYS_ADMIN (+ SYS_CHROOT for the
        // mount namespace), opening /proc/1/ns/* needs SYS_PTRACE and no
        // AppArmor confinement.
        expected["capabilities"]["add"] =
            json!(["SYSLOG", "SYS_ADMIN", "SYS_CHROOT", "SYS_PTRACE"]);
        expected["appArmorProfile"] = json!({"type": "Unconfined"});
    }
    assert_eq!(
        agent["securityContext"], expected,
        "agent securityContext (docs/design.md, DaemonSet privileges)"
    );
    let mut mounts = json!([
        {"name": "sys-hugepages", "mountPath": "/host/sys/kernel/mm/hugepages"},
        {"name": "sys-node", "mountPath": "/host/sys/devices/system/node"},
        {"name": "proc-sys-vm", "mountPath": "/host/proc/sys/vm"},
        {"name": "proc-meminfo", "mountPath": "/host/proc/meminfo", "readOnly": true},
        {"name": "proc-buddyinfo", "mountPath": "/host/proc/buddyinfo", "readOnly": true},
        {"name": "proc-pagetypeinfo", "mountPath": "/host/proc/pagetypeinfo", "readOnly": true},
        {"name": "sys-fs-cgroup", "mountPath": "/host/sys/fs/cgroup", "readOnly": true, "recursiveReadOnly": "IfPossible"},
        {"name": "run-hugepool", "mountPath": "/host/run/hugepool"},
    ]);
    let mut volumes = json!([
        {"name": "sys-hugepages", "hostPath": {"path": "/sys/kernel/mm/hugepages", "type": "Directory"}},
        {"name": "sys-node", "hostPath": {"path": "/sys/devices/system/node", "type": "Directory"}},
        {"name": "proc-sys-vm", "hostPath": {"path": "/proc/sys/vm", "type": "Directory"}},
        {"name": "proc-meminfo", "hostPath": {"path": "/proc/meminfo", "type": "File"}},
        {"name": "proc-buddyinfo", "hostPath": {"path": "/proc/buddyinfo", "type": "File"}},
        {"name": "proc-pagetypeinfo", "hostPath": {"path": "/proc/pagetypeinfo", "type": "File"}},
        {"name": "sys-fs-cgroup", "hostPath": {"path": "/sys/fs/cgroup", "type": "Directory"}},
        {"name": "run-hugepool", "hostPath": {"path": "/run/hugepool", "type": "DirectoryOrCreate"}},
    ]);
    if restart {
        // The Memory Manager's checkpoint, removed before a restart.
        mounts.as_array_mut().unwrap().push(json!({
            "name": "kubelet-root",
            "mountPath": "/host/var/lib/kubelet",
            // Pod volumes the kubelet mounts later are seen, not pinned.
            "mountPropagation": "HostToContainer",
        }));
        volumes.as_array_mut().unwrap().push(
            json!({"name": "kubelet-root", "hostPath": {"path": "/var/lib/kubelet", "type": "Directory"}}),
        );
    }
    assert_eq!(agent["volumeMounts"], mounts, "agent volumeMounts");
    assert_eq!(pod["volumes"], volumes, "agent hostPath volumes");
    let args: Vec<&str> = agent["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg"))
        .collect();
    assert_eq!(
        args[..5],
        [
            "run",
            "--sys-root=/host/sys",
            "--proc-root=/host/proc",
            "--writer-lock=/host/run/hugepool/agent.lock",
            "--model-file=/host/run/hugepool/cost-models.json"
        ]
    );
    assert_eq!(
        pod.get("hostPID").cloned(),
        restart.then_some(Value::Bool(true)),
        "hostPID only with kubeletRestart.enabled"
    );
    // Without restarts the agent is told it has no restart command, so its
    // status says it will not restart the kubelet (rather than a failed
    // nsenter); with them it keeps its default command.
    let restart_args: Vec<&str> = args
        .iter()
        .filter(|a| a.starts_with("--kubelet-restart-command"))
        .copied()
        .collect();
    let expected: &[&str] = if restart {
        &[]
    } else {
        &["--kubelet-restart-command="]
    };
    assert_eq!(restart_args, expected, "kubelet restart command");
    let root_dir: Vec<&str> = args
        .iter()
        .filter(|a| a.starts_with("--kubelet-root-dir"))
        .copied()
        .collect();
    let expected: &[&str] = if restart {
        &["--kubelet-root-dir=/host/var/lib/kubelet"]
    } else {
        &[]
    };
    assert_eq!(root_dir, expected, "kubelet root dir only with restarts");
    for host in ["hostNetwork", "hostIPC"] {
        assert!(pod.get(host).is_none(), "{host} is not needed");
    }
    assert!(
        agent["env"].as_array().expect("env").contains(
            &json!({"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
        ),
        "NODE_NAME from the downward API"
    );
    assert_eq!(agent["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(agent["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(
        pod["tolerations"]
            .as_array()
            .expect("tolerations")
            .contains(&json!({"operator": "Exists"})),
        "the agent tolerates every taint, so it runs on every node"
    );
}

#[test]
fn agent_daemonset_has_exactly_the_designed_privileges() {
    assert_agent_privileges(&committed_manifests(), false);
    if let Some(helm) = helm() {
        let docs = documents(&helm_template(
            &helm,
            &["--set", "agent.kubeletRestart.enabled=true"],
        ));
        assert_agent_privileges(&docs, true);
    }
}

/// Boot mode adds one writable hostPath (the boot file's directory) and
/// the flag that names the file; off by default (the committed manifests
/// have neither: `assert_agent_privileges` checks the whole list).
#[test]
fn the_boot_file_is_one_more_mount_only_when_enabled() {
    let Some(helm) = helm() else { return };
    let docs = documents(&helm_template(
        &helm,
        &[
            "--set",
            "agent.bootFile.enabled=true",
            "--set",
            "agent.bootFile.hostDir=/var/lib/hp",
        ],
    ));
    let pod = &find(&docs, "DaemonSet", "hugepool-agent")["spec"]["template"]["spec"];
    let agent = &pod["containers"][0];
    assert_eq!(
        agent["volumeMounts"].as_array().expect("mounts").last(),
        Some(&json!({"name": "boot-file", "mountPath": "/host/var/lib/hugepool"}))
    );
    assert_eq!(
        pod["volumes"].as_array().expect("volumes").last(),
        Some(
            &json!({"name": "boot-file", "hostPath": {"path": "/var/lib/hp", "type": "DirectoryOrCreate"}})
        )
    );
    assert!(
        agent["args"].as_array().expect("args").contains(&json!(
            "--boot-file=/host/var/lib/hugepool/boot-targets.json"
        )),
        "{}",
        agent["args"]
    );
}

#[test]
fn rbac_is_the_designs_list() {
    let docs = committed_manifests();
    let rule = |group: &str, resource: &str, verbs: &[&str]| json!({"apiGroups": [group], "resources": [resource], "verbs": verbs});
    // docs/design.md, "Operator decisions": RBAC.
    assert_eq!(
        find(&docs, "ClusterRole", "hugepool-operator")["rules"],
        json!([
            rule(
                "hugepool.dev",
                "hugepagepools",
                &["get", "list", "watch", "patch"]
            ),
            rule("hugepool.dev", "hugepagepools/status", &["patch"]),
            rule(
                "hugepool.dev",
                "hugepagenodes",
                &["get", "list", "watch", "create", "patch"]
            ),
            rule("hugepool.dev", "hugepagenodes/status", &["patch"]),
            rule("", "nodes", &["get", "list", "watch", "patch"]),
            rule("", "pods", &["get", "list", "watch"]),
            rule("", "pods/eviction", &["create"]),
            rule("events.k8s.io", "events", &["create", "patch"]),
        ])
    );
    let lease_role = find(&docs, "Role", "hugepool-operator-leader-election");
    assert_eq!(lease_role["metadata"]["namespace"], "hugepool-system");
    assert_eq!(
        lease_role["rules"],
        json!([rule(
            "coordination.k8s.io",
            "leases",
            &["get", "list", "watch", "create", "patch"]
        )])
    );
    assert_eq!(
        find(&docs, "ClusterRole", "hugepool-agent")["rules"],
        json!([
            rule("hugepool.dev", "hugepagenodes", &["get", "list", "watch"]),
            rule("hugepool.dev", "hugepagenodes/status", &["patch"]),
            rule("", "nodes", &["get", "list", "watch"]),
            rule("events.k8s.io", "events", &["create", "patch"]),
        ])
    );
    // With DRA the operator follows ResourceClaims, to hold what allocated
    // claims hold and to drain the pods whose claims hold a shrinking
    // pool's pages; without it, none.
    if let Some(helm) = helm() {
        let dra = documents(&helm_template(
            &helm,
            &["--set", "dra.enabled=true", "--kube-version", "1.36.0"],
        ));
        let mut rules = find(&docs, "ClusterRole", "hugepool-operator")["rules"].clone();
        rules.as_array_mut().expect("rules").push(rule(
            "resource.k8s.io",
            "resourceclaims",
            &["list", "watch"],
        ));
        assert_eq!(
            find(&dra, "ClusterRole", "hugepool-operator")["rules"],
            rules
        );
    }
    for (kind, name, account) in [
        (
            "ClusterRoleBinding",
            "hugepool-operator",
            "hugepool-operator",
        ),
        ("ClusterRoleBinding", "hugepool-agent", "hugepool-agent"),
        (
            "RoleBinding",
            "hugepool-operator-leader-election",
            "hugepool-operator",
        ),
    ] {
        assert_eq!(
            find(&docs, kind, name)["subjects"],
            json!([{"kind": "ServiceAccount", "name": account, "namespace": "hugepool-system"}]),
            "{kind} {name}"
        );
        find(&docs, "ServiceAccount", account);
    }
}

/// With DRA the node hooks write pod cgroups' hugetlb limits: of the host's
/// cgroups they mount only what holds the pod cgroups (v1: the hugetlb
/// hierarchy; v2: the kubelet's pods cgroup, and cgroup.controllers read
/// only), and the operator follows claims.
#[test]
fn with_dra_the_hooks_mount_only_the_pod_cgroups_and_the_operator_follows_claims() {
    let Some(helm) = helm() else { return };
    let render = |extra: &[&str]| {
        let mut args = vec!["--set", "dra.enabled=true", "--kube-version", "1.36.0"];
        args.extend_from_slice(extra);
        documents(&helm_template(&helm, &args))
    };
    let hooks_cgroups = |docs: &[Value]| -> Vec<(String, bool, String)> {
        let pod = &find(docs, "DaemonSet", "hugepool-agent")["spec"]["template"]["spec"];
        let volumes = pod["volumes"].as_array().expect("volumes");
        let hooks = pod["containers"]
            .as_array()
            .expect("containers")
            .iter()
            .find(|c| c["name"] == "hooks")
            .expect("the hooks container");
        hooks["volumeMounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .filter(|m| {
                m["mountPath"]
                    .as_str()
                    .unwrap_or_default()
                    .starts_with("/host/sys/fs/cgroup")
            })
            .map(|m| {
                let volume = volumes
                    .iter()
                    .find(|v| v["name"] == m["name"])
                    .expect("the mount's volume");
                (
                    m["mountPath"].as_str().unwrap_or_default().to_string(),
                    m["readOnly"] == true,
                    volume["hostPath"]["path"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )
            })
            .collect()
    };
    let mounted =
        |path: &str, read_only: bool, host: &str| (path.to_string(), read_only, host.to_string());
    let v2 = render(&[]);
    assert_eq!(
        hooks_cgroups(&v2),
        [
            mounted(
                "/host/sys/fs/cgroup/kubepods.slice",
                false,
                "/sys/fs/cgroup/kubepods.slice"
            ),
            mounted(
                "/host/sys/fs/cgroup/cgroup.controllers",
                true,
                "/sys/fs/cgroup/cgroup.controllers"
            ),
        ]
    );
    assert_eq!(
        hooks_cgroups(&render(&["--set", "dra.cgroup.kubepodsCgroup=kubepods"]))[0],
        mounted(
            "/host/sys/fs/cgroup/kubepods",
            false,
            "/sys/fs/cgroup/kubepods"
        )
    );
    assert_eq!(
        hooks_cgroups(&render(&["--set", "dra.cgroup.version=v1"])),
        [mounted(
            "/host/sys/fs/cgroup/hugetlb",
            false,
            "/sys/fs/cgroup/hugetlb"
        )]
    );
    let args = &find(&v2, "Deployment", "hugepool-operator")["spec"]["template"]["spec"]["containers"]
        [0]["args"];
    assert!(
        args.as_array()
            .expect("args")
            .iter()
            .any(|a| a == "--watch-claims"),
        "{args}"
    );
}

#[test]
fn operator_deployment_is_ha_and_locked_down() {
    let docs = committed_manifests();
    let deployment = find(&docs, "Deployment", "hugepool-operator");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    let operator = &pod["containers"][0];
    let args = operator["args"].as_array().expect("args");
    assert_eq!(args[0], "run");
    assert!(args.contains(&json!("--leader-elect")), "{args:?}");
    // Every node an agent runs on gets a HugePageNode before any pool:
    // the operator is told the agents' nodeSelector.
    let agents = find(&docs, "DaemonSet", "hugepool-agent");
    let selector = agents["spec"]["template"]["spec"]["nodeSelector"]
        .as_object()
        .expect("the agents' nodeSelector");
    let labels: Vec<String> = selector
        .iter()
        .map(|(key, value)| format!("{key}={}", value.as_str().expect("a label value")))
        .collect();
    assert!(
        args.contains(&json!(format!("--agent-node-labels={}", labels.join(",")))),
        "{args:?}"
    );
    let env = operator["env"].as_array().expect("env");
    for (name, field) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        assert!(
            env.contains(&json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}})),
            "{name} from the downward API"
        );
    }
    assert_eq!(operator["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(operator["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(operator["resources"]["requests"].is_object());
    let security = &operator["securityContext"];
    assert_eq!(security["runAsNonRoot"], true);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"], json!({"drop": ["ALL"]}));
    let service = find(&docs, "Service", "hugepool-operator-metrics");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "metrics");
    // The dashboard is on by default, and is real JSON.
    let dashboard = find(&docs, "ConfigMap", "hugepool-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value = serde_json::from_str(
        dashboard["data"]["hugepool.json"]
            .as_str()
            .expect("dashboard"),
    )
    .expect("dashboard JSON");
    assert!(json["panels"].as_array().expect("panels").len() >= 4);
    // Prometheus Operator objects are off by default (their CRDs may be absent).
    for kind in ["ServiceMonitor", "PodMonitor", "PrometheusRule"] {
        assert!(
            docs.iter().all(|d| d["kind"] != kind),
            "{kind} rendered by default"
        );
    }
}

/// Every optional part of the chart turned on.
const EVERYTHING_ON: &[&str] = hugepool_e2e::CHART_EVERYTHING_ON;

/// The uninstall hook is a pod like any other: a namespace with a
/// ResourceQuota refuses it without requests and limits, and then `helm
/// uninstall` fails at the hook.
#[test]
fn the_uninstall_hook_has_resources() {
    let Some(helm) = helm() else { return };
    let docs = documents(&helm_template(&helm, &[]));
    let job = find(&docs, "Job", "hugepool-operator-uninstall");
    assert_eq!(
        job["spec"]["template"]["spec"]["containers"][0]["resources"],
        json!({
            "requests": {"cpu": "50m", "memory": "64Mi", "ephemeral-storage": "16Mi"},
            "limits": {"memory": "256Mi"}
        })
    );
    let docs = documents(&helm_template(
        &helm,
        &[
            "--set",
            "operator.uninstallHook.resources.limits.memory=1Gi",
        ],
    ));
    let job = find(&docs, "Job", "hugepool-operator-uninstall");
    assert_eq!(
        job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"], "1Gi",
        "a value"
    );
}

/// Two crash-looping replicas are not Ready: counted by the PDB they would
/// block every drain of their nodes.
#[test]
fn the_operator_pdb_lets_unhealthy_replicas_go() {
    let docs = committed_manifests();
    let pdb = find(&docs, "PodDisruptionBudget", "hugepool-operator");
    assert_eq!(pdb["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
}

/// The operator alone removes hugepool.dev/not-ready, the agent guards the
/// node's memory: neither may be preempted by the pods they make room for.
#[test]
fn the_operator_and_the_agent_have_priority_classes() {
    let docs = committed_manifests();
    let pod = |kind, name| find(&docs, kind, name)["spec"]["template"]["spec"].clone();
    assert_eq!(
        pod("Deployment", "hugepool-operator")["priorityClassName"],
        "system-cluster-critical"
    );
    assert_eq!(
        pod("DaemonSet", "hugepool-agent")["priorityClassName"],
        "system-node-critical"
    );
    let Some(helm) = helm() else { return };
    let docs = documents(&helm_template(&helm, &[]));
    let job = find(&docs, "Job", "hugepool-operator-uninstall");
    assert_eq!(
        job["spec"]["template"]["spec"]["priorityClassName"], "system-cluster-critical",
        "the hook stands in for the operator"
    );
    let docs = documents(&helm_template(
        &helm,
        &["--set", "operator.priorityClassName="],
    ));
    let deployment = find(&docs, "Deployment", "hugepool-operator");
    assert!(
        deployment["spec"]["template"]["spec"]
            .get("priorityClassName")
            .is_none(),
        "empty: none"
    );
}

/// On platforms that admit critical pods outside kube-system only under a
/// quota scoped to their classes, `criticalPodsQuota.create` renders one
/// for exactly the classes the chart's pods use (docs/platforms.md); by
/// default there is none, and with no class to admit the chart refuses.
#[test]
fn the_critical_pods_quota_admits_the_charts_classes_only_when_asked() {
    let docs = committed_manifests();
    assert!(
        !docs.iter().any(|d| d["kind"] == "ResourceQuota"),
        "no quota by default"
    );
    let Some(helm) = helm() else { return };
    let classes = |extra: &[&str]| {
        let mut args = vec!["--set", "criticalPodsQuota.create=true"];
        args.extend_from_slice(extra);
        let docs = documents(&helm_template(&helm, &args));
        let quota = find(&docs, "ResourceQuota", "hugepool-critical-pods");
        assert_eq!(quota["metadata"]["namespace"], "hugepool-system");
        assert_eq!(quota["spec"]["hard"]["pods"], "1000");
        let expression = &quota["spec"]["scopeSelector"]["matchExpressions"][0];
        assert_eq!(
            (&expression["scopeName"], &expression["operator"]),
            (&json!("PriorityClass"), &json!("In"))
        );
        expression["values"].clone()
    };
    assert_eq!(
        classes(&[]),
        json!(["system-node-critical", "system-cluster-critical"])
    );
    assert_eq!(
        classes(&["--set", "operator.priorityClassName=system-node-critical"]),
        json!(["system-node-critical"])
    );
    assert_eq!(
        classes(&[
            "--set",
            "agent.priorityClassName=",
            "--set",
            "operator.priorityClassName=ours"
        ]),
        json!(["ours"])
    );
    let refused = Command::new(&helm)
        .current_dir(repo())
        .args([
            "template",
            "hugepool",
            "charts/hugepool",
            "--namespace",
            "hugepool-system",
        ])
        .args(["--set", "criticalPodsQuota.create=true"])
        .args([
            "--set",
            "agent.priorityClassName=",
            "--set",
            "operator.priorityClassName=",
        ])
        .output()
        .expect("run helm");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("there is no class to admit"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// Grafana would let a user edit a provisioned dashboard, and lose the
/// edit at the next sidecar sync.
#[test]
fn the_dashboard_is_read_only() {
    let file = repo().join("charts/hugepool/dashboards/hugepool.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("read the dashboard"))
            .expect("dashboard JSON");
    assert_eq!(dashboard["editable"], false);
    let docs = committed_manifests();
    let rendered: Value = serde_json::from_str(
        find(&docs, "ConfigMap", "hugepool-dashboard")["data"]["hugepool.json"]
            .as_str()
            .expect("dashboard"),
    )
    .expect("dashboard JSON");
    assert_eq!(rendered["editable"], false);
}

/// Lines of `text` that are blank but not empty, numbered from 1.
fn whitespace_only_lines(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.is_empty() && line.trim().is_empty())
        .map(|(at, _)| at + 1)
        .collect()
}

#[test]
fn no_rendered_manifest_has_a_whitespace_only_line() {
    assert_eq!(whitespace_only_lines("a:\n\n  b: 1\n  \n"), [4]);
    for (name, text) in tree(&repo().join("deploy")) {
        let text = String::from_utf8(text).expect("UTF-8");
        assert_eq!(
            whitespace_only_lines(&text),
            [0usize; 0],
            "deploy/{name}: lines of spaces only"
        );
    }
    let Some(helm) = helm() else { return };
    for values in [&[][..], EVERYTHING_ON] {
        let text = helm_template(&helm, values);
        assert_eq!(
            whitespace_only_lines(&text),
            [0usize; 0],
            "helm template {values:?}: lines of spaces only"
        );
    }
    // The API server env the blank line came from is still there when set.
    let docs = documents(&helm_template(&helm, EVERYTHING_ON));
    let env = &find(&docs, "Deployment", "hugepool-operator")["spec"]["template"]["spec"]["containers"]
        [0]["env"];
    assert!(
        env.as_array()
            .expect("env")
            .contains(&json!({"name": "KUBERNETES_SERVICE_HOST", "value": "10.88.0.1"})),
        "{env}"
    );
}

/// Runs kubectl with `stdin` as its input.
fn kubectl(kubeconfig: &Path, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(kubectl_path())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write kubectl stdin");
    child.wait_with_output().expect("kubectl output")
}

/// Server-side dry run of `yaml` (written for namespace hugepool-system) in a
/// namespace of its own, which is created for real (with the manifests' own
/// Namespace object, labels and all) and deleted afterwards.
fn dry_run_apply(kubeconfig: &Path, yaml: &str, what: &str) {
    let namespace = unique_name("hugepool-manifests");
    let yaml = yaml.replace("hugepool-system", &namespace);
    let docs = documents(&yaml);
    let ns = find(&docs, "Namespace", &namespace);
    let created = kubectl(
        kubeconfig,
        &["apply", "-f", "-"],
        &serde_json::to_string(ns).expect("namespace"),
    );
    assert!(
        created.status.success(),
        "creating {namespace}: {}",
        output_text(&created)
    );
    let applied = kubectl(
        kubeconfig,
        &["apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        &yaml,
    );
    let _ = kubectl(
        kubeconfig,
        &["delete", "namespace", &namespace, "--wait=false"],
        "",
    );
    let text = output_text(&applied);
    assert!(
        applied.status.success(),
        "{what}: kubectl apply --dry-run=server failed: {text}"
    );
    assert!(
        !String::from_utf8_lossy(&applied.stderr).contains("Warning"),
        "{what}: the API server warned: {text}"
    );
    for doc in &docs {
        let kind = doc["kind"].as_str().expect("kind").to_lowercase();
        let name = doc["metadata"]["name"].as_str().expect("name");
        assert!(
            text.contains(&format!("{name} ")),
            "{what}: {kind} {name} missing from kubectl's output: {text}"
        );
    }
}

#[tokio::test]
async fn deploy_is_accepted_by_a_real_apiserver() {
    let Some(env) = setup().await else { return };
    let kubeconfig = &env.control_plane.kubeconfig;
    let crds = kubectl(
        kubeconfig,
        &[
            "apply",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            &repo().join("deploy").join("crds").to_string_lossy(),
        ],
        "",
    );
    assert!(crds.status.success(), "deploy/crds: {}", output_text(&crds));
    let yaml = std::fs::read_to_string(repo().join("deploy").join("hugepool.yaml"))
        .expect("read deploy/hugepool.yaml");
    dry_run_apply(kubeconfig, &yaml, "deploy/hugepool.yaml");

    // The optional parts that need no Prometheus Operator CRDs.
    if let Some(helm) = helm() {
        let yaml = helm_template(
            &helm,
            &[
                "--set",
                "namespace.create=true,agent.kubeletRestart.enabled=true",
                "--set",
                "agent.kubeletRestart.command=systemctl restart kubelet",
                "--set",
                "monitoring.kubeStateMetrics.enabled=true",
                "--set",
                "monitoring.kubeStateMetrics.rbac.serviceAccountName=kube-state-metrics",
                "--set",
                "monitoring.kubeStateMetrics.rbac.serviceAccountNamespace=monitoring",
            ],
        );
        dry_run_apply(
            kubeconfig,
            &yaml,
            "chart with kubeletRestart and kube-state-metrics",
        );
        // DRA's DeviceClasses, RBAC and policy where the apiserver serves
        // consumable capacity (1.36+).
        let client = env.control_plane.client().await.expect("client");
        let (minor, kube_version) = hugepool_e2e::server_minor(&client).await;
        if minor >= hugepool_e2e::DRA_MINOR {
            let yaml = helm_template(
                &helm,
                &[
                    "--set",
                    "namespace.create=true,dra.enabled=true",
                    "--kube-version",
                    &kube_version,
                ],
            );
            assert!(yaml.contains("kind: DeviceClass"), "{yaml}");
            dry_run_apply(kubeconfig, &yaml, "chart with dra.enabled");
        }
    }
}

/// The CRD's OpenAPI schema under `path`, stepping into array items.
fn schema_at<'a>(mut schema: &'a Value, path: &[Value]) -> Option<&'a Value> {
    for segment in path {
        if schema["type"] == "array" {
            schema = &schema["items"];
        }
        schema = schema["properties"].get(segment.as_str()?)?;
    }
    Some(schema)
}

#[test]
fn kube_state_metrics_config_names_real_fields() {
    let Some(helm) = helm() else { return };
    let docs = documents(&helm_template(
        &helm,
        &["--set", "monitoring.kubeStateMetrics.enabled=true"],
    ));
    let config_map = find(&docs, "ConfigMap", "hugepool-kube-state-metrics");
    let config: Value = serde_saphyr::from_str(
        config_map["data"]["config.yaml"]
            .as_str()
            .expect("config.yaml"),
    )
    .expect("config.yaml is YAML");
    assert_eq!(config["kind"], "CustomResourceStateMetrics");
    let resources = config["spec"]["resources"].as_array().expect("resources");
    assert_eq!(resources.len(), 2);
    for resource in resources {
        let gvk = &resource["groupVersionKind"];
        let kind = gvk["kind"].as_str().expect("kind");
        let plural = format!("{}s", kind.to_lowercase());
        let crd_path = chart()
            .join("crds")
            .join(format!("hugepool.dev_{plural}.yaml"));
        let crd: Value =
            serde_saphyr::from_str(&std::fs::read_to_string(&crd_path).expect("read CRD"))
                .expect("CRD YAML");
        assert_eq!(crd["spec"]["group"], gvk["group"]);
        let version = crd["spec"]["versions"]
            .as_array()
            .expect("versions")
            .iter()
            .find(|v| v["name"] == gvk["version"])
            .unwrap_or_else(|| panic!("{kind}: no version {}", gvk["version"]));
        let root = &version["schema"]["openAPIV3Schema"];
        let metrics = resource["metrics"].as_array().expect("metrics");
        let mut has_conditions = false;
        for metric in metrics {
            let name = metric["name"].as_str().expect("metric name");
            assert_eq!(metric["each"]["type"], "Gauge", "{kind} {name}");
            let gauge = &metric["each"]["gauge"];
            let path = gauge["path"].as_array().expect("path");
            let base = schema_at(root, path)
                .unwrap_or_else(|| panic!("{kind} {name}: no field {path:?} in the CRD"));
            let item = if base["type"] == "array" {
                &base["items"]
            } else {
                base
            };
            let mut relative: Vec<&Vec<Value>> = gauge["labelsFromPath"]
                .as_object()
                .map(|labels| labels.values().filter_map(Value::as_array).collect())
                .unwrap_or_default();
            if let Some(value_from) = gauge["valueFrom"].as_array() {
                relative.push(value_from);
            }
            for sub in relative {
                assert!(
                    schema_at(item, sub).is_some(),
                    "{kind} {name}: no field {sub:?} under {path:?} in the CRD"
                );
            }
            has_conditions |= name == "status_condition";
        }
        assert!(has_conditions, "{kind}: the conditions are exposed");
    }
}

#[test]
fn helm_uninstall_runs_the_operators_uninstall_first_and_deploy_has_no_hooks() {
    // deploy/ is for kubectl: a hook there would run at once.
    for doc in committed_manifests() {
        assert!(
            doc["metadata"]["annotations"]["helm.sh/hook"].is_null(),
            "deploy/ has a hook: {} {}",
            doc["kind"],
            doc["metadata"]["name"]
        );
    }
    let Some(helm) = helm() else { return };
    let docs = documents(&helm_template(&helm, &[]));
    let job = find(&docs, "Job", "hugepool-operator-uninstall");
    assert_eq!(job["metadata"]["annotations"]["helm.sh/hook"], "pre-delete");
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "hugepool-operator");
    assert_eq!(pod["restartPolicy"], "Never");
    let container = &pod["containers"][0];
    assert_eq!(
        container["image"],
        find(&docs, "Deployment", "hugepool-operator")["spec"]["template"]["spec"]["containers"][0]
            ["image"]
    );
    assert_eq!(
        container["args"],
        json!([
            "uninstall",
            "--namespace=hugepool-system",
            "--deployment=hugepool-operator",
            "--timeout=2m",
            "--log-format=json"
        ])
    );
    assert!(
        pod["tolerations"]
            .as_array()
            .expect("tolerations")
            .contains(&json!({"key": "hugepool.dev/draining", "operator": "Exists", "effect": "NoSchedule"})),
        "the hook runs on a node being drained"
    );
    for (kind, name) in [
        ("Job", "hugepool-operator-uninstall"),
        ("Deployment", "hugepool-operator"),
    ] {
        let tolerations = &find(&docs, kind, name)["spec"]["template"]["spec"]["tolerations"];
        assert!(
            tolerations.as_array().expect("tolerations").contains(
                &json!({"key": "hugepool.dev/not-ready", "operator": "Exists", "effect": "NoSchedule"})
            ),
            "{kind} {name} runs on a node whose pools are not back (it removes that taint)"
        );
    }
    // Its pods are not the operator's: the operator Deployment's selector
    // must not match them, or the hook would wait for itself.
    let selector =
        &find(&docs, "Deployment", "hugepool-operator")["spec"]["selector"]["matchLabels"];
    let labels = &job["spec"]["template"]["metadata"]["labels"];
    assert!(
        selector
            .as_object()
            .expect("matchLabels")
            .iter()
            .any(|(k, v)| &labels[k] != v),
        "hook pod labels {labels} match the operator selector {selector}"
    );
    // Scaling is granted only during the hook, only for its own Deployment.
    let role = find(&docs, "Role", "hugepool-operator-uninstall");
    assert_eq!(
        role["metadata"]["annotations"]["helm.sh/hook"],
        "pre-delete"
    );
    assert_eq!(
        role["rules"],
        json!([
            {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["hugepool-operator"], "verbs": ["get"]},
            {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": ["hugepool-operator"], "verbs": ["patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        ])
    );
    let off = documents(&helm_template(
        &helm,
        &["--set", "operator.uninstallHook.enabled=false"],
    ));
    assert!(
        off.iter().all(|d| d["kind"] != "Job"),
        "no hook when disabled"
    );
}

#[test]
fn the_chart_refuses_two_writers() {
    let Some(helm) = helm() else { return };
    for (values, says) in [
        (
            "operator.leaderElection.enabled=false",
            "operator.replicas is 2 without operator.leaderElection.enabled",
        ),
        (
            "agent.updateStrategy.rollingUpdate.maxSurge=1",
            "maxSurge is 1: a surge runs two agents on one node",
        ),
        (
            "agent.updateStrategy.rollingUpdate.maxSurge=25%",
            "maxSurge is 25%",
        ),
    ] {
        let output = Command::new(&helm)
            .current_dir(repo())
            .args(["template", "hugepool", "charts/hugepool", "--set", values])
            .output()
            .expect("run helm template");
        let text = output_text(&output);
        assert!(!output.status.success(), "--set {values} rendered");
        assert!(text.contains(says), "--set {values}: {text}");
    }
    // What stays allowed: one replica without a Lease, no surge.
    helm_template(
        &helm,
        &[
            "--set",
            "operator.leaderElection.enabled=false,operator.replicas=1",
            "--set",
            "agent.updateStrategy.rollingUpdate.maxSurge=0",
        ],
    );
    // The agent is node-critical by default.
    let docs = committed_manifests();
    let agent = find(&docs, "DaemonSet", "hugepool-agent");
    assert_eq!(
        agent["spec"]["template"]["spec"]["priorityClassName"],
        "system-node-critical"
    );
}

/// Both pods' securityContexts are values (OpenShift's restricted SCC assigns
/// the uid itself), but the agent's privileges stay the design's.
#[test]
fn security_contexts_are_values_and_the_agents_privileges_are_not() {
    let Some(helm) = helm() else { return };
    let pod_of = |docs: &[Value], kind: &str, name: &str| {
        find(docs, kind, name)["spec"]["template"]["spec"].clone()
    };
    // The uninstall Job is a helm hook: rendered by helm, not in deploy/.
    let defaults = documents(&helm_template(&helm, &[]));
    for (kind, name) in [
        ("Deployment", "hugepool-operator"),
        ("Job", "hugepool-operator-uninstall"),
    ] {
        let pod = pod_of(&defaults, kind, name);
        assert_eq!(
            pod["securityContext"],
            json!({"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
                   "seccompProfile": {"type": "RuntimeDefault"}}),
            "{kind} {name}"
        );
    }
    let docs = documents(&helm_template(
        &helm,
        &[
            "--set",
            "operator.podSecurityContext.runAsUser=null,operator.podSecurityContext.runAsGroup=null",
            "--set",
            "operator.securityContext.seLinuxOptions.level=s0:c1",
            "--set",
            "agent.securityContext.seLinuxOptions.type=spc_t",
            "--set",
            "agent.podSecurityContext.fsGroup=7",
        ],
    ));
    for (kind, name) in [
        ("Deployment", "hugepool-operator"),
        ("Job", "hugepool-operator-uninstall"),
    ] {
        let pod = pod_of(&docs, kind, name);
        assert_eq!(
            pod["securityContext"],
            json!({"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}}),
            "{kind} {name}: no fixed uid"
        );
        let container = &pod["containers"][0]["securityContext"];
        assert_eq!(
            container["seLinuxOptions"]["level"], "s0:c1",
            "{kind} {name}"
        );
        assert_eq!(container["readOnlyRootFilesystem"], true, "{kind} {name}");
    }
    let mut agent_docs = docs.clone();
    let agent = agent_docs
        .iter_mut()
        .find(|d| d["kind"] == "DaemonSet")
        .expect("the agent DaemonSet");
    let pod = &mut agent["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["fsGroup"], 7);
    let security = pod["containers"][0]["securityContext"]
        .as_object_mut()
        .expect("agent securityContext");
    assert_eq!(
        security.remove("seLinuxOptions"),
        Some(json!({"type": "spc_t"}))
    );
    assert_agent_privileges(&agent_docs, false);
    for field in [
        "runAsUser=1000",
        "privileged=true",
        "allowPrivilegeEscalation=true",
        "readOnlyRootFilesystem=false",
        "capabilities.add[0]=SYS_ADMIN",
        "appArmorProfile.type=Unconfined",
    ] {
        let output = Command::new(&helm)
            .current_dir(repo())
            .args(["template", "hugepool", "charts/hugepool", "--set"])
            .arg(format!("agent.securityContext.{field}"))
            .output()
            .expect("run helm template");
        let text = output_text(&output);
        let key = field.split(['=', '.']).next().expect("a key");
        assert!(
            !output.status.success(),
            "agent.securityContext.{field} rendered"
        );
        assert!(
            text.contains(&format!("agent.securityContext.{key} is set")),
            "{field}: {text}"
        );
    }
}

/// The chart README's CRD upgrade command, run over CRDs created the way
/// Helm creates them, with a schema that lacks a field the new one has. The
/// CRDs are renamed into a group of their own so the shared control plane's
/// real ones stay as they are.
#[tokio::test]
async fn the_documented_crd_upgrade_replaces_helms_crds_and_keeps_the_pools() {
    let Some(env) = setup().await else { return };
    let kubeconfig = &env.control_plane.kubeconfig;
    let readme = std::fs::read_to_string(chart().join("README.md")).expect("chart README");
    let command: Vec<&str> = readme
        .lines()
        .find(|line| line.starts_with("kubectl apply --server-side"))
        .expect("the README documents the CRD upgrade")
        .split_whitespace()
        .collect();
    assert_eq!(
        command.last(),
        Some(&"charts/hugepool/crds/"),
        "{command:?}"
    );

    let group = format!("{}.hugepool.dev", unique_name("upgrade"));
    let dir = tempfile::tempdir().expect("temp dir");
    let mut old_pool_crd = Value::Null;
    for entry in std::fs::read_dir(chart().join("crds")).expect("chart crds") {
        let path = entry.expect("entry").path();
        let mut crd: Value =
            serde_saphyr::from_str(&std::fs::read_to_string(&path).expect("read CRD"))
                .expect("CRD YAML");
        let plural = crd["spec"]["names"]["plural"]
            .as_str()
            .expect("plural")
            .to_string();
        crd["metadata"]["name"] = json!(format!("{plural}.{group}"));
        crd["spec"]["group"] = json!(group);
        let names = crd["spec"]["names"].as_object_mut().expect("names");
        names.remove("shortNames");
        names.remove("categories");
        let file = dir.path().join(format!("{plural}.json"));
        std::fs::write(&file, crd.to_string()).expect("write CRD");
        if plural == "hugepagepools" {
            old_pool_crd = crd;
        }
    }
    // The previous release: no spec.rollout.paused.
    let rollout = &mut old_pool_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        ["spec"]["properties"]["rollout"];
    rollout["properties"]
        .as_object_mut()
        .expect("rollout")
        .remove("paused");
    rollout["default"]
        .as_object_mut()
        .expect("default")
        .remove("paused");
    let created = kubectl(
        kubeconfig,
        &["create", "-f", "-"],
        &old_pool_crd.to_string(),
    );
    assert!(created.status.success(), "{}", output_text(&created));
    let crd_name = old_pool_crd["metadata"]["name"]
        .as_str()
        .expect("name")
        .to_string();
    let established = kubectl(
        kubeconfig,
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd",
            &crd_name,
        ],
        "",
    );
    assert!(
        established.status.success(),
        "{}",
        output_text(&established)
    );

    let resource = format!("hugepagepools.{group}");
    let pool = |name: &str| {
        json!({
            "apiVersion": format!("{group}/v1alpha1"), "kind": "HugePagePool",
            "metadata": {"name": name},
            "spec": {"pageSize": "2Mi", "pages": 8, "rollout": {"paused": true}},
        })
        .to_string()
    };
    let paused_of = |name: &str| {
        let output = kubectl(
            kubeconfig,
            &[
                "get",
                &resource,
                name,
                "-o",
                "jsonpath={.spec.rollout.paused}",
            ],
            "",
        );
        assert!(output.status.success(), "{}", output_text(&output));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let refused = kubectl(kubeconfig, &["apply", "-f", "-"], &pool("before"));
    assert!(
        !refused.status.success()
            && output_text(&refused).contains("unknown field \"spec.rollout.paused\""),
        "the old schema has no rollout.paused: {}",
        output_text(&refused)
    );
    let mut unpaused: Value = serde_json::from_str(&pool("before")).expect("pool JSON");
    unpaused["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("rollout");
    let applied = kubectl(kubeconfig, &["apply", "-f", "-"], &unpaused.to_string());
    assert!(applied.status.success(), "{}", output_text(&applied));

    let mut args: Vec<String> = command[1..command.len() - 1]
        .iter()
        .map(|arg| arg.to_string())
        .collect();
    args.push(dir.path().to_string_lossy().into_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let upgraded = kubectl(kubeconfig, &args, "");
    assert!(upgraded.status.success(), "{}", output_text(&upgraded));

    // The CRD's schema is the chart's: the field is kept now, and nothing was lost.
    let applied = kubectl(kubeconfig, &["apply", "-f", "-"], &pool("after"));
    assert!(applied.status.success(), "{}", output_text(&applied));
    assert_eq!(paused_of("after"), "true");
    assert_eq!(
        paused_of("before"),
        "false",
        "the old pool survives, defaulted"
    );
    // Compared as typed CRDs: JSON reads `maximum: 1023.0` as a float, the server returns 1023.
    let served = kubectl(kubeconfig, &["get", "crd", &crd_name, "-o", "json"], "");
    let served: CustomResourceDefinition =
        serde_json::from_slice(&served.stdout).expect("CRD JSON");
    let chart_pool: CustomResourceDefinition = serde_saphyr::from_str(
        &std::fs::read_to_string(chart().join("crds/hugepool.dev_hugepagepools.yaml"))
            .expect("read CRD"),
    )
    .expect("CRD YAML");
    assert_eq!(
        serde_json::to_value(&served.spec.versions[0].schema).expect("schema"),
        serde_json::to_value(&chart_pool.spec.versions[0].schema).expect("schema"),
        "the served schema is the chart's"
    );
    for name in [crd_name, format!("hugepagenodes.{group}")] {
        let _ = kubectl(kubeconfig, &["delete", "crd", &name, "--wait=false"], "");
    }
}

/// A client that authenticates with `token` only (no client certificate).
async fn token_client(kubeconfig: &Path, token: &str) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("config");
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.to_string().into()),
        ..Default::default()
    };
    kube::Client::try_from(config).expect("client")
}

/// The chart's policy on a real apiserver with real pod-bound tokens: the
/// agent on node A may write HugePageNode A's status and nothing else.
#[tokio::test]
async fn an_agent_writes_only_its_own_nodes_status() {
    use hugepool_crds::{HugePageNode, node::HugePageNodeSpec};
    use k8s_openapi::api::authentication::v1::{
        BoundObjectReference, TokenRequest, TokenRequestSpec,
    };
    use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
    use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

    let Some(env) = setup().await else { return };
    let Some(helm) = helm() else { return };
    let client = env.control_plane.client().await.expect("client");
    let kubeconfig = &env.control_plane.kubeconfig;
    let namespace = unique_name("vap");
    let release = unique_name("own");
    // With DRA where the apiserver has consumable capacity (1.36+): the
    // agent's ResourceSlice policy and RBAC too.
    let (minor, kube_version) = hugepool_e2e::server_minor(&client).await;
    let dra = minor >= hugepool_e2e::DRA_MINOR;
    let rendered = Command::new(&helm)
        .current_dir(repo())
        .args([
            "template",
            &release,
            "charts/hugepool",
            "--namespace",
            &namespace,
            "--kube-version",
            &kube_version,
            "--set",
            &format!("dra.enabled={dra}"),
        ])
        .args(["--show-only", "templates/agent-policy.yaml"])
        .args(["--show-only", "templates/rbac-agent.yaml"])
        .args(["--show-only", "templates/serviceaccounts.yaml"])
        .output()
        .expect("helm template");
    assert!(rendered.status.success(), "{}", output_text(&rendered));
    let yaml = String::from_utf8(rendered.stdout).expect("utf-8");
    let created = kubectl(kubeconfig, &["create", "namespace", &namespace], "");
    assert!(created.status.success(), "{}", output_text(&created));
    let applied = kubectl(kubeconfig, &["apply", "-f", "-"], &yaml);
    assert!(applied.status.success(), "{}", output_text(&applied));
    let account = format!("{release}-hugepool-agent");

    // Two nodes, an agent pod bound to each (no kubelet runs them: the
    // token only needs the pod and its node), and their HugePageNodes.
    let nodes: Api<Node> = Api::all(client.clone());
    let hpns: Api<HugePageNode> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &namespace);
    let names = [unique_name("node-a"), unique_name("node-b")];
    let mut tokens = Vec::new();
    for name in &names {
        let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("Node");
        hpns.create(
            &PostParams::default(),
            &HugePageNode::new(name, HugePageNodeSpec::default()),
        )
        .await
        .expect("HugePageNode");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("agent-{name}")},
            "spec": {"nodeName": name, "serviceAccountName": account,
                     "containers": [{"name": "agent", "image": "hugepool-agent"}]},
        }))
        .unwrap();
        let pod = pods
            .create(&PostParams::default(), &pod)
            .await
            .expect("Pod");
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod.metadata.name.clone(),
                    uid: pod.metadata.uid.clone(),
                }),
                expiration_seconds: Some(600),
            },
            ..Default::default()
        };
        let issued: TokenRequest = accounts
            .create_subresource("token", &account, &PostParams::default(), &request)
            .await
            .expect("TokenRequest");
        tokens.push(issued.status.expect("token").token);
    }
    let (a, b) = (&names[0], &names[1]);
    let agent_a = token_client(kubeconfig, &tokens[0]).await;
    let as_a: Api<HugePageNode> = Api::all(agent_a.clone());
    let write_status = |api: Api<HugePageNode>, name: String| async move {
        let body = json!({
            "apiVersion": "hugepool.dev/v1alpha1", "kind": "HugePageNode",
            "status": {"observedGeneration": 1},
        });
        api.patch_status(
            &name,
            &PatchParams::apply(hugepool_crds::AGENT_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    // A policy takes effect a moment after it is created: wait until A's
    // write of B is refused by it, then check everything else.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let refused = loop {
        match write_status(as_a.clone(), b.clone()).await {
            Err(message) if message.contains("may write only HugePageNode") => break message,
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "A's write of B's status was never refused by the policy: {other:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
    };
    assert!(
        refused.contains(&format!(
            "the hugepool agent on node {a} may write only HugePageNode {a}, not {b}"
        )),
        "{refused}"
    );
    write_status(as_a.clone(), a.clone())
        .await
        .expect("A writes its own status");
    assert_eq!(
        hpns.get(a)
            .await
            .unwrap()
            .status
            .unwrap()
            .observed_generation,
        Some(1)
    );
    // B's own token works for B.
    let as_b: Api<HugePageNode> = Api::all(token_client(kubeconfig, &tokens[1]).await);
    write_status(as_b, b.clone())
        .await
        .expect("B writes its own status");
    // Not the spec, not even its own (RBAC has no such verb; the policy
    // would refuse it too).
    let spec = as_a
        .patch(
            a,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"pageSizes": []}})),
        )
        .await;
    assert!(spec.is_err(), "A patched its own spec");
    // A token of the account bound to no pod carries no node: refused.
    let unbound: TokenRequest = accounts
        .create_subresource(
            "token",
            &account,
            &PostParams::default(),
            &TokenRequest {
                spec: TokenRequestSpec {
                    audiences: vec![],
                    expiration_seconds: Some(600),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .expect("TokenRequest");
    let loose: Api<HugePageNode> =
        Api::all(token_client(kubeconfig, &unbound.status.unwrap().token).await);
    let refused = write_status(loose, a.clone()).await.unwrap_err();
    assert!(
        refused.contains("needs a token bound to a pod on a node"),
        "{refused}"
    );

    if dra {
        own_resource_slices_only(&client, &agent_a, a, b).await;
    }

    for name in &names {
        let _ = hpns.delete(name, &DeleteParams::default()).await;
        let _ = nodes.delete(name, &DeleteParams::default()).await;
    }
    let deleted = kubectl(kubeconfig, &["delete", "-f", "-", "--wait=false"], &yaml);
    assert!(deleted.status.success(), "{}", output_text(&deleted));
    let _ = kubectl(
        kubeconfig,
        &["delete", "namespace", &namespace, "--wait=false"],
        "",
    );
}

/// With `dra.enabled`, the agent on node `a` (`agent_a`'s token) writes its
/// own node's ResourceSlice, and neither writes nor deletes `b`'s.
async fn own_resource_slices_only(admin: &kube::Client, agent_a: &kube::Client, a: &str, b: &str) {
    use kube::api::{
        Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams,
    };
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceSlice"),
        "resourceslices",
    );
    let slice = |node: &str| {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": format!("{node}-hugepool")},
            "spec": {"driver": "hugepages.hugepool.dev", "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": []},
        })
    };
    let apply = |api: Api<DynamicObject>, node: String, body: serde_json::Value| async move {
        api.patch(
            &format!("{node}-hugepool"),
            &PatchParams::apply(hugepool_crds::AGENT_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    let as_a: Api<DynamicObject> = Api::all_with(agent_a.clone(), &resource);
    let as_admin: Api<DynamicObject> = Api::all_with(admin.clone(), &resource);
    // The policy was created with the others: wait until it refuses.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let refused = loop {
        match apply(as_a.clone(), b.to_string(), slice(b)).await {
            Err(message) if message.contains("may write only ResourceSlice") => break message,
            other => {
                let _ = as_admin
                    .delete(&format!("{b}-hugepool"), &DeleteParams::default())
                    .await;
                assert!(
                    std::time::Instant::now() < deadline,
                    "A's write of B's ResourceSlice was never refused by the policy: {other:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
    };
    assert!(
        refused.contains(&format!(
            "the hugepool agent on node {a} may write only ResourceSlice {a}-hugepool"
        )),
        "{refused}"
    );
    // Its own node's name on a slice for another node is refused too.
    let mut disguised = slice(b);
    disguised["metadata"]["name"] = json!(format!("{a}-hugepool"));
    let refused = apply(as_a.clone(), a.to_string(), disguised)
        .await
        .unwrap_err();
    assert!(
        refused.contains("may write only ResourceSlice"),
        "{refused}"
    );
    apply(as_a.clone(), a.to_string(), slice(a))
        .await
        .expect("A writes its own node's slice");
    as_admin
        .create(
            &Default::default(),
            &serde_json::from_value(slice(b)).unwrap(),
        )
        .await
        .expect("B's slice");
    let refused = as_a
        .delete(&format!("{b}-hugepool"), &DeleteParams::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("may write only ResourceSlice"),
        "{refused}"
    );
    as_a.delete(&format!("{a}-hugepool"), &DeleteParams::default())
        .await
        .expect("A deletes its own node's slice");
    let _ = as_admin
        .delete(&format!("{b}-hugepool"), &DeleteParams::default())
        .await;
}

/// The chart's operator policies on a real apiserver with a real token of
/// the operator's ServiceAccount: on a Node it may add and remove its own
/// `hugepool.dev/draining:NoSchedule` taint and nothing else; it writes
/// Events only as hugepool-operator about pools and Nodes.
#[tokio::test]
async fn the_operator_may_only_set_its_taint_and_report_its_own_events() {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::{Node, ServiceAccount};
    use k8s_openapi::api::events::v1::Event;
    use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

    let Some(env) = setup().await else { return };
    let Some(helm) = helm() else { return };
    let client = env.control_plane.client().await.expect("client");
    let kubeconfig = &env.control_plane.kubeconfig;
    let namespace = unique_name("opvap");
    let release = unique_name("op");
    let rendered = Command::new(&helm)
        .current_dir(repo())
        .args([
            "template",
            &release,
            "charts/hugepool",
            "--namespace",
            &namespace,
        ])
        .args(["--show-only", "templates/operator-policy.yaml"])
        .args(["--show-only", "templates/rbac-operator.yaml"])
        .args(["--show-only", "templates/serviceaccounts.yaml"])
        .output()
        .expect("helm template");
    assert!(rendered.status.success(), "{}", output_text(&rendered));
    let yaml = String::from_utf8(rendered.stdout).expect("utf-8");
    let created = kubectl(kubeconfig, &["create", "namespace", &namespace], "");
    assert!(created.status.success(), "{}", output_text(&created));
    let applied = kubectl(kubeconfig, &["apply", "-f", "-"], &yaml);
    assert!(applied.status.success(), "{}", output_text(&applied));

    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &namespace);
    let issued: TokenRequest = accounts
        .create_subresource(
            "token",
            &format!("{release}-hugepool-operator"),
            &PostParams::default(),
            &TokenRequest {
                spec: TokenRequestSpec {
                    audiences: vec![],
                    expiration_seconds: Some(600),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .expect("TokenRequest");
    let operator = token_client(kubeconfig, &issued.status.expect("token").token).await;

    let nodes: Api<Node> = Api::all(client.clone());
    let name = unique_name("tainted");
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"zone": "a"}},
        "spec": {"taints": [{"key": "example.com/gpu", "effect": "NoSchedule"}]},
    }))
    .unwrap();
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("Node");
    let as_operator: Api<Node> = Api::all(operator.clone());
    let patch = |body: Value| {
        let api = as_operator.clone();
        let name = name.clone();
        async move {
            api.patch(&name, &PatchParams::default(), &Patch::Merge(body))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    };
    // The node lifecycle controller adds taints of its own to a Node no
    // kubelet runs: each patch starts from the Node as it is now, as the
    // operator's does (controller::taint_patch).
    let current = || async {
        let node = nodes.get(&name).await.expect("Node");
        let taints: Vec<Value> = node
            .spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .into_iter()
            .map(|t| serde_json::to_value(t).unwrap())
            .collect();
        (node.metadata.resource_version.unwrap_or_default(), taints)
    };
    let with = |mut taints: Vec<Value>, extra: Vec<Value>, version: String| {
        taints.retain(|t| {
            t["key"] != "hugepool.dev/draining" && t["key"] != "hugepool.dev/not-ready"
        });
        taints.extend(extra);
        json!({"metadata": {"resourceVersion": version}, "spec": {"taints": taints}})
    };
    let draining = json!({"key": "hugepool.dev/draining", "effect": "NoSchedule"});

    // A policy takes effect a moment after it is created: wait until a
    // label change is refused by it (a new value each time: a patch that
    // changes nothing passes).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut attempt = 0;
    let refused = loop {
        attempt += 1;
        match patch(json!({"metadata": {"labels": {"zone": format!("b{attempt}")}}})).await {
            Err(message) if message.contains("may not change a Node's labels") => break message,
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the operator's label change was never refused: {other:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
    };
    assert!(refused.contains("denied request"), "{refused}");
    let keys = |taints: &[Value]| -> Vec<String> {
        taints
            .iter()
            .map(|t| {
                format!(
                    "{}:{}",
                    t["key"].as_str().unwrap(),
                    t["effect"].as_str().unwrap()
                )
            })
            .collect()
    };
    // What the operator does: its taint on, then off, other taints kept.
    // (A concurrent change by the node controller makes a patch conflict:
    // retried from the fresh Node, as the operator does.)
    let retried = |extra: Vec<Value>| {
        let patch = &patch;
        let current = &current;
        let with = &with;
        async move {
            loop {
                let (version, taints) = current().await;
                match patch(with(taints, extra.clone(), version)).await {
                    Err(message) if message.contains("the object has been modified") => continue,
                    other => return other,
                }
            }
        }
    };
    let not_ready = json!({"key": "hugepool.dev/not-ready", "effect": "NoSchedule"});
    retried(vec![draining.clone(), not_ready])
        .await
        .expect("the operator adds its taints");
    let (_, taints) = current().await;
    let listed = keys(&taints);
    assert!(
        listed.contains(&"example.com/gpu:NoSchedule".to_string()),
        "{listed:?}"
    );
    assert!(
        listed.contains(&"hugepool.dev/draining:NoSchedule".to_string())
            && listed.contains(&"hugepool.dev/not-ready:NoSchedule".to_string()),
        "{listed:?}"
    );
    retried(vec![])
        .await
        .expect("the operator removes its taints");
    // Anything else is refused, each with the policy's message.
    let only_its_taint = "only its own hugepool.dev/draining:NoSchedule and hugepool.dev/not-ready:NoSchedule taints";
    let (_, before) = current().await;
    let without_gpu: Vec<Value> = before
        .iter()
        .filter(|t| t["key"] != "example.com/gpu")
        .cloned()
        .collect();
    let gpu_no_execute: Vec<Value> = before
        .iter()
        .map(|t| {
            let mut t = t.clone();
            if t["key"] == "example.com/gpu" {
                t["effect"] = json!("NoExecute");
            }
            t
        })
        .collect();
    let refusals = [
        (
            with(
                before.clone(),
                vec![json!({"key": "hugepool.dev/draining", "effect": "NoExecute"})],
                String::new(),
            ),
            only_its_taint,
        ),
        (
            with(
                before.clone(),
                vec![json!({"key": "hugepool.dev/not-ready", "effect": "NoExecute"})],
                String::new(),
            ),
            only_its_taint,
        ),
        (with(without_gpu, vec![], String::new()), only_its_taint),
        (with(gpu_no_execute, vec![], String::new()), only_its_taint),
        (
            json!({"metadata": {"annotations": {"a": "b"}}}),
            "may not change a Node's labels, annotations",
        ),
        (
            json!({"spec": {"unschedulable": true}}),
            "may not cordon a Node",
        ),
    ];
    for (mut body, message) in refusals {
        if body["metadata"]["resourceVersion"] == "" {
            body["metadata"]
                .as_object_mut()
                .unwrap()
                .remove("resourceVersion");
        }
        let refused = patch(body.clone()).await.expect_err(&body.to_string());
        assert!(refused.contains(message), "{body}: {refused}");
    }
    let (_, after) = current().await;
    assert!(
        keys(&after).contains(&"example.com/gpu:NoSchedule".to_string())
            && !keys(&after).iter().any(|k| k.starts_with("hugepool.dev/")),
        "{after:?}"
    );
    let deleted = as_operator.delete(&name, &DeleteParams::default()).await;
    assert!(deleted.is_err(), "the operator deleted a Node");

    // Events: about a Node, as hugepool-operator, in default: accepted.
    let events: Api<Event> = Api::namespaced(operator.clone(), "default");
    let event = |controller: &str, kind: &str, name: &str| -> Event {
        serde_json::from_value(json!({
            "metadata": {"generateName": "hugepool-test-"},
            "eventTime": "2026-12-02T00:00:00.000000Z",
            "reportingController": controller,
            "reportingInstance": "test",
            "action": "Drain",
            "reason": "DrainStarted",
            "type": "Normal",
            "note": "test",
            "regarding": {"apiVersion": "v1", "kind": kind, "name": name},
        }))
        .unwrap()
    };
    events
        .create(
            &PostParams::default(),
            &event("hugepool-operator", "Node", &name),
        )
        .await
        .expect("the operator's Event about a Node");
    // The Events policy is a policy of its own, loaded on its own time:
    // wait until it refuses, as for the Node policy above.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match events
            .create(&PostParams::default(), &event("kubelet", "Node", &name))
            .await
        {
            Err(e) if e.to_string().contains("writes Events only as") => break,
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the operator's Event as kubelet was never refused: {other:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
    }
    for (controller, kind) in [("kubelet", "Node"), ("hugepool-operator", "Secret")] {
        let refused = events
            .create(&PostParams::default(), &event(controller, kind, &name))
            .await
            .expect_err(kind)
            .to_string();
        assert!(
            refused.contains("writes Events only as hugepool-operator"),
            "{controller} {kind}: {refused}"
        );
    }
    // (The apiserver itself keeps a cluster-scoped object's Events in
    // default; one that names a namespace for it is the policy's to refuse.)
    let elsewhere: Api<Event> = Api::namespaced(operator, &namespace);
    let mut outside = event("hugepool-operator", "Node", &name);
    outside.regarding.as_mut().unwrap().namespace = Some(namespace.clone());
    let refused = elsewhere
        .create(&PostParams::default(), &outside)
        .await
        .expect_err("an Event outside default")
        .to_string();
    assert!(refused.contains("in default"), "{refused}");

    let _ = nodes.delete(&name, &DeleteParams::default()).await;
    let deleted = kubectl(kubeconfig, &["delete", "-f", "-", "--wait=false"], &yaml);
    assert!(deleted.status.success(), "{}", output_text(&deleted));
    let _ = kubectl(
        kubeconfig,
        &["delete", "namespace", &namespace, "--wait=false"],
        "",
    );
}

/// Every GitHub Actions workflow names each action by the commit SHA (a
/// tag can be moved to other code) and its job containers by digest, and
/// the release builds with the Rust rust-toolchain.toml pins, installed by
/// a rustup-init checked against its sha256, not whatever `sh.rustup.rs`
/// serves that day.
#[test]
fn workflows_pin_actions_by_sha_containers_by_digest_and_rust_by_the_toolchain_file() {
    let dir = repo().join(".github/workflows");
    let mut workflows = 0;
    for entry in std::fs::read_dir(&dir).expect("the workflows") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("a workflow");
        workflows += 1;
        for line in text.lines().map(str::trim) {
            let line = line.strip_prefix("- ").unwrap_or(line);
            if let Some(action) = line.strip_prefix("uses:") {
                let action = action.split('#').next().unwrap_or_default().trim();
                let pinned = action.split_once('@').is_some_and(|(_, rev)| {
                    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit())
                });
                assert!(
                    pinned || action.starts_with("./"),
                    "{}: `{action}` is not pinned by a commit SHA (write owner/repo@<sha> # vX.Y.Z)",
                    path.display()
                );
            }
            if let Some(image) = line
                .strip_prefix("container:")
                .or_else(|| line.strip_prefix("image:"))
            {
                let image = image.trim();
                assert!(
                    image.contains("@sha256:"),
                    "{}: container `{image}` is not pinned by digest",
                    path.display()
                );
            }
        }
        assert!(
            !text.contains("sh.rustup.rs"),
            "{}: Rust from whatever sh.rustup.rs serves",
            path.display()
        );
    }
    assert!(workflows > 0, "no workflow in {}", dir.display());
    let release = std::fs::read_to_string(dir.join("release.yml")).expect("release.yml");
    assert!(
        release.contains("rust-toolchain.toml") && release.contains("sha256sum -c"),
        "the release installs rust-toolchain.toml's Rust with a checked rustup-init"
    );
    // Gated: the release job needs the checks job, which runs the tests.
    // A job's lines: from `  NAME:` to the next line indented by two.
    let job = |name: &str| -> String {
        let head = format!("  {name}:");
        let lines: Vec<&str> = release.lines().skip_while(|l| *l != head).collect();
        assert!(!lines.is_empty(), "no job {name} in release.yml");
        lines[1..]
            .iter()
            .take_while(|l| !l.starts_with("  ") || l.starts_with("   "))
            .copied()
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        job("release").contains("needs: checks"),
        "{}",
        job("release")
    );
    assert!(
        job("checks").contains("make test-hosted"),
        "{}",
        job("checks")
    );
    let toolchain =
        std::fs::read_to_string(repo().join("rust-toolchain.toml")).expect("rust-toolchain.toml");
    assert!(
        toolchain.lines().any(|l| {
            l.strip_prefix("channel = \"")
                .and_then(|v| v.strip_suffix('"'))
                .is_some_and(|v| {
                    v.split('.').count() == 3 && v.split('.').all(|n| n.parse::<u32>().is_ok())
                })
        }),
        "rust-toolchain.toml pins an exact version (x.y.z), not a channel:\n{toolchain}"
    );
}

/// What one container gets on its node, in the terms of docs/security.md's
/// "At a glance" table.
#[derive(Debug, Default, Clone, PartialEq)]
struct Privileges {
    capabilities: BTreeSet<String>,
    namespaces: BTreeSet<String>,
    ports: BTreeSet<String>,
    writable: BTreeSet<String>,
    read_only: BTreeSet<String>,
}

impl Privileges {
    fn fields(&self) -> [(&'static str, &BTreeSet<String>); 5] {
        [
            ("capabilities", &self.capabilities),
            ("host namespaces", &self.namespaces),
            ("ports", &self.ports),
            ("host paths, writable", &self.writable),
            ("host paths, read only", &self.read_only),
        ]
    }

    /// What `self` has that `base` has not, field by field.
    fn beyond(&self, base: &Privileges) -> Privileges {
        let less = |a: &BTreeSet<String>, b: &BTreeSet<String>| a.difference(b).cloned().collect();
        Privileges {
            capabilities: less(&self.capabilities, &base.capabilities),
            namespaces: less(&self.namespaces, &base.namespaces),
            ports: less(&self.ports, &base.ports),
            writable: less(&self.writable, &base.writable),
            read_only: less(&self.read_only, &base.read_only),
        }
    }
}

/// Every container of every pod the chart renders with `--set values`
/// (none for the defaults), by container name. Also checks what the table's
/// prose says of all of them: every other capability dropped, never
/// privileged, no escalation.
fn rendered_privileges(helm: &Path, values: Option<&str>) -> BTreeMap<String, Privileges> {
    let mut args = vec!["--kube-version", "1.37.0"];
    if let Some(values) = values {
        args.extend(["--set", values]);
    }
    let mut out = BTreeMap::new();
    for doc in documents(&helm_template(helm, &args)) {
        let pod = &doc["spec"]["template"]["spec"];
        let Some(containers) = pod["containers"].as_array() else {
            continue;
        };
        let init = pod["initContainers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let volumes: BTreeMap<&str, &Value> = pod["volumes"]
            .as_array()
            .map(|v| {
                v.iter()
                    .map(|v| (v["name"].as_str().unwrap_or(""), v))
                    .collect()
            })
            .unwrap_or_default();
        let namespaces: BTreeSet<String> = ["hostPID", "hostNetwork", "hostIPC"]
            .into_iter()
            .filter(|ns| pod[*ns] == true)
            .map(String::from)
            .collect();
        for container in containers.iter().chain(&init) {
            let name = container["name"]
                .as_str()
                .expect("container name")
                .to_string();
            let context = &container["securityContext"];
            assert_eq!(
                context["capabilities"]["drop"],
                json!(["ALL"]),
                "{name} drops every capability"
            );
            assert_ne!(context["privileged"], true, "{name} is not privileged");
            assert_eq!(
                context["allowPrivilegeEscalation"], false,
                "{name} may not escalate"
            );
            let mut got = Privileges {
                capabilities: context["capabilities"]["add"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|c| c.as_str().expect("capability").to_string())
                            .collect()
                    })
                    .unwrap_or_default(),
                namespaces: namespaces.clone(),
                ports: container["ports"]
                    .as_array()
                    .map(|p| p.iter().map(|p| p["containerPort"].to_string()).collect())
                    .unwrap_or_default(),
                ..Privileges::default()
            };
            for mount in container["volumeMounts"].as_array().into_iter().flatten() {
                let volume = volumes[mount["name"].as_str().expect("mount name")];
                let Some(path) = volume["hostPath"]["path"].as_str() else {
                    continue;
                };
                let list = if mount["readOnly"] == true {
                    &mut got.read_only
                } else {
                    &mut got.writable
                };
                list.insert(path.to_string());
            }
            assert!(
                out.insert(name.clone(), got).is_none(),
                "two containers named {name}"
            );
        }
    }
    out
}

/// The rows of docs/security.md's "At a glance" table: (values or `None`
/// for the defaults, container, what it has or adds).
fn documented_privileges() -> Vec<(Option<String>, String, Privileges)> {
    let text = std::fs::read_to_string(repo().join("docs").join("security.md"))
        .expect("read docs/security.md");
    let section = text
        .split("\n### At a glance\n")
        .nth(1)
        .expect("docs/security.md has an \"### At a glance\" section")
        .split("\n#")
        .next()
        .unwrap_or_default();
    // The backquoted items of a cell ("none": no item).
    let items = |cell: &str| -> BTreeSet<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(String::from)
            .collect()
    };
    let mut rows = Vec::new();
    for line in section.lines().filter(|l| l.starts_with("| ")).skip(1) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 7, "a row of seven cells: {line}");
        let values = (cells[0] != "defaults")
            .then(|| items(cells[0]).pop_first().expect("the values, backquoted"));
        let container = items(cells[1])
            .pop_first()
            .expect("the container, backquoted");
        let privileges = Privileges {
            capabilities: items(cells[2]),
            namespaces: items(cells[3]),
            ports: items(cells[4]),
            writable: items(cells[5]),
            read_only: items(cells[6]),
        };
        rows.push((values, container, privileges));
    }
    assert!(rows.len() >= 3, "the table's rows were read: {rows:?}");
    rows
}

/// docs/security.md's table of privileges per mode is what the chart
/// renders: each row's container has (defaults) or gains (a mode's values)
/// exactly the capabilities, host namespaces, ports and host paths the row
/// names, and every container the chart renders, in every mode the table
/// names, has its row.
#[test]
fn the_security_docs_privilege_table_is_what_the_chart_renders() {
    let Some(helm) = helm() else { return };
    let rows = documented_privileges();
    let defaults = rendered_privileges(&helm, None);
    let modes: BTreeSet<Option<String>> =
        rows.iter().map(|(values, _, _)| values.clone()).collect();
    for values in &modes {
        let rendered = match values {
            None => defaults.clone(),
            Some(values) => rendered_privileges(&helm, Some(values)),
        };
        let shown = values.as_deref().unwrap_or("defaults");
        for (container, got) in &rendered {
            let base = if values.is_some() {
                defaults.get(container)
            } else {
                None
            };
            let base = base.cloned().unwrap_or_default();
            let lost = base.beyond(got);
            assert_eq!(
                lost,
                Privileges::default(),
                "{shown}: {container} loses what the defaults give it (the table lists only additions)"
            );
            let added = got.beyond(&base);
            let row = rows.iter().find(|(v, c, _)| v == values && c == container);
            match row {
                Some((_, _, documented)) => {
                    for ((field, doc), (_, chart)) in
                        documented.fields().into_iter().zip(added.fields())
                    {
                        assert_eq!(
                            doc, chart,
                            "docs/security.md \"At a glance\", {shown}, {container}: {field} (left: the docs, right: the chart)"
                        );
                    }
                }
                None => assert!(
                    values.is_some() && added == Privileges::default(),
                    "docs/security.md \"At a glance\" has no row for {container} with {shown}; the chart gives it {added:?}"
                ),
            }
        }
        for (_, container, _) in rows.iter().filter(|(v, _, _)| v == values) {
            assert!(
                rendered.contains_key(container),
                "{shown}: the docs name {container}, the chart renders no such container"
            );
        }
    }
}
