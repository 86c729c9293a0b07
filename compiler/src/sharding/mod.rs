//! Sharding over a device mesh: the mesh spec (`--devices`), the attention policy,
//! and the per-op rule table ([`rules`]) that the shard pass
//! (`passes/shard.rs`) applies. docs/sharding.md describes the design.

pub mod rules;

use maxc_format::{DeviceKind, DeviceMesh};

/// Parses `--devices`: `cpu` (one CPU device), `cpu:0,1`, `gpu:0,1,2,3`, `gpu:N`.
pub fn parse_mesh(spec: &str) -> Result<DeviceMesh, String> {
    let spec = spec.trim();
    let (kind, ordinals) = match spec.split_once(':') {
        Some((k, rest)) => (k, Some(rest)),
        None => (spec, None),
    };
    let kind = match kind {
        "cpu" => DeviceKind::Cpu,
        "gpu" => DeviceKind::Gpu,
        other => return Err(format!("`{other}` is not a device kind; devices are cpu, cpu:0,1, gpu:0,1,2,3 (one kind per mesh)")),
    };
    let ordinals: Vec<u32> = match ordinals {
        None => vec![0],
        Some("all") => {
            return Err(format!(
                "`{spec}`: the compiler splits the model for a fixed number of devices and cannot see the machine it will run on; list them, e.g. {}:0,1,2,3",
                kind.name()
            ))
        }
        Some(list) => list
            .split(',')
            .map(|o| o.trim().parse::<u32>().map_err(|_| format!("`{spec}`: `{o}` is not a device number; write e.g. {}:0,1", kind.name())))
            .collect::<Result<_, _>>()?,
    };
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = ordinals.iter().find(|o| !seen.insert(**o)) {
        return Err(format!("`{spec}` names device {dup} twice"));
    }
    Ok(DeviceMesh { kind, ordinals })
}

/// How attention is placed when the mesh has several devices.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum AttentionSharding {
    /// Split by KV heads when the device count divides them, else replicate.
    #[default]
    Auto,
    /// Split by KV heads; an error when the device count does not divide them.
    Heads,
    /// Every device computes every head.
    Replicated,
}

impl AttentionSharding {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "heads" => Ok(Self::Heads),
            "replicated" => Ok(Self::Replicated),
            other => Err(format!("`{other}` is not an attention sharding; use auto, heads or replicated")),
        }
    }
}

/// One device's view of the mesh, for the shard pass.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ShardTarget {
    /// This device's index in the mesh.
    pub index: u32,
    /// Devices in the mesh.
    pub devices: u32,
    /// Whether attention is split by heads.
    pub split_attention: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meshes_parse() {
        assert_eq!(parse_mesh("cpu").unwrap(), DeviceMesh { kind: DeviceKind::Cpu, ordinals: vec![0] });
        assert_eq!(parse_mesh("cpu:0,1").unwrap().ordinals, vec![0, 1]);
        assert_eq!(parse_mesh("gpu:0,1,2,3").unwrap().kind, DeviceKind::Gpu);
        assert!(parse_mesh("tpu:0").unwrap_err().contains("not a device kind"));
        assert!(parse_mesh("gpu:all").unwrap_err().contains("gpu:0,1,2,3"));
        assert!(parse_mesh("cpu:0,0").unwrap_err().contains("twice"));
        assert!(parse_mesh("cpu:a").unwrap_err().contains("not a device number"));
    }
}
