//! Lattice's connection plumbing, shared by the server (`lattice`) and the
//! Rust hook SDK; not part of the contract (`lattice-proto`), and not an
//! API of its own.
//!
//! **Gathered writes.** h2 writes a connection's frames one write (and one
//! trip through the kernel) at a time: each DATA frame of 256 bytes or
//! more on its own, with a flush after it. On loopback and in a pod
//! network each write costs both sides the kernel's whole send and receive
//! path, so a unary call or reply that leaves in two or three writes costs
//! more than its bytes. The connections below hold small writes and write
//! them together ([`gather`]), each side deciding when:
//!
//! - [`corked`]: Lattice's hook and tool connections (it runs their tasks,
//!   and writes after each poll);
//! - [`served`]: Lattice's API listener (the next poll of the connection's
//!   task), and the hook SDK's (a reply in one write).
//!
//! This relies on how h2 writes (it flushes after large DATA frames and
//! after each poll's frames), which h2 does not promise. So it has a
//! switch, on by default: `[server] gather_writes = false` for Lattice,
//! `Server::gather_writes(false)` for the SDK. Off, h2 writes to the socket
//! as it would without this crate: the figures of `docs/performance.md`'s
//! gathered writes are then lost, nothing else changes.
//!
//! **Serving.** [`incoming`] (accepted connections with TCP_NODELAY) and
//! [`shutdown_signal`] (SIGTERM or Ctrl-C), which Lattice and the SDK both
//! serve with.

pub mod corked;
pub mod gather;
pub mod served;

use tokio::net::TcpListener;

pub use corked::cork;
pub use served::{Events, Replies};

/// Accepted connections with TCP_NODELAY. Serving from one's own listener
/// bypasses tonic's socket setup, and with Nagle's algorithm on, small gRPC
/// frames wait for delayed ACKs: ~40 ms a round trip on loopback.
pub fn incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Resolves on SIGTERM or Ctrl-C. The SIGTERM handler is installed when
/// this is called, not when the future is first polled: call it before the
/// port opens, so that a SIGTERM that comes right after is not the default
/// action (an abrupt exit).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        #[cfg(unix)]
        if let Some(mut term) = term {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}
