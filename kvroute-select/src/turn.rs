//! The order in which a host decides the requests of one burst
//! ([`burst_turn`]): which wait, and for how long.
//!
//! Requests often arrive in bursts: many at the same instant (a front end
//! flushing a batch, agents fanning out, a trace with whole-millisecond
//! timestamps). Decided in arrival order, a request whose prompt no endpoint
//! holds in particular goes to the cheapest endpoint, which may be the home
//! of a conversation whose next turn is further back in the same burst; that
//! turn then queues behind it at its home or leaves its cache. Deciding the
//! requests that have a home first and the others after them, on a view that
//! holds the first ones' charges, avoids both. Sans-IO: the host waits
//! [`Turn::hold`] on its own timer.

use std::time::Duration;

use crate::load::Deciders;
use crate::scoring::BurstStats;

/// A request's turn within a burst ([`burst_turn`]): how long to hold it,
/// and whether it is then decided in its replica's turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Turn {
    /// Wait this long before deciding (zero: decide now).
    pub hold: Duration,
    /// Decided as part of a burst the replicas decide in order
    /// ([`crate::WithRemote::in_turn`], [`Deciders::ordered`]): a request
    /// without a home in its replica's turn (the view has the lower ranks'
    /// part of the burst, the higher ranks will see its own), a request
    /// with a home at once (what the others place at that instant are
    /// their own requests with a home, each at its home). Either way no
    /// other replica is placing a share of the burst on its zone of the
    /// endpoints meanwhile.
    pub in_turn: bool,
    /// Decided in turn at once for having a home: the others decide their
    /// own requests with a home at the same instant, and those that leave
    /// a busy home go where every view finds it cheapest
    /// ([`Deciders::home`]). Set only with `in_turn`.
    pub home: bool,
}

impl Turn {
    /// No turn: decided at once, expecting the other replicas' parts of a
    /// burst in their zones (outside bursts, with turns and ordering off,
    /// or a request with a home when no replicas take turns).
    pub const NONE: Self = Self {
        hold: Duration::ZERO,
        in_turn: false,
        home: false,
    };
}

/// Other decisions expected within a burst below which nothing is held:
/// requests come nearly one at a time and a hold would only add its wait.
/// For ordering, the other decisions of this decider's own bursts (its mean
/// decisions per burst, [`BurstStats::decisions`], less one); for replica
/// turns, those times the other live replicas (a front end hands every
/// replica the same stream).
pub const TURN_MIN_OTHERS: f64 = 0.5;

/// A request whose best endpoint holds at least this fraction of the blocks
/// past the prefix most endpoints hold has a home: it is never held, since
/// it goes where its cache is whatever the others place (most turns of a
/// conversation are such requests). A prompt whose cached part every
/// endpoint holds (a shared system prompt and a new question) has no home
/// and waits.
pub const TURN_MAX_CACHED: f64 = 0.5;

/// How a host orders the requests of one burst ([`burst_turn`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnConfig {
    /// Requests without a home wait this long in a burst, so that the
    /// burst's requests with a home are placed first. It should exceed the
    /// time over which one burst arrives. Zero: off. Default 1 ms.
    pub order: Duration,
    /// Replica turns: with other replicas live, the replica of rank `k`
    /// holds a request without a home `k · stagger` more, so it decides
    /// after the lower ranks' decisions of the burst have reached it; it
    /// must exceed the time a decision takes to reach the other replicas
    /// (the ordering wait is then at least one stagger, for the same
    /// reason). Zero: no turns (the default; a replica's router sets it).
    pub stagger: Duration,
}

/// [`TurnConfig::order`]'s default.
pub const DEFAULT_BURST_ORDER: Duration = Duration::from_millis(1);

impl Default for TurnConfig {
    fn default() -> Self {
        Self {
            order: DEFAULT_BURST_ORDER,
            stagger: Duration::ZERO,
        }
    }
}

