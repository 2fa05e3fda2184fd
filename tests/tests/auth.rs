//! `[server.auth]` mode "token": who may call, and what each may do.

use std::time::Duration;

use lattice_proto::agent::v1::{self as pb, test_hooks_request::Value};
use lattice_tests::{
    Lattice, QueryOpts, cfg,
    hook::{Behaviour, HookServer},
    temp_dir,
    tool::{ToolDef, ToolServer},
};
use tonic::Code;

/// A tokens file for `(principal, token)` pairs.
fn tokens_file(path: &std::path::Path, tokens: &[(&str, &str)]) {
    let text: String =
        tokens.iter().map(|(p, t)| format!("{p} {}\n", lattice_tests::sha256_hex(t.as_bytes()))).collect();
    std::fs::write(path, format!("# principal sha256\n{text}")).unwrap();
}

fn with_token(agent: &str, token: Option<&str>) -> QueryOpts {
    QueryOpts { agent: agent.into(), prompt: "go".into(), token: token.map(str::to_owned), ..Default::default() }
}

fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

/// Without a token, or with one not in the file: UNAUTHENTICATED. A
/// principal not listed on an agent: PERMISSION_DENIED, and its tool is
/// never called. TestHooks is for admins. A token removed from the file
/// stops working within seconds. No token reaches the logs, even at trace.
#[tokio::test(flavor = "multi_thread")]
async fn bearer_tokens_authenticate_and_agents_authorize() {
    let dir = temp_dir("auth");
    let tokens = dir.join("tokens.txt");
    let (alice, bob, ops): (&'static str, &'static str, &'static str) =
        ("alice-token-7f3a91", "bob-token-52c0d4", "ops-token-e81b2f");
    tokens_file(&tokens, &[("alice", alice), ("bob", bob), ("ops", ops)]);
    let tools = ToolServer::start(vec![ToolDef::new("t", "the tool ran")]).await;
    let hook = HookServer::start(Behaviour::default()).await;
    let config = format!(
        "[server.auth]\nmode = \"token\"\ntokens_file = {:?}\nadmins = [\"ops\"]\n",
        tokens.display().to_string()
    ) + &cfg::agent("support", "principals = [\"alice\"]")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done: {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("keep", &hook.url, &["tool_result"], 2000)
        + &cfg::agent("open", "")
        + &cfg::turn("hello", &[]);
    let lattice = Lattice::spawn(&config, &[("RUST_LOG", "trace")]).await;

    let none = lattice.query_with(with_token("support", None)).await;
    assert_eq!(none.status.as_ref().map(|s| s.code()), Some(Code::Unauthenticated), "{:?}", none.status);
    let wrong = lattice.query_with(with_token("support", Some("not-a-token"))).await;
    assert_eq!(wrong.status.as_ref().map(|s| s.code()), Some(Code::Unauthenticated));

    assert_eq!(lattice.query_with(with_token("support", Some(alice))).await.expect_ok().text, "done: the tool ran");
    let denied = lattice.query_with(with_token("support", Some(bob))).await;
    assert_eq!(denied.status.as_ref().map(|s| s.code()), Some(Code::PermissionDenied));
    assert_eq!(tools.state.called().len(), 1, "bob's query called no tool");
    // An agent that lists no principals takes any authenticated one.
    assert_eq!(lattice.query_with(with_token("open", Some(bob))).await.expect_ok().text, "hello");

    let mut client = lattice.client().await;
    let dry = || pb::TestHooksRequest {
        agent: "support".into(),
        value: Some(Value::ToolResult(pb::TestToolResult {
            tool_name: "t".into(),
            input: None,
            result: Some(pb::ToolResultBlock { tool_use_id: "toolu_1".into(), content: vec![], is_error: false }),
        })),
    };
    assert_eq!(client.test_hooks(authed(dry(), alice)).await.unwrap_err().code(), Code::PermissionDenied);
    assert!(client.test_hooks(authed(dry(), ops)).await.unwrap().into_inner().completed);
    assert_eq!(client.list_agents(pb::ListAgentsRequest {}).await.unwrap_err().code(), Code::Unauthenticated);
    // Each sees the agents it may query; only an admin sees endpoints.
    let seen_by = |token: &'static str| {
        let mut client = client.clone();
        async move { client.list_agents(authed(pb::ListAgentsRequest {}, token)).await.unwrap().into_inner().agents }
    };
    let bobs = seen_by(bob).await;
    assert_eq!(bobs.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["open"]);
    let alices = seen_by(alice).await;
    let support = alices.iter().find(|a| a.name == "support").expect("alice sees support");
    assert_eq!((support.hooks[0].endpoint.as_str(), support.tools[0].target.as_str()), ("", ""));
    let ops_view = seen_by(ops).await;
    let support = ops_view.iter().find(|a| a.name == "support").unwrap();
    assert_eq!(support.hooks[0].endpoint, hook.url, "an admin sees where the hooks are");
    let get = authed(pb::GetAgentRequest { name: "support".into() }, bob);
    assert_eq!(client.get_agent(get).await.unwrap_err().code(), Code::PermissionDenied);

    // Alice's token is revoked: the file is re-read within a second or two.
    tokens_file(&tokens, &[("bob", bob), ("ops", ops)]);
    let revoked = async {
        loop {
            let out = lattice.query_with(with_token("open", Some(alice))).await;
            if out.status.as_ref().map(|s| s.code()) == Some(Code::Unauthenticated) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), revoked).await.expect("a revoked token stops working");

    let logs = lattice.process_logs();
    assert!(logs.contains("\"principal\":\"alice\""), "the query log says who asked");
    for token in [alice, bob, ops, "not-a-token"] {
        assert!(!logs.contains(token), "a token reached the logs");
    }
}

/// grpcurl sends the token as a header: `-H 'authorization: Bearer …'`.
#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_queries_with_a_bearer_token() {
    let dir = temp_dir("auth-grpcurl");
    let tokens = dir.join("tokens.txt");
    tokens_file(&tokens, &[("alice", "grpcurl-token-1")]);
    let config = format!("[server.auth]\nmode = \"token\"\ntokens_file = {:?}\n", tokens.display().to_string())
        + &cfg::agent("echo", "")
        + &cfg::turn("you said: {{last_user_text}}", &[]);
    let lattice = Lattice::start(&config).await;
    let addr = lattice.url.trim_start_matches("http://").to_owned();
    let run = |header: Option<&str>| {
        let mut args = vec!["-plaintext"];
        if let Some(h) = header {
            args.extend(["-H", h]);
        }
        args.extend(["-d", r#"{"agent": "echo", "prompt": "hi"}"#, &addr, "lattice.agent.v1.AgentService/Query"]);
        let out = std::process::Command::new("grpcurl").args(&args).output().expect("grpcurl");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    assert!(run(Some("authorization: Bearer grpcurl-token-1")).contains("you said: hi"));
    assert!(run(None).contains("Code: Unauthenticated"));
}

/// A config with mode "token" and no tokens file, or an unknown mode, is
/// refused with the field named.
#[tokio::test(flavor = "multi_thread")]
async fn auth_config_mistakes_are_named() {
    for (table, field) in [
        ("[server.auth]\nmode = \"token\"\n", "server.auth.tokens_file"),
        ("[server.auth]\nmode = \"kerberos\"\n", "server.auth.mode"),
        ("[server.auth]\nadmins = [\"ops\"]\n", "server.auth.mode"),
        // Secure by default: running open must be said.
        ("", "server.auth: missing"),
    ] {
        let path = temp_dir("auth-config").join("lattice.toml");
        std::fs::write(&path, table.to_owned() + &cfg::agent("a", "") + &cfg::turn("hi", &[])).unwrap();
        let out = std::process::Command::new(lattice_tests::workspace_binary("lattice"))
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{table}: {text}");
        assert!(text.contains(field), "{table}: {text}");
    }
}

/// Sessions belong to the principal that created them: another one can't
/// continue, read or delete one (NOT_FOUND, as if it did not exist), on
/// the memory store and on PostgreSQL alike.
#[tokio::test(flavor = "multi_thread")]
async fn sessions_belong_to_their_owner() {
    let dir = temp_dir("auth-owner");
    let tokens = dir.join("tokens.txt");
    let (alice, bob) = ("alice-owner-token", "bob-owner-token");
    tokens_file(&tokens, &[("alice", alice), ("bob", bob)]);
    let auth = format!("[server.auth]\nmode = \"token\"\ntokens_file = {:?}\n", tokens.display().to_string());
    let agent = cfg::agent("a", "") + "[[agents.model.script]]\ntext = \"seen {{message_count}}\"\n";
    let url = lattice_tests::postgres::Cluster::shared().await.database().await;
    let postgres = "[sessions]\nstore = \"postgres\"\nurl_env = \"LATTICE_POSTGRES_URL\"\n";
    for store in ["", postgres] {
        let lattice = Lattice::spawn(&(auth.clone() + store + &agent), &[("LATTICE_POSTGRES_URL", &url)]).await;
        let first = lattice.query_with(with_token("a", Some(alice))).await;
        assert_eq!(first.expect_ok().text, "seen 1", "{store}");
        let sid = first.session_id();
        let go_on = |token: &str| QueryOpts { session: Some(sid.clone()), ..with_token("a", Some(token)) };

        let by_bob = lattice.query_with(go_on(bob)).await;
        assert_eq!(by_bob.status.as_ref().map(|s| s.code()), Some(Code::NotFound), "{store}");
        let mut client = lattice.client().await;
        let get = |token: &str| authed(pb::GetSessionRequest { session_id: sid.clone(), ..Default::default() }, token);
        let delete = |token: &str| authed(pb::DeleteSessionRequest { session_id: sid.clone() }, token);
        assert_eq!(client.get_session(get(bob)).await.unwrap_err().code(), Code::NotFound);
        assert_eq!(client.delete_session(delete(bob)).await.unwrap_err().code(), Code::NotFound);

        assert_eq!(client.get_session(get(alice)).await.unwrap().into_inner().messages.len(), 2, "{store}");
        assert_eq!(lattice.query_with(go_on(alice)).await.expect_ok().text, "seen 3", "bob's attempts changed nothing");
        client.delete_session(delete(alice)).await.unwrap();
        assert_eq!(client.get_session(get(alice)).await.unwrap_err().code(), Code::NotFound);
    }
}

/// `lattice query` sends a token from `--token-file` or `LATTICE_TOKEN`;
/// without one it prints UNAUTHENTICATED and exits 1.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_sends_a_token() {
    let dir = temp_dir("auth-cli");
    let tokens = dir.join("tokens.txt");
    tokens_file(&tokens, &[("alice", "cli-token-31")]);
    let token_file = dir.join("token");
    std::fs::write(&token_file, "cli-token-31\n").unwrap();
    let config = format!("[server.auth]\nmode = \"token\"\ntokens_file = {:?}\n", tokens.display().to_string())
        + &cfg::agent("echo", "")
        + &cfg::turn("you said: {{last_user_text}}", &[]);
    let lattice = Lattice::start(&config).await;
    let run = |extra: &[&str], env: Option<&str>| {
        let mut cmd = std::process::Command::new(lattice_tests::workspace_binary("lattice"));
        cmd.args(["query", "--addr", &lattice.url, "--agent", "echo"]).args(extra).arg("hi");
        cmd.env_remove("LATTICE_TOKEN");
        if let Some(t) = env {
            cmd.env("LATTICE_TOKEN", t);
        }
        let out = cmd.output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, text) = run(&["--token-file", token_file.to_str().unwrap()], None);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("you said: hi"), "{text}");
    let (code, text) = run(&[], Some("cli-token-31"));
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = run(&[], None);
    assert_eq!(code, Some(1));
    assert!(text.contains("UNAUTHENTICATED"), "{text}");
}

/// /metrics is on the admin port only: the API port serves gRPC and
/// nothing else; `--admin-listen` (or server.admin_listen) moves it.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_are_on_the_admin_port_only() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let lattice = Lattice::start(&(cfg::agent("a", "") + &cfg::turn("hi", &[]))).await;
    lattice.query("a", "go").await.expect_ok();
    assert!(lattice.metrics().await.contains("lattice_queries_total{agent=\"a\",code=\"OK\"} 1"));
    let api = lattice.url.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(&api).await.unwrap();
    conn.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {api}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut response)).await;
    let response = String::from_utf8_lossy(&response);
    assert!(!response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(!response.contains("lattice_queries_total"), "{response}");
}

