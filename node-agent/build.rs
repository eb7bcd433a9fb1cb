//! Compiles the kubelet's DRA proto (proto/) into
//! the tonic services of `hugepool_agent::dra`, with protox: no protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/dra.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
