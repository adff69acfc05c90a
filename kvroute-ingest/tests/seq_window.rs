//! The window's rules table, one scenario per row, and its counters.

use kvroute_ingest::{
    ClearReason, DropReason, ReplayEnd, RestartPolicy, SeqAction, SeqWindow, SeqWindowConfig,
};

fn window(w: u64, on_restart: RestartPolicy) -> SeqWindow {
    SeqWindow::new(SeqWindowConfig {
        window: w,
        on_restart,
        ..SeqWindowConfig::default()
    })
}

fn feed(w: &mut SeqWindow, seqs: &[u64]) -> Vec<SeqAction> {
    seqs.iter().map(|s| w.on_batch(*s)).collect()
}

#[test]
fn gaps_up_to_the_window_keep_the_inventory_beyond_it_clear() {
    let cfg = SeqWindowConfig::default();
    let mut w = SeqWindow::new(cfg);
    let at_limit = 10 + 1 + cfg.window;
    let actions = feed(&mut w, &[10, at_limit, at_limit + cfg.window + 2]);
    assert_eq!(actions[0], SeqAction::Apply);
    assert_eq!(actions[1], SeqAction::ApplyAfterGap { missed: cfg.window });
    assert_eq!(
        actions[2],
        SeqAction::ClearThenApply(ClearReason::GapBeyondWindow {
            missed: cfg.window + 1
        })
    );
    let c = w.counters();
    assert_eq!(
        (c.first, c.gaps_kept, c.missed_in_kept_gaps, c.gaps_cleared),
        (1, 1, cfg.window, 1)
    );
}

#[test]
fn duplicates_and_old_batches_drop_far_regressions_restart() {
    let mut w = window(8, RestartPolicy::Clear);
    let actions = feed(&mut w, &[100, 101, 101, 95, 92, 101]);
    assert_eq!(actions[2], SeqAction::Drop(DropReason::Duplicate));
    assert_eq!(actions[3], SeqAction::Drop(DropReason::Old));
    // 101 - 92 = 9 > 8: far below means a new publisher process.
    assert_eq!(actions[4], SeqAction::ClearThenApply(ClearReason::Restart));
    // After the restart 92 is the reference: 101 is a kept gap.
    assert_eq!(actions[5], SeqAction::ApplyAfterGap { missed: 8 });
    let c = w.counters();
    assert_eq!((c.duplicates, c.old, c.restarts), (1, 1, 1));
}

