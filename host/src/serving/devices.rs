//! Which devices a model's decode pools run on (`--device cpu`, `cuda`,
//! `cuda:N`, `cuda:all` or a list such as `cuda:0,2`), and each pool's
//! engine settings: pools on several GPUs are pools as on one, each with
//! its own weights, KV pages and engine thread, so sessions spread over
//! them by the router's rendezvous hashing and a GPU's failing pool fails
//! alone.

use std::fmt;
use std::str::FromStr;

use kiln_kernels::Device;

use crate::engine::EngineConfig;

/// The devices `--device` names, before `cuda:all` is counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// One device, or several GPUs in the order given (none twice).
    Listed(Vec<Device>),
    /// Every CUDA GPU the machine has (`cuda:all`).
    AllCuda,
}

impl Default for DeviceSpec {
    fn default() -> Self {
        Self::Listed(vec![Device::Cpu])
    }
}

impl FromStr for DeviceSpec {
    type Err = String;

    /// `cpu`, `cuda` (GPU 0), `cuda:N`, `cuda:all`, or `cuda:N,M,...`.
    fn from_str(s: &str) -> Result<Self, String> {
        let Some(list) = s.strip_prefix("cuda:").filter(|l| l.contains(',')) else {
            return match s {
                "cuda:all" => Ok(Self::AllCuda),
                _ => s
                    .parse()
                    .map(|d| Self::Listed(vec![d]))
                    .map_err(|e: String| {
                        format!("{e} (serve: also cuda:all, or a list such as cuda:0,1)")
                    }),
            };
        };
        let mut devices = Vec::new();
        for n in list.split(',') {
            let n: usize = n.trim().parse().map_err(|_| {
                format!("device list `{s}`: `{n}` is not a GPU number (as in cuda:0,1)")
            })?;
            if devices.contains(&Device::Cuda(n)) {
                return Err(format!(
                    "device list `{s}` names GPU {n} twice; --decode-pools sets the pools \
                     a GPU runs"
                ));
            }
            devices.push(Device::Cuda(n));
        }
        Ok(Self::Listed(devices))
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AllCuda => f.write_str("cuda:all"),
            Self::Listed(d) if d.len() == 1 => f.write_str(&d[0].name()),
            Self::Listed(d) => {
                let n: Vec<String> = (d.iter())
                    .map(|d| match d {
                        Device::Cuda(n) => n.to_string(),
                        Device::Cpu => "cpu".into(),
                    })
                    .collect();
                write!(f, "cuda:{}", n.join(","))
            }
        }
    }
}

impl DeviceSpec {
    /// The devices, `cuda:all` counted by `gpus` (the GPUs this machine
    /// has, or why they cannot be counted).
    pub fn resolve(
        &self,
        gpus: impl FnOnce() -> Result<usize, String>,
    ) -> Result<Vec<Device>, String> {
        match self {
            Self::Listed(d) => Ok(d.clone()),
            Self::AllCuda => match gpus()? {
                0 => {
                    Err("--device cuda:all: this machine has no CUDA GPU; use --device cpu".into())
                }
                n => Ok((0..n).map(Device::Cuda).collect()),
            },
        }
    }

    /// The one device of a command that runs one engine (`run`, `bench`).
    pub fn single(&self) -> Result<Device, String> {
        match self {
            Self::Listed(d) if d.len() == 1 => Ok(d[0]),
            _ => Err(format!(
                "--device {self}: this command runs one engine on one device; `kiln serve` \
                 runs pools on several"
            )),
        }
    }
}

/// Where a model's pools run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The devices of its decode pools (none: its config's own).
    pub devices: Vec<Device>,
    /// Decode pools on each device (at least one).
    pub pools: usize,
    /// The device of a prefill pool, which computes every prompt and hands
    /// each sequence on to the decode pool the router chose for it (none:
    /// decode pools compute their own prompts).
    pub prefill: Option<Device>,
}

impl Placement {
    /// `pools` decode pools on the config's own device.
    pub fn pools(pools: usize) -> Self {
        Self {
            pools,
            ..Self::default()
        }
    }
}

