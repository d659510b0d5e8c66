//! Where everything lives in a channel's block: the one map of its words and slots.
//!
//! A channel (every queue and pipe) has one [`SharedWords`](crate::shm::SharedWords)
//! block, made by the ring, whose page of 32-bit words is shared by three owners and
//! whose byte area holds the ring's slots. Every offset any of them uses is defined
//! here and nowhere else, so that two owners can never be given the same word:
//!
//! | words | owner | what |
//! |---|---|---|
//! | 0 | `shm::SharedWords` | the block's kind (`ring::KIND`) |
//! | 10–11 | `ring` | `TAIL`: the position of the next record (64 bits, a hint) |
//! | 12 | `ring` | `SEQ`: bumped by every publication; sleeping getters wait on it |
//! | 13 | `ring` | `GET_WAITERS`: getters asleep on `SEQ` |
//! | 16–23 | `custody` | shelf 0: its lock (4 words), `ENTRIES` (+4), `BYTES` (+6, 64 bits) |
//! | 24–31 | `custody` | shelf 1, the same |
//! | 33 | `bounded` | `FREE_PLACES`: places a bounded queue has free |
//! | 36 | `bounded` | `CAPACITY`: a bounded queue's `maxsize` (0: unbounded) |
//! | 37 | `channel` | `FLAVOR`: the queue type that made the channel, which a receiver checks |
//! | 48–49 | `ring` | `HEAD`: the position of the oldest record (64 bits, a hint) |
//! | 64–65 | `ring` | `LANE`: the socket lane's generation and flag (64 bits) |
//! | 66 | `ring` | `LEFT`: bumped by every channel value dropped (a holder leaving) |
//! | 80 | `bounded` | `ITEMS`: messages put and not yet taken (`len`) |
//! | 81 | `bounded` | `UNFINISHED`: a joinable queue's tasks not yet done |
//! | 96 | `bounded` | `PLACE_WAITERS`: putters asleep on `FREE_PLACES` |
//! | 97 | `bounded` | `PLACE_DEBT`: places taken back from putters that timed out |
//!
//! Words 1–9, 14–15, 32, 34–35, 38–47, 50–63, 67–79, 82–95 and 98 up are unused.
//!
//! **Cache lines.** A line is 16 words. What a put and a get both write, and the other
//! side then reads or writes, crosses between their cores once per message at least;
//! the words are laid out so that it crosses no more than that:
//! - `HEAD`, which only getters write, has a line of its own: on the line of `TAIL` and
//!   `SEQ`, which putters write, every get took the line away from the putters and
//!   every put took it back. (`SEQ` stays with `TAIL`: a getter reads it, and a put
//!   writes both.)
//! - `LANE`, which every put and every get reads and only a message too large for the
//!   ring writes, has one with `LEFT` (written when a holder leaves): beside `TAIL`
//!   every get fetched it again after each put.
//! - `FREE_PLACES` has one with `CAPACITY` (never written after the queue is made): a
//!   putter that waits for room polls it, and takes it back from the getter after
//!   every write of the getter's, so the getter writes it once per message and
//!   nothing else there. `ITEMS` and `UNFINISHED` have one, and the words only a
//!   sleeper or a forged packet writes (`PLACE_WAITERS`, `PLACE_DEBT`) another.
//!
//! The byte area after the page is [`SLOTS`] slots of [`SLOT_BYTES`] each: a 64-bit
//! state word (`ring::slots`' protocol), a 32-bit length at [`LENGTH_AT`], and from
//! [`RECORD_AT`] the record (a whole packet).

/// Words of the ring (see the table).
pub(super) const HEAD: usize = 48;
pub(super) const TAIL: usize = 10;
pub(super) const SEQ: usize = 12;
pub(super) const GET_WAITERS: usize = 13;
pub(super) const LANE: usize = 64;
pub(super) const LEFT: usize = 66;

/// The first word of each custody shelf's words: its lock (4 words, a
/// `sync::lock::RawLock`), then [`SHELF_ENTRIES`] and [`SHELF_BYTES`].
pub(super) const SHELF_BASE: [usize; 2] = [16, 24];
/// A shelf's `ENTRIES` word, from its base: about how many packets it holds.
pub(super) const SHELF_ENTRIES: usize = 4;
/// A shelf's `BYTES` (64 bits), from its base: about how many bytes of blocks they hold.
pub(super) const SHELF_BYTES: usize = 6;

