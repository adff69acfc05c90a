//! Property tests: random neutral batches, encoded with an independent encoder (rmpv)
//! in every vLLM / SGLang layout, decode back to the same events (minus what the
//! layout cannot carry). Plus hostile-input and counting tests.

use kvroute_core::{BlockKey, Medium};
use kvroute_engines::events::{sglang, vllm, DecodeError, DecodeStats};
use kvroute_ingest::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};
use proptest::prelude::*;
use rmpv::Value as M;

fn enc(v: &M) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> M {
    M::from(x)
}

/// How one event layout is written.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// vLLM ≥ 0.24 maps; `bin_hashes` = `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
    VllmMap { bin_hashes: bool },
    /// vLLM arrays with this many `BlockStored` fields (5, 6, 7, 8, 9 or 11).
    VllmArray { stored_fields: usize },
    /// SGLang ≥ 0.5.20 maps.
    SglangMap,
    /// SGLang arrays, with or without `medium`.
    SglangArray { medium: bool },
}

fn medium_wire(m: Medium, sglang: bool) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::Cpu if sglang => "CPU_PINNED",
        Medium::Cpu => "CPU",
        Medium::Disk => "DISK",
        Medium::External => "EXTERNAL",
    }
}

fn extra_to_m(k: &ExtraKey) -> M {
    match k {
        ExtraKey::Text(t) => s(t),
        ExtraKey::Int(i) => M::from(*i),
        ExtraKey::Bytes(b) => M::Binary(b.clone()),
        ExtraKey::List(l) => M::Array(l.iter().map(extra_to_m).collect()),
    }
}

fn key_to_m(k: BlockKey, layout: Layout, salt: u8) -> M {
    match layout {
        Layout::VllmMap { bin_hashes: true } => {
            let mut digest = vec![salt; 24];
            digest.extend_from_slice(&k.0.to_be_bytes());
            M::Binary(digest)
        }
        Layout::SglangMap | Layout::SglangArray { .. } => M::from(k.as_i64()),
        _ => M::from(k.0),
    }
}

fn is_sglang(layout: Layout) -> bool {
    matches!(layout, Layout::SglangMap | Layout::SglangArray { .. })
}

