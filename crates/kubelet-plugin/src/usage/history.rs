//! What each prepared claim used over its life, per device: the figures right-sizing advice
//! needs (`gpu-dra advise`), kept across samples and across plugin restarts.
//!
//! Per (claim UID, device UUID): the first and last sample time, the sample count, the peak
//! memory used (exact), the peak SM utilisation, and a histogram each of memory used and of SM
//! utilisation, from which a high percentile (p95) is read. A sample whose device NVML did not
//! read adds nothing; a sample without an SM figure (MIG devices) adds to the memory figures
//! only, so the SM percentile has its own count.
//!
//! Why fixed buckets: a claim may live for weeks at one sample per interval (40,000 samples a
//! week at 15 s), so keeping samples is unbounded, and a streaming quantile sketch (P², t-digest)
//! is harder to merge, persist and reason about than counts per fixed bucket. SM utilisation is
//! an integer percentage: 101 exact buckets. Memory uses log-linear buckets, 16 per power of
//! two from 1 MiB up (everything below 1 MiB in one bucket, everything near 2^52 bytes and above
//! in the last), so a bucket is at most 1/16 (6.25 %) of its lower bound wide: at most 513 buckets,
//! kept sparse (only those seen). A percentile is the upper bound of the bucket it falls in,
//! capped at the exact peak: it may overstate memory by up to 6.25 %, never understate it.
//!
//! Persistence: the whole history is one JSON file in the plugin folder
//! ([`crate::node_layout::NodeFolders::usage_history`]), replaced atomically every
//! [`WRITE_EVERY`] samples and when the sampler stops, and read when the plugin starts; a
//! crash loses at most those samples. Entries exist only for claims prepared at the last
//! sample (bounded by what the node can prepare, and at most [`MAX_ENTRIES`]); an unprepared
//! claim's entry is gone at the next sample and from the file at the next write. The file has
//! no checksum for the reason the checkpoint has none (an atomic replace never tears it); a
//! file that cannot be read or parsed is reported and history starts empty: advice then waits
//! for new samples, nothing else depends on it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ClaimDeviceUsage;

/// Samples between two writes of the history file.
pub const WRITE_EVERY: u64 = 20;

/// The most (claim, device) entries kept: far above what one node prepares (a GPU shared by
/// time-slicing holds at most a few dozen claims), so it only bounds a damaged file.
pub const MAX_ENTRIES: usize = 4096;

/// The format version this plugin writes and reads.
pub const VERSION: u32 = 1;

/// The percentile the metrics and advice read.
pub const PERCENTILE: f64 = 0.95;

/// Counts per bucket, sparse.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Histogram(BTreeMap<u16, u64>);

impl Histogram {
    fn add(&mut self, bucket: u16) {
        *self.0.entry(bucket).or_insert(0) += 1;
    }

    fn count(&self) -> u64 {
        self.0.values().sum()
    }

    /// The bucket holding quantile `q` (0..=1): the smallest bucket with at least
    /// `ceil(q * count)` samples at or below it.
    fn quantile_bucket(&self, q: f64) -> Option<u16> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (b, c) in &self.0 {
            seen += c;
            if seen >= rank {
                return Some(*b);
            }
        }
        self.0.keys().next_back().copied()
    }
}

/// Below this, memory is one bucket (1 MiB).
const MEMORY_FLOOR_LOG2: u32 = 20;
/// Sub-buckets per power of two (log2).
const SUB_LOG2: u32 = 4;
/// From 2^this bytes up, memory is one last bucket.
const MEMORY_CEILING_LOG2: u32 = 51;

/// The memory bucket of `bytes`.
pub fn memory_bucket(bytes: u64) -> u16 {
    if bytes < 1 << MEMORY_FLOOR_LOG2 {
        return 0;
    }
    let e = (63 - bytes.leading_zeros()).min(MEMORY_CEILING_LOG2);
    let sub = if e == MEMORY_CEILING_LOG2 && bytes >> MEMORY_CEILING_LOG2 > 1 {
        (1 << SUB_LOG2) - 1
    } else {
        (bytes >> (e - SUB_LOG2)) & ((1 << SUB_LOG2) - 1)
    };
    // e - floor <= 31, sub < 16: at most 1 + 31 * 16 + 15 = 512.
    (1 + (e - MEMORY_FLOOR_LOG2) as u64 * (1 << SUB_LOG2) + sub) as u16
}

/// The largest value of memory bucket `b` (bytes).
pub fn memory_bucket_upper(b: u16) -> u64 {
    if b == 0 {
        return (1 << MEMORY_FLOOR_LOG2) - 1;
    }
    let i = u64::from(b - 1);
    let e = MEMORY_FLOOR_LOG2 as u64 + i / (1 << SUB_LOG2);
    let sub = i % (1 << SUB_LOG2);
    if e >= MEMORY_CEILING_LOG2 as u64 && sub == (1 << SUB_LOG2) - 1 {
        return u64::MAX;
    }
    (((1 << SUB_LOG2) + sub + 1) << (e - SUB_LOG2 as u64)) - 1
}

