//! TLS on Lattice's own listener (`[server.tls]`): client certificates as
//! identities (`[server.auth] mode = "mtls"`), certificates reloaded from
//! disk without dropping connections, the plaintext health-only port, and
//! the clients users have (`lattice query`, grpcurl) speaking it.

use std::{sync::Arc, time::Duration};

use lattice_proto::agent::v1 as pb;
use lattice_tests::{
    Lattice, QueryOpts, cfg,
    hook::{Behaviour, HookServer},
    temp_dir,
    tls::{Leaf, TestCa},
    tool::{ToolDef, ToolServer},
    workspace_binary,
};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use tonic::Code;

const FRONTEND: &str = "spiffe://cluster.local/ns/app/sa/frontend";

fn server_tls(server: &Leaf, client_ca: Option<&TestCa>) -> String {
    let mut table = format!(
        "[server.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        server.cert_file.display().to_string(),
        server.key_file.display().to_string()
    );
    if let Some(ca) = client_ca {
        table += &format!("client_ca_file = {:?}\n", ca.file.display().to_string());
    }
    table
}

fn code(outcome: &lattice_tests::Outcome) -> Option<Code> {
    outcome.status.as_ref().map(|s| s.code())
}

fn message(outcome: &lattice_tests::Outcome) -> String {
    outcome.status.as_ref().map(|s| s.message().to_owned()).unwrap_or_default()
}

fn go(agent: &str) -> QueryOpts {
    QueryOpts { agent: agent.into(), prompt: "go".into(), ..Default::default() }
}

