//! `lattice trace`: a trace file with every model request whole.

/// Copies a trace file's lines from `file` to `out` with every model
/// request whole: a line that continues the previous request gets its
/// `messages` (the first `messages_kept` of that request's, then its
/// `messages_added`) and, where it leaves them out, that request's `system`
/// and `tools`. The error names the line that is not JSON, or that
/// continues more than the file holds.
pub fn expand(file: impl std::io::BufRead, mut out: impl std::io::Write) -> Result<(), String> {
    // The file's previous request, whole.
    let mut previous = serde_json::Map::new();
    for (n, line) in file.lines().enumerate() {
        let line = line.map_err(|e| e.to_string())?;
        let at = n + 1;
        let mut event: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("line {at} is not JSON: {e}"))?;
        let is_request = event["type"] == "model_request";
        if let Some(request) =
            event.get_mut("request").filter(|_| is_request).and_then(serde_json::Value::as_object_mut)
        {
            let kept = request.remove("messages_kept").map(|k| k.as_u64().unwrap_or(u64::MAX));
            let added = request.remove("messages_added");
            match (kept, added) {
                (Some(kept), Some(serde_json::Value::Array(added))) => {
                    let before = previous.get("messages").and_then(serde_json::Value::as_array).map_or(&[][..], |m| m);
                    let head = usize::try_from(kept).ok().and_then(|k| before.get(..k)).ok_or_else(|| {
                        format!(
                            "line {at} continues {kept} messages of a request; the file holds {} before it",
                            before.len()
                        )
                    })?;
                    let messages: Vec<serde_json::Value> = head.iter().cloned().chain(added).collect();
                    request.insert("messages".into(), serde_json::Value::Array(messages));
                    for key in ["system", "tools"] {
                        if !request.contains_key(key) {
                            request.insert(key.into(), previous.get(key).cloned().unwrap_or_default());
                        }
                    }
                }
                (None, None) => {}
                _ => return Err(format!("line {at}: a request with messages_kept needs messages_added")),
            }
        }
        serde_json::to_writer(&mut out, &event).map_err(|e| e.to_string())?;
        out.write_all(b"\n").map_err(|e| e.to_string())?;
        if is_request
            && let Some(serde_json::Value::Object(request)) = event.get_mut("request").map(serde_json::Value::take)
        {
            previous = request;
        }
    }
    Ok(())
}
