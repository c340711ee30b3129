//! Compiles proto/synapse.proto with protox (a pure-Rust protobuf compiler: no protoc
//! needed), generates the tonic services, and saves the descriptor set for the HTTP/JSON
//! gateway, the OpenAPI document and gRPC server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler
        .include_imports(true)
        .include_source_info(true)
        // The wrapper and struct types ride along so that `Any` payloads holding them
        // (text, JSON objects) have descriptors for the HTTP gateway's JSON.
        .open_files([
            "synapse.proto",
            "google/protobuf/wrappers.proto",
            "google/protobuf/struct.proto",
        ])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // The encoded set keeps the extension options (the `google.api.http` rules) that
    // prost_types' structs would drop.
    std::fs::write(
        out.join("synapse_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Smaller starting call buffers (src/protocols/synapse/codec.rs).
        .codec_path("crate::protocols::synapse::codec::SmallBufferCodec")
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
