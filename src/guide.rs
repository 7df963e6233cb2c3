//! The guide: how to use the crate, chapter by chapter, guarantees first.
//!
//! Every Rust example in these chapters is compiled by `cargo test --doc`, and those that need
//! no etcd (they use [`testing::FakeSource`](crate::testing::FakeSource)) also run. The
//! chapters are the Markdown files of `docs/guide/` in the repository.
//!
//! **Using the library**
//!
//! 1. [Getting started](getting_started): the first informer, reading its cache, the examples.
//! 2. [Codecs and your own type](codecs): from etcd's bytes to your type; values that do not
//!    decode.
//! 3. [Indexes](indexes): reading by a field, counting per index value.
//! 4. [Handlers and their guarantees](handlers): order, deletes, slow handlers, state.
//! 5. [Shutting down](shutting_down): Ctrl-C, and what awaiting `run` waits for.
//! 6. [Controllers, the runner, sharding](controllers): reconciles, leader election, shards.
//! 7. [Consistent reads and read-your-writes](consistent_reads): how fresh the cache is, and
//!    how to wait until it is fresh enough.
//! 8. [Snapshots and warm restarts](snapshots): starting from a local file instead of a list.
//! 9. [The compact cache](compact_cache): memory against read time.
//!
//! **Running it**
//!
//! 10. [Faults and what health tells you](faults_and_health): outages, hung members, wiped
//!     stores, the audit, readiness.
//! 11. [Metrics and operating](metrics_and_operating): logs, metrics, alert rules, dashboard.
//! 12. [Serving etcd's API](serving): the cache server, for the author of an etcd client.
//! 13. [The cache server's operator's guide](operator): the `etcd-cache-server` binary.
//! 14. [etcd versions and their bugs](etcd_versions): what the informer does about each.
//!
//! **Reference**
//!
//! 15. [Coming from client-go](coming_from_client_go): the names, and the differences on purpose.
//!
//! Measured figures are in the repository's `BENCHMARKS.md` (speed, memory, what etcd spends)
//! and `RELIABILITY.md` (convergence after faults); how a change travels through the code is in
//! `ARCHITECTURE.md`.

#[doc = include_str!("../docs/guide/01-getting-started.md")]
pub mod getting_started {}

#[doc = include_str!("../docs/guide/02-codecs.md")]
pub mod codecs {}

#[doc = include_str!("../docs/guide/03-indexes.md")]
pub mod indexes {}

#[doc = include_str!("../docs/guide/04-handlers.md")]
pub mod handlers {}

#[doc = include_str!("../docs/guide/05-shutting-down.md")]
pub mod shutting_down {}

#[doc = include_str!("../docs/guide/06-controllers.md")]
pub mod controllers {}

#[doc = include_str!("../docs/guide/07-consistent-reads.md")]
pub mod consistent_reads {}

#[doc = include_str!("../docs/guide/08-snapshots.md")]
pub mod snapshots {}

#[doc = include_str!("../docs/guide/09-compact-cache.md")]
pub mod compact_cache {}

#[doc = include_str!("../docs/guide/10-faults-and-health.md")]
pub mod faults_and_health {}

#[doc = include_str!("../docs/guide/11-metrics-and-operating.md")]
pub mod metrics_and_operating {}

#[doc = include_str!("../docs/guide/12-serving.md")]
pub mod serving {}

#[doc = include_str!("../docs/operator.md")]
pub mod operator {}

#[doc = include_str!("../docs/guide/13-etcd-versions.md")]
pub mod etcd_versions {}

#[doc = include_str!("../docs/guide/14-coming-from-client-go.md")]
pub mod coming_from_client_go {}
