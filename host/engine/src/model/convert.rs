//! Weight formats chosen at load (`--weights`): every projection (q, k,
//! v, o, gate, up, down; not the embedding) converted to bf16, FP8 rows or
//! int4 groups, and the output head where the plan names a format for it.

use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{DType, quantize_rows};
use rayon::prelude::*;

use super::arch::Convert;
use super::cpu::{Host, Model};

/// The weights a model runs with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// As the file stores them.
    #[default]
    Native,
    /// Projections as bf16 (the reference the other formats are held to).
    Bf16,
    /// Projections as FP8 e4m3 with a scale per output channel.
    Fp8,
    /// Projections rounded to int4 groups at load (W4A16).
    Int4,
}

/// Converts `model`'s projections to `format`; returns how many it
/// converted and how many it left as they were (int4 needs rows a multiple
/// of 64 long).
pub fn convert(model: &mut Model, format: WeightFormat) -> (usize, usize) {
    let weights = projections(model);
    let total = weights.len();
    let bar = super::progress::bar(total, format!("converting projections to {format:?}"));
    let done = weights
        .into_iter()
        .filter_map(|w| {
            bar.inc(1);
            let new = match format {
                WeightFormat::Native => None,
                WeightFormat::Bf16 => rows_as(w, DType::BF16),
                WeightFormat::Fp8 => rows_as(w, DType::Fp8Row),
                WeightFormat::Int4 => to_int4(w),
            };
            new.map(|n| *w = n)
        })
        .count();
    bar.finish_and_clear();
    (done, total - done)
}

/// Every projection of `model`.
fn projections(model: &mut Model) -> Vec<&mut Weight> {
    let mut weights: Vec<&mut Weight> = Vec::new();
    for b in &mut model.weights.blocks {
        weights.extend(b.qkv.iter_mut());
        weights.push(&mut b.wo);
        weights.extend(b.gate_up.iter_mut());
        weights.push(&mut b.down);
    }
    weights
}

/// `w`'s values as f32, row-major.
fn values(w: &Weight) -> Vec<f32> {
    let mut values = vec![0.0f32; w.rows() * w.cols()];
    values
        .par_chunks_mut(w.cols())
        .enumerate()
        .for_each(|(r, row)| w.row(r, row));
    values
}

/// `w` stored as `dtype`, row by row.
fn rows_as(w: &Weight, dtype: DType) -> Option<Weight> {
    let cols = w.cols();
    let bytes: Vec<u8> = values(w)
        .par_chunks(cols)
        .flat_map_iter(|row| quantize_rows(dtype, cols, row))
        .collect();
    Weight::from_bytes(dtype, w.rows(), cols, bytes).ok()
}

/// Rounds `w` to int4 groups of 128 inputs (64 where its rows are not a
/// multiple of 128 long); `None` when neither divides its rows or it is
/// int4 already.
fn to_int4(w: &Weight) -> Option<Weight> {
    let cols = w.cols();
    let dtype = [DType::Int4G128, DType::Int4G64]
        .into_iter()
        .find(|d| cols.is_multiple_of(d.block_len()))?;
    if w.dtype().int4_group().is_some() {
        return None;
    }
    rows_as(w, dtype)
}

/// The weights each phase runs with (`--weights`): one format for both, or
/// `prefill=F,decode=F` (two copies of the projections, each phase on its
/// own: FP8 tensor cores for prefill's math, int4 for decode's bytes); and
/// `head=F` for the output head.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightPlan {
    /// Weights of prefill chunks (and of the model's single copy).
    pub prefill: WeightFormat,
    /// Weights of decode rows (one new token).
    pub decode: WeightFormat,
    /// The output head of the copy decode runs on. `Native` keeps it as
    /// stored: checkpoints quantized to int4 keep their head in 16 bits,
    /// and so does `--weights int4`, though at one sequence that head is a
    /// quarter of the bytes an int4 step reads. Another format gives the
    /// head a copy of its own (a tied embedding stays the gather's table).
    /// On CUDA a one-token step folds its norms only where the head is
    /// bf16 or int4 tiles: an fp8 head runs every launch apart.
    pub head: WeightFormat,
}

impl WeightPlan {
    /// Whether the phases run on different copies.
    pub fn is_split(&self) -> bool {
        self.prefill != self.decode
    }
}

impl From<WeightFormat> for WeightPlan {
    fn from(format: WeightFormat) -> Self {
        Self {
            prefill: format,
            decode: format,
            head: WeightFormat::Native,
        }
    }
}

