use super::*;
use kvroute_core::EndpointId;
use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying};

use crate::transport::{IndexIngest, SocketRole};

fn builtins() -> [&'static dyn Engine; 4] {
    [&VLLM, &SGLANG, &TRTLLM, &LLAMA_CPP]
}

fn target() -> IngestTarget {
    let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
    IngestTarget::new(
        IndexIngest::share(ingest),
        Arc::new(SharedIndex::new(1, IndexConfig::default())),
    )
}

fn zmq(stream: &Stream) -> &ZmqStream {
    match stream {
        Stream::Zmq(z) => z,
        other => panic!("not a ZeroMQ stream: {other:?}"),
    }
}

#[test]
fn registry_names_aliases_and_unknown_names() {
    let r = builtin();
    for (name, want) in [
        ("vllm", "vllm"),
        ("sglang", "sglang"),
        ("trtllm", "trtllm"),
        ("llama.cpp", "llama.cpp"),
        ("llamacpp", "llama.cpp"),
    ] {
        assert_eq!(r.get(name).unwrap().name(), want);
        assert_eq!(by_name(name).unwrap().name(), want);
    }
    for bad in ["tgi", "VLLM", "", "tensorrt-llm"] {
        let err = by_name(bad).unwrap_err();
        assert_eq!(err.name, bad);
        assert_eq!(err.expected, "vllm, sglang, trtllm or llama.cpp");
        let err = r.get(bad).unwrap_err();
        assert_eq!(err.expected, ["vllm", "sglang", "trtllm", "llama.cpp"]);
    }
    assert_eq!(
        Registry::empty().get("vllm").unwrap_err().to_string(),
        r#"unknown engine "vllm"; expected none (the registry is empty)"#
    );
}

