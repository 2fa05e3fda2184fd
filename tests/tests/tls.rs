//! TLS to hook and tool services: `https://` and `dns:///` endpoints with a
//! private CA, mutual TLS with the hook SDK serving, and every way the
//! handshake can fail aborting the query without leaking.

use std::{path::Path, time::Duration};

use lattice_hook_sdk::{Hook, Status, Tls, ToolResultBlock, ToolResultCall};
use lattice_proto::agent::v1::GetAgentRequest;
use lattice_tests::{
    Lattice, assert_no_leak, canary, cfg,
    tls::{Leaf, TestCa},
    tool::{ToolDef, ToolServer},
};
use tokio::sync::oneshot;

/// Replaces every tool result's text with "clean".
struct Clean;

#[lattice_hook_sdk::async_trait]
impl Hook for Clean {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        Ok(Some(call.replace_text("clean")))
    }
}

/// The SDK's server with `tls`, on loopback, until dropped.
struct SdkHook {
    port: u16,
    _stop: oneshot::Sender<()>,
}

async fn sdk_hook(tls: Tls) -> SdkHook {
    let (listener, addr) = lattice_tests::bind().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = lattice_hook_sdk::Server::new(Clean).tls(tls).drain(std::time::Duration::ZERO);
    tokio::spawn(server.serve_on(listener, async {
        let _ = stopped.await;
    }));
    SdkHook { port: addr.port(), _stop: stop }
}

/// A `tls = { … }` line for the config.
fn tls_line(ca: Option<&Path>, client: Option<&Leaf>, server_name: &str) -> String {
    let mut fields = vec![format!("server_name = {server_name:?}")];
    if let Some(ca) = ca {
        fields.push(format!("ca_file = {:?}", ca.display().to_string()));
    }
    if let Some(c) = client {
        fields.push(format!("cert_file = {:?}", c.cert_file.display().to_string()));
        fields.push(format!("key_file = {:?}", c.key_file.display().to_string()));
    }
    format!("tls = {{ {} }}\n", fields.join(", "))
}

fn agent(tools: &str, hook: &str) -> String {
    cfg::agent("x", "")
        + &cfg::turn("go", &["fetch"])
        + &cfg::turn("model saw {{last_tool_result}}", &[])
        + tools
        + hook
}

/// A hook that requires client certificates (mutual TLS) and a tool over
/// TLS, both verified against a private CA under a name that is not the
/// address: by `https://` and by `dns:///` (tools discovered over TLS).
#[tokio::test(flavor = "multi_thread")]
async fn hooks_and_tools_over_mutual_tls() {
    let secret = canary();
    let ca = TestCa::new("ok");
    let (hook_cert, tool_cert, client) = (ca.issue("hook.test"), ca.issue("tools.test"), ca.issue("lattice.test"));
    let hook = sdk_hook(Tls::new(&hook_cert.cert_pem, &hook_cert.key_pem).require_client_ca(&ca.pem)).await;
    let tools =
        ToolServer::start_with(vec![ToolDef::new("fetch", &secret)], Some(ca.server_config(&tool_cert, false))).await;
    assert!(tools.url.starts_with("https://"));
    for scheme in ["https://", "dns:///"] {
        // The tool's list is discovered over TLS at start-up, a dns:/// name
        // being resolved in the background meanwhile.
        let tools_cfg =
            cfg::tools(&tools.url.replace("https://", scheme), 2000) + &tls_line(Some(&ca.file), None, "tools.test");
        let endpoint = format!("{scheme}127.0.0.1:{}", hook.port);
        let hook_cfg = cfg::hook("redact", &endpoint, &["tool_result"], 2000)
            + &tls_line(Some(&ca.file), Some(&client), "hook.test");
        let lattice = Lattice::start(&agent(&tools_cfg, &hook_cfg)).await;
        let mut out = lattice.query("x", "go").await;
        // A dns:/// name is resolved in the background from start-up on.
        for _ in 0..50 {
            if out.status.is_none() || !endpoint.starts_with("dns:") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            out = lattice.query("x", "go").await;
        }
        assert_eq!(out.expect_ok().text, "model saw clean", "{endpoint}");
        assert_no_leak(&secret, &lattice, &out);
        // GetAgent says so.
        let agent = lattice.client().await.get_agent(GetAgentRequest { name: "x".into() }).await.unwrap().into_inner();
        assert!(agent.hooks[0].tls && agent.hooks[0].client_certificate, "{:?}", agent.hooks);
        assert!(agent.tools[0].tls, "{:?}", agent.tools);
    }
    let plain = Lattice::start(&agent(&cfg::declared_tools("http://127.0.0.1:1", 100, &["fetch"]), "")).await;
    let agent = plain.client().await.get_agent(GetAgentRequest { name: "x".into() }).await;
    assert!(!agent.unwrap().into_inner().tools.iter().any(|t| t.tls));
}

