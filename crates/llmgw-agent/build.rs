//! Generates the feed service from `proto/llmgw/feed/v1/feed.proto` with protox (pure Rust, no
//! protoc). Two passes: the service (server and client) uses llmgw-core's hand-written message
//! structs through `extern_path`, so the agent serves exactly what the filter decodes; the
//! messages are also generated on their own so tests can prove both agree on field numbers.
//!
//! Also sets `LLMGW_GIT_COMMIT` for `--version` (see `build_commit.rs`).

#[path = "build_commit.rs"]
mod build_commit;

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    println!("cargo:rerun-if-env-changed=LLMGW_GIT_COMMIT");
    for p in build_commit::watched(&here) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    let commit = build_commit::commit(std::env::var("LLMGW_GIT_COMMIT").ok(), &here);
    println!("cargo:rustc-env=LLMGW_GIT_COMMIT={commit}");

    let proto_root = "../../proto";
    let file = "llmgw/feed/v1/feed.proto";
    println!("cargo:rerun-if-changed={proto_root}/{file}");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);

    let service_dir = out.join("service");
    std::fs::create_dir_all(&service_dir)?;
    let fds = protox::compile([file], [proto_root])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .extern_path(".llmgw.feed.v1", "::llmgw_core::feed")
        .out_dir(&service_dir)
        .compile_fds(fds)?;

    let messages_dir = out.join("messages");
    std::fs::create_dir_all(&messages_dir)?;
    let fds = protox::compile([file], [proto_root])?;
    tonic_prost_build::configure().build_server(false).build_client(false).out_dir(&messages_dir).compile_fds(fds)?;
    Ok(())
}
