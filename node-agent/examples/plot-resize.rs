//! `cargo run -p hugepool-agent --example plot-resize -- FILE.json [OUT.svg]`:
//! draws a saved resize bench result (node-agent/bench-results/resize-*.json)
//! as the SVG `make bench` writes beside it; OUT defaults to FILE with .svg.

#[path = "../benches/common/plot.rs"]
mod plot;

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(input) = args.next().map(PathBuf::from) else {
        eprintln!("usage: plot-resize FILE.json [OUT.svg]");
        return ExitCode::FAILURE;
    };
    let output = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| input.with_extension("svg"));
    let plotted = std::fs::read_to_string(&input)
        .map_err(|e| format!("{}: {e}", input.display()))
        .and_then(|text| {
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", input.display()))
        })
        .and_then(|document| plot::plot_raw(&document, &output));
    match plotted {
        Ok(()) => {
            println!("{}", output.display());
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("plot-resize: {err}");
            ExitCode::FAILURE
        }
    }
}

// The plot's tests live here, not in benches/common/plot.rs: a bench is
// built with cfg(test) but runs no tests, so they would be dead code there.
#[cfg(test)]
mod tests {
    use super::plot::*;

    fn run(strategy: &str, total: f64, writes: &[f64]) -> serde_json::Value {
        serde_json::json!({
            "size": "2Mi", "hvo": false, "direction": "shrink", "strategy": strategy,
            "totalMs": total, "interleaved": true,
            "writes": writes.iter().map(|ms| serde_json::json!({"pages": 1, "ms": ms})).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn writes_end_at_their_latency_plus_an_even_share_of_the_gaps() {
        // 40 ms in all, 30 in writes: 5 ms before each write.
        let points = write_times(&run("engine, saved model", 40.0, &[10.0, 20.0])).unwrap();
        assert_eq!(points, vec![(15.0, 10.0), (40.0, 20.0)]);
    }

    #[test]
    fn a_panel_holds_the_median_run_and_only_the_largest_fixed_steps() {
        // A run of the engine's extra resizes for the p99: not in the medians.
        let mut extra = run("engine, saved model", 1.0, &[1.0]);
        extra["interleaved"] = false.into();
        let document = serde_json::json!({
            "budgetMs": 50.0,
            "runs": [
                run("one write", 90.0, &[90.0]),
                run("one write", 60.0, &[60.0]),
                run("one write", 70.0, &[70.0]),
                run("fixed steps of 64", 100.0, &[1.0; 8]),
                run("fixed steps of 1024", 50.0, &[25.0, 25.0]),
                run("engine, saved model", 62.0, &[30.0, 30.0]),
                extra,
            ],
        });
        let panels = panels(&document).unwrap();
        assert_eq!(panels.len(), 1);
        assert_eq!(panels[0].title, "2Mi shrink, HVO off");
        let names: Vec<&str> = panels[0].series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["one write", "fixed steps of 1024", "engine, saved model"]
        );
        assert_eq!(panels[0].series[0].points, vec![(70.0, 70.0)]);
        assert_eq!(panels[0].series[2].points, vec![(31.0, 30.0), (62.0, 30.0)]);
    }

    #[test]
    fn the_svg_draws_every_series_and_the_budget_line() {
        let panels = vec![
            Panel {
                title: "2Mi shrink, HVO on".into(),
                series: vec![
                    Series {
                        name: "one write".into(),
                        points: vec![(99.0, 99.0)],
                    },
                    Series {
                        name: "engine, saved model".into(),
                        points: vec![(40.0, 38.0), (80.0, 36.0), (120.0, 35.0)],
                    },
                ],
            },
            Panel {
                title: "2Mi grow, HVO on".into(),
                series: vec![Series {
                    name: "engine, saved model".into(),
                    points: vec![(30.0, 29.0), (60.0, 28.0)],
                }],
            },
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("resize.svg");
        write_svg(&path, "write latency", &panels, 50.0).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in [
            "write latency",
            "2Mi shrink, HVO on",
            "2Mi grow, HVO on",
            "one write (1 write)",
            "engine, saved model (3 writes)",
            "engine, saved model (2 writes)",
            "budget 50 ms",
            X_LABEL,
            Y_LABEL,
        ] {
            assert!(svg.contains(text), "no {text:?} in the SVG");
        }
        // Every write is a circle, and every series has one in its legend.
        let circles = svg.matches("<circle").count();
        assert_eq!(circles, (1 + 3 + 2) + 3);
        // The budget line, dashed, in each panel.
        let budget = format!(
            "stroke=\"#{:02X}{:02X}{:02X}\"",
            BUDGET_COLOUR.0, BUDGET_COLOUR.1, BUDGET_COLOUR.2
        );
        assert!(
            svg.matches(&budget).count() >= 2 * 2,
            "{budget} drawn too rarely"
        );
    }
}