/// Every TLS failure to a hook aborts the query at once, fail-closed: an
/// untrusted server certificate, a certificate for another name, no client
/// certificate where one is required, and plaintext to a TLS hook.
#[tokio::test(flavor = "multi_thread")]
async fn tls_failures_abort_the_query_without_leaking() {
    let secret = canary();
    let (ca, other) = (TestCa::new("real"), TestCa::new("other"));
    let (hook_cert, client) = (ca.issue("hook.test"), ca.issue("lattice.test"));
    let hook = sdk_hook(Tls::new(&hook_cert.cert_pem, &hook_cert.key_pem).require_client_ca(&ca.pem)).await;
    let tools = ToolServer::start(vec![ToolDef::new("fetch", &secret)]).await;
    let https = format!("https://127.0.0.1:{}", hook.port);
    let other_client = other.issue("lattice.test");
    let cases = [
        ("an untrusted CA", https.clone(), tls_line(Some(&other.file), Some(&client), "hook.test")),
        ("another name", https.clone(), tls_line(Some(&ca.file), Some(&client), "not-the-hook.test")),
        ("no client certificate", https.clone(), tls_line(Some(&ca.file), None, "hook.test")),
        (
            "a client certificate of another CA",
            https.clone(),
            tls_line(Some(&ca.file), Some(&other_client), "hook.test"),
        ),
        ("plaintext", format!("http://127.0.0.1:{}", hook.port), String::new()),
    ];
    for (case, endpoint, tls) in cases {
        let hook_cfg = cfg::hook("redact", &endpoint, &["tool_result"], 2000) + &tls;
        // A hook Lattice can't reach over TLS keeps it out of rotation.
        let lattice = Lattice::start_unready(&agent(&cfg::tools(&tools.url, 2000), &hook_cfg)).await;
        assert!(!lattice.serving().await, "{case}: NOT_SERVING");
        let out = lattice.query("x", "go").await;
        let failure = out.hook_failure();
        assert_eq!(failure["hook"], "redact", "{case}");
        assert!(out.elapsed < Duration::from_millis(1500), "{case}: took {:?}", out.elapsed);
        assert_no_leak(&secret, &lattice, &out);
        println!("{case}: {}", failure["kind"]);
    }
}