/// What one claim used of one device so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceHistory {
    /// Claim UID.
    #[serde(rename = "claimUID")]
    pub claim_uid: String,
    /// Device UUID.
    pub uuid: String,
    /// Unix seconds of the first sample with figures.
    pub first_sample: i64,
    /// Unix seconds of the last sample with figures.
    pub last_sample: i64,
    /// Samples with figures.
    pub samples: u64,
    /// Most memory its processes held at one sample, in bytes.
    pub peak_used_bytes: u64,
    /// Memory used, per bucket ([`memory_bucket`]).
    pub memory: Histogram,
    /// Highest SM utilisation seen, in percent (`None`: never exposed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_sm_percent: Option<u32>,
    /// SM utilisation, per percent.
    #[serde(default)]
    pub sm: Histogram,
}

impl DeviceHistory {
    /// Adds one sample at `now`.
    pub fn record(&mut self, now: i64, used: u64, sm: Option<u32>) {
        if self.samples == 0 {
            self.first_sample = now;
        }
        self.samples += 1;
        self.last_sample = now;
        self.peak_used_bytes = self.peak_used_bytes.max(used);
        self.memory.add(memory_bucket(used));
        if let Some(sm) = sm {
            let sm = sm.min(100);
            self.peak_sm_percent = Some(self.peak_sm_percent.unwrap_or(0).max(sm));
            self.sm.add(sm as u16);
        }
    }

    /// The p95 of memory used, rounded up to its bucket's bound and capped at the peak.
    pub fn memory_p95_bytes(&self) -> Option<u64> {
        self.memory
            .quantile_bucket(PERCENTILE)
            .map(|b| memory_bucket_upper(b).min(self.peak_used_bytes))
    }

    /// The p95 of SM utilisation (`None` where NVML never gave an SM figure).
    pub fn sm_p95_percent(&self) -> Option<u32> {
        self.sm.quantile_bucket(PERCENTILE).map(u32::from)
    }

    /// Seconds between the first and the last sample.
    pub fn covered_seconds(&self) -> u64 {
        u64::try_from(self.last_sample.saturating_sub(self.first_sample)).unwrap_or(0)
    }
}

/// The history of every prepared claim's devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct History {
    entries: BTreeMap<(String, String), DeviceHistory>,
}

/// The file's content.
#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    entries: Vec<DeviceHistory>,
}

/// Why a history file was not loaded.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// Not JSON of the expected shape.
    #[error("usage history is not valid: {0}")]
    Parse(#[from] serde_json::Error),
    /// Written by a plugin with another format.
    #[error("usage history has version {0}; this plugin reads version {VERSION}")]
    Version(u32),
}

impl History {
    /// Adds the figures of one sample at `now` (Unix seconds) and forgets the devices of
    /// claims not in `usage` (no longer prepared).
    pub fn record(&mut self, usage: &[ClaimDeviceUsage], now: i64) {
        let keep: std::collections::BTreeSet<(&str, &str)> = usage
            .iter()
            .map(|u| (u.device.claim_uid.as_str(), u.device.uuid.as_str()))
            .collect();
        self.entries
            .retain(|(c, u), _| keep.contains(&(c.as_str(), u.as_str())));
        for u in usage {
            // No pod row: NVML did not read the device at this sample.
            if u.pods.is_empty() {
                continue;
            }
            let used = u.pods.iter().filter_map(|p| p.used_bytes).sum::<u64>();
            let sm = u
                .pods
                .iter()
                .filter_map(|p| p.sm_percent)
                .reduce(|a, b| a.saturating_add(b))
                .map(|s| s.min(100));
            let key = (u.device.claim_uid.clone(), u.device.uuid.clone());
            if !self.entries.contains_key(&key) && self.entries.len() >= MAX_ENTRIES {
                continue;
            }
            let entry = self.entries.entry(key).or_insert_with(|| DeviceHistory {
                claim_uid: u.device.claim_uid.clone(),
                uuid: u.device.uuid.clone(),
                ..DeviceHistory::default()
            });
            entry.record(now, used, sm);
        }
    }

    /// The history of `claim_uid` on device `uuid`.
    pub fn get(&self, claim_uid: &str, uuid: &str) -> Option<&DeviceHistory> {
        self.entries.get(&(claim_uid.to_owned(), uuid.to_owned()))
    }

