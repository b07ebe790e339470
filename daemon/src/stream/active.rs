//! Which slots of the stream table are in use: one bit per slot, set when a connection takes
//! the slot and cleared when it gives it back.
//!
//! The threads that look at every open stream (the watchdog at each heartbeat, a shutdown, the
//! admin listing) walk this bitmap instead of the whole table, so what they cost depends on
//! how many streams are open, not on `--max-streams`: with 8,192 slots and nothing open a pass
//! reads 128 words instead of 8,192 slots (1.6 MiB of them).
//!
//! A set bit is a hint, the slot's state is the truth: the table sets the bit before it
//! publishes the slot as live and clears it only after the slot is free again, and readers
//! still check the state of every slot they find. So every live slot's bit is set, and a slot
//! whose bit is set but which is free (just released, or not yet published) is skipped.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

/// Bits per word of the bitmap.
const WORD_BITS: u32 = u64::BITS;

/// One bit per slot; bit `i % 64` of word `i / 64` is slot `i`.
#[derive(Debug)]
pub struct ActiveSlots {
    words: Box<[AtomicU64]>,
}

impl ActiveSlots {
    /// A bitmap for `capacity` slots, none in use.
    pub fn new(capacity: u32) -> Self {
        let words = capacity.div_ceil(WORD_BITS);
        ActiveSlots {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Marks slot `idx` in use. Called once per connection, never per token.
    pub fn insert(&self, idx: u32) {
        let (word, bit) = split(idx);
        self.words[word].fetch_or(bit, SeqCst);
    }

    /// Marks slot `idx` free. Called once per connection, never per token.
    pub fn remove(&self, idx: u32) {
        let (word, bit) = split(idx);
        self.words[word].fetch_and(!bit, SeqCst);
    }

    /// Whether any slot is marked in use: the watchdog's idle test (see
    /// [`crate::watchdog::pulse`]). A word at a time, so a slot taken during the read may or
    /// may not be seen; the idle protocol reads it again after it sets its flag.
    pub fn any(&self) -> bool {
        self.words.iter().any(|w| w.load(SeqCst) != 0)
    }

    /// The slots marked in use, in index order; each word is read once, so a slot inserted
    /// or removed during the walk may or may not be seen.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0u32..)
            .zip(self.words.iter())
            .flat_map(|(w, word)| Bits(word.load(SeqCst)).map(move |b| w * WORD_BITS + b))
    }
}

fn split(idx: u32) -> (usize, u64) {
    ((idx / WORD_BITS) as usize, 1u64 << (idx % WORD_BITS))
}

/// The set bits of one word, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_exactly_the_slots_in_use_in_order() {
        let a = ActiveSlots::new(130);
        assert_eq!(a.iter().count(), 0);
        assert!(!a.any());
        for i in [129, 0, 63, 64, 5] {
            a.insert(i);
        }
        assert_eq!(a.iter().collect::<Vec<_>>(), [0, 5, 63, 64, 129]);
        a.remove(63);
        a.remove(0);
        a.remove(0);
        assert_eq!(a.iter().collect::<Vec<_>>(), [5, 64, 129]);
        assert!(a.any());
        for i in [5, 64, 129] {
            a.remove(i);
        }
        assert!(!a.any());
    }

    #[test]
    fn concurrent_claims_and_releases_of_one_word_lose_no_bit() {
        let a = std::sync::Arc::new(ActiveSlots::new(64));
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let a = std::sync::Arc::clone(&a);
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        for i in (t..64).step_by(4) {
                            a.insert(i);
                            a.remove(i);
                        }
                    }
                    // Each thread ends holding its own slots.
                    for i in (t..64).step_by(4) {
                        a.insert(i);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(a.iter().count(), 64);
    }
}
