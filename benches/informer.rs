//! Placeholder; the benchmark is being written.
fn main() {}
