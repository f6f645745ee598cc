//! `torch.topk(largest=True)` as torch's CPU kernel computes it, ties included.
//!
//! The QSA indexer's block scores are relu sums, so runs of exactly equal scores (0)
//! are common and the top-k boundary often falls inside one; which blocks a query
//! attends to is then decided by torch's tie rule, and a different rule changes the
//! logits (REFERENCE_NOTES.md measures 2.8 on the toy). No simple rule ("lowest index
//! first") is equivalent, so this is a line-by-line port of what torch runs:
//! `at::native::topk_impl_loop` builds `(value, index)` pairs in index order with the
//! comparator "a before b iff a is NaN and b is not, or a.value > b.value", then
//! - when `k · 64 ≤ n`: libstdc++ `std::partial_sort` (heap select over the first
//!   `k`, then `sort_heap`);
//! - otherwise: libstdc++ `std::nth_element` (introselect: depth limit `2·⌊log2 n⌋`,
//!   median-of-three pivot moved to the front, unguarded Hoare partition, heap select
//!   on depth exhaustion, insertion sort of the last ≤ 3), then `std::sort` of the
//!   first `k − 1`.
//!
//! This is torch on Linux (libstdc++). libc++ (macOS wheels) and CUDA order ties
//! differently; the goldens were made on Linux CPU.
//!
//! Everything is comparisons and moves of pairs: no arithmetic on the values, so the
//! selection is exact for any f32 input, NaN included.

#[derive(Clone, Copy, Debug)]
struct Pair {
    value: f32,
    index: usize,
}

/// torch's comparator: `a` sorts before `b`. A strict weak order (NaN above every
/// number, equal values equivalent), which the unguarded loops below rely on.
#[inline]
fn before(a: Pair, b: Pair) -> bool {
    (a.value.is_nan() && !b.value.is_nan()) || a.value > b.value
}

/// libstdc++ `std::__adjust_heap` on `q[first..first + len]`, then `__push_heap`.
fn adjust_heap(q: &mut [Pair], first: usize, mut hole: usize, len: usize, value: Pair) {
    let top = hole;
    let mut child = hole;
    if len >= 1 {
        while child < (len - 1) / 2 {
            child = 2 * (child + 1);
            if before(q[first + child], q[first + child - 1]) {
                child -= 1;
            }
            q[first + hole] = q[first + child];
            hole = child;
        }
    }
    if len >= 2 && len.is_multiple_of(2) && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        q[first + hole] = q[first + child - 1];
        hole = child - 1;
    }
    while hole > top {
        let parent = (hole - 1) / 2;
        if !before(q[first + parent], value) {
            break;
        }
        q[first + hole] = q[first + parent];
        hole = parent;
    }
    q[first + hole] = value;
}

