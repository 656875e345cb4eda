//! Suggestions for unknown keys and names: the known one closest to what was written, when
//! it is close enough to be a plausible typo, and the fix for top-level keys that people
//! commonly put in the wrong place.

/// Optimal string alignment distance (edits: insert, delete, substitute, swap).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// The most edits a suggestion may be away from what was written.
const MAX_EDITS: usize = 4;

/// Longer keys get no suggestion: no known key is within [`MAX_EDITS`] of them, and
/// the distance costs the product of the two lengths.
const MAX_SUGGESTED_LEN: usize = 64;

/// The known key closest to `key`, if close enough to be a plausible typo.
///
/// Bounded work whatever the input: nothing for keys over [`MAX_SUGGESTED_LEN`]
/// characters, and no distance computed to a known key whose length alone rules it out
/// (the distance is at least the difference in lengths).
pub(super) fn suggest<'k>(key: &str, known: impl IntoIterator<Item = &'k str>) -> Option<&'k str> {
    // Bytes bound characters from above, so a megabyte key is refused without a scan.
    if key.len() > 4 * MAX_SUGGESTED_LEN || key.chars().count() > MAX_SUGGESTED_LEN {
        return None;
    }
    let key = key.to_lowercase();
    let len = key.chars().count();
    let mut best: Option<(usize, &str)> = None;
    for k in known {
        let k_len = k.chars().count();
        let limit = (k_len / 3).clamp(1, MAX_EDITS);
        if len.abs_diff(k_len) > limit {
            continue;
        }
        let d = edit_distance(&key, &k.to_lowercase());
        if d <= limit && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, k));
        }
    }
    best.map(|(_, k)| k)
}

/// Fixes for top-level keys that belong in a section or are named differently. They are
/// used before [`suggest`], which could only propose a top-level key.
pub(super) const MISPLACED: &[(&str, &str)] = &[
    (
        "lr",
        "move it into \"optimizer\": {\"params\": {\"lr\": ...}}",
    ),
    (
        "learning_rate",
        "write it as \"optimizer\": {\"params\": {\"lr\": ...}}",
    ),
    (
        "weight_decay",
        "move it into \"optimizer\": {\"params\": {...}}",
    ),
    ("betas", "move it into \"optimizer\": {\"params\": {...}}"),
    ("loss_scale", "move it into \"fp16\": {...}"),
    ("initial_scale_power", "move it into \"fp16\": {...}"),
    ("loss_scale_window", "move it into \"fp16\": {...}"),
    ("hysteresis", "move it into \"fp16\": {...}"),
    ("min_loss_scale", "move it into \"fp16\": {...}"),
    ("stage", "move it into \"zero_optimization\": {...}"),
    (
        "warmup_num_steps",
        "move it into \"scheduler\": {\"params\": {...}}",
    ),
    (
        "total_num_steps",
        "move it into \"scheduler\": {\"params\": {...}}",
    ),
    (
        "micro_batch_size",
        "did you mean \"train_micro_batch_size_per_gpu\"?",
    ),
    ("batch_size", "did you mean \"train_batch_size\"?"),
    (
        "world_size",
        "the world size comes from the launcher, not the config; remove it",
    ),
];