/// Mutual TLS: the client certificate's URI SAN (a SPIFFE ID) or DNS SAN
/// is the principal. No certificate, one from another CA, or an expired
/// one: UNAUTHENTICATED, with the reason. A principal the agent does not
/// list: PERMISSION_DENIED, and the tool is never called. Sessions belong
/// to the certificate's principal. The kubelet's probe reaches health on a
/// plaintext port of its own.
#[tokio::test(flavor = "multi_thread")]
async fn client_certificates_are_identities() {
    let ca = TestCa::new("mtls");
    let server = ca.issue("localhost");
    let frontend = ca.issue_uri("frontend", FRONTEND);
    let batch = ca.issue("batch.example");
    let expired = ca.issue_expired("old.example");
    let stranger = TestCa::new("stranger").issue("batch.example");

    let tools = ToolServer::start(vec![ToolDef::new("t", "the tool ran")]).await;
    let health_port = lattice_tests::bind().await.1;
    let config = format!("[server]\nhealth_listen = \"{health_port}\"\n")
        + &server_tls(&server, Some(&ca))
        + "[server.auth]\nmode = \"mtls\"\nadmins = [\"ops.example\"]\n"
        + &cfg::agent("support", &format!("principals = [{FRONTEND:?}]"))
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done: {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::agent("open", "")
        + &cfg::turn("hello", &[]);
    let lattice = Lattice::spawn_tls(&config, &[], ca.client_tls(Some(&frontend))).await;

    let first = lattice.query_with(go("support")).await;
    assert_eq!(first.expect_ok().text, "done: the tool ran");
    assert_eq!(tools.state.called().len(), 1);

    let anonymous = lattice.with_client_tls(Some(ca.client_tls(None)));
    let out = anonymous.query_with(go("open")).await;
    assert_eq!(code(&out), Some(Code::Unauthenticated), "{:?}", out.status);
    assert!(message(&out).contains("client certificate"), "{}", message(&out));

    let out = lattice.with_client_tls(Some(ca.client_tls(Some(&stranger)))).query_with(go("open")).await;
    assert_eq!(code(&out), Some(Code::Unauthenticated), "{:?}", out.status);
    assert!(message(&out).contains("not signed by the client CA"), "{}", message(&out));

    let out = lattice.with_client_tls(Some(ca.client_tls(Some(&expired)))).query_with(go("open")).await;
    assert_eq!(code(&out), Some(Code::Unauthenticated), "{:?}", out.status);
    assert!(message(&out).contains("expired"), "{}", message(&out));

    // A DNS SAN names a principal too; this one may not query "support".
    let as_batch = lattice.with_client_tls(Some(ca.client_tls(Some(&batch))));
    let out = as_batch.query_with(go("support")).await;
    assert_eq!(code(&out), Some(Code::PermissionDenied), "{:?}", out.status);
    assert!(message(&out).contains("batch.example"), "{}", message(&out));
    assert_eq!(tools.state.called().len(), 1, "a denied query calls no tool");
    assert_eq!(as_batch.query_with(go("open")).await.expect_ok().text, "hello");

    // The frontend's session is not batch's to read or continue.
    let sid = first.session_id();
    assert_eq!(as_batch.session(&sid).await.unwrap_err().code(), Code::NotFound);
    let continued = as_batch.query_with(QueryOpts { session: Some(sid.clone()), ..go("open") }).await;
    assert_eq!(code(&continued), Some(Code::NotFound));
    assert!(lattice.session(&sid).await.is_ok(), "its owner reads it");

    // Health answers without a certificate: on the API port over TLS, and
    // in plaintext on the health port (the kubelet's gRPC probe).
    assert!(anonymous.serving().await);
    let plaintext = Lattice::remote_unchecked(&format!("http://{health_port}"));
    assert!(plaintext.serving().await, "the health port answers in plaintext");
    let channel = plaintext.channel().await.unwrap();
    let mut agents = pb::agent_service_client::AgentServiceClient::new(channel);
    let err = agents.list_agents(pb::ListAgentsRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "the health port serves nothing else: {err:?}");
    // The API port speaks no plaintext.
    let api_plain = Lattice::remote_unchecked(&lattice.url.replace("https://", "http://"));
    assert!(!api_plain.serving().await);

    // Session ids are 128 random bits.
    assert!(sid.len() == 32 && sid.bytes().all(|b| b.is_ascii_hexdigit()), "{sid}");

    // One audit line per query, refused ones included: who, which agent,
    // the outcome; never the prompt.
    let logs = lattice.process_logs();
    assert!(logs.contains(&format!("\"principal\":\"{FRONTEND}\"")), "the query log names the principal");
    let refused: Vec<&str> = logs.lines().filter(|l| l.contains("\"query refused\"")).collect();
    assert!(
        refused.iter().any(|l| l.contains("\"principal\":\"batch.example\"") && l.contains("PERMISSION_DENIED")),
        "{refused:#?}"
    );
    assert!(refused.iter().any(|l| l.contains("\"principal\":\"-\"") && l.contains("UNAUTHENTICATED")));
    assert!(!logs.contains("\"go\""), "no prompt in the logs");
}

/// Which certificate the listener at `addr` presents to a new connection.
async fn presented(addr: &str, ca: &TestCa) -> Option<Vec<u8>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let tls = connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.ok()?;
    tls.get_ref().1.peer_certificates().map(|c| c[0].to_vec())
}

fn der(leaf: &Leaf) -> Vec<u8> {
    CertificateDer::from_pem_slice(leaf.cert_pem.as_bytes()).unwrap().to_vec()
}

