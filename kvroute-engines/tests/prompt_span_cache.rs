//! Property: span-cached tokenization == full tokenization, on random
//! conversations rendered with the Qwen3 template and on raw text that puts
//! delimiter fragments, combining marks and whitespace next to the cut points.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_engines::prompt::{
    prompt_tokens, ApiKind, ModelOptions, ModelTokenizer, PyDict, PyValue,
};
use proptest::prelude::*;

fn qwen3() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
        // A small budget so eviction happens during the run.
        let opts = ModelOptions {
            span_cache_bytes: 16 << 10,
            ..ModelOptions::default()
        };
        ModelTokenizer::load(&dir, &opts).unwrap()
    })
}

/// Text fragments chosen to stress the cut: partial and complete special
/// tokens, combining marks that NFC would merge with a preceding letter,
/// whitespace runs the pre-tokenizer groups, CJK and emoji.
const FRAGMENTS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start",
    "|>",
    "<|",
    "im_start|>",
    "<think>",
    "</tool_call>",
    "\u{301}",
    "e",
    "é",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "hello",
    "world",
    "123",
    "東京",
    "😀",
    "👨‍👩‍👧",
    "'s",
    "<",
    "ok.",
];

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..12).prop_map(|v| v.concat())
}

fn message() -> impl Strategy<Value = (usize, String)> {
    (0usize..4, text())
}

fn conversation_body(msgs: &[(usize, String)]) -> PyValue {
    const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
    let messages = msgs
        .iter()
        .map(|(r, c)| {
            let mut d = PyDict::new();
            d.insert("role".into(), PyValue::Str(ROLES[*r].into()));
            d.insert("content".into(), PyValue::Str(c.clone()));
            PyValue::Dict(d)
        })
        .collect();
    let mut body = PyDict::new();
    body.insert("model".into(), PyValue::Str("qwen3".into()));
    body.insert("messages".into(), PyValue::List(messages));
    PyValue::Dict(body)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn cached_ids_equal_full_ids_on_conversations(
        msgs in prop::collection::vec(message(), 1..8),
        extra in prop::collection::vec(message(), 0..3),
    ) {
        let tok = qwen3();
        // A conversation and its continuation: the second render reuses the
        // first's segments from the cache.
        let mut longer = msgs.clone();
        longer.extend(extra);
        for conv in [&msgs, &longer] {
            let p = prompt_tokens(tok, ApiKind::Chat, &conversation_body(conv)).unwrap();
            let rendered = p.engine_prompts[0].rendered.as_deref().unwrap();
            let full = tok.encode_uncached(rendered, false).unwrap();
            prop_assert_eq!(&p.engine_prompts[0].token_ids, &full);
            prop_assert_eq!(tok.encode(rendered, false).unwrap(), full);
        }
    }

    #[test]
    fn cached_ids_equal_full_ids_on_raw_text(t in text(), u in text()) {
        let tok = qwen3();
        for s in [t.clone(), format!("{t}<|im_start|>{u}"), format!("{u}{t}{u}")] {
            for add_special in [false, true] {
                prop_assert_eq!(tok.encode(&s, add_special).unwrap(), tok.encode_uncached(&s, add_special).unwrap());
            }
        }
    }
}
