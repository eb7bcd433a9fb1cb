//! `kubectl hugepool check`: whether an install works: both CRDs served,
//! the operator leading, an agent reporting on every selected node, and the
//! operator and agent of one version. Decided here from what the cluster
//! holds; mod.rs reads it.

use hugepool_crds::HugePageNode;
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Serialize;

use super::status::PoolRow;

/// Labels the chart gives the operator's Deployment and the agent's DaemonSet.
pub const OPERATOR_SELECTOR: &str =
    "app.kubernetes.io/part-of=hugepool,app.kubernetes.io/component=operator";
pub const AGENT_SELECTOR: &str =
    "app.kubernetes.io/part-of=hugepool,app.kubernetes.io/component=agent";
/// The operator's defaults (operator/src/main.rs) when its args say nothing.
pub const DEFAULT_LEASE_NAME: &str = "hugepool-operator";

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckReport {
    pub checks: Vec<Check>,
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Check {
    pub name: String,
    pub ok: bool,
    /// What was found, or what is wrong and what to do.
    pub detail: String,
}

impl Check {
    fn new(name: impl Into<String>, ok: bool, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ok,
            detail: detail.into(),
        }
    }
}

/// What `check` read from the cluster.
#[derive(Clone, Debug, Default)]
pub struct CheckInput {
    /// Each CRD's name and the object, None when absent.
    pub crds: Vec<(String, Option<CustomResourceDefinition>)>,
    pub operators: Vec<Deployment>,
    pub agents: Vec<DaemonSet>,
    /// The Lease the operator's args name, as (namespace, name, object).
    pub lease: Option<(String, String, Option<Lease>)>,
    /// Every pool with its selected nodes (`status`'s rows).
    pub pools: Vec<PoolRow>,
    /// Why the pools or HugePageNodes could not be read (a CRD missing).
    pub unreadable: Option<String>,
    pub node_states: Vec<HugePageNode>,
    /// This plugin's version.
    pub plugin_version: String,
}

pub fn report(input: &CheckInput, now: Timestamp) -> CheckReport {
    let mut checks: Vec<Check> = input
        .crds
        .iter()
        .map(|(name, crd)| crd_check(name, crd.as_ref()))
        .collect();
    checks.push(leader_check(input, now));
    checks.push(agents_check(input));
    checks.push(versions_check(input));
    CheckReport { checks }
}

fn crd_check(name: &str, crd: Option<&CustomResourceDefinition>) -> Check {
    let title = format!("CRD {name}");
    let Some(crd) = crd else {
        return Check::new(
            title,
            false,
            "not installed: apply the chart's crds/ (kubectl apply --server-side -f crds/)",
        );
    };
    let served = crd
        .spec
        .versions
        .iter()
        .any(|v| v.name == hugepool_crds::VERSION && v.served);
    if !served {
        return Check::new(
            title,
            false,
            format!(
                "{} is not served: apply this release's CRDs",
                hugepool_crds::VERSION
            ),
        );
    }
    let established = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "Established");
    match established {
        Some(c) if c.status == "True" => Check::new(
            title,
            true,
            format!("{} served, Established", hugepool_crds::VERSION),
        ),
        other => Check::new(
            title,
            false,
            format!(
                "not Established: {}",
                other
                    .and_then(|c| c.message.clone())
                    .unwrap_or_else(|| "no condition yet".into())
            ),
        ),
    }
}

fn object_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// The operator container's args.
fn operator_args(deployment: &Deployment) -> Vec<String> {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first())
        .and_then(|c| c.args.clone())
        .unwrap_or_default()
}

/// `--name=value` (or `--name value`) in `args`.
fn arg_value(args: &[String], name: &str) -> Option<String> {
    let flag = format!("--{name}");
    args.iter().enumerate().find_map(|(i, arg)| {
        if let Some(value) = arg.strip_prefix(&format!("{flag}=")) {
            Some(value.to_string())
        } else if *arg == flag {
            args.get(i + 1).cloned()
        } else {
            None
        }
    })
}

/// Where the operator `deployment` keeps its Lease (namespace, name), or
/// None when it runs without leader election.
pub fn lease_of(deployment: &Deployment) -> Option<(String, String)> {
    let args = operator_args(deployment);
    if !args.iter().any(|a| a == "--leader-elect") {
        return None;
    }
    let namespace = arg_value(&args, "lease-namespace")
        .or_else(|| deployment.metadata.namespace.clone())
        .unwrap_or_default();
    let name = arg_value(&args, "lease-name").unwrap_or_else(|| DEFAULT_LEASE_NAME.into());
    Some((namespace, name))
}

