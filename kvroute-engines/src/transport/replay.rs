#[cfg(feature = "zmq")]
pub use client::request_replay;

#[cfg(feature = "zmq")]
mod client {
    use std::time::Duration;

    use bytes::Bytes;
    use tokio::time::Instant;
    use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

    use crate::events::{LiveMessage, ReplayReply};
    use crate::transport::metrics::SubscriberMetrics;
    use crate::transport::sink::{Frame, FrameSink, FrameSource, ReplayOutcome, SinkAction};

    /// Asks `endpoint`'s ROUTER for every batch with seq ≥ `from_seq` and feeds each
    /// reply for `topic` to `sink` (as [`FrameSource::Replay`]), within `timeout`
    /// overall. Replies larger than `max_message_bytes` are dropped and counted.
    /// A replay request the sink makes while replaying (a replayed batch
    /// proved a restart) ends this replay, unread past that batch, with the
    /// request in [`ReplayOutcome::restart_from`]: the batches after it
    /// follow the ones the new request brings.
    ///
    /// Never fails: errors end the replay early with `completed == false`. The
    /// caller reports the outcome to [`FrameSink::on_replay_done`], also when
    /// the replay could not even be sent.
    ///
    /// The engines' replay protocol (vLLM ≥ 0.9, SGLang): a DEALER sends
    /// `[b"", start_seq]` to the engine's ROUTER and receives every buffered batch with
    /// seq ≥ start, then an end marker (golden/vllm-events/README.md).
    ///
    /// Two reply layouts exist, both accepted:
    ///
    /// | engine version | batch | end marker |
    /// |---|---|---|
    /// | vLLM ≥ 0.26, SGLang ≥ 0.5.22 | `[b"", topic, seq_be8, payload]` | `[b"", b"", ff×8, b""]` |
    /// | older | `[b"", seq_be8, payload]` | `[b"", ff×8, b""]` |
    ///
    /// Only the last `buffer_steps` batches are kept by the engine: a first replayed
    /// seq above the requested one means the start fell out of the buffer — the sink's
    /// sequence window sees that as an ordinary gap.
    ///
    /// Reply parsing is [`crate::events::ReplayReply`]; this function is the DEALER client.
    pub async fn request_replay<S: FrameSink + ?Sized>(
        endpoint: &str,
        topic: &[u8],
        from_seq: u64,
        timeout: Duration,
        max_message_bytes: usize,
        sink: &mut S,
        metrics: &SubscriberMetrics,
    ) -> ReplayOutcome {
        metrics.replay_requested();
        let mut outcome = ReplayOutcome {
            requested_from: from_seq,
            ..ReplayOutcome::default()
        };
        let deadline = Instant::now() + timeout;
        // The same receive limits as the subscriber: a reply declaring more
        // than `max_message_bytes` ends the replay before it is buffered.
        let options = crate::transport::zmq_subscriber::socket_options(max_message_bytes, timeout);
        let mut dealer = DealerSocket::with_options(options);
        match tokio::time::timeout_at(deadline, dealer.connect(endpoint)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(endpoint, error = %e, "replay: connect failed");
                return outcome;
            }
            Err(_) => {
                tracing::warn!(endpoint, "replay: connect timed out");
                return outcome;
            }
        }
        let request = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from_seq.to_be_bytes()),
        ];
        let Ok(request) = ZmqMessage::try_from(request) else {
            return outcome;
        };
        if let Err(e) = dealer.send(request).await {
            tracing::warn!(endpoint, error = %e, "replay: send failed");
            return outcome;
        }
        loop {
            let message = match tokio::time::timeout_at(deadline, dealer.recv()).await {
                Ok(Ok(m)) => m,
                Ok(Err(e)) => {
                    if e.is_limit_exceeded() {
                        metrics.oversized_peer_dropped();
                    }
                    tracing::warn!(endpoint, error = %e, "replay: receive failed");
                    break;
                }
                Err(_) => {
                    tracing::warn!(endpoint, from_seq, "replay: no end marker before timeout");
                    break;
                }
            };
            let size: usize = message.iter().map(|b| b.len()).sum();
            if size > max_message_bytes {
                metrics.oversized(None);
                tracing::warn!(
                    endpoint,
                    size,
                    limit = max_message_bytes,
                    "replay: oversized reply dropped"
                );
                continue;
            }
            let frames: Vec<&[u8]> = message.iter().map(|b| b.as_ref()).collect();
            match ReplayReply::parse(&frames) {
                Ok(ReplayReply::End) => {
                    outcome.completed = true;
                    metrics.replay_completed();
                    break;
                }
                Ok(ReplayReply::Batch(LiveMessage {
                    topic: reply_topic,
                    seq,
                    payload,
                })) => {
                    // Legacy replies carry no topic: accept them for any topic.
                    if !reply_topic.is_empty() && reply_topic != topic {
                        metrics.other_topic();
                        continue;
                    }
                    outcome.batches += 1;
                    let report = sink.on_frame(Frame {
                        topic,
                        seq,
                        payload,
                        source: FrameSource::Replay,
                    });
                    metrics.frame(seq, FrameSource::Replay, &report);
                    metrics.decoded(sink.decode_stats());
                    // A number the sink rejected as implausible (e.g. u64::MAX − 1)
                    // must not become the replay's range: the subscriber drops
                    // live frames inside it as already replayed.
                    if !report.rejected {
                        outcome.first_seq.get_or_insert(seq);
                        outcome.last_seq = Some(seq);
                    }
                    if let SinkAction::Replay { from_seq } = report.action {
                        tracing::debug!(seq, from_seq, "replay: restart found, replaying again");
                        outcome.restart_from = Some(from_seq);
                        break;
                    }
                }
                Err(e) => {
                    metrics.malformed(None);
                    tracing::warn!(endpoint, error = %e, "replay: bad reply");
                }
            }
        }
        outcome
    }
}
