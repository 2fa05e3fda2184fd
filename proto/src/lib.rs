//! The Lattice gRPC contract, generated from the `.proto` files in this crate.
//!
//! - [`agent::v1`]: `lattice.agent.v1.AgentService` and the conversation types.
//! - [`hooks::v1`]: `lattice.hooks.v1.HookService`, implemented by hook services.
//! - [`tools::v1`]: `lattice.tools.v1.ToolService`, implemented by tool services.
//!
//! [`codec`] is the services' codec: prost's, with a request that does not
//! decode answered INVALID_ARGUMENT. With the `logs` feature, the module
//! `logs` holds the rules Lattice's and the hook SDK's log lines share.
//!
//! [`FILE_DESCRIPTOR_SET`] holds the encoded descriptors of all three, for
//! server reflection; [`ERROR_DETAILS_DESCRIPTOR_SET`] those of the standard
//! `google.rpc` error details that Lattice's errors carry.
#![allow(missing_docs, clippy::doc_lazy_continuation, clippy::large_enum_variant)]

pub mod codec;
#[cfg(feature = "logs")]
pub mod logs;

/// `lattice.agent.*`
pub mod agent {
    /// `lattice.agent.v1`
    pub mod v1 {
        tonic::include_proto!("lattice.agent.v1");
    }
}

/// `lattice.hooks.*`
pub mod hooks {
    /// `lattice.hooks.v1`
    pub mod v1 {
        tonic::include_proto!("lattice.hooks.v1");
    }
}

/// `lattice.tools.*`
pub mod tools {
    /// `lattice.tools.v1`
    pub mod v1 {
        tonic::include_proto!("lattice.tools.v1");
    }
}

/// The encoded `FileDescriptorSet` of the whole contract (for reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("lattice_descriptor");

/// The encoded `FileDescriptorSet` of `google/rpc/status.proto` and
/// `google/rpc/error_details.proto` (for reflection: grpcurl decodes a
/// HOOK_FAILED `ErrorInfo` with it).
pub const ERROR_DETAILS_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("error_details_descriptor");

/// Re-exported so that users of the generated types need no direct dependency.
pub use prost_types;

#[cfg(test)]
mod tests {
    use prost::Message as _;

    /// Every file of the contract names its Go package (protoc-gen-go
    /// refuses a file without one), and the error details are served.
    #[test]
    fn every_contract_file_has_a_go_package() {
        let set = prost_types::FileDescriptorSet::decode(super::FILE_DESCRIPTOR_SET).unwrap();
        let ours: Vec<_> = set.file.iter().filter(|f| f.package().starts_with("lattice.")).collect();
        assert_eq!(ours.len(), 4);
        for f in ours {
            let go = f.options.as_ref().map(|o| o.go_package()).unwrap_or_default();
            assert!(go.starts_with("lattice.dev/proto/lattice/"), "{}: {go:?}", f.name());
        }
        let errors = prost_types::FileDescriptorSet::decode(super::ERROR_DETAILS_DESCRIPTOR_SET).unwrap();
        let error_info = errors
            .file
            .iter()
            .filter(|f| f.package() == "google.rpc")
            .flat_map(|f| &f.message_type)
            .find(|m| m.name() == "ErrorInfo");
        assert!(error_info.is_some());
    }
}
