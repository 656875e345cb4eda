//! The timestamp queries of an open profile (`profile.rs` opens, records and reads
//! them): query sets taken in pairs, and per launch which queries bound it.

use std::time::Instant;

use kiln_engine::device::cost::KernelCost;

pub(crate) const PER_SET: u32 = wgpu::QUERY_SET_MAX_QUERIES;
/// Calibration round trips at `profile_begin`.
pub(crate) const CALIBRATIONS: usize = 3;

pub(crate) struct Profiling {
    pub(crate) sets: Vec<wgpu::QuerySet>,
    /// Queries written so far (two per pass).
    pub(crate) used: u32,
    /// Per launch: what it was and the queries of its start and end. A launch without
    /// passes (a buffer copy) is bounded by the query written before it and a marker
    /// pass's after it.
    pub(crate) launches: Vec<(KernelCost, u32, u32)>,
    /// The last query written, and the first of the launch being recorded.
    pub(crate) last: u32,
    pub(crate) launch_first: Option<u32>,
    /// The calibration pass's start query and the host instants around its submission
    /// and completion.
    pub(crate) calibration: (u32, Instant, Instant),
}

impl Profiling {
    /// The query set and index of the next `n` (2) queries: a set holds whole pairs.
    pub(crate) fn take(&mut self, device: &wgpu::Device, n: u32) -> (wgpu::QuerySet, u32) {
        debug_assert!(
            self.used.is_multiple_of(2) && n == 2,
            "queries are taken in pairs"
        );
        let set = (self.used / PER_SET) as usize;
        if set == self.sets.len() {
            self.sets
                .push(device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("kiln profile"),
                    ty: wgpu::QueryType::Timestamp,
                    count: PER_SET,
                }));
        }
        let index = self.used % PER_SET;
        self.launch_first.get_or_insert(self.used);
        self.used += n;
        self.last = self.used - 1;
        (self.sets[set].clone(), index)
    }
}
