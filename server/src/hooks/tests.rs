//! The chain's timing and ordering rules on tokio's paused clock, over an
//! in-process transport: real tonic clients and servers, joined by
//! in-memory pipes, so a test controls time exactly and needs no ports.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use hyper_util::rt::TokioIo;
use lattice_proto::hooks::v1::{self as pb, hook_service_server::HookServiceServer};
use tokio::{sync::mpsc, time::Instant};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint, Server};

use super::*;
use crate::{config::HookEvents, domain::JsonObject, metrics::Metrics, scope::Scope};

/// A hook that waits `delay`, then appends `marker` to the result's text;
/// it records the grpc-timeout of each call it receives.
struct Fake {
    delay: Duration,
    marker: &'static str,
    seen: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl pb::hook_service_server::HookService for Fake {
    async fn on_tool_result(
        &self,
        request: tonic::Request<pb::OnToolResultRequest>,
    ) -> Result<tonic::Response<pb::OnToolResultResponse>, tonic::Status> {
        let timeout = request.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).unwrap_or("");
        self.seen.lock().unwrap().push(timeout.to_owned());
        tokio::time::sleep(self.delay).await;
        let mut result = request.into_inner().result.unwrap_or_default();
        if let Some(t) = result.content.last_mut() {
            t.text.push_str(self.marker);
        }
        Ok(tonic::Response::new(pb::OnToolResultResponse { result: Some(result) }))
    }

    async fn on_model_request(
        &self,
        _: tonic::Request<pb::OnModelRequestRequest>,
    ) -> Result<tonic::Response<pb::OnModelRequestResponse>, tonic::Status> {
        tokio::time::sleep(self.delay).await;
        Ok(tonic::Response::new(pb::OnModelRequestResponse::default()))
    }
}

/// A channel to `hook` served in this process over in-memory pipes.
fn in_process(hook: Fake) -> Channel {
    let (accept, incoming) = mpsc::unbounded_channel::<std::io::Result<tokio::io::DuplexStream>>();
    tokio::spawn(
        Server::builder()
            .add_service(HookServiceServer::new(hook))
            .serve_with_incoming(UnboundedReceiverStream::new(incoming)),
    );
    let connect = tower::service_fn(move |_| {
        let accept = accept.clone();
        async move {
            let (client, server) = tokio::io::duplex(64 * 1024);
            accept.send(Ok(server)).map_err(|_| std::io::Error::other("the in-process server is gone"))?;
            Ok::<_, std::io::Error>(TokioIo::new(client))
        }
    });
    Endpoint::from_static("http://in-process").connect_with_connector_lazy(connect)
}