/// [server.limits] per principal: one principal over its queries in flight
/// or its queries per minute gets RESOURCE_EXHAUSTED with a RetryInfo, and
/// nothing runs; another principal is not held back.
#[tokio::test(flavor = "multi_thread")]
async fn per_principal_limits_refuse_with_a_retry_hint() {
    use tonic_types::StatusExt;
    let dir = temp_dir("auth-limits");
    let tokens = dir.join("tokens.txt");
    let (alice, bob) = ("alice-limit-token", "bob-limit-token");
    tokens_file(&tokens, &[("alice", alice), ("bob", bob)]);
    let config = format!(
        "[server.limits]\nqueries_in_flight = 1\nqueries_per_minute = 3\n\
         [server.auth]\nmode = \"token\"\ntokens_file = {:?}\n",
        tokens.display().to_string()
    ) + &cfg::agent("slow", "")
        + "[[agents.model.script]]\ntext = \"done\"\ndelay_ms = 600\n";
    let lattice = std::sync::Arc::new(Lattice::start(&config).await);
    let running = {
        let lattice = lattice.clone();
        tokio::spawn(async move { lattice.query_with(with_token("slow", Some(alice))).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = lattice.query_with(with_token("slow", Some(alice))).await;
    let status = second.status.expect("refused");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.get_details_retry_info().and_then(|r| r.retry_delay).is_some(), "{status:?}");
    assert!(status.message().contains("queries_in_flight"), "{status:?}");
    assert_eq!(
        lattice.query_with(with_token("slow", Some(bob))).await.expect_ok().text,
        "done",
        "bob is not held back"
    );
    assert_eq!(running.await.unwrap().expect_ok().text, "done");

    // Alice has started 1 of her 3 a minute (the refused one counts none).
    for _ in 0..2 {
        assert_eq!(lattice.query_with(with_token("slow", Some(alice))).await.expect_ok().text, "done");
    }
    let over = lattice.query_with(with_token("slow", Some(alice))).await.status.expect("over the rate");
    assert_eq!(over.code(), Code::ResourceExhausted);
    assert!(over.message().contains("queries_per_minute") && over.message().contains("retry in"), "{over:?}");
}

/// `[server.auth.groups]` names sets of principals, used as `group:<name>`
/// in an agent's `principals` and in `admins`; an unknown group is a config
/// error that names it.
#[tokio::test(flavor = "multi_thread")]
async fn groups_name_sets_of_principals() {
    let dir = temp_dir("auth-groups");
    let tokens = dir.join("tokens.txt");
    let (alice, bob, carol) = ("alice-group-token", "bob-group-token", "carol-group-token");
    tokens_file(&tokens, &[("alice", alice), ("bob", bob), ("carol", carol)]);
    let auth = format!(
        "[server.auth]\nmode = \"token\"\ntokens_file = {:?}\nadmins = [\"group:ops\"]\n\
         [server.auth.groups]\nfrontends = [\"alice\", \"bob\"]\nops = [\"carol\"]\n",
        tokens.display().to_string()
    );
    let agent = cfg::agent("support", "principals = [\"group:frontends\"]") + &cfg::turn("hello", &[]);
    let lattice = Lattice::spawn(&(auth.clone() + &agent), &[]).await;
    for member in [alice, bob] {
        assert_eq!(lattice.query_with(with_token("support", Some(member))).await.expect_ok().text, "hello");
    }
    let denied = lattice.query_with(with_token("support", Some(carol))).await;
    assert_eq!(denied.status.as_ref().map(|s| s.code()), Some(Code::PermissionDenied));
    let mut client = lattice.client().await;
    let dry = pb::TestHooksRequest {
        agent: "support".into(),
        value: Some(Value::ToolResult(pb::TestToolResult {
            tool_name: "t".into(),
            input: None,
            result: Some(pb::ToolResultBlock { tool_use_id: "toolu_1".into(), content: vec![], is_error: false }),
        })),
    };
    assert!(client.test_hooks(authed(dry.clone(), carol)).await.is_ok(), "carol is in group ops: an admin");
    assert_eq!(client.test_hooks(authed(dry, alice)).await.unwrap_err().code(), Code::PermissionDenied);

    let path = dir.join("unknown.toml");
    std::fs::write(&path, auth + &cfg::agent("a", "principals = [\"group:nobody\"]") + &cfg::turn("hi", &[])).unwrap();
    let out = std::process::Command::new(lattice_tests::workspace_binary("lattice"))
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{text}");
    assert!(text.contains("agents[0].principals") && text.contains("\"nobody\""), "{text}");
}
