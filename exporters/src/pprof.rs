//! Gzipped pprof profiles (`profile.proto`), for `go tool pprof` and Pyroscope.
//!
//! The message types are the ones the `pyroscope` crate generates from the same
//! `profile.proto`, so the Pyroscope push (whose request types live in that crate too) can carry
//! these bytes without a second copy of the schema.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;
pub use pyroscope::encode::gen::google::Profile as PprofProfile;
use pyroscope::encode::gen::google::{Function, Label, Line, Location, Sample, ValueType};

use crate::{display_name, Error, Frame, Profile};

/// Encodes `profile` as a gzipped pprof protobuf; see [`to_pprof`] for the layout.
pub fn encode_pprof_gzip(profile: &Profile) -> Result<Vec<u8>, Error> {
    gzip(&to_pprof(profile)?.encode_to_vec())
}

/// Gzips encoded pprof bytes (pprof files and Pyroscope's raw profiles are gzipped).
pub fn gzip(bytes: &[u8]) -> Result<Vec<u8>, Error> {
    // The gzip header's mtime stays 0, so equal profiles give equal bytes.
    let mut encoder = GzEncoder::new(Vec::with_capacity(bytes.len() / 4), Compression::default());
    encoder.write_all(bytes).map_err(Error::Gzip)?;
    encoder.finish().map_err(Error::Gzip)
}

/// Builds the pprof message for `profile`.
///
/// - sample types `[("samples","count"), (meta.sample_type, meta.unit)]`, values
///   `[count, count * period]`; period type and period, time and duration from the meta;
/// - one `Function` and one `Location` (ids from 1, no mapping, no address) per distinct frame
///   name, named as in the folded output (kernel frames end in `_[k]`);
/// - `location_id` leaf first, as pprof requires;
/// - every sample label as a string label (`pid` included);
/// - identical (stack, labels) pairs merged, zero counts dropped, samples sorted by stack then
///   labels, so the encoding does not depend on the order of `profile.samples`. An empty stack
///   becomes one `[unknown]` frame, as in the folded output.
///
/// Fails only when a value does not fit pprof's `int64`.
pub fn to_pprof(profile: &Profile) -> Result<PprofProfile, Error> {
    let meta = &profile.meta;
    let mut builder = Builder::default();
    builder.string("");

    let sample_type = vec![
        builder.value_type("samples", "count"),
        builder.value_type(&meta.sample_type, &meta.unit),
    ];
    let period_type = Some(builder.value_type(&meta.period_type, &meta.period_unit));
    let period = to_i64("period", meta.period)?;

    let mut merged: BTreeMap<StackKey, u64> = BTreeMap::new();
    for sample in &profile.samples {
        let total = merged
            .entry((sample.frames.as_slice(), sample.labels.as_slice()))
            .or_insert(0);
        *total = total.saturating_add(sample.count);
    }

    let mut samples = Vec::with_capacity(merged.len());
    for ((frames, labels), count) in merged {
        if count == 0 {
            continue;
        }
        let location_id = if frames.is_empty() {
            vec![builder.location("[unknown]".to_string())]
        } else {
            frames
                .iter()
                .rev()
                .map(|frame| builder.location(display_name(frame)))
                .collect()
        };
        let weighted = count.saturating_mul(meta.period);
        let value = vec![to_i64("sample count", count)?, to_i64("sample value", weighted)?];
        let label = labels
            .iter()
            .map(|(key, value)| Label {
                key: builder.string(key),
                str: builder.string(value),
                num: 0,
                num_unit: 0,
            })
            .collect();
        samples.push(Sample {
            location_id,
            value,
            label,
        });
    }

    Ok(PprofProfile {
        sample_type,
        sample: samples,
        mapping: Vec::new(),
        location: builder.locations,
        function: builder.functions,
        string_table: builder.strings,
        drop_frames: 0,
        keep_frames: 0,
        time_nanos: to_i64("start time", meta.start_unix_nanos)?,
        duration_nanos: to_i64("duration", meta.duration_nanos)?,
        period_type,
        period,
        comment: Vec::new(),
        default_sample_type: 0,
    })
}

