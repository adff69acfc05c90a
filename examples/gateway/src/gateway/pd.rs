//! vLLM's disaggregated two-step, as its reference proxy does it: the prefill
//! endpoint gets the request with `kv_transfer_params.do_remote_decode = true`,
//! `max_tokens = 1` (`min_tokens` 0), no streaming and no echo or log-probabilities (its answer
//! is read for the transfer only); the decode endpoint then gets the original
//! request carrying the `kv_transfer_params` the prefill answered with.

use bytes::Bytes;
use serde_json::{json, Map, Value};

/// The request as a JSON object, parsed once for both legs (`None` when it is
/// not one: then there is no two-step).
#[must_use]
pub fn parse(original: &[u8]) -> Option<Map<String, Value>> {
    serde_json::from_slice(original).ok()
}

/// The prefill leg's body.
#[must_use]
pub fn prefill_body_of(mut v: Map<String, Value>) -> Option<Bytes> {
    v.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    v.insert("max_tokens".into(), json!(1));
    if v.contains_key("max_completion_tokens") {
        v.insert("max_completion_tokens".into(), json!(1));
    }
    v.insert("stream".into(), json!(false));
    v.remove("stream_options");
    // The prefill answer is read for its transfer parameters and usage
    // only, then dropped: asked to echo the prompt or score it, an engine
    // would answer megabytes of prompt log-probabilities for nothing (and
    // past the answer's read bound). The decode leg keeps them.
    for k in ["echo", "logprobs", "top_logprobs", "prompt_logprobs"] {
        v.remove(k);
    }
    // vLLM refuses `min_tokens` above `max_tokens`: the leg's one token.
    if v.contains_key("min_tokens") {
        v.insert("min_tokens".into(), json!(0));
    }
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

/// The prefill answer's `kv_transfer_params`, if any.
#[must_use]
pub fn transfer_params(prefill_response: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(prefill_response).ok()?;
    v.get("kv_transfer_params")
        .filter(|p| !p.is_null())
        .cloned()
}

/// The decode leg's body: the original request with the prefill's parameters.
#[must_use]
pub fn decode_body_of(mut v: Map<String, Value>, params: &Value) -> Option<Bytes> {
    v.insert("kv_transfer_params".into(), params.clone());
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_asks_for_one_token_without_streaming_and_decode_carries_the_answer() {
        let original = br#"{"model":"m","prompt":"hi","max_tokens":50,"stream":true,"stream_options":{"include_usage":true}}"#;
        let object = parse(original).unwrap();
        let p: Value = serde_json::from_slice(&prefill_body_of(object.clone()).unwrap()).unwrap();
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        let answer = br#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_port":9}}"#;
        let params = transfer_params(answer);
        let d: Value =
            serde_json::from_slice(&decode_body_of(object, params.as_ref().unwrap()).unwrap())
                .unwrap();
        assert_eq!(d["max_tokens"], 50);
        assert_eq!(d["stream"], true);
        assert_eq!(d["kv_transfer_params"]["remote_port"], 9);
        // Echo and log-probabilities: the decode leg's, never the prefill's.
        let scored = br#"{"model":"m","prompt":"hi","max_tokens":9,"min_tokens":9,"echo":true,"logprobs":1,"top_logprobs":2,"prompt_logprobs":1}"#;
        let object = parse(scored).unwrap();
        let p: Value = serde_json::from_slice(&prefill_body_of(object.clone()).unwrap()).unwrap();
        for k in ["echo", "logprobs", "top_logprobs", "prompt_logprobs"] {
            assert!(p.get(k).is_none(), "{k} in the prefill leg: {p}");
        }
        // A valid minimum for the leg's one token; the decode leg keeps the client's.
        assert_eq!(p["min_tokens"], 0);
        let d: Value =
            serde_json::from_slice(&decode_body_of(object, &json!({})).unwrap()).unwrap();
        assert_eq!(
            (d["echo"].clone(), d["prompt_logprobs"].clone()),
            (json!(true), json!(1))
        );
        assert_eq!(d["min_tokens"], 9);
        assert!(parse(b"not json").is_none());
        assert!(parse(b"[1]").is_none(), "not an object: no two-step");
    }
}
