//! A watch response split as etcd splits one for a watch created with `fragment`: whole
//! events, each fragment under the limit unless one event alone is larger.

use etcd_client::proto::PbWatchResponse;
use tonic_prost::prost::Message;

// WatchResponse's `events` field number.
const EVENTS_FIELD: u32 = 11;

/// `response` split as etcd splits a response to a watch created with `fragment`: when it is
/// `limit` bytes or more and holds two events or more, into responses under `limit` bytes
/// (one event alone may exceed it), each with the same header, all but the last marked
/// `fragment`. The client joins them again.
pub(super) fn fragments(mut response: PbWatchResponse, limit: usize) -> Vec<PbWatchResponse> {
    if response.events.len() < 2 || response.encoded_len() < limit {
        return vec![response];
    }
    let events = std::mem::take(&mut response.events);
    response.fragment = true;
    let base = response.encoded_len();
    let mut out: Vec<PbWatchResponse> = Vec::new();
    let mut size = base;
    for event in events {
        let len = tonic_prost::prost::encoding::message::encoded_len(EVENTS_FIELD, &event);
        match out.last_mut() {
            Some(current) if current.events.is_empty() || size + len < limit => {
                current.events.push(event);
                size += len;
            }
            _ => {
                let mut next = response.clone();
                next.events.push(event);
                out.push(next);
                size = base + len;
            }
        }
    }
    if let Some(last) = out.last_mut() {
        last.fragment = false;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::proto::{PbEvent, PbKeyValue};

    /// A response of watch 7 with one put of `bytes` bytes per entry of `sizes`.
    fn response(sizes: &[usize]) -> PbWatchResponse {
        let event = |bytes: usize| PbEvent {
            kv: Some(PbKeyValue {
                key: b"k".to_vec(),
                value: vec![b'v'; bytes],
                ..Default::default()
            }),
            ..Default::default()
        };
        PbWatchResponse {
            watch_id: 7,
            events: sizes.iter().map(|&b| event(b)).collect(),
            ..Default::default()
        }
    }

    /// (fragment, events) of each response.
    fn shape(responses: &[PbWatchResponse]) -> Vec<(bool, usize)> {
        responses
            .iter()
            .map(|r| (r.fragment, r.events.len()))
            .collect()
    }

    #[test]
    fn a_response_is_split_as_etcd_splits_it() {
        // Under the limit, or one event alone: as it is.
        assert_eq!(shape(&fragments(response(&[100, 100]), 1000)), [(false, 2)]);
        assert_eq!(shape(&fragments(response(&[5000]), 1000)), [(false, 1)]);
        // Each fragment under the limit but an event that alone exceeds it; the last is
        // not marked.
        let split = fragments(response(&[400, 400, 400, 5000, 100]), 1000);
        assert_eq!(shape(&split), [(true, 2), (true, 1), (true, 1), (false, 1)]);
        for r in &split {
            assert_eq!(r.watch_id, 7);
            assert!(
                r.events.len() == 1 || r.encoded_len() < 1000,
                "{}",
                r.encoded_len()
            );
        }
    }
}
