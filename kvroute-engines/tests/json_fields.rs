//! `parse_json_fields` (the skimming reader hosts use for a request's
//! `model` and `stream` without building its prompt) against `parse_json`,
//! the full Python-compatible reader, as the oracle: on generated bodies —
//! objects with the kept keys anywhere, repeated, nested, next to large
//! arrays and strings, and the same with one byte cut or changed — both give
//! the same kept fields, or the same error at the same offset.

use kvroute_engines::prompt::fuzzing::{fields_of, openai_request};
use kvroute_engines::prompt::{parse_json, parse_json_fields};
use proptest::prelude::*;

fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just("NaN".to_owned()),
        Just("-Infinity".to_owned()),
        (-1000i64..1000).prop_map(|i| i.to_string()),
        Just("1e400".to_owned()),
        Just("123456789012345678901234567890".to_owned()),
        "[a-z\\\\\"\\u{e9} ]{0,8}".prop_map(|s| format!("{s:?}")),
        Just(r#""\ud83d\ude00""#.to_owned()),
    ]
}

fn value() -> impl Strategy<Value = String> {
    scalar().prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec((key(), inner), 0..6).prop_map(|kv| {
                let members: Vec<String> = kv.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
                format!("{{{}}}", members.join(", "))
            }),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model".to_owned()),
        Just("stream".to_owned()),
        Just("prompt".to_owned()),
        "[a-z]{1,4}",
    ]
}

fn body() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::collection::vec((key(), value()), 0..8).prop_map(|kv| {
            let members: Vec<String> = kv.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
            format!(" {{{}}} ", members.join(", "))
        }),
        1 => value(),
    ]
}

fn same(bytes: &[u8]) {
    assert_eq!(
        format!("{:?}", parse_json_fields(bytes, &["model", "stream"])),
        format!("{:?}", fields_of(&parse_json(bytes))),
        "{}",
        String::from_utf8_lossy(bytes)
    );
    // The fuzz target checks the same and must not panic.
    let _ = openai_request(bytes);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_kept_fields_are_the_full_readers(b in body(), cut in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let bytes = b.into_bytes();
        same(&bytes);
        let at = cut.index(bytes.len().max(1));
        same(&bytes[..at.min(bytes.len())]);
        let mut changed = bytes.clone();
        if let Some(x) = changed.get_mut(at) {
            *x = byte;
        }
        same(&changed);
    }
}

#[test]
fn golden_cases() {
    for body in [
        &br#"{"model": "a", "prompt": [1, 2, 3], "model": "b", "stream": true}"#[..],
        br#"{"stream": NaN}"#,
        br#"[0, 0, 0]"#,
        b"\xEF\xBB\xBF{\"model\": \"m\"}",
        br#"{"model": "m"} x"#,
        br#"{"prompt": "\ud800", "model": "m"}"#,
        br#"{"a": {"model": "inner"}}"#,
        b"",
        b"{",
    ] {
        same(body);
    }
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    same(deep.as_bytes());
}
