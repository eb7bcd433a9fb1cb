//! The resize bench's picture: each write's latency over the time since its
//! resize began, per (size, HVO, direction), one write against the engine
//! and the largest fixed steps, with the budget as a line. Drawn from the
//! raw JSON the bench saves (`save_raw`), so the bench and
//! `cargo run -p hugepool-agent --example plot-resize -- FILE.json` draw
//! the same picture.

use std::path::Path;

use plotters::prelude::*;

/// One strategy's resize: each write as (ms since the resize began, at the
/// write's end; the write's latency in ms).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart of the grid: one size, HVO state and direction.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

/// The x axis, said once for the chart and the docs.
pub const X_LABEL: &str = "ms since the resize began (writes + the pauses and reads between them)";
pub const Y_LABEL: &str = "write latency, ms";

const PANEL_WIDTH: u32 = 560;
const PANEL_HEIGHT: u32 = 380;
const HEADER: u32 = 40;

/// Draws `document` (a resize-*.json) as an SVG at `path`.
pub fn plot_raw(document: &serde_json::Value, path: &Path) -> Result<(), String> {
    let budget_ms = document["budgetMs"]
        .as_f64()
        .ok_or("the result has no budgetMs")?;
    let panels = panels(document)?;
    let at = document["at"].as_str().unwrap_or("?");
    let title = format!(
        "Write latency over a resize, kernel {}, {} (the median run of each strategy)",
        document["kernel"].as_str().unwrap_or("?"),
        at.get(..10).unwrap_or(at),
    );
    write_svg(path, &title, &panels, budget_ms)
}

/// (size, HVO, direction): one panel.
type PanelKey = (String, bool, String);
/// A strategy's name and its runs.
type StrategyRuns<'a> = (String, Vec<&'a serde_json::Value>);

/// The panels of a saved result: per (size, HVO, direction), in the order
/// the bench ran them, one write, the fixed steps with the fewest writes
/// (smaller steps stretch the time axis tenfold and say nothing new) and the
/// engine, each as its median run by total time over the interleaved
/// repetitions.
pub fn panels(document: &serde_json::Value) -> Result<Vec<Panel>, String> {
    let runs = document["runs"]
        .as_array()
        .ok_or("the result has no runs")?;
    // Panels and their strategies in the order the bench ran them.
    let mut groups: Vec<(PanelKey, Vec<StrategyRuns>)> = Vec::new();
    for run in runs {
        if run["interleaved"].as_bool() == Some(false) {
            continue;
        }
        let key = (
            run["size"].as_str().ok_or("a run has no size")?.to_string(),
            run["hvo"].as_bool().ok_or("a run has no hvo")?,
            run["direction"]
                .as_str()
                .ok_or("a run has no direction")?
                .to_string(),
        );
        let strategy = run["strategy"]
            .as_str()
            .ok_or("a run has no strategy")?
            .to_string();
        let group = match groups.iter_mut().position(|(k, _)| *k == key) {
            Some(i) => &mut groups[i].1,
            None => {
                groups.push((key, Vec::new()));
                &mut groups.last_mut().expect("pushed").1
            }
        };
        match group.iter_mut().find(|(s, _)| *s == strategy) {
            Some((_, of)) => of.push(run),
            None => group.push((strategy, vec![run])),
        }
    }
    let mut panels = Vec::new();
    for ((size, hvo, direction), strategies) in groups {
        let fewest_fixed = strategies
            .iter()
            .filter(|(s, _)| s.starts_with("fixed steps"))
            .filter_map(|(s, of)| Some((s, median_run(of)?["writes"].as_array()?.len())))
            .min_by_key(|(_, writes)| *writes)
            .map(|(s, _)| s.clone());
        let mut series = Vec::new();
        for (strategy, of) in &strategies {
            if strategy.starts_with("fixed steps") && Some(strategy) != fewest_fixed.as_ref() {
                continue;
            }
            let Some(run) = median_run(of) else { continue };
            series.push(Series {
                name: strategy.clone(),
                points: write_times(run)?,
            });
        }
        panels.push(Panel {
            title: format!("{size} {direction}, HVO {}", if hvo { "on" } else { "off" }),
            series,
        });
    }
    if panels.is_empty() {
        return Err("the result has no interleaved runs".into());
    }
    Ok(panels)
}