#[test]
fn back_to_zero_is_a_restart_unless_replaying() {
    let mut w = window(64, RestartPolicy::Clear);
    assert_eq!(
        feed(&mut w, &[0, 1, 2, 0])[3],
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
    let mut w = window(64, RestartPolicy::Clear);
    let _ = feed(&mut w, &[0, 1, 2]);
    assert_eq!(w.on_bootstrap(), 3);
    assert_eq!(w.on_batch(0), SeqAction::Drop(DropReason::Old));
    w.on_replay_done();
    assert_eq!(
        w.on_batch(0),
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
}

#[test]
fn replay_policy_clears_and_asks_for_the_new_buffer() {
    let mut w = window(4, RestartPolicy::Replay);
    let _ = feed(&mut w, &[50, 51]);
    assert_eq!(w.on_batch(3), SeqAction::ClearThenReplay { from: 0 });
    assert!(w.replaying());
    // The replay starts the stream afresh.
    assert_eq!(
        feed(&mut w, &[1, 2, 3, 2]),
        vec![
            SeqAction::Apply,
            SeqAction::Apply,
            SeqAction::Apply,
            SeqAction::Drop(DropReason::Old),
        ]
    );
    assert_eq!(w.counters().replays_requested, 1);
}

#[test]
fn reconnects_near_keep_far_clear_backwards_restart() {
    let mut w = window(4, RestartPolicy::Clear);
    let _ = feed(&mut w, &[7]);
    w.on_reconnect();
    assert_eq!(w.on_batch(10), SeqAction::ApplyAfterGap { missed: 2 });
    w.on_reconnect();
    assert!(matches!(
        w.on_batch(20),
        SeqAction::ClearThenApply(ClearReason::GapBeyondWindow { .. })
    ));
    w.on_reconnect();
    // Within the window below `last`, but right after a reconnect: a restart.
    assert_eq!(
        w.on_batch(19),
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
    let c = w.counters();
    assert_eq!((c.reconnects, c.near_reconnects, c.restarts), (3, 1, 1));
}

#[test]
fn reconnect_before_any_batch_is_just_a_first_batch() {
    let mut w = window(4, RestartPolicy::Clear);
    w.on_reconnect();
    assert_eq!(w.on_batch(1000), SeqAction::Apply);
    assert_eq!(w.counters().first, 1);
}

#[test]
fn extreme_sequence_numbers_do_not_overflow() {
    // Plausibility limits lifted so that the arithmetic itself is exercised.
    let mut w = SeqWindow::new(SeqWindowConfig {
        window: u64::MAX,
        max_seq: u64::MAX,
        max_jump: u64::MAX,
        ..SeqWindowConfig::default()
    });
    let actions = feed(&mut w, &[u64::MAX, 0, u64::MAX]);
    assert_eq!(actions[1], SeqAction::ClearThenApply(ClearReason::Restart));
    assert_eq!(
        actions[2],
        SeqAction::ApplyAfterGap {
            missed: u64::MAX - 1
        }
    );
}

fn resumed(policy: RestartPolicy) -> SeqWindow {
    let mut w = window(8, policy);
    for (seq, digest) in [(10, 0xa), (11, 0xb)] {
        assert!(w.on_batch_with_digest(seq, digest).applies());
    }
    assert_eq!(w.on_resume(), Some(11));
    w
}

#[test]
fn resume_verified_by_the_replayed_last_batch_keeps_the_inventory() {
    let mut w = resumed(RestartPolicy::Clear);
    assert_eq!(
        w.on_batch_with_digest(11, 0xb),
        SeqAction::Drop(DropReason::Duplicate)
    );
    // The rest of the replay, then live traffic, as usual.
    assert_eq!(w.on_batch_with_digest(12, 0xc), SeqAction::Apply);
    assert_eq!(w.on_replay_finished(true), ReplayEnd::Continue);
    assert_eq!(
        w.on_batch_with_digest(14, 0xe),
        SeqAction::ApplyAfterGap { missed: 1 }
    );
    let c = w.counters();
    assert_eq!(
        (c.resumes, c.resumes_verified, c.resume_restarts, c.restarts),
        (1, 1, 0, 0)
    );
}

#[test]
fn resume_detects_a_restart_that_published_past_our_last_sequence() {
    // A new process numbered a different batch 11: digests differ.
    let mut w = resumed(RestartPolicy::Clear);
    assert_eq!(
        w.on_batch_with_digest(11, 0xbad),
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
    assert_eq!(w.on_batch_with_digest(12, 0xc), SeqAction::Apply);
    // Without the resume check, a small forward gap would have kept the inventory.
    let mut legacy = window(8, RestartPolicy::Clear);
    let _ = feed(&mut legacy, &[10, 11]);
    legacy.on_reconnect();
    assert_eq!(legacy.on_batch(14), SeqAction::ApplyAfterGap { missed: 2 });
    // The publisher no longer has 11 and sends 14 first: unverifiable, cleared.
    let mut w = resumed(RestartPolicy::Clear);
    assert_eq!(
        w.on_batch_with_digest(14, 0xe),
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
    // Older than 11 right after a resume: a new process.
    let mut w = resumed(RestartPolicy::Replay);
    assert_eq!(
        w.on_batch_with_digest(3, 0x3),
        SeqAction::ClearThenReplay { from: 0 }
    );
    assert_eq!(w.on_batch_with_digest(0, 0x0), SeqAction::Apply);
    let c = w.counters();
    assert_eq!((c.resume_restarts, c.restarts), (1, 1));
}

#[test]
fn resume_without_digests_cannot_verify_and_restarts() {
    let mut w = window(8, RestartPolicy::Clear);
    let _ = feed(&mut w, &[10, 11]);
    assert_eq!(w.on_resume(), Some(11));
    assert_eq!(
        w.on_batch(11),
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
}

#[test]
fn an_empty_complete_replay_from_last_is_a_restart_an_incomplete_one_waits() {
    let mut w = resumed(RestartPolicy::Clear);
    assert_eq!(
        w.on_replay_finished(true),
        ReplayEnd::Clear(ClearReason::Restart)
    );
    // The window starts over: the new process's next batch is a first batch.
    assert_eq!(w.on_batch_with_digest(5, 0x5), SeqAction::Apply);
    assert_eq!(w.counters().first, 2);

    let mut w = resumed(RestartPolicy::Replay);
    assert_eq!(
        w.on_replay_finished(true),
        ReplayEnd::ClearThenReplay { from: 0 }
    );
    assert!(w.replaying());

    // Timed out: no evidence; the next batch decides (here: verified).
    let mut w = resumed(RestartPolicy::Clear);
    assert_eq!(w.on_replay_finished(false), ReplayEnd::Continue);
    assert_eq!(
        w.on_batch_with_digest(11, 0xb),
        SeqAction::Drop(DropReason::Duplicate)
    );
    assert_eq!(w.counters().resumes_verified, 1);
}

#[test]
fn resume_before_any_batch_has_nothing_to_verify() {
    let mut w = window(8, RestartPolicy::Clear);
    assert_eq!(w.on_resume(), None);
    assert_eq!(w.on_replay_finished(true), ReplayEnd::Continue);
    assert_eq!(w.on_batch_with_digest(40, 1), SeqAction::Apply);
    assert_eq!(w.counters().resumes, 0);
}

/// One replayed batch at u64::MAX − 1 must not become the high-water
/// mark (before the fix every later live batch was dropped as old or duplicate).
#[test]
fn a_batch_at_u64_extremes_is_dropped_and_the_live_stream_continues() {
    for policy in [RestartPolicy::Clear, RestartPolicy::Replay] {
        let mut w = window(64, policy);
        assert_eq!(w.on_batch(3), SeqAction::Apply);
        for poison in [u64::MAX - 1, u64::MAX, 1 << 50] {
            assert_eq!(w.on_batch(poison), SeqAction::Drop(DropReason::Implausible));
        }
        for seq in 4..22 {
            assert_eq!(w.on_batch(seq), SeqAction::Apply, "{policy:?} seq {seq}");
        }
        assert_eq!(w.last_seq(), Some(21));
        assert_eq!(w.counters().implausible, 3);
        // Also as the very first batch of a stream.
        let mut fresh = window(64, policy);
        assert_eq!(
            fresh.on_batch(u64::MAX - 1),
            SeqAction::Drop(DropReason::Implausible)
        );
        assert_eq!(fresh.on_batch(0), SeqAction::Apply);
    }
}

/// A jump beyond `max_jump` from a single batch is dropped; the same jump
/// confirmed by the next batch is a real one (a long silent cut) and is followed.
#[test]
fn a_far_jump_needs_confirmation_by_its_successor() {
    let mut w = SeqWindow::new(SeqWindowConfig {
        max_jump: 1000,
        ..SeqWindowConfig::default()
    });
    assert_eq!(w.on_batch(10), SeqAction::Apply);
    assert_eq!(w.on_batch(5_000), SeqAction::Drop(DropReason::Implausible));
    // The live stream is unharmed, and the stale candidate is forgotten.
    assert_eq!(w.on_batch(11), SeqAction::Apply);
    assert_eq!(w.on_batch(5_001), SeqAction::Drop(DropReason::Implausible));
    assert_eq!(
        w.on_batch(5_002),
        SeqAction::ClearThenApply(ClearReason::GapBeyondWindow { missed: 4_990 })
    );
    assert_eq!(w.on_batch(5_003), SeqAction::Apply);
    assert_eq!(
        (w.counters().implausible, w.counters().jumps_confirmed),
        (2, 1)
    );
    // Inside the bound a jump is judged as before.
    assert_eq!(
        w.on_batch(5_900),
        SeqAction::ClearThenApply(ClearReason::GapBeyondWindow { missed: 896 })
    );
}

/// An implausible replayed batch during a resume does not consume the
/// verification: the next plausible batch is judged by it.
#[test]
fn an_implausible_batch_does_not_answer_a_resume() {
    let mut w = window(64, RestartPolicy::Clear);
    assert_eq!(w.on_batch_with_digest(7, 0xaa), SeqAction::Apply);
    assert_eq!(w.on_resume(), Some(7));
    assert_eq!(
        w.on_batch_with_digest(u64::MAX - 1, 0xbb),
        SeqAction::Drop(DropReason::Implausible)
    );
    assert_eq!(
        w.on_batch_with_digest(7, 0xaa),
        SeqAction::Drop(DropReason::Duplicate)
    );
    assert_eq!(w.counters().resumes_verified, 1);
}

/// A stream whose first batch is not 0 (a late bootstrap replay
/// or a subscriber started over a warm engine) knows the batches it lacks;
/// gaps add to them, a restart from 0 makes it complete.
#[test]
fn missing_batches_follow_late_starts_gaps_and_restarts() {
    let mut w = window(64, RestartPolicy::Clear);
    assert_eq!(w.missing_batches(), 0);
    assert_eq!(w.on_batch(326), SeqAction::Apply);
    assert_eq!(w.missing_batches(), 326);
    assert_eq!(w.on_batch(330), SeqAction::ApplyAfterGap { missed: 3 });
    assert_eq!(w.missing_batches(), 329);
    w.mark_complete();
    assert_eq!(w.missing_batches(), 0);
    assert!(w.on_batch(500).clears());
    assert_eq!(w.missing_batches(), 500);
    assert_eq!(
        w.on_batch(0),
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
    assert_eq!(w.missing_batches(), 0);
    w.mark_lost();
    assert_eq!(w.missing_batches(), 1);
}
