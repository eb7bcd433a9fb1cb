//! The rendered chart under real manifest linters: kube-score
//! (`hack/tool.sh kube-score`, built from its Go module) and checkov
//! (hack/checkov.sh, from PyPI into a virtualenv), each run on the chart
//! rendered with its default values and with every optional part on. Every
//! finding must be in charts/hugepool/lint-exceptions.yaml with its reason,
//! and every exception there must still be found (else it is stale). Each
//! linter is also shown a chart with a container made writable, and must
//! report it: the pipeline catches a new finding.
//!
//! Without Go, python3 or the registries these tests skip, except under
//! CI=true, where they fail.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use hugepool_e2e::{helm_template, output_text};
use serde::Deserialize;
use serde_json::Value;

/// Images by digest, beside every optional part of the chart turned on
/// (`hugepool_e2e::CHART_EVERYTHING_ON`).
const DIGESTS: &[&str] = &[
    "--set",
    "operator.image.digest=sha256:2f6c1e0b5a9d8c7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e",
    "--set",
    "agent.image.digest=sha256:9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d",
];

/// The two renders linted: default values, and every optional part on with
/// images by digest.
fn renders() -> [(&'static str, Vec<&'static str>); 2] {
    let everything = [hugepool_e2e::CHART_EVERYTHING_ON, DIGESTS].concat();
    [("default", Vec::new()), ("everything-on", everything)]
}

/// The operator's root filesystem made writable: both linters flag it.
const WRITABLE_ROOT: &[&str] = &[
    "--set",
    "operator.securityContext.readOnlyRootFilesystem=false",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Exceptions {
    #[serde(rename = "kube-score")]
    kube_score: Vec<Exception>,
    checkov: Vec<Exception>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Exception {
    check: String,
    /// kube-score's finding summary (one check says several things).
    #[serde(default)]
    summary: Option<String>,
    /// Kind/name of each object the finding is kept for.
    objects: Vec<String>,
    reason: String,
}

impl Exception {
    fn covers(&self, finding: &Finding) -> bool {
        self.check == finding.check
            && self.objects.contains(&finding.object)
            && self
                .summary
                .as_ref()
                .is_none_or(|summary| *summary == finding.summary)
    }
}

fn exceptions() -> Exceptions {
    let path = repo().join("charts/hugepool/lint-exceptions.yaml");
    let text = std::fs::read_to_string(&path).expect("read lint-exceptions.yaml");
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One thing a linter says about one object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Finding {
    check: String,
    /// Kind/name.
    object: String,
    summary: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {}: {}", self.check, self.object, self.summary)
    }
}

/// The chart rendered (hooks and CRDs included) into `dir`/`name`.yaml.
fn render(helm: &Path, dir: &Path, name: &str, values: &[&str]) -> PathBuf {
    let mut args = vec!["--include-crds"];
    args.extend_from_slice(values);
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, helm_template(helm, &args)).expect("write the render");
    path
}

fn renders_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("lint")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("temp dir")
}

