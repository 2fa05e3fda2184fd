//! A scriptable peer for container tests: a hook or a tool service whose
//! behaviour is set on its command line.
//!
//! - `lattice-test-peer hook --listen 0.0.0.0:50071 --append "[A]" --delay-ms 0`
//!   appends a marker to every tool result (and to the system prompt of
//!   every model request), after an optional delay.
//! - `lattice-test-peer tool --listen 0.0.0.0:50061 --delay-ms 0 --text T`
//!   offers `fetch`, answering `T` after the delay.
//!
//! Both handle SIGTERM (they run as PID 1 in their containers): with
//! `--drain-ms N` they first turn NOT_SERVING and keep serving for N ms, as
//! a rolling update expects; then GOAWAY, the calls in flight finish, exit 0.

use std::{net::SocketAddr, time::Duration};

use clap::{Parser, Subcommand};
use lattice_hook_sdk::{
    Hook, ModelRequestCall, ModelRequestChange, Status, ToolResultBlock, ToolResultCall, async_trait,
};
use lattice_proto::tools::v1::{self as pb, tool_service_server::ToolServiceServer};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// A hook service.
    Hook {
        #[arg(long)]
        listen: SocketAddr,
        /// Appended to tool results and system prompts.
        #[arg(long, default_value = "")]
        append: String,
        /// Replaces a tool result's text (before appending).
        #[arg(long)]
        replace: Option<String>,
        /// Wait this long in every call.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
        /// After SIGTERM, NOT_SERVING but serving this long.
        #[arg(long, default_value_t = 0)]
        drain_ms: u64,
    },
    /// A tool service offering `fetch`.
    Tool {
        #[arg(long)]
        listen: SocketAddr,
        /// Wait this long in every call.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
        /// The answer.
        #[arg(long, default_value = "fetched")]
        text: String,
        /// Answer this many bytes (`x` repeated) instead of `--text`.
        #[arg(long)]
        bytes: Option<usize>,
        /// After SIGTERM, NOT_SERVING but serving this long.
        #[arg(long, default_value_t = 0)]
        drain_ms: u64,
    },
}

struct Appender {
    marker: String,
    replace: Option<String>,
    delay: Duration,
}

#[async_trait]
impl Hook for Appender {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let text = self.replace.clone().unwrap_or_else(|| call.text());
        Ok(Some(call.replace_text(format!("{text}{}", self.marker))))
    }

    async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Ok(ModelRequestChange::system(format!("{}{}", call.system, self.marker)))
    }
}

struct Fetch {
    delay: Duration,
    text: String,
}

#[tonic::async_trait]
impl pb::tool_service_server::ToolService for Fetch {
    async fn list_tools(
        &self,
        _: tonic::Request<pb::ListToolsRequest>,
    ) -> Result<tonic::Response<pb::ListToolsResponse>, Status> {
        Ok(tonic::Response::new(pb::ListToolsResponse {
            tools: vec![pb::Tool { name: "fetch".into(), description: "fetches".into(), input_schema: None }],
        }))
    }

    async fn call_tool(
        &self,
        _: tonic::Request<pb::CallToolRequest>,
    ) -> Result<tonic::Response<pb::CallToolResponse>, Status> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Ok(tonic::Response::new(pb::CallToolResponse {
            content: vec![pb::ToolContent { kind: Some(pb::tool_content::Kind::Text(self.text.clone())) }],
            is_error: false,
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let signal = lattice_hook_sdk::shutdown_signal();
    match Cli::parse().role {
        Role::Hook { listen, append, replace, delay_ms, drain_ms } => {
            let hook = Appender { marker: append, replace, delay: Duration::from_millis(delay_ms) };
            let listener = tokio::net::TcpListener::bind(listen).await?;
            let drain = Duration::from_millis(drain_ms);
            lattice_hook_sdk::Server::new(hook).drain(drain).serve_on(listener, signal).await?;
        }
        Role::Tool { listen, delay_ms, text, bytes, drain_ms } => {
            let text = bytes.map_or(text, |n| "x".repeat(n));
            let listener = tokio::net::TcpListener::bind(listen).await?;
            let (health, health_svc) = tonic_health::server::health_reporter();
            health.set_service_status("", tonic_health::ServingStatus::Serving).await;
            tracing::info!(%listen, "tool serving");
            let drained = async move {
                signal.await;
                health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
                tracing::info!(drain_ms, "draining: NOT_SERVING, still serving calls");
                tokio::time::sleep(Duration::from_millis(drain_ms)).await;
            };
            tonic::transport::Server::builder()
                .add_service(health_svc)
                .add_service(
                    ToolServiceServer::new(Fetch { delay: Duration::from_millis(delay_ms), text })
                        .max_encoding_message_size(usize::MAX),
                )
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    drained,
                )
                .await?;
        }
    }
    Ok(())
}