/// Words of a queue's counters (see the table).
pub(super) const FREE_PLACES: usize = 33;
pub(super) const CAPACITY: usize = 36;
/// Word of the queue type that made the channel (see `channel::Flavor`): on the line of
/// `CAPACITY`, written once when the queue is made.
pub(crate) const FLAVOR: usize = 37;
pub(super) const ITEMS: usize = 80;
pub(super) const UNFINISHED: usize = 81;
pub(super) const PLACE_WAITERS: usize = 96;
pub(super) const PLACE_DEBT: usize = 97;

/// Slots of the ring, in the block's byte area.
pub(super) const SLOTS: usize = 1024;
/// Bytes of a slot: state word, length, record.
pub(super) const SLOT_BYTES: usize = 256;
/// Where a slot's record length (32 bits) is, from the slot's start.
pub(super) const LENGTH_AT: usize = 8;
/// Where a slot's record starts.
pub(super) const RECORD_AT: usize = 16;

// Every word is on the page, and the slots' fields are in their slot.
const _: () = assert!(
    PLACE_DEBT < crate::shm::FIRST_RESERVED_WORD
        && HEAD + 1 < crate::shm::FIRST_RESERVED_WORD
        && LEFT < crate::shm::FIRST_RESERVED_WORD
        && SHELF_BASE[1] + SHELF_BYTES + 1 < FREE_PLACES
);
const _: () = assert!(LENGTH_AT >= 8 && LENGTH_AT + 4 <= RECORD_AT && RECORD_AT < SLOT_BYTES);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_two_owners_share_a_word_and_everything_fits_the_page() {
        let mut owner = [""; crate::shm::WORDS];
        let mut claim = |first: usize, words: usize, who: &'static str| {
            for (w, slot) in owner.iter_mut().enumerate().skip(first).take(words) {
                assert!(slot.is_empty(), "word {w} is claimed by {slot} and {who}");
                *slot = who;
            }
            assert!(first + words <= crate::shm::WORDS, "{who} is past the page");
        };
        claim(0, 1, "kind");
        claim(
            crate::shm::FIRST_RESERVED_WORD,
            crate::shm::WORDS - crate::shm::FIRST_RESERVED_WORD,
            "the page's holder ids",
        );
        claim(HEAD, 2, "HEAD");
        claim(TAIL, 2, "TAIL");
        claim(SEQ, 1, "SEQ");
        claim(GET_WAITERS, 1, "GET_WAITERS");
        claim(LANE, 2, "LANE");
        claim(LEFT, 1, "LEFT");
        for base in SHELF_BASE {
            claim(base, crate::sync::lock::RAW_LOCK_WORDS, "a shelf's lock");
            claim(base + SHELF_ENTRIES, 1, "a shelf's ENTRIES");
            claim(base + SHELF_BYTES, 2, "a shelf's BYTES");
        }
        for w in [
            FREE_PLACES,
            ITEMS,
            UNFINISHED,
            CAPACITY,
            PLACE_WAITERS,
            PLACE_DEBT,
        ] {
            claim(w, 1, "a counter");
        }
        // The lines (see the module docs): a get writes nothing else on the line of
        // `FREE_PLACES`, which a waiting putter polls, nor on those of `TAIL`/`SEQ` and
        // `LANE`, which every put and get reads.
        let line = |w: usize| w / 16;
        for w in [
            ITEMS,
            UNFINISHED,
            PLACE_WAITERS,
            PLACE_DEBT,
            HEAD,
            LEFT,
            LANE,
            TAIL,
        ] {
            assert_ne!(
                line(w),
                line(FREE_PLACES),
                "word {w} on the line of FREE_PLACES"
            );
        }
        for w in [HEAD, ITEMS, UNFINISHED, LANE] {
            assert_ne!(line(w), line(TAIL), "word {w} on the line of TAIL and SEQ");
        }
        for w in [HEAD, ITEMS, UNFINISHED, PLACE_WAITERS, PLACE_DEBT] {
            assert_ne!(line(w), line(LANE), "word {w} on the line of LANE");
        }
        // 64-bit words are 8-byte aligned.
        for w in [
            HEAD,
            TAIL,
            LANE,
            SHELF_BASE[0] + SHELF_BYTES,
            SHELF_BASE[1] + SHELF_BYTES,
        ] {
            assert_eq!(w % 2, 0, "the 64-bit word at {w} is not 8-byte aligned");
        }
    }
}
