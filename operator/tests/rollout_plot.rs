//! The fleet bench's rollout picture (benches/fleet/plot.rs), drawn from a
//! small rollout in memory.

#[path = "../benches/fleet/plot.rs"]
mod plot;

use plot::{
    CHANGING, CHANGING_COLOUR, CONVERGED, CONVERGED_COLOUR, LIMIT_COLOUR, RolloutSample, X_LABEL,
    Y_LABEL, write_svg,
};
use plotters::style::RGBColor;

fn hex(colour: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", colour.0, colour.1, colour.2)
}

/// The points of the polylines drawn in `colour` (a series' line and its
/// legend mark).
fn polylines(svg: &str, colour: RGBColor) -> Vec<usize> {
    svg.split("<polyline")
        .skip(1)
        .filter(|element| element.contains(&format!("stroke=\"{}\"", hex(colour))))
        .filter_map(|element| {
            let points = element.split("points=\"").nth(1)?.split('"').next()?;
            Some(points.split_whitespace().count())
        })
        .collect()
}

#[test]
fn the_rollout_svg_draws_changing_converged_and_max_unavailable() {
    // 20 nodes at 10%: two at a time, each reported a second later.
    let samples: Vec<RolloutSample> = (0..=10)
        .map(|second| RolloutSample {
            seconds: second as f64,
            changing: if second < 10 { 2 } else { 0 },
            converged: 2 * second,
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rollout.svg");
    write_svg(&path, "rollout of 20 nodes", &samples, 20, 2, "10%").expect("drawn");
    let svg = std::fs::read_to_string(&path).expect("the SVG is written");
    for text in [
        "rollout of 20 nodes",
        CHANGING,
        CONVERGED,
        "maxUnavailable 10% = 2 nodes",
        X_LABEL,
        Y_LABEL,
    ] {
        assert!(svg.contains(text), "no {text:?} in the SVG");
    }
    // Each series is one line through every sample, plus its legend mark.
    assert_eq!(polylines(&svg, CHANGING_COLOUR), vec![samples.len(), 2]);
    assert_eq!(polylines(&svg, CONVERGED_COLOUR), vec![samples.len(), 2]);
    // The limit is dashed: several segments and its legend mark.
    let limit = polylines(&svg, LIMIT_COLOUR);
    assert!(limit.len() > 3, "the maxUnavailable line: {limit:?}");
}
