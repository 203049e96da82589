//! cuBLASLt's bf16 algorithms timed on decode's products (17-256 rows) with
//! the weights out of L2, as in a decode step (every layer's weights evict
//! the others'): `cuda_bench bf16lt` prints them against
//! `cublasGemmEx`'s own choice, and [`Gpu::tune_bf16`] keeps the fastest
//! where it wins, for the engine's products at that shape.

use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys as drv};
use half::bf16;

use super::fp8_tune::{LtConfig, LtTiming};
use super::lt::{Bf16Out, Descs, Lt, Operands, Tuned, poisoned};
use super::shape::GemmShape;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Rounds of launches over every weight copy that one timing averages.
const ROUNDS: usize = 4;

/// Bytes of weight copies a tuned product rotates over: several times L2
/// (50-60 MB on Hopper). A weight of half this or more is read in place.
const ROTATION_BYTES: usize = 256 << 20;

/// Most copies of one weight: a small weight's launches are short, and
/// thousands of them would make tuning slow (sixteen 8 MB copies, the k
/// and v parts of Llama-3-8B, still overflow L2).
const MOST_COPIES: usize = 16;

/// How much faster than `cublasGemmEx` an algorithm must be for the
/// engine to keep it (its time over GemmEx's): closer than this, the
/// timings' spread decides.
pub const TUNE_KEEP_BELOW: f64 = 0.97;

/// What [`Gpu::tune_bf16`] times and keeps.
#[derive(Clone, Copy, Debug)]
pub struct TuneBf16<'a> {
    /// Activation rows to tune at.
    pub rows: &'a [usize],
    /// cuBLASLt's algorithms to time, its best guess first.
    pub candidates: usize,
    /// Keep the fastest where its time over `cublasGemmEx`'s is below this
    /// ([`TUNE_KEEP_BELOW`]; infinite keeps it always, for tests of the
    /// tuned path).
    pub keep_below: f64,
    /// The output type the product writes.
    pub out: Bf16Out,
}

/// What tuning found for one product at one row count.
#[derive(Clone, Copy, Debug)]
pub struct Bf16Tuning {
    /// The product's shape.
    pub shape: GemmShape,
    /// Microseconds a `cublasGemmEx` launch.
    pub gemmex_us: f64,
    /// Microseconds a launch of cuBLASLt's fastest algorithm, and which.
    pub best: LtTiming,
    /// Whether the product now runs that algorithm.
    pub kept: bool,
}

impl Gpu {
    /// Microseconds a launch of `cublasGemmEx` (the engine's bf16 path),
    /// then of each of cuBLASLt's first `count` algorithms, for `out (m x
    /// n) = x (m x k) * w^T` with f32 output. Launch `i` reads
    /// `weights[i % len]`: copies of one weight that together overflow L2,
    /// so each launch streams its weights from memory. Not for use while
    /// the stream is captured (it waits on events).
    pub fn bf16_lt_timings(
        &self,
        weights: &[CudaSlice<bf16>],
        x: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        shape: GemmShape,
        count: usize,
    ) -> R<(f64, Vec<LtTiming>)> {
        let GemmShape { m, n, k } = shape;
        if weights.is_empty()
            || weights.iter().any(|w| w.len() < n * k)
            || x.len() < m * k
            || out.len() < m * n
        {
            return Err(KernelError::Shape(format!(
                "bf16 GEMM of {m} x {k} by {n} rows: no weights or buffers too small"
            )));
        }
        let guards: Vec<_> = weights.iter().map(|w| w.device_ptr(&self.stream)).collect();
        let ws: Vec<u64> = guards.iter().map(|g| g.0).collect();
        let (xp, _rx) = x.device_ptr(&self.stream);
        let (op, _ro) = out.device_ptr_mut(&self.stream);
        // SAFETY: sizes checked above, guards held until the stream syncs.
        let (ex, found) = unsafe { self.time_bf16(&ws, xp, op, (shape, Bf16Out::F32), count) }?;
        self.stream.synchronize().map_err(cuda_err)?;
        Ok((ex, found.into_iter().map(|(t, _)| t).collect()))
    }