/// The turn of a request ready to be decided now, for a decider among
/// `deciders` (its rank among the live replicas; [`Deciders::ALONE`] for a
/// host routing alone; called only inside a burst, so requests that come one
/// at a time never read it) whose decisions come in bursts as `burst` says
/// (its rule's [`crate::Rule::burst_stats`]).
///
/// Outside bursts there is no turn: decided at once. A request with a home
/// (`home`, called only inside a burst: of the blocks past the prefix most
/// endpoints hold, such as a shared system prompt, the fraction its best
/// endpoint holds, at least [`TURN_MAX_CACHED`]) is never held either. A
/// request without a home waits [`TurnConfig::order`] (at least one stagger
/// with replicas), plus `rank · stagger` when other replicas are deciding
/// parts of the same bursts: the burst is then decided in order on every
/// replica — the requests with a home first, then the rest rank by rank, as
/// one gateway would decide it. With replica turns every decision of the
/// burst is [`Turn::in_turn`] ([`Deciders::ordered`]), the ones with a home
/// included: while they are decided, the others place only their own
/// requests with a home, not a share of the burst on their zones, so a
/// decision expects nothing unseen from them. A request with a home that
/// leaves a busy one would go where the others' leaving ones go, so those
/// ([`Turn::home`], [`Deciders::home`]) rank the other zones in their
/// decider's own order.
///
/// ```
/// use std::time::Duration;
/// use kvroute_select::{burst_turn, BurstStats, Deciders, Turn, TurnConfig};
///
/// let cfg = TurnConfig { order: Duration::from_millis(1), stagger: Duration::from_millis(2) };
/// let bursty = BurstStats { decisions: 3.0, prefill_tokens: 2000.0 };
/// let fresh = || 0.0; // no endpoint holds more of it than the others
/// // Alone: a fresh prompt waits for the burst's requests with a home.
/// let alone = || Deciders::ALONE;
/// let turn = burst_turn(cfg, bursty, alone, fresh);
/// assert_eq!(turn, Turn { hold: Duration::from_millis(1), in_turn: false, home: false });
/// // A conversation's next turn, mostly cached on one endpoint, goes at once.
/// assert_eq!(burst_turn(cfg, bursty, alone, || 0.9), Turn::NONE);
/// // Third of three replicas: after the ranks below it.
/// let third = || Deciders { count: 3, rank: 2, ordered: false, home: false };
/// assert_eq!(
///     burst_turn(cfg, bursty, third, fresh),
///     Turn { hold: Duration::from_millis(2 + 2 * 2), in_turn: true, home: false },
/// );
/// // With a home: at once, and part of the ordered burst.
/// assert_eq!(
///     burst_turn(cfg, bursty, third, || 0.9),
///     Turn { hold: Duration::ZERO, in_turn: true, home: true },
/// );
/// ```
#[must_use]
pub fn burst_turn(
    cfg: TurnConfig,
    burst: BurstStats,
    deciders: impl FnOnce() -> Deciders,
    home: impl FnOnce() -> f64,
) -> Turn {
    let mine = burst.decisions - 1.0;
    // Also for NaN.
    if mine.is_nan() || mine <= 0.0 {
        return Turn::NONE;
    }
    let deciders = deciders();
    let others = mine * f64::from(deciders.count.saturating_sub(1));
    let turns = !cfg.stagger.is_zero() && others >= TURN_MIN_OTHERS;
    // With turns, the burst is the fleet's: ordered across the replicas.
    let order = !cfg.order.is_zero() && (mine >= TURN_MIN_OTHERS || turns);
    if !(turns || order) {
        return Turn::NONE;
    }
    if home() >= TURN_MAX_CACHED {
        return Turn {
            hold: Duration::ZERO,
            in_turn: turns,
            home: turns,
        };
    }
    // With replicas, the requests with a home decided at once elsewhere
    // take up to one stagger to arrive.
    let ordered = match (order, turns) {
        (false, _) => Duration::ZERO,
        (true, false) => cfg.order,
        (true, true) => cfg.order.max(cfg.stagger),
    };
    let ranked = if turns {
        cfg.stagger.saturating_mul(deciders.rank)
    } else {
        Duration::ZERO
    };
    Turn {
        hold: ranked.saturating_add(ordered),
        in_turn: turns,
        home: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn cfg(order: u32, stagger: u32) -> TurnConfig {
        TurnConfig {
            order: MS * order,
            stagger: MS * stagger,
        }
    }

    fn rank(count: u32, rank: u32) -> Deciders {
        Deciders {
            count,
            rank,
            ordered: false,
            home: false,
        }
    }

    const BURSTY: BurstStats = BurstStats {
        decisions: 4.0,
        prefill_tokens: 1000.0,
    };
    const SINGLE: BurstStats = BurstStats {
        decisions: 1.2,
        prefill_tokens: 1000.0,
    };

    fn held(ms: u32, in_turn: bool) -> Turn {
        Turn {
            hold: MS * ms,
            in_turn,
            home: false,
        }
    }

    /// A request with a home, decided at once in turn.
    const HOME: Turn = Turn {
        hold: Duration::ZERO,
        in_turn: true,
        home: true,
    };

    /// `(order ms, stagger ms, burst, deciders, home, expected)`, checked
    /// one by one so a failure names its row.
    type Case = (u32, u32, BurstStats, Deciders, f64, Turn);

    fn check(cases: &[Case]) {
        for (i, &(order, stagger, burst, deciders, home, want)) in cases.iter().enumerate() {
            let got = burst_turn(cfg(order, stagger), burst, || deciders, || home);
            assert_eq!(got, want, "case {i}: {:?}", cases[i]);
        }
    }

    #[test]
    fn alone_only_requests_without_a_home_wait_and_only_in_bursts() {
        let nan = BurstStats {
            decisions: f64::NAN,
            prefill_tokens: 0.0,
        };
        let alone = Deciders::ALONE;
        check(&[
            (1, 0, BURSTY, alone, 0.0, held(1, false)),
            (1, 0, BURSTY, alone, 0.49, held(1, false)),
            (1, 0, BURSTY, alone, 0.5, Turn::NONE),
            (1, 0, SINGLE, alone, 0.0, Turn::NONE),
            (0, 0, BURSTY, alone, 0.0, Turn::NONE),
            // A replica's stagger means nothing alone.
            (1, 2, BURSTY, alone, 0.0, held(1, false)),
            (1, 2, nan, rank(3, 2), 0.0, Turn::NONE),
        ]);
    }

    #[test]
    fn replicas_wait_for_the_lower_ranks_after_the_requests_with_a_home() {
        // Bursts of the fleet's, each replica's share near one request.
        let thin = BurstStats {
            decisions: 1.3,
            prefill_tokens: 1000.0,
        };
        check(&[
            // Ordering on: at least one stagger, then the rank's.
            (1, 2, BURSTY, rank(3, 0), 0.0, held(2, true)),
            (1, 2, BURSTY, rank(3, 2), 0.0, held(6, true)),
            (5, 2, BURSTY, rank(3, 1), 0.0, held(7, true)),
            // Ordering off: the rank's wait alone (rank 0 at once, but
            // without a home).
            (0, 2, BURSTY, rank(3, 0), 0.0, held(0, true)),
            (0, 2, BURSTY, rank(3, 2), 0.0, held(4, true)),
            // A home: at once whatever the rank, part of the ordered
            // burst.
            (1, 2, BURSTY, rank(3, 2), 0.8, HOME),
            (0, 2, BURSTY, rank(3, 1), 0.5, HOME),
            (1, 2, thin, rank(3, 1), 0.0, held(4, true)),
            (1, 2, thin, rank(2, 1), 0.0, Turn::NONE),
            // Turns off: ordering only.
            (1, 0, BURSTY, rank(3, 2), 0.0, held(1, false)),
        ]);
    }

    #[test]
    fn home_and_deciders_are_read_only_when_they_can_matter() {
        let (homes, ranks) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
        let home = || {
            homes.set(homes.get() + 1);
            0.0
        };
        let deciders = || {
            ranks.set(ranks.get() + 1);
            rank(3, 1)
        };
        // One at a time: neither is read.
        let one_at_a_time = BurstStats {
            decisions: 1.0,
            prefill_tokens: 1000.0,
        };
        let _ = burst_turn(cfg(1, 2), one_at_a_time, deciders, home);
        assert_eq!((homes.get(), ranks.get()), (0, 0));
        // In a burst with nothing to wait for: the ranks, not the home.
        let _ = burst_turn(cfg(1, 2), SINGLE, deciders, home);
        let _ = burst_turn(cfg(0, 0), BURSTY, deciders, home);
        assert_eq!((homes.get(), ranks.get()), (0, 2));
        let _ = burst_turn(cfg(1, 0), BURSTY, || Deciders::ALONE, home);
        assert_eq!(homes.get(), 1);
    }
}
