//! The operator's files in deploy/ (Prometheus alert rules, the Grafana dashboard) name only
//! metrics this crate exports, so a renamed metric fails here rather than in someone's pager.
//! The rules' behaviour is tested by `promtool test rules deploy/prometheus/alerts_test.yaml`.
#![cfg(feature = "metrics")]

use std::collections::BTreeSet;
use std::sync::Mutex;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// Collects the names `etcd_informer::metrics::describe` describes: every metric the crate has.
#[derive(Default)]
struct Names(Mutex<BTreeSet<(String, &'static str)>>);

impl Names {
    fn add(&self, key: KeyName, kind: &'static str) {
        self.0
            .lock()
            .unwrap()
            .insert((key.as_str().to_owned(), kind));
    }
}

impl Recorder for Names {
    fn describe_counter(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
        self.add(key, "counter");
    }
    fn describe_gauge(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
        self.add(key, "gauge");
    }
    fn describe_histogram(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
        self.add(key, "histogram");
    }
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

fn exported() -> BTreeSet<(String, &'static str)> {
    let names = Names::default();
    metrics::with_local_recorder(&names, etcd_informer::metrics::describe);
    names.0.into_inner().unwrap()
}

/// Every `etcd_informer_*` name in `text`, with a histogram's `_bucket`/`_sum`/`_count`
/// series taken back to the histogram.
fn named_in(text: &str, exported: &BTreeSet<(String, &'static str)>) -> Vec<(String, bool)> {
    let histograms: BTreeSet<&str> = exported
        .iter()
        .filter(|(_, kind)| *kind == "histogram")
        .map(|(n, _)| n.as_str())
        .collect();
    let plain: BTreeSet<&str> = exported.iter().map(|(n, _)| n.as_str()).collect();
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("etcd_informer_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let known = plain.contains(name)
            || ["_bucket", "_sum", "_count"].iter().any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|base| histograms.contains(base))
            });
        out.push((name.to_owned(), known));
        rest = &tail[end..];
    }
    out
}

fn check(file: &str, min_names: usize) {
    let exported = exported();
    assert!(
        exported.len() >= 25,
        "describe() lists {} metrics",
        exported.len()
    );
    let path = format!("{}/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let names = named_in(&text, &exported);
    let unknown: Vec<_> = names.iter().filter(|(_, known)| !known).collect();
    assert!(
        unknown.is_empty(),
        "{file} names metrics the crate does not export: {unknown:?}"
    );
    let distinct: BTreeSet<_> = names.iter().map(|(n, _)| n).collect();
    assert!(
        distinct.len() >= min_names,
        "{file} uses {} metrics: {distinct:?}",
        distinct.len()
    );
}

#[test]
fn alert_rules_use_only_exported_metrics() {
    check("deploy/prometheus/alerts.yaml", 9);
    check("deploy/prometheus/alerts_test.yaml", 9);
}

#[test]
fn dashboard_is_json_and_uses_only_exported_metrics() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/grafana/etcd-informer.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    let rows: Vec<&str> = panels
        .iter()
        .filter(|p| p["type"] == "row")
        .filter_map(|p| p["title"].as_str())
        .collect();
    assert_eq!(
        rows,
        [
            "Informers",
            "Controllers",
            "Sharding and leadership",
            "Cache server"
        ]
    );
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(
            !targets.is_empty(),
            "panel {} queries nothing",
            panel["title"]
        );
    }
    check("deploy/grafana/etcd-informer.json", 20);
}

#[test]
fn the_check_catches_a_renamed_metric() {
    let exported = exported();
    let names = named_in(
        "rate(etcd_informer_events_total[5m]) etcd_informer_reconcile_duration_seconds_bucket etcd_informer_event_total",
        &exported,
    );
    let known: Vec<bool> = names.iter().map(|(_, k)| *k).collect();
    assert_eq!(known, [true, true, false]);
}
