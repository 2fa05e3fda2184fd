//! The PostgreSQL store under real faults: a database that accepts TLS
//! only (and one that checks client certificates, whose files are rotated
//! under a running Lattice), one whose every process is stopped (a failover's silent old
//! primary), a connection gone silent while the database is fine,
//! connections reset at random under concurrent sessions (on pipelined
//! connections and on pooled ones), PgBouncer in transaction mode, and a
//! schema the binary must not touch.
//! What a client is told must match what is stored: OK ⇒ the turn stored
//! once; a failure ⇒ nothing; UNKNOWN + COMMIT_OUTCOME_UNKNOWN ⇒ either.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use lattice_tests::{
    Lattice, QueryOpts, canary, cfg, message_text,
    postgres::{Cluster, PgBouncer, connect},
    reset_proxy::ResetProxy,
    sample, temp_dir,
    tls::{DirectTls, TestCa},
    workspace_binary,
};
use tonic::Code;
use tonic_types::StatusExt;

const URL_ENV: &str = "LATTICE_POSTGRES_URL";

/// What a replica logs when it finds a pooler in transaction mode with
/// prepared statements off.
const POOLER_FOUND: &str =
    "reached through a pooler in transaction mode: statements are sent one at a time on each connection";

/// An agent over the postgres store that answers "seen N" after `delay_ms`,
/// with `extra` session keys.
fn config(delay_ms: u64, extra: &str) -> String {
    format!("[sessions]\nstore = \"postgres\"\nurl_env = \"{URL_ENV}\"\n{extra}\n")
        + &cfg::agent("a", "")
        + &format!("[[agents.model.script]]\ntext = \"seen {{{{message_count}}}}\"\ndelay_ms = {delay_ms}\n")
}

fn query(prompt: &str, session: Option<&str>, timeout: Duration) -> QueryOpts {
    QueryOpts {
        agent: "a".into(),
        prompt: prompt.into(),
        session: session.map(str::to_owned),
        timeout: Some(timeout),
        no_model_requests: true,
        ..Default::default()
    }
}

/// Runs `lattice serve` on `config` until it exits (at most 30 s): whether
/// it exited 0, and what it wrote.
async fn serve_until_exit(config: &str, url: &str) -> (bool, String) {
    serve_until_exit_with(config, url, &[]).await
}

/// [`serve_until_exit`] with `env` set too.
async fn serve_until_exit_with(config: &str, url: &str, env: &[(&str, &str)]) -> (bool, String) {
    let dir = temp_dir("pgserve");
    let path = dir.join("lattice.toml");
    std::fs::write(&path, lattice_tests::with_open_auth(config)).unwrap();
    let run = tokio::process::Command::new(workspace_binary("lattice"))
        .args(["serve", "--config"])
        .arg(&path)
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "off"])
        .env(URL_ENV, url)
        .envs(env.iter().copied())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), run).await.expect("lattice serve did not exit").unwrap();
    let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.success(), text)
}

/// A database that accepts TLS only (`hostssl`, `hostnossl … reject`),
/// reached with each `sslmode` as a provider's console gives it: verify-full
/// (with a CA file, or `sslrootcert=system`), require, prefer and allow
/// connect and serve; a foreign CA, a certificate for another host, and no
/// TLS at all are refused at start-up with the reason, never the
/// connection string (its password included).
#[tokio::test(flavor = "multi_thread")]
async fn a_tls_only_database_is_reached_as_sslmode_says() {
    let ca = TestCa::new("pg");
    let server = ca.issue("127.0.0.1");
    let cluster = Cluster::tls_only(&server.cert_pem, &server.key_pem).await;
    let database = cluster.database().await;
    let password = canary();
    let with = |host: &str, params: &str| {
        let at = database.replacen("postgres@127.0.0.1", &format!("postgres:{password}@{host}"), 1);
        format!("{at}?{params}")
    };

    // `allow` tries plaintext first and `prefer` (the default, also when
    // unset) TLS first: each ends up over TLS here.
    for params in [
        format!("sslmode=verify-full&sslrootcert={}", ca.file.display()),
        "sslmode=require".to_owned(),
        "sslmode=prefer".to_owned(),
        "sslmode=allow".to_owned(),
        "connect_timeout=10".to_owned(),
    ] {
        let url = with("127.0.0.1", &params);
        let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
        let first = lattice.query("a", "over TLS").await;
        assert_eq!(first.expect_ok().text, "seen 1", "{params}");
        let stored = lattice.session(&first.session_id()).await.unwrap();
        assert_eq!(stored.messages.len(), 2, "{params}");
        assert!(!lattice.process_logs().contains(&password), "{params}: the password reached the log");
    }
    // `sslrootcert=system`: the system's CAs, here the test's CA as
    // OpenSSL's SSL_CERT_FILE names it (as a distribution's bundle would
    // hold a public CA).
    let url = with("127.0.0.1", "sslmode=verify-full&sslrootcert=system");
    let ca_file = ca.file.display().to_string();
    let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str()), ("SSL_CERT_FILE", &ca_file)]).await;
    assert_eq!(lattice.query("a", "over TLS").await.expect_ok().text, "seen 1", "sslrootcert=system");

    let foreign = TestCa::new("other");
    let exit = "on_unreachable = \"exit\"";
    for (url, reason) in [
        (
            with("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={}", foreign.file.display())),
            "the server's certificate is not signed by sslrootcert",
        ),
        (
            with("localhost", &format!("sslmode=verify-full&sslrootcert={}", ca.file.display())),
            "does not name the host",
        ),
        (with("127.0.0.1", "sslmode=disable"), "requires TLS"),
        // The system's CAs (here another CA's) do not include the test's.
        (with("127.0.0.1", "sslmode=verify-full&sslrootcert=system"), "not signed by sslrootcert"),
    ] {
        let system = [("SSL_CERT_FILE", foreign.file.to_str().unwrap_or_default())];
        let (ok, said) = serve_until_exit_with(&config(0, exit), &url, &system).await;
        assert!(!ok, "{url}: started");
        assert!(said.contains(reason), "{url}: expected {reason:?} in:\n{said}");
        assert!(!said.contains(&password) && !said.contains(&url), "the connection string reached the output:\n{said}");
    }
}

/// A password sent over TLS is bound to the TLS connection
/// (SCRAM-SHA-256-PLUS, libpq's `channel_binding`), so that even with
/// `sslmode=require`, which checks no certificate, a man in the middle
/// cannot pass it on. With `channel_binding=require`, as some providers'
/// consoles give it, Lattice connects only if the binding was made, and
/// PostgreSQL checks it: certificates signed with SHA-256 and SHA-384
/// (the binding hashes the certificate as it is signed). A server that
/// authenticates without a password cannot bind, and is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_password_over_tls_is_bound_to_the_connection() {
    for (name, algorithm) in
        [("pg-sha256", &rcgen::PKCS_ECDSA_P256_SHA256), ("pg-sha384", &rcgen::PKCS_ECDSA_P384_SHA384)]
    {
        let ca = TestCa::new_with(name, algorithm);
        let server = ca.issue("127.0.0.1");
        let cluster = Cluster::tls_only_with_passwords(&server.cert_pem, &server.key_pem).await;
        let password = canary();
        let admin = connect(&cluster.admin_url("postgres")).await;
        admin.batch_execute(&format!("ALTER ROLE postgres PASSWORD '{password}'")).await.unwrap();
        let database = cluster.database().await;
        let with = |password: &str, params: &str| {
            let at = database.replacen("postgres@", &format!("postgres:{password}@"), 1);
            format!("{at}?{params}")
        };
        for params in [
            "sslmode=require&channel_binding=require".to_owned(),
            format!("sslmode=verify-full&sslrootcert={}&channel_binding=require", ca.file.display()),
            "sslmode=require".to_owned(),
        ] {
            let url = with(&password, &params);
            let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
            let first = lattice.query("a", "bound").await;
            assert_eq!(first.expect_ok().text, "seen 1", "{name}: {params}");
            assert!(!lattice.process_logs().contains(&password), "{name}: {params}: the password reached the log");
        }
        let exit = "on_unreachable = \"exit\"";
        let wrong = with("not-the-password", "sslmode=require&channel_binding=require");
        let (ok, said) = serve_until_exit(&config(0, exit), &wrong).await;
        assert!(!ok && said.contains("the server refused the password"), "{name}: a wrong password:\n{said}");
    }
    let ca = TestCa::new("pg-trust");
    let server = ca.issue("127.0.0.1");
    let trusting = Cluster::tls_only(&server.cert_pem, &server.key_pem).await;
    let url = format!("{}?sslmode=require&channel_binding=require", trusting.database().await);
    let (ok, said) = serve_until_exit(&config(0, "on_unreachable = \"exit\""), &url).await;
    assert!(!ok && said.contains("did not bind the password"), "no password asked:\n{said}");
}