/// Replacing the certificate files (as the kubelet does when a Secret
/// rotates) reaches new connections within seconds; a query in flight on
/// an old connection completes, and the connection stays usable. Files
/// that don't load keep the previous certificate, and the log says why.
#[tokio::test(flavor = "multi_thread")]
async fn certificates_reload_from_disk_without_dropping_connections() {
    let ca = TestCa::new("reload");
    let first = ca.issue("localhost");
    let dir = temp_dir("tls-reload");
    let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&cert_file, &first.cert_pem).unwrap();
    std::fs::write(&key_file, &first.key_pem).unwrap();
    let live = Leaf { cert_file: cert_file.clone(), key_file: key_file.clone(), ..first };

    let slow = HookServer::start(Behaviour { delay: Duration::from_millis(2500), ..Default::default() }).await;
    let tools = ToolServer::start(vec![ToolDef::new("t", "value")]).await;
    let config = server_tls(&live, None)
        + "[server.auth]\nmode = \"none\"\n"
        + &cfg::agent("slow", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("done", &[])
        + &cfg::tools(&tools.url, 5000)
        + &cfg::hook("slow", &slow.url, &["tool_result"], 5000)
        + &cfg::agent("fast", "")
        + &cfg::turn("hi", &[]);
    let lattice = Lattice::spawn_tls(&config, &[], ca.client_tls(None)).await;
    let addr = lattice.url.trim_start_matches("https://").to_owned();
    assert_eq!(presented(&addr, &ca).await, Some(der(&live)));

    // A query in flight on one connection while the files change.
    let channel = lattice.channel().await.unwrap();
    let mut client = pb::agent_service_client::AgentServiceClient::new(channel);
    let in_flight = {
        let mut client = client.clone();
        tokio::spawn(async move {
            let request = pb::QueryRequest { agent: "slow".into(), prompt: "go".into(), ..Default::default() };
            let mut stream = client.query(request).await?.into_inner();
            let mut last = None;
            while let Some(event) = stream.message().await? {
                last = Some(event);
            }
            Ok::<_, tonic::Status>(last)
        })
    };
    let called = async {
        while slow.state.tool_results().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), called).await.expect("the slow hook is called");

    let second = ca.issue("localhost");
    std::fs::write(&cert_file, &second.cert_pem).unwrap();
    std::fs::write(&key_file, &second.key_pem).unwrap();
    let rotated = async {
        while presented(&addr, &ca).await != Some(der(&second)) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), rotated).await.expect("new connections get the new certificate");

    let last = in_flight.await.unwrap().expect("the in-flight query completes");
    let done = matches!(last.and_then(|e| e.event), Some(pb::query_event::Event::Result(r)) if r.text == "done");
    assert!(done, "the in-flight query ends with its result");
    let request = pb::QueryRequest { agent: "fast".into(), prompt: "again".into(), ..Default::default() };
    assert!(client.query(request).await.is_ok(), "the old connection still takes queries");

    // A broken certificate is not loaded: the second one stays.
    std::fs::write(&cert_file, "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n").unwrap();
    let logged = async {
        while !lattice.process_logs().contains("certificate not reloaded") {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), logged).await.expect("the failed reload is logged");
    assert_eq!(presented(&addr, &ca).await, Some(der(&second)), "the previous certificate stays in force");
    assert_eq!(lattice.query_with(go("fast")).await.expect_ok().text, "hi");
    assert!(!lattice.process_logs().contains(second.key_pem.lines().nth(1).unwrap()), "no key in the logs");
}

