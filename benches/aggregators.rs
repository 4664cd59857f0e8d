//! Placeholder: the aggregator benchmark is being written.
fn main() {}