fn leader_check(input: &CheckInput, now: Timestamp) -> Check {
    let title = "operator leading";
    let Some(deployment) = input.operators.first() else {
        return Check::new(
            title,
            false,
            format!("no operator Deployment labelled {OPERATOR_SELECTOR}: is the chart installed?"),
        );
    };
    let ready = deployment
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    let wanted = deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    let replicas = format!(
        "Deployment {}, {ready}/{wanted} ready",
        object_name(&deployment.metadata)
    );
    let Some((namespace, name, lease)) = &input.lease else {
        return if ready > 0 {
            Check::new(
                title,
                true,
                format!("{replicas}; no leader election (one replica writes)"),
            )
        } else {
            Check::new(
                title,
                false,
                format!("{replicas}; no leader election and no replica ready"),
            )
        };
    };
    let Some(lease) = lease else {
        return Check::new(
            title,
            false,
            format!("{replicas}; no Lease {namespace}/{name}: no replica has led yet"),
        );
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let Some(holder) = spec.holder_identity.filter(|h| !h.is_empty()) else {
        return Check::new(
            title,
            false,
            format!("{replicas}; Lease {namespace}/{name} has no holder: no replica leads"),
        );
    };
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    let Some(renewed) = spec.renew_time.or(spec.acquire_time).map(|t| t.0) else {
        return Check::new(
            title,
            false,
            format!("{replicas}; Lease {namespace}/{name} held by {holder}, never renewed"),
        );
    };
    let age = now.duration_since(renewed).as_secs();
    if age > duration {
        Check::new(
            title,
            false,
            format!(
                "{replicas}; Lease {namespace}/{name} held by {holder} expired: renewed {age}s ago, valid {duration}s"
            ),
        )
    } else {
        Check::new(
            title,
            true,
            format!(
                "{replicas}; Lease {namespace}/{name} held by {holder}, renewed {}s ago",
                age.max(0)
            ),
        )
    }
}

fn agents_check(input: &CheckInput) -> Check {
    let title = "agents report";
    if let Some(error) = &input.unreadable {
        return Check::new(title, false, format!("cannot read the pools: {error}"));
    }
    let mut selected: Vec<&str> = input
        .pools
        .iter()
        .flat_map(|p| p.nodes.iter().map(|n| n.node.as_str()))
        .collect();
    selected.sort();
    selected.dedup();
    let daemonset = input.agents.first().map(|ds| {
        let status = ds.status.clone().unwrap_or_default();
        format!(
            "DaemonSet {}, {}/{} ready",
            object_name(&ds.metadata),
            status.number_ready,
            status.desired_number_scheduled
        )
    });
    let missing: Vec<String> = selected
        .iter()
        .filter_map(|&node| {
            let state = input
                .node_states
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(node));
            let problem = match state {
                None => "no HugePageNode".to_string(),
                Some(state) => match &state.status {
                    None => "no status: no agent has reported".to_string(),
                    Some(status) => {
                        let generation = state.metadata.generation.unwrap_or(0);
                        let seen = status.observed_generation.unwrap_or(0);
                        if seen >= generation {
                            return None;
                        }
                        format!("spec generation {generation} not seen (saw {seen})")
                    }
                },
            };
            Some(format!("{node} ({problem})"))
        })
        .collect();
    let where_ = daemonset.map_or_else(
        || format!("; no agent DaemonSet labelled {AGENT_SELECTOR}"),
        |ds| format!("; {ds}"),
    );
    if missing.is_empty() {
        Check::new(
            title,
            true,
            format!(
                "{} of {} selected nodes report their current spec{where_}",
                selected.len(),
                selected.len()
            ),
        )
    } else {
        const SHOWN: usize = 5;
        let more = missing.len().saturating_sub(SHOWN);
        let mut listed = missing[..missing.len().min(SHOWN)].join(", ");
        if more > 0 {
            listed.push_str(&format!(" and {more} more"));
        }
        Check::new(
            title,
            false,
            format!(
                "{} of {} selected nodes have no agent reporting their spec: {listed}{where_}",
                missing.len(),
                selected.len()
            ),
        )
    }
}

/// The version an image runs: its tag, else the object's
/// `app.kubernetes.io/version` label (a digest-pinned image).
fn version_of(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    image: Option<&str>,
) -> Option<String> {
    let tag = image.and_then(|image| {
        let name = image.split('@').next()?;
        let last = name.rsplit('/').next()?;
        Some(last.split_once(':')?.1.to_string())
    });
    tag.or_else(|| {
        meta.labels
            .as_ref()?
            .get("app.kubernetes.io/version")
            .cloned()
    })
}