/// The engine settings of each pool of a model set up by `config`:
/// `placement.pools` decode pools on each of its devices in turn, each
/// with an equal share of the KV budget, which `config` gives each device;
/// then the prefill pool, if any, with a decode pool's share (a sequence it
/// computed then fits the decode pool it goes to).
pub fn pool_configs(config: &EngineConfig, placement: &Placement) -> Vec<EngineConfig> {
    let per_device = placement.pools.max(1);
    let own = [config.device];
    let devices = match placement.devices.as_slice() {
        [] => &own[..],
        d => d,
    };
    let pool = |&device| EngineConfig {
        device,
        kv_memory: config.kv_memory / per_device,
        ..config.clone()
    };
    // A decode pool's budget: what the prefill pool admits, a decode pool
    // can hold.
    let prefill = placement.prefill.map(|device| EngineConfig {
        device,
        pd: false,
        kv_memory: config.kv_memory / per_device,
        ..config.clone()
    });
    (devices.iter())
        .flat_map(|d| std::iter::repeat_n(d, per_device))
        .map(pool)
        .chain(prefill)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_device_lists_and_all_parse() {
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Listed(vec![Device::Cpu])));
        assert_eq!(
            "cuda".parse(),
            Ok(DeviceSpec::Listed(vec![Device::Cuda(0)]))
        );
        assert_eq!(
            "cuda:3".parse(),
            Ok(DeviceSpec::Listed(vec![Device::Cuda(3)]))
        );
        assert_eq!("cuda:all".parse(), Ok(DeviceSpec::AllCuda));
        let list = DeviceSpec::Listed(vec![Device::Cuda(2), Device::Cuda(0)]);
        assert_eq!("cuda:2,0".parse(), Ok(list.clone()));
        assert_eq!(list.to_string(), "cuda:2,0");
        assert_eq!(DeviceSpec::AllCuda.to_string(), "cuda:all");
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        let twice = "cuda:1,1".parse::<DeviceSpec>().unwrap_err();
        assert!(
            twice.contains("GPU 1 twice") && twice.contains("--decode-pools"),
            "{twice}"
        );
        let word = "cuda:0,x".parse::<DeviceSpec>().unwrap_err();
        assert!(word.contains("`x` is not a GPU number"), "{word}");
        assert!(
            "gpu"
                .parse::<DeviceSpec>()
                .unwrap_err()
                .contains("unknown device")
        );
    }

    #[test]
    fn all_counts_the_gpus_and_needs_one() {
        let all = DeviceSpec::AllCuda.resolve(|| Ok(3)).unwrap();
        assert_eq!(all, [Device::Cuda(0), Device::Cuda(1), Device::Cuda(2)]);
        let none = DeviceSpec::AllCuda.resolve(|| Ok(0)).unwrap_err();
        assert!(none.contains("no CUDA GPU"), "{none}");
        let why = DeviceSpec::AllCuda.resolve(|| Err("no driver".into()));
        assert_eq!(why, Err("no driver".into()));
        // A list is taken as given; each device is probed where it opens.
        let listed = DeviceSpec::Listed(vec![Device::Cuda(5)]);
        assert_eq!(
            listed.resolve(|| panic!("not counted")),
            Ok(vec![Device::Cuda(5)])
        );
    }

    #[test]
    fn commands_of_one_engine_refuse_several_devices() {
        assert_eq!(DeviceSpec::default().single(), Ok(Device::Cpu));
        let err = DeviceSpec::AllCuda.single().unwrap_err();
        assert!(err.contains("kiln serve"), "{err}");
        assert!("cuda:0,1".parse::<DeviceSpec>().unwrap().single().is_err());
    }

    #[test]
    fn each_device_gets_its_pools_and_each_pool_its_share_of_that_device() {
        let config = EngineConfig {
            kv_memory: 1 << 30,
            ..EngineConfig::default()
        };
        let gpus = Placement {
            devices: vec![Device::Cuda(0), Device::Cuda(1)],
            pools: 2,
            prefill: None,
        };
        let pools = pool_configs(&config, &gpus);
        let placed: Vec<_> = pools.iter().map(|c| (c.device, c.kv_memory)).collect();
        let half = 1 << 29;
        assert_eq!(
            placed,
            [
                (Device::Cuda(0), half),
                (Device::Cuda(0), half),
                (Device::Cuda(1), half),
                (Device::Cuda(1), half)
            ]
        );
        // No devices: the config's own, as one-device servers have it.
        let own = pool_configs(&config, &Placement::pools(1));
        assert_eq!(own.len(), 1);
        assert_eq!((own[0].device, own[0].kv_memory), (Device::Cpu, 1 << 30));
    }

    #[test]
    fn a_prefill_pool_comes_last_with_a_decode_pools_budget() {
        let config = EngineConfig {
            kv_memory: 1 << 30,
            pd: true,
            ..EngineConfig::default()
        };
        let placement = Placement {
            devices: vec![Device::Cuda(1)],
            pools: 2,
            prefill: Some(Device::Cuda(0)),
        };
        let pools = pool_configs(&config, &placement);
        let placed: Vec<_> = pools
            .iter()
            .map(|c| (c.device, c.kv_memory, c.pd))
            .collect();
        assert_eq!(
            placed,
            [
                (Device::Cuda(1), 1 << 29, true),
                (Device::Cuda(1), 1 << 29, true),
                (Device::Cuda(0), 1 << 29, false)
            ]
        );
    }
}
