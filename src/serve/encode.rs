//! A Range answer encoded straight from the cache: each key-value written once into one buffer
//! sized up front, with no intermediate message per key (a 100k-key list would otherwise copy
//! every key and value into its own allocation before encoding them again).
//!
//! The wire format is protobuf's, as etcd's `rpc.proto` and `kv.proto` define the messages:
//! `RangeResponse { ResponseHeader header = 1; repeated KeyValue kvs = 2; bool more = 3;
//! int64 count = 4; }` and `KeyValue { bytes key = 1; int64 create_revision = 2; int64
//! mod_revision = 3; int64 version = 4; bytes value = 5; int64 lease = 6; }`, fields at their
//! default value left out (proto3).

use bytes::{Buf, BufMut, Bytes};
use etcd_client::proto::{PbRangeRequest, PbResponseHeader};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::prost::Message;

use super::cache::Found;
use crate::object::Object;

const LENGTH_DELIMITED: u64 = 2;

fn varint_len(v: u64) -> usize {
    // 7 bits a byte; 0 takes one.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

fn tag(field: u64, wire: u64) -> u64 {
    (field << 3) | wire
}

fn int_len(v: i64) -> usize {
    if v == 0 {
        0
    } else {
        1 + varint_len(v as u64)
    }
}

fn put_int(buf: &mut Vec<u8>, field: u64, v: i64) {
    if v != 0 {
        put_varint(buf, tag(field, 0));
        put_varint(buf, v as u64);
    }
}

fn bytes_len(b: &[u8]) -> usize {
    if b.is_empty() {
        0
    } else {
        1 + varint_len(b.len() as u64) + b.len()
    }
}

fn put_bytes(buf: &mut Vec<u8>, field: u64, b: &[u8]) {
    if !b.is_empty() {
        put_varint(buf, tag(field, LENGTH_DELIMITED));
        put_varint(buf, b.len() as u64);
        buf.extend_from_slice(b);
    }
}

fn value(kv: &Object<Vec<u8>>, keys_only: bool) -> &[u8] {
    if keys_only {
        &[]
    } else {
        &kv.value
    }
}

fn kv_len(key: &[u8], kv: &Object<Vec<u8>>, keys_only: bool) -> usize {
    bytes_len(key)
        + int_len(kv.create_revision)
        + int_len(kv.mod_revision)
        + int_len(kv.version)
        + bytes_len(value(kv, keys_only))
        + int_len(kv.lease)
}

/// The encoded `RangeResponse`.
pub(crate) fn range_response(
    header: &PbResponseHeader,
    kvs: &Found,
    keys_only: bool,
    more: bool,
    count: i64,
) -> Bytes {
    let header = header.encode_to_vec();
    let lens: Vec<usize> = kvs
        .iter()
        .map(|(key, kv)| kv_len(key, kv, keys_only))
        .collect();
    let size = 1
        + varint_len(header.len() as u64)
        + header.len()
        + lens
            .iter()
            .map(|l| 1 + varint_len(*l as u64) + l)
            .sum::<usize>()
        + 2
        + int_len(count);
    let mut buf = Vec::with_capacity(size);
    put_varint(&mut buf, tag(1, LENGTH_DELIMITED));
    put_varint(&mut buf, header.len() as u64);
    buf.extend_from_slice(&header);
    for ((key, kv), len) in kvs.iter().zip(lens) {
        put_varint(&mut buf, tag(2, LENGTH_DELIMITED));
        put_varint(&mut buf, len as u64);
        put_bytes(&mut buf, 1, key);
        put_int(&mut buf, 2, kv.create_revision);
        put_int(&mut buf, 3, kv.mod_revision);
        put_int(&mut buf, 4, kv.version);
        put_bytes(&mut buf, 5, value(kv, keys_only));
        put_int(&mut buf, 6, kv.lease);
    }
    if more {
        put_varint(&mut buf, tag(3, 0));
        buf.push(1);
    }
    put_int(&mut buf, 4, count);
    Bytes::from(buf)
}

/// Range's codec: requests decoded as etcd's message, answers sent as encoded bytes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RangeCodec;

impl Codec for RangeCodec {
    type Encode = Bytes;
    type Decode = PbRangeRequest;
    type Encoder = RangeCodec;
    type Decoder = RangeCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RangeCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RangeCodec
    }
}

impl Encoder for RangeCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RangeCodec {
    type Item = PbRangeRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<PbRangeRequest>, Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        PbRangeRequest::decode(bytes)
            .map(Some)
            .map_err(|e| Status::internal(format!("malformed RangeRequest: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use etcd_client::proto::PbRangeResponse;

    use super::*;
    use crate::serve::cache::to_pb;

    #[test]
    fn encodes_as_prost_does() {
        let mut a = Object::new("a", 7, b"value".to_vec());
        a.create_revision = 3;
        a.version = 2;
        a.lease = 1 << 40;
        let b = Object::new("b", 300, Vec::new());
        let kvs: Found = vec![
            (b"/p/a".as_slice().into(), Arc::new(a)),
            (b"/p/b".as_slice().into(), Arc::new(b)),
        ];
        let header = PbResponseHeader {
            cluster_id: u64::MAX,
            member_id: 5,
            revision: 301,
            raft_term: 2,
        };
        for (keys_only, more, count) in [(false, true, 2), (true, false, 0)] {
            let ours = range_response(&header, &kvs, keys_only, more, count);
            let theirs = PbRangeResponse {
                header: Some(header),
                kvs: kvs.iter().map(|(k, kv)| to_pb(k, kv, keys_only)).collect(),
                more,
                count,
            };
            assert_eq!(ours.to_vec(), theirs.encode_to_vec());
        }
    }
}