    /// Tunes the product of bf16 weight rows `row0..row0 + shape.n` of `w`
    /// (rows of `shape.k`) at each of `tune.rows` activation rows: times
    /// `cublasGemmEx` and cuBLASLt's first `tune.candidates` algorithms
    /// with the weights out of L2 (on up to 16 copies of them, or in place
    /// for a large weight; a weight under ~3 MB stays in L2), and where
    /// the fastest is fast enough (`tune.keep_below`),
    /// [`Self::gemm_bf16_cublas`] (f32 out) or [`Self::matmul_bf16_out`]
    /// (bf16 out) runs it at that shape from then on. Not for use while the
    /// stream is captured.
    pub fn tune_bf16(
        &self,
        w: &CudaSlice<bf16>,
        row0: usize,
        shape: GemmShape,
        tune: TuneBf16<'_>,
    ) -> R<Vec<Bf16Tuning>> {
        let GemmShape { n, k, .. } = shape;
        let TuneBf16 {
            rows,
            candidates: count,
            keep_below,
            out: out_ty,
        } = tune;
        let m_most = rows.iter().copied().max().unwrap_or(0);
        let len = n * k;
        if w.len() < (row0 + n) * k || len == 0 {
            return Err(KernelError::Shape(format!(
                "rows {row0}..{} of {k}: weight too small",
                row0 + n
            )));
        }
        let s = &self.stream;
        let part = w.slice(row0 * k..(row0 + n) * k);
        let copies = if 2 * len * 2 >= ROTATION_BYTES {
            vec![]
        } else {
            let mut v = Vec::new();
            for _ in 0..ROTATION_BYTES.div_ceil(len * 2).min(MOST_COPIES) {
                let mut c: CudaSlice<bf16> = s.alloc_zeros(len).map_err(cuda_err)?;
                s.memcpy_dtod(&part, &mut c).map_err(cuda_err)?;
                v.push(c);
            }
            v
        };
        // Activations: the weight's own values, nonzero like real ones.
        let mut x: CudaSlice<bf16> = s.alloc_zeros(m_most * k).map_err(cuda_err)?;
        s.memcpy_dtod(
            &w.slice(..(m_most * k).min(w.len())),
            &mut x.slice_mut(..(m_most * k).min(w.len())),
        )
        .map_err(cuda_err)?;
        let mut out: CudaSlice<f32> = s.alloc_zeros(m_most * n).map_err(cuda_err)?;
        let guards: Vec<_> = copies.iter().map(|c| c.device_ptr(s)).collect();
        let (pp, _rp) = part.device_ptr(s);
        let ws: Vec<u64> = if guards.is_empty() {
            vec![pp]
        } else {
            guards.iter().map(|g| g.0).collect()
        };
        let (xp, _rx) = x.device_ptr(s);
        let (op, _ro) = out.device_ptr_mut(s);
        let mut found = Vec::with_capacity(rows.len());
        for &m in rows {
            let shape = GemmShape { m, n, k };
            // SAFETY: every buffer holds `m_most` rows, guards held until
            // the stream syncs.
            let (ex, timed) = unsafe { self.time_bf16(&ws, xp, op, (shape, out_ty), count) }?;
            let Some((best, algo)) = timed
                .into_iter()
                .filter(|(t, _)| t.us.is_finite())
                .min_by(|a, b| a.0.us.total_cmp(&b.0.us))
            else {
                // Nothing ran: nothing kept from an earlier tuning either.
                let mut guard = self.lt.lock().map_err(|_| poisoned())?;
                Lt::get(&mut guard, self)?.bf16.remove(&(m, n, k, out_ty));
                continue;
            };
            let kept = best.us < keep_below * ex;
            let mut guard = self.lt.lock().map_err(|_| poisoned())?;
            let lt = Lt::get(&mut guard, self)?;
            if kept {
                let descs = bf16_descs(shape, out_ty)?;
                lt.bf16.insert((m, n, k, out_ty), Tuned { descs, algo });
            } else {
                lt.bf16.remove(&(m, n, k, out_ty));
            }
            found.push(Bf16Tuning {
                shape,
                gemmex_us: ex,
                best,
                kept,
            });
        }
        // Freed in stream order before the wait, so the memory is back when
        // this returns.
        drop((guards, _rp, _rx, _ro));
        drop((copies, x, out));
        s.synchronize().map_err(cuda_err)?;
        Ok(found)
    }