/// The connection string in a file (`url_file`: a Kubernetes Secret
/// mounted as a volume, which the kubelet updates in place), read again for
/// each new connection: a rotated password reaches new connections without
/// a restart. A file that cannot be used meanwhile (half-written, or not a
/// connection string) leaves new connections on the last string that could,
/// and the log says why once, never what the file holds.
#[tokio::test(flavor = "multi_thread")]
async fn a_password_rotated_in_the_url_file_needs_no_restart() {
    let ca = TestCa::new("pg-rotate");
    let server = ca.issue("127.0.0.1");
    let cluster = Cluster::tls_only_with_passwords(&server.cert_pem, &server.key_pem).await;
    let admin = connect(&cluster.admin_url("postgres")).await;
    let (first, second) = (canary(), canary());
    admin.batch_execute(&format!("ALTER ROLE postgres PASSWORD '{first}'")).await.unwrap();
    let database = cluster.database().await;
    let url = |password: &str| {
        format!("{}?sslmode=require", database.replacen("postgres@", &format!("postgres:{password}@"), 1))
    };
    let dir = lattice_tests::temp_dir("urlfile");
    let file = dir.join("url");
    // Replaced whole, as the kubelet replaces a Secret's files.
    let write = |text: &str| {
        std::fs::write(dir.join("url.new"), text).unwrap();
        std::fs::rename(dir.join("url.new"), &file).unwrap();
    };
    write(&url(&first));
    let from_file = config(0, "").replace(&format!("url_env = \"{URL_ENV}\""), &format!("url_file = {:?}", file));
    let lattice = Lattice::spawn(&from_file, &[]).await;
    let sid = lattice.query("a", "before").await.session_id();
    // Goes on once new connections are made (those open were cut).
    let continues = |prompt: &'static str| {
        let (lattice, sid) = (&lattice, sid.clone());
        async move {
            let start = Instant::now();
            loop {
                let out = lattice.query_with(query(prompt, Some(&sid), Duration::from_secs(5))).await;
                if out.code() == Code::Ok {
                    return;
                }
                assert!(start.elapsed() < Duration::from_secs(10), "{prompt}: still {:?}", out.code());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };

    admin.batch_execute(&format!("ALTER ROLE postgres PASSWORD '{second}'")).await.unwrap();
    write(&url(&second));
    assert!(cluster.cut_connections().await > 0, "Lattice had no connection to cut");
    continues("after the rotation").await;
    // A config reload after it: the string changed, in the file, and that
    // needs no restart.
    lattice.rewrite_config(&from_file.replace("seen", "saw"));
    let reloaded = Instant::now();
    loop {
        let metrics = lattice.metrics().await;
        let count = |result: &str| sample(&metrics, &format!("lattice_config_reloads_total{{result=\"{result}\"}}"));
        assert_eq!(count("restart_needed"), None, "{}", lattice.process_logs());
        if count("ok") == Some(1.0) {
            break;
        }
        assert!(reloaded.elapsed() < Duration::from_secs(10), "the config was not reloaded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    write("host=db.example password='half-written");
    cluster.cut_connections().await;
    continues("with a broken file").await;
    let logs = lattice.process_logs();
    let said = logs.matches("the connection string's file cannot be used").count();
    assert_eq!(said, 1, "said once:\n{logs}");
    for secret in [&first, &second] {
        assert!(!logs.contains(secret.as_str()), "a password reached the log");
    }
    let stored = lattice.session(&sid).await.unwrap();
    assert_eq!(stored.messages.len(), 6, "{:?}", stored.messages.iter().map(message_text).collect::<Vec<_>>());
}

/// `sslnegotiation=direct` (PostgreSQL 17): TLS at once, without asking
/// the server first, and with the ALPN protocol `postgresql`, which such a
/// server requires. Here a TLS terminator that behaves so, in front of a
/// plaintext PostgreSQL. `direct` with an `sslmode` that may fall back to
/// plaintext is refused at start-up, as libpq refuses it.
#[tokio::test(flavor = "multi_thread")]
async fn sslnegotiation_direct_reaches_a_server_that_takes_tls_at_once() {
    let ca = TestCa::new("pg-direct");
    let server = ca.issue("127.0.0.1");
    let (database, upstream) = database_and_upstream().await;
    let direct = DirectTls::start(&server, upstream).await;
    let url = |params: &str| format!("postgres://postgres@{}/{database}?{params}", direct.addr);
    for params in [
        format!("sslmode=verify-full&sslrootcert={}&sslnegotiation=direct", ca.file.display()),
        "sslmode=require&sslnegotiation=direct".to_owned(),
    ] {
        let url = url(&params);
        let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
        assert_eq!(lattice.query("a", "direct").await.expect_ok().text, "seen 1", "{params}");
    }
    let (served, refused) = direct.counts();
    assert!(served > 0 && refused == 0, "served {served}, refused {refused}");
    let exit = config(0, "on_unreachable = \"exit\"");
    for weak in ["sslnegotiation=direct", "sslmode=prefer&sslnegotiation=direct", "sslmode=allow&sslnegotiation=direct"]
    {
        let (ok, said) = serve_until_exit(&exit, &url(weak)).await;
        assert!(!ok && said.contains("sslnegotiation=direct needs sslmode"), "{weak}:\n{said}");
    }
}

/// A connection string naming several hosts, as libpq takes them (an HA
/// pair's endpoints, in order): the first that answers serves, and with
/// `verify-full` the certificate is checked against the host reached. With
/// `target_session_attrs=read-write`, only a server that takes writes does.
#[tokio::test(flavor = "multi_thread")]
async fn a_list_of_hosts_is_tried_in_order() {
    let ca = TestCa::new("pg-hosts");
    let server = ca.issue("127.0.0.1");
    let cluster = Cluster::tls_only(&server.cert_pem, &server.key_pem).await;
    let database = cluster.database().await;
    // A port nobody listens on, named first.
    let (listener, gone) = lattice_tests::bind().await;
    drop(listener);
    let hosts = |first: &str| database.replacen("127.0.0.1:", &format!("{first}:{},127.0.0.1:", gone.port()), 1);
    let tls = format!("sslmode=verify-full&sslrootcert={}", ca.file.display());
    for url in [
        format!("{}?{tls}", hosts("127.0.0.1")),
        format!("{}?{tls}&target_session_attrs=read-write", hosts("localhost")),
    ] {
        let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
        let first = lattice.query("a", "hi").await;
        assert_eq!(first.expect_ok().text, "seen 1", "{url}");
        assert_eq!(lattice.session(&first.session_id()).await.unwrap().messages.len(), 2);
    }

    // A server that takes no writes (as a standby does) named first: with
    // read-write asked for, the next one serves; without, the first is
    // used, and start-up says why it cannot serve.
    let writable = Cluster::shared().await.database().await;
    let (name, rest) = (writable.rsplit('/').next().unwrap(), writable.trim_start_matches("postgres://postgres@"));
    let standby = Cluster::private().await;
    let admin = connect(&standby.admin_url("postgres")).await;
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
    admin.batch_execute("ALTER SYSTEM SET default_transaction_read_only = on").await.unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    let both = format!("postgres://postgres@127.0.0.1:{},{rest}", standby.port());
    let url = format!("{both}?target_session_attrs=read-write");
    let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
    assert_eq!(lattice.query("a", "hi").await.expect_ok().text, "seen 1", "{url}");
    let exit = config(0, "on_unreachable = \"exit\"");
    let (ok, said) = serve_until_exit(&exit, &both).await;
    assert!(!ok && said.contains("the server takes no writes"), "{said}");
    // Named alone, with read-write asked for: skipped, and said so.
    let alone = format!("postgres://postgres@127.0.0.1:{}/{name}?target_session_attrs=read-write", standby.port());
    let (ok, said) = serve_until_exit(&exit, &alone).await;
    assert!(!ok && said.contains("the server takes no writes"), "{said}");
    // No host usable: the log says why for each, by its place.
    let (port, gone) = (standby.port(), gone.port());
    let neither =
        format!("postgres://postgres@127.0.0.1:{gone},127.0.0.1:{port}/{name}?target_session_attrs=read-write");
    let (ok, said) = serve_until_exit(&exit, &neither).await;
    assert!(!ok, "{said}");
    for reason in ["host 1 of 2: connection refused", "host 2 of 2: the server takes no writes"] {
        assert!(said.contains(reason), "no {reason:?} in:\n{said}");
    }
}

/// `sslmode=allow` with several hosts, as libpq does it: each host is
/// tried whole (plaintext, then TLS) before the next, so a first host that
/// requires TLS serves over TLS rather than the second in plaintext.
#[tokio::test(flavor = "multi_thread")]
async fn sslmode_allow_tries_each_host_whole_before_the_next() {
    let ca = TestCa::new("pg-allow");
    let server = ca.issue("127.0.0.1");
    let tls_only = Cluster::tls_only(&server.cert_pem, &server.key_pem).await;
    let database = tls_only.database().await;
    let name = database.rsplit('/').next().unwrap().to_owned();
    let plaintext = Cluster::private().await;
    connect(&plaintext.admin_url("postgres")).await.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{name}?sslmode=allow",
        tls_only.port(),
        plaintext.port()
    );
    let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
    let first = lattice.query("a", "where").await;
    first.expect_ok();
    let stored = "SELECT count(*) FROM lattice_sessions WHERE id = $1";
    let sid = first.session_id();
    let on_first = connect(&tls_only.admin_url(&name)).await.query_one(stored, &[&sid]).await.unwrap();
    assert_eq!(on_first.get::<_, i64>(0), 1, "the session is not on the first host");
    let second = connect(&plaintext.admin_url(&name)).await;
    let schema = second.query_one("SELECT to_regclass('lattice_sessions') IS NOT NULL", &[]).await.unwrap();
    assert!(!schema.get::<_, bool>(0), "the second host was used");
}

/// A database that stops taking writes (a primary turned standby, or a
/// managed service's read-only mode when its disk is full): queries are told
/// UNAVAILABLE and store nothing, health says NOT_SERVING and the log says
/// why; once it takes writes again, all is as before, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_that_takes_no_writes_is_not_serving_until_it_does() {
    let cluster = Cluster::private().await;
    let url = cluster.database().await;
    let lattice = Lattice::spawn(&config(0, "store_timeout_ms = 1000"), &[(URL_ENV, url.as_str())]).await;
    let first = lattice.query_with(query("start", None, Duration::from_secs(5))).await;
    first.expect_ok();
    let sid = first.session_id();
    let admin = connect(&cluster.admin_url("postgres")).await;
    let read_only = async |on: &str| {
        admin.batch_execute(&format!("ALTER SYSTEM SET default_transaction_read_only = {on}")).await.unwrap();
        admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    };
    read_only("on").await;
    health_turns(&lattice, false, Duration::from_secs(5), "once the database took no writes").await;
    let refused = lattice.query_with(query("refused", Some(&sid), Duration::from_secs(5))).await;
    assert_eq!(refused.code(), Code::Unavailable, "{:?}", refused.status);
    let logs = lattice.process_logs();
    assert!(logs.contains("the server takes no writes"), "no reason in the log:\n{logs}");
    read_only("off").await;
    health_turns(&lattice, true, Duration::from_secs(5), "once the database took writes again").await;
    let next = lattice.query_with(query("next", Some(&sid), Duration::from_secs(5))).await;
    assert_eq!(next.expect_ok().text, "seen 3", "the refused query was stored");
    let stored = lattice.session(&sid).await.unwrap();
    assert_eq!(stored.messages.iter().map(message_text).collect::<Vec<_>>()[2], "next");
}

/// A connection string that points nowhere useful is refused at start-up
/// with words an operator can act on: a host name that does not resolve,
/// a socket directory with no server in it, a port where something else
/// answers.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_address_is_refused_with_the_reason() {
    // Something that is not PostgreSQL: it answers every connection with
    // an HTTP error and closes it.
    let (listener, addr) = lattice_tests::bind().await;
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = socket.read(&mut [0; 1024]).await;
            let _ = socket.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n").await;
            let _ = socket.shutdown().await;
        }
    });
    let exit = config(0, "on_unreachable = \"exit\"");
    for (url, reason) in [
        ("postgres://postgres@nosuchhost.invalid/lattice".to_owned(), "the host name could not be resolved"),
        ("host=/nonexistent user=postgres dbname=lattice".to_owned(), "no server's socket in that directory"),
        (format!("postgres://postgres@{addr}/lattice"), "does not speak PostgreSQL's protocol"),
    ] {
        let (ok, said) = serve_until_exit(&exit, &url).await;
        assert!(!ok && said.contains(reason), "{url}: expected {reason:?} in:\n{said}");
    }
}