/// A chain of hooks `(marker, delay, deadline)`, each handling tool
/// results, and what each hook saw as grpc-timeout.
fn chain(hooks: &[(&'static str, Duration, Duration)]) -> (HookChain, Vec<Arc<Mutex<Vec<String>>>>) {
    let mut peers = Vec::new();
    let mut seen = Vec::new();
    for (marker, delay, deadline) in hooks {
        let log = Arc::new(Mutex::new(Vec::new()));
        let def = HookDef {
            name: format!("hook{marker}"),
            endpoint: "http://in-process".into(),
            tls: None,
            events: HookEvents { tool_result: true, model_request: true },
            deadline: *deadline,
            enabled: true,
            required: true,
            conditions: Default::default(),
            shadow_of: None,
        };
        let channel = in_process(Fake { delay: *delay, marker, seen: log.clone() });
        peers.push((def, Peer::over(channel)));
        seen.push(log);
    }
    (HookChain::over("agent", peers, 1 << 20, Arc::new(Metrics::default())), seen)
}

/// Folds one tool result through `chain` with the query's deadline at
/// `deadline`; returns the result and how long it took on the paused clock.
async fn fold(chain: &HookChain, deadline: Instant) -> (Result<ToolResult, ChainError>, Duration) {
    let input = JsonObject::new();
    let view = ToolCallView {
        tool_name: "t",
        tool_use_id: "toolu_1",
        input: &input,
        error: None,
        source: ResultSource::ToolService("in-process".into()),
    };
    let scope = Scope { agent: "agent".into(), session_id: "s".into(), query_id: "q".into(), deadline, audit: None };
    let started = Instant::now();
    let out =
        chain.on_tool_result(Step { scope: &scope, turn: 1 }, &view, ToolResult::text("toolu_1", "x", false)).await;
    (out, started.elapsed())
}

const MS: fn(u64) -> Duration = Duration::from_millis;

/// Each hook gets the previous hook's output, in registered order.
#[tokio::test(start_paused = true)]
async fn the_fold_runs_in_registered_order() {
    let (chain, _) = chain(&[("a", MS(5), MS(1000)), ("b", MS(1), MS(1000)), ("c", MS(3), MS(1000))]);
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    assert_eq!(out.unwrap().content, vec!["xabc".to_owned()]);
    // Strictly one after the other: 5 + 1 + 3 ms.
    assert_eq!(took, MS(9));
}

/// The budget sent to a hook is min(its deadline, what is left of the
/// query's): here the query's 300 ms for the first hook, then the second
/// hook's own 200 ms, then what the first hook left of the query's.
#[tokio::test(start_paused = true)]
async fn the_budget_is_the_smaller_of_the_hook_and_query_deadlines() {
    let (chain, seen) = chain(&[("a", MS(150), MS(1000)), ("b", MS(0), MS(200)), ("c", MS(0), MS(1000))]);
    let (out, _) = fold(&chain, Instant::now() + MS(300)).await;
    assert!(out.is_ok());
    let sent: Vec<String> = seen.iter().map(|s| s.lock().unwrap()[0].clone()).collect();
    assert_eq!(sent, vec!["300000u", "150000u", "150000u"]);
}

/// A hook slower than its own deadline fails the chain at exactly that
/// deadline, as the hook's failure (kind deadline).
#[tokio::test(start_paused = true)]
async fn a_hook_past_its_own_deadline_fails_at_that_deadline() {
    let (chain, _) = chain(&[("a", MS(10_000), MS(500))]);
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    match out {
        Err(ChainError::Hook(e)) => assert_eq!((e.hook.as_str(), e.failure), ("hooka", HookFailure::Deadline)),
        other => panic!("{other:?}"),
    }
    assert_eq!(took, MS(500));
}

/// When the query's deadline is the one that cuts the call, the chain ends
/// at exactly that deadline with QueryDeadline (DEADLINE_EXCEEDED), not as
/// the hook's failure.
#[tokio::test(start_paused = true)]
async fn a_budget_cut_by_the_query_deadline_is_deadline_exceeded() {
    let (chain, _) = chain(&[("a", MS(100), MS(1000)), ("b", MS(10_000), MS(1000))]);
    let (out, took) = fold(&chain, Instant::now() + MS(300)).await;
    assert_eq!(out, Err(ChainError::QueryDeadline));
    assert_eq!(took, MS(300));
}

/// With no time left, no hook is called at all.
#[tokio::test(start_paused = true)]
async fn no_call_is_made_without_time_left() {
    let (chain, seen) = chain(&[("a", MS(0), MS(1000))]);
    let (out, took) = fold(&chain, Instant::now()).await;
    assert_eq!(out, Err(ChainError::QueryDeadline));
    assert_eq!(took, Duration::ZERO);
    assert!(seen[0].lock().unwrap().is_empty());
}

/// A request over the hook limit keeps its newest messages that fit, from
/// a user message that answers no tool call; when nothing fits, nothing is
/// cut (the call then fails as request_too_large).
#[test]
fn a_window_starts_at_a_clean_user_message() {
    use crate::domain::{Block, Role, ToolUse};
    let text = |role, n: usize| Message { role, content: Arc::new([Block::Text { text: "x".repeat(n) }]) };
    let tool_use = Message {
        role: Role::Assistant,
        content: Arc::new([Block::ToolUse(ToolUse { id: "t1".into(), name: "t".into(), input: JsonObject::new() })]),
    };
    let tool_result =
        Message { role: Role::User, content: Arc::new([Block::ToolResult(ToolResult::text("t1", "r", false))]) };
    let messages =
        vec![text(Role::User, 1000), tool_use, tool_result, text(Role::Assistant, 1000), text(Role::User, 100)];
    let encoded = convert::messages_to_pb(&messages);
    assert_eq!(window(&messages, &encoded, 50, 10_000), 0, "everything fits");
    // Without the first message the next clean start is the last prompt:
    // the tool_result at index 2 cannot start a conversation.
    assert_eq!(window(&messages, &encoded, 50, 1_500), 4);
    assert_eq!(window(&messages, &encoded, 50, 60), 0, "nothing fits: nothing is cut");
}

/// A channel whose every connection attempt is refused after `after` (a
/// replica that went away): nothing is ever sent on it.
fn refusing(after: Duration) -> Channel {
    let connect = tower::service_fn(move |_| async move {
        tokio::time::sleep(after).await;
        Err::<TokioIo<tokio::io::DuplexStream>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
    });
    Endpoint::from_static("http://in-process").connect_with_connector_lazy(connect)
}

/// One tool_result hook `hooka` (deadline `deadline`) over several
/// addresses, tried in this order.
fn replicated(channels: Vec<Channel>, deadline: Duration) -> (HookChain, Peer) {
    let def = HookDef {
        name: "hooka".into(),
        endpoint: "dns:///in-process:1".into(),
        tls: None,
        events: HookEvents { tool_result: true, model_request: false },
        deadline,
        enabled: true,
        required: true,
        conditions: Default::default(),
        shadow_of: None,
    };
    let peer = Peer::over_all(channels);
    (HookChain::over("agent", vec![(def, peer.clone())], 1 << 20, Arc::new(Metrics::default())), peer)
}

/// A call refused by one address (it never left Lattice) is sent to the
/// next one within the same budget: the retry's grpc-timeout is what is
/// left, and the refusing address leaves the ready set.
#[tokio::test(start_paused = true)]
async fn a_refused_call_is_retried_on_another_address_within_its_budget() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let good = in_process(Fake { delay: MS(5), marker: "a", seen: seen.clone() });
    let (chain, peer) = replicated(vec![refusing(MS(100)), good], MS(1000));
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    assert_eq!(out.unwrap().content, vec!["xa".to_owned()]);
    assert_eq!(took, MS(105));
    assert_eq!(*seen.lock().unwrap(), vec!["900000u".to_owned()]);
    assert_eq!(peer.ready_addresses(), 1);
    // The next call goes straight to the ready address.
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    assert!(out.is_ok());
    assert_eq!(took, MS(5));
}

/// No retry starts once the call's deadline has come: a connection refused
/// only after the deadline ends the call at the deadline, and the other
/// address is never called.
#[tokio::test(start_paused = true)]
async fn no_retry_starts_past_the_call_deadline() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let good = in_process(Fake { delay: MS(0), marker: "a", seen: seen.clone() });
    let (chain, _) = replicated(vec![refusing(MS(1200)), good], MS(1000));
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    match out {
        Err(ChainError::Hook(e)) => assert_eq!(e.failure, HookFailure::Deadline),
        other => panic!("{other:?}"),
    }
    assert_eq!(took, MS(1000));
    assert!(seen.lock().unwrap().is_empty());
}

