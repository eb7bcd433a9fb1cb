//! The fleet bench's picture of a rollout: nodes changing and converged
//! over time against the rollout's maxUnavailable (tests:
//! operator/tests/rollout_plot.rs).

use std::path::Path;

use plotters::prelude::*;

/// One reading of a rollout, `seconds` after its pools were patched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RolloutSample {
    pub seconds: f64,
    /// Nodes that carry the new target and whose agent has not reported it.
    pub changing: usize,
    /// Nodes whose agent has reported the new target.
    pub converged: usize,
}

pub const CHANGING: &str = "changing (new target, not yet reported)";
pub const CONVERGED: &str = "converged (reported at the new target)";
pub const X_LABEL: &str = "seconds since the pools were patched";
pub const Y_LABEL: &str = "nodes";

pub const CHANGING_COLOUR: RGBColor = RGBColor(255, 127, 14);
pub const CONVERGED_COLOUR: RGBColor = RGBColor(31, 119, 180);
pub const LIMIT_COLOUR: RGBColor = RGBColor(214, 39, 40);

/// Draws `samples` of a rollout over `nodes` nodes as an SVG at `path`,
/// with a horizontal line at `max_unavailable` nodes (`limit`: how it was
/// set, such as "10%").
pub fn write_svg(
    path: &Path,
    title: &str,
    samples: &[RolloutSample],
    nodes: usize,
    max_unavailable: usize,
    limit: &str,
) -> Result<(), String> {
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    let draw_error = |e: DrawingAreaErrorKind<_>| format!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(draw_error)?;
    let x_max = samples.iter().map(|s| s.seconds).fold(1.0, f64::max) * 1.02;
    let y_max = nodes.max(max_unavailable).max(1) as f64 * 1.08;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc(X_LABEL)
        .y_desc(Y_LABEL)
        .y_label_formatter(&|nodes| format!("{nodes:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(draw_error)?;
    let limit_at = max_unavailable as f64;
    chart
        .draw_series(DashedLineSeries::new(
            [(0.0, limit_at), (x_max, limit_at)],
            6,
            4,
            LIMIT_COLOUR.stroke_width(2),
        ))
        .map_err(draw_error)?
        .label(format!("maxUnavailable {limit} = {max_unavailable} nodes"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], LIMIT_COLOUR.stroke_width(2)));
    for (name, colour, count) in [
        (
            CHANGING,
            CHANGING_COLOUR,
            (|s: &RolloutSample| s.changing) as fn(&RolloutSample) -> usize,
        ),
        (CONVERGED, CONVERGED_COLOUR, |s: &RolloutSample| s.converged),
    ] {
        chart
            .draw_series(LineSeries::new(
                samples.iter().map(|s| (s.seconds, count(s) as f64)),
                colour.stroke_width(2),
            ))
            .map_err(draw_error)?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(draw_error)?;
    root.present().map_err(draw_error)
}
