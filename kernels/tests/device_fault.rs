//! A device fault is reported, never taken for work still running: a lane's
//! mark after a kernel that traps reads as an error, so an engine that
//! polls its lanes fails (and is restarted) rather than waiting for ever.
//! CUDA only, so ignored unless asked for: `KILN_TEST_DEVICE=cuda` with
//! `--include-ignored`. A binary of its own: the fault spoils the
//! process's CUDA context for every test after it.

use std::time::{Duration, Instant};

use cudarc::driver::{LaunchConfig, PushKernelArg};
use kiln_kernels::cuda::Gpu;

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_mark_after_a_kernel_that_traps_reports_the_fault() {
    let gpu = Gpu::new(0).expect("a GPU");
    let lane = gpu.lane().expect("a second lane");
    let src = r#"extern "C" __global__ void trap_if(int on) { if (on) asm("trap;"); }"#;
    let ptx = cudarc::nvrtc::compile_ptx(src).expect("NVRTC");
    let module = lane.context().load_module(ptx).expect("module");
    let trap_if = module.load_function("trap_if").expect("function");
    let launch = |on: i32| {
        let mut b = lane.stream().launch_builder(&trap_if);
        b.arg(&on);
        // SAFETY: one thread of a kernel that takes one int by value.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.expect("launch");
        lane.mark().expect("mark")
    };
    let wait = |mark: &kiln_kernels::cuda::Mark| {
        let start = Instant::now();
        loop {
            match mark.is_done() {
                Ok(false) if start.elapsed() < Duration::from_secs(20) => std::thread::yield_now(),
                other => return other,
            }
        }
    };
    assert!(
        matches!(wait(&launch(0)), Ok(true)),
        "a kernel that returns"
    );
    let fault = wait(&launch(1));
    assert!(fault.is_err(), "a trap read as {fault:?}");
}
