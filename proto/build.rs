//! Generates the Rust code for the contract with protox (no system `protoc`)
//! and writes the encoded file descriptor set used by server reflection.

use std::{env, fs, path::PathBuf};

use prost::Message as _;

const PROTOS: &[&str] = &[
    "lattice/agent/v1/content.proto",
    "lattice/agent/v1/agent.proto",
    "lattice/hooks/v1/hooks.proto",
    "lattice/tools/v1/tools.proto",
];

/// The standard error detail messages, served by reflection only (Lattice
/// builds its details with tonic-types).
const ERROR_PROTOS: &[&str] = &["google/rpc/status.proto", "google/rpc/error_details.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=lattice");
    println!("cargo:rerun-if-changed=google");
    let out = PathBuf::from(env::var("OUT_DIR")?);
    let errors = protox::compile(ERROR_PROTOS, ["."])?;
    fs::write(out.join("error_details_descriptor.bin"), errors.encode_to_vec())?;
    let fds = protox::compile(PROTOS, ["."])?;
    fs::write(out.join("lattice_descriptor.bin"), fds.encode_to_vec())?;
    // A request that does not decode is INVALID_ARGUMENT (see src/codec.rs).
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::codec::LatticeCodec")
        .compile_fds(fds)?;
    Ok(())
}
