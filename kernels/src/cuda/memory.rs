//! Device memory: allocation, copies both ways, and the copy bandwidth.

use cudarc::driver::CudaSlice;

use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

impl Gpu {
    /// Uploads host data.
    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, x: &[T]) -> R<CudaSlice<T>> {
        self.stream.clone_htod(x).map_err(cuda_err)
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus written),
    /// over copies of 1 GiB: the bound a memory-bound kernel is held to.
    pub fn copy_bandwidth(&self) -> R<f64> {
        let n = 1usize << 30;
        let src: CudaSlice<u8> = self.stream.alloc_zeros(n).map_err(cuda_err)?;
        let mut dst: CudaSlice<u8> = self.stream.alloc_zeros(n).map_err(cuda_err)?;
        self.stream.memcpy_dtod(&src, &mut dst).map_err(cuda_err)?;
        self.synchronize()?;
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.stream.memcpy_dtod(&src, &mut dst).map_err(cuda_err)?;
        }
        self.synchronize()?;
        Ok((2 * n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9)
    }

    /// Copies `x` to the start of `dst` (at least as long).
    pub fn upload_into<T: cudarc::driver::DeviceRepr>(&self, x: &[T], dst: &mut CudaSlice<T>) -> R {
        if dst.len() < x.len() {
            return Err(KernelError::Shape(format!(
                "copying {} elements into {}",
                x.len(),
                dst.len()
            )));
        }
        self.stream
            .memcpy_htod(x, &mut dst.slice_mut(..x.len()))
            .map_err(cuda_err)
    }

    /// Copies `x` into `dst` from element `at` on.
    pub fn upload_at<T: cudarc::driver::DeviceRepr>(
        &self,
        x: &[T],
        dst: &mut CudaSlice<T>,
        at: usize,
    ) -> R {
        if dst.len() < at + x.len() {
            return Err(KernelError::Shape(format!(
                "copying {} elements at {at} into {}",
                x.len(),
                dst.len()
            )));
        }
        self.stream
            .memcpy_htod(x, &mut dst.slice_mut(at..at + x.len()))
            .map_err(cuda_err)
    }

    /// Downloads `range` of `x`.
    pub fn download_range<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        x: &CudaSlice<T>,
        range: std::ops::Range<usize>,
    ) -> R<Vec<T>> {
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let mut out = vec![T::default(); range.len()];
        self.stream
            .memcpy_dtoh(&x.slice(range), &mut out)
            .map_err(cuda_err)?;
        self.stream.synchronize().map_err(cuda_err)?;
        Ok(out)
    }

    /// Downloads device data.
    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        x: &CudaSlice<T>,
    ) -> R<Vec<T>> {
        self.stream.clone_dtoh(x).map_err(cuda_err)
    }

    /// A zeroed device buffer of `n` elements.
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> R<CudaSlice<T>> {
        self.stream.alloc_zeros(n.max(1)).map_err(cuda_err)
    }
}
