//! A run's `chart.svg`: loss, evaluation accuracy and throughput per step, drawn from
//! its `metrics.jsonl` with `plotters`. Presentation, not training: behind the engine's
//! `chart` feature (on by default), so a build without it (the web build) leaves
//! plotters out.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use super::runs::{read_metrics, run_name, Result, RunError, StepRecord, CHART_FILE};
use crate::fsutil;

const CHART_SIZE: (u32, u32) = (960, 900);
const FONT: &str = "sans-serif";

struct Series {
    label: &'static str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    markers: bool,
}

impl Series {
    fn new(
        label: &'static str,
        color: RGBColor,
        markers: bool,
        points: impl Iterator<Item = (f64, f64)>,
    ) -> Series {
        Series {
            label,
            color,
            points: points
                .filter(|p| p.0.is_finite() && p.1.is_finite())
                .collect(),
            markers,
        }
    }
}

/// A range that plotters can draw: never empty, never inverted, padded a little.
fn padded_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    let pad = if span > 0.0 {
        span * 0.05
    } else if lo != 0.0 {
        lo.abs() * 0.1
    } else {
        1.0
    };
    (lo - pad, hi + pad)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn draw_panel(
    area: &Area<'_>,
    caption: &str,
    x: (f64, f64),
    series: &[Series],
) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    let y = padded_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18))
        .margin(10)
        .x_label_area_size(32)
        .y_label_area_size(72)
        .build_cartesian_2d(x.0..x.1, y.0..y.1)
        .map_err(err)?;
    let decimals = |span: f64| (1.0 - span.log10().floor()).clamp(0.0, 6.0) as usize;
    let yd = decimals(y.1 - y.0);
    // Steps are whole numbers: at most one label per step, printed without decimals.
    let x_labels = ((x.1 - x.0).floor() as usize + 1).clamp(2, 10);
    let x_fmt = |v: &f64| format!("{v:.0}");
    let y_fmt = move |v: &f64| format!("{v:.yd$}");
    chart
        .configure_mesh()
        .x_desc("step")
        .x_labels(x_labels)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .light_line_style(WHITE)
        .draw()
        .map_err(err)?;
    let mut any = false;
    for s in series.iter().filter(|s| !s.points.is_empty()) {
        any = true;
        let color = s.color;
        let legend = move |(x, y): (i32, i32)| {
            PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
        };
        if s.points.len() >= 2 {
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(s.label)
                .legend(legend);
        }
        if s.markers || s.points.len() == 1 {
            let drawn = chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(err)?;
            if s.points.len() == 1 {
                drawn.label(s.label).legend(legend);
            }
        }
    }
    if any {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 14))
            .draw()
            .map_err(err)?;
    } else {
        chart
            .plotting_area()
            .draw(&Text::new(
                "no data yet",
                ((x.0 + x.1) / 2.0, (y.0 + y.1) / 2.0),
                (FONT, 16),
            ))
            .map_err(err)?;
    }
    Ok(())
}

/// Renders step records as an SVG document: loss (and eval loss), eval accuracy
/// when there is any, and tokens/s, each against the step. Any number of records,
/// zero included, gives a valid document.
pub fn render_chart(records: &[StepRecord], title: &str) -> std::result::Result<String, String> {
    let step = |r: &StepRecord| r.step as f64;
    let loss = [
        Series::new(
            "train loss",
            BLUE,
            false,
            records.iter().map(|r| (step(r), r.loss as f64)),
        ),
        Series::new(
            "eval loss",
            RED,
            true,
            records
                .iter()
                .filter_map(|r| r.eval_loss.map(|l| (step(r), l as f64))),
        ),
    ];
    let accuracy = [Series::new(
        "eval accuracy",
        RGBColor(0, 140, 60),
        true,
        records
            .iter()
            .filter_map(|r| r.eval_accuracy.map(|a| (step(r), a as f64))),
    )];
    let throughput = [Series::new(
        "tokens/s",
        RGBColor(120, 60, 170),
        false,
        records.iter().map(|r| (step(r), r.tokens_per_s)),
    )];
    let mut panels: Vec<(&str, &[Series])> = vec![("loss", &loss)];
    if !accuracy[0].points.is_empty() {
        panels.push(("eval accuracy", &accuracy));
    }
    panels.push(("tokens/s", &throughput));
    let x = padded_range(records.iter().map(step));

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, CHART_SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let root = root.titled(title, (FONT, 22)).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((panels.len(), 1));
        for ((caption, series), area) in panels.iter().zip(&areas) {
            draw_panel(area, caption, x, series)?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// Draws `run_dir/metrics.jsonl` into `run_dir/chart.svg` (written atomically) and
/// returns the chart's path.
pub fn write_chart(run_dir: &Path) -> Result<PathBuf> {
    if !run_dir.is_dir() {
        return Err(RunError::NotARun {
            dir: run_dir.to_path_buf(),
            missing: "the directory does not exist".to_string(),
        });
    }
    let records = read_metrics(run_dir)?;
    let path = run_dir.join(CHART_FILE);
    let title = run_name(run_dir);
    let svg = render_chart(&records, &title).map_err(|detail| RunError::Chart {
        path: path.clone(),
        detail,
    })?;
    fsutil::write_atomic(&path, svg.as_bytes())?;
    Ok(path)
}
