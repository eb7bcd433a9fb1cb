//! Keeps the metric tables of docs/operations.md in step with what the
//! binaries export: the tables read as (names, labels) rows, an OpenMetrics
//! text as families with the labels their samples carry. Each binary's
//! metrics tests compare the two.

use std::collections::{BTreeMap, BTreeSet};

/// The rows of the metrics table under the line `intro` (e.g. "Agent (per
/// node):") in `markdown`: the metric names in backticks of the first
/// column, the label names in backticks of the second.
pub fn documented(markdown: &str, intro: &str) -> Vec<(Vec<String>, BTreeSet<String>)> {
    let ticked = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    markdown
        .lines()
        .skip_while(|line| line.trim() != intro)
        .skip(1)
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2)
        .filter_map(|row| {
            let cells: Vec<&str> = row.split('|').collect();
            Some((
                ticked(cells.get(1)?),
                ticked(cells.get(2)?).into_iter().collect(),
            ))
        })
        .collect()
}

/// Every family of an OpenMetrics text by the name its samples carry
/// (counters with `_total`, info metrics with `_info`, histograms by their
/// own name) and the label names its samples have (a histogram's `le`
/// left out). A family with no sample has no labels here.
pub fn exported(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut families: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        if let (Some(name), Some(kind)) = (words.next(), words.next()) {
            let shown = match kind {
                "counter" => format!("{name}_total"),
                "info" => format!("{name}_info"),
                _ => name.to_string(),
            };
            families.push((name.to_string(), shown));
        }
    }
    let mut exported: BTreeMap<String, BTreeSet<String>> = families
        .iter()
        .map(|(_, shown)| (shown.clone(), BTreeSet::new()))
        .collect();
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let Some((sample, labels)) = line.split_once('{') else {
            continue;
        };
        // The family whose name is the longest prefix of the sample's.
        let Some((_, shown)) = families
            .iter()
            .filter(|(name, _)| sample.starts_with(name.as_str()))
            .max_by_key(|(name, _)| name.len())
        else {
            continue;
        };
        let labels = labels.split_once('}').map_or("", |(labels, _)| labels);
        let names = labels
            .split(',')
            .filter_map(|pair| pair.split_once('=').map(|(name, _)| name.trim()))
            .filter(|name| !name.is_empty() && *name != "le")
            .map(str::to_string);
        exported.entry(shown.clone()).or_default().extend(names);
    }
    exported
}

/// What differs between a table and an export: names only one side has,
/// and rows whose labels differ from their metrics' (the union over the
/// row's names). Empty when they agree.
pub fn differences(
    table: &[(Vec<String>, BTreeSet<String>)],
    exported: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let documented: BTreeSet<&String> = table.iter().flat_map(|(names, _)| names).collect();
    for name in exported.keys().filter(|name| !documented.contains(name)) {
        problems.push(format!("{name} is exported but not in the table"));
    }
    for (names, labels) in table {
        let mut seen = BTreeSet::new();
        for name in names {
            match exported.get(name) {
                Some(found) => seen.extend(found.iter().cloned()),
                None => problems.push(format!("{name} is in the table but not exported")),
            }
        }
        if &seen != labels {
            problems.push(format!(
                "{names:?}: the table says labels {labels:?}, the samples carry {seen:?}"
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
Intro (x):

| metric | labels | what |
|---|---|---|
| `a_total` | `size`, `state` (in_use, free) | one |
| `b`, `c` | `size` (, `numa`) | two |
| `d_info` | | three |

after
";

    const TEXT: &str = "\
# HELP a A.
# TYPE a counter
a_total{size=\"2Mi\",state=\"free\"} 1
# TYPE b gauge
b{size=\"2Mi\"} 1
# TYPE c histogram
c_bucket{size=\"2Mi\",numa=\"0\",le=\"0.1\"} 1
c_count{size=\"2Mi\",numa=\"0\"} 1
# TYPE d info
d_info{version=\"1\"} 1
# EOF
";

    #[test]
    fn a_table_and_an_export_are_read_and_compared() {
        let table = documented(TABLE, "Intro (x):");
        assert_eq!(table.len(), 3);
        assert_eq!(table[1].0, ["b", "c"]);
        assert_eq!(
            table[1].1,
            BTreeSet::from(["size".to_string(), "numa".to_string()])
        );
        let exported = exported(TEXT);
        assert_eq!(
            exported.keys().collect::<Vec<_>>(),
            ["a_total", "b", "c", "d_info"]
        );
        assert_eq!(
            differences(&table, &exported),
            [r#"["d_info"]: the table says labels {}, the samples carry {"version"}"#]
        );
    }
}
