//! ZeroMQ multipart framing of vLLM / SGLang event streams (live PUB messages and
//! ROUTER replay replies). Pure byte-slice parsing; the sockets live elsewhere.

use super::DecodeError;

/// Sequence value of the replay end marker (`ff × 8`, also SGLang's `-1`).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

fn seq_of(frame: &[u8]) -> Result<u64, DecodeError> {
    let b: [u8; 8] = frame.try_into().map_err(|_| DecodeError::BadLayout {
        what: "sequence frame is not 8 bytes",
    })?;
    Ok(u64::from_be_bytes(b))
}

/// One live message from the PUB socket: `[topic, seq (u64 BE), payload]`.
///
/// ```
/// use kvroute_engines::events::LiveMessage;
/// let seq = 5u64.to_be_bytes();
/// let m = LiveMessage::parse(&[b"kv@vllm", &seq, b"\x93"]).unwrap();
/// assert_eq!((m.topic, m.seq), (&b"kv@vllm"[..], 5));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// Topic frame (UTF-8 by convention, empty by default).
    pub topic: &'a [u8],
    /// Publisher sequence number (per process, from 0).
    pub seq: u64,
    /// The msgpack `KVEventBatch`.
    pub payload: &'a [u8],
}

impl<'a> LiveMessage<'a> {
    /// Splits a received multipart message.
    pub fn parse(frames: &[&'a [u8]]) -> Result<Self, DecodeError> {
        match frames {
            [topic, seq, payload] => Ok(Self {
                topic,
                seq: seq_of(seq)?,
                payload,
            }),
            _ => Err(DecodeError::BadLayout {
                what: "live message must have 3 frames",
            }),
        }
    }
}

/// One reply from the replay ROUTER, as a DEALER receives it.
///
/// Accepted shapes (the leading empty delimiter is required):
/// `["", topic, seq, payload]` and end `["", "", ff×8, ""]` (vLLM ≥ 0.26, SGLang ≥
/// 0.5.22); `["", seq, payload]` and end `["", ff×8, ""]` (older). A REQ socket strips
/// the delimiter and sees `[topic, seq, payload]`, which is also accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch.
    Batch(LiveMessage<'a>),
    /// No more buffered batches.
    End,
}

impl<'a> ReplayReply<'a> {
    /// Parses one reply message.
    pub fn parse(frames: &[&'a [u8]]) -> Result<Self, DecodeError> {
        let batch_or_end = |topic: &'a [u8], seq: &'a [u8], payload: &'a [u8]| {
            let seq = seq_of(seq)?;
            Ok(if seq == REPLAY_END_SEQ {
                ReplayReply::End
            } else {
                ReplayReply::Batch(LiveMessage {
                    topic,
                    seq,
                    payload,
                })
            })
        };
        match frames {
            [[], topic, seq, payload] => batch_or_end(topic, seq, payload),
            // Old DEALER form (empty delimiter, no topic) and REQ form (topic, no
            // delimiter) have the same shape; an empty first frame is an empty topic.
            [topic, seq, payload] => batch_or_end(topic, seq, payload),
            _ => Err(DecodeError::BadLayout {
                what: "replay reply must have 3 or 4 frames with a leading delimiter",
            }),
        }
    }
}