/// A database that does not offer TLS at all: `prefer` and `allow` reach it
/// in plaintext; `require`, and every mode that checks the server's
/// certificate, are refused at start-up with the reason.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_without_tls_is_reached_as_sslmode_says() {
    let database = Cluster::shared().await.database().await;
    for params in ["sslmode=prefer", "sslmode=allow"] {
        let url = format!("{database}?{params}");
        let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
        assert_eq!(lattice.query("a", "in plaintext").await.expect_ok().text, "seen 1", "{params}");
    }
    let ca = TestCa::new("pg-none");
    let exit = "on_unreachable = \"exit\"";
    for params in ["sslmode=require".to_owned(), format!("sslmode=verify-full&sslrootcert={}", ca.file.display())] {
        let url = format!("{database}?{params}");
        let (ok, said) = serve_until_exit(&config(0, exit), &url).await;
        assert!(!ok, "{params}: started");
        assert!(said.contains("the server does not accept TLS"), "{params}: no reason in:\n{said}");
        assert!(!said.contains(&url), "the connection string reached the output:\n{said}");
    }
}

/// A database that checks client certificates (`clientcert=verify-ca`):
/// reached with `sslcert`/`sslkey`; without them, or with a certificate of
/// a CA it does not trust, refused at start-up with the reason. Then, under
/// a running Lattice, every file is rotated: the server's certificate to
/// one of a new CA (and `sslrootcert` rewritten to that CA), the client's
/// to one of a new CA the server now trusts instead. Once the database cuts
/// every connection, queries succeed again on new connections made from
/// the files as they are now: no restart.
#[tokio::test(flavor = "multi_thread")]
async fn client_certificates_are_presented_and_rotated_files_reach_new_connections() {
    let (server_ca, client_ca) = (TestCa::new("pg-server"), TestCa::new("pg-client"));
    let server = server_ca.issue("127.0.0.1");
    let cluster = Cluster::tls_only_with_client_certificates(&server.cert_pem, &server.key_pem, &client_ca.pem).await;
    let database = cluster.database().await;
    let password = canary();
    let at = database.replacen("postgres@", &format!("postgres:{password}@"), 1);
    // The files Lattice is given, as a Secret mounted in a pod: rewritten
    // in place when rotated.
    let files = temp_dir("pg-client-files");
    let (root, cert, key) = (files.join("ca.crt"), files.join("tls.crt"), files.join("tls.key"));
    let client = client_ca.issue("lattice");
    let write = |ca: &str, leaf: &lattice_tests::tls::Leaf| {
        std::fs::write(&root, ca).unwrap();
        std::fs::write(&cert, &leaf.cert_pem).unwrap();
        std::fs::write(&key, &leaf.key_pem).unwrap();
    };
    write(&server_ca.pem, &client);
    let verify = format!("sslmode=verify-full&sslrootcert={}", root.display());
    let with_client = format!("{at}?{verify}&sslcert={}&sslkey={}", cert.display(), key.display());

    // Refused, with the reason: no client certificate, and one the database
    // does not trust.
    let exit = "on_unreachable = \"exit\"";
    let foreign_ca = TestCa::new("pg-foreign");
    let foreign = foreign_ca.issue("lattice");
    for (url, reason) in [
        (format!("{at}?{verify}"), "the server requires a client certificate it accepts: set sslcert and sslkey"),
        (
            format!("{at}?{verify}&sslcert={}&sslkey={}", foreign.cert_file.display(), foreign.key_file.display()),
            "does it require a client certificate (sslcert, sslkey)?",
        ),
    ] {
        let (ok, said) = serve_until_exit(&config(0, exit), &url).await;
        assert!(!ok, "{url}: started");
        assert!(said.contains(reason), "{url}: expected {reason:?} in:\n{said}");
        assert!(!said.contains(&password) && !said.contains(&url), "the connection string reached the output:\n{said}");
    }

    let lattice = Lattice::spawn(&config(0, ""), &[(URL_ENV, with_client.as_str())]).await;
    let first = lattice.query("a", "with a client certificate").await;
    assert_eq!(first.expect_ok().text, "seen 1");
    let session = first.session_id();

    // Everything rotated: the old files would now be refused both ways.
    let (new_server_ca, new_client_ca) = (TestCa::new("pg-server-next"), TestCa::new("pg-client-next"));
    let new_server = new_server_ca.issue("127.0.0.1");
    write(&new_server_ca.pem, &new_client_ca.issue("lattice"));
    cluster.rotate_tls(&new_server.cert_pem, &new_server.key_pem, Some(&new_client_ca.pem));
    assert!(cluster.cut_connections().await > 0, "Lattice held no connection to cut");

    // Queries continue the session until one succeeds (those on a cut
    // connection may fail, and then store nothing).
    let until = Instant::now() + Duration::from_secs(20);
    let mut told_ok = 1;
    loop {
        let out = lattice.query_with(query("after the rotation", Some(&session), Duration::from_secs(5))).await;
        match &out.status {
            None => {
                told_ok += 1;
                break;
            }
            Some(status) if Instant::now() < until => {
                assert_ne!(status.code(), Code::Unknown, "an outcome left unknown: {}", status.message());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Some(status) => panic!(
                "no query succeeded on new connections after the rotation: {:?} {}\n{}",
                status.code(),
                status.message(),
                lattice.process_logs()
            ),
        }
    }
    let stored = lattice.session(&session).await.unwrap();
    assert_eq!(stored.messages.len(), 2 * told_ok, "what was stored is not what clients were told");
    assert!(!lattice.process_logs().contains(&password), "the password reached the log");
}

/// Every process of the database stopped (SIGSTOP: connections stay open,
/// nothing answers, no reset comes) under concurrent queries: each ends by
/// its deadline, not OK; health turns NOT_SERVING within a few seconds;
/// GetSession and DeleteSession are told UNAVAILABLE within the store's
/// timeout; after SIGCONT everything heals without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_silent_database_ends_each_query_by_its_deadline_and_heals() {
    a_silent_database_ends_each_query_by_its_deadline_and_heals_("").await;
}

