//! vLLM's disaggregated two-step, as its reference proxy does it: the prefill
//! endpoint gets the request with `kv_transfer_params.do_remote_decode = true`,
//! `max_tokens = 1` (`min_tokens` 0), no streaming and no echo or log-probabilities (its answer
//! is read for the transfer only); the decode endpoint then gets the original
//! request carrying the `kv_transfer_params` the prefill answered with.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

use bytes::Bytes;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::{to_raw_value, RawValue};
use serde_json::{json, Value};

/// Top-level fields a request may have to be split into the two legs. An
/// OpenAI request has a few dozen; a body of many small members would
/// otherwise cost a field entry each, several times the body's own size.
/// Beyond it the body is not split (the decode endpoint serves it whole).
pub const MAX_FIELDS: usize = 1024;

/// A field's name: where it is in the body, or, for one written with
/// escapes, its decoded text.
#[derive(Debug)]
enum Key {
    At(Range<usize>),
    Owned(Box<str>),
}

/// The request's top-level fields, in order, each value kept as where its
/// JSON text is in the body: the legs' bodies are the client's bytes with a
/// few fields set or left out, so nothing below the top level is parsed
/// into a tree (a 4 MiB list of token ids would take several times its
/// size as one, per leg), nothing is copied (a field costs two ranges,
/// at most [`MAX_FIELDS`] of them), and every other value reaches the
/// engines byte for byte (numbers beyond `f64` included). A key given twice
/// keeps its first place and its last value, as a JSON object read by the
/// engines does.
#[derive(Debug)]
pub struct Fields {
    body: Bytes,
    fields: Vec<(Key, Range<usize>)>,
}

/// A key as read: borrowed from the body when written without escapes.
struct KeyText<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for KeyText<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> Visitor<'de> for Text {
            type Value = KeyText<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<KeyText<'de>, E> {
                Ok(KeyText(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<KeyText<'de>, E> {
                Ok(KeyText(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(Text)
    }
}

/// The fields as read from the body, borrowing it.
struct Borrowed<'de>(Vec<(KeyText<'de>, &'de RawValue)>);

impl<'de> Deserialize<'de> for Borrowed<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Object;
        impl<'de> Visitor<'de> for Object {
            type Value = Borrowed<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Borrowed<'de>, A::Error> {
                let mut fields: Vec<(KeyText<'de>, &'de RawValue)> = Vec::new();
                let mut at: HashMap<Cow<'de, str>, usize> = HashMap::new();
                while let Some((k, v)) = m.next_entry::<KeyText<'de>, &'de RawValue>()? {
                    match at.get(&k.0).and_then(|&i| fields.get_mut(i)) {
                        Some(slot) => slot.1 = v,
                        None => {
                            if fields.len() >= MAX_FIELDS {
                                return Err(serde::de::Error::custom("too many fields"));
                            }
                            at.insert(k.0.clone(), fields.len());
                            fields.push((k, v));
                        }
                    }
                }
                Ok(Borrowed(fields))
            }
        }
        d.deserialize_map(Object)
    }
}

/// Where `part` (a slice of `whole`) starts and ends in `whole`.
fn range_in(whole: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len()).then_some(start..end)
}

impl Fields {
    fn key<'a>(&'a self, k: &'a Key) -> Option<&'a str> {
        match k {
            Key::At(r) => std::str::from_utf8(self.body.get(r.clone())?).ok(),
            Key::Owned(s) => Some(s),
        }
    }

    fn has(&self, key: &str) -> bool {
        self.fields.iter().any(|(k, _)| self.key(k) == Some(key))
    }

