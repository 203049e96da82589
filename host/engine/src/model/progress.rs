//! Progress of long loads (a model's layers, a weight conversion, the
//! default model's unpacking), drawn on stderr with an estimate of the
//! time left. indicatif draws nothing where stderr is not a terminal, so
//! logs and tests stay clean.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar of `len` steps labelled `what`; finish it with
/// `finish_and_clear`.
pub(crate) fn bar(len: usize, what: String) -> ProgressBar {
    styled(len as u64, what, "{pos}/{len}")
}

/// A bar of `len` bytes labelled `what`.
pub(crate) fn bytes(len: u64, what: String) -> ProgressBar {
    styled(len, what, "{bytes}/{total_bytes}")
}

fn styled(len: u64, what: String, count: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    let template = format!("{{msg}} [{{bar:30}}] {count} ({{elapsed}}, about {{eta}} left)");
    let style = ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what);
    bar
}