/// TLS settings are checked at start-up: every problem is listed with its
/// field, and no file content is repeated.
#[tokio::test(flavor = "multi_thread")]
async fn bad_tls_settings_are_refused_at_start_up() {
    let ca = TestCa::new("cfg");
    let leaf = ca.issue("hook.test");
    let garbage = std::env::temp_dir().join(format!("lattice-not-pem-{}", canary()));
    std::fs::write(&garbage, "SECRET-BYTES-NOT-A-CERTIFICATE").unwrap();
    let hook = |endpoint: &str, tls: &str| cfg::hook("h", endpoint, &["tool_result"], 500) + tls;
    let config = cfg::agent("x", "")
        + &cfg::turn("hi", &[])
        + &hook("http://127.0.0.1:1", &tls_line(Some(&ca.file), None, "h.test"))
        + &hook("https://127.0.0.1:1", "tls = { ca_file = \"/nonexistent/ca.pem\" }\n").replace("\"h\"", "\"h2\"")
        + &hook("https://127.0.0.1:1", &format!("tls = {{ ca_file = {:?} }}\n", garbage.display().to_string()))
            .replace("\"h\"", "\"h3\"")
        + &hook(
            "https://127.0.0.1:1",
            &format!("tls = {{ cert_file = {:?} }}\n", leaf.cert_file.display().to_string()),
        )
        .replace("\"h\"", "\"h4\"");
    let err = Lattice::try_start(&config).await.err().expect("refused");
    for expected in [
        "agents[0].hooks[0].tls: a tls setting needs an https:// or dns:/// endpoint",
        "agents[0].hooks[1].tls.ca_file: cannot read \"/nonexistent/ca.pem\"",
        "agents[0].hooks[2].tls: the CA file holds no valid PEM certificate",
        "agents[0].hooks[3].tls: set both cert_file and key_file, or neither",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
    assert!(!err.contains("SECRET-BYTES"), "{err}");
    let _ = std::fs::remove_file(garbage);
}

/// The `redact` examples, Rust, Python and Go, serve mutual TLS from PEM
/// files given as flags.
#[tokio::test(flavor = "multi_thread")]
async fn the_redact_examples_serve_mutual_tls() {
    let ca = TestCa::new("example");
    let (server, client) = (ca.issue("redact.test"), ca.issue("lattice.test"));
    let path = |p: &Path| p.display().to_string();
    let flags = [
        "--tls-cert".to_owned(),
        path(&server.cert_file),
        "--tls-key".to_owned(),
        path(&server.key_file),
        "--tls-client-ca".to_owned(),
        path(&ca.file),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (rust, _rust) = lattice_tests::start_example("redact", &flags).await;
    let (python, _python) = lattice_tests::start_python_hook_with(&flags).await;
    let (go, _go) = lattice_tests::start_go_hook(&flags).await;
    assert!(python.starts_with("https://") && go.starts_with("https://"));
    for endpoint in [rust.replace("http://", "https://"), python, go] {
        redact_over_mutual_tls(&ca, &client, &endpoint).await;
    }
}

async fn redact_over_mutual_tls(ca: &TestCa, client: &Leaf, endpoint: &str) {
    let tools = ToolServer::start(vec![ToolDef::new("fetch", "write to ada@example.com")]).await;
    let with = |client: Option<&Leaf>| {
        agent(
            &cfg::tools(&tools.url, 2000),
            &(cfg::hook("redact", endpoint, &["tool_result"], 2000) + &tls_line(Some(&ca.file), client, "redact.test")),
        )
    };
    let lattice = Lattice::start(&with(Some(client))).await;
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "model saw write to [REDACTED:email]", "{endpoint}");
    // Without a client certificate the example refuses the connection.
    let lattice = Lattice::start_unready(&with(None)).await;
    assert!(!lattice.serving().await, "{endpoint}: the hook refuses Lattice: NOT_SERVING");
    let out = lattice.query("x", "go").await;
    out.hook_failure();
    assert!(!out.everything().contains("ada@example.com"));
}

/// The certificate Lattice presents to a hook follows its files: a hook
/// that refuses the first one (another CA signed it) takes the one written
/// over it within seconds, with no restart. Files that don't load keep the
/// certificate in force, and the log says why.
#[tokio::test(flavor = "multi_thread")]
async fn a_rotated_client_certificate_reaches_new_hook_connections() {
    let secret = canary();
    let (ca, other) = (TestCa::new("rotate"), TestCa::new("rotate-old"));
    let hook_cert = ca.issue("hook.test");
    let hook = sdk_hook(Tls::new(&hook_cert.cert_pem, &hook_cert.key_pem).require_client_ca(&ca.pem)).await;
    let tools = ToolServer::start(vec![ToolDef::new("fetch", &secret)]).await;
    // Lattice's client certificate, as a mounted Secret: the old CA's first.
    let dir = lattice_tests::temp_dir("tls-rotate");
    let refused = other.issue("lattice.test");
    let live = Leaf {
        cert_file: dir.join("tls.crt"),
        key_file: dir.join("tls.key"),
        cert_pem: refused.cert_pem.clone(),
        key_pem: refused.key_pem.clone(),
    };
    std::fs::write(&live.cert_file, &refused.cert_pem).unwrap();
    std::fs::write(&live.key_file, &refused.key_pem).unwrap();
    let hook_cfg = cfg::hook("redact", &format!("https://127.0.0.1:{}", hook.port), &["tool_result"], 2000)
        + &tls_line(Some(&ca.file), Some(&live), "hook.test");
    let lattice = Lattice::start_unready(&agent(&cfg::tools(&tools.url, 2000), &hook_cfg)).await;
    let out = lattice.query("x", "go").await;
    assert_eq!(out.hook_failure()["hook"], "redact", "the hook refuses the old CA's certificate");
    assert_no_leak(&secret, &lattice, &out);

    let accepted = ca.issue("lattice.test");
    std::fs::write(&live.cert_file, &accepted.cert_pem).unwrap();
    std::fs::write(&live.key_file, &accepted.key_pem).unwrap();
    let works = async {
        loop {
            let out = lattice.query("x", "go").await;
            if out.status.is_none() {
                return out;
            }
            assert_no_leak(&secret, &lattice, &out);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let out = tokio::time::timeout(Duration::from_secs(5), works).await.expect("the new certificate is used");
    assert_eq!(out.expect_ok().text, "model saw clean");

    std::fs::write(&live.key_file, "-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n").unwrap();
    let logged = async {
        while !lattice_tests::logs().contains("peer tls: certificates not reloaded") {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), logged).await.expect("the failed reload is logged");
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "model saw clean", "the loaded certificate stays");
    assert!(!lattice_tests::logs().contains(accepted.key_pem.lines().nth(1).unwrap()), "no key in the logs");
}

/// One transport for plaintext and TLS: a hook whose reply carries a
/// header list over the limit (a 200 kB status message with a canary)
/// fails the query the same way over both, and the message reaches no
/// one.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_over_the_header_limit_fails_alike_over_plaintext_and_tls() {
    use lattice_tests::hook::{Behaviour, HookServer};
    let secret = canary();
    let ca = TestCa::new("limits");
    let leaf = ca.issue("hook.test");
    let tools = ToolServer::start(vec![ToolDef::new("fetch", "data")]).await;
    let behaviour = Behaviour {
        fail: Some(tonic::Code::Internal),
        fail_message: Some(format!("{secret} {}", "x".repeat(200_000))),
        ..Default::default()
    };
    let mut kinds = Vec::new();
    for tls in [false, true] {
        let hook = match tls {
            false => HookServer::start(behaviour.clone()).await,
            true => HookServer::start_tls(behaviour.clone(), ca.server_config(&leaf, false)).await,
        };
        let extra = if tls { tls_line(Some(&ca.file), None, "hook.test") } else { String::new() };
        let hooks = cfg::hook("h", &hook.url, &["tool_result"], 2000) + &extra;
        let lattice = Lattice::start(&agent(&cfg::tools(&tools.url, 2000), &hooks)).await;
        let out = lattice.query("x", "go").await;
        kinds.push(out.hook_failure()["kind"].clone());
        assert_no_leak(&secret, &lattice, &out);
    }
    assert_eq!(kinds[0], kinds[1], "plaintext and TLS fail alike");
}
