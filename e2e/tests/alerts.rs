//! The chart's alerts (templates/prometheusrule.yaml) under the real
//! promtool: the rendered rules pass `promtool check rules`, the unit tests
//! in charts/hugepool/tests/alerts.test.yaml pass, every alert has a case
//! where it fires and one where it does not, and those tests fail when a
//! rule's threshold, `for:` or expression is changed.
//!
//! helm and promtool come from `hack/helm.sh` and `hack/prometheus.sh`
//! (built once from the Go module proxy into target/tools/). Without Go or
//! the proxy these tests skip, except under CI=true, where they fail.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hugepool_e2e::{helm_template, output_text, yaml_documents};
use serde_json::Value;

/// The rules file alerts.test.yaml names in `rule_files`, beside it.
const RULES_FILE: &str = "hugepool.rules.yaml";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

fn unit_tests_path() -> PathBuf {
    repo()
        .join("charts")
        .join("hugepool")
        .join("tests")
        .join("alerts.test.yaml")
}

fn helm() -> Option<PathBuf> {
    hugepool_e2e::hack_tool_or_skip("helm.sh", &[])
}

fn promtool() -> Option<PathBuf> {
    hugepool_e2e::hack_tool_or_skip("prometheus.sh", &["promtool"])
}

/// Alerts the chart renders only when asked (a value turns each on); the
/// unit tests cover them rendered with their other values at the defaults.
const OPTIONAL_ALERTS: &[(&str, &str)] = &[(
    "HugepoolMemoryReservedUnrequested",
    "monitoring.prometheusRule.reservedUnrequested.enabled",
)];