    /// Forgets every tuned algorithm: bf16 products run `cublasGemmEx`'s
    /// choice again.
    pub fn clear_bf16_tuning(&self) -> R {
        let mut guard = self.lt.lock().map_err(|_| poisoned())?;
        if let Some(lt) = guard.as_mut() {
            lt.bf16.clear();
        }
        Ok(())
    }

    /// Runs `out^T = w x^T` (bf16 `w` of `shape.n` rows, out of type
    /// `out_ty` and leading dimension `shape.n`) by its tuned algorithm;
    /// `false` (nothing run) where it has none or cuBLASLt refuses it, and
    /// cublasGemmEx is the caller's to run.
    ///
    /// # Safety
    /// The pointers are live device buffers of the shape's sizes.
    pub(super) unsafe fn gemm_tuned(
        &self,
        (w, x, out): (u64, u64, u64),
        shape: GemmShape,
        out_ty: Bf16Out,
    ) -> R<bool> {
        let GemmShape { m, n, k } = shape;
        let mut guard = self.lt.lock().map_err(|_| poisoned())?;
        let Some(lt) = guard.as_mut() else {
            return Ok(false);
        };
        // SAFETY: the caller vouches for the pointers.
        Ok(unsafe { lt.run_tuned(&(m, n, k, out_ty), Operands { w, x, out }, &self.stream) })
    }

    /// `cublasGemmEx`'s time, then each of cuBLASLt's first `count`
    /// algorithms' with it, on rotating weights `ws`.
    ///
    /// # Safety
    /// Every pointer is a live device buffer of `shape`'s size.
    unsafe fn time_bf16(
        &self,
        ws: &[u64],
        xp: u64,
        op: u64,
        (shape, out_ty): (GemmShape, Bf16Out),
        count: usize,
    ) -> R<(f64, Vec<(LtTiming, sys::cublasLtMatmulAlgo_t)>)> {
        let bf = cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
        let ex = time_rotation(&self.stream, ws.len(), |i| {
            // SAFETY: the caller vouches for the pointers.
            unsafe { self.gemm_into(ws[i], xp, bf, (op, out_ty.blas_ty()), shape, shape.n) }
        })?;
        let mut guard = self.lt.lock().map_err(|_| poisoned())?;
        let lt = Lt::get(&mut guard, self)?;
        let descs = bf16_descs(shape, out_ty)?;
        let candidates = lt.heuristics(&descs, count)?;
        let mut found = Vec::with_capacity(candidates.len());
        for (rank, c) in candidates.iter().enumerate() {
            let us = time_rotation(&self.stream, ws.len(), |i| {
                let p = Operands {
                    w: ws[i],
                    x: xp,
                    out: op,
                };
                // SAFETY: the caller vouches for the pointers.
                unsafe { lt.run(&descs, &c.algo, p, &self.stream) }
            })
            .unwrap_or(f64::NAN);
            let timing = LtTiming {
                rank,
                us,
                waves: c.wavesCount,
                config: LtConfig::of(&c.algo),
            };
            found.push((timing, c.algo));
        }
        Ok((ex, found))
    }
}

/// Descriptors of a bf16 product with `out` output, as the engine runs it.
fn bf16_descs(shape: GemmShape, out: Bf16Out) -> R<Descs> {
    let d = Lt::plain_descs(shape, sys::cudaDataType::CUDA_R_16BF, out.ty(), shape.k)?;
    if out == Bf16Out::Bf16 {
        d.reduce_in_compute_type()?;
    }
    Ok(d)
}

/// Microseconds a launch of `launch(i)` over `copies` rotating buffers:
/// one warm-up round, then [`ROUNDS`] rounds between two events.
fn time_rotation(stream: &CudaStream, copies: usize, mut launch: impl FnMut(usize) -> R) -> R<f64> {
    let timing = Some(drv::CUevent_flags::CU_EVENT_DEFAULT);
    for i in 0..copies {
        launch(i)?;
    }
    let start = stream.record_event(timing).map_err(cuda_err)?;
    for _ in 0..ROUNDS {
        for i in 0..copies {
            launch(i)?;
        }
    }
    let end = stream.record_event(timing).map_err(cuda_err)?;
    let ms = start.elapsed_ms(&end).map_err(cuda_err)? as f64;
    Ok(ms * 1e3 / (ROUNDS * copies) as f64)
}
