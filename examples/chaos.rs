//! The chaos soak: faults injected into a real 3-member etcd cluster under an informer, round
//! after round, measuring how long the cache takes to equal etcd again after each fault ends and
//! checking the handler's history (the driver is `etcd_informer::testing::chaos`).
//!
//! ```text
//! cargo run --release --example chaos -- --rounds 5 --seed 42 --endpoints both
//! ```
//!
//! - `--rounds N`: rounds of each fault kind per endpoint mode (default 3), in a seeded order;
//! - `--seed S`: the schedule's seed (default: from the clock; printed);
//! - `--endpoints one|all|both`: the informer's client gets member 0 only, all members, or
//!   each in turn (default both);
//! - `--quick`: the test suite's short timings (probes after 500 ms of silence, protective
//!   backoff 50 ms to 1 s) instead of the library's defaults (probes after 1 s, idle timeout
//!   2 s, client-go's 800 ms to 30 s), which are what the figures in RELIABILITY.md are
//!   measured with.
//!
//! Prints a line per round, then, per fault kind and endpoint mode, the rounds run, the median,
//! p90 and worst time from the fault ending (a hung member: from the hang) to the cache matching
//! etcd, and how many rounds made the
//! informer relist; then every history violation. Exits non-zero on
//! a violation or on a round that never converges (that endpoint mode stops there).

mod common;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_informer::testing::chaos::{fault_schedule, Chaos, ChaosConfig, Endpoints, Fault};
use etcd_informer::{Backoff, EtcdOptions};

#[tokio::main]
async fn main() -> ExitCode {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let Ok(rounds) = common::arg("rounds", "3").parse::<usize>() else {
        eprintln!("--rounds takes a number");
        return ExitCode::FAILURE;
    };
    let seed = common::arg("seed", "");
    let seed = if seed.is_empty() {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    } else if let Ok(seed) = seed.parse::<u64>() {
        seed
    } else {
        eprintln!("--seed takes a number");
        return ExitCode::FAILURE;
    };
    let modes = match common::arg("endpoints", "both").as_str() {
        "one" => vec![Endpoints::One],
        "all" => vec![Endpoints::All],
        "both" => vec![Endpoints::One, Endpoints::All],
        other => {
            eprintln!("--endpoints takes one, all or both, not {other}");
            return ExitCode::FAILURE;
        }
    };
    let quick = std::env::args().any(|a| a == "--quick");
    println!(
        "chaos soak: seed {seed}, {rounds} round(s) of each fault kind per endpoint mode, {} timeouts",
        if quick { "quick" } else { "default" }
    );

    // Per fault kind and endpoint mode: convergence times, the same counted from when the
    // informer's member answered a linearizable read (one endpoint, restart and wipe), and
    // rounds that relisted.
    type Times = (Vec<Duration>, Vec<Duration>, usize);
    let mut times: BTreeMap<(Endpoints, Fault), Times> = BTreeMap::new();
    let mut failures: Vec<String> = Vec::new();
    for endpoints in modes {
        let mut config = ChaosConfig::new(seed, endpoints);
        if !quick {
            config.etcd = EtcdOptions::default();
            config.backoff = Backoff::default();
        }
        let mut chaos = match Chaos::start(config).await {
            Ok(chaos) => chaos,
            Err(e) => {
                println!("{e}");
                failures.push(e.to_string());
                continue;
            }
        };
        for fault in fault_schedule(seed, rounds, endpoints) {
            match chaos.round(fault).await {
                Ok(report) => {
                    println!("{report}");
                    let entry = times.entry((endpoints, fault)).or_default();
                    entry.0.push(report.converged_after);
                    if let Some(answered) = report.member_answered_after {
                        entry
                            .1
                            .push(report.converged_after.saturating_sub(answered));
                    }
                    entry.2 += usize::from(report.relists > 0);
                    if let Err(e) = report.check() {
                        println!("{e}");
                        failures.push(e.to_string());
                    }
                }
                Err(e) => {
                    // The cluster or the cache is in an unknown state: stop this mode.
                    println!("{e}");
                    failures.push(e.to_string());
                    break;
                }
            }
        }
    }

    println!();
    println!(
        "{:<14} {:<14} {:>6} {:>10} {:>10} {:>10} {:>9}   from the member's first linearizable answer: median / p90 / worst",
        "endpoints", "fault", "rounds", "median", "p90", "worst", "relisted",
    );
    for ((endpoints, fault), (t, answered, relisted)) in times {
        let rounds = t.len();
        let [median, p90, worst] = summary(t);
        let since_answer = if answered.is_empty() {
            String::new()
        } else {
            let [m, p, w] = summary(answered);
            format!("{m:.2}s / {p:.2}s / {w:.2}s")
        };
        println!(
            "{:<14} {:<14} {:>6} {:>9.2}s {:>9.2}s {:>9.2}s {:>9}   {since_answer}",
            endpoints.to_string(),
            fault.to_string(),
            rounds,
            median,
            p90,
            worst,
            relisted
        );
    }
    if failures.is_empty() {
        println!("no violation, every round converged (seed {seed})");
        ExitCode::SUCCESS
    } else {
        println!("{} failure(s) (seed {seed}):", failures.len());
        for f in &failures {
            println!("- {f}");
        }
        ExitCode::FAILURE
    }
}

/// Median, p90 (nearest rank: the smallest time at least 90% of the rounds are within) and
/// worst, in seconds.
fn summary(mut t: Vec<Duration>) -> [f64; 3] {
    t.sort();
    let mid = t.len() / 2;
    let median = if t.len() % 2 == 0 {
        (t[mid - 1] + t[mid]) / 2
    } else {
        t[mid]
    };
    let p90 = t[(t.len() * 9).div_ceil(10).max(1) - 1];
    let worst = t[t.len() - 1];
    [median, p90, worst].map(|d| d.as_secs_f64())
}