/// Every address refusing: the call fails as unavailable once each was
/// tried, and the next call fails at once (no ready address left).
#[tokio::test(start_paused = true)]
async fn every_address_refusing_fails_unavailable_then_at_once() {
    let (chain, peer) = replicated(vec![refusing(MS(100)), refusing(MS(100))], MS(1000));
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    match out {
        Err(ChainError::Hook(e)) => assert_eq!(e.failure, HookFailure::Unavailable),
        other => panic!("{other:?}"),
    }
    assert_eq!(took, MS(200));
    assert_eq!(peer.ready_addresses(), 0);
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    assert!(matches!(out, Err(ChainError::Hook(ref e)) if e.failure == HookFailure::Unavailable), "{out:?}");
    assert_eq!(took, Duration::ZERO);
}

/// A reply as a hook (or a proxy in front of one) might send it, frame by
/// frame.
#[derive(Clone, Debug)]
struct Reply {
    status: u16,
    headers: Vec<(&'static str, &'static str)>,
    /// DATA frames, raw (prefix included).
    data: Vec<Vec<u8>>,
    /// `None`: the stream ends with the last DATA frame (or the headers).
    trailers: Option<Vec<(&'static str, &'static str)>>,
}

/// A channel to a raw HTTP/2 service that reads each request and sends
/// `reply`.
fn replying(reply: Reply) -> Channel {
    let connect = tower::service_fn(move |_| {
        let reply = reply.clone();
        async move {
            let (client, server) = tokio::io::duplex(1 << 20);
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(server).await else { return };
                while let Some(Ok((request, mut respond))) = conn.accept().await {
                    let reply = reply.clone();
                    tokio::spawn(async move {
                        let mut body = request.into_body();
                        while let Some(Ok(data)) = body.data().await {
                            let _ = body.flow_control().release_capacity(data.len());
                        }
                        let mut head = http::Response::builder().status(reply.status);
                        for (k, v) in &reply.headers {
                            head = head.header(*k, *v);
                        }
                        let ends_now = reply.data.is_empty() && reply.trailers.is_none();
                        let Ok(head) = head.body(()) else { return };
                        let Ok(mut send) = respond.send_response(head, ends_now) else { return };
                        let last = reply.data.len();
                        for (i, frame) in reply.data.into_iter().enumerate() {
                            let end = i + 1 == last && reply.trailers.is_none();
                            let _ = send.send_data(frame.into(), end);
                        }
                        if let Some(trailers) = reply.trailers {
                            let mut map = http::HeaderMap::new();
                            for (k, v) in trailers {
                                map.insert(http::HeaderName::from_static(k), http::HeaderValue::from_static(v));
                            }
                            let _ = send.send_trailers(map);
                        }
                    });
                }
            });
            Ok::<_, std::io::Error>(TokioIo::new(client))
        }
    });
    Endpoint::from_static("http://in-process").connect_with_connector_lazy(connect)
}