#[derive(Debug)]
struct Named(&'static str, &'static [&'static str]);

impl Engine for Named {
    fn name(&self) -> &str {
        self.0
    }
    fn aliases(&self) -> &[&str] {
        self.1
    }
    fn events_carry_tokens(&self) -> bool {
        false
    }
}

#[test]
fn a_host_registers_its_own_engines_without_shadowing() {
    let mut r = Registry::builtin();
    r.register(Arc::new(Named("sim", &["simulated"]))).unwrap();
    assert_eq!(r.get("simulated").unwrap().name(), "sim");
    assert_eq!(r.names().last(), Some("sim"));
    for clash in [
        Named("vllm", &[]),
        Named("x", &["llamacpp"]),
        Named("y", &["sim"]),
    ] {
        let taken = clash.1.first().copied().unwrap_or(clash.0);
        let err = r.register(Arc::new(clash)).unwrap_err();
        assert_eq!(err.name, taken);
    }
    assert_eq!(r.iter().count(), 5);
    // The built-in registry is not changed by a copy's registrations.
    assert!(builtin().get("sim").is_err());
    // A defaulted engine follows nothing and keeps the text.
    let sim = r.get("sim").unwrap();
    let f = Follow::new("http://h:1", 16).events("tcp://*:5557");
    assert!(sim.streams(&f).unwrap().is_empty());
    assert!(sim.followers(&f, &target()).unwrap().is_empty());
    assert!(sim.kv_events().is_ok());
    assert_eq!(sim.window(&f), SeqWindowConfig::default());
    let body = crate::prompt::parse_json(br#"{"prompt": "x"}"#).unwrap();
    assert_eq!(
        sim.token_ids_equivalent(ApiKind::Completions, &body),
        Err(KeepText::Engine)
    );
    assert_eq!(
        sim.token_ids_equivalent(ApiKind::Chat, &body),
        Err(KeepText::Chat)
    );
}

#[test]
fn window_policy_per_follow_config() {
    let bare = Follow::new("http://10.0.0.7:8000", 16);
    let events = bare.clone().events("tcp://*:5557");
    let replay = events.clone().replay("tcp://*:5558");
    let replay_only = bare.clone().replay("tcp://*:5558");
    let replaying = SeqWindowConfig {
        on_restart: RestartPolicy::Replay,
        ..SeqWindowConfig::default()
    };
    for e in [&VLLM as &dyn Engine, &SGLANG] {
        assert_eq!(e.window(&bare), SeqWindowConfig::default(), "{e:?}");
        assert_eq!(e.window(&events), SeqWindowConfig::default(), "{e:?}");
        assert_eq!(e.window(&replay), replaying, "{e:?}");
        assert_eq!(e.window(&replay_only), SeqWindowConfig::default(), "{e:?}");
    }
    for f in [&bare, &events, &replay] {
        assert_eq!(TRTLLM.window(f), SeqWindowConfig::destructive_drain());
        assert_eq!(LLAMA_CPP.window(f), SeqWindowConfig::default());
    }
}

#[test]
fn dialects_tokens_and_kv_support_of_each_engine() {
    let want = [
        (
            "vllm",
            Some(MetricsDialect::Vllm),
            Dialect::Vllm,
            true,
            true,
            true,
        ),
        (
            "sglang",
            Some(MetricsDialect::Sglang),
            Dialect::Sglang,
            true,
            true,
            true,
        ),
        (
            "trtllm",
            Some(MetricsDialect::TrtllmPrometheus),
            Dialect::Vllm,
            true,
            true,
            false,
        ),
        ("llama.cpp", None, Dialect::Vllm, false, false, false),
    ];
    for (e, (name, metrics, prompt, tokens, kv, zmq)) in builtins().into_iter().zip(want) {
        assert_eq!(e.name(), name);
        assert_eq!(e.metrics_dialect(), metrics, "{name}");
        assert_eq!(e.prompt_dialect(), prompt, "{name}");
        assert_eq!(e.events_carry_tokens(), tokens, "{name}");
        assert_eq!(e.kv_events().is_ok(), kv, "{name}");
        assert_eq!(e.frame_decoder().is_some(), zmq, "{name}");
    }
    let err = LLAMA_CPP.kv_events().unwrap_err().to_string();
    assert!(
        err.starts_with("llama.cpp does not support KV-exact routing"),
        "{err}"
    );
    assert!(err.contains("no KV-cache events") && err.contains("content affinity"));

    let pool = |es: &[&'static dyn Engine]| prompt_dialect_of(es.iter().copied());
    assert_eq!(pool(&[&SGLANG, &SGLANG]), Dialect::Sglang);
    assert_eq!(pool(&[&SGLANG, &VLLM]), Dialect::Vllm);
    assert_eq!(pool(&[&SGLANG, &LLAMA_CPP]), Dialect::Vllm);
    assert_eq!(pool(&[]), Dialect::Vllm);
    let arcs = vec![by_name("sglang").unwrap()];
    assert_eq!(prompt_dialect_of(&arcs), Dialect::Sglang);
}

#[test]
fn zmq_streams_per_rank_with_one_replay_rewrite() {
    let f = Follow::new("http://10.0.0.7:8000/", 16)
        .events("tcp://*:5557")
        .replay("tcp://*:5558")
        .topic("kv")
        .dp_ranks(3);
    let streams = VLLM.streams(&f).unwrap();
    assert_eq!(streams, SGLANG.streams(&f).unwrap());
    assert_eq!(streams.len(), 3);
    for (rank, s) in streams.iter().enumerate() {
        let z = zmq(s);
        let port = 5557 + rank;
        assert_eq!(z.rank as usize, rank);
        assert_eq!(s.rank(), Some(z.rank));
        assert_eq!(s.address(), format!("tcp://10.0.0.7:{port}"));
        assert_eq!(z.endpoint.role, SocketRole::Connect);
        assert_eq!(z.replay, Some(format!("tcp://10.0.0.7:{}", port + 1)));
        assert_eq!(z.topic, "kv");
    }
    // Every wildcard spelling of the replay host is the endpoint's host.
    for wildcard in [
        "tcp://*:6000",
        "tcp://0.0.0.0:6000",
        "tcp://[::]:6000",
        "tcp://:6000",
    ] {
        let f = Follow::new("http://[fd00::7]:8000", 16)
            .events("tcp://*:5557")
            .replay(wildcard);
        let s = VLLM.streams(&f).unwrap();
        assert_eq!(
            zmq(&s[0]).replay.as_deref(),
            Some("tcp://[fd00::7]:6000"),
            "{wildcard}"
        );
        assert_eq!(s[0].address(), "tcp://[fd00::7]:5557");
    }
    // The engine dials us: we bind what it dials.
    let f = Follow::new("http://10.0.0.7:8000", 16).events("tcp://10.0.0.1:5557");
    let s = VLLM.streams(&f).unwrap();
    assert_eq!(
        zmq(&s[0]).endpoint,
        ZmqEndpoint::bind("tcp://10.0.0.1:5557")
    );
    assert_eq!(zmq(&s[0]).replay, None);
}

#[test]
fn what_cannot_be_followed_names_its_field() {
    let field = |r: Result<Vec<Stream>, TransportError>| match r {
        Err(TransportError::Follow { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    let base = Follow::new("http://10.0.0.7:8000", 16);
    assert!(VLLM.streams(&base).unwrap().is_empty());
    assert_eq!(
        field(VLLM.streams(&base.clone().replay("tcp://*:1"))),
        "replay"
    );
    assert_eq!(
        field(VLLM.streams(&base.clone().events("ipc:///kv").dp_ranks(2))),
        "events"
    );
    assert_eq!(
        field(VLLM.streams(&base.clone().events("inproc://kv"))),
        "events"
    );
    assert_eq!(
        field(VLLM.streams(&base.clone().events("tcp://*:1").replay("udp://x:1"))),
        "replay"
    );
    assert_eq!(
        field(SGLANG.streams(&Follow::new("http://:8000", 16).events("tcp://*:1"))),
        "url"
    );
    assert_eq!(
        field(TRTLLM.streams(&base.clone().events("tcp://*:1"))),
        "events"
    );
    assert_eq!(
        field(TRTLLM.streams(&base.clone().replay("tcp://*:1"))),
        "replay"
    );
    assert_eq!(field(TRTLLM.streams(&Follow::new("", 16))), "url");
    assert!(matches!(
        LLAMA_CPP.streams(&base.clone().events("tcp://*:1")),
        Err(TransportError::Unsupported { .. })
    ));
}

#[derive(Debug)]
struct OwnTransport;

impl Engine for OwnTransport {
    fn name(&self) -> &str {
        "own"
    }
    fn events_carry_tokens(&self) -> bool {
        true
    }
    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        Ok(vec![Stream::Other {
            address: format!("{}/events", follow.url),
            rank: Some(0),
        }])
    }
}

#[test]
fn a_stream_of_an_engines_own_transport_is_its_to_follow() {
    let f = Follow::new("http://h:1", 16);
    let s = OwnTransport.streams(&f).unwrap();
    assert_eq!(
        (s[0].address(), s[0].rank()),
        ("http://h:1/events", Some(0))
    );
    let err = OwnTransport.followers(&f, &target()).unwrap_err();
    assert!(matches!(err, TransportError::Unsupported { .. }), "{err}");
    // Its followers, built with Follower::new, are run by the host like any.
    let stream = s[0].clone();
    let follower = Follower::new(stream, Arc::default(), |stop| stop);
    assert_eq!(follower.stream().address(), "http://h:1/events");
    drop(follower.run(std::future::ready(())));
}

#[test]
fn follow_host_parsing() {
    let host = |u: &str| Follow::new(u, 1).host();
    assert_eq!(host("http://10.0.0.7:8000").as_deref(), Some("10.0.0.7"));
    assert_eq!(
        host("http://engine-0.svc:8000/").as_deref(),
        Some("engine-0.svc")
    );
    assert_eq!(host("http://[::1]:8000").as_deref(), Some("::1"));
    assert_eq!(host("http://user@h:1").as_deref(), Some("h"));
    assert_eq!(host("h:1").as_deref(), Some("h"));
    assert_eq!(host("http://:8000"), None);
    assert_eq!(host("http://[::1"), None);
}

#[cfg(all(feature = "zmq", feature = "trtllm-http"))]
#[test]
fn followers_are_built_without_starting_anything() {
    let f = Follow::new("http://127.0.0.1:8000", 16)
        .events("tcp://*:5557")
        .replay("tcp://*:5558")
        .dp_ranks(2);
    let followers = VLLM.followers(&f, &target()).unwrap();
    assert_eq!(followers.len(), 2);
    assert_eq!(followers[1].stream().address(), "tcp://127.0.0.1:5558");
    assert_eq!(followers[0].metrics().snapshot().frames_live, 0);
    let drains = TRTLLM
        .followers(&Follow::new("http://127.0.0.1:8000", 32), &target())
        .unwrap();
    assert_eq!(drains.len(), 1);
    assert_eq!(
        drains[0].stream(),
        &Stream::Drain(DrainStream {
            url: "http://127.0.0.1:8000/kv_cache_events".into(),
            tokens_per_block: 32
        })
    );
    assert!(format!("{:?}", drains[0]).contains("kv_cache_events"));
    assert!(LLAMA_CPP
        .followers(&Follow::new("http://h:1", 16), &target())
        .unwrap()
        .is_empty());
}

#[cfg(not(feature = "zmq"))]
#[test]
fn a_transport_left_out_of_the_build_is_a_clear_error() {
    let f = Follow::new("http://127.0.0.1:8000", 16).events("tcp://*:5557");
    let err = VLLM.followers(&f, &target()).unwrap_err();
    assert!(
        matches!(err, TransportError::NotCompiled { feature: "zmq", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("enable the `zmq` feature"));
}

#[cfg(not(feature = "trtllm-http"))]
#[test]
fn the_drain_left_out_of_the_build_is_a_clear_error() {
    let err = TRTLLM
        .followers(&Follow::new("http://127.0.0.1:8000", 16), &target())
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::NotCompiled {
                feature: "trtllm-http",
                ..
            }
        ),
        "{err}"
    );
}