    /// The object with `set` fields replaced (in place) or added (at the
    /// end) and `drop` fields left out.
    fn write(&self, set: &[(&str, Box<RawValue>)], drop: &[&str]) -> Option<Bytes> {
        let extra: usize = set.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum();
        let mut out = Vec::with_capacity(self.body.len() + extra + 2);
        out.push(b'{');
        let field = |out: &mut Vec<u8>, k: &str, v: &[u8]| -> Option<()> {
            if out.len() > 1 {
                out.push(b',');
            }
            serde_json::to_writer(&mut *out, k).ok()?;
            out.push(b':');
            out.extend_from_slice(v);
            Some(())
        };
        for (k, v) in &self.fields {
            let k = self.key(k)?;
            if drop.contains(&k) {
                continue;
            }
            let v = match set.iter().find(|(s, _)| *s == k) {
                Some((_, s)) => s.get().as_bytes(),
                None => self.body.get(v.clone())?,
            };
            field(&mut out, k, v)?;
        }
        for (k, v) in set {
            if !self.has(k) {
                field(&mut out, k, v.get().as_bytes())?;
            }
        }
        out.push(b'}');
        Some(Bytes::from(out))
    }
}

/// The request as a JSON object, parsed once for both legs (`None` when it is
/// not one, or has more than [`MAX_FIELDS`] fields: then there is no
/// two-step).
#[must_use]
pub fn parse(original: &Bytes) -> Option<Fields> {
    let whole: &[u8] = original;
    let borrowed: Borrowed<'_> = serde_json::from_slice(whole).ok()?;
    let mut fields = Vec::with_capacity(borrowed.0.len());
    for (k, v) in borrowed.0 {
        let key = match k.0 {
            Cow::Borrowed(b) => Key::At(range_in(whole, b.as_bytes())?),
            Cow::Owned(o) => Key::Owned(o.into_boxed_str()),
        };
        fields.push((key, range_in(whole, v.get().as_bytes())?));
    }
    Some(Fields {
        body: original.clone(),
        fields,
    })
}

