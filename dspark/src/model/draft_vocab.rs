//! A draft vocabulary: the subset of the target's tokens a draft may propose.
//!
//! A DSpark round spends much of its memory traffic on the vocabulary: the LM-head rows that make
//! the block's base logits (0.62 GB in FP8 for Qwen3-8B, read once a round) and the Markov head's
//! `W2` (read once per step). Restricted to the tokens that actually occur in text, the draft
//! reads a fraction of those rows (the idea of frequency-ranked drafting, FR-Spec, and of
//! EAGLE-3's draft-to-target table). Verification is untouched: the draft's proposal `q` is the
//! softmax over the subset, zero elsewhere, which is exactly the distribution it samples from,
//! so rejection sampling against the target's `p` keeps the output distribution the target's.
//! A token outside the subset can still be emitted (by the target, as a correction or bonus); it
//! only can never be drafted, which lowers acceptance where such tokens are likely.

use crate::error::{Error, Result};

/// The sorted, distinct token ids a draft may propose, a subset of `0..vocab_size`.
///
/// Its length is a multiple of [`DraftVocab::MULTIPLE`] (or the whole vocabulary): the LM-head
/// and `W2` products run on kernels that tile the output by 16 to 64 rows, so a requested set is
/// filled up with the lowest ids it lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftVocab {
    ids: Vec<u32>,
    vocab_size: usize,
}

impl DraftVocab {
    /// The subset's length is rounded up to a multiple of this.
    pub const MULTIPLE: usize = 64;

    /// The given ids (any order, repeats allowed), filled up to a multiple of
    /// [`Self::MULTIPLE`] with the lowest ids not among them.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when no id is given, or one is outside `0..vocab_size`.
    pub fn new(ids: impl IntoIterator<Item = u32>, vocab_size: usize) -> Result<Self> {
        let mut ids: Vec<u32> = ids.into_iter().collect();
        if ids.is_empty() {
            return Err(Error::InvalidInput("a draft vocabulary needs at least one token".into()));
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(Error::InvalidInput(format!(
                "draft vocabulary: token {bad} is outside the vocabulary (0..{vocab_size})"
            )));
        }
        ids.sort_unstable();
        ids.dedup();
        let want = ids.len().next_multiple_of(Self::MULTIPLE).min(vocab_size);
        if ids.len() < want {
            let mut fill = Vec::with_capacity(want - ids.len());
            let mut have = ids.iter().peekable();
            for t in 0..vocab_size as u32 {
                if fill.len() + ids.len() == want {
                    break;
                }
                if have.peek() == Some(&&t) {
                    have.next();
                } else {
                    fill.push(t);
                }
            }
            ids.extend(fill);
            ids.sort_unstable();
        }
        Ok(Self { ids, vocab_size })
    }

    /// The first `count` ids, `0..count`. For byte-level BPE vocabularies such as Qwen's, ids
    /// follow the merge order, and early merges are the frequent pieces of the tokenizer's
    /// training text: a corpus-free approximation of [`Self::most_frequent`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `count` is 0 or exceeds `vocab_size`.
    pub fn leading(count: usize, vocab_size: usize) -> Result<Self> {
        if count == 0 || count > vocab_size {
            return Err(Error::InvalidInput(format!(
                "draft vocabulary of {count} tokens: it takes 1..={vocab_size}"
            )));
        }
        Self::new(0..count as u32, vocab_size)
    }

    /// The `count` ids with the largest counts (`counts[t]`: how often token `t` occurs in text
    /// like the traffic to serve; ties go to the lower id). The vocabulary is `counts.len()`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `count` is 0 or exceeds the vocabulary.
    pub fn most_frequent(counts: &[u64], count: usize) -> Result<Self> {
        if count == 0 || count > counts.len() {
            return Err(Error::InvalidInput(format!(
                "draft vocabulary of {count} tokens: it takes 1..={}",
                counts.len()
            )));
        }
        let mut order: Vec<u32> = (0..counts.len() as u32).collect();
        order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        order.truncate(count);
        Self::new(order, counts.len())
    }

