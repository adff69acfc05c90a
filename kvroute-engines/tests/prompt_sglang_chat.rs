//! kvroute's SGLang chat path against SGLang 0.5.23's own:
//! `tests/python/sglang_chat_render.py` validates each body with the wheel's
//! pydantic request models and runs `serving_chat.py`'s message processing
//! and template call (compiled from the wheel's source), rendering with
//! transformers; the ids are transformers' encoding of what SGLang encodes
//! (the rendered text without special tokens, then a continued assistant
//! text on its own, as `_append_assistant_prefix_to_prompt_ids` does).
//!
//! The corpus: every chat request of `golden/chat` (vLLM's cases, where the
//! engines differ in many), requests aimed at each known difference, and
//! generated conversations. A request SGLang refuses must be refused; one it
//! renders must render to the same text and ids.

mod interop_support;

use std::path::PathBuf;

use interop_support::golden;
use interop_support::transformers::{qwen3_tokenizer, run_json};
use kvroute_engines::prompt::{
    parse_json, prompt_tokens_as, ApiKind, Dialect, ModelOptions, ModelTokenizer,
};
use serde_json::{json, Value};

const MODEL: &str = "Qwen/Qwen3-8B";

/// The staged Qwen3 files, the chat template edited by `edit`.
fn staged_dir(name: &str, edit: impl Fn(&str) -> String) -> (PathBuf, Value) {
    let (tokenizer, mut config) = qwen3_tokenizer();
    let template = edit(config["chat_template"].as_str().unwrap());
    config["chat_template"] = template.into();
    let dir =
        std::env::temp_dir().join(format!("kvroute-sglang-chat-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    (dir, config)
}

fn special_tokens(config: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for k in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        if let Some(v) = config[k].as_str() {
            out.insert(k.to_owned(), v.into());
        }
    }
    Value::Object(out)
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

fn clock() -> Value {
    json!({"function": {"parameters": {"type": "object"}, "name": "get_time", "strict": true}, "type": "function"})
}

fn call(args: Value) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]})
}

