//! `kiln bench --plot FILE.png`: output tokens/s and inter-token latency
//! against concurrency, a line per KV format (and mode), in one picture.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

/// One line of the plot: its label and `(concurrency, output tok/s, ITL
/// p50 ms)` points.
pub type Line = (String, Vec<(usize, f64, f64)>);

/// Why the plot could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// No font to write the axes with.
    #[error(
        "no TrueType font for the plot's labels: install one (Debian: fonts-dejavu-core) or set KILN_PLOT_FONT to a .ttf file"
    )]
    NoFont,
    /// Drawing or writing the picture failed.
    #[error("drawing {path}: {message}")]
    Draw {
        /// The picture.
        path: PathBuf,
        /// What failed.
        message: String,
    },
}

/// Where fonts commonly are, after `KILN_PLOT_FONT`.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

fn register_font() -> Result<(), PlotError> {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = FONT.get_or_init(|| {
        let from_env = std::env::var_os("KILN_PLOT_FONT").map(PathBuf::from);
        let found = from_env
            .into_iter()
            .chain(FONTS.iter().map(PathBuf::from))
            .find_map(|p| std::fs::read(p).ok());
        // plotters keeps the font for the process's life.
        found.is_some_and(|bytes| {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    });
    if *ok { Ok(()) } else { Err(PlotError::NoFont) }
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws `lines` into a PNG at `path`: throughput on the left, latency on
/// the right, concurrency on a log axis in both.
pub fn plot(lines: &[Line], title: &str, path: &Path) -> Result<(), PlotError> {
    register_font()?;
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: path.to_owned(),
        message: e.to_string(),
    };
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(700);
    let points = lines.iter().flat_map(|(_, p)| p.iter());
    let max_c = points.clone().map(|p| p.0).max().unwrap_or(1).max(2) as f64;
    let max_tps = points.clone().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let max_itl = points.map(|p| p.2).fold(1.0, f64::max) * 1.1;
    for (area, y_label, max_y, pick) in [
        (&left, "output tokens/s", max_tps, 1usize),
        (&right, "inter-token latency p50 (ms)", max_itl, 2),
    ] {
        let mut chart = ChartBuilder::on(area)
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d((1.0..max_c * 1.2).log_scale(), 0.0..max_y)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("concurrent sequences")
            .y_desc(y_label)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(|e| err(&e))?;
        for (i, (label, pts)) in lines.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let xy: Vec<(f64, f64)> = pts
                .iter()
                .map(|p| (p.0 as f64, if pick == 1 { p.1 } else { p.2 }))
                .collect();
            chart
                .draw_series(LineSeries::new(xy.clone(), color.stroke_width(3)))
                .map_err(|e| err(&e))?
                .label(label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
            chart
                .draw_series(xy.into_iter().map(|p| Circle::new(p, 4, color.filled())))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_of_two_formats_is_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench.png");
        let lines = vec![
            (
                "bf16".to_owned(),
                vec![(1, 100.0, 10.0), (4, 350.0, 11.0), (16, 900.0, 17.0)],
            ),
            (
                "fp8".to_owned(),
                vec![(1, 110.0, 9.0), (4, 380.0, 10.5), (16, 1000.0, 16.0)],
            ),
        ];
        plot(&lines, "kiln bench", &path).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        assert!(png.len() > 10_000, "{} bytes: an empty picture?", png.len());
    }
}