/// The same with leases kept between queries: a session's next query
/// takes its kept lease without the database and waits on it only to
/// commit, so it may be told `UNKNOWN` (the commit was sent, no answer
/// came); such a turn is stored once or not at all.
#[tokio::test(flavor = "multi_thread")]
async fn a_silent_database_with_kept_leases_ends_each_query_by_its_deadline_and_heals() {
    a_silent_database_ends_each_query_by_its_deadline_and_heals_("keep_lease_ms = 30000").await;
}

async fn a_silent_database_ends_each_query_by_its_deadline_and_heals_(extra: &str) {
    let cluster = Cluster::private().await;
    let url = cluster.database().await;
    let keys = format!("store_timeout_ms = 1000\nlease_ttl_ms = 3000\n{extra}");
    let lattice = Arc::new(Lattice::spawn(&config(300, &keys), &[(URL_ENV, url.as_str())]).await);
    let sessions: Vec<String> = {
        let mut ids = Vec::new();
        for i in 0..4 {
            let out = lattice.query_with(query(&format!("start {i}"), None, Duration::from_secs(10))).await;
            out.expect_ok();
            ids.push(out.session_id());
        }
        ids
    };
    // A session to delete while the database is frozen.
    let spare = lattice.query_with(query("spare", None, Duration::from_secs(10))).await.session_id();

    cluster.freeze();
    let deadline = Duration::from_secs(2);
    let mut running = Vec::new();
    for (i, sid) in sessions.iter().enumerate() {
        let (continuing, sid) = (lattice.clone(), sid.clone());
        running.push(tokio::spawn(async move {
            let started = Instant::now();
            let out = continuing.query_with(query(&format!("frozen {i}"), Some(&sid), deadline)).await;
            (Some(i), out.code(), started.elapsed())
        }));
        // A new session too: its creation waits on the database as well.
        let lattice = lattice.clone();
        running.push(tokio::spawn(async move {
            let started = Instant::now();
            let out = lattice.query_with(query("new while frozen", None, deadline)).await;
            (None, out.code(), started.elapsed())
        }));
    }
    // What each session's frozen query was told.
    let mut told = vec![Code::Ok; sessions.len()];
    let mut told_unknown = 0;
    for q in running {
        let (session, code, took) = q.await.unwrap();
        told_unknown += usize::from(code == Code::Unknown);
        assert_ne!(code, Code::Ok);
        // The client's own timer fires at the deadline too; Lattice must
        // have ended the query by then (plus a little for the reply).
        assert!(took < deadline + Duration::from_millis(500), "{code:?} after {took:?}");
        if let Some(i) = session {
            told[i] = code;
        }
    }
    health_turns(&lattice, false, Duration::from_secs(5), "after the database froze").await;
    let metrics = lattice.metrics().await;
    assert_eq!(sample(&metrics, "lattice_session_store_up"), Some(0.0));
    eprintln!("told: {told:?}, UNKNOWN {told_unknown} of {}", 2 * sessions.len());
    // Each query told UNKNOWN counted so, and no other.
    let unknown = sample(&metrics, "lattice_session_commits_total{outcome=\"unknown\"}").unwrap_or_default();
    assert_eq!(unknown, told_unknown as f64, "{metrics}");
    // Reading and deleting a session wait for it `store_timeout_ms` (1 s)
    // at most, and are told so.
    let started = Instant::now();
    let read = lattice.session_page(&sessions[0], 0, "").await;
    assert_eq!(read.map(drop).map_err(|s| s.code()), Err(Code::Unavailable), "a read while frozen");
    assert!(started.elapsed() < Duration::from_millis(2500), "a read held {:?}", started.elapsed());
    let started = Instant::now();
    let request = lattice_proto::agent::v1::DeleteSessionRequest { session_id: spare.clone() };
    let deleted = lattice.client().await.delete_session(request).await;
    assert_eq!(deleted.map(drop).map_err(|s| s.code()), Err(Code::Unavailable), "a delete while frozen");
    assert!(started.elapsed() < Duration::from_millis(2500), "a delete held {:?}", started.elapsed());

    cluster.thaw();
    health_turns(&lattice, true, Duration::from_secs(10), "after the database thawed").await;
    assert_eq!(sample(&lattice.metrics().await, "lattice_session_store_up"), Some(1.0));
    // Every session is usable again: no lease left held, nothing of the
    // failed queries stored.
    for sid in &sessions {
        let mut out = lattice.query_with(query("after", Some(sid), Duration::from_secs(10))).await;
        // A lease whose release the freeze cut off expires (3 s).
        let retried = Instant::now();
        while out.code() == Code::FailedPrecondition && retried.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            out = lattice.query_with(query("after", Some(sid), Duration::from_secs(10))).await;
        }
        out.expect_ok();
        // The first turn and this one are stored; the frozen one only if
        // it was told UNKNOWN (its commit sent), and then once.
        let stored = lattice.session(sid).await.unwrap();
        let texts: Vec<String> = stored.messages.iter().map(message_text).collect();
        let frozen = texts.iter().filter(|t| t.starts_with("frozen")).count();
        let i = sessions.iter().position(|s| s == sid).unwrap_or_default();
        let most = usize::from(told[i] == Code::Unknown);
        assert!(frozen <= most, "told {:?}, stored: {texts:?}", told[i]);
        assert_eq!(texts.iter().filter(|t| *t == "after").count(), 1, "{texts:?}");
        assert_eq!(texts.len(), 4 + 2 * frozen, "{texts:?}");
    }
}

