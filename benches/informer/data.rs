//! The objects written: keys, values and their sequence numbers.

use super::*;

pub(super) fn rel_key(i: usize) -> String {
    format!("ns-{:02}/cm-{:08}", i % NAMESPACES, i)
}

pub(super) fn full_key(prefix: &str, i: usize) -> String {
    format!("{prefix}{}", rel_key(i))
}

/// The value of key `i` carrying sequence number `seq`, padded to about `size` bytes of JSON.
pub(super) fn make_value(i: usize, seq: u64, size: usize) -> Vec<u8> {
    const TIERS: [&str; 3] = ["web", "api", "db"];
    let mut labels = BTreeMap::new();
    labels.insert("app".to_owned(), format!("app-{}", i % 100));
    labels.insert("tier".to_owned(), TIERS[i % 3].to_owned());
    labels.insert("release".to_owned(), format!("r{}", i % 7));
    let mut data = BTreeMap::new();
    data.insert("seq".to_owned(), seq.to_string());
    data.insert("payload".to_owned(), String::new());
    let mut cm = ConfigMap {
        namespace: format!("ns-{:02}", i % NAMESPACES),
        name: format!("cm-{i:08}"),
        labels,
        data,
    };
    let base = serde_json::to_vec(&cm).expect("encode").len();
    if size > base {
        // Varied filler, so decoding is not a run of one byte.
        let filler: String = (0..size - base)
            .map(|k| {
                let c = (i.wrapping_mul(31) + seq as usize + k * 7) % 36;
                char::from_digit(c as u32, 36).unwrap_or('x')
            })
            .collect();
        cm.data.insert("payload".to_owned(), filler);
    }
    serde_json::to_vec(&cm).expect("encode")
}

pub(super) fn prefix_range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

pub(super) fn seq_of(cm: &ConfigMap) -> Option<u64> {
    cm.data.get("seq")?.parse().ok()
}
