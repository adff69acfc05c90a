//! The chat-template content format (string or OpenAI part lists) kvroute
//! detects, against vLLM's own detection (`vllm/renderers/hf.py`, run from
//! the wheel by `tests/python/vllm_content_format.py`) and SGLang's
//! (`parser/jinja_template_utils.py`, run from the wheel by
//! `tests/python/sglang_chat_render.py --detect`) on the staged Qwen3
//! template and on templates written to exercise each of their rules.

mod interop_support;

use std::io::Write;
use std::process::{Command, Stdio};

use interop_support::{golden, python, repo_root};
use kvroute_engines::prompt::{ChatTemplate, ContentFormat};

fn vllm_formats(templates: &[String]) -> Vec<String> {
    run_detection(templates, &["tests/python/vllm_content_format.py"])
}

fn sglang_formats(templates: &[String]) -> Vec<String> {
    run_detection(
        templates,
        &["tests/python/sglang_chat_render.py", "--detect"],
    )
}

fn run_detection(templates: &[String], script: &[&str]) -> Vec<String> {
    let mut child = Command::new(python())
        .arg(repo_root().join(script[0]))
        .args(&script[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let input = serde_json::to_vec(templates).unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn content_format_matches_vllms_detection() {
    let qwen3: serde_json::Value = serde_json::from_slice(
        &std::fs::read(golden("tokenizers/qwen3/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let macro_tpl = |call: &str| {
        format!(
            "{{%- macro render_content(body, count=false) %}}{{%- if body is string %}}{{{{ body }}}}\
             {{%- else %}}{{%- for item in body %}}{{{{ item.text }}}}{{%- endfor %}}{{%- endif %}}\
             {{%- endmacro %}}{{%- for message in messages %}}{{{{ {call} }}}}{{%- endfor %}}"
        )
    };
    let mut templates: Vec<String> = vec![
        qwen3["chat_template"].as_str().unwrap().to_owned(),
        "{% for m in messages %}{{ m.content }}{% endfor %}".into(),
        "{% for m in messages %}{%- for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}".into(),
        "{% for m in messages %}{% for part in m[\"content\"] | selectattr('type', 'equalto', 'text') %}{{ part.text }}{% endfor %}{% endfor %}".into(),
        "{% for m in messages %}{% for part in m.content[1:] %}{{ part }}{% endfor %}{% endfor %}".into(),
        "{% for c in messages[0].content %}{{ c }}{% endfor %}".into(),
        "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c.text }}{% endfor %}{% endfor %}".into(),
        "{% for m in messages %}{% set content = m.content %}{% for c in content|list %}{{ c }}{% endfor %}{% endfor %}".into(),
        "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}".into(),
        "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}".into(),
        "{% for m in other %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}".into(),
        "{% macro m(x) %}{% for c in content %}{{ c }}{% endfor %}{% endmacro %}{{ m(1) }}".into(),
        "{% macro r(body=message.content) %}{% for i in body %}{{ i }}{% endfor %}{% endmacro %}".into(),
        macro_tpl("render_content(message.content, true)"),
        macro_tpl("render_content(count=true, body=message['content'])"),
        macro_tpl("render_content(message.role)"),
        "{%- macro render(sep=', ', body=none) %}{%- for item in body %}{{ item.text }}{%- endfor %}\
         {%- endmacro %}{%- for message in messages %}{{ render (')', message.content) }}{%- endfor %}"
            .into(),
    ];
    // SGLang's own rules: media words anywhere, loops over `message`,
    // `msg` or `m` content only.
    templates.extend([
        "{# handles image parts #}{% for m in messages %}{{ m.content }}{% endfor %}".into(),
        "{% for msg in messages %}{% for p in msg.content|list %}{{ p }}{% endfor %}{% endfor %}".into(),
        "{% for message in messages %}{% for p in message['content'][1:] if p.type == 'text' %}{{ p }}{% endfor %}{% endfor %}".into(),
        "{% for turn in messages %}{% for p in turn.content %}{{ p }}{% endfor %}{% endfor %}".into(),
        "{% for m in messages %}{% for p in (m.content) %}{{ p }}{% endfor %}{% endfor %}".into(),
    ]);
    templates.dedup();
    let name = |f: ContentFormat| match f {
        ContentFormat::String => "string",
        ContentFormat::OpenAi => "openai",
    };
    let mut differ = Vec::new();
    for (t, want) in templates.iter().zip(&vllm_formats(&templates)) {
        let got = name(ChatTemplate::new(t, vec![]).unwrap().content_format());
        if got != want {
            differ.push(format!("vLLM {want}, kvroute {got}: {t}"));
        }
    }
    let sglang = sglang_formats(&templates);
    for (t, want) in templates.iter().zip(&sglang) {
        let got = name(
            ChatTemplate::new(t, vec![])
                .unwrap()
                .sglang_content_format(),
        );
        if got != want {
            differ.push(format!("SGLang {want}, kvroute {got}: {t}"));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    // The corpus tells the two detections apart somewhere.
    let vllm = vllm_formats(&templates);
    assert!(vllm.iter().zip(&sglang).any(|(a, b)| a != b));
}
