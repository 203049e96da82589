//! A reader for GGUF v3 files: metadata and tensor directory, with tensor
//! bytes read from a memory map.

use std::collections::HashMap;
use std::path::Path;

use kiln_kernels::quant::DType;

use super::ModelError;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned or signed integer.
    Int(i64),
    /// Any float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Value>),
}

/// A tensor's directory entry.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Dimensions, innermost first (ggml order: `dims[0]` is the row length).
    pub dims: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Byte offset from the start of the data section.
    pub offset: usize,
}

/// An opened GGUF file.
pub struct Gguf {
    /// Metadata.
    pub meta: HashMap<String, Value>,
    /// Tensors by name.
    pub tensors: HashMap<String, TensorInfo>,
    map: memmap2::Mmap,
    data_start: usize,
}

/// How deep metadata arrays may nest.
const MAX_NESTING: usize = 8;

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ModelError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.b.len())
            .ok_or_else(|| {
                ModelError::Format(format!(
                    "GGUF truncated at byte {} (wanted {n} more)",
                    self.pos
                ))
            })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
    fn len(&mut self) -> Result<usize, ModelError> {
        let n = self.u64()?;
        if n > self.b.len() as u64 {
            return Err(ModelError::Format(format!(
                "GGUF length {n} is beyond the file"
            )));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, ModelError> {
        let n = self.len()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn value(&mut self, ty: u32) -> Result<Value, ModelError> {
        self.value_in(ty, 0)
    }

    /// A value `depth` arrays down: nesting is bounded, so a crafted file
    /// cannot exhaust the stack.
    fn value_in(&mut self, ty: u32, depth: usize) -> Result<Value, ModelError> {
        let mut fixed = |n: usize| -> Result<[u8; 8], ModelError> {
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(self.take(n)?);
            Ok(a)
        };
        Ok(match ty {
            0 => Value::Int(fixed(1)?[0] as i64),
            1 => Value::Int(fixed(1)?[0] as i8 as i64),
            2 => {
                Value::Int(u16::from_le_bytes(fixed(2)?[..2].try_into().unwrap_or_default()) as i64)
            }
            3 => {
                Value::Int(i16::from_le_bytes(fixed(2)?[..2].try_into().unwrap_or_default()) as i64)
            }
            4 => {
                Value::Int(u32::from_le_bytes(fixed(4)?[..4].try_into().unwrap_or_default()) as i64)
            }
            5 => {
                Value::Int(i32::from_le_bytes(fixed(4)?[..4].try_into().unwrap_or_default()) as i64)
            }
            6 => Value::Float(
                f32::from_le_bytes(fixed(4)?[..4].try_into().unwrap_or_default()) as f64,
            ),
            7 => Value::Bool(fixed(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let inner = self.u32()?;
                if inner == 9 && depth >= MAX_NESTING {
                    return Err(ModelError::Format(format!(
                        "GGUF arrays nested more than {MAX_NESTING} deep"
                    )));
                }
                let n = self.len()?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value_in(inner, depth + 1)?);
                }
                Value::Array(items)
            }
            10 | 11 => Value::Int(i64::from_le_bytes(fixed(8)?)),
            12 => Value::Float(f64::from_le_bytes(fixed(8)?)),
            other => {
                return Err(ModelError::Format(format!(
                    "unknown GGUF value type {other}"
                )));
            }
        })
    }
}

impl Gguf {
    /// Opens and parses `path`.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = std::fs::File::open(path)
            .map_err(|e| ModelError::Io(format!("opening {}: {e}", path.display())))?;
        // SAFETY: the file is opened read-only; Kiln does not modify model
        // files while they are mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| ModelError::Io(format!("mapping {}: {e}", path.display())))?;
        let mut c = Cursor { b: &map, pos: 0 };
        if c.take(4)? != b"GGUF" {
            return Err(ModelError::Format(format!(
                "{} is not a GGUF file",
                path.display()
            )));
        }
        let version = c.u32()?;
        if version != 3 && version != 2 {
            return Err(ModelError::Format(format!(
                "GGUF version {version} is not supported (want 3)"
            )));
        }
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut meta = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            meta.insert(key, c.value(ty)?);
        }
        let mut tensors = HashMap::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()? as usize;
            if nd > 4 {
                return Err(ModelError::Format(format!(
                    "tensor {name} has {nd} dimensions"
                )));
            }
            let dims = (0..nd).map(|_| c.len()).collect::<Result<Vec<_>, _>>()?;
            let dtype = DType::from_ggml(c.u32()?)
                .map_err(|e| ModelError::Unsupported(format!("tensor {name}: {e}")))?;
            let offset = c.len()?;
            tensors.insert(
                name,
                TensorInfo {
                    dims,
                    dtype,
                    offset,
                },
            );
        }
        let align = match meta.get("general.alignment") {
            Some(Value::Int(a)) if *a > 0 => *a as usize,
            _ => 32,
        };
        let data_start = c.pos.div_ceil(align) * align;
        Ok(Self {
            meta,
            tensors,
            map,
            data_start,
        })
    }

    /// The bytes of tensor `name`, checked against the file's size.
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8]), ModelError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::Format(format!("tensor {name} is missing")))?;
        let past = || ModelError::Format(format!("tensor {name} runs past the end of the file"));
        let n = t
            .dims
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d))
            .ok_or_else(past)?;
        // No type takes more than 34 bytes a 32-element block or 4 an element.
        n.checked_mul(34).ok_or_else(past)?;
        let len = t.dtype.bytes_for(n);
        let start = self.data_start.checked_add(t.offset).ok_or_else(past)?;
        let end = start.checked_add(len).ok_or_else(past)?;
        let bytes = self.map.get(start..end).ok_or_else(past)?;
        Ok((t, bytes))
    }

    /// An integer metadata value.
    pub fn int(&self, key: &str) -> Option<i64> {
        match self.meta.get(key)? {
            Value::Int(v) => Some(*v),
            _ => None,
        }
    }

    /// A float metadata value (integers are converted).
    pub fn float(&self, key: &str) -> Option<f64> {
        match self.meta.get(key)? {
            Value::Float(v) => Some(*v),
            Value::Int(v) => Some(*v as f64),
            _ => None,
        }
    }

    /// A string metadata value.
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.meta.get(key)? {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A string-array metadata value.
    pub fn strings(&self, key: &str) -> Option<Vec<&str>> {
        match self.meta.get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::Str(s) => Some(s.as_str()),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    /// An integer-array metadata value.
    pub fn ints(&self, key: &str) -> Option<Vec<i64>> {
        match self.meta.get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::Int(i) => Some(*i),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }
}

#[cfg(test)]
#[path = "gguf_fuzz.rs"]
mod fuzz;
