//! The command line.

use super::*;

#[derive(Debug, Clone)]
pub(super) struct Args {
    pub(super) keys: usize,
    pub(super) value_bytes: usize,
    pub(super) events: usize,
    pub(super) handlers: usize,
    pub(super) scenarios: Vec<String>,
    pub(super) page_size: i64,
    pub(super) runs: usize,
    pub(super) writers: usize,
    pub(super) latency_puts: usize,
    pub(super) latency_rate: u64,
    pub(super) processing: Processing,
    /// `--cache compact`: the restart scenario's informers keep a compact cache.
    pub(super) compact: bool,
    /// `--index unique`: the restart scenario's informers also index each object by its own
    /// key (a value per object, as names or uids are).
    pub(super) unique_index: bool,
    // Hidden, for the memory child processes.
    pub(super) child: Option<String>,
    pub(super) endpoints: Vec<String>,
    pub(super) prefix: Option<String>,
}

pub(super) fn parse_args() -> Args {
    let mut a = Args {
        keys: 100_000,
        value_bytes: 256,
        events: 20_000,
        handlers: 10,
        scenarios: ALL_SCENARIOS.iter().map(|s| s.to_string()).collect(),
        page_size: EtcdOptions::default().page_size,
        runs: 3,
        writers: 16,
        latency_puts: 2_000,
        latency_rate: 500,
        processing: Processing::default(),
        compact: false,
        unique_index: false,
        child: None,
        endpoints: Vec::new(),
        prefix: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        // `cargo bench` passes `--bench` to harness-less benchmarks.
        if flag == "--bench" {
            continue;
        }
        let mut value = || -> String {
            inline
                .clone()
                .or_else(|| it.next())
                .unwrap_or_else(|| fail(format!("{flag} needs a value")))
        };
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> T {
            v.replace('_', "")
                .parse()
                .unwrap_or_else(|_| fail(format!("{flag}: not a number: {v}")))
        }
        match flag.as_str() {
            "--keys" => a.keys = num(&flag, value()),
            "--value-bytes" => a.value_bytes = num(&flag, value()),
            "--events" => a.events = num(&flag, value()),
            "--handlers" => a.handlers = num(&flag, value()),
            "--page-size" => a.page_size = num(&flag, value()),
            "--runs" => a.runs = num(&flag, value()),
            "--writers" => a.writers = num(&flag, value()),
            "--latency-puts" => a.latency_puts = num(&flag, value()),
            "--latency-rate" => a.latency_rate = num(&flag, value()),
            "--scenario" => {
                a.scenarios = value().split(',').map(|s| s.trim().to_owned()).collect();
                for s in &a.scenarios {
                    if !ALL_SCENARIOS.contains(&s.as_str()) {
                        fail(format!(
                            "unknown scenario {s:?}; known: {}",
                            ALL_SCENARIOS.join(", ")
                        ));
                    }
                }
            }
            "--processing" => {
                a.processing = match value().as_str() {
                    "atomic" => Processing::Atomic,
                    "delta-fifo" => Processing::DeltaFifo,
                    other => fail(format!(
                        "--processing {other:?}: expected atomic or delta-fifo"
                    )),
                }
            }
            "--cache" => {
                a.compact = match value().as_str() {
                    "default" => false,
                    "compact" => true,
                    other => fail(format!("--cache {other:?}: expected default or compact")),
                }
            }
            "--index" => {
                a.unique_index = match value().as_str() {
                    "default" => false,
                    "unique" => true,
                    other => fail(format!("--index {other:?}: expected default or unique")),
                }
            }
            "--child" => a.child = Some(value()),
            "--endpoints" => a.endpoints = value().split(',').map(str::to_owned).collect(),
            "--prefix" => a.prefix = Some(value()),
            "-h" | "--help" => {
                eprintln!(
                    "usage: cargo bench --bench informer -- [--keys N] [--value-bytes S] [--events M] \
                     [--handlers H] [--scenario {}] [--page-size P] [--runs R] [--writers W] \
                     [--latency-puts K] [--latency-rate PUTS_PER_S] [--processing atomic|delta-fifo] \
                     [--cache default|compact] [--index default|unique]",
                    ALL_SCENARIOS.join("|")
                );
                std::process::exit(0);
            }
            other => fail(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if a.keys == 0 || a.runs == 0 || a.writers == 0 || a.page_size < 1 || a.latency_rate == 0 {
        fail("--keys, --runs, --writers, --page-size and --latency-rate must be positive");
    }
    a
}
