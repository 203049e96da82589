//! CUDA graphs of a step's launches. Between two of Kiln's kernels a
//! captured edge becomes programmatic (sm_90 and up): the second kernel's
//! blocks may start while the first still runs and wait in
//! `griddepcontrol.wait` (every kernel of the source opens with it, after
//! any loads that need no earlier result, such as a GEMV's first weights),
//! so launch gaps and the ramp of each kernel overlap the previous one.

use std::collections::HashSet;
use std::ffi::CStr;
use std::sync::Arc;

use cudarc::driver::sys::{
    self, CUgraph, CUgraphDependencyType, CUgraphEdgeData, CUgraphExec, CUgraphInstantiate_flags,
    CUgraphNode, CUgraphNodeType, CUstreamCaptureMode,
};
use cudarc::driver::{CudaStream, DriverError, result};

use super::{Gpu, cuda_err};
use crate::KernelError;

/// Launches recorded once by [`Gpu::capture`] and replayed with one call.
pub struct Graph {
    graph: CUgraph,
    exec: CUgraphExec,
    stream: Arc<CudaStream>,
    programmatic: usize,
}

// SAFETY: a graph is used by the one thread that owns its engine at a time
// (moved with it, never shared), as CUDA requires.
unsafe impl Send for Graph {}

impl Graph {
    /// How many of its edges let the next kernel start early.
    pub fn programmatic_edges(&self) -> usize {
        self.programmatic
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: handles this graph owns, destroyed once; errors (a lost
        // context) leave nothing to free.
        unsafe {
            if !self.exec.is_null() {
                let _ = result::graph::exec_destroy(self.exec);
            }
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// The name of the kernel a graph node launches, if it launches one.
///
/// # Safety
/// `node` is a node of a live graph.
unsafe fn kernel_name(node: CUgraphNode) -> Result<Option<String>, DriverError> {
    let mut ty = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    unsafe { sys::cuGraphNodeGetType(node, &mut ty) }.result()?;
    if ty != CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(None);
    }
    let mut params = unsafe { std::mem::zeroed::<sys::CUDA_KERNEL_NODE_PARAMS>() };
    unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) }.result()?;
    if params.func.is_null() {
        return Ok(None);
    }
    let mut name = std::ptr::null();
    unsafe { sys::cuFuncGetName(&mut name, params.func) }.result()?;
    // SAFETY: the driver returns a NUL-terminated name it keeps alive.
    Ok((!name.is_null()).then(|| {
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }))
}

/// Turns every edge between two kernels named in `ours` into a
/// programmatic one; how many it turned.
///
/// # Safety
/// `graph` is a live graph no one else is editing or running.
unsafe fn make_programmatic(graph: CUgraph, ours: &HashSet<&str>) -> Result<usize, DriverError> {
    let mut n = 0usize;
    let (none, no_data) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe { sys::cuGraphGetEdges_v2(graph, none, none, no_data, &mut n) }.result()?;
    let mut from: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    let mut to: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    let mut data = vec![unsafe { std::mem::zeroed::<CUgraphEdgeData>() }; n];
    let (f, t, d) = (from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr());
    unsafe { sys::cuGraphGetEdges_v2(graph, f, t, d, &mut n) }.result()?;
    let default = CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8;
    let is_ours = |node| -> Result<bool, DriverError> {
        Ok(unsafe { kernel_name(node) }?.is_some_and(|k| ours.contains(k.as_str())))
    };
    // Decide every edge before changing any, so an error leaves the graph
    // as captured.
    let mut turn = Vec::new();
    for i in 0..n {
        if data[i].type_ == default && is_ours(from[i])? && is_ours(to[i])? {
            turn.push(i);
        }
    }
    for &i in &turn {
        let mut e = data[i];
        unsafe { sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &e, 1) }.result()?;
        e.type_ = CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        e.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
        unsafe { sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &e, 1) }.result()?;
    }
    Ok(turn.len())
}

impl Gpu {
    /// Records the launches `f` makes as a graph instead of running them;
    /// `f` must not allocate, copy or synchronize. Needs a GPU opened with
    /// its own stream. With [`Gpu::programmatic`], consecutive kernels of
    /// ours are joined by programmatic edges.
    pub fn capture(
        &self,
        f: impl FnOnce() -> Result<(), KernelError>,
    ) -> Result<Graph, KernelError> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda_err)?;
        let recorded = f();
        // The capture always ends, so the stream is usable after an error.
        // SAFETY: the capture begun above, on this stream.
        let graph = unsafe { result::stream::end_capture(self.stream.cu_stream()) };
        let graph = graph.map_err(cuda_err)?;
        if graph.is_null() {
            recorded?;
            return Err(KernelError::Cuda("the capture recorded nothing".into()));
        }
        let mut g = Graph {
            graph,
            exec: std::ptr::null_mut(),
            stream: self.stream.clone(),
            programmatic: 0,
        };
        recorded?;
        if self.programmatic {
            let ours: HashSet<&str> = self.functions.keys().map(String::as_str).collect();
            // SAFETY: the graph just captured, owned by `g`.
            g.programmatic = unsafe { make_programmatic(g.graph, &ours) }.map_err(cuda_err)?;
        }
        let flags = CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        // SAFETY: a complete graph; the executable is destroyed with `g`.
        g.exec = unsafe { result::graph::instantiate(g.graph, flags) }.map_err(cuda_err)?;
        Ok(g)
    }

    /// Runs a captured graph on the stream.
    pub fn replay(&self, graph: &Graph) -> Result<(), KernelError> {
        self.ctx.bind_to_thread().map_err(cuda_err)?;
        // SAFETY: an instantiated graph of this context, on its stream.
        unsafe { result::graph::launch(graph.exec, graph.stream.cu_stream()) }.map_err(cuda_err)
    }
}
