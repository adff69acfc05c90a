//! The hand-written CBOR / pickle encoders against references: ciborium, a
//! separately written tree pickler, and CPython's own `pickle` module.

use std::io::Write;
use std::process::{Command, Stdio};

use kvroute_core::fuzzing::{reference_cbor, reference_pickle, FuzzBlock, OwnedItem};
use proptest::prelude::*;

fn token() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..24,
        0u64..256,
        0u64..65_536,
        0u64..200_000,
        any::<u32>().prop_map(u64::from),
        any::<u64>(),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z]",
        "[a-zA-Z0-9/_-]{2,30}",
        "\\PC{0,12}",
        "[é中😀a]{1,3}",
        "x{255,300}",
    ]
}

fn item() -> impl Strategy<Value = OwnedItem> {
    prop_oneof![
        (text(), text()).prop_map(|(n, p)| OwnedItem::Lora(n, p)),
        (text(), any::<i64>()).prop_map(|(i, o)| OwnedItem::Mm(i, o)),
        (text(), -100i64..100).prop_map(|(i, o)| OwnedItem::Mm(i, o)),
        text().prop_map(OwnedItem::CacheSalt),
        any::<[u8; 32]>().prop_map(OwnedItem::PromptEmbeds),
    ]
}

fn block() -> impl Strategy<Value = FuzzBlock> {
    (
        prop_oneof![
            any::<[u8; 32]>().prop_map(|p| p.to_vec()),
            any::<[u8; 16]>().prop_map(|p| p.to_vec())
        ],
        prop::collection::vec(token(), 0..80),
        prop::collection::vec(item(), 0..6),
        prop::option::of(prop::collection::vec(token(), 1..4)),
    )
        .prop_map(|(parent, tokens, items, lookahead)| FuzzBlock {
            parent,
            tokens,
            items,
            lookahead,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn cbor_matches_ciborium(b in block()) {
        prop_assert_eq!(b.encode_cbor(), reference_cbor(&b.to_py()));
    }

    #[test]
    fn pickle_matches_reference_pickler(b in block()) {
        prop_assert_eq!(b.encode_pickle(), reference_pickle(&b.to_py()));
    }
}

/// A small deterministic generator (the cases must be reproducible for Python too).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn text(&mut self) -> String {
        const ALPHABET: [&str; 8] = ["a", "b", "é", "中", "😀", "-", "/", "Z"];
        match self.below(5) {
            0 => String::new(),
            1 => ALPHABET[self.below(8) as usize].to_owned(),
            2 => "q".repeat(250 + self.below(20) as usize),
            _ => (0..2 + self.below(20))
                .map(|_| ALPHABET[self.below(8) as usize])
                .collect(),
        }
    }
    fn token(&mut self) -> u64 {
        match self.below(6) {
            0 => self.below(24),
            1 => self.below(256),
            2 => self.below(65_536),
            3 => self.below(1 << 31),
            4 => self.below(1 << 32),
            _ => self.next(),
        }
    }
}

fn random_block(rng: &mut XorShift) -> FuzzBlock {
    let parent_len = if rng.below(2) == 0 { 32 } else { 16 };
    let parent = (0..parent_len).map(|_| rng.next() as u8).collect();
    let tokens = (0..rng.below(70)).map(|_| rng.token()).collect();
    let items = (0..rng.below(6))
        .map(|_| match rng.below(4) {
            0 => OwnedItem::Lora(rng.text(), rng.text()),
            1 => OwnedItem::Mm(rng.text(), rng.next() as i64 >> rng.below(64)),
            2 => OwnedItem::CacheSalt(rng.text()),
            _ => {
                let mut d = [0u8; 32];
                d.iter_mut().for_each(|b| *b = rng.next() as u8);
                OwnedItem::PromptEmbeds(d)
            }
        })
        .collect();
    let lookahead =
        (rng.below(3) == 0).then(|| (0..1 + rng.below(3)).map(|_| rng.token()).collect());
    FuzzBlock {
        parent,
        tokens,
        items,
        lookahead,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn json_case(b: &FuzzBlock) -> serde_json::Value {
    let items: Vec<serde_json::Value> = b
        .items
        .iter()
        .map(|it| match it {
            OwnedItem::Lora(n, p) => serde_json::json!(["lora", n, p]),
            OwnedItem::Mm(i, o) => serde_json::json!(["mm", i, o]),
            OwnedItem::CacheSalt(s) => serde_json::json!(["cache_salt", s]),
            OwnedItem::PromptEmbeds(d) => serde_json::json!(["prompt_embeds", hex(d)]),
        })
        .collect();
    serde_json::json!({"parent": hex(&b.parent), "tokens": b.tokens, "items": items, "lookahead": b.lookahead})
}

/// Builds the tuple the way vLLM does: tags are code literals (one interned
/// object each), user strings come from decoded input, and pickles it with
/// CPython's C pickler.
const PY_PICKLER: &str = r#"
import json, pickle, sys
TAGS = {"lora": "lora", "mm": "mm", "cache_salt": "cache_salt", "prompt_embeds": "prompt_embeds"}
for line in sys.stdin:
    c = json.loads(line)
    items = []
    for it in c["items"]:
        tag = TAGS[it[0]]
        if tag == "prompt_embeds":
            items.append((tag, bytes.fromhex(it[1])))
        else:
            items.append((tag,) + tuple(it[1:]))
    e = tuple(items) if items else None
    if c["lookahead"] is not None:
        e = (e,) + tuple(c["lookahead"])
    v = (bytes.fromhex(c["parent"]), tuple(c["tokens"]), e)
    print(pickle.dumps(v, protocol=5).hex())
"#;

#[test]
fn pickle_matches_cpython() {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let blocks: Vec<FuzzBlock> = (0..400).map(|_| random_block(&mut rng)).collect();
    let mut child = Command::new("python3")
        .args(["-c", PY_PICKLER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 is required for this test (CPython's pickle is the reference)");
    // Feed stdin from a thread: python answers line by line, and its output would
    // fill the pipe before all input is written.
    let input: String = blocks
        .iter()
        .map(|b| format!("{}\n", json_case(b)))
        .collect();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "python3 failed");
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    assert_eq!(lines.len(), blocks.len());
    for (b, want) in blocks.iter().zip(lines) {
        assert_eq!(hex(&b.encode_pickle()), want, "{b:?}");
    }
}
