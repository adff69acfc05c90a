//! kvroute's chat-template rendering (minijinja with Python's semantics
//! layered on) against transformers' own (jinja2), the renderer vLLM calls
//! (`tests/python/transformers_render.py` says how).
//!
//! Templates: the staged Qwen3 one, the chat templates vLLM's wheel ships
//! (read from the test venv), and templates of this file that exercise the
//! jinja2 features chat templates lean on: `tojson` and its options, string
//! methods, tests, filters, loop state, `namespace`, slicing, `dict`
//! methods, arithmetic, `raise_exception`. Conversations are generated from a
//! seed (system prompts or none, user and assistant turns, tool calls with
//! argument objects, tool results, reasoning, tools, `enable_thinking`,
//! `add_generation_prompt`, `continue_final_message`), with texts holding
//! quotes, braces, markup, Unicode and whitespace. Each case renders the same
//! text in both, or fails in both.

mod interop_support;

use std::path::PathBuf;
use std::process::Command;

use interop_support::transformers::run_json;
use interop_support::{golden, python};
use kvroute_engines::prompt::{parse_json, ChatTemplate, PyValue, TemplateInput};
use serde_json::{json, Value};

/// Templates of this file: each leans on jinja2 features real templates use.
const FEATURE_TEMPLATES: &[(&str, &str)] = &[
    (
        "tojson",
        r#"{%- if tools %}{{ tools | tojson }}
{{ tools | tojson(indent=2) }}
{{ tools[0] | tojson(separators=(',', ':')) }}
{{ tools[0].function | tojson(sort_keys=true) }}
{% endif %}
{%- for m in messages %}{{ m.role }}={{ m.content | tojson }}
{%- if m.tool_calls is defined %}{% for c in m.tool_calls %} call {{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% endif %}
{{ m | tojson }}
{% endfor %}"#,
    ),
    (
        "strings",
        r#"{%- for m in messages %}
[{{ m.content.strip() }}|{{ m.content.lstrip() }}|{{ m.content.rstrip('\n') }}|{{ m.content | trim }}]
{{ m.content.split('\n') | length }} {{ m.content.split() | join('/') }}
{{ m.content.startswith(' ') }} {{ m.content.endswith('\n') }} {{ m.role.upper() }} {{ m.role | capitalize }} {{ m.role.title() }}
{{ m.content.replace('"', "'") }} {{ m.role ~ '/' ~ loop.index0 }} {{ m.role + '+' + m.content }}
{{ m.content | length }} {{ m.content[:3] }} {{ m.content[-2:] }} {{ m.content | lower }} {{ '<' in m.content }}
{%- endfor %}"#,
    ),
    (
        "control",
        r#"{%- set ns = namespace(last_user=-1, count=0, tool=false) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% set ns.count = ns.count + 1 %}{% if m.role == 'tool' %}{% set ns.tool = true %}{% endif %}{% endfor %}
last user {{ ns.last_user }} of {{ ns.count }}, tool {{ ns.tool }}
{%- for m in messages[1:] %}
{{ loop.index }}/{{ loop.length }} {{ loop.first }} {{ loop.last }} {{ loop.revindex }}{% if loop.previtem is defined %} after {{ loop.previtem.role }}{% endif %}: {{ m.role }}
{%- if m.reasoning_content is defined and m.reasoning_content %} <think>{{ m.reasoning_content }}</think>{% endif %}
{%- if m.content is string %} str{% elif m.content is none %} none{% else %} other{% endif %}
{%- if m.tool_calls is defined and m.tool_calls is iterable %} {{ m.tool_calls | length }} calls{% endif %}
{%- endfor %}
{{ messages | selectattr('role', 'equalto', 'user') | list | length }} users; roles {{ messages | map(attribute='role') | join(',') }}
{{ (messages | last).role }} {{ (messages | first).role }} {{ messages | reverse | map(attribute='role') | first }}
{%- if enable_thinking is defined and enable_thinking is false %} no-think{% endif %}
{%- if add_generation_prompt %}
<assistant>{% endif %}"#,
    ),
    (
        "dicts_and_values",
        r#"{%- for m in messages %}
{%- for k, v in m.items() %}{{ k }}:{{ v is mapping }}{{ v is sequence }};{% endfor %}
{{ m.get('name', 'anon') }} {{ m.get('missing') }} {{ m.missing | default('dflt') }} {{ 'role' in m }} {{ m.keys() | list | length }}
{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}{% endfor %}{% endif %}
{%- endfor %}
{{ none }} {{ true }} {{ false }} {{ [1, 'a', none, true] }} {{ {'a': 1} }} {{ 7 // 2 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 10 / 5 }} {{ (3 / 2) | int }} {{ 1.5 | round }} {{ 12345678901234567 }}"#,
    ),
    (
        "type_tests",
        r#"{%- set values = [none, true, false, 1, 0, 1.5, 0.0, 'str', '', [1, 2], [], {'a': 1}, {}] %}
{%- for v in values %}{{ loop.index0 }}:{{ v is none }}{{ v is boolean }}{{ v is number }}{{ v is integer }}{{ v is float }}{{ v is string }}{{ v is sequence }}{{ v is iterable }}{{ v is mapping }}{{ v is defined }}{{ v is true }}{{ v is false }}{% if v %}T{% else %}F{% endif %}{{ v | length if v is sequence else '-' }}
{% endfor %}
{{ {'a': 1}.items() is sequence }} {{ {'a': 1}.items() is iterable }} {{ (['a'] | map('upper')) is iterable }} {{ missing is sequence }} {{ missing is iterable }}
{%- for m in messages %}{{ m is mapping }}{{ m.content is sequence }}{{ m.tool_calls is iterable }}{{ m.tool_calls is defined }}{{ m.tool_calls is undefined }}{% endfor %}"#,
    ),
    (
        "filters",
        r#"{%- set words = ['b', 'a', 'c', 'a'] %}
{{ words | first }} {{ words | last }} {{ words | sort | join }} {{ words | unique | list | join(',') }} {{ words | reverse | join }} {{ words | length }}
{{ '0x1A' | int(0, 16) }} {{ '0b101' | int(0, 2) }} {{ '0x10' | int(0, 0) }} {{ '0x_ff' | int(0, 16) }} {{ '5' | int(0, 'x') }} {{ ' -1_000 ' | int }} {{ '42.9' | int }} {{ 'nan' | int }} {{ none | int }} {{ none | float }} {{ '1e3' | float }} {{ true | int }}
{{ 'abc' | list }} {{ 'abc' | first }} {{ 'abc' | reverse }} {{ -3 | abs }} {{ '42' | int }} {{ 'x' | int }} {{ '2.5' | float }} {{ 3.14159 | round(2) }} {{ 7 | string }} {{ [3, 1, 2] | max }} {{ [3, 1, 2] | min }} {{ [3, 1, 2] | sum }}
{% for k, v in {'b': 1, 'a': 2} | dictsort %}{{ k }}{{ v }}{% endfor %} {% for k, v in {'b': 1, 'a': 2} | items %}{{ k }}{{ v }}{% endfor %} {{ {'b': 1, 'a': 2} | list }} {{ {'b': 1} | length }}
{{ 'hello world' | title }} {{ 'a
b' | indent(2) }} {{ 'aXbX' | replace('X', '-') }} {{ 'xxhixx' | trim('x') }}
{{ words | map('upper') | join }} {{ [0, 1, 2, none] | select | list }} {{ [0, 1, 2] | reject('odd') | list }} {{ messages | rejectattr('role', 'equalto', 'user') | map(attribute='role') | join(',') }}
{%- for m in messages %}{{ m.content | indent(4, true) }};{% endfor %}"#,
    ),
    ("undefined_int", "{{ missing | int }}"),
    ("undefined_float", "{{ missing | float }}"),
    ("infinite_int", "{{ 'inf' | int }} {{ 'nan' | int }} {{ (1e308 * 10) | int }}"),
    ("infinite_int_nan", "{{ 'nan' | float | int }}"),
    ("indent_a_number", "{{ 5 | indent }}"),
    ("indent_none", "{{ none | indent }}"),
    (
        "raise",
        r#"{%- if messages[0].role != 'system' and messages[0].role != 'user' %}{{ raise_exception('Conversation must start with system or user') }}{% endif %}
{%- for m in messages %}{% if m.role == 'tool' and not loop.previtem is defined %}{{ raise_exception('tool first') }}{% endif %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"#,
    ),
    (
        "whitespace",
        "{% for m in messages %}\n  {%- if m.role == 'system' %}\n    SYSTEM: {{ m.content }}\n  {% else %}\n    {{ m.role }}: {{ m.content }}\n  {%- endif %}\n{% endfor %}\n{#- a comment -#}\n{% if add_generation_prompt %}  assistant:  {% endif %}",
    ),
];

/// Strings every generated text is drawn from.
const TEXTS: &[&str] = &[
    "Hello",
    "What is the weather in Paris?",
    "",
    " padded both sides ",
    "line one\nline two\n",
    "quotes \" and ' and a \\ backslash",
    "braces {{ not a tag }} {% raw %} and {# #}",
    "<b>markup</b> & entities &amp; <|im_start|>",
    "Ünïcödé, 中文, 🚀, العربية",
    "\ttab\tseparated\t",
    "json-ish: {\"a\": [1, 2.5, null]}",
    "ends with newlines\n\n",
];

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn text(&mut self) -> String {
        TEXTS[self.below(TEXTS.len())].to_owned()
    }
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather for a city, in \"metric\" units",
        "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "default": 3}},
            "required": ["city"]}}})
}

/// One generated case: `{messages, tools, add_generation_prompt,
/// continue_final_message, kwargs}`.
fn case(rng: &mut Rng) -> Value {
    let mut messages = Vec::new();
    if rng.chance(60) {
        messages.push(json!({"role": "system", "content": rng.text()}));
    }
    let turns = 1 + rng.below(3);
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": rng.text()}));
        if t + 1 == turns && rng.chance(60) {
            break;
        }
        if rng.chance(35) {
            let call = format!("call_{t}");
            messages.push(json!({"role": "assistant", "content": rng.text(),
                "tool_calls": [{"id": call, "type": "function", "function": {
                    "name": "get_weather",
                    "arguments": {"city": rng.text(), "days": rng.below(7), "metric": rng.chance(50)}}}]}));
            messages.push(json!({"role": "tool", "tool_call_id": call, "content": rng.text()}));
        }
        let mut reply = json!({"role": "assistant", "content": rng.text()});
        if rng.chance(30) {
            reply["reasoning_content"] = rng.text().into();
        }
        messages.push(reply);
    }
    let last_is_assistant = messages.last().is_some_and(|m| m["role"] == "assistant");
    let continue_final = last_is_assistant && rng.chance(25);
    let mut kwargs = serde_json::Map::new();
    match rng.below(3) {
        0 => {
            kwargs.insert("enable_thinking".into(), false.into());
        }
        1 => {
            kwargs.insert("enable_thinking".into(), true.into());
        }
        _ => {}
    }
    json!({
        "messages": messages,
        "tools": if rng.chance(30) { json!([weather_tool()]) } else { Value::Null },
        "add_generation_prompt": !continue_final && rng.chance(70),
        "continue_final_message": continue_final,
        "kwargs": kwargs,
    })
}

