//! Kiln's compute kernels.
//!
//! Every kernel has a CPU reference implementation; CUDA versions are
//! checked against them. This crate knows nothing of tenants or HTTP. The
//! kernels arrive with the inference engine; for now it only names the
//! devices Kiln can run on.

/// A device kernels can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU: the default, and the reference for every other device.
    #[default]
    Cpu,
}

impl Device {
    /// The device's name as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_the_default_device() {
        assert_eq!(Device::default().name(), "cpu");
    }
}
