//! `receipt::include_usage` splices the option into the client's bytes; the
//! serde_json round trip it replaced is the oracle: on every body both say
//! whether to rewrite, and the spliced body parses to the oracle's document
//! (key order included) while keeping every byte the client sent.

use kvroute_testkit::receipt_oracle;

use kvroute::receipt::include_usage;
use proptest::prelude::*;
use receipt_oracle::include_usage_by_value;

/// Compares the splice with the oracle on `body`; `Err` names the mismatch.
fn agree(body: &[u8]) -> Result<(), String> {
    let show = || String::from_utf8_lossy(body).into_owned();
    let (spliced, oracle) = (include_usage(body), include_usage_by_value(body));
    match (&spliced, &oracle) {
        (None, None) => Ok(()),
        (Some(s), Some(o)) => {
            let reparsed: serde_json::Value = serde_json::from_slice(s)
                .map_err(|e| format!("{e}: {} from {}", String::from_utf8_lossy(s), show()))?;
            let reserialised = serde_json::to_vec(&reparsed).map_err(|e| e.to_string())?;
            if &reserialised != o {
                return Err(format!(
                    "spliced {} ≠ oracle {} for {}",
                    String::from_utf8_lossy(s),
                    String::from_utf8_lossy(o),
                    show()
                ));
            }
            kept(body, s)
                .map_err(|e| format!("{e}: {} from {}", String::from_utf8_lossy(s), show()))
        }
        _ => Err(format!(
            "splice {:?} vs oracle {:?} for {}",
            spliced
                .as_ref()
                .map(|s| String::from_utf8_lossy(s).into_owned()),
            oracle
                .as_ref()
                .map(|s| String::from_utf8_lossy(s).into_owned()),
            show()
        )),
    }
}

/// `out` is `body` with one insertion, or with one `null` replaced.
fn kept(body: &[u8], out: &[u8]) -> Result<(), String> {
    let limit = body.len().min(out.len());
    let prefix = body.iter().zip(out).take_while(|(a, b)| a == b).count();
    let suffix = body
        .iter()
        .rev()
        .zip(out.iter().rev())
        .take(limit - prefix)
        .take_while(|(a, b)| a == b)
        .count();
    let removed = &body[prefix..body.len() - suffix];
    if removed.is_empty() || removed == b"null" {
        Ok(())
    } else {
        Err(format!(
            "client bytes {:?} lost",
            String::from_utf8_lossy(removed)
        ))
    }
}

fn ws() -> impl Strategy<Value = &'static str> {
    prop_oneof![4 => Just(""), 2 => Just(" "), 1 => Just("\n  "), 1 => Just("\t"), 1 => Just("\r\n")]
}