/// Gives `model` an output head of its own in `format` (a tied embedding
/// stays the embedding gather's table); false where `format` is `Native`
/// or the head's rows cannot take it.
pub fn convert_head(model: &mut Model, format: WeightFormat) -> bool {
    let head = model.weights.head();
    let new = match format {
        WeightFormat::Native => None,
        WeightFormat::Bf16 => rows_as(head, DType::BF16),
        WeightFormat::Fp8 => rows_as(head, DType::Fp8Row),
        WeightFormat::Int4 => to_int4(head),
    };
    new.map(|w| model.weights.output = Some(w)).is_some()
}

impl WeightFormat {
    fn parse(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(WeightFormat::Native),
            "bf16" => Ok(WeightFormat::Bf16),
            "fp8" => Ok(WeightFormat::Fp8),
            "int4" => Ok(WeightFormat::Int4),
            other => Err(format!(
                "unknown weight format `{other}` (use native, bf16, fp8 or int4)"
            )),
        }
    }
}

impl std::str::FromStr for WeightPlan {
    type Err = String;

    /// `FORMAT`, or `prefill=FORMAT,decode=FORMAT` (either order), then
    /// optionally `,head=FORMAT`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (mut both, mut prefill, mut decode, mut head) = (None, None, None, None);
        for part in s.split(',').map(str::trim) {
            let Some((key, format)) = part.split_once('=') else {
                if both.replace(WeightFormat::parse(part)?).is_some() {
                    return Err(format!("`{s}` names two formats for the projections"));
                }
                continue;
            };
            let slot = match key.trim() {
                "prefill" => &mut prefill,
                "decode" => &mut decode,
                "head" => &mut head,
                other => {
                    return Err(format!(
                        "unknown part `{other}` (prefill, decode or head, as in \
                         prefill=fp8,decode=int4,head=int4)"
                    ));
                }
            };
            if slot.replace(WeightFormat::parse(format.trim())?).is_some() {
                return Err(format!("`{}` given twice", key.trim()));
            }
        }
        let head = head.unwrap_or_default();
        match (both, prefill, decode) {
            (Some(f), None, None) => Ok(Self { head, ..f.into() }),
            (None, Some(prefill), Some(decode)) => Ok(Self {
                prefill,
                decode,
                head,
            }),
            (Some(_), _, _) => Err("one format, or one for each phase, not both".into()),
            (None, None, None) => {
                Err("name the projections' format before the head's, as in int4,head=int4".into())
            }
            _ => Err("name both phases, as in prefill=fp8,decode=int4".into()),
        }
    }
}

/// Copies host weights as they are.
struct Duplicate;

impl Convert<Host, Host> for Duplicate {
    fn vector(&mut self, v: &Vec<f32>) -> super::arch::R<Vec<f32>> {
        Ok(v.clone())
    }
    fn matrix(&mut self, m: &Weight) -> super::arch::R<Weight> {
        Ok(m.clone())
    }
    fn stack(&mut self, s: &Vec<Weight>) -> super::arch::R<Vec<Weight>> {
        Ok(s.clone())
    }
}

impl Model {
    /// A second copy of the model (for the other phase's weights).
    pub(crate) fn duplicate(&self) -> Result<Model, super::ModelError> {
        Ok(Model {
            config: self.config.clone(),
            weights: self.weights.convert(&mut Duplicate)?,
            rope: self.rope.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_plans_parse_one_format_or_both_phases() {
        let one: WeightPlan = "int4".parse().unwrap();
        assert_eq!(one, WeightFormat::Int4.into());
        assert!(!one.is_split());
        let split: WeightPlan = "decode=int4, prefill=fp8".parse().unwrap();
        assert_eq!(split.prefill, WeightFormat::Fp8);
        assert_eq!(split.decode, WeightFormat::Int4);
        assert!(split.is_split());
        let head: WeightPlan = "int4, head=int4".parse().unwrap();
        assert_eq!(
            (head.decode, head.head),
            (WeightFormat::Int4, WeightFormat::Int4)
        );
        assert!(!head.is_split());
        let split_head: WeightPlan = "prefill=fp8,decode=int4,head=fp8".parse().unwrap();
        assert_eq!(split_head.head, WeightFormat::Fp8);
        assert_eq!(split_head.decode, WeightFormat::Int4);
        for bad in [
            "int3",
            "prefill=fp8",
            "prefill=fp8,prefill=int4",
            "warm=fp8,decode=int4",
            "head=int4",
            "int4,fp8",
            "int4,decode=int4",
            "int4,head=int3",
            "int4,head=int4,head=fp8",
        ] {
            let e = bad.parse::<WeightPlan>().unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
    }
}