/// Requests aimed at each way SGLang's chat path is its own.
fn targeted() -> Vec<Value> {
    let conv = |messages: Value| json!({"model": MODEL, "messages": messages});
    let mut out = vec![
        conv(json!([user("Hi"), {"role": "assistant", "content": "Hello"}])),
        conv(
            json!([user("Hi"), {"role": "assistant", "content": "Hello", "reasoning_content": "think"}]),
        ),
        conv(json!([
            user("Weather in Paris?"),
            call(json!("{\"city\": \"Paris\"}"))
        ])),
        conv(
            json!([user("Weather?"), call(json!("{\"city\": \"Paris\"}")), {"role": "tool", "content": "sunny"}]),
        ),
        conv(
            json!([user("Weather?"), call(json!({"city": "Oslo"})), {"role": "tool", "content": "snow"}]),
        ),
        conv(json!([user("Weather?"), call(json!(null)), {"role": "tool", "content": "x"}])),
        conv(
            json!([user("Weather?"), call(json!("{\"city\":")), {"role": "tool", "content": "x"}]),
        ),
        conv(json!([user("Weather?"), call(json!("[1]")), {"role": "tool", "content": "x"}])),
        conv(json!([user("Weather?"), call(json!("")), {"role": "tool", "content": "x"}])),
        conv(
            json!([user("Weather?"), call(json!("{\"n\": NaN}")), {"role": "tool", "content": "x"}]),
        ),
        conv(
            json!([user("Weather?"), call(json!("{\"b\": 1, \"a\": [1.5, true, null]}")),
            {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        ),
        conv(
            json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]),
        ),
        conv(
            json!([{"role": "system", "content": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]}, user("Hi")]),
        ),
        conv(json!([{"role": "user", "content": [{"type": "input_text", "text": "a"}]}])),
        conv(json!([{"role": "user", "content": ["a", "b"]}])),
        conv(
            json!([user("Q"), {"role": "assistant", "content": [{"type": "thinking", "thinking": "T"}, {"type": "text", "text": "A"}]}, user("again")]),
        ),
        conv(json!([{"role": "user", "content": [{"type": "thinking", "thinking": "T"}]}])),
        conv(json!([{"role": "developer", "content": "Answer in French."}, user("Hi")])),
        conv(
            json!([{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, user("Hi")]),
        ),
        conv(json!([{"role": "System", "content": "S"}, user("Hi")])),
        conv(json!([{"role": "User", "content": "Hi"}])),
        conv(json!([{"role": "narrator", "content": "x"}, user("Hi")])),
        conv(
            json!([{"role": "system", "content": "x-anthropic-billing-header: cch=1\nReal system"}, user("Hi")]),
        ),
        conv(
            json!([{"role": "system", "content": "S", "name": "sys"}, {"role": "user", "content": "Hi", "name": "bob"}]),
        ),
        conv(
            json!([user("Q"), {"role": "assistant", "content": null, "reasoning": "R", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "x"}]),
        ),
        conv(json!([{"role": "user", "content": null}])),
        conv(json!([user("Hi"), {"role": "assistant", "content": null}])),
        conv(json!([])),
    ];
    let with = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": [user("Hi")]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    out.extend([
        with(json!({"add_generation_prompt": false})),
        with(json!({"chat_template_kwargs": {"add_generation_prompt": false}})),
        with(json!({"chat_template_kwargs": {"enable_thinking": false}})),
        with(json!({"reasoning_effort": "none"})),
        with(json!({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": false}})),
        with(json!({"reasoning": {"effort": "none"}})),
        with(json!({"reasoning": {"effort": "low"}, "reasoning_effort": "none"})),
        with(json!({"reasoning": {"enabled": "yes"}})),
        with(json!({"chat_template_kwargs": {"reasoning_effort": "none"}})),
        with(json!({"tools": [weather()]})),
        with(json!({"tools": [weather(), clock()]})),
        with(json!({"tools": [weather()], "tool_choice": "none"})),
        with(json!({"tools": [weather()], "tool_choice": "required"})),
        with(json!({"tools": [weather(), clock()], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})),
        with(json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}})),
        with(json!({"tools": []})),
        with(json!({"tools": [{"type": "function", "defer_loading": true, "function": {"name": "lazy"}}]})),
        with(json!({"tools": [{"function": {"name": "f", "description": "d", "x-extra": 1}}]})),
        with(json!({"truncate_prompt_tokens": 3, "add_special_tokens": true})),
        with(json!({"cache_salt": ""})),
    ]);
    for (prefix, kwargs) in [
        ("Hel", json!({})),
        ("\nHello", json!({})),
        ("", json!({})),
        ("Hel", json!({"enable_thinking": false})),
    ] {
        out.push(json!({"model": MODEL, "continue_final_message": true, "add_generation_prompt": false,
            "chat_template_kwargs": kwargs, "messages": [user("Hi"), {"role": "assistant", "content": prefix}]}));
    }
    out.push(json!({"model": MODEL, "continue_final_message": true, "messages": [user("Hi")]}));
    out
}

/// A small deterministic generator (xorshift) of conversations mixing the
/// shapes above.
fn generated(n: usize) -> Vec<Value> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |m: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % m
    };
    let words = [
        "alpha",
        "beta",
        "  gamma",
        "δέλτα",
        "<think>x</think>",
        "line\nbreak",
        "",
        "中文",
    ];
    (0..n)
        .map(|_| {
            let mut messages = Vec::new();
            if next(3) == 0 {
                let role = ["system", "developer", "System"][next(3) as usize];
                messages.push(json!({"role": role, "content": words[next(8) as usize]}));
            }
            for _ in 0..1 + next(4) {
                let text = |k: &mut dyn FnMut(u64) -> u64| {
                    if k(3) == 0 {
                        json!([{"type": "text", "text": words[k(8) as usize]}, {"type": "text", "text": words[k(8) as usize]}])
                    } else {
                        json!(words[k(8) as usize])
                    }
                };
                messages.push(json!({"role": "user", "content": text(&mut next)}));
                match next(4) {
                    0 => messages.push(json!({"role": "assistant", "content": text(&mut next)})),
                    1 => messages.push(json!({"role": "assistant", "content": words[next(8) as usize],
                        "reasoning_content": words[next(8) as usize]})),
                    2 => {
                        messages.push(call(json!(format!("{{\"city\": \"{}\"}}", words[next(8) as usize].escape_default()))));
                        messages.push(json!({"role": "tool", "content": text(&mut next)}));
                    }
                    _ => {}
                }
            }
            let mut body = json!({"model": MODEL, "messages": messages});
            if next(3) == 0 {
                body["tools"] = json!([weather(), clock()]);
                if next(2) == 0 {
                    let choice = ["auto", "none", "required"][next(3) as usize];
                    body["tool_choice"] = json!(choice);
                }
            }
            if next(4) == 0 {
                body["continue_final_message"] = json!(true);
            }
            if next(4) == 0 {
                body["chat_template_kwargs"] = json!({"enable_thinking": next(2) == 0});
            }
            body
        })
        .collect()
}