/// `message` framed as gRPC sends it, with compression flag `flag`.
fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// Hook replies are read by Lattice's own unary call, not tonic's client:
/// for every way a reply can be right or wrong, the outcome (the message,
/// or the status code and whether it came with a transport source) is the
/// one tonic's unary client gives, which `classify` was built on.
#[tokio::test]
async fn hook_replies_read_as_tonic_reads_them() {
    use prost::Message as _;

    let reply = pb::OnToolResultResponse {
        result: Some(lattice_proto::agent::v1::ToolResultBlock {
            tool_use_id: "t1".into(),
            content: vec![lattice_proto::agent::v1::TextBlock { text: "redacted".into() }],
            is_error: false,
        }),
    }
    .encode_to_vec();
    let other = pb::OnToolResultResponse { result: None }.encode_to_vec();
    let ok_head = || vec![("content-type", "application/grpc")];
    let ok_trailers = || Some(vec![("grpc-status", "0")]);
    let case = |data: Vec<Vec<u8>>, trailers| Reply { status: 200, headers: ok_head(), data, trailers };
    // The same with one more response header.
    let with = |header, data, trailers| {
        let mut reply = case(data, trailers);
        reply.headers.push(header);
        reply
    };
    let limit = 64;
    let cases: Vec<(&str, Reply)> = vec![
        ("one message", case(vec![framed(0, &reply)], ok_trailers())),
        (
            "split over frames",
            case(vec![framed(0, &reply)[..3].to_vec(), framed(0, &reply)[3..].to_vec()], ok_trailers()),
        ),
        ("two messages", case(vec![framed(0, &reply), framed(0, &other)], ok_trailers())),
        ("an empty message", case(vec![framed(0, &[])], ok_trailers())),
        ("no message", case(vec![], ok_trailers())),
        ("a status after the message", case(vec![framed(0, &reply)], Some(vec![("grpc-status", "13")]))),
        ("a status, no message", case(vec![], Some(vec![("grpc-status", "9"), ("grpc-message", "no")]))),
        ("no trailers", case(vec![framed(0, &reply)], None)),
        ("cut mid-message", case(vec![framed(0, &reply)[..10].to_vec()], None)),
        ("cut mid-message, then a status", case(vec![framed(0, &reply)[..10].to_vec()], ok_trailers())),
        ("compressed flag", case(vec![framed(1, &reply)], ok_trailers())),
        ("invalid flag", case(vec![framed(7, &reply)], ok_trailers())),
        ("over the limit", case(vec![framed(0, &[b'x'; 65])], ok_trailers())),
        ("does not decode", case(vec![framed(0, &[0xff, 0xff, 0xff])], ok_trailers())),
        ("a second message that does not decode", case(vec![framed(0, &reply), framed(0, &[0xff])], ok_trailers())),
        ("trailers-only error", with(("grpc-status", "7"), vec![], None)),
        ("trailers-only OK", with(("grpc-status", "0"), vec![], None)),
        ("gzip", with(("grpc-encoding", "gzip"), vec![framed(1, &reply)], ok_trailers())),
        ("identity", with(("grpc-encoding", "identity"), vec![framed(0, &reply)], ok_trailers())),
        ("a proxy's 503", Reply { status: 503, headers: vec![], data: vec![], trailers: None }),
        ("a proxy's 404", Reply { status: 404, headers: vec![], data: vec![], trailers: None }),
        ("a proxy's 401", Reply { status: 401, headers: vec![], data: vec![], trailers: None }),
        ("a proxy's 500", Reply { status: 500, headers: vec![], data: vec![], trailers: None }),
        (
            "a 503 with a status",
            Reply { status: 503, headers: vec![], data: vec![], trailers: Some(vec![("grpc-status", "14")]) },
        ),
    ];
    type Outcome = Result<pb::OnToolResultResponse, (Code, bool)>;
    let outcome = |r: Result<tonic::Response<pb::OnToolResultResponse>, tonic::Status>| -> Outcome {
        r.map(tonic::Response::into_inner).map_err(|s| (s.code(), std::error::Error::source(&s).is_some()))
    };
    let request = || pb::OnToolResultRequest { tool_use_id: "t1".into(), ..Default::default() };
    let len = request().encoded_len();
    for (what, reply) in cases {
        let peer = Peer::over_all(vec![replying(reply)]);
        let ours = outcome(
            crate::peer::unary(peer.clone(), wire::ON_TOOL_RESULT, tonic::Request::new(request()), len, limit).await,
        );
        let mut grpc = tonic::client::Grpc::new(peer).max_decoding_message_size(limit);
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(wire::ON_TOOL_RESULT);
        let codec = lattice_proto::codec::LatticeCodec::<pb::OnToolResultRequest, pb::OnToolResultResponse>::default();
        let theirs = outcome(grpc.unary(tonic::Request::new(request()), path, codec).await);
        assert_eq!(ours, theirs, "{what}");
    }
}

