//! Every metric the dashboard and the alerts query is one that the agent or
//! the operator exports (a renamed metric would leave a panel empty and an
//! alert that never fires). The real Prometheus test (e2e/tests/prometheus.rs)
//! checks the same with series; this one needs nothing running.

use std::collections::BTreeSet;
use std::path::Path;

/// The metric families a registry's OpenMetrics text declares, with the
/// sample names each family's type gives (`_total`, `_bucket`, `_info`, ...).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
        let suffixes: &[&str] = match kind {
            "counter" => &["_total", "_created"],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            "info" => &["_info"],
            _ => &[""],
        };
        for suffix in suffixes {
            names.insert(format!("{name}{suffix}"));
        }
    }
    names
}

/// `hugepool_*` identifiers in a PromQL expression.
fn queried(expr: &str, into: &mut BTreeSet<String>) {
    let bytes = expr.as_bytes();
    let mut at = 0;
    while let Some(found) = expr[at..].find("hugepool_") {
        let start = at + found;
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = expr[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(expr.len(), |n| start + n);
        if !preceded {
            into.insert(expr[start..end].to_string());
        }
        at = end;
    }
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_query_is_exported() {
    use hugepool_agent::agent::metrics::{
        self as agent_metrics, SizeLabels, StallLabels, StepLabels,
    };
    use hugepool_agent::kernel::{NumaCounts, PoolCounts};
    // A family shows in the text once it has a series: give each one.
    let mut registry = prometheus_client::registry::Registry::default();
    let agent = agent_metrics::Metrics::register(&mut registry);
    let size = hugepool_crds::PageSize::from_bytes(2 << 20).expect("2Mi");
    let numa = [NumaCounts {
        node: 0,
        total: 1,
        free: 1,
        surplus: 0,
    }];
    agent.set_kernel_pages(
        size,
        &PoolCounts {
            total: 1,
            free: 1,
            reserved: 0,
            surplus: 0,
        },
        &numa,
    );
    let target: hugepool_crds::node::PageSizeTarget = serde_json::from_value(serde_json::json!({
        "size": "2Mi", "pages": 1, "numa": [{"id": 0, "pages": 1}],
    }))
    .expect("a target");
    agent.set_targets(&[target]);
    agent.set_requested_pages(size, 1);
    agent.set_obtainable(
        true,
        &std::collections::BTreeMap::from([(
            (size, None),
            hugepool_agent::kernel::freelists::GrowEstimate {
                obtainable_now: 1,
                after_compaction: 2,
            },
        )]),
    );
    let step = StepLabels {
        size: "2Mi".into(),
        direction: "grow".into(),
    };
    agent.step_seconds.get_or_create(&step).observe(0.01);
    agent.pages_moved.get_or_create(&step).inc();
    agent
        .stalls
        .get_or_create(&StallLabels {
            reason: "SlowKernelWrite".into(),
        })
        .inc();
    agent
        .shortfall_pages
        .get_or_create(&SizeLabels { size: "2Mi".into() })
        .set(1);
    agent
        .foreign_writes
        .get_or_create(&SizeLabels { size: "2Mi".into() })
        .inc();
    let mut text = agent_metrics::encode(&registry);
    let operator = hugepool_operator::metrics::Metrics::default();
    operator.set_leading(true);
    operator.observe_pool(
        "pool",
        &hugepool_operator::planner::PoolPlan {
            status: Default::default(),
            max_unavailable: 1,
            page_size: Some(size),
            ..Default::default()
        },
    );
    operator.count_eviction("pool", "evicted");
    operator.count_error("kube");
    operator.observe_reconcile(std::time::Duration::from_millis(1));
    operator.plan_duration.observe(0.001);
    text.push_str(&operator.encode());
    let exported = exported(&text);
    assert!(exported.contains("hugepool_pages"), "{exported:?}");

    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/hugepool");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chart.join("dashboards/hugepool.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    let mut from_dashboard = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queried(target["expr"].as_str().expect("expr"), &mut from_dashboard);
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(query) = variable["definition"].as_str() {
            queried(query, &mut from_dashboard);
        }
    }
    let rules =
        std::fs::read_to_string(chart.join("templates/prometheusrule.yaml")).expect("rules");
    let mut from_rules = BTreeSet::new();
    for line in rules.lines().filter(|l| !l.trim_start().starts_with('#')) {
        if !line.contains("`kubectl") {
            queried(line, &mut from_rules);
        }
    }
    assert!(from_dashboard.len() >= 8, "{from_dashboard:?}");
    assert!(from_rules.len() >= 5, "{from_rules:?}");
    let missing: Vec<_> = from_dashboard
        .iter()
        .chain(&from_rules)
        .filter(|name| !exported.contains(*name))
        .collect();
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\nexported: {exported:?}"
    );
}

/// Stranded memory has its panels: per pool allocated (`current`),
/// requested and in use, per pool unrequested (what the optional alert
/// reads), and per node all four from the agents.
#[test]
fn the_dashboard_shows_allocated_requested_in_use_and_unrequested_memory() {
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/hugepool");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chart.join("dashboards/hugepool.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    let panel_exprs = |title: &str| -> Vec<String> {
        let panel = dashboard["panels"]
            .as_array()
            .expect("panels")
            .iter()
            .find(|p| p["title"] == title)
            .unwrap_or_else(|| panic!("no panel {title:?}"));
        panel["targets"]
            .as_array()
            .expect("targets")
            .iter()
            .map(|t| t["expr"].as_str().expect("expr").to_string())
            .collect()
    };
    let pools = panel_exprs("Pool memory: allocated, requested, in use");
    assert!(
        pools.iter().any(|e| e.contains("hugepool_pool_bytes")
            && e.contains(r#"kind=~"current|requested|in_use""#)),
        "{pools:?}"
    );
    let unrequested = panel_exprs("Unrequested memory by pool");
    assert!(
        unrequested
            .iter()
            .any(|e| e.contains(r#"hugepool_pool_bytes{pool=~"$pool", kind="unrequested"}"#)),
        "{unrequested:?}"
    );
    let nodes = panel_exprs("Nodes by unrequested memory");
    assert_eq!(nodes.len(), 4, "{nodes:?}");
    assert!(
        nodes.iter().any(|e| e.contains("hugepool_requested_bytes")),
        "{nodes:?}"
    );
    // What a grow can get: both estimates, per node and size.
    let obtainable = panel_exprs("What a grow can get, by node");
    assert_eq!(
        obtainable,
        [
            r#"max by (node, size) (hugepool_obtainable_pages{when="now"})"#,
            r#"max by (node, size) (hugepool_obtainable_pages{when="after_compaction"})"#
        ],
    );
    // The older panel keeps to what it says: targets against kernels.
    let target = panel_exprs("Pool pages: target vs current");
    assert!(
        target[0].contains(r#"kind=~"target|current""#),
        "{target:?}"
    );
}