/// Encodes one event; returns the wire value.
fn encode_event(e: &KvEvent, layout: Layout) -> M {
    let sg = is_sglang(layout);
    match (e, layout) {
        (KvEvent::AllCleared, Layout::VllmMap { .. } | Layout::SglangMap) => {
            M::Map(vec![(s("type"), s("AllBlocksCleared"))])
        }
        (KvEvent::AllCleared, _) => M::Array(vec![s("AllBlocksCleared")]),
        (KvEvent::Stored(b), _) => {
            let hashes = M::Array(b.keys.iter().map(|k| key_to_m(*k, layout, 7)).collect());
            let parent = b.parent.map_or(M::Nil, |p| key_to_m(p, layout, 9));
            let tokens = M::Array(b.token_ids.iter().map(|t| M::from(*t)).collect());
            let medium = s(medium_wire(b.medium, sg));
            let lora = b.lora_name.as_deref().map_or(M::Nil, s);
            let extra = M::Array(
                b.extra_keys
                    .iter()
                    .map(|x| {
                        x.as_ref()
                            .map_or(M::Nil, |l| M::Array(l.iter().map(extra_to_m).collect()))
                    })
                    .collect(),
            );
            match layout {
                Layout::VllmMap { .. } => {
                    let mut m = vec![
                        (s("type"), s("BlockStored")),
                        (s("block_hashes"), hashes),
                        (s("parent_block_hash"), parent),
                        (s("token_ids"), tokens),
                        (s("block_size"), M::from(b.block_size)),
                        (s("lora_id"), M::Nil),
                        (s("medium"), medium),
                        (s("lora_name"), lora),
                    ];
                    if !b.extra_keys.is_empty() {
                        m.push((s("extra_keys"), extra));
                    }
                    m.push((s("group_idx"), M::from(b.group)));
                    m.push((s("kv_cache_spec_kind"), kind(b.full_attention)));
                    M::Map(m)
                }
                Layout::VllmArray { stored_fields } => {
                    let all = vec![
                        hashes,
                        parent,
                        tokens,
                        M::from(b.block_size),
                        M::Nil,
                        medium,
                        lora,
                        if b.extra_keys.is_empty() {
                            M::Nil
                        } else {
                            extra
                        },
                        M::from(b.group),
                        kind(b.full_attention),
                        M::Nil,
                    ];
                    let mut a = vec![s("BlockStored")];
                    a.extend(all.into_iter().take(stored_fields));
                    M::Array(a)
                }
                Layout::SglangMap => {
                    let mut m = vec![
                        (s("type"), s("BlockStored")),
                        (s("block_hashes"), hashes),
                        (s("parent_block_hash"), parent),
                        (s("token_ids"), tokens),
                        (s("block_size"), M::from(b.block_size)),
                        (s("lora_id"), M::Nil),
                        (s("medium"), medium),
                    ];
                    if let Some(salt) = &b.cache_salt {
                        m.push((s("cache_salt"), s(salt)));
                    }
                    if let Some(l) = &b.lora_name {
                        m.push((s("lora_name"), s(l)));
                    }
                    M::Map(m)
                }
                Layout::SglangArray {
                    medium: with_medium,
                } => {
                    let mut a = vec![
                        s("BlockStored"),
                        hashes,
                        parent,
                        tokens,
                        M::from(b.block_size),
                        M::Nil,
                    ];
                    if with_medium {
                        a.push(medium);
                    }
                    M::Array(a)
                }
            }
        }
        (KvEvent::Removed(r), _) => {
            let hashes = M::Array(r.keys.iter().map(|k| key_to_m(*k, layout, 7)).collect());
            let medium = s(medium_wire(r.medium, sg));
            match layout {
                Layout::VllmMap { .. } => M::Map(vec![
                    (s("type"), s("BlockRemoved")),
                    (s("block_hashes"), hashes),
                    (s("medium"), medium),
                    (s("group_idx"), M::from(r.group)),
                ]),
                Layout::SglangMap => M::Map(vec![
                    (s("type"), s("BlockRemoved")),
                    (s("block_hashes"), hashes),
                    (s("medium"), medium),
                ]),
                Layout::VllmArray { stored_fields } => {
                    // Removed grew with the same releases as Stored.
                    let n = match stored_fields {
                        5 => 1,
                        6..=8 => 2,
                        _ => 3,
                    };
                    let mut a = vec![s("BlockRemoved")];
                    a.extend([hashes, medium, M::from(r.group)].into_iter().take(n));
                    M::Array(a)
                }
                Layout::SglangArray {
                    medium: with_medium,
                } => {
                    let mut a = vec![s("BlockRemoved"), hashes];
                    if with_medium {
                        a.push(medium);
                    }
                    M::Array(a)
                }
            }
        }
        (KvEvent::Moved(_), _) => unreachable!("msgpack engines have no moved events"),
    }
}

/// A vLLM `kv_cache_spec_kind` saying `full` (one kind of each answer).
fn kind(full: Option<bool>) -> M {
    match full {
        Some(true) => s("full_attention"),
        Some(false) => s("sliding_window"),
        None => M::Nil,
    }
}

/// The reference model: what a layout can carry of an event.
fn representable(e: &KvEvent, layout: Layout) -> KvEvent {
    let (medium, lora, extra, group, salt) = match layout {
        Layout::VllmMap { .. } => (true, true, true, true, false),
        Layout::VllmArray { stored_fields: n } => (n >= 6, n >= 7, n >= 8, n >= 9, false),
        Layout::SglangMap => (true, true, false, false, true),
        Layout::SglangArray { medium } => (medium, false, false, false, false),
    };
    let spec_kind = match layout {
        Layout::VllmMap { .. } => true,
        Layout::VllmArray { stored_fields: n } => n >= 10,
        Layout::SglangMap | Layout::SglangArray { .. } => false,
    };
    match e.clone() {
        KvEvent::Stored(mut b) => {
            if !medium {
                b.medium = Medium::Gpu;
            }
            if !lora {
                b.lora_name = None;
            }
            if !extra {
                b.extra_keys.clear();
            }
            if !group {
                b.group = 0;
            }
            if !spec_kind {
                b.full_attention = None;
            }
            if !salt {
                b.cache_salt = None;
            }
            KvEvent::Stored(b)
        }
        KvEvent::Removed(mut r) => {
            let removed_medium = match layout {
                Layout::VllmArray { stored_fields } => stored_fields >= 6,
                _ => medium,
            };
            let removed_group = match layout {
                Layout::VllmArray { stored_fields } => stored_fields >= 9,
                _ => group,
            };
            if !removed_medium {
                r.medium = Medium::Gpu;
            }
            if !removed_group {
                r.group = 0;
            }
            KvEvent::Removed(r)
        }
        other => other,
    }
}

