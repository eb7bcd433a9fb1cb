//! The handbook keeps up with the code: every condition reason has a
//! troubleshooting entry, every alert a runbook its `runbook_url` reaches,
//! and no relative link in README.md or docs/ points at nothing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use hugepool_crds::conditions::Reason;

/// Where every alert's `runbook_url` points, up to the anchor.
const RUNBOOK_BASE: &str = "https://github.com/hugepool-dev/hugepool/blob/main/docs/runbooks.md#";

/// The chart's helper that spells an alert's `runbook_url` from
/// `monitoring.prometheusRule.runbookBaseUrl` and the alert's name.
const RUNBOOK_HELPER: &str = "hugepool.runbookUrl";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(relative: &str) -> String {
    let path = root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {relative}: {err}"))
}

/// The lines of a Markdown text outside fenced code blocks.
fn prose_lines(markdown: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push(line);
        }
    }
    lines
}

/// The text of every ATX heading (`## Text`), in order.
fn headings(markdown: &str) -> Vec<String> {
    prose_lines(markdown)
        .into_iter()
        .filter_map(|line| {
            let hashes = line.len() - line.trim_start_matches('#').len();
            let rest = &line[hashes..];
            ((1..=6).contains(&hashes) && rest.starts_with(' '))
                .then(|| rest.trim().trim_end_matches('#').trim().to_string())
        })
        .collect()
}