/// A replica started while its database is down (`on_unreachable =
/// "wait"`, the default): it starts NOT_SERVING, tells queries UNAVAILABLE
/// and logs why (never the connection string); once the database starts,
/// it migrates the schema, turns SERVING and serves, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_started_before_its_database_waits_for_it() {
    let cluster = Cluster::private().await;
    // A database never migrated: the replica's first contact must do it.
    let url = cluster.database().await;
    cluster.stop();
    let lattice = Lattice::spawn_answering(&config(0, ""), &[(URL_ENV, url.as_str())]).await;
    assert!(!lattice.serving().await && !lattice.serving_as("").await, "SERVING without its database");
    assert!(lattice.serving_as("liveness").await, "liveness follows the process, not the database");
    let out = lattice.query("a", "too soon").await;
    assert_eq!(out.code(), Code::Unavailable, "{:?}", out.status);
    let logs = lattice.process_logs();
    assert!(logs.contains("session store unreachable at start-up"), "no word of it in the log:\n{logs}");
    assert!(logs.contains("connection refused"), "no reason in the log:\n{logs}");

    cluster.start().await;
    health_turns(&lattice, true, Duration::from_secs(15), "after the database started").await;
    assert_eq!(lattice.query("a", "now").await.expect_ok().text, "seen 1");
    let client = connect(&url).await;
    let version: i32 = client.query_one("SELECT max(version) FROM lattice_migrations", &[]).await.unwrap().get(0);
    assert!(version > 0, "no schema version recorded");
    assert!(!lattice.process_logs().contains(&url), "the connection string reached the log");
}