    /// How many (claim, device) entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let file = File {
            version: VERSION,
            entries: self.entries.values().cloned().collect(),
        };
        serde_json::to_vec(&file).unwrap_or_default()
    }

    /// A history from a file's bytes; at most [`MAX_ENTRIES`] entries are taken.
    pub fn from_bytes(bytes: &[u8]) -> Result<History, HistoryError> {
        #[derive(Deserialize)]
        struct Head {
            version: u32,
        }
        let head: Head = serde_json::from_slice(bytes)?;
        if head.version != VERSION {
            return Err(HistoryError::Version(head.version));
        }
        let file: File = serde_json::from_slice(bytes)?;
        Ok(History {
            entries: file
                .entries
                .into_iter()
                .take(MAX_ENTRIES)
                .map(|e| ((e.claim_uid.clone(), e.uuid.clone()), e))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_buckets_are_at_most_a_sixteenth_wide_and_bound_their_values() {
        let mut last = 0;
        for v in [
            0u64,
            1,
            (1 << 20) - 1,
            1 << 20,
            (1 << 20) + 1,
            3 << 30,
            (10 << 30) + 12345,
            80 << 30,
            141 << 30,
            1 << 50,
            (1 << 51) + 7,
            u64::MAX,
        ] {
            let b = memory_bucket(v);
            assert!(b >= last, "buckets grow with the value: {v}");
            last = b;
            let upper = memory_bucket_upper(b);
            assert!(upper >= v, "{v} above its bucket's bound {upper}");
            if (1 << 20..1 << 51).contains(&v) {
                assert!(
                    (upper - v) as f64 <= v as f64 / 16.0,
                    "{v}: bound {upper} more than 1/16 above"
                );
                if b > 1 {
                    assert!(memory_bucket_upper(b - 1) < v, "{v} fits the bucket below");
                }
            }
        }
        assert!(memory_bucket(u64::MAX) <= 512);
    }

    fn usage_row(claim: &str, used: Option<u64>, sm: Option<u32>) -> ClaimDeviceUsage {
        ClaimDeviceUsage {
            device: super::super::ClaimDevice {
                claim_uid: claim.into(),
                namespace: "ns".into(),
                name: claim.into(),
                device: "gpu-0".into(),
                pool: "node-a".into(),
                uuid: "GPU-0".into(),
                strategy: String::new(),
                share_bytes: None,
                mig_profile: String::new(),
                admin_access: false,
            },
            allocated_bytes: Some(80 << 30),
            device_utilization_percent: None,
            pods: used
                .map(|u| super::super::PodUsage {
                    pod: "p".into(),
                    container: "c".into(),
                    used_bytes: Some(u),
                    sm_percent: sm,
                    processes: 1,
                })
                .into_iter()
                .collect(),
            active: true,
        }
    }

    #[test]
    fn the_p95_ignores_a_rare_spike_the_peak_keeps_it() {
        let mut h = History::default();
        // 100 samples at 2 GiB and 10 % SM, then 3 spikes to 30 GiB and 90 %.
        for t in 0..100 {
            h.record(&[usage_row("c1", Some(2 << 30), Some(10))], 1000 + t * 15);
        }
        for t in 100..103 {
            h.record(&[usage_row("c1", Some(30 << 30), Some(90))], 1000 + t * 15);
        }
        let e = h.get("c1", "GPU-0").expect("entry");
        assert_eq!(e.samples, 103);
        assert_eq!(e.peak_used_bytes, 30 << 30);
        assert_eq!(e.peak_sm_percent, Some(90));
        assert_eq!(e.sm_p95_percent(), Some(10));
        let p95 = e.memory_p95_bytes().expect("p95");
        assert!(
            (2 << 30..=(2 << 30) + (2 << 30) / 16).contains(&p95),
            "p95 {p95}"
        );
        assert_eq!((e.first_sample, e.last_sample), (1000, 1000 + 102 * 15));
        assert_eq!(e.covered_seconds(), 102 * 15);

        // Once more than 5 % of the samples are high, the p95 is high.
        for t in 103..110 {
            h.record(&[usage_row("c1", Some(30 << 30), Some(90))], 1000 + t * 15);
        }
        let e = h.get("c1", "GPU-0").expect("entry");
        assert_eq!(e.sm_p95_percent(), Some(90));
        assert_eq!(e.memory_p95_bytes(), Some(30 << 30), "capped at the peak");
    }

    #[test]
    fn a_device_not_read_adds_nothing_and_an_unprepared_claim_is_forgotten() {
        let mut h = History::default();
        h.record(&[usage_row("c1", Some(1 << 30), None)], 10);
        h.record(&[usage_row("c1", None, None)], 25);
        let e = h.get("c1", "GPU-0").expect("entry");
        assert_eq!((e.samples, e.last_sample), (1, 10));
        assert_eq!(e.sm_p95_percent(), None, "no SM figure, no SM percentile");
        h.record(&[usage_row("c2", Some(1), None)], 40);
        assert!(h.get("c1", "GPU-0").is_none());
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn the_file_round_trips_and_a_foreign_version_is_refused() {
        let mut h = History::default();
        for t in 0..5 {
            h.record(&[usage_row("c1", Some(t << 30), Some(t as u32))], t as i64);
        }
        let back = History::from_bytes(&h.to_bytes()).expect("parse");
        assert_eq!(back, h);
        let err = History::from_bytes(br#"{"version":2,"entries":[]}"#).expect_err("v2");
        assert!(err.to_string().contains("version 2"), "{err}");
        assert!(History::from_bytes(b"{").is_err());
    }
}