#[test]
fn chat_requests_render_and_encode_as_sglang_does() {
    let (dir, config) = staged_dir("qwen3", str::to_owned);
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(golden("chat/qwen3_cases.json")).unwrap())
            .unwrap();
    let mut requests: Vec<Value> = cases["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["endpoint"].as_str().is_some_and(|e| e.contains("chat")))
        .filter(|c| c["request"].is_object())
        .map(|c| c["request"].clone())
        .collect();
    assert!(requests.len() >= 30, "golden chat requests lost");
    requests.extend(targeted());
    requests.extend(generated(120));
    let (rendered, refused) = compare(&dir, &config, &requests);
    // The corpus exercises both outcomes.
    assert!(
        rendered >= 100 && refused >= 8,
        "{rendered} rendered, {refused} refused"
    );
}

/// A template SGLang gives part lists to (its detection takes any mention
/// of images as a multimodal template; vLLM's does not): the Qwen3 template
/// with a comment, which then renders list content as nothing.
#[test]
fn part_lists_reach_a_template_sglang_detects_as_openai() {
    let (dir, config) = staged_dir("openai", |t| format!("{{# image-free #}}{t}"));
    let mut requests = targeted();
    requests.extend(generated(40));
    let (rendered, _) = compare(&dir, &config, &requests);
    assert!(rendered >= 40, "{rendered} rendered");
}

/// A template that refuses tools wrapped as `{"type", "function"}`: SGLang
/// renders again with the functions alone.
#[test]
fn a_template_refusing_wrapped_tools_gets_the_functions() {
    let (dir, config) = staged_dir("flat", |t| {
        format!(
            "{{%- if tools and tools[0].function is defined %}}{{{{ raise_exception('functions only') }}}}{{%- endif %}}{t}"
        )
    });
    let requests: Vec<Value> = targeted()
        .into_iter()
        .filter(|r| r.get("tools").is_some())
        .collect();
    let (rendered, _) = compare(&dir, &config, &requests);
    assert!(rendered >= 5, "{rendered} rendered");
}