fn encode_batch(b: &EventBatch, layout: Layout) -> Vec<u8> {
    enc(&M::Array(vec![
        M::F64(b.timestamp),
        M::Array(b.events.iter().map(|e| encode_event(e, layout)).collect()),
        b.dp_rank.map_or(M::Nil, M::from),
    ]))
}

fn medium() -> impl Strategy<Value = Medium> {
    prop::sample::select(Medium::ALL.to_vec())
}

fn extra_key() -> impl Strategy<Value = ExtraKey> {
    let leaf = prop_oneof![
        "[a-z-]{0,12}".prop_map(ExtraKey::Text),
        any::<i64>().prop_map(ExtraKey::Int),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(ExtraKey::Bytes),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop::collection::vec(inner, 0..3).prop_map(ExtraKey::List)
    })
}

fn stored() -> impl Strategy<Value = KvEvent> {
    (1u32..=32, 0usize..6, any::<bool>()).prop_flat_map(|(block_size, blocks, with_extra)| {
        let n_tokens = block_size as usize * blocks;
        (
            prop::collection::vec(any::<u64>().prop_map(BlockKey), blocks),
            prop::option::of(any::<u64>().prop_map(BlockKey)),
            prop::collection::vec(any::<u32>(), n_tokens),
            medium(),
            prop::option::of("[a-z-]{1,10}"),
            if with_extra {
                prop::collection::vec(
                    prop::option::of(prop::collection::vec(extra_key(), 0..3)),
                    blocks,
                )
                .boxed()
            } else {
                Just(Vec::new()).boxed()
            },
            (0u32..4, prop::option::of(any::<bool>())),
            prop::option::of("[a-z0-9]{1,8}"),
        )
            .prop_map(
                move |(
                    keys,
                    parent,
                    token_ids,
                    medium,
                    lora_name,
                    extra_keys,
                    (group, full_attention),
                    cache_salt,
                )| {
                    KvEvent::Stored(BlockStored {
                        keys,
                        parent,
                        token_ids,
                        block_size,
                        partial_last_block: false,
                        medium,
                        lora_name,
                        extra_keys,
                        group,
                        full_attention,
                        cache_salt,
                    })
                },
            )
    })
}

fn event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        4 => stored(),
        3 => (prop::collection::vec(any::<u64>().prop_map(BlockKey), 0..8), medium(), 0u32..4)
            .prop_map(|(keys, medium, group)| KvEvent::Removed(BlockRemoved { keys, medium, group })),
        1 => Just(KvEvent::AllCleared),
    ]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<u64>(),
        0.0f64..4e9,
        prop::option::of(0u32..16),
        prop::collection::vec(event(), 0..6),
    )
        .prop_map(|(seq, timestamp, dp_rank, events)| EventBatch {
            seq,
            timestamp,
            dp_rank,
            events,
        })
}