/// Waits until health says SERVING (`serving`) or NOT_SERVING, failing
/// the test if it does not within `within` of now (`when` says of what).
async fn health_turns(lattice: &Lattice, serving: bool, within: Duration, when: &str) {
    let start = Instant::now();
    while lattice.serving().await != serving {
        let want = if serving { "SERVING" } else { "NOT_SERVING" };
        assert!(start.elapsed() < within, "not {want} {within:?} {when}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Lattice whose database connections pass through a proxy (on a new
/// database of the shared cluster; a store timeout of 1 s; `extra`: more
/// `[sessions]` keys), and a session it created.
async fn one_session_behind_a_proxy(extra: &str) -> (ResetProxy, Lattice, String) {
    let (database, upstream) = database_and_upstream().await;
    let proxy = ResetProxy::start(upstream).await;
    let url = format!("postgres://postgres@{}/{database}", proxy.addr);
    let keys = format!("store_timeout_ms = 1000\n{extra}");
    let lattice = Lattice::spawn(&config(0, &keys), &[(URL_ENV, url.as_str())]).await;
    let first = lattice.query_with(query("start", None, Duration::from_secs(5))).await;
    first.expect_ok();
    let sid = first.session_id();
    (proxy, lattice, sid)
}

/// A new database on the shared cluster: its name, and where the cluster
/// listens (for a proxy in front of it).
async fn database_and_upstream() -> (String, std::net::SocketAddr) {
    let cluster = Cluster::shared().await;
    let url = cluster.database().await;
    let database = url.rsplit('/').next().unwrap().to_owned();
    (database, format!("127.0.0.1:{}", cluster.port()).parse().unwrap())
}

/// What one session's queries were told.
#[derive(Debug, Default)]
struct Told {
    /// The prompts told OK, failed (with the code), or UNKNOWN.
    ok: Vec<String>,
    failed: Vec<(String, Code)>,
    unknown: Vec<String>,
}

/// 8 sessions query for `run` on two replicas in turn, through a proxy
/// that resets a random database connection every 50–200 ms; then every
/// session is read back: a prompt told OK is stored exactly once, a prompt
/// told any failure is not stored, and no prompt is stored twice. Returns
/// the tallies. `extra`: more `[sessions]` keys.
async fn resets_keep_outcomes_exact(
    upstream: std::net::SocketAddr,
    database: &str,
    run: Duration,
    extra: &str,
) -> HashMap<&'static str, usize> {
    let proxy = ResetProxy::start(upstream).await;
    let url = format!("postgres://postgres@{}/{database}", proxy.addr);
    let faults = async {
        proxy.reset_every(Duration::from_millis(50)..Duration::from_millis(200));
        tokio::time::sleep(run).await;
        proxy.calm();
        proxy.resets()
    };
    let (resets, tally) = outcomes_stay_exact(&url, run, extra, faults).await;
    eprintln!("resets: {resets}, tally: {tally:?}");
    assert!(resets > 50, "the proxy reset too little to prove anything: {resets}");
    assert!(tally["ok"] > 100, "too few queries succeeded: {tally:?}");
    tally
}

/// 8 sessions query for `run` on two replicas in turn (with `extra`
/// `[sessions]` keys) at `url`, while `faults` runs; then every session is
/// read back: a prompt told OK is stored exactly once, a prompt told any
/// failure is not stored, and no prompt is stored twice. Returns what
/// `faults` returned, and the tallies of what clients were told.
async fn outcomes_stay_exact<T>(
    url: &str,
    run: Duration,
    extra: &str,
    faults: impl Future<Output = T>,
) -> (T, HashMap<&'static str, usize>) {
    let keys = format!("store_timeout_ms = 2000\nlease_ttl_ms = 3000\npool_size = 4\n{extra}");
    let mut replicas = Vec::new();
    for _ in 0..2 {
        replicas.push(Arc::new(Lattice::spawn(&config(5, &keys), &[(URL_ENV, url)]).await));
    }
    let lattice = replicas[0].clone();
    let mut clients = Vec::new();
    for c in 0..8 {
        let replicas = replicas.clone();
        clients.push(tokio::spawn(async move {
            let mut told = Told::default();
            let mut session: Option<String> = None;
            let start = Instant::now();
            let mut n = 0;
            while start.elapsed() < run {
                n += 1;
                let prompt = format!("client {c} query {n}");
                let lattice = &replicas[(c + n) % 2];
                let out = lattice.query_with(query(&prompt, session.as_deref(), Duration::from_secs(5))).await;
                if session.is_none() && out.code() == Code::Ok {
                    session = Some(out.session_id());
                }
                match &out.status {
                    None => told.ok.push(prompt),
                    Some(s) if s.code() == Code::Unknown => {
                        let info = s.get_details_error_info().expect("UNKNOWN carries ErrorInfo");
                        assert_eq!(info.reason, "COMMIT_OUTCOME_UNKNOWN");
                        told.unknown.push(prompt);
                    }
                    Some(s) => {
                        if matches!(s.code(), Code::FailedPrecondition | Code::Unavailable) {
                            // A lease its holder could not give back
                            // expires, a database away comes back: no
                            // need to spin meanwhile.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        told.failed.push((prompt, s.code()))
                    }
                }
            }
            (session, told)
        }));
    }
    let faulted = faults.await;
    let mut results = Vec::new();
    for c in clients {
        results.push(c.await.unwrap());
    }

    let mut tally: HashMap<&'static str, usize> = HashMap::new();
    for (session, told) in &results {
        *tally.entry("ok").or_default() += told.ok.len();
        *tally.entry("unknown").or_default() += told.unknown.len();
        for (_, code) in &told.failed {
            let key = match code {
                Code::Unavailable => "unavailable",
                Code::FailedPrecondition => "busy",
                Code::Aborted => "aborted",
                Code::DeadlineExceeded => "deadline",
                _ => "other",
            };
            *tally.entry(key).or_default() += 1;
        }
        let Some(session) = session else { continue };
        let mut stored: Option<lattice_proto::agent::v1::Session> = None;
        for _ in 0..50 {
            match lattice.session(session).await {
                Ok(s) => {
                    stored = Some(s);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let stored = stored.expect("the session reads back once the faults stop");
        let mut times: HashMap<String, usize> = HashMap::new();
        for m in &stored.messages {
            *times.entry(message_text(m)).or_default() += 1;
        }
        for prompt in &told.ok {
            assert_eq!(times.get(prompt), Some(&1), "{prompt}: told OK, stored {:?} times", times.get(prompt));
        }
        for (prompt, code) in &told.failed {
            assert_eq!(times.get(prompt), None, "{prompt}: told {code:?}, yet stored");
        }
        for prompt in &told.unknown {
            assert!(times.get(prompt).is_none_or(|n| *n == 1), "{prompt}: UNKNOWN, stored twice");
        }
    }
    // Each replica counted how its commits ended, and the counts agree
    // with what the clients were told.
    let mut commits: HashMap<&str, f64> = HashMap::new();
    for replica in &replicas {
        let text = replica.metrics().await;
        for outcome in ["stored", "read_back_stored", "read_back_not_stored", "unknown"] {
            let series = format!("lattice_session_commits_total{{outcome=\"{outcome}\"}}");
            *commits.entry(outcome).or_default() += sample(&text, &series).unwrap_or_default();
        }
    }
    eprintln!("commits: {commits:?}");
    let told_ok = tally.get("ok").copied().unwrap_or(0) as f64;
    assert_eq!(commits["stored"] + commits["read_back_stored"], told_ok, "stored: {commits:?}, {tally:?}");
    let told_unknown = tally.get("unknown").copied().unwrap_or(0) as f64;
    assert_eq!(commits["unknown"], told_unknown, "unknown: {commits:?}, {tally:?}");
    (faulted, tally)
}

/// The database restarted (`pg_ctl stop -m fast`, as for maintenance or a
/// failover: every connection closed, statements in flight cut off, the
/// server away for a moment) three times under 8 concurrent sessions on two
/// replicas: every outcome exact (see [`outcomes_stay_exact`]), and the
/// leases of queries that failed are given back once it is back.
#[tokio::test(flavor = "multi_thread")]
async fn database_restarts_keep_outcomes_exact() {
    database_restarts_keep_outcomes_exact_("").await;
}

/// The same with leases kept between queries: kept leases outlive the
/// restarts in their rows.
#[tokio::test(flavor = "multi_thread")]
async fn database_restarts_keep_outcomes_exact_with_kept_leases() {
    database_restarts_keep_outcomes_exact_("keep_lease_ms = 30000").await;
}

async fn database_restarts_keep_outcomes_exact_(extra: &str) {
    let cluster = Cluster::private().await;
    let url = cluster.database().await;
    let restarts = async {
        let mut restarted = 0;
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(2)).await;
            tokio::task::block_in_place(|| cluster.stop());
            tokio::time::sleep(Duration::from_millis(300)).await;
            cluster.start().await;
            restarted += 1;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        restarted
    };
    let (restarted, tally) = outcomes_stay_exact(&url, Duration::from_secs(9), extra, restarts).await;
    eprintln!("restarts: {restarted}, tally: {tally:?}");
    assert_eq!(restarted, 3);
    let unavailable = tally.get("unavailable").copied().unwrap_or(0);
    assert!(unavailable > 0, "no query met a restart: {tally:?}");
    assert!(tally["ok"] > 100, "too few queries succeeded: {tally:?}");
    // A lease a failed query could not give back while the database was
    // away is given back as soon as it is back, not left to expire: hardly
    // any of the session's next queries find it busy (here 0 or 1 against
    // about 100 told UNAVAILABLE; 103 to 161 when the lease was tried once
    // only, 3 to 24 when tried again only on a schedule).
    let busy = tally.get("busy").copied().unwrap_or(0);
    assert!(10 * busy <= unavailable, "leases left behind by the restarts refused follow-ups: {tally:?}");
}

/// The database stopped under queries holding their leases, and away for
/// longer than a lease lives: each query fails and says so once in the
/// log; asking the database again meanwhile (whether a commit landed,
/// giving a lease back) is not one warning per attempt, and the log says
/// once how each lease it could not give back ended.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_away_is_logged_once_per_failure_not_per_attempt() {
    a_database_away_is_logged_once_per_failure_not_per_attempt_("").await;
}

/// The same with leases kept between queries.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_away_is_logged_once_per_failure_not_per_attempt_with_kept_leases() {
    a_database_away_is_logged_once_per_failure_not_per_attempt_("keep_lease_ms = 30000").await;
}

async fn a_database_away_is_logged_once_per_failure_not_per_attempt_(extra: &str) {
    let cluster = Cluster::private().await;
    let url = cluster.database().await;
    let keys = format!("store_timeout_ms = 1000\nlease_ttl_ms = 2000\n{extra}");
    let lattice = Arc::new(Lattice::spawn(&config(1000, &keys), &[(URL_ENV, url.as_str())]).await);
    let mut sessions = Vec::new();
    for i in 0..4 {
        let out = lattice.query_with(query(&format!("start {i}"), None, Duration::from_secs(10))).await;
        out.expect_ok();
        sessions.push(out.session_id());
    }
    let before = lattice.process_logs().lines().count();
    // Each query takes its lease, then waits a second for the model: the
    // database stops meanwhile, before any of them commits.
    let mut running = Vec::new();
    for (i, sid) in sessions.iter().enumerate() {
        let (lattice, sid) = (lattice.clone(), sid.clone());
        running.push(tokio::spawn(async move {
            lattice.query_with(query(&format!("away {i}"), Some(&sid), Duration::from_secs(4))).await.code()
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    tokio::task::block_in_place(|| cluster.stop());
    for q in running {
        let code = q.await.unwrap();
        assert_ne!(code, Code::Ok);
    }
    // Away past the leases' time to live: nothing left to give back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.start().await;
    health_turns(&lattice, true, Duration::from_secs(10), "after the database came back").await;

    let logs = lattice.process_logs();
    let during: Vec<&str> = logs.lines().skip(before).collect();
    let warnings: Vec<&&str> = during.iter().filter(|l| l.contains(r#""level":"WARN""#)).collect();
    let about = |operation: &str| {
        let field = format!(r#""operation":"{operation}""#);
        warnings.iter().filter(|l| l.contains(&field)).count()
    };
    let (commit, read_back, release) = (about("commit"), about("read back"), about("release"));
    let ready = about("ready");
    eprintln!(
        "{} warnings: commit {commit}, read back {read_back}, release {release}, ready {ready}\n{}",
        warnings.len(),
        warnings.iter().map(|l| l.to_string()).collect::<Vec<_>>().join("\n")
    );
    assert!(commit >= 1, "no query's failure was logged");
    // One line for each query's first try at each, at most (and the
    // keeper's first, with kept leases).
    assert!(read_back <= sessions.len(), "{read_back} warnings reading commits back");
    assert!(release <= sessions.len() + 1, "{release} warnings giving leases back");
    // Health asks every second, the renewer every third of a lease; the
    // reason is said when it changes.
    assert!(ready <= 2, "{ready} warnings from the readiness probe");
    let renew = about("renew");
    assert!(renew <= 2, "{renew} warnings renewing leases");
    // Nor anything else on a timer (the leases' renewals, the keeper's
    // statements every 50 ms): each query's commit and release, and a few.
    let store_failed = warnings.iter().filter(|l| l.contains("session store failed")).count();
    assert!(store_failed <= 4 * sessions.len(), "{store_failed} warnings of the store's failures");
    // The database client's crates are silenced, whatever their targets.
    let client = during.iter().filter(|l| l.contains(r#""target":"deadpool"#) || l.contains("tokio_postgres"));
    assert_eq!(client.count(), 0, "the database client's own lines reached the log");
    let ended = during.iter().filter(|l| l.contains("a lease could not be given back")).count();
    assert_eq!(ended, sessions.len(), "how each lease ended is said once");
}

/// Connection resets under 8 concurrent sessions for 20 s: every outcome
/// exact (see [`resets_keep_outcomes_exact`]); a failed query gives its
/// lease back, so its session's next query is rarely refused as busy.
#[tokio::test(flavor = "multi_thread")]
async fn connection_resets_never_lose_or_duplicate_a_turn() {
    let (database, upstream) = database_and_upstream().await;
    let tally = resets_keep_outcomes_exact(upstream, &database, Duration::from_secs(20), "").await;
    let failed: usize =
        ["unavailable", "busy", "aborted", "deadline", "other"].iter().filter_map(|k| tally.get(k)).sum();
    assert!(tally.get("busy").copied().unwrap_or(0) <= failed / 2 + 5, "leftover leases refused follow-ups: {tally:?}");
}

/// The same with each statement on a pooled connection of its own
/// (`pipeline_connections = 0`), for 10 s.
#[tokio::test(flavor = "multi_thread")]
async fn connection_resets_keep_outcomes_exact_on_pooled_connections() {
    let (database, upstream) = database_and_upstream().await;
    resets_keep_outcomes_exact(upstream, &database, Duration::from_secs(10), "pipeline_connections = 0").await;
}

/// The same with leases kept between queries, for 10 s: the clients move
/// to the other replica with each query, which asks for the lease the
/// last one kept; each commit keeps it under a token of its own, so a
/// commit whose reply was lost is still read back exactly.
#[tokio::test(flavor = "multi_thread")]
async fn connection_resets_keep_outcomes_exact_with_kept_leases() {
    let (database, upstream) = database_and_upstream().await;
    resets_keep_outcomes_exact(upstream, &database, Duration::from_secs(10), "keep_lease_ms = 30000").await;
}

/// A database connection that goes silent while the database is fine (a
/// proxy whose upstream vanished keeps acknowledging, so the kernel never
/// gives up on it): the query whose statement waits on it ends by its
/// deadline, and that connection takes no new statement, so the queries
/// after it get a fresh connection and succeed.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_gone_silent_takes_no_new_statement() {
    silent_connection_costs_few_queries("").await;
}

/// The same with each statement on a pooled connection of its own
/// (`pipeline_connections = 0`): the pool gives up a connection whose
/// statement was cut off.
#[tokio::test(flavor = "multi_thread")]
async fn a_pooled_connection_gone_silent_takes_no_new_statement() {
    silent_connection_costs_few_queries("pipeline_connections = 0\n").await;
}

/// Freezes every open database connection of a Lattice (with `extra`
/// `[sessions]` keys) and runs queries one after another for 5 s: a few
/// fail in the first seconds, none after, and none that failed is stored.
async fn silent_connection_costs_few_queries(extra: &str) {
    let (proxy, lattice, sid) = one_session_behind_a_proxy(extra).await;
    for n in 0..3 {
        lattice.query_with(query(&format!("warm {n}"), Some(&sid), Duration::from_secs(5))).await.expect_ok();
    }
    assert!(proxy.freeze_live() > 0, "no database connection was open to freeze");
    // Queries one after another for 5 s, several times the store's
    // timeout: a statement that waited on the silent connection gives it
    // up at its deadline, so a connection kept would take statements again.
    let (start, mut failed, mut n) = (Instant::now(), Vec::new(), 0);
    while start.elapsed() < Duration::from_secs(5) {
        n += 1;
        let prompt = format!("after {n}");
        let out = lattice.query_with(query(&prompt, Some(&sid), Duration::from_millis(1500))).await;
        if out.code() != Code::Ok {
            failed.push((prompt, out.code(), start.elapsed()));
        }
    }
    // The silent connection costs the query waiting on it, and perhaps
    // one whose lease was given back on it; none after the first seconds.
    assert!(
        failed.len() <= 3 && failed.iter().all(|(_, _, at)| *at < Duration::from_secs(3)),
        "a silent connection kept taking statements ({n} queries): {failed:?}"
    );
    let stored = lattice.session(&sid).await.unwrap();
    let texts: Vec<String> = stored.messages.iter().map(message_text).collect();
    for (prompt, code, _) in &failed {
        assert!(!texts.contains(prompt), "{prompt}: told {code:?}, yet stored");
    }
}

/// The same for the pool's connections, which carry the readiness probe,
/// session reads and deletes: a probe cut off by the store's timeout on a
/// silent connection gives that connection up, so health turns SERVING
/// again within a few probes and reads succeed, while the frozen
/// connections stay open behind the proxy.
#[tokio::test(flavor = "multi_thread")]
async fn a_pooled_connection_gone_silent_is_given_up() {
    let (proxy, lattice, sid) = one_session_behind_a_proxy("").await;
    // A read and a few probes: the pool has connections, all idle.
    lattice.session(&sid).await.unwrap();
    health_turns(&lattice, true, Duration::from_secs(5), "before the freeze").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    assert!(proxy.freeze_live() > 0, "no database connection was open to freeze");
    health_turns(&lattice, false, Duration::from_secs(5), "after its connections went silent").await;
    // The database is fine, new connections reach it: health comes back
    // once the probes stop waiting on the silent ones.
    health_turns(&lattice, true, Duration::from_secs(8), "after NOT_SERVING, with the database answering").await;
    let stored = lattice.session(&sid).await.expect("a read after health came back");
    assert_eq!(stored.messages.iter().map(message_text).next().as_deref(), Some("start"));
}

/// The same through PgBouncer in transaction pooling mode (Debian's
/// 1.18, which carries no prepared statement between transactions), with
/// `prepared_statements = false`: it works, and outcomes stay exact.
#[tokio::test(flavor = "multi_thread")]
async fn behind_pgbouncer_in_transaction_mode_outcomes_stay_exact() {
    behind_pgbouncer_in_transaction_mode("prepared_statements = false").await;
}

/// The same with leases kept between queries: the handover goes through
/// the session row, which PgBouncer's transaction pooling carries.
#[tokio::test(flavor = "multi_thread")]
async fn behind_pgbouncer_kept_leases_keep_outcomes_exact() {
    behind_pgbouncer_in_transaction_mode("prepared_statements = false\nkeep_lease_ms = 30000").await;
}

async fn behind_pgbouncer_in_transaction_mode(extra: &str) {
    let cluster = Cluster::shared().await;
    let url = cluster.database().await;
    let database = url.rsplit('/').next().unwrap().to_owned();
    let bouncer = PgBouncer::transaction_pooling(cluster).await;
    let upstream = bouncer.url.rsplit('@').next().unwrap().parse().unwrap();
    resets_keep_outcomes_exact(upstream, &database, Duration::from_secs(10), extra).await;
}

/// A pooler in transaction mode is found at start-up whichever idle server
/// connection it hands out first, the most recently freed (PgBouncer's
/// default) or each in turn (`server_round_robin = 1`), and whatever its
/// pool's size and how many of them are idle. With prepared statements
/// off, as here, nothing else would show it, and statements pipelined
/// through it can be answered with another's reply.
#[tokio::test(flavor = "multi_thread")]
async fn a_pooler_is_found_however_it_hands_out_connections() {
    let cluster = Cluster::shared().await;
    let url = cluster.database().await;
    let database = url.rsplit('/').next().unwrap().to_owned();
    for (pool_size, round_robin) in [1, 2, 3, 20].into_iter().flat_map(|n| [(n, false), (n, true)]) {
        let bouncer = PgBouncer::transaction_pooling_with(cluster, pool_size, round_robin).await;
        let through = format!("{}/{database}", bouncer.url);
        // Server connections idle in the pool, as under other clients:
        // transactions open at once on connections of the test's own.
        let mut warm = Vec::new();
        for _ in 0..pool_size.min(4) {
            let client = connect(&through).await;
            client.batch_execute("BEGIN; SELECT 1").await.unwrap();
            warm.push(client);
        }
        for client in &warm {
            client.batch_execute("COMMIT").await.unwrap();
        }
        let lattice = Lattice::spawn(&config(0, "prepared_statements = false"), &[(URL_ENV, through.as_str())]).await;
        lattice.query("a", "hi").await.expect_ok();
        let logs = lattice.process_logs();
        assert!(logs.contains(POOLER_FOUND), "a pool of {pool_size} (in turn: {round_robin}) not found:\n{logs}");
    }
}

/// `migrate = "never"`: a binary refuses an empty database and says to run
/// `lattice migrate`, which applies the schema alone; a binary older than
/// the database's schema refuses to start and says so.
#[tokio::test(flavor = "multi_thread")]
async fn the_schema_is_migrated_by_command_and_a_newer_one_is_refused() {
    let cluster = Cluster::shared().await;
    let url = cluster.database().await;
    let never = config(0, "migrate = \"never\"\non_unreachable = \"exit\"");
    let (ok, said) = serve_until_exit(&never, &url).await;
    assert!(!ok && said.contains("lattice migrate"), "{said}");

    let dir = temp_dir("pgmigrate");
    let path = dir.join("lattice.toml");
    std::fs::write(&path, lattice_tests::with_open_auth(&never)).unwrap();
    let migrate = |path: std::path::PathBuf, url: String| async move {
        tokio::process::Command::new(workspace_binary("lattice"))
            .args(["migrate", "--config"])
            .arg(path)
            .env(URL_ENV, url)
            .output()
            .await
            .unwrap()
    };
    let out = migrate(path.clone(), url.clone()).await;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("applied 1, 2, 3, 4"),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let again = migrate(path, url.clone()).await;
    assert!(String::from_utf8_lossy(&again.stdout).contains("up to date"));

    let lattice = Lattice::spawn(&never, &[(URL_ENV, url.as_str())]).await;
    assert_eq!(lattice.query("a", "hi").await.expect_ok().text, "seen 1");
    drop(lattice);

    // A newer Lattice migrated it further.
    let client = connect(&url).await;
    client.batch_execute("INSERT INTO lattice_migrations (version) VALUES (99)").await.unwrap();
    for keys in ["on_unreachable = \"exit\"", "migrate = \"never\"\non_unreachable = \"exit\""] {
        let (ok, said) = serve_until_exit(&config(0, keys), &url).await;
        assert!(!ok && said.contains("schema is version 99, newer than this build"), "{keys}: {said}");
    }
}

/// Behind PgBouncer in transaction mode with the default settings (which
/// prepare and pipeline statements): the store finds the pooler at
/// start-up and sends statements unnamed, one at a time on each
/// connection; it says so once in the log, and every query succeeds and is
/// stored once. A plain TCP proxy is not taken for a pooler.
#[tokio::test(flavor = "multi_thread")]
async fn behind_pgbouncer_in_transaction_mode_the_default_settings_work() {
    let cluster = Cluster::shared().await;
    let url = cluster.database().await;
    let database = url.rsplit('/').next().unwrap().to_owned();
    let bouncer = PgBouncer::transaction_pooling(cluster).await;
    let through = format!("{}/{database}", bouncer.url);
    let lattice = Arc::new(Lattice::spawn(&config(0, ""), &[(URL_ENV, through.as_str())]).await);
    let mut clients = Vec::new();
    for c in 0..8 {
        let lattice = lattice.clone();
        clients.push(tokio::spawn(async move {
            let first = lattice.query_with(query(&format!("{c} 0"), None, Duration::from_secs(10))).await;
            assert_eq!(first.expect_ok().text, "seen 1");
            let sid = first.session_id();
            for i in 1..20 {
                let out = lattice.query_with(query(&format!("{c} {i}"), Some(&sid), Duration::from_secs(10))).await;
                assert_eq!(out.expect_ok().text, format!("seen {}", 2 * i + 1));
            }
            sid
        }));
    }
    for client in clients {
        let sid = client.await.unwrap();
        assert_eq!(lattice.session(&sid).await.unwrap().messages.len(), 40);
    }
    let logs = lattice.process_logs();
    let said = logs.matches("statements are sent unnamed, one at a time on each connection, from now on").count();
    assert_eq!(said, 1, "the switch should be logged once:\n{logs}");

    // Configured for it, the pooler is found and said all the same; a
    // plain TCP proxy in front of the database is no pooler.
    let configured = config(0, "prepared_statements = false");
    let unnamed = Lattice::spawn(&configured, &[(URL_ENV, through.as_str())]).await;
    unnamed.query("a", "hi").await.expect_ok();
    assert!(unnamed.process_logs().contains(POOLER_FOUND), "no word of the pooler:\n{}", unnamed.process_logs());
    let proxy = ResetProxy::start(format!("127.0.0.1:{}", cluster.port()).parse().unwrap()).await;
    let proxied = format!("postgres://postgres@{}/{database}", proxy.addr);
    let direct = Lattice::spawn(&config(0, ""), &[(URL_ENV, proxied.as_str())]).await;
    direct.query("a", "hi").await.expect_ok();
    assert!(!direct.process_logs().contains("reached through a pooler"), "a TCP proxy taken for a pooler");
}