/// GitHub's anchor for a heading: lowercase, punctuation other than '-'
/// and '_' dropped, each space a '-'.
fn slug(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors GitHub gives a page's headings (a repeated slug gets `-1`,
/// `-2`, ...).
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for heading in headings(markdown) {
        let base = slug(&heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// A line with its inline code spans removed (`[x](y)` inside backticks is
/// not a link).
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// Link targets of a Markdown text: inline `[text](target)`, reference
/// definitions `[label]: target` and HTML `src="target"`.
fn link_targets(markdown: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in prose_lines(markdown) {
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("");
            targets.push(target.trim_matches(['<', '>']).to_string());
            rest = &after[end..];
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some((label, target)) = trimmed.split_once("]:")
            && !label.contains(']')
        {
            targets.push(target.split_whitespace().next().unwrap_or("").to_string());
        }
        let mut rest = line.as_str();
        while let Some(at) = rest.find("src=\"") {
            let after = &rest[at + 5..];
            let end = after.find('"').unwrap_or(after.len());
            targets.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    targets
}

/// README.md and every Markdown page of docs/.
fn handbook_pages() -> Vec<String> {
    let mut pages = vec!["README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("reading docs/")
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.ends_with(".md").then(|| format!("docs/{name}"))
        })
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// One alert of the chart's PrometheusRule, as written in the template.
#[derive(Debug, PartialEq, Eq)]
struct Alert {
    name: String,
    runbook_url: Option<String>,
}

/// The alerts of a PrometheusRule template, read as text: each
/// `- alert: NAME` line starts one, and a `runbook_url:` line before the
/// next belongs to it.
fn alerts(template: &str) -> Vec<Alert> {
    let mut alerts: Vec<Alert> = Vec::new();
    for line in template.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            alerts.push(Alert {
                name: name.trim().trim_matches(['"', '\'']).to_string(),
                runbook_url: None,
            });
        } else if let Some(url) = trimmed.strip_prefix("runbook_url:")
            && let Some(alert) = alerts.last_mut()
        {
            alert.runbook_url = Some(url.trim().trim_matches(['"', '\'']).to_string());
        }
    }
    alerts
}

/// The value of `key:` in a YAML text, read as a plain line (the first one).
fn yaml_value<'a>(yaml: &'a str, key: &str) -> Option<&'a str> {
    yaml.lines().find_map(|line| {
        let value = line.trim().strip_prefix(key)?.strip_prefix(':')?;
        Some(value.trim().trim_matches(['"', '\'']))
    })
}

/// The URL a `runbook_url:` line renders to: written out, or
/// `{{ include "hugepool.runbookUrl" (list $ "Name") }}`, which the helper
/// renders as `<runbookBaseUrl>#<name, lowercased>`.
fn rendered_runbook_url(raw: &str, base_url: &str) -> Result<String, String> {
    if raw.starts_with("https://") || raw.starts_with("http://") {
        return Ok(raw.to_string());
    }
    let quoted: Vec<&str> = raw.split('"').skip(1).step_by(2).collect();
    match quoted.as_slice() {
        [helper, name] if *helper == RUNBOOK_HELPER => Ok(format!(
            "{}#{}",
            base_url.trim_end_matches('/'),
            name.to_lowercase()
        )),
        _ => Err(format!("cannot read runbook_url {raw:?}")),
    }
}

#[test]
fn every_condition_reason_has_a_troubleshooting_entry() {
    let page = read("docs/troubleshooting.md");
    let headings: BTreeSet<String> = headings(&page).into_iter().collect();
    let missing: Vec<&str> = Reason::ALL
        .iter()
        .map(|r| r.as_str())
        .filter(|r| !headings.contains(&format!("`{r}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/troubleshooting.md has no entry for the condition reasons {missing:?}: add a \
         heading \"### `Reason`\" for each (meaning, how to confirm, what to do)"
    );
}

#[test]
fn troubleshooting_answers_a_pod_pending_on_hugepages() {
    let page = read("docs/troubleshooting.md");
    assert!(
        headings(&page)
            .iter()
            .any(|h| h.starts_with("Pod Pending: Insufficient hugepages")),
        "docs/troubleshooting.md has no entry \"Pod Pending: Insufficient hugepages-<size>\""
    );
}

#[test]
fn every_alert_has_a_runbook_url_that_reaches_its_runbook() {
    let template = read("charts/hugepool/templates/prometheusrule.yaml");
    let found = alerts(&template);
    assert!(
        found.len() >= 6,
        "expected the chart's alerts in prometheusrule.yaml, read {found:?}"
    );
    // The test renders the helper as _helpers.tpl defines it: base, '#',
    // the alert's name lowercased.
    let helpers = read("charts/hugepool/templates/_helpers.tpl");
    let definition = helpers
        .split(&format!("define \"{RUNBOOK_HELPER}\""))
        .nth(1)
        .and_then(|rest| rest.split("{{- end").next())
        .unwrap_or_default();
    assert!(
        definition.contains("runbookBaseUrl") && definition.contains("(lower (index . 1))"),
        "_helpers.tpl's {RUNBOOK_HELPER} no longer renders runbookBaseUrl#<lowercased name>; \
         update rendered_runbook_url in crds/tests/docs.rs to match: {definition:?}"
    );
    let values = read("charts/hugepool/values.yaml");
    let base_url = yaml_value(&values, "runbookBaseUrl").unwrap_or_default();
    let runbooks = read("docs/runbooks.md");
    let titles: BTreeSet<String> = headings(&runbooks).into_iter().collect();
    let anchors = anchors(&runbooks);
    let mut problems = Vec::new();
    for alert in &found {
        let name = &alert.name;
        if !titles.contains(name) {
            problems.push(format!(
                "{name}: docs/runbooks.md has no heading \"## {name}\""
            ));
        }
        let Some(raw) = &alert.runbook_url else {
            problems.push(format!(
                "{name}: no runbook_url annotation (want {RUNBOOK_BASE}{})",
                slug(name)
            ));
            continue;
        };
        let url = match rendered_runbook_url(raw, base_url) {
            Ok(url) => url,
            Err(problem) => {
                problems.push(format!("{name}: {problem}"));
                continue;
            }
        };
        match url.strip_prefix(RUNBOOK_BASE) {
            None => problems.push(format!(
                "{name}: runbook_url {url} does not start with {RUNBOOK_BASE}"
            )),
            Some(anchor) if !anchors.contains(anchor) => problems.push(format!(
                "{name}: runbook_url anchor #{anchor} matches no heading of docs/runbooks.md"
            )),
            Some(anchor) if anchor != slug(name) => problems.push(format!(
                "{name}: runbook_url anchor #{anchor} is another alert's (want #{})",
                slug(name)
            )),
            Some(_) => {}
        }
    }
    assert!(
        problems.is_empty(),
        "alerts without a runbook:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn relative_links_in_the_readme_and_docs_resolve() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in handbook_pages() {
        let text = read(&page);
        let dir = Path::new(&page).parent().unwrap_or(Path::new(""));
        for target in link_targets(&text) {
            let external = ["http://", "https://", "mailto:"]
                .iter()
                .any(|scheme| target.starts_with(scheme));
            if external || target.is_empty() {
                continue;
            }
            checked += 1;
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let linked = if file.is_empty() {
                PathBuf::from(&page)
            } else {
                dir.join(file)
            };
            let path = root().join(&linked);
            if !path.exists() {
                broken.push(format!("{page}: {target} (no file {})", linked.display()));
                continue;
            }
            if let Some(anchor) = anchor
                && linked.extension().is_some_and(|e| e == "md")
                && path.is_file()
                && !anchors(&std::fs::read_to_string(&path).unwrap_or_default()).contains(anchor)
            {
                broken.push(format!(
                    "{page}: {target} (no heading with anchor #{anchor} in {})",
                    linked.display()
                ));
            }
        }
    }
    assert!(checked > 0, "no relative link found in README.md or docs/");
    assert!(
        broken.is_empty(),
        "relative links to nothing:\n  {}",
        broken.join("\n  ")
    );
}

#[test]
fn the_handbook_index_lists_every_page() {
    let index = read("docs/README.md");
    let linked: BTreeSet<String> = link_targets(&index)
        .into_iter()
        .map(|target| target.split('#').next().unwrap_or_default().to_string())
        .collect();
    let unlisted: Vec<String> = handbook_pages()
        .into_iter()
        .filter_map(|page| page.strip_prefix("docs/").map(String::from))
        .filter(|page| page != "README.md" && !linked.contains(page))
        .collect();
    assert!(
        unlisted.is_empty(),
        "docs/README.md does not list {unlisted:?}: add a row for each"
    );
}

#[test]
fn slugs_follow_githubs_rule() {
    assert_eq!(slug("HugepoolResizeStalled"), "hugepoolresizestalled");
    assert_eq!(
        slug("Pod Pending: Insufficient hugepages-2Mi"),
        "pod-pending-insufficient-hugepages-2mi"
    );
    assert_eq!(slug("`Fragmented`"), "fragmented");
    assert_eq!(
        slug("Retain and Release (deletion)"),
        "retain-and-release-deletion"
    );
    assert_eq!(slug("snake_case stays"), "snake_case-stays");
    let page = "# A\n## Same\n```\n## Not a heading\n```\n### Same\n";
    let expected: BTreeSet<String> = ["a", "same", "same-1"].map(String::from).into();
    assert_eq!(anchors(page), expected);
}

#[test]
fn links_are_read_outside_code() {
    let page = "See [the guide](docs/user-guide.md#pools) and [x][ref].\n\
                `[not](a-link.md)`\n\
                ```\n[nor](this.md)\n```\n\
                [ref]: docs/reference.md\n\
                <img src=\"docs/images/architecture.svg\" alt=\"\">\n";
    assert_eq!(
        link_targets(page),
        [
            "docs/user-guide.md#pools",
            "docs/reference.md",
            "docs/images/architecture.svg"
        ]
    );
}

#[test]
fn runbook_urls_render_as_the_chart_helper_does() {
    let base = "https://github.com/hugepool-dev/hugepool/blob/main/docs/runbooks.md/";
    assert_eq!(
        rendered_runbook_url(
            r#"{{ include "hugepool.runbookUrl" (list $ "HugepoolResizeStalled") }}"#,
            base
        ),
        Ok(format!("{RUNBOOK_BASE}hugepoolresizestalled"))
    );
    assert_eq!(
        rendered_runbook_url("https://example.com/r.md#x", base),
        Ok("https://example.com/r.md#x".to_string())
    );
    assert!(rendered_runbook_url(r#"{{ include "other" (list $ "X") }}"#, base).is_err());
    assert_eq!(
        yaml_value("a:\n  runbookBaseUrl: \"https://x/y\"\n", "runbookBaseUrl"),
        Some("https://x/y")
    );
}

#[test]
fn alerts_are_read_with_their_runbook_urls() {
    let template = "      rules:\n\
                    \x20       - alert: First\n\
                    \x20         expr: up == 0\n\
                    \x20         annotations:\n\
                    \x20           runbook_url: https://example.com/r.md#first\n\
                    \x20       - alert: \"Second\"\n\
                    \x20         expr: up == 1\n";
    assert_eq!(
        alerts(template),
        [
            Alert {
                name: "First".into(),
                runbook_url: Some("https://example.com/r.md#first".into()),
            },
            Alert {
                name: "Second".into(),
                runbook_url: None,
            },
        ]
    );
}

/// The `.rs` files below `dir` (relative to the root), test files left out.
fn sources(dir: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![root().join(dir)];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir)
            .expect("a source directory")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "tests.rs")
            {
                found.push(path);
            }
        }
    }
    found
}

/// Every Event reason the operator and the agent emit: the first string
/// literal after each `EventType::Normal` or `EventType::Warning` in their
/// code (inline test modules left out).
fn emitted_event_reasons() -> BTreeSet<String> {
    let mut reasons = BTreeSet::new();
    for path in sources("operator/src")
        .into_iter()
        .chain(sources("node-agent/src"))
    {
        let text = std::fs::read_to_string(&path).expect("source");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for kind in ["EventType::Normal", "EventType::Warning"] {
            for (at, _) in code.match_indices(kind) {
                let after = &code[at + kind.len()..];
                let Some(open) = after.find('"') else {
                    continue;
                };
                let literal: String = after[open + 1..]
                    .chars()
                    .take_while(|c| *c != '"')
                    .collect();
                if literal.chars().next().is_some_and(char::is_uppercase)
                    && literal.chars().all(char::is_alphanumeric)
                {
                    reasons.insert(literal);
                }
            }
        }
    }
    reasons
}

#[test]
fn the_reference_lists_every_event_the_code_emits() {
    let emitted = emitted_event_reasons();
    // The scan finds the Events both sides are known to emit.
    for known in [
        "RolloutStarted",
        "DrainStarted",
        "EvictionFailed",
        "ShrinkBlocked",
        "KernelStall",
    ] {
        assert!(emitted.contains(known), "{known} not found in {emitted:?}");
    }
    let reference = read("docs/reference.md");
    let paragraph = reference
        .split("\n\n")
        .find(|p| p.starts_with("Events."))
        .expect("docs/reference.md's Events paragraph");
    let missing: Vec<&String> = emitted
        .iter()
        .filter(|reason| !paragraph.contains(&format!("`{reason}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/reference.md's Events paragraph misses {missing:?}"
    );
}