/// libstdc++ `std::__make_heap` on `q[first..last]`.
fn make_heap(q: &mut [Pair], first: usize, last: usize) {
    let len = last - first;
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let value = q[first + parent];
        adjust_heap(q, first, parent, len, value);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// libstdc++ `std::__pop_heap`: the heap top of `q[first..last]` goes to `result`.
fn pop_heap(q: &mut [Pair], first: usize, last: usize, result: usize) {
    let value = q[result];
    q[result] = q[first];
    adjust_heap(q, first, 0, last - first, value);
}

/// libstdc++ `std::__heap_select`.
fn heap_select(q: &mut [Pair], first: usize, middle: usize, last: usize) {
    make_heap(q, first, middle);
    for i in middle..last {
        if before(q[i], q[first]) {
            pop_heap(q, first, middle, i);
        }
    }
}

/// libstdc++ `std::__move_median_to_first`.
fn median_to_first(q: &mut [Pair], result: usize, a: usize, b: usize, c: usize) {
    let m = if before(q[a], q[b]) {
        if before(q[b], q[c]) {
            b
        } else if before(q[a], q[c]) {
            c
        } else {
            a
        }
    } else if before(q[a], q[c]) {
        a
    } else if before(q[b], q[c]) {
        c
    } else {
        b
    };
    q.swap(result, m);
}

/// libstdc++ `std::__unguarded_partition` of `q[first..last]` around `q[pivot]`
/// (the pivot sits just before the range). The scans stop at the pivot's equals,
/// which bound them because the median of three is in the range.
fn partition(q: &mut [Pair], mut first: usize, mut last: usize, pivot: usize) -> usize {
    loop {
        while before(q[first], q[pivot]) {
            first += 1;
        }
        last -= 1;
        while before(q[pivot], q[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        q.swap(first, last);
        first += 1;
    }
}

/// libstdc++ `std::__insertion_sort` (stable for a strict weak order).
fn insertion_sort(q: &mut [Pair], first: usize, last: usize) {
    for i in first + 1..last.max(first + 1) {
        let val = q[i];
        if before(val, q[first]) {
            q.copy_within(first..i, first + 1);
            q[first] = val;
        } else {
            let mut j = i;
            while before(val, q[j - 1]) {
                q[j] = q[j - 1];
                j -= 1;
            }
            q[j] = val;
        }
    }
}

/// libstdc++ `std::sort` threshold: ranges up to this length are insertion-sorted.
const SORT_THRESHOLD: usize = 16;

/// The indices `torch.topk(values, k).indices` returns on Linux CPU, in its order.
///
/// The set is exactly torch's. The order is torch's too, except among equal values
/// in the `nth_element` branch when `k − 1 > 16` (torch's `std::sort` introsort is not
/// stable there; this sorts stably); callers that need a set sort the result.
/// `k` larger than `values.len()` is clamped (torch refuses it).
pub fn torch_topk(values: &[f32], k: usize) -> Vec<usize> {
    let n = values.len();
    let k = k.min(n);
    if k == 0 {
        return Vec::new();
    }
    let mut q: Vec<Pair> = values
        .iter()
        .enumerate()
        .map(|(index, &value)| Pair { value, index })
        .collect();
    if k * 64 <= n {
        // std::partial_sort(first, first + k, last).
        heap_select(&mut q, 0, k, n);
        let mut last = k;
        while last > 1 {
            last -= 1;
            pop_heap(&mut q, 0, last, last);
        }
    } else {
        // std::nth_element(first, first + k - 1, last).
        let (mut first, mut last, nth) = (0usize, n, k - 1);
        let mut depth = 2 * n.ilog2() as usize;
        let mut selected = false;
        while last - first > 3 {
            if depth == 0 {
                heap_select(&mut q, first, nth + 1, last);
                q.swap(first, nth);
                selected = true;
                break;
            }
            depth -= 1;
            let mid = first + (last - first) / 2;
            median_to_first(&mut q, first, first + 1, mid, last - 1);
            let cut = partition(&mut q, first + 1, last, first);
            if cut <= nth {
                first = cut;
            } else {
                last = cut;
            }
        }
        if !selected {
            insertion_sort(&mut q, first, last);
        }
        // std::sort(first, first + k - 1): only reorders the set.
        let head = &mut q[..k - 1];
        if head.len() <= SORT_THRESHOLD {
            let len = head.len();
            insertion_sort(head, 0, len);
        } else {
            head.sort_by(|a, b| {
                if before(*a, *b) {
                    std::cmp::Ordering::Less
                } else if before(*b, *a) {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            });
        }
    }
    q[..k].iter().map(|p| p.index).collect()
}

/// The blocks a query attends to: torch's top-`min(kb, n)` of its scores, as an
/// ascending set.
pub fn select_blocks(scores: &[f32], block_topk: usize) -> Vec<usize> {
    let mut sel = torch_topk(scores, block_topk.min(scores.len()));
    sel.sort_unstable();
    sel
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The golden file's cases: `torch.topk` on tie-heavy vectors (both branches).
    #[derive(serde::Deserialize)]
    struct Case {
        values: Vec<f32>,
        k: usize,
        n: usize,
        path: String,
        indices: Vec<usize>,
    }

    fn cases() -> Vec<Case> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/flashnext_toy/golden/topk_ties.json"
        );
        serde_json::from_slice(&std::fs::read(path).expect("read topk_ties.json"))
            .expect("parse topk_ties.json")
    }

    #[test]
    fn every_golden_tie_vector_selects_torchs_set_and_order() {
        let cases = cases();
        assert_eq!(cases.len(), 32);
        let mut branches = std::collections::BTreeSet::new();
        for (i, c) in cases.iter().enumerate() {
            assert_eq!(c.values.len(), c.n, "case {i}");
            let got = torch_topk(&c.values, c.k);
            let mut gs = got.clone();
            let mut ws = c.indices.clone();
            gs.sort_unstable();
            ws.sort_unstable();
            assert_eq!(gs, ws, "case {i} ({}, n {}, k {}): set", c.path, c.n, c.k);
            // The order is torch's in the partial_sort branch and, for k − 1 ≤ 16,
            // in the nth_element branch too (std::sort is an insertion sort there).
            if c.path == "partial_sort" || c.k - 1 <= SORT_THRESHOLD {
                assert_eq!(got, c.indices, "case {i} ({}): order", c.path);
            }
            branches.insert(c.path.clone());
        }
        // Both of torch's branches are covered, and the rule chosen agrees.
        assert_eq!(branches.len(), 2);
        for c in &cases {
            let partial = c.k * 64 <= c.n;
            assert_eq!(partial, c.path == "partial_sort", "n {} k {}", c.n, c.k);
        }
    }

    #[test]
    fn the_notes_examples_drop_the_block_torch_drops() {
        // REFERENCE_NOTES.md: layer 7, query 38 of the long prompt drops block 1, where
        // lowest-index-first would drop block 5.
        let s = [0.0, 0.0, 0.36, 10.7, 10.9, 0.0, 0.036, 8.06, 0.34];
        let mut got = torch_topk(&s, 8);
        got.sort_unstable();
        assert_eq!(got, vec![0, 2, 3, 4, 5, 6, 7, 8]);
        // Eight zeros and one positive score, k = 8: index 3 is dropped.
        let mut s = [0.0f32; 9];
        s[8] = 0.74;
        let mut got = torch_topk(&s, 8);
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn distinct_values_give_the_k_largest_in_descending_order() {
        let v: Vec<f32> = (0..300).map(|i| ((i * 7919) % 301) as f32).collect();
        for k in [1, 2, 3, 4, 5, 10, 17, 64, 299, 300] {
            let got = torch_topk(&v, k);
            let mut want: Vec<usize> = (0..v.len()).collect();
            want.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
            // nth_element leaves the k-th in place, after the k − 1 sorted ones.
            assert_eq!(got, want[..k], "k {k}");
        }
    }

    #[test]
    fn nan_ranks_above_numbers_and_degenerate_inputs_do_not_panic() {
        let v = [1.0, f32::NAN, 3.0, f32::NAN, -1.0];
        let mut got = torch_topk(&v, 2);
        got.sort_unstable();
        assert_eq!(got, vec![1, 3]);
        assert!(torch_topk(&[], 3).is_empty());
        assert!(torch_topk(&[1.0], 0).is_empty());
        assert_eq!(torch_topk(&[1.0, 2.0], 5).len(), 2);
        let all_nan = [f32::NAN; 200];
        assert_eq!(torch_topk(&all_nan, 3).len(), 3);
        let zeros = [0.0f32; 1000];
        assert_eq!(torch_topk(&zeros, 10).len(), 10);
        assert_eq!(torch_topk(&zeros, 999).len(), 999);
    }
}
