//! `audit`: records what it saw, keeps everything.
//!
//! Appends one JSON line per call to `--file` (default `audit.jsonl`): the
//! event, its context, and the value as it stands after the hooks before it
//! in the chain. Put it after a redaction hook and the audit log holds only
//! redacted values. It never changes anything (an unset reply), and refuses
//! (an error status, which aborts the query) when it cannot write, so that
//! nothing passes unaudited.
//!
//! Run: `cargo run -p lattice-hook-sdk --example audit -- --listen 127.0.0.1:50073 --file audit.jsonl`
//! and register it for both events.

use std::{net::SocketAddr, path::PathBuf};

use clap::Parser;
use lattice_hook_sdk::{
    Hook, ModelRequestCall, ModelRequestChange, Status, ToolResultBlock, ToolResultCall, async_trait, text_of,
};
use serde_json::json;
use tokio::{io::AsyncWriteExt, sync::Mutex};

/// The hook.
pub struct Audit {
    file: Mutex<tokio::fs::File>,
}

impl Audit {
    /// Appends to `path`.
    pub async fn open(path: &std::path::Path) -> std::io::Result<Self> {
        let file = tokio::fs::OpenOptions::new().create(true).append(true).open(path).await?;
        Ok(Self { file: Mutex::new(file) })
    }

    async fn write(&self, line: serde_json::Value) -> Result<(), Status> {
        let mut f = self.file.lock().await;
        f.write_all(format!("{line}\n").as_bytes()).await.map_err(|e| Status::internal(format!("audit log: {e}")))?;
        f.flush().await.map_err(|e| Status::internal(format!("audit log: {e}")))
    }
}

fn context(c: lattice_hook_sdk::HookContext) -> serde_json::Value {
    json!({"agent": c.agent, "session_id": c.session_id, "query_id": c.query_id, "turn": c.turn})
}

#[async_trait]
impl Hook for Audit {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        let result = &call.result;
        self.write(json!({
            "event": "tool_result",
            "context": context(call.context),
            "tool_name": call.tool_name,
            "tool_use_id": call.tool_use_id,
            "is_error": result.is_error,
            "text": text_of(result),
        }))
        .await?;
        Ok(None)
    }

    async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        let messages: Vec<serde_json::Value> =
            call.messages.iter().map(|m| json!({"role": m.role().as_str_name(), "blocks": m.content.len()})).collect();
        self.write(json!({
            "event": "model_request",
            "context": context(call.context),
            "system": call.system,
            "messages": messages,
            "tools": call.tools.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
        }))
        .await?;
        Ok(ModelRequestChange::keep())
    }
}

#[derive(Parser)]
struct Args {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:50073")]
    listen: SocketAddr,
    /// The JSONL file to append to.
    #[arg(long, default_value = "audit.jsonl")]
    file: PathBuf,
    /// Log lines: text or json.
    #[arg(long, default_value = "text")]
    log_format: lattice_hook_sdk::LogFormat,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    lattice_hook_sdk::init_logs(args.log_format);
    let audit = Audit::open(&args.file).await?;
    lattice_hook_sdk::serve(audit, args.listen).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lattice_hook_sdk::TextBlock;

    #[tokio::test]
    async fn records_what_it_saw_and_keeps_it() {
        let path = std::env::temp_dir().join(format!("lattice-audit-{}.jsonl", std::process::id()));
        let audit = Audit::open(&path).await.unwrap();
        let call = ToolResultCall {
            tool_name: "lookup".into(),
            tool_use_id: "t1".into(),
            result: ToolResultBlock {
                tool_use_id: "t1".into(),
                content: vec![TextBlock { text: "seen".into() }],
                is_error: false,
            },
            ..Default::default()
        };
        assert_eq!(audit.on_tool_result(call).await.unwrap(), None);
        assert!(audit.on_model_request(ModelRequestCall::default()).await.unwrap().is_keep());
        let lines = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
        assert_eq!(first["text"], "seen");
        assert_eq!(first["tool_use_id"], "t1");
        assert_eq!(lines.lines().count(), 2);
    }
}