    /// The ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// How many ids the draft may propose.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Never true: a draft vocabulary holds at least one token.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The target vocabulary's size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether the draft may propose `token`.
    pub fn contains(&self, token: u32) -> bool {
        self.ids.binary_search(&token).is_ok()
    }

    /// For every target token, its index in the subset, or [`Self::len`] when absent (the
    /// index of the −∞ column [`Self::expand_row`] and the device pass append).
    pub(crate) fn target_to_draft(&self) -> Vec<i64> {
        let mut out = vec![self.ids.len() as i64; self.vocab_size];
        for (i, &t) in self.ids.iter().enumerate() {
            out[t as usize] = i as i64;
        }
        out
    }

    /// A row over the subset spread over the whole vocabulary: −∞ where the draft may not
    /// propose (probability zero in any softmax, never an argmax).
    pub(crate) fn expand_row(&self, row: &[f32], out: &mut Vec<f32>) {
        out.clear();
        out.resize(self.vocab_size, f32::NEG_INFINITY);
        for (&t, &x) in self.ids.iter().zip(row) {
            out[t as usize] = x;
        }
    }

    /// Rows of `row.len() / len` values over the subset, each spread over the vocabulary.
    pub(crate) fn expand_rows(&self, rows: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows.len() / self.ids.len() * self.vocab_size);
        let mut one = Vec::new();
        for row in rows.chunks(self.ids.len()) {
            self.expand_row(row, &mut one);
            out.extend_from_slice(&one);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ids_are_sorted_distinct_and_filled_to_a_multiple() {
        let v = DraftVocab::new([90, 3, 3, 7], 200).unwrap();
        assert_eq!(v.len(), 64);
        assert!(v.ids().windows(2).all(|w| w[0] < w[1]));
        // The three given, then the lowest others: 0..=62 without 3 and 7 is 61 ids.
        assert!(v.contains(90) && v.contains(3) && v.contains(7) && v.contains(62));
        assert!(!v.contains(63) && !v.contains(91));
        // Never more than the vocabulary.
        assert_eq!(DraftVocab::new([5], 40).unwrap().len(), 40);
        let exact = DraftVocab::leading(128, 1000).unwrap();
        assert_eq!(exact.ids(), (0..128).collect::<Vec<u32>>().as_slice());
    }

    #[test]
    fn bad_requests_are_errors() {
        assert!(DraftVocab::new([], 10).is_err());
        assert!(DraftVocab::new([10], 10).is_err());
        assert!(DraftVocab::leading(0, 10).is_err());
        assert!(DraftVocab::leading(11, 10).is_err());
        assert!(DraftVocab::most_frequent(&[1, 2], 3).is_err());
    }

    #[test]
    fn most_frequent_takes_the_largest_counts_and_lower_ids_on_ties() {
        let mut counts = vec![0u64; 300];
        for (t, c) in [(250, 9), (12, 9), (100, 5), (7, 1)] {
            counts[t] = c;
        }
        let v = DraftVocab::most_frequent(&counts, 3).unwrap();
        assert!(v.contains(250) && v.contains(12) && v.contains(100) && v.len() == 64);
        // The filler comes from the lowest ids, not from the ranking.
        assert!(v.contains(0) && v.contains(61) && !v.contains(62));
        let counted = DraftVocab::most_frequent(&counts, 64).unwrap();
        assert!(counted.contains(7), "every counted token fits in 64");
    }

    #[test]
    fn rows_expand_with_minus_infinity_outside() {
        let v = DraftVocab::new((0..64).map(|i| 2 * i), 130).unwrap();
        let map = v.target_to_draft();
        assert_eq!((map[0], map[1], map[4], map[129]), (0, 64, 2, 64));
        let row: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let wide = v.expand_rows(&[row.clone(), row].concat());
        assert_eq!(wide.len(), 260);
        assert_eq!((wide[2], wide[3], wide[130 + 126]), (1.0, f32::NEG_INFINITY, 63.0));
    }
}