/// The image of a pod template's first container.
fn first_image(pod: &k8s_openapi::api::core::v1::PodSpec) -> Option<&str> {
    pod.containers.first()?.image.as_deref()
}

fn versions_check(input: &CheckInput) -> Check {
    let title = "versions match";
    let operator = input.operators.first().and_then(|d| {
        version_of(
            &d.metadata,
            first_image(d.spec.as_ref()?.template.spec.as_ref()?),
        )
    });
    let agent = input.agents.first().and_then(|ds| {
        version_of(
            &ds.metadata,
            first_image(ds.spec.as_ref()?.template.spec.as_ref()?),
        )
    });
    let plugin = &input.plugin_version;
    match (operator, agent) {
        (Some(operator), Some(agent))
            if operator.trim_start_matches('v') == agent.trim_start_matches('v') =>
        {
            let note = if operator.trim_start_matches('v') == plugin {
                String::new()
            } else {
                format!(" (this kubectl-hugepool is {plugin}: its reading of the API may differ)")
            };
            Check::new(
                title,
                true,
                format!("operator {operator}, agent {agent}{note}"),
            )
        }
        (Some(operator), Some(agent)) => Check::new(
            title,
            false,
            format!(
                "operator {operator}, agent {agent}: upgrade both to one release (helm upgrade)"
            ),
        ),
        (operator, agent) => Check::new(
            title,
            false,
            format!(
                "operator {}, agent {}: cannot compare",
                operator.unwrap_or_else(|| "not found".into()),
                agent.unwrap_or_else(|| "not found".into())
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn deployment(image: &str, args: &[&str]) -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "op", "namespace": "hp", "labels": {"app.kubernetes.io/version": "0.2.0"}},
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "operator", "image": image, "args": args},
            ]}}},
        }))
        .expect("Deployment")
    }

    fn lease(renewed: i64) -> Lease {
        serde_json::from_value(json!({
            "metadata": {"name": "l", "namespace": "hp"},
            "spec": {"holderIdentity": "op-1", "leaseDurationSeconds": 15,
                     "renewTime": Timestamp::from_second(renewed).unwrap().to_string()},
        }))
        .expect("Lease")
    }

    fn check<'a>(report: &'a CheckReport, name: &str) -> &'a Check {
        report
            .checks
            .iter()
            .find(|c| c.name.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} check"))
    }

    #[test]
    fn a_missing_crd_an_expired_lease_and_unreadable_pools_each_fail_their_line() {
        let input = CheckInput {
            crds: vec![("hugepagepools.hugepool.dev".into(), None)],
            operators: vec![deployment("op:0.1.0", &["run", "--leader-elect"])],
            lease: Some(("hp".into(), "hugepool-operator".into(), Some(lease(1000)))),
            unreadable: Some("the server could not find the requested resource".into()),
            ..CheckInput::default()
        };
        let report = report(&input, Timestamp::from_second(1016).unwrap());
        assert!(!report.passed());
        let crd = check(&report, "CRD hugepagepools");
        assert!(
            !crd.ok && crd.detail.starts_with("not installed"),
            "{crd:?}"
        );
        let leading = check(&report, "operator leading");
        assert!(!leading.ok, "{leading:?}");
        assert!(
            leading
                .detail
                .ends_with("held by op-1 expired: renewed 16s ago, valid 15s"),
            "{leading:?}"
        );
        let agents = check(&report, "agents report");
        assert!(
            !agents.ok && agents.detail.contains("could not find"),
            "{agents:?}"
        );
        // 15s after the renewal the Lease still holds.
        let report = super::report(&input, Timestamp::from_second(1015).unwrap());
        assert!(check(&report, "operator leading").ok);
    }

    #[test]
    fn the_lease_comes_from_the_args_and_a_digest_pinned_image_reads_its_version_label() {
        let d = deployment(
            "ghcr.io/x/op@sha256:abcd",
            &[
                "run",
                "--leader-elect",
                "--lease-name",
                "mine",
                "--lease-namespace=elsewhere",
            ],
        );
        assert_eq!(lease_of(&d), Some(("elsewhere".into(), "mine".into())));
        assert_eq!(lease_of(&deployment("op:1", &["run"])), None);
        assert_eq!(
            version_of(&d.metadata, Some("ghcr.io/x/op@sha256:abcd")).as_deref(),
            Some("0.2.0")
        );
        assert_eq!(
            version_of(&d.metadata, Some("registry:5000/x/op:0.1.0")).as_deref(),
            Some("0.1.0")
        );
    }
}
