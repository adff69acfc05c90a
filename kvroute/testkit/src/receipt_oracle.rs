//! The serde_json `include_usage` that `kvroute::receipt::include_usage`
//! replaced (parse to a `Value`, edit, serialise): the oracle its property
//! test compares against, and the "before" of `benches/receipt.rs`.

/// `stream_options.include_usage = true` added to a streamed body, by a
/// whole `serde_json::Value` round trip.
pub fn include_usage_by_value(body: &[u8]) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let obj = v.as_object_mut()?;
    if obj.get("stream").and_then(serde_json::Value::as_bool) != Some(true) {
        return None;
    }
    match obj.get_mut("stream_options") {
        None | Some(serde_json::Value::Null) => {
            let mut opts = serde_json::Map::new();
            opts.insert("include_usage".into(), serde_json::Value::Bool(true));
            obj.insert("stream_options".into(), serde_json::Value::Object(opts));
        }
        Some(serde_json::Value::Object(opts)) => {
            if opts.contains_key("include_usage") {
                return None;
            }
            opts.insert("include_usage".into(), serde_json::Value::Bool(true));
        }
        Some(_) => return None,
    }
    serde_json::to_vec(&v).ok()
}