/// The run whose total is the median (the lower one of an even count).
fn median_run<'a>(runs: &[&'a serde_json::Value]) -> Option<&'a serde_json::Value> {
    let mut sorted: Vec<&serde_json::Value> = runs.to_vec();
    sorted.sort_by(|a, b| {
        let total = |r: &serde_json::Value| r["totalMs"].as_f64().unwrap_or(f64::NAN);
        total(a).total_cmp(&total(b))
    });
    sorted.get(sorted.len().checked_sub(1)? / 2).copied()
}

/// Each write's end (ms since the resize began) and latency. The result
/// keeps only the writes' latencies and the run's total, so the time
/// outside the writes (the engine's pauses, pool reads) is shared evenly
/// before each write: the last write ends at the run's total.
pub fn write_times(run: &serde_json::Value) -> Result<Vec<(f64, f64)>, String> {
    let latencies: Vec<f64> = run["writes"]
        .as_array()
        .ok_or("a run has no writes")?
        .iter()
        .map(|w| w["ms"].as_f64().ok_or("a write has no ms"))
        .collect::<Result<_, _>>()?;
    let total = run["totalMs"].as_f64().ok_or("a run has no totalMs")?;
    let between = (total - latencies.iter().sum::<f64>()).max(0.0) / latencies.len().max(1) as f64;
    let mut now = 0.0;
    Ok(latencies
        .into_iter()
        .map(|latency| {
            now += between + latency;
            (now, latency)
        })
        .collect())
}

/// The colour of a strategy, by its name, so every panel agrees.
fn colour(name: &str) -> RGBColor {
    match name {
        "one write" => RGBColor(214, 39, 40),
        "engine, saved model" => RGBColor(31, 119, 180),
        "engine, cold start" => RGBColor(23, 190, 207),
        _ => RGBColor(127, 127, 127),
    }
}

pub const BUDGET_COLOUR: RGBColor = RGBColor(44, 160, 44);

/// Draws `panels` in a grid two wide (HVO off, on) with a horizontal line
/// at `budget_ms` in each.
pub fn write_svg(path: &Path, title: &str, panels: &[Panel], budget_ms: f64) -> Result<(), String> {
    let columns = panels.len().clamp(1, 2);
    let rows = panels.len().div_ceil(columns);
    let size = (
        PANEL_WIDTH * columns as u32,
        PANEL_HEIGHT * rows as u32 + HEADER,
    );
    let root = SVGBackend::new(path, size).into_drawing_area();
    let draw_error = |e: DrawingAreaErrorKind<_>| format!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(draw_error)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(draw_error)?;
    for (panel, area) in panels.iter().zip(root.split_evenly((rows, columns))) {
        let x_max = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .fold(1.0, f64::max)
            * 1.05;
        let y_max = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(budget_ms, f64::max)
            // Headroom for the legend above the highest write.
            * 1.5;
        let mut chart = ChartBuilder::on(&area)
            .caption(&panel.title, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .x_desc(X_LABEL)
            .y_desc(Y_LABEL)
            .x_label_formatter(&|ms| format!("{ms:.0}"))
            .y_label_formatter(&|ms| format!("{ms:.0}"))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(draw_error)?;
        let budget_label = format!("budget {budget_ms:.0} ms");
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, budget_ms), (x_max, budget_ms)],
                6,
                4,
                BUDGET_COLOUR.stroke_width(2),
            ))
            .map_err(draw_error)?
            .label(budget_label)
            .legend(|(x, y)| {
                PathElement::new([(x, y), (x + 16, y)], BUDGET_COLOUR.stroke_width(2))
            });
        for series in &panel.series {
            let colour = colour(&series.name);
            if series.points.len() > 1 {
                chart
                    .draw_series(LineSeries::new(
                        series.points.iter().copied(),
                        colour.stroke_width(1),
                    ))
                    .map_err(draw_error)?;
            }
            // One write is one point: drawn larger so it reads alone.
            let radius = if series.points.len() == 1 { 6 } else { 4 };
            chart
                .draw_series(
                    series
                        .points
                        .iter()
                        .map(|p| Circle::new(*p, radius, colour.filled())),
                )
                .map_err(draw_error)?
                .label(match series.points.len() {
                    1 => format!("{} (1 write)", series.name),
                    n => format!("{} ({n} writes)", series.name),
                })
                .legend(move |(x, y)| Circle::new((x + 8, y), 4, colour.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()
            .map_err(draw_error)?;
    }
    root.present().map_err(draw_error)
}
