//! The rows a bench prints, also written as JSON to `target/bench/<bench>.json`, for
//! `scripts/plot-benches.py` to draw.

use serde_json::{json, Value};

/// A bench's rows, written when [`Rows::write`] is called.
pub(crate) struct Rows {
    bench: &'static str,
    meta: Value,
    rows: Vec<Value>,
}

impl Rows {
    /// No rows yet; `meta` describes the run (world size, dimensions, ...).
    pub(crate) fn new(bench: &'static str, meta: Value) -> Self {
        Rows {
            bench,
            meta,
            rows: Vec::new(),
        }
    }

    /// Adds one row (an object).
    pub(crate) fn push(&mut self, row: Value) {
        self.rows.push(row);
    }

    /// Writes `target/bench/<bench>.json` under the package and says so in a comment line;
    /// a failure to write is printed, not fatal (the text table is the primary output).
    pub(crate) fn write(&self) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
        let path = dir.join(format!("{}.json", self.bench));
        let doc = json!({ "bench": self.bench, "meta": self.meta, "rows": self.rows });
        let written = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&path, serde_json::to_string_pretty(&doc)?));
        match written {
            Ok(()) => println!("# rows as JSON: {}", path.display()),
            Err(e) => println!("# rows not written to {}: {e}", path.display()),
        }
    }
}

/// Progress of a long bench on stderr (drawn only where stderr is a terminal, so logs and CI
/// output stay clean): a bar over `len` items, or a spinner with the elapsed time when `len`
/// is `None`. (Short benches leave it unused.)
#[allow(dead_code)]
pub(crate) fn progress(len: Option<u64>, what: &str) -> indicatif::ProgressBar {
    let (bar, template) = match len {
        Some(len) => (
            indicatif::ProgressBar::new(len),
            "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})",
        ),
        None => (
            indicatif::ProgressBar::new_spinner(),
            "{prefix} {spinner} {msg} ({elapsed})",
        ),
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar.set_prefix(what.to_string());
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// A tokio runtime for a bench: the multi-threaded one with two workers, or a current-thread
/// one, where the task awaiting a collective also runs the transport's tasks (what ranks run
/// on unless a bench is told otherwise).
#[allow(dead_code)]
pub(crate) fn runtime(multi_thread: bool) -> tokio::runtime::Runtime {
    let mut builder = if multi_thread {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    builder.enable_all().build().expect("tokio runtime")
}

/// The command line as `T`: `--help` prints and exits 0; a bad value is clap's message, for
/// the bench to print and exit with status 2.
#[allow(dead_code)]
pub(crate) fn parse_cli<T: clap::Parser>() -> Result<T, String> {
    T::try_parse().map_err(|e| match e.kind() {
        clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => e.exit(),
        _ => e.to_string(),
    })
}
