//! kvroute patch: receive limits are enforced on the declared length, before
//! anything is reserved or buffered.

use super::*;

fn limited(frame: Option<usize>, message: Option<usize>, parts: Option<usize>) -> ZmqCodec {
    let mut options = SocketOptions::default();
    if let Some(n) = frame {
        options.max_frame_size(n);
    }
    if let Some(n) = message {
        options.max_message_size(n);
    }
    if let Some(n) = parts {
        options.max_message_parts(n);
    }
    let mut codec = ZmqCodec::with_options(&options);
    codec.state = DecoderState::FrameHeader;
    codec.waiting_for = 1;
    codec
}

fn long_header(more: bool, len: u64) -> Vec<u8> {
    let mut bytes = vec![0b0000_0010 | u8::from(more)];
    bytes.extend_from_slice(&len.to_be_bytes());
    bytes
}

fn frame(more: bool, body: &[u8]) -> Vec<u8> {
    let mut bytes = if body.len() > 255 {
        long_header(more, body.len() as u64)
    } else {
        vec![u8::from(more), body.len() as u8]
    };
    bytes.extend_from_slice(body);
    bytes
}

#[test]
fn huge_declared_frame_is_refused_before_reserving() {
    let mut codec = limited(Some(1 << 20), None, None);
    let mut input = BytesMut::from(long_header(false, 1 << 40).as_slice());
    let error = codec.decode(&mut input).unwrap_err();
    assert!(matches!(
        error,
        CodecError::FrameTooLarge { declared, limit } if declared == 1 << 40 && limit == 1 << 20
    ));
    assert!(error.is_limit_exceeded());
    // Nothing was reserved for the body.
    assert!(input.capacity() < 1 << 20, "capacity {}", input.capacity());
    // The decoder stays refused instead of reading body bytes as headers.
    let mut more = BytesMut::from(&[0u8, 1, 2][..]);
    assert!(matches!(
        codec.decode(&mut more),
        Err(CodecError::Decode(_))
    ));
}

#[test]
fn unlimited_codec_rejects_only_unrepresentable_lengths() {
    // Upstream behaviour is kept without limits: a u64::MAX length still fails.
    let mut codec = limited(None, None, None);
    let mut input = BytesMut::from(long_header(false, u64::MAX).as_slice());
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::Decode(_))
    ));
}

#[test]
fn frames_at_the_limit_pass_and_one_byte_more_fails() {
    let mut codec = limited(Some(300), None, None);
    let mut input = BytesMut::from(frame(false, &[7u8; 300]).as_slice());
    let Message::Message(message) = codec.decode(&mut input).unwrap().unwrap() else {
        panic!("expected a message");
    };
    assert_eq!(message.get(0).map(|b| b.len()), Some(300));
    let mut input = BytesMut::from(frame(false, &[7u8; 301]).as_slice());
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::FrameTooLarge {
            declared: 301,
            limit: 300
        })
    ));
}

#[test]
fn multipart_size_counts_every_part_and_resets_per_message() {
    let mut codec = limited(None, Some(600), None);
    // 3 × 200 = 600 bytes: exactly the limit, twice in a row.
    for _ in 0..2 {
        let mut input = BytesMut::new();
        input.extend_from_slice(&frame(true, &[1u8; 200]));
        input.extend_from_slice(&frame(true, &[2u8; 200]));
        input.extend_from_slice(&frame(false, &[3u8; 200]));
        let Message::Message(message) = codec.decode(&mut input).unwrap().unwrap() else {
            panic!("expected a message");
        };
        assert_eq!(message.len(), 3);
    }
    // A fourth part of one byte would exceed it: refused at its header, with
    // the body of that part never reached.
    let mut input = BytesMut::new();
    for _ in 0..3 {
        input.extend_from_slice(&frame(true, &[1u8; 200]));
    }
    input.extend_from_slice(&[0, 1]);
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::MessageTooLarge {
            size: 601,
            limit: 600
        })
    ));
    assert_eq!(
        input.len(),
        0,
        "the refused part's header was the last byte read"
    );
}

#[test]
fn declared_part_length_counts_before_its_body_arrives() {
    // 8 MiB parts flagged MORE: the third header is refused with 16 MiB
    // buffered, whatever follows.
    let mut codec = limited(Some(16 << 20), Some(16 << 20), None);
    let body = vec![0u8; 8 << 20];
    let mut input = BytesMut::new();
    input.extend_from_slice(&frame(true, &body));
    input.extend_from_slice(&frame(true, &body));
    input.extend_from_slice(&long_header(true, 8 << 20));
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::MessageTooLarge { size, limit }) if size == 24 << 20 && limit == 16 << 20
    ));
}

#[test]
fn empty_parts_are_bounded_by_the_part_limit() {
    let mut codec = limited(None, Some(1 << 20), Some(4));
    let mut input = BytesMut::from([1u8, 0].repeat(4).as_slice());
    input.extend_from_slice(&[0, 0]);
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::TooManyParts { limit: 4 })
    ));
    // Four parts are fine.
    let mut codec = limited(None, None, Some(4));
    let mut input = BytesMut::from([1u8, 0].repeat(3).as_slice());
    input.extend_from_slice(&[0, 0]);
    let Message::Message(message) = codec.decode(&mut input).unwrap().unwrap() else {
        panic!("expected a message");
    };
    assert_eq!(message.len(), 4);
}

#[test]
fn commands_obey_the_frame_limit_only() {
    // A command is one frame: the message limits do not apply, the frame limit does.
    let mut codec = limited(Some(16), Some(1), Some(1));
    let mut input = BytesMut::from(&[0b0000_0110u8][..]);
    input.extend_from_slice(&1000u64.to_be_bytes());
    assert!(matches!(
        codec.decode(&mut input),
        Err(CodecError::FrameTooLarge {
            declared: 1000,
            limit: 16
        })
    ));
}
