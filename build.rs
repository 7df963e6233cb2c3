//! Compiles the protobuf schemas in proto/ when the `protobuf` feature is on (needs `protoc`,
//! which etcd-client's own build needs anyway), and records the git commit the binary is built
//! from (`etcd-cache-server --version`; "unknown" outside a git checkout).

fn main() {
    println!("cargo:rerun-if-changed=proto");
    #[cfg(feature = "protobuf")]
    if let Err(e) = prost_build::compile_protos(&["proto/configmap.proto"], &["proto/"]) {
        panic!("compiling proto/configmap.proto failed (is protoc installed? apt-get install protobuf-compiler): {e}");
    }
    // A new commit moves HEAD or the branch it names.
    for path in [".git/HEAD", ".git/refs/heads"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=ETCD_INFORMER_COMMIT={commit}");
}