/// Renders `requests` with SGLang's own code (content format detected as
/// SGLang does) and with kvroute's SGLang path over the model in `dir`;
/// panics on any difference; returns (rendered, refused) counts.
fn compare(dir: &std::path::Path, config: &Value, requests: &[Value]) -> (usize, usize) {
    let tok = ModelTokenizer::load(dir, &ModelOptions::default()).unwrap();
    let job = json!({
        "template": config["chat_template"],
        "special_tokens": special_tokens(config),
        "content_format": "auto",
        "requests": requests,
    });
    let sglang: Vec<Value> =
        serde_json::from_value(run_json("sglang_chat_render.py", &[], &job)).unwrap();
    assert_eq!(sglang.len(), requests.len());

    // What SGLang encodes, encoded by transformers: the rendered text, and a
    // continued assistant text on its own with the tokenizer's specials.
    let mut texts = Vec::new();
    for r in &sglang {
        if let Some(t) = r["ok"].as_str() {
            texts.push(json!({"text": t, "add_special_tokens": false, "max_length": null}));
            if let Some(p) = r["assistant_prefix"].as_str().filter(|p| !p.is_empty()) {
                texts.push(json!({"text": p, "add_special_tokens": true, "max_length": null}));
            }
        }
    }
    let encoded: Vec<Vec<u32>> = serde_json::from_value(run_json(
        "transformers_encode.py",
        &[dir.as_os_str()],
        &Value::Array(texts),
    ))
    .unwrap();
    let mut encoded = encoded.into_iter();

    let mut failures = Vec::new();
    let (mut rendered, mut refused) = (0, 0);
    for (body, want) in requests.iter().zip(&sglang) {
        let ours = prompt_tokens_as(
            &tok,
            ApiKind::Chat,
            &parse_json(body.to_string().as_bytes()).unwrap(),
            Default::default(),
            Dialect::Sglang,
        );
        match (want.get("ok").and_then(Value::as_str), ours) {
            (Some(text), Ok(p)) => {
                rendered += 1;
                let prefix = want["assistant_prefix"].as_str().unwrap_or_default();
                let mut ids = encoded.next().unwrap();
                if !prefix.is_empty() {
                    ids.extend(encoded.next().unwrap());
                }
                let got = &p.engine_prompts[0];
                let joined = format!("{text}{prefix}");
                if got.rendered.as_deref() != Some(joined.as_str()) {
                    failures.push(format!(
                        "{body}\n  sglang: {joined:?}\n  ours:   {:?}",
                        got.rendered
                    ));
                } else if got.token_ids != ids {
                    failures.push(format!(
                        "{body}\n  ids differ: {ids:?} vs {:?}",
                        got.token_ids
                    ));
                }
            }
            (Some(text), Err(e)) => {
                if !want["assistant_prefix"]
                    .as_str()
                    .unwrap_or_default()
                    .is_empty()
                {
                    encoded.next();
                }
                encoded.next();
                failures.push(format!(
                    "{body}\n  sglang renders {text:?}, ours refuses: {e}"
                ));
            }
            (None, Ok(p)) if want.get("input_ids").is_none() => failures.push(format!(
                "{body}\n  sglang refuses ({}), ours renders {:?}",
                want["err"], p.engine_prompts[0].rendered
            )),
            (None, _) => refused += 1,
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} requests differ from SGLang:\n{}",
        failures.len(),
        requests.len(),
        failures.join("\n")
    );
    (rendered, refused)
}

/// Fields SGLang's request models do not have are ignored, whatever their
/// value: the models (read from the wheel) lack them, and kvroute's SGLang
/// ids do not change with them, on chat and completions.
#[test]
fn fields_sglang_does_not_have_change_nothing() {
    let fields: Value = run_json(
        "sglang_chat_render.py",
        &["--fields".as_ref()],
        &json!(null),
    );
    let has = |api: &str, f: &str| fields[api].as_array().unwrap().iter().any(|v| v == f);
    let ignored = [
        "add_special_tokens",
        "truncate_prompt_tokens",
        "truncation_side",
    ];
    for f in ignored {
        assert!(!has("chat", f) && !has("completions", f), "SGLang has {f}");
    }
    assert!(!has("chat", "add_generation_prompt"));
    assert!(has("chat", "continue_final_message") && has("completions", "cache_salt"));

    let (dir, _) = staged_dir("fields", str::to_owned);
    let tok = ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap();
    let ids = |api: ApiKind, body: Value| {
        let p = prompt_tokens_as(
            &tok,
            api,
            &parse_json(body.to_string().as_bytes()).unwrap(),
            Default::default(),
            Dialect::Sglang,
        )
        .unwrap();
        p.engine_prompts[0].token_ids.clone()
    };
    let extra = json!({"add_special_tokens": false, "truncate_prompt_tokens": 2,
        "truncation_side": "right", "add_generation_prompt": false});
    for (api, body) in [
        (
            ApiKind::Chat,
            json!({"model": MODEL, "messages": [user("a question of some length")]}),
        ),
        (
            ApiKind::Completions,
            json!({"model": MODEL, "prompt": "a prompt of some length"}),
        ),
    ] {
        let mut with = body.clone();
        for (k, v) in extra.as_object().unwrap() {
            with[k] = v.clone();
        }
        assert_eq!(ids(api, with), ids(api, body));
    }
}
