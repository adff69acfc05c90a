//! All cases of golden/chat/qwen3_cases.json with the real Qwen3 tokenizer:
//! rendered text, ids, template input and error kinds.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_engines::prompt::golden::{check_chat_cases, check_chat_cases_value};
use kvroute_engines::prompt::{ModelOptions, ModelTokenizer};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn qwen3() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let opts = ModelOptions {
            max_model_len: Some(40960),
            ..ModelOptions::default()
        };
        ModelTokenizer::load(&repo().join("golden/tokenizers/qwen3"), &opts).unwrap()
    })
}

fn cases_file() -> Vec<u8> {
    std::fs::read(repo().join("golden/chat/qwen3_cases.json")).unwrap()
}

#[test]
fn all_qwen3_cases_match() {
    let report = check_chat_cases(&cases_file(), qwen3()).unwrap();
    for f in &report.failures {
        eprintln!("FAIL {}: {}", f.id, f.reason);
    }
    assert_eq!(report.total, 50);
    assert_eq!(report.render_cases, 45);
    assert_eq!(report.error_cases, 5);
    assert_eq!(report.engine_prompts, 48);
    // Every successful chat case (41 chat - 4 chat errors) carries a template_input.
    assert_eq!(report.template_inputs_checked, 37);
    assert_eq!(report.failures, vec![]);
    assert_eq!(report.passed, 50);
    assert!(report.is_clean());
}

#[test]
fn checker_loads_a_model_dir_and_reports_mismatches() {
    let opts = ModelOptions {
        max_model_len: Some(40960),
        ..ModelOptions::default()
    };
    // Corrupt one id and one error kind: the checker must flag exactly those cases.
    let mut file: serde_json::Value = serde_json::from_slice(&cases_file()).unwrap();
    for case in file["cases"].as_array_mut().unwrap() {
        match case["id"].as_str().unwrap() {
            "chat_user_only" => case["engine_prompts"][0]["token_ids"][4] = 1.into(),
            "err_empty_tools_array" => case["error"]["kind"] = "template_error".into(),
            _ => {}
        }
    }
    let report =
        check_chat_cases_value(&file, &repo().join("golden/tokenizers/qwen3"), &opts).unwrap();
    let ids: Vec<&str> = report.failures.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(report.total, 50);
    assert_eq!(ids, vec!["chat_user_only", "err_empty_tools_array"]);
    assert_eq!(report.passed, 48);
    assert!(!report.is_clean());
}

#[test]
fn cached_tokenization_equals_full_on_every_golden_prompt() {
    let tok = qwen3();
    let report = check_chat_cases(&cases_file(), tok).unwrap();
    assert!(report.is_clean());
    let stats = tok
        .span_cache_stats()
        .expect("Qwen3 tokenizer admits the span cache");
    // Shared-prefix and repeated system prompts in the file must have produced hits.
    assert!(stats.hits > 0 && stats.misses > 0, "{stats:?}");
    // The span cache's misses went through the fast byte-level BPE path
    // (so the vLLM ids above are that path's), whose pre-token cache hit.
    let words = tok
        .pre_token_cache_stats()
        .expect("Qwen3 takes the fast byte-level BPE path");
    assert!(words.hits > 0 && words.misses > 0, "{words:?}");
    // And each rendered prompt, cached (now warm) vs a full tokenization:
    let file = kvroute_engines::prompt::parse_json(&cases_file()).unwrap();
    let cases = file.as_dict().unwrap()["cases"].as_list().unwrap();
    let mut compared = 0;
    for case in cases {
        let Some(prompts) = case.as_dict().unwrap()["engine_prompts"].as_list() else {
            continue;
        };
        for p in prompts {
            if let Some(text) = p.as_dict().unwrap()["rendered_prompt"].as_str() {
                for add_special in [false, true] {
                    assert_eq!(
                        tok.encode(text, add_special).unwrap(),
                        tok.encode_uncached(text, add_special).unwrap()
                    );
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 45);
}