/// `lattice query --ca --cert --key` and grpcurl's `-cacert/-cert/-key`
/// reach an mTLS listener; grpcurl's `-H 'authorization: Bearer …'` works
/// over TLS with tokens. Without a certificate both print UNAUTHENTICATED.
#[tokio::test(flavor = "multi_thread")]
async fn lattice_query_and_grpcurl_speak_tls() {
    let ca = TestCa::new("clients");
    let server = ca.issue("localhost");
    let alice = ca.issue("alice.example");
    let config = server_tls(&server, Some(&ca))
        + "[server.auth]\nmode = \"mtls\"\n"
        + &cfg::agent("echo", "")
        + &cfg::turn("you said: {{last_user_text}}", &[]);
    let lattice = Lattice::spawn_tls(&config, &[], ca.client_tls(Some(&alice))).await;
    let addr = lattice.url.trim_start_matches("https://").to_owned();
    let https = format!("https://{addr}");
    let path = |p: &std::path::Path| p.display().to_string();

    let query = |extra: &[String]| {
        let mut args = vec!["query".to_owned(), "--addr".into(), https.clone(), "--agent".into(), "echo".into()];
        args.extend(extra.iter().cloned());
        args.push("hi".into());
        let out = std::process::Command::new(workspace_binary("lattice")).args(&args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let tls_args = |with_cert: bool| {
        let mut a = vec!["--ca".to_owned(), path(&ca.file), "--server-name".into(), "localhost".into()];
        if with_cert {
            a.extend(["--cert".into(), path(&alice.cert_file), "--key".into(), path(&alice.key_file)]);
        }
        a
    };
    let (ok, text) = query(&tls_args(true));
    assert!(ok && text.contains("you said: hi"), "{text}");
    let (ok, text) = query(&tls_args(false));
    assert!(!ok && text.contains("UNAUTHENTICATED"), "{text}");
    // A CA that did not sign the server's certificate: a connection error
    // that says what to check, not silence.
    let other = TestCa::new("other");
    let (ok, text) = query(&["--ca".into(), path(&other.file), "--server-name".into(), "localhost".into()]);
    assert!(!ok && text.contains("cannot reach") && text.contains("--ca"), "{text}");

    let grpcurl = |extra: &[&str]| {
        let mut args = vec!["-cacert", ca.file.to_str().unwrap(), "-servername", "localhost"];
        args.extend_from_slice(extra);
        args.extend(["-d", r#"{"agent": "echo", "prompt": "hi"}"#, &addr, "lattice.agent.v1.AgentService/Query"]);
        let out = std::process::Command::new("grpcurl").args(&args).output().expect("grpcurl");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    let with_cert = ["-cert", alice.cert_file.to_str().unwrap(), "-key", alice.key_file.to_str().unwrap()];
    let text = grpcurl(&with_cert);
    assert!(text.contains("you said: hi"), "{text}");
    assert!(grpcurl(&[]).contains("Code: Unauthenticated"));
}

/// Bearer tokens over TLS (no client certificates): grpcurl with -cacert
/// and the authorization header.
#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_sends_a_bearer_token_over_tls() {
    let ca = TestCa::new("tokens");
    let server = ca.issue("localhost");
    let dir = temp_dir("tls-bearer");
    let tokens = dir.join("tokens.txt");
    let digest = lattice_tests::sha256_hex(b"tls-token-1");
    std::fs::write(&tokens, format!("alice {digest}\n")).unwrap();
    let config = server_tls(&server, None)
        + &format!("[server.auth]\nmode = \"token\"\ntokens_file = {:?}\n", tokens.display().to_string())
        + &cfg::agent("echo", "")
        + &cfg::turn("you said: {{last_user_text}}", &[]);
    let lattice = Lattice::spawn_tls(&config, &[], ca.client_tls(None)).await;
    let addr = lattice.url.trim_start_matches("https://").to_owned();
    let grpcurl = |header: Option<&str>| {
        let mut args = vec!["-cacert", ca.file.to_str().unwrap(), "-servername", "localhost"];
        if let Some(h) = header {
            args.extend(["-H", h]);
        }
        args.extend(["-d", r#"{"agent": "echo", "prompt": "hi"}"#, &addr, "lattice.agent.v1.AgentService/Query"]);
        let out = std::process::Command::new("grpcurl").args(&args).output().expect("grpcurl");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    let text = grpcurl(Some("authorization: Bearer tls-token-1"));
    assert!(text.contains("you said: hi"), "{text}");
    assert!(grpcurl(None).contains("Code: Unauthenticated"));
    assert!(!lattice.process_logs().contains("tls-token-1"), "no token in the logs");
}

/// `[server.tls]` mistakes are named at start-up, with the file and what
/// is wrong, never a key: a missing key_file, a key file that holds no
/// key, and mode "mtls" without a client CA.
#[tokio::test(flavor = "multi_thread")]
async fn server_tls_config_mistakes_are_named() {
    let ca = TestCa::new("config");
    let server = ca.issue("localhost");
    let cert = server.cert_file.display().to_string();
    for (table, field) in [
        (format!("[server.tls]\ncert_file = {cert:?}\n[server.auth]\nmode = \"none\"\n"), "server.tls.key_file"),
        (
            format!("[server.tls]\ncert_file = {cert:?}\nkey_file = {cert:?}\n[server.auth]\nmode = \"none\"\n"),
            "no valid PEM private key",
        ),
        (server_tls(&server, None) + "[server.auth]\nmode = \"mtls\"\n", "client_ca_file"),
        (server_tls(&server, None) + "[server.tls.extra]\n[server.auth]\nmode = \"none\"\n", "server.tls.extra"),
    ] {
        let path = temp_dir("tls-config").join("lattice.toml");
        std::fs::write(&path, table.clone() + &cfg::agent("a", "") + &cfg::turn("hi", &[])).unwrap();
        let out = std::process::Command::new(workspace_binary("lattice"))
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{table}: {text}");
        assert!(text.contains(field), "{table}: {text}");
        assert!(!text.contains("PRIVATE KEY"), "{text}");
    }
}