/// What a linter found in each render, and what it was shown.
struct Run {
    /// (render, findings)
    renders: Vec<(&'static str, Vec<Finding>)>,
}

impl Run {
    /// Fails on a finding no exception covers, and on an exception (an
    /// object of an entry) that covers no finding of any render.
    fn assert_only_excepted(&self, linter: &str, exceptions: &[Exception]) {
        let mut unexcepted = Vec::new();
        for (render, findings) in &self.renders {
            for finding in findings {
                if !exceptions.iter().any(|e| e.covers(finding)) {
                    unexcepted.push(format!("{render}: {finding}"));
                }
            }
        }
        let mut stale = Vec::new();
        for exception in exceptions {
            for object in &exception.objects {
                let found = self.renders.iter().any(|(_, findings)| {
                    findings
                        .iter()
                        .any(|f| &f.object == object && exception.covers(f))
                });
                if !found {
                    stale.push(format!("{} on {object}", exception.check));
                }
            }
        }
        assert!(
            unexcepted.is_empty(),
            "{linter} finds what charts/hugepool/lint-exceptions.yaml does not keep: fix the \
             chart, or add the finding with a reason:\n{}",
            unexcepted.join("\n")
        );
        assert!(
            stale.is_empty(),
            "charts/hugepool/lint-exceptions.yaml keeps {linter} findings no render has any \
             more; remove them: {stale:?}"
        );
    }
}

/// kube-score's findings (grade below 10, not skipped) in `file`, and how
/// many objects it scored.
fn kube_score(kube_score: &Path, file: &Path) -> (Vec<Finding>, usize) {
    let output = Command::new(kube_score)
        .args(["score", "--output-format", "json"])
        // The Kubernetes the chart is tested against, not kube-score's 1.18.
        .args(["--kubernetes-version", "v1.33"])
        // Exceptions live in lint-exceptions.yaml, not in annotations.
        .arg("--disable-ignore-checks-annotations")
        .arg(file)
        .stdin(Stdio::null())
        .output()
        .expect("run kube-score");
    // It exits 1 when it has a critical finding; its JSON says which.
    let objects: Vec<Value> = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("kube-score printed no JSON ({e}): {}", output_text(&output)));
    let mut findings = Vec::new();
    for object in &objects {
        let name = format!(
            "{}/{}",
            object["type_meta"]["kind"].as_str().expect("kind"),
            object["object_meta"]["name"].as_str().expect("name")
        );
        for check in object["checks"].as_array().expect("checks") {
            let grade = check["grade"].as_i64().expect("grade");
            if check["skipped"] == true || grade >= 10 {
                continue;
            }
            for comment in check["comments"].as_array().expect("comments") {
                findings.push(Finding {
                    check: check["check"]["id"].as_str().expect("check id").into(),
                    object: name.clone(),
                    summary: comment["summary"].as_str().expect("summary").into(),
                });
            }
        }
    }
    findings.sort();
    (findings, objects.len())
}

/// `Kind/name` of a checkov resource: `Kind.namespace.name`, and for its
/// graph checks on pods `Pod.namespace.name.<labels>`.
fn checkov_object(resource: &str) -> String {
    let mut parts = resource.splitn(3, '.');
    let kind = parts.next().unwrap_or_default();
    let _namespace = parts.next();
    let rest = parts.next().unwrap_or_default();
    let name = if kind == "Pod" {
        rest.split('.').next().unwrap_or_default()
    } else {
        rest
    };
    format!("{kind}/{name}")
}

/// checkov's failed checks in `file`, and how many passed.
fn checkov(checkov: &Path, file: &Path) -> (Vec<Finding>, u64) {
    let output = Command::new(checkov)
        .arg("--file")
        .arg(file)
        .args(["--framework", "kubernetes", "--output", "json"])
        .args(["--quiet", "--compact"])
        // Its own checks only: nothing fetched from a platform.
        .arg("--skip-download")
        .env("BC_SKIP_MAPPING", "TRUE")
        .stdin(Stdio::null())
        .output()
        .expect("run checkov");
    let report: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("checkov printed no JSON ({e}): {}", output_text(&output)));
    assert_eq!(
        report["summary"]["parsing_errors"],
        0,
        "checkov could not parse {}: {}",
        file.display(),
        output_text(&output)
    );
    let mut findings: Vec<Finding> = report["results"]["failed_checks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|failed| Finding {
            check: failed["check_id"].as_str().expect("check_id").into(),
            object: checkov_object(failed["resource"].as_str().expect("resource")),
            summary: failed["check_name"].as_str().unwrap_or_default().into(),
        })
        .collect();
    findings.sort();
    findings.dedup();
    let passed = report["summary"]["passed"]
        .as_u64()
        .expect("summary.passed");
    (findings, passed)
}

