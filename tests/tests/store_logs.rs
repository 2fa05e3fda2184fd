//! What Lattice's log may hold with sessions in PostgreSQL: the database
//! client logs each statement with its parameters (a prompt, a tool
//! result, as stored: before any hook) at debug and trace, so its crates are
//! capped like the transport crates, whatever `RUST_LOG` says.

use lattice_tests::{
    Lattice, canary, cfg,
    hook::{Behaviour, HookServer, OnRequest, OnResult},
    postgres::Cluster,
    tool::{ToolDef, ToolServer},
};

const URL_ENV: &str = "LATTICE_POSTGRES_URL";

/// Two queries of one session (a create, then a continue: every kind of
/// statement the store runs), at debug and at trace, with hooks that redact
/// the prompt (for the model) and the tool's result: neither value as it
/// was before its hook is in the log, which still says the queries ran (and,
/// at trace, holds the requests as sent, redacted).
#[tokio::test(flavor = "multi_thread")]
async fn no_log_level_writes_a_stored_conversation() {
    for level in ["debug", "trace", "info,tokio_postgres=trace,postgres_protocol=trace,deadpool=trace"] {
        let (prompt, result) = (canary(), canary());
        let tools = ToolServer::start(vec![ToolDef::new("t", &format!("result {result}"))]).await;
        let redact_result = HookServer::start(Behaviour {
            on_result: OnResult::ReplaceText("result [REDACTED]".into()),
            ..Default::default()
        })
        .await;
        let redact_prompt = HookServer::start(Behaviour {
            on_request: OnRequest::ReplaceInTexts(prompt.clone(), "[REDACTED]".into()),
            ..Default::default()
        })
        .await;
        let config = format!("[sessions]\nstore = \"postgres\"\nurl_env = \"{URL_ENV}\"\n")
            + &cfg::agent("a", "")
            + &cfg::turn("go", &["t"])
            + &cfg::turn("done", &[])
            + &cfg::tools(&tools.url, 2000)
            + &cfg::hook("redact-result", &redact_result.url, &["tool_result"], 2000)
            + &cfg::hook("redact-prompt", &redact_prompt.url, &["model_request"], 2000);
        let url = Cluster::shared().await.database().await;
        let lattice = Lattice::spawn(&config, &[(URL_ENV, url.as_str()), ("RUST_LOG", level)]).await;
        let first = lattice.query("a", &format!("prompt {prompt}")).await;
        first.expect_ok();
        let session = first.session_id();
        let second = lattice
            .query_with(lattice_tests::QueryOpts {
                agent: "a".into(),
                prompt: format!("again {prompt}"),
                session: Some(session),
                ..Default::default()
            })
            .await;
        second.expect_ok();
        let log = lattice.process_logs();
        assert!(log.contains("query succeeded"), "RUST_LOG={level}: the log should hold the queries:\n{log}");
        assert!(!log.contains(&prompt), "RUST_LOG={level}: the prompt reached the log");
        assert!(!log.contains(&result), "RUST_LOG={level}: the tool's result reached the log");
        if level == "trace" {
            assert!(log.contains("[REDACTED]"), "RUST_LOG=trace: the requests as sent are in the log");
        }
    }
}