/// The prefill leg's body.
#[must_use]
pub fn prefill_body_of(v: &Fields) -> Option<Bytes> {
    let raw = |x: Value| to_raw_value(&x).ok();
    let mut set = vec![
        (
            "kv_transfer_params",
            raw(json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            }))?,
        ),
        ("max_tokens", raw(json!(1))?),
        ("stream", raw(json!(false))?),
    ];
    if v.has("max_completion_tokens") {
        set.push(("max_completion_tokens", raw(json!(1))?));
    }
    // vLLM refuses `min_tokens` above `max_tokens`: the leg's one token.
    if v.has("min_tokens") {
        set.push(("min_tokens", raw(json!(0))?));
    }
    // The prefill answer is read for its transfer parameters and usage
    // only, then dropped: asked to echo the prompt or score it, an engine
    // would answer megabytes of prompt log-probabilities for nothing (and
    // past the answer's read bound). The decode leg keeps them.
    let drop = [
        "stream_options",
        "echo",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
    ];
    v.write(&set, &drop)
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
pub fn decode_body_of(v: &Fields, params: &Value) -> Option<Bytes> {
    v.write(&[("kv_transfer_params", to_raw_value(params).ok()?)], &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_asks_for_one_token_without_streaming_and_decode_carries_the_answer() {
        let original = br#"{"model":"m","prompt":"hi","max_tokens":50,"stream":true,"stream_options":{"include_usage":true}}"#;
        let object = parse(&Bytes::from_static(original)).unwrap();
        let p: Value = serde_json::from_slice(&prefill_body_of(&object).unwrap()).unwrap();
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        let answer = br#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_port":9}}"#;
        let params = transfer_params(answer);
        let d: Value =
            serde_json::from_slice(&decode_body_of(&object, params.as_ref().unwrap()).unwrap())
                .unwrap();
        assert_eq!(d["max_tokens"], 50);
        assert_eq!(d["stream"], true);
        assert_eq!(d["kv_transfer_params"]["remote_port"], 9);
        // Echo and log-probabilities: the decode leg's, never the prefill's.
        let scored = br#"{"model":"m","prompt":"hi","max_tokens":9,"min_tokens":9,"echo":true,"logprobs":1,"top_logprobs":2,"prompt_logprobs":1}"#;
        let object = parse(&Bytes::from_static(scored)).unwrap();
        let p: Value = serde_json::from_slice(&prefill_body_of(&object).unwrap()).unwrap();
        for k in ["echo", "logprobs", "top_logprobs", "prompt_logprobs"] {
            assert!(p.get(k).is_none(), "{k} in the prefill leg: {p}");
        }
        // A valid minimum for the leg's one token; the decode leg keeps the client's.
        assert_eq!(p["min_tokens"], 0);
        let d: Value =
            serde_json::from_slice(&decode_body_of(&object, &json!({})).unwrap()).unwrap();
        assert_eq!(
            (d["echo"].clone(), d["prompt_logprobs"].clone()),
            (json!(true), json!(1))
        );
        assert_eq!(d["min_tokens"], 9);
        assert!(parse(&Bytes::from_static(b"not json")).is_none());
        assert!(
            parse(&Bytes::from_static(b"{\"a\":1}x")).is_none(),
            "trailing bytes"
        );
        assert!(
            parse(&Bytes::from_static(b"[1]")).is_none(),
            "not an object: no two-step"
        );
    }

    /// Every value the legs do not change reaches the engines as the client
    /// wrote it: numbers beyond `f64`, their spelling, nested objects; a key
    /// given twice keeps its first place and its last value.
    #[test]
    fn untouched_values_pass_byte_for_byte() {
        let original = br#"{"model":"m","seed":18446744073709551616123,"temperature":0.10000000000000001,"prompt":[1,2,3],"extra":{"b":1.50,"a":[]},"seed":7,"max_tokens":5}"#;
        let object = parse(&Bytes::from_static(original)).unwrap();
        let d = decode_body_of(&object, &json!({"p": 1})).unwrap();
        assert_eq!(
            std::str::from_utf8(&d).unwrap(),
            r#"{"model":"m","seed":7,"temperature":0.10000000000000001,"prompt":[1,2,3],"extra":{"b":1.50,"a":[]},"max_tokens":5,"kv_transfer_params":{"p":1}}"#
        );
        let p = prefill_body_of(&object).unwrap();
        assert_eq!(
            std::str::from_utf8(&p).unwrap(),
            r#"{"model":"m","seed":7,"temperature":0.10000000000000001,"prompt":[1,2,3],"extra":{"b":1.50,"a":[]},"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null},"stream":false}"#
        );
        // Nested past serde_json's depth limit for trees: kept as text.
        let deep = format!(r#"{{"x":{}1{}}}"#, "[".repeat(200), "]".repeat(200));
        let out = decode_body_of(&parse(&Bytes::from(deep.clone())).unwrap(), &json!(1)).unwrap();
        assert!(out.starts_with(deep.trim_end_matches('}').as_bytes()));
        let escaped = parse(&Bytes::from_static(br#"{"a\"b":"\u00e9"}"#)).unwrap();
        let out = decode_body_of(&escaped, &json!(null)).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["a\"b"], "\u{e9}");
    }

    /// A body of more top-level fields than any request has (each would
    /// cost an entry) is not split; repeating one key does not count.
    #[test]
    fn bodies_of_too_many_fields_are_not_split() {
        let body = |n: usize, key: &dyn Fn(usize) -> String| {
            let fields: Vec<String> = (0..n).map(|i| format!(r#""{}":{i}"#, key(i))).collect();
            Bytes::from(format!("{{{}}}", fields.join(",")))
        };
        let distinct = |i: usize| format!("k{i}");
        assert!(parse(&body(MAX_FIELDS, &distinct)).is_some());
        assert!(parse(&body(MAX_FIELDS + 1, &distinct)).is_none());
        let repeated = parse(&body(10 * MAX_FIELDS, &|_| "k".to_owned())).unwrap();
        let d = decode_body_of(&repeated, &json!(1)).unwrap();
        assert_eq!(
            std::str::from_utf8(&d).unwrap(),
            format!(r#"{{"k":{},"kv_transfer_params":1}}"#, 10 * MAX_FIELDS - 1)
        );
    }
}