/// The chat templates vLLM's wheel ships, from the test venv.
fn vllm_templates() -> Vec<(String, String)> {
    let out = Command::new(python())
        .args([
            "-c",
            "import importlib.util; print(importlib.util.find_spec('vllm').submodule_search_locations[0])",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vLLM is not in the test venv: run scripts/python-env.sh"
    );
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
        .join("transformers_utils/chat_templates");
    let mut found: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
        .map(|p| {
            (
                format!("vllm/{}", p.file_name().unwrap().to_string_lossy()),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    found.sort();
    assert!(
        found.len() >= 5,
        "vLLM's chat templates not found in {}",
        dir.display()
    );
    found
}

/// The special tokens transformers passes as variables (the Qwen3 ones).
fn special_tokens() -> Vec<(String, String)> {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(golden("tokenizers/qwen3/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    ["bos_token", "eos_token", "pad_token", "unk_token"]
        .iter()
        .filter_map(|k| Some((k.to_string(), config[*k].as_str()?.to_owned())))
        .collect()
}

/// transformers' result per case: `Ok(text)` or `Err(message)`.
fn transformers_render(template: &str, cases: &[Value]) -> Vec<Result<String, String>> {
    let special: serde_json::Map<String, Value> = special_tokens()
        .into_iter()
        .map(|(k, v)| (k, v.into()))
        .collect();
    let job = json!({"template": template, "special_tokens": special, "cases": cases});
    let results: Vec<Value> =
        serde_json::from_value(run_json("transformers_render.py", &[], &job)).unwrap();
    results
        .into_iter()
        .map(|r| match r.get("ok").and_then(Value::as_str) {
            Some(s) => Ok(s.to_owned()),
            None => Err(r["err"].as_str().unwrap_or_default().to_owned()),
        })
        .collect()
}

fn py(v: &Value) -> PyValue {
    parse_json(v.to_string().as_bytes()).unwrap()
}

/// kvroute's result for one case.
fn kvroute_render(t: &ChatTemplate, case: &Value) -> Result<String, String> {
    let input = TemplateInput {
        messages: case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(py)
            .collect(),
        tools: case["tools"].as_array().map(|t| t.iter().map(py).collect()),
        documents: None,
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
        continue_final_message: case["continue_final_message"].as_bool().unwrap(),
        extra: match py(&case["kwargs"]) {
            PyValue::Dict(d) => d,
            _ => unreachable!(),
        },
    };
    t.render(&input).map_err(|e| e.to_string())
}

/// Renders `cases` with `template` in both; the differing cases, described.
fn compare(name: &str, template: &str, cases: &[Value]) -> Vec<String> {
    let ours = ChatTemplate::new(template, special_tokens());
    let theirs = transformers_render(template, cases);
    let ours = match ours {
        Ok(t) => t,
        Err(e) => {
            if theirs.iter().all(Result::is_err) {
                return Vec::new();
            }
            return vec![format!(
                "{name}: kvroute cannot compile it ({e}) but transformers renders it"
            )];
        }
    };
    let mut diffs = Vec::new();
    for (i, (case, want)) in cases.iter().zip(&theirs).enumerate() {
        let got = kvroute_render(&ours, case);
        let same = match (&got, want) {
            (Ok(a), Ok(b)) => a == b,
            (Err(_), Err(_)) => true,
            _ => false,
        };
        if !same {
            diffs.push(format!(
                "{name} case {i}: kvroute {got:?}\n  transformers {want:?}\n  case {case}"
            ));
        }
    }
    if diffs.len() > 2 {
        let n = diffs.len();
        diffs.truncate(2);
        diffs.push(format!("{name}: {n} of {} cases differ", cases.len()));
    }
    diffs
}

/// Fails with every template's differing cases.
fn assert_same(diffs: Vec<String>) {
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
}

fn cases(seed: u64, n: usize) -> Vec<Value> {
    let mut rng = Rng(seed);
    (0..n).map(|_| case(&mut rng)).collect()
}

#[test]
fn qwen3_template_renders_as_transformers_does() {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(golden("tokenizers/qwen3/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_same(compare(
        "qwen3",
        config["chat_template"].as_str().unwrap(),
        &cases(0x5eed_0001, 300),
    ));
}

#[test]
fn vllm_shipped_templates_render_as_transformers_does() {
    let cases = cases(0x5eed_0002, 120);
    assert_same(
        vllm_templates()
            .iter()
            .flat_map(|(name, template)| compare(name, template, &cases))
            .collect(),
    );
}

#[test]
fn jinja2_features_render_as_transformers_does() {
    let cases = cases(0x5eed_0003, 120);
    assert_same(
        FEATURE_TEMPLATES
            .iter()
            .flat_map(|(name, template)| compare(name, template, &cases))
            .collect(),
    );
}