#[test]
fn every_exception_says_why() {
    let exceptions = exceptions();
    for (linter, list) in [
        ("kube-score", &exceptions.kube_score),
        ("checkov", &exceptions.checkov),
    ] {
        assert!(!list.is_empty(), "{linter}: no entries");
        for exception in list {
            let what = format!("{linter} {}", exception.check);
            assert!(
                exception.reason.split_whitespace().count() >= 12,
                "{what}: a reason says why the finding is right for this chart: {:?}",
                exception.reason
            );
            assert!(!exception.objects.is_empty(), "{what}: no objects");
            for object in &exception.objects {
                assert!(
                    object
                        .split_once('/')
                        .is_some_and(|(k, n)| !k.is_empty() && !n.is_empty()),
                    "{what}: {object:?} is not Kind/name"
                );
            }
            if linter == "kube-score" {
                assert!(
                    exception.summary.is_some(),
                    "{what}: a kube-score entry names the finding's summary"
                );
            }
        }
    }
}

#[test]
fn checkov_resources_name_their_object() {
    assert_eq!(
        checkov_object("DaemonSet.hugepool-system.hugepool-agent"),
        "DaemonSet/hugepool-agent"
    );
    assert_eq!(
        checkov_object("Pod.hugepool-system.hugepool-operator.helm.sh/chart-hugepool-0.1.0.app"),
        "Pod/hugepool-operator"
    );
    assert_eq!(
        checkov_object("CustomResourceDefinition.default.hugepagepools.hugepool.dev"),
        "CustomResourceDefinition/hugepagepools.hugepool.dev"
    );
}

#[test]
fn kube_score_finds_only_the_excepted() {
    let (Some(helm), Some(bin)) = (
        hugepool_e2e::hack_tool_or_skip("helm.sh", &[]),
        hugepool_e2e::hack_tool_or_skip("tool.sh", &["kube-score"]),
    ) else {
        return;
    };
    let dir = renders_dir();
    let mut run = Run {
        renders: Vec::new(),
    };
    for (name, values) in renders() {
        let (findings, scored) = kube_score(&bin, &render(&helm, dir.path(), name, &values));
        // The Deployment, the DaemonSet, the hook Job, the Service, the PDB.
        assert!(scored >= 5, "{name}: kube-score scored {scored} objects");
        run.renders.push((name, findings));
    }
    run.assert_only_excepted("kube-score", &exceptions().kube_score);

    let (findings, _) = kube_score(&bin, &render(&helm, dir.path(), "writable", WRITABLE_ROOT));
    let writable = Finding {
        check: "container-security-context-readonlyrootfilesystem".into(),
        object: "Deployment/hugepool-operator".into(),
        summary: "The pod has a container with a writable root filesystem".into(),
    };
    assert!(
        findings.contains(&writable),
        "kube-score did not report the writable root filesystem: {findings:#?}"
    );
    assert!(!exceptions().kube_score.iter().any(|e| e.covers(&writable)));
}

#[test]
fn checkov_finds_only_the_excepted() {
    let (Some(helm), Some(bin)) = (
        hugepool_e2e::hack_tool_or_skip("helm.sh", &[]),
        hugepool_e2e::hack_tool_or_skip("checkov.sh", &[]),
    ) else {
        return;
    };
    let dir = renders_dir();
    let mut run = Run {
        renders: Vec::new(),
    };
    for (name, values) in renders() {
        let (findings, passed) = checkov(&bin, &render(&helm, dir.path(), name, &values));
        assert!(passed >= 100, "{name}: checkov passed only {passed} checks");
        run.renders.push((name, findings));
    }
    run.assert_only_excepted("checkov", &exceptions().checkov);

    let (findings, _) = checkov(&bin, &render(&helm, dir.path(), "writable", WRITABLE_ROOT));
    let writable: BTreeSet<&Finding> = findings
        .iter()
        .filter(|f| f.check == "CKV_K8S_22" && f.object == "Deployment/hugepool-operator")
        .collect();
    assert_eq!(
        writable.len(),
        1,
        "checkov did not report the writable root filesystem: {findings:#?}"
    );
    assert!(
        !exceptions()
            .checkov
            .iter()
            .any(|e| writable.iter().any(|f| e.covers(f)))
    );
}