/// The `spec` (rule groups) of the chart's PrometheusRule, default values
/// with every optional alert turned on.
fn rendered_rules(helm: &Path) -> Value {
    let mut args: Vec<String> = vec![
        "--set".into(),
        "monitoring.prometheusRule.enabled=true".into(),
    ];
    for (_, value) in OPTIONAL_ALERTS {
        args.extend(["--set".into(), format!("{value}=true")]);
    }
    args.extend(["--show-only".into(), "templates/prometheusrule.yaml".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    rules_spec(&helm_template(helm, &args))
}

fn rules_spec(yaml: &str) -> Value {
    let rule = yaml_documents(yaml)
        .into_iter()
        .find(|doc| doc["kind"] == "PrometheusRule")
        .expect("a PrometheusRule in the rendered chart");
    rule["spec"].clone()
}

fn unit_tests() -> Value {
    let path = unit_tests_path();
    let text = std::fs::read_to_string(&path).expect("read alerts.test.yaml");
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every alerting rule of every group, in file order.
fn alert_rules(spec: &Value) -> Vec<&Value> {
    spec["groups"]
        .as_array()
        .expect("spec.groups")
        .iter()
        .flat_map(|group| group["rules"].as_array().expect("group rules"))
        .filter(|rule| rule.get("alert").is_some())
        .collect()
}

fn alert_rules_mut(spec: &mut Value) -> Vec<&mut Value> {
    spec["groups"]
        .as_array_mut()
        .expect("spec.groups")
        .iter_mut()
        .flat_map(|group| group["rules"].as_array_mut().expect("group rules"))
        .filter(|rule| rule.get("alert").is_some())
        .collect()
}

fn alert_names(spec: &Value) -> Vec<String> {
    alert_rules(spec)
        .into_iter()
        .map(|rule| rule["alert"].as_str().expect("alert name").to_owned())
        .collect()
}

/// A directory holding `rules` as hugepool.rules.yaml and a copy of
/// alerts.test.yaml beside it, as the test file's `rule_files` expects.
struct UnitTestDir {
    dir: tempfile::TempDir,
}

impl UnitTestDir {
    fn new(rules: &Value) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("alerts")
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .expect("temp dir");
        let yaml = serde_saphyr::to_string(rules).expect("rules as YAML");
        std::fs::write(dir.path().join(RULES_FILE), yaml).expect("write rules");
        std::fs::copy(unit_tests_path(), dir.path().join("alerts.test.yaml"))
            .expect("copy alerts.test.yaml");
        Self { dir }
    }

    fn promtool(&self, promtool: &Path, args: &[&str]) -> Output {
        Command::new(promtool)
            .current_dir(self.dir.path())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run promtool")
    }

    fn check_rules(&self, promtool: &Path) -> Output {
        self.promtool(promtool, &["check", "rules", RULES_FILE])
    }

    fn test_rules(&self, promtool: &Path) -> Output {
        self.promtool(promtool, &["test", "rules", "alerts.test.yaml"])
    }
}

#[test]
fn rendered_rules_pass_promtool_check() {
    let (Some(helm), Some(promtool)) = (helm(), promtool()) else {
        return;
    };
    let rules = rendered_rules(&helm);
    let output = UnitTestDir::new(&rules).check_rules(&promtool);
    let text = output_text(&output);
    assert!(output.status.success(), "promtool check rules: {text}");
    let alerts = alert_names(&rules).len();
    assert!(
        text.contains(&format!("SUCCESS: {alerts} rules found")),
        "promtool did not find the chart's {alerts} alerts: {text}"
    );
}

#[test]
fn alert_unit_tests_pass() {
    let (Some(helm), Some(promtool)) = (helm(), promtool()) else {
        return;
    };
    let output = UnitTestDir::new(&rendered_rules(&helm)).test_rules(&promtool);
    assert!(
        output.status.success(),
        "promtool test rules charts/hugepool/tests/alerts.test.yaml: {}",
        output_text(&output)
    );
}

#[test]
fn every_alert_has_a_firing_and_a_quiet_case() {
    let Some(helm) = helm() else { return };
    let rules = rendered_rules(&helm);
    let tests = unit_tests();
    assert_eq!(
        tests["rule_files"],
        serde_json::json!([RULES_FILE]),
        "alerts.test.yaml must test the rendered rules alone, as {RULES_FILE}"
    );
    // alert name -> (firing cases, quiet cases)
    let mut cases: BTreeMap<String, (usize, usize)> = alert_names(&rules)
        .into_iter()
        .map(|name| (name, (0, 0)))
        .collect();
    let groups = tests["tests"].as_array().expect("tests");
    for case in groups
        .iter()
        .filter_map(|group| group["alert_rule_test"].as_array())
        .flatten()
    {
        let name = case["alertname"].as_str().expect("alertname");
        let Some((firing, quiet)) = cases.get_mut(name) else {
            panic!("alerts.test.yaml tests {name}, which the chart does not define");
        };
        // promtool reads a missing exp_alerts as none.
        match case.get("exp_alerts").and_then(Value::as_array) {
            Some(expected) if !expected.is_empty() => *firing += 1,
            _ => *quiet += 1,
        }
    }
    let untested: Vec<String> = cases
        .iter()
        .filter(|(_, (firing, quiet))| *firing == 0 || *quiet == 0)
        .map(|(name, (firing, quiet))| format!("{name} ({firing} firing, {quiet} quiet)"))
        .collect();
    assert!(
        untested.is_empty(),
        "charts/hugepool/tests/alerts.test.yaml needs a case where each alert fires \
         and one where it does not: {untested:?}"
    );
}

/// A rule's expression with its last comparison made inclusive (`>` to `>=`),
/// so it fires exactly at the threshold.
fn inclusive_threshold(expr: &str) -> Option<String> {
    let at = [" > ", " < "]
        .iter()
        .filter_map(|op| expr.rfind(op))
        .max()?;
    let mut mutated = expr.to_owned();
    mutated.insert(at + 2, '=');
    Some(mutated)
}

/// Each change that should break an alert: its name, what changed, the rules.
fn broken_rules(rules: &Value) -> Vec<(String, &'static str, Value)> {
    let mut broken = Vec::new();
    for (index, rule) in alert_rules(rules).into_iter().enumerate() {
        let name = rule["alert"].as_str().expect("alert name");
        let expr = rule["expr"].as_str().expect("expr");
        let mutate = |change: &dyn Fn(&mut serde_json::Map<String, Value>)| {
            let mut copy = rules.clone();
            let rule = alert_rules_mut(&mut copy).swap_remove(index);
            change(rule.as_object_mut().expect("rule is a mapping"));
            copy
        };
        let at_threshold = inclusive_threshold(expr)
            .unwrap_or_else(|| panic!("{name}: no ` > ` or ` < ` in {expr:?}"));
        let never = format!("({expr}) unless on() vector(1)");
        for (change, mutated) in [
            ("threshold made inclusive", at_threshold),
            ("expression never true", never),
        ] {
            let copy = mutate(&|rule| {
                rule.insert("expr".into(), mutated.clone().into());
            });
            broken.push((name.to_owned(), change, copy));
        }
        if rule.get("for").is_some() {
            let copy = mutate(&|rule| {
                rule.remove("for");
            });
            broken.push((name.to_owned(), "`for:` removed", copy));
        }
    }
    broken
}

#[test]
fn alert_unit_tests_fail_when_a_rule_is_broken() {
    let (Some(helm), Some(promtool)) = (helm(), promtool()) else {
        return;
    };
    let rules = rendered_rules(&helm);
    // Else each broken rule below would look caught.
    let pristine = UnitTestDir::new(&rules).test_rules(&promtool);
    assert!(pristine.status.success(), "{}", output_text(&pristine));
    let mut survived = Vec::new();
    for (name, change, rules) in &broken_rules(&rules) {
        let output = UnitTestDir::new(rules).test_rules(&promtool);
        let text = output_text(&output);
        // A failure that names the alert, not one of the rules file.
        if output.status.success() || !text.contains(&format!("alertname: {name},")) {
            survived.push(format!("{name}, {change}: {text}"));
        }
    }
    assert!(
        survived.is_empty(),
        "alerts.test.yaml still passes with these rules broken:\n{}",
        survived.join("\n")
    );
}

#[test]
fn optional_alerts_are_off_by_default() {
    let Some(helm) = helm() else { return };
    let defaults = rules_spec(&helm_template(
        &helm,
        &[
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
    ));
    let names = alert_names(&defaults);
    let all = alert_names(&rendered_rules(&helm));
    for (alert, value) in OPTIONAL_ALERTS {
        assert!(
            !names.iter().any(|n| n == alert),
            "{alert} is on by default"
        );
        assert!(
            all.iter().any(|n| n == alert),
            "{value}=true renders no {alert}"
        );
    }
    // The threshold and the wait are values.
    let tuned = helm_template(
        &helm,
        &[
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--set",
            "monitoring.prometheusRule.reservedUnrequested.enabled=true",
            "--set",
            "monitoring.prometheusRule.reservedUnrequested.thresholdBytes=68719476736",
            "--set",
            "monitoring.prometheusRule.reservedUnrequested.for=24h",
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
    );
    let rules = rules_spec(&tuned);
    let rule = alert_rules(&rules)
        .into_iter()
        .find(|r| r["alert"] == "HugepoolMemoryReservedUnrequested")
        .expect("the alert, turned on");
    assert_eq!(
        rule["expr"],
        "max by (pool) (hugepool_pool_bytes{kind=\"unrequested\"}) > 68719476736"
    );
    assert_eq!(rule["for"], "24h");
}

#[test]
fn every_alert_links_its_runbook_heading() {
    let Some(helm) = helm() else { return };
    let base = "https://github.com/hugepool-dev/hugepool/blob/main/docs/runbooks.md";
    let rules = rendered_rules(&helm);
    for rule in alert_rules(&rules) {
        let name = rule["alert"].as_str().expect("alert name");
        assert_eq!(
            rule["annotations"]["runbook_url"],
            format!("{base}#{}", name.to_lowercase()),
            "{name}: runbook_url is docs/runbooks.md's heading named after the alert"
        );
    }
    // The base is a value: a fork or a mirror points the links at its own.
    let yaml = helm_template(
        &helm,
        &[
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--set",
            "monitoring.prometheusRule.runbookBaseUrl=https://wiki.example.com/hugepool/",
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
    );
    assert!(
        yaml.contains("runbook_url: https://wiki.example.com/hugepool#hugepoolnodenotreadytaint"),
        "{yaml}"
    );
}
