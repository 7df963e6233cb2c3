//! Compiles the protobuf schemas in proto/ when the `protobuf` feature is on (needs `protoc`,
//! which etcd-client's own build needs anyway).

fn main() {
    println!("cargo:rerun-if-changed=proto");
    #[cfg(feature = "protobuf")]
    if let Err(e) = prost_build::compile_protos(&["proto/configmap.proto"], &["proto/"]) {
        panic!("compiling proto/configmap.proto failed (is protoc installed? apt-get install protobuf-compiler): {e}");
    }
}