fn layout() -> impl Strategy<Value = Layout> {
    prop_oneof![
        any::<bool>().prop_map(|bin_hashes| Layout::VllmMap { bin_hashes }),
        prop::sample::select(vec![5usize, 6, 7, 8, 9, 11])
            .prop_map(|stored_fields| Layout::VllmArray { stored_fields }),
        Just(Layout::SglangMap),
        any::<bool>().prop_map(|medium| Layout::SglangArray { medium }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn encoded_batches_decode_to_the_reference_model(b in batch(), layout in layout()) {
        let bytes = encode_batch(&b, layout);
        let mut stats = DecodeStats::default();
        let mut out = EventBatch::default();
        let res = if is_sglang(layout) {
            sglang::decode_into(&bytes, b.seq, &mut out, &mut stats)
        } else {
            vllm::decode_into(&bytes, b.seq, &mut out, &mut stats)
        };
        prop_assert!(res.is_ok(), "{res:?}");
        let want: Vec<KvEvent> = b.events.iter().map(|e| representable(e, layout)).collect();
        prop_assert_eq!(&out.events, &want);
        prop_assert_eq!(out.seq, b.seq);
        prop_assert_eq!(out.dp_rank, b.dp_rank);
        prop_assert_eq!(out.timestamp, b.timestamp);
        prop_assert_eq!((stats.batches, stats.events, stats.unknown_fields, stats.malformed_events),
            (1, b.events.len() as u64, 0, 0));
        // Every strict prefix is rejected.
        for cut in (0..bytes.len()).step_by(7) {
            prop_assert!(vllm::decode(&bytes[..cut], 0, &mut DecodeStats::default()).is_err());
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let mut stats = DecodeStats::default();
        let ok = vllm::decode(&bytes, 0, &mut stats).is_ok();
        prop_assert_eq!(stats.batches + stats.malformed_payloads, 1);
        prop_assert_eq!(ok, stats.batches == 1);
        let _ = sglang::decode(&bytes, 0, &mut stats);
    }
}

#[test]
fn unknown_fields_and_tags_are_skipped_and_counted() {
    let payload = enc(&M::Array(vec![
        M::F64(1.0),
        M::Array(vec![
            M::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), M::Array(vec![M::from(5u64)])),
                (s("medium"), s("GPU")),
                (
                    s("future_field"),
                    M::Map(vec![(s("x"), M::Array(vec![M::Nil]))]),
                ),
            ]),
            M::Map(vec![
                (s("type"), s("BlockTeleported")),
                (s("block_hashes"), M::from(3)),
            ]),
            M::Array(vec![
                s("BlockRemoved"),
                M::Array(vec![M::from(6u64)]),
                s("GPU"),
                M::from(0),
                s("new"),
            ]),
            M::Array(vec![s("SomethingElse"), M::from(1)]),
            M::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), M::Array(vec![M::from(7u64)])),
                (s("medium"), s("NVME_OVER_FABRIC")),
            ]),
        ]),
        M::from(2),
        s("trailing batch field"),
    ]));
    let mut stats = DecodeStats::default();
    let b = vllm::decode(&payload, 1, &mut stats).unwrap();
    let keys: Vec<_> = b
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Removed(r) => (r.keys[0].0, r.medium),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        keys,
        vec![(5, Medium::Gpu), (6, Medium::Gpu), (7, Medium::External)]
    );
    assert_eq!(
        (
            stats.unknown_fields,
            stats.unknown_event_tags,
            stats.unknown_media,
            stats.events
        ),
        (3, 2, 1, 5)
    );
}

#[test]
fn an_invalid_event_is_dropped_and_the_rest_kept() {
    let payload = enc(&M::Array(vec![
        M::F64(1.0),
        M::Array(vec![
            // token id does not fit u32
            M::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), M::Array(vec![M::from(1u64)])),
                (s("parent_block_hash"), M::Nil),
                (s("token_ids"), M::Array(vec![M::from(1u64 << 40)])),
                (s("block_size"), M::from(1)),
            ]),
            M::Map(vec![(s("type"), s("AllBlocksCleared"))]),
            // missing block_hashes
            M::Map(vec![(s("type"), s("BlockRemoved"))]),
        ]),
        M::Nil,
    ]));
    let mut stats = DecodeStats::default();
    let b = vllm::decode(&payload, 1, &mut stats).unwrap();
    assert_eq!(b.events, vec![KvEvent::AllCleared]);
    assert_eq!(stats.malformed_events, 2);
    assert_eq!(b.dp_rank, None);
}

#[test]
fn hostile_lengths_and_nesting_are_bounded() {
    // array32 of 4 billion events with no bytes behind it.
    let mut p = vec![
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
    ];
    assert!(matches!(
        vllm::decode(&p, 0, &mut DecodeStats::default()),
        Err(DecodeError::Truncated { .. })
    ));
    // token_ids claiming 4 billion entries.
    p.truncate(10);
    p.extend([0x91, 0x81, 0xa9]);
    p.extend(b"token_ids");
    p.extend([0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]);
    assert!(vllm::decode(&p, 0, &mut DecodeStats::default()).is_err());

    // extra_keys nested 100 000 deep: the event is dropped, no stack overflow.
    let depth = 100_000;
    let mut ev = vec![0x86];
    for (k, v) in [
        ("type", enc(&s("BlockStored"))),
        ("block_hashes", enc(&M::Array(vec![M::from(1u64)]))),
        ("parent_block_hash", enc(&M::Nil)),
        ("token_ids", enc(&M::Array(vec![M::from(1)]))),
        ("block_size", enc(&M::from(1))),
    ] {
        ev.extend(enc(&s(k)));
        ev.extend(v);
    }
    ev.extend(enc(&s("extra_keys")));
    ev.push(0x91);
    ev.extend(std::iter::repeat_n(0x91, depth));
    ev.push(0xc0);
    let mut payload = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
    payload.extend(ev);
    payload.push(0x00);
    let mut stats = DecodeStats::default();
    let b = vllm::decode(&payload, 0, &mut stats).unwrap();
    assert!(b.events.is_empty());
    assert_eq!(stats.malformed_events, 1);
}