/// A sample's frames and labels, borrowed from the profile.
type StackKey<'a> = (&'a [Frame], &'a [(String, String)]);

fn to_i64(field: &'static str, value: u64) -> Result<i64, Error> {
    i64::try_from(value).map_err(|_| Error::PprofOverflow { field, value })
}

/// Interns strings and frames into pprof's tables.
#[derive(Default)]
struct Builder {
    strings: Vec<String>,
    string_index: HashMap<String, i64>,
    functions: Vec<Function>,
    locations: Vec<Location>,
    /// Display name → location id (equal to the function id: one location per function).
    location_ids: HashMap<String, u64>,
}

impl Builder {
    fn string(&mut self, text: &str) -> i64 {
        if let Some(&index) = self.string_index.get(text) {
            return index;
        }
        let index = self.strings.len() as i64;
        self.strings.push(text.to_string());
        self.string_index.insert(text.to_string(), index);
        index
    }

    fn value_type(&mut self, r#type: &str, unit: &str) -> ValueType {
        ValueType {
            r#type: self.string(r#type),
            unit: self.string(unit),
        }
    }

    fn location(&mut self, name: String) -> u64 {
        if let Some(&id) = self.location_ids.get(&name) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        let name_index = self.string(&name);
        self.functions.push(Function {
            id,
            name: name_index,
            system_name: name_index,
            filename: 0,
            start_line: 0,
        });
        self.locations.push(Location {
            id,
            mapping_id: 0,
            address: 0,
            line: vec![Line {
                function_id: id,
                line: 0,
            }],
            is_folded: false,
        });
        self.location_ids.insert(name, id);
        id
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::io::Read;

    use flate2::read::GzDecoder;

    use super::*;
    use crate::test_support::*;
    use crate::ProfileMeta;

    fn decode(bytes: &[u8]) -> PprofProfile {
        assert_eq!(&bytes[..2], &[0x1f, 0x8b], "gzip magic");
        let mut raw = Vec::new();
        GzDecoder::new(bytes).read_to_end(&mut raw).expect("valid gzip");
        PprofProfile::decode(raw.as_slice()).expect("valid pprof protobuf")
    }

    /// Leaf-first function names, labels, values.
    type DecodedSample = (Vec<String>, Vec<(String, String)>, Vec<i64>);

    fn string(profile: &PprofProfile, index: i64) -> &str {
        &profile.string_table[usize::try_from(index).expect("non-negative string index")]
    }

    /// Leaf-first function names of a sample.
    fn stack(profile: &PprofProfile, sample: &Sample) -> Vec<String> {
        sample
            .location_id
            .iter()
            .map(|id| {
                let location = profile
                    .location
                    .iter()
                    .find(|l| l.id == *id)
                    .expect("location exists");
                assert_eq!(location.line.len(), 1);
                let function = profile
                    .function
                    .iter()
                    .find(|f| f.id == location.line[0].function_id)
                    .expect("function exists");
                string(profile, function.name).to_string()
            })
            .collect()
    }

    fn labels(profile: &PprofProfile, sample: &Sample) -> Vec<(String, String)> {
        sample
            .label
            .iter()
            .map(|l| {
                assert_eq!((l.num, l.num_unit), (0, 0), "string labels only");
                (
                    string(profile, l.key).to_string(),
                    string(profile, l.str).to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn decodes_back_to_the_same_profile() {
        let profile = small_profile();
        let pprof = decode(&encode_pprof_gzip(&profile).unwrap());
        let period = 1_000_000_000 / 99;

        assert_eq!(pprof.string_table[0], "");
        let value_types: Vec<(&str, &str)> = pprof
            .sample_type
            .iter()
            .map(|t| (string(&pprof, t.r#type), string(&pprof, t.unit)))
            .collect();
        assert_eq!(value_types, [("samples", "count"), ("cpu", "nanoseconds")]);
        let period_type = pprof.period_type.expect("period type");
        assert_eq!(
            (
                string(&pprof, period_type.r#type),
                string(&pprof, period_type.unit)
            ),
            ("cpu", "nanoseconds")
        );
        assert_eq!(pprof.period, period);
        assert_eq!(pprof.time_nanos, 1_700_000_000_000_000_000);
        assert_eq!(pprof.duration_nanos, 30_000_000_000);

        // Ids: 1..=n, unique, one location per function, one function per distinct name.
        let location_ids: Vec<u64> = pprof.location.iter().map(|l| l.id).collect();
        let function_ids: Vec<u64> = pprof.function.iter().map(|f| f.id).collect();
        assert_eq!(
            location_ids,
            (1..=pprof.location.len() as u64).collect::<Vec<_>>()
        );
        assert_eq!(function_ids, location_ids);
        let names: HashSet<&str> = pprof.function.iter().map(|f| string(&pprof, f.name)).collect();
        assert_eq!(names.len(), pprof.function.len(), "function names are distinct");
        let expected_names: HashSet<String> = profile
            .samples
            .iter()
            .flat_map(|s| s.frames.iter().map(display_name))
            .collect();
        assert_eq!(names, expected_names.iter().map(String::as_str).collect());
        // The string table has no duplicates.
        let strings: HashSet<&String> = pprof.string_table.iter().collect();
        assert_eq!(strings.len(), pprof.string_table.len());

        // Samples: the two identical stacks merged, leaf first, values count and count*period.
        let decoded: Vec<DecodedSample> = pprof
            .sample
            .iter()
            .map(|s| (stack(&pprof, s), labels(&pprof, s), s.value.clone()))
            .collect();
        let pid = |p: &str| vec![("pid".to_string(), p.to_string())];
        let leaf_first = |leaves: &[&str]| -> Vec<String> {
            leaves
                .iter()
                .chain(&["exec_simple_query", "PostmasterMain", "main"])
                .map(|s| s.to_string())
                .collect()
        };
        let expected = vec![
            (
                leaf_first(&["ExecScan", "ExecProcNode", "ExecProcNode"]),
                pid("43"),
                vec![4, 4 * period],
            ),
            (leaf_first(&["LockRelationOid"]), pid("42"), vec![4, 4 * period]),
            (
                leaf_first(&["tcp_recvmsg_[k]", "__libc_recv"]),
                pid("43"),
                vec![2, 2 * period],
            ),
            (leaf_first(&["_bt_getroot"]), pid("42"), vec![5, 5 * period]),
        ];
        assert_eq!(decoded, expected);
    }

    #[test]
    fn encoding_is_independent_of_sample_order() {
        let mut reversed = small_profile();
        reversed.samples.reverse();
        assert_eq!(
            encode_pprof_gzip(&small_profile()).unwrap(),
            encode_pprof_gzip(&reversed).unwrap()
        );
    }

    #[test]
    fn empty_stacks_zero_counts_and_empty_profiles() {
        let profile = Profile {
            meta: ProfileMeta::cpu(100, 0, 0),
            samples: vec![sample(vec![], &[], 2), sample(vec![user("f")], &[], 0)],
        };
        let pprof = decode(&encode_pprof_gzip(&profile).unwrap());
        assert_eq!(pprof.sample.len(), 1);
        assert_eq!(stack(&pprof, &pprof.sample[0]), ["[unknown]"]);
        assert_eq!(pprof.sample[0].value, [2, 2 * 10_000_000]);

        let empty = Profile {
            meta: ProfileMeta::cpu(100, 0, 0),
            samples: vec![],
        };
        let pprof = decode(&encode_pprof_gzip(&empty).unwrap());
        assert!(pprof.sample.is_empty() && pprof.location.is_empty());
        assert_eq!(pprof.string_table[0], "");
        assert_eq!(pprof.sample_type.len(), 2);
    }

    #[test]
    fn values_that_overflow_int64_are_errors() {
        let profile = Profile {
            meta: ProfileMeta::cpu(1, 0, 0),
            samples: vec![sample(vec![user("f")], &[], u64::MAX / 2)],
        };
        let error = encode_pprof_gzip(&profile).unwrap_err();
        assert!(
            matches!(
                error,
                Error::PprofOverflow {
                    field: "sample value",
                    ..
                }
            ),
            "{error}"
        );
        assert_eq!(
            error.to_string(),
            format!("sample value {} does not fit in a pprof int64", u64::MAX)
        );
    }
}
