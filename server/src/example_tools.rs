//! The example tool service: customer lookup over a small embedded dataset
//! whose records hold emails, phone numbers and card numbers, which is what
//! the quickstart's redaction hook exists to hide. Run it with
//! `lattice example-tools --listen ADDR`.

use std::future::Future;

use lattice_proto::tools::v1::{
    self as pb,
    tool_service_server::{ToolService, ToolServiceServer},
};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::{convert, incoming};

/// The embedded customers (fictional).
const CUSTOMERS: &str = r#"[
  {"id": "C-1001", "name": "Ada Lovelace", "email": "ada.lovelace@example.com", "phone": "+44 20 7946 0958",
   "plan": "enterprise", "card": "4111 1111 1111 1111", "notes": "Prefers email. Renewal due in March."},
  {"id": "C-1002", "name": "Grace Hopper", "email": "grace@navy.example.org", "phone": "+1 (555) 010-7788",
   "plan": "team", "card": "5555-5555-5555-4444", "notes": "Asked about SSO; api key sk_live_51HxQ2eZvKYlo2CExampleKey9 was pasted in a ticket."},
  {"id": "C-1003", "name": "Alan Turing", "email": "alan.turing@example.net", "phone": "+44 161 496 0000",
   "plan": "free", "card": "", "notes": "Evaluating the product."}
]"#;

/// The customer-lookup tool service.
#[derive(Debug, Clone)]
pub struct CustomerTools {
    customers: Vec<Value>,
}

impl Default for CustomerTools {
    fn default() -> Self {
        Self { customers: serde_json::from_str(CUSTOMERS).unwrap_or_default() }
    }
}

fn schema(v: Value) -> Option<prost_types::Struct> {
    v.as_object().map(convert::to_struct)
}

fn text(t: String, is_error: bool) -> pb::CallToolResponse {
    pb::CallToolResponse { content: vec![pb::ToolContent { kind: Some(pb::tool_content::Kind::Text(t)) }], is_error }
}

#[tonic::async_trait]
impl ToolService for CustomerTools {
    async fn list_tools(&self, _: Request<pb::ListToolsRequest>) -> Result<Response<pb::ListToolsResponse>, Status> {
        Ok(Response::new(pb::ListToolsResponse {
            tools: vec![
                pb::Tool {
                    name: "lookup_customer".into(),
                    description:
                        "Finds customers whose name, id or email contains the query; returns their full records.".into(),
                    input_schema: schema(
                        json!({"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}),
                    ),
                },
                pb::Tool {
                    name: "list_customers".into(),
                    description: "Lists customer ids and names.".into(),
                    input_schema: schema(json!({"type": "object", "properties": {}})),
                },
            ],
        }))
    }

    async fn call_tool(&self, request: Request<pb::CallToolRequest>) -> Result<Response<pb::CallToolResponse>, Status> {
        let call = request.into_inner();
        let input = convert::from_struct(call.input);
        info!(tool = %call.name, tool_use_id = %call.tool_use_id, "tool call");
        let reply = match call.name.as_str() {
            "lookup_customer" => match input.get("query").and_then(Value::as_str) {
                Some(q) if !q.trim().is_empty() => {
                    let q = q.to_lowercase();
                    let hits: Vec<&Value> = self
                        .customers
                        .iter()
                        .filter(|c| {
                            ["id", "name", "email"]
                                .iter()
                                .any(|k| c[k].as_str().is_some_and(|v| v.to_lowercase().contains(&q)))
                        })
                        .collect();
                    if hits.is_empty() {
                        text(format!("no customer matches {q:?}"), false)
                    } else {
                        text(serde_json::to_string_pretty(&hits).unwrap_or_default(), false)
                    }
                }
                _ => text("input.query must be a non-empty string".into(), true),
            },
            "list_customers" => {
                let list: Vec<Value> =
                    self.customers.iter().map(|c| json!({"id": c["id"], "name": c["name"]})).collect();
                text(serde_json::to_string_pretty(&list).unwrap_or_default(), false)
            }
            other => return Err(Status::not_found(format!("no tool named {other:?}"))),
        };
        Ok(Response::new(reply))
    }
}

/// Serves the example tools on `listener` until `shutdown` resolves, then
/// drains for `drain`: health NOT_SERVING at once, calls still served until
/// the drain ends (so that a rolling update loses none), then GOAWAY and the
/// calls in flight finish.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    drain: std::time::Duration,
) -> Result<(), tonic::transport::Error> {
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<ToolServiceServer<CustomerTools>>().await;
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    info!(%addr, "example tools serving");
    let drained = async move {
        shutdown.await;
        health.set_not_serving::<ToolServiceServer<CustomerTools>>().await;
        health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        info!(drain_ms = drain.as_millis() as u64, "draining: NOT_SERVING, still serving calls");
        tokio::time::sleep(drain).await;
    };
    tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(ToolServiceServer::new(CustomerTools::default()))
        .serve_with_incoming_shutdown(incoming(listener), drained)
        .await
}