/// A JSON string literal as a client might spell it: plain, escaped, with
/// JSON-looking text inside, and (rarely) a lone surrogate that a strict
/// parser refuses.
fn string() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z_ ]{0,8}".prop_map(|s| format!("\"{s}\"")),
        Just(r#""stream""#.to_owned()),
        Just(r#""stream_options""#.to_owned()),
        Just(r#""include_usage""#.to_owned()),
        Just(r#""str\u0065am""#.to_owned()),
        Just(r#""stream\u005foptions""#.to_owned()),
        Just(r#""include\u005Fusage""#.to_owned()),
        Just(r#""\"stream\":true,\"stream_options\":{}}""#.to_owned()),
        Just(r#""a\\\"b\n\t\/\u00e9\ud83d\ude00 }""#.to_owned()),
        Just(r#""größe 東京 🙂""#.to_owned()),
        Just(r#""\ud800""#.to_owned()),
    ]
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i32>().prop_map(|n| n.to_string()),
        Just("-0".to_owned()),
        Just("1.5E+3".to_owned()),
        Just("0.000001".to_owned()),
        Just("18446744073709551616".to_owned()),
        Just("1e400".to_owned()),
    ]
}

fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just("null".to_owned()),
        number(),
        string(),
    ]
}

/// An object or array of `inner`, with whitespace anywhere a parser allows.
fn compound(inner: BoxedStrategy<String>) -> BoxedStrategy<String> {
    let member = (ws(), string(), ws(), ws(), inner.clone(), ws())
        .prop_map(|(a, k, b, c, v, d)| format!("{a}{k}{b}:{c}{v}{d}"));
    prop_oneof![
        (proptest::collection::vec(member, 0..5), ws()).prop_map(|(m, w)| if m.is_empty() {
            format!("{{{w}}}")
        } else {
            format!("{{{}}}", m.join(","))
        }),
        (proptest::collection::vec((ws(), inner, ws()), 0..4), ws()).prop_map(|(e, w)| {
            if e.is_empty() {
                format!("[{w}]")
            } else {
                let e: Vec<String> = e
                    .into_iter()
                    .map(|(a, v, b)| format!("{a}{v}{b}"))
                    .collect();
                format!("[{}]", e.join(","))
            }
        }),
    ]
    .boxed()
}

fn value() -> BoxedStrategy<String> {
    scalar().boxed().prop_recursive(4, 48, 5, compound).boxed()
}

/// A value for `stream_options`: what clients send, and what they should not.
fn options() -> BoxedStrategy<String> {
    let opt_member = (ws(), string(), ws(), value(), ws())
        .prop_map(|(a, k, b, v, c)| format!("{a}{k}{b}:{v}{c}"));
    prop_oneof![
        Just("null".to_owned()),
        Just(r#"{"include_usage":false}"#.to_owned()),
        Just(r#"{ "continuous_usage_stats" : true }"#.to_owned()),
        Just("{ }".to_owned()),
        (proptest::collection::vec(opt_member, 0..4), ws()).prop_map(|(m, w)| if m.is_empty() {
            format!("{{{w}}}")
        } else {
            format!("{{{}}}", m.join(","))
        }),
        value(),
    ]
    .boxed()
}

/// A request body: a top-level object whose members are mostly the ones the
/// rewrite looks at (repeated, escaped, nested copies inside other values),
/// or something else entirely; sometimes cut short or with a byte dropped.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let member = prop_oneof![
        3 => (ws(), prop_oneof![Just("true".to_owned()), Just("false".to_owned()), value()])
            .prop_map(|(w, v)| format!(r#""stream"{w}:{w}{v}"#)),
        1 => value().prop_map(|v| format!(r#""str\u0065am":{v}"#)),
        3 => (ws(), options()).prop_map(|(w, v)| format!(r#"{w}"stream_options"{w}:{v}"#)),
        1 => options().prop_map(|v| format!(r#""stream\u005Foptions": {v}"#)),
        3 => (string(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
        1 => value().prop_map(|v| format!(r#""messages":[{{"stream":true,"stream_options":{v}}}]"#)),
    ];
    let object =
        (ws(), proptest::collection::vec((member, ws()), 0..6), ws()).prop_map(|(a, m, b)| {
            let m: Vec<String> = m.into_iter().map(|(m, w)| format!("{m}{w}")).collect();
            format!("{a}{{{}}}{b}", m.join(","))
        });
    let whole = prop_oneof![8 => object, 1 => value()];
    (whole, 0u8..10, any::<proptest::sample::Index>()).prop_map(|(s, damage, at)| {
        let mut b = s.into_bytes();
        match damage {
            0 if !b.is_empty() => b.truncate(at.index(b.len())),
            1 if !b.is_empty() => {
                b.remove(at.index(b.len()));
            }
            _ => {}
        }
        b
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// Whatever the body, the splice and the serde_json round trip agree.
    #[test]
    fn the_splice_agrees_with_the_serde_json_round_trip(body in body()) {
        prop_assert!(agree(&body).is_ok(), "{}", agree(&body).unwrap_err());
    }
}

/// The generator reaches every branch: bodies that get the option added to
/// an existing object, in place of `null`, as a new member, and bodies left
/// alone for each reason (so the property above cannot pass by never
/// rewriting).
#[test]
fn every_case_is_covered_and_agrees() {
    let cases: &[(&[u8], Option<&[u8]>)] = &[
        (br#"{"stream":true}"#, Some(br#"{"stream":true,"stream_options":{"include_usage":true}}"#)),
        (b" {\n \"stream\" : true \n} \n", Some(b" {\n \"stream\" : true \n,\"stream_options\":{\"include_usage\":true}} \n")),
        (br#"{"stream":true,"stream_options":null,"n":1}"#, Some(br#"{"stream":true,"stream_options":{"include_usage":true},"n":1}"#)),
        (br#"{"stream":true,"stream_options":{ }}"#, Some(br#"{"stream":true,"stream_options":{ "include_usage":true}}"#)),
        (br#"{"stream_options":{"a":1},"stream":true}"#, Some(br#"{"stream_options":{"a":1,"include_usage":true},"stream":true}"#)),
        // The last of repeated members counts, as in a parse.
        (br#"{"stream":false,"stream":true}"#, Some(br#"{"stream":false,"stream":true,"stream_options":{"include_usage":true}}"#)),
        (br#"{"stream":true,"stream_options":{"include_usage":false},"stream_options":{}}"#,
         Some(br#"{"stream":true,"stream_options":{"include_usage":false},"stream_options":{"include_usage":true}}"#)),
        (br#"{"stream":true,"stream":false}"#, None),
        // Escaped names are the same names.
        (br#"{"str\u0065am":true}"#, Some(br#"{"str\u0065am":true,"stream_options":{"include_usage":true}}"#)),
        (br#"{"stream":true,"stream\u005foptions":{"include\u005fusage":false}}"#, None),
        // Nested look-alikes and text inside strings do not count.
        (br#"{"x":{"stream":true},"y":"\"stream\":true"}"#, None),
        (br#"{"stream":true,"x":{"stream_options":{"include_usage":false}}}"#,
         Some(br#"{"stream":true,"x":{"stream_options":{"include_usage":false}},"stream_options":{"include_usage":true}}"#)),
        (br#"{"stream":true,"stream_options":{"x":{"include_usage":false}}}"#,
         Some(br#"{"stream":true,"stream_options":{"x":{"include_usage":false},"include_usage":true}}"#)),
        (br#"{"stream":"true"}"#, None),
        (br#"{"stream":true,"stream_options":[]}"#, None),
        (br#"[{"stream":true}]"#, None),
        // What a strict parse refuses, the splice refuses.
        (br#"{"stream":true,"x":"\ud800"}"#, None),
        (br#"{"stream":true,"x":1e400}"#, None),
        (br#"{"stream":true}x"#, None),
        (br#"{"stream":true,}"#, None),
        (b"{\"stream\":true,\"x\":\"\xff\"}", None),
        (b"{\"stream\":true,\"x\":\"a\nb\"}", None),
        (b"", None),
    ];
    for (body, want) in cases {
        let got = include_usage(body);
        assert_eq!(
            got.as_deref(),
            *want,
            "{} → {:?}",
            String::from_utf8_lossy(body),
            got.as_deref().map(String::from_utf8_lossy)
        );
        agree(body).unwrap();
    }
}

/// serde_json's nesting limit applies to the splice as to the round trip.
#[test]
fn nesting_depth_is_judged_as_serde_json_judges_it() {
    // Inside a member the splice reads, and inside one it only checks.
    for (before, after) in [
        (r#"{"stream":true,"x":"#, "}"),
        (r#"{"stream":true,"stream_options":{"x":"#, "}}"),
    ] {
        let mut seen = (false, false);
        for depth in 120..136 {
            let body = format!("{before}{}{}{after}", "[".repeat(depth), "]".repeat(depth));
            agree(body.as_bytes()).unwrap();
            match include_usage(body.as_bytes()) {
                Some(_) => seen.0 = true,
                None => seen.1 = true,
            }
        }
        assert_eq!(seen, (true, true), "both sides of the limit were tried");
    }
}
