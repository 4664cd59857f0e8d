//! Seven ranks in one process, two of them Byzantine: rank 5 sends its vector sign-flipped and
//! scaled by 1000, rank 6 sends NaN and infinities. Every honest rank runs the same robust
//! all-reduce with mean, median and trimmed mean; the table compares each with the mean of the
//! honest vectors. The example asserts that the robust rules stay inside the honest range and
//! that the mean does not.
//!
//! `cargo run --release --example quickstart`

#![allow(clippy::print_stdout)]

use byzcoll::aggregators::{Aggregator, Mean, Median, TrimmedMean};
use byzcoll::transports::local::LocalTransport;
use byzcoll::{Communicator, Config, Error, Policy};

const N: usize = 7;
const F: usize = 2;
const D: usize = 1 << 16;

fn honest(rank: usize) -> Vec<f32> {
    (0..D)
        .map(|j| 1.0 + 0.1 * (j as f32 * 0.01).sin() + 0.01 * rank as f32)
        .collect()
}

/// What rank `rank` sends; `nan_attack` switches rank 6's NaN attack on.
fn contribution(rank: usize, nan_attack: bool) -> Vec<f32> {
    match rank {
        5 => honest(5).iter().map(|x| -1000.0 * x).collect(),
        6 if nan_attack => (0..D)
            .map(|j| [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][j % 3])
            .collect(),
        _ => honest(rank),
    }
}

#[derive(Debug)]
enum Cell {
    Result { max_dev: f32, in_range: bool },
    Refused(String),
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cell::Result { max_dev, in_range } => write!(
                f,
                "max |x - honest mean| = {max_dev:<9.4} {}",
                if *in_range {
                    "inside honest range"
                } else {
                    "OUTSIDE honest range"
                }
            ),
            Cell::Refused(why) => write!(f, "refused: {why}"),
        }
    }
}

fn judge(result: Result<Vec<f32>, Error>) -> Cell {
    let v = match result {
        Ok(v) => v,
        Err(Error::Aggregation(e)) => return Cell::Refused(e.to_string()),
        Err(e) => panic!("unexpected error: {e}"),
    };
    let honest: Vec<Vec<f32>> = (0..N - F).map(honest).collect();
    let mut max_dev = 0.0f32;
    let mut in_range = true;
    for (j, x) in v.iter().enumerate() {
        let col = honest.iter().map(|h| h[j]);
        let mean = col.clone().sum::<f32>() / (N - F) as f32;
        let lo = col.clone().fold(f32::INFINITY, f32::min);
        let hi = col.fold(f32::NEG_INFINITY, f32::max);
        max_dev = max_dev.max((x - mean).abs());
        in_range &= x.is_finite() && lo <= *x && *x <= hi;
    }
    Cell::Result { max_dev, in_range }
}

#[tokio::main]
async fn main() {
    let rules: Vec<Box<dyn Aggregator>> = vec![
        Box::new(Mean::new()),
        Box::new(Median::new(F)),
        Box::new(TrimmedMean::new(F)),
    ];
    let rules = std::sync::Arc::new(rules);
    let tasks: Vec<_> = LocalTransport::world(N)
        .into_iter()
        .map(|t| {
            let rules = rules.clone();
            tokio::spawn(async move {
                let mut comm = Communicator::new(Box::new(t), Config::default());
                let me = comm.rank();
                let mut rows = Vec::new();
                for nan_attack in [true, false] {
                    for rule in rules.iter() {
                        let mut v = contribution(me, nan_attack);
                        let r = comm
                            .robust_all_reduce(&mut v, rule.as_ref(), Policy::Gather)
                            .await
                            .map(|_| v);
                        rows.push(r);
                    }
                }
                // Collective: a rank left behind by a quorum round (stragglers are allowed by
                // default) still gets what it needs from the others before they go.
                comm.close().await;
                (me, rows)
            })
        })
        .collect();

    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("rank panicked"));
    }
    println!("byzcoll quickstart: {N} ranks, f = {F}, d = {D} float32, local transport");
    println!("rank 5 sends -1000 x its vector; rank 6 sends NaN/+inf/-inf (first column only)\n");
    println!(
        "{:<13} | {:<58} | sign-flip only",
        "rule", "sign-flip + NaN/inf"
    );
    println!("{}", "-".repeat(140));
    let mut honest_rows: Option<Vec<String>> = None;
    for (me, rows) in results {
        if me >= N - F {
            continue;
        }
        let cells: Vec<Cell> = rows.into_iter().map(judge).collect();
        let shown: Vec<String> = cells.iter().map(|c| c.to_string()).collect();
        // Every honest rank must have come to the same conclusions.
        if let Some(first) = &honest_rows {
            assert_eq!(first, &shown, "rank {me} disagrees with rank 0");
            continue;
        }
        for (i, rule) in rules.iter().enumerate() {
            println!(
                "{:<13} | {:<58} | {}",
                rule.name(),
                shown[i],
                shown[i + rules.len()]
            );
        }
        for (i, cell) in cells.iter().enumerate() {
            let robust = i % rules.len() != 0;
            match (robust, cell) {
                (true, Cell::Result { in_range, .. }) => {
                    assert!(in_range, "robust rule left the honest range")
                }
                (true, Cell::Refused(why)) => panic!("robust rule refused: {why}"),
                (false, Cell::Result { in_range, .. }) => {
                    assert!(!in_range, "the mean survived an attack?")
                }
                (false, Cell::Refused(_)) => {}
            }
        }
        honest_rows = Some(shown);
    }
    println!("\nOK: median and trimmed mean stayed inside the honest range on every honest rank; the mean did not.");
}