/// A shadow hook is off the query's path: on the paused clock, a fold
/// whose shadow takes 500 ms takes its primary's 5 ms, and the shadow's
/// output (its marker) is never applied. Its comparison is counted when it
/// answers, after the fold.
#[tokio::test(start_paused = true)]
async fn a_shadow_never_holds_up_the_chain_and_is_never_applied() {
    let metrics = Arc::new(Metrics::default());
    let def = |name: &str, shadow_of: Option<&str>| HookDef {
        name: name.into(),
        endpoint: "http://in-process".into(),
        tls: None,
        events: HookEvents { tool_result: true, model_request: false },
        deadline: MS(1000),
        enabled: true,
        required: shadow_of.is_none(),
        conditions: Default::default(),
        shadow_of: shadow_of.map(Into::into),
    };
    let seen = || Arc::new(Mutex::new(Vec::new()));
    let primary = in_process(Fake { delay: MS(5), marker: "p", seen: seen() });
    let shadow = in_process(Fake { delay: MS(500), marker: "s", seen: seen() });
    let peers = vec![(def("shadow", Some("primary")), Peer::over(shadow)), (def("primary", None), Peer::over(primary))];
    let chain = HookChain::over("agent", peers, 1 << 20, metrics.clone());
    let (out, took) = fold(&chain, Instant::now() + MS(60_000)).await;
    assert_eq!(out.unwrap().content, vec!["xp".to_owned()], "only the primary's output is applied");
    assert_eq!(took, MS(5), "the fold did not wait for the shadow");
    let counted = || {
        metrics.render().contains(
            "lattice_shadow_hook_calls_total{agent=\"agent\",hook=\"shadow\",outcome=\"ok\",agreement=\"different\"} 1",
        )
    };
    assert!(!counted(), "not answered yet");
    tokio::time::sleep(MS(600)).await;
    assert!(counted(), "{}", metrics.render());
}
