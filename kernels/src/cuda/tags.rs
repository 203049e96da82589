//! The page-tag check on the device: the kernels a step starts with.

use cudarc::driver::{CudaSlice, CudaViewMut, PushKernelArg};

use super::{Gpu, cuda_err, grid_1d as cfg};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Where the tag check's inputs sit in a step's buffer of 32-bit words.
#[derive(Debug, Clone, Default)]
pub struct TagLayout {
    /// Expected tags: two u64 words per table entry (8-byte aligned).
    pub expected: usize,
    /// Block-table entries (page ids).
    pub tables: usize,
    /// Each sequence's first table entry, and the end (sequences + 1).
    pub seq_tab: usize,
    /// Each sequence's first token, and the end; with `lens` and `slots`,
    /// what a failing sequence clears.
    pub tok_off: Option<usize>,
    /// Per-token attention lengths.
    pub lens: Option<usize>,
    /// Per-token KV slots.
    pub slots: Option<usize>,
}

impl Gpu {
    /// The batched page-tag check of one step (see `tag_check` in the
    /// source for the layout of `inputs`): one flag per sequence into
    /// `flags`; a failing sequence's lens and slots are cleared when
    /// `layout.tok_off` is given.
    pub fn tag_check(
        &self,
        inputs: &mut CudaSlice<u32>,
        layout: &TagLayout,
        current: &CudaSlice<u64>,
        flags: &mut CudaViewMut<'_, u32>,
        seqs: usize,
    ) -> R {
        let f = self.function("tag_check")?;
        let w = |x: Option<usize>| x.map_or(-1, |v| v as i32);
        let ints = [
            layout.expected as i32,
            layout.tables as i32,
            layout.seq_tab as i32,
            w(layout.tok_off),
            w(layout.lens),
            w(layout.slots),
        ];
        let mut b = self.stream.launch_builder(f);
        b.arg(inputs);
        for i in &ints {
            b.arg(i);
        }
        b.arg(current).arg(flags);
        // SAFETY: the offsets index `inputs` as the caller laid it out.
        unsafe { b.launch(cfg(seqs as u32, 128)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Applies `n` tag changes (u64 triples page, generation, tenant at word
    /// `at` of `inputs`) to the device's copy of the page tags (two words
    /// per page); entries naming a page past the end are padding.
    pub fn tag_scatter(
        &self,
        inputs: &CudaSlice<u32>,
        at: usize,
        n: usize,
        current: &mut CudaSlice<u64>,
    ) -> R {
        if n == 0 {
            return Ok(());
        }
        let f = self.function("tag_scatter")?;
        let (a, ni, pages) = (at as i32, n as i32, (current.len() / 2) as i64);
        let mut b = self.stream.launch_builder(f);
        b.arg(inputs).arg(&a).arg(&ni).arg(current).arg(&pages);
        // SAFETY: one thread per change, bounds-checked; pages are in range.
        unsafe { b.launch(cfg(n.div_ceil(128) as u32, 128)) }.map_err(cuda_err)?;
        Ok(())
    }
}
