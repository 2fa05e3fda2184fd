//! The Lattice gRPC contract, generated from the `.proto` files in this crate.
//!
//! - [`agent::v1`]: `lattice.agent.v1.AgentService` and the conversation types.
//! - [`hooks::v1`]: `lattice.hooks.v1.HookService`, implemented by hook services.
//! - [`tools::v1`]: `lattice.tools.v1.ToolService`, implemented by tool services.
//!
//! [`codec`] is the services' codec: prost's, with a request that does not
//! decode answered INVALID_ARGUMENT.
//!
//! [`FILE_DESCRIPTOR_SET`] holds the encoded descriptors of all three, for
//! server reflection; [`ERROR_DETAILS_DESCRIPTOR_SET`] those of the standard
//! `google.rpc` error details that Lattice's errors carry.
#![allow(missing_docs, clippy::doc_lazy_continuation, clippy::large_enum_variant)]

pub mod codec;

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
