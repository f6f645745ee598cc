//! What the CLI prints: the dry-run report (text and `--json`) and the families table.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::family::Family;
use crate::install::Prepared;
use crate::plan::{Census, Dest, OutputTotals, Plan};

/// The `--json` document of `gturbo install --dry-run` (`schema_version` 1).
///
/// Fields: `family`, `family_picked_by` (the sentence saying config.json picked the
/// family, or null when a flag or the target named it), `source` (`describe`, `repo`, `revision`, `commit`,
/// `index_sha256`, `index_pinned`), `shards` (count, bytes, and `published_sha256`:
/// how many have a published SHA-256 to verify against), `requests` (made so
/// far: total, for headers, retries), `reads` (planned range requests and source
/// bytes they fetch), `outputs` (bytes per file kind, total, file count),
/// `resident_entries`, `expert_pools` (count, experts, stride per group),
/// `row_pools` (file, shards, rows per block, row bytes, bytes), `sidecars`,
/// `excluded_tensors`, `census` (int4 / int8 / passthrough / excluded: tensors,
/// params, bytes, and `other` by scheme label), `quant` (`profile`: the quant profile
/// used, `source` for a pre-quantized source; `auto`: what `--quant auto` chose and
/// why, or null; `footprint_bytes`: resident + working set), `parameters`,
/// `fingerprint`, `warnings`, `elapsed_s`.
#[derive(Debug, Serialize)]
pub struct DryRunReport {
    schema_version: u32,
    family: String,
    family_name: String,
    /// Why the family was chosen when no flag named it (config.json's `model_type`),
    /// else null.
    family_picked_by: Option<String>,
    out: String,
    source: SourceReport,
    shards: ShardsReport,
    requests: RequestsReport,
    reads: ReadsReport,
    outputs: OutputTotals,
    resident_entries: usize,
    expert_pools: Vec<PoolGroup>,
    row_pools: Vec<RowPoolReport>,
    sidecars: Vec<String>,
    tensors: usize,
    excluded_tensors: u64,
    census: Census,
    quant: QuantReport,
    parameters: u64,
    fingerprint: String,
    warnings: Vec<String>,
    elapsed_s: f64,
}

#[derive(Debug, Serialize)]
struct QuantReport {
    profile: String,
    auto: Option<crate::plan::AutoChoice>,
    footprint_bytes: u64,
}

#[derive(Debug, Serialize)]
struct SourceReport {
    describe: String,
    repo: String,
    revision: String,
    commit: Option<String>,
    index_sha256: Option<String>,
    index_pinned: bool,
    index_total_size: Option<u64>,
}

#[derive(Debug, Serialize)]
struct ShardsReport {
    count: usize,
    bytes: u64,
    /// Shards the source publishes a SHA-256 for (the install verifies those).
    published_sha256: usize,
}

#[derive(Debug, Serialize)]
struct RequestsReport {
    total: u64,
    headers: u64,
    retries: u64,
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct ReadsReport {
    range_requests: usize,
    source_bytes: u64,
}

/// Expert pools with the same geometry, grouped for display.
#[derive(Debug, Serialize)]
struct PoolGroup {
    sidecar: Option<String>,
    files: usize,
    experts: u64,
    blob_bytes: u64,
    stride: u64,
    scheme: String,
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct RowPoolReport {
    file: String,
    shards: usize,
    rows: u64,
    width: u64,
    row_bytes: u64,
    rows_per_block: u64,
    scheme: String,
    bytes: u64,
}

impl DryRunReport {
    /// Build the report from a prepared install.
    pub fn new(family: &Family, describe: &str, p: &Prepared, out: &Path) -> DryRunReport {
        let plan = &p.plan;
        let c = &plan.census;
        DryRunReport {
            schema_version: 1,
            family: family.id().into(),
            family_name: family.file.name.clone(),
            family_picked_by: None,
            out: out.display().to_string(),
            source: SourceReport::new(describe, p),
            shards: ShardsReport {
                count: plan.shards.len(),
                bytes: plan.shards.iter().map(|s| s.size).sum(),
                published_sha256: plan.shards.iter().filter(|s| s.sha256.is_some()).count(),
            },
            requests: RequestsReport {
                total: p.stats.requests,
                headers: p.header_requests,
                retries: p.stats.retries,
                bytes: p.stats.bytes,
            },
            reads: ReadsReport {
                range_requests: plan.reads.len(),
                source_bytes: plan.source_bytes_read(),
            },
            outputs: plan.totals(),
            resident_entries: plan.outputs.resident.index.tensors.len(),
            expert_pools: pool_groups(plan),
            row_pools: row_pools(plan),
            sidecars: sidecars(family, plan),
            tensors: plan.tensors.len(),
            excluded_tensors: c.excluded.tensors,
            census: c.clone(),
            quant: QuantReport {
                profile: if plan.source_quant.is_some() {
                    "source".into()
                } else {
                    plan.options.quant.to_string()
                },
                auto: plan.auto.clone(),
                footprint_bytes: plan.footprint(),
            },
            parameters: c.int4.params
                + c.int8.params
                + c.passthrough.params
                + c.other.values().map(|r| r.params).sum::<u64>(),
            fingerprint: plan.fingerprint(),
            warnings: p.warnings.clone(),
            elapsed_s: p.elapsed.as_secs_f64(),
        }
    }

    /// The report of a family picked by the checkpoint's config.json, saying so.
    pub fn picked_by(self, why: Option<&str>) -> DryRunReport {
        DryRunReport {
            family_picked_by: why.map(str::to_string),
            ..self
        }
    }

    /// The human-readable report.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        self.write_source(&mut s);
        self.write_quant(&mut s);
        self.write_outputs(&mut s);
        self.write_census(&mut s);
        let _ = writeln!(s, "  parameters      {}", thousands(self.parameters));
        let _ = writeln!(s, "  fingerprint     sha256:{}", self.fingerprint);
        let _ = writeln!(s, "  planned in      {:.2} s", self.elapsed_s);
        s
    }

    /// The heading, then where the bytes come from: source, revision, index, shards,
    /// requests made and reads planned.
    fn write_source(&self, s: &mut String) {
        let src = &self.source;
        let _ = writeln!(
            s,
            "gturbo install plan: {} ({})",
            self.family, self.family_name
        );
        let _ = writeln!(s, "  source          {}", src.describe);
        let _ = writeln!(
            s,
            "  revision        {} -> {}",
            src.revision,
            src.commit.as_deref().unwrap_or("(no commit: local folder)")
        );
        let _ = writeln!(
            s,
            "  index sha256    {} ({})",
            src.index_sha256
                .as_deref()
                .unwrap_or("(single-file repo, no index)"),
            if src.index_pinned {
                "matches the pin"
            } else {
                "not pinned"
            }
        );
        let _ = writeln!(
            s,
            "  shards          {} files, {} ({} with a published SHA-256)",
            self.shards.count,
            bytes(self.shards.bytes),
            self.shards.published_sha256
        );
        let _ = writeln!(
            s,
            "  requests made   {} ({} for {} shard headers, {} retries)",
            self.requests.total, self.requests.headers, self.shards.count, self.requests.retries
        );
        let _ = writeln!(
            s,
            "  reads planned   {} range requests, {} of source",
            self.reads.range_requests,
            bytes(self.reads.source_bytes)
        );
    }

    /// The quant profile (and why auto chose it) and the memory it needs.
    fn write_quant(&self, s: &mut String) {
        let q = &self.quant;
        let _ = match &q.auto {
            Some(a) => writeln!(
                s,
                "  quant           {} (auto chose it: {}; RAM from {})",
                if a.profile == "source" {
                    &q.profile
                } else {
                    &a.profile
                },
                a.reason,
                a.ram_source
            ),
            None if q.profile == "source" => writeln!(
                s,
                "  quant           as published (pre-quantized source, its own widths)"
            ),
            None => writeln!(s, "  quant           {}", q.profile),
        };
        let _ = writeln!(
            s,
            "  memory          {} resident + working set",
            bytes(q.footprint_bytes)
        );
    }

    /// The output folder and its files by kind, then the sidecars.
    fn write_outputs(&self, s: &mut String) {
        let o = &self.outputs;
        let _ = writeln!(s, "  output          {}", self.out);
        let _ = writeln!(
            s,
            "    resident      {:>20}  ({} entries)",
            bytes(o.resident),
            self.resident_entries
        );
        for g in &self.expert_pools {
            let label = match &g.sidecar {
                None => "experts".to_string(),
                Some(sc) => format!("{sc} experts"),
            };
            let _ = writeln!(
                s,
                "    {label:<13} {:>20}  ({} layer files x {} experts, {} blob, stride {} = {} pages, {})",
                bytes(g.bytes),
                g.files,
                g.experts,
                thousands(g.blob_bytes),
                thousands(g.stride),
                g.stride / crate::format::PAGE,
                g.scheme
            );
        }
        for r in &self.row_pools {
            let _ = writeln!(
                s,
                "    rows          {:>20}  ({}: {} shards, {} rows of {} B, {} per 16 KiB block, {})",
                bytes(r.bytes),
                r.file,
                r.shards,
                thousands(r.rows),
                r.row_bytes,
                r.rows_per_block,
                r.scheme
            );
        }
        let _ = writeln!(s, "    tokenizer     {:>20}", bytes(o.copied));
        let _ = writeln!(
            s,
            "    total         {:>20}  ({} files)",
            bytes(o.total),
            o.files
        );
        for sc in &self.sidecars {
            let _ = writeln!(s, "  sidecar         {sc}");
        }
    }

    /// The tensor count and the census rows (int4, int8, passthrough, then the others).
    fn write_census(&self, s: &mut String) {
        let c = &self.census;
        let _ = writeln!(
            s,
            "  tensors         {} ({} excluded, {} of source not installed)",
            self.tensors,
            c.excluded.tensors,
            bytes(c.excluded.bytes)
        );
        let others = c.other.iter().map(|(l, r)| (l.as_str(), r));
        for (label, row) in [
            ("int4_g64", &c.int4),
            ("int8_g64", &c.int8),
            ("passthrough", &c.passthrough),
        ]
        .into_iter()
        .chain(others)
        {
            let _ = writeln!(
                s,
                "  census {label:<12} {:>6} tensors {:>20} params -> {}",
                row.tensors,
                thousands(row.params),
                bytes(row.bytes)
            );
        }
    }
}

impl SourceReport {
    fn new(describe: &str, p: &Prepared) -> SourceReport {
        let source = &p.plan.source;
        SourceReport {
            describe: describe.into(),
            repo: source.repo.clone(),
            revision: source.revision.clone(),
            commit: source.commit.clone(),
            index_sha256: source.index_sha256.clone(),
            index_pinned: p.index_pinned,
            index_total_size: p.index_total_size,
        }
    }
}

/// The expert pools, those with the same sidecar, expert count and stride in one group.
fn pool_groups(plan: &Plan) -> Vec<PoolGroup> {
    let mut groups: Vec<PoolGroup> = Vec::new();
    for pool in &plan.outputs.expert_pools {
        match groups.iter_mut().find(|g| {
            g.sidecar == pool.sidecar && g.experts == pool.experts && g.stride == pool.stride
        }) {
            Some(g) => {
                g.files += 1;
                g.bytes += pool.file_bytes;
            }
            None => groups.push(PoolGroup {
                sidecar: pool.sidecar.clone(),
                files: 1,
                experts: pool.experts,
                blob_bytes: pool.blob_bytes,
                stride: pool.stride,
                scheme: pool.scheme.label(),
                bytes: pool.file_bytes,
            }),
        }
    }
    groups
}

/// The row pools, one row each.
fn row_pools(plan: &Plan) -> Vec<RowPoolReport> {
    plan.outputs
        .row_pools
        .iter()
        .map(|r| RowPoolReport {
            file: r.file.clone(),
            shards: r.shards.len(),
            rows: r.shards.iter().map(|s| s.rows).sum(),
            width: r.width,
            row_bytes: r.row_bytes,
            rows_per_block: r.rows_per_block,
            scheme: r.scheme.label(),
            bytes: r.file_bytes,
        })
        .collect()
}

/// Each of the family's sidecars, `NAME (WHAT): carried` or `skipped`; one the family
/// skips by default also says how much it drops and the flag that keeps it.
fn sidecars(family: &Family, plan: &Plan) -> Vec<String> {
    family
        .file
        .sidecars
        .iter()
        .map(|(name, s)| {
            let opts = &plan.options;
            if !opts.skips_sidecar(family, name) {
                return format!("{name} ({}): carried", s.what);
            }
            if opts.skip_sidecars.contains(name) {
                return format!("{name} ({}): skipped", s.what);
            }
            let why = format!("sidecar `{name}` skipped");
            let (n, b) = plan
                .tensors
                .iter()
                .filter(|t| matches!(&t.dest, Dest::Excluded { why: w } if *w == why))
                .fold((0u64, 0u64), |(n, b), t| (n + 1, b + (t.src[1] - t.src[0])));
            format!(
                "{name} ({}): skipped by default, {n} tensors ({}) of the source not \
                 installed; --keep-{name} keeps them",
                s.what,
                bytes(b)
            )
        })
        .collect()
}

/// `1,234,567,890 B (1.23 GB)`.
fn bytes(n: u64) -> String {
    let human = if n >= 1_000_000_000 {
        format!("{:.2} GB", n as f64 / 1e9)
    } else if n >= 1_000_000 {
        format!("{:.2} MB", n as f64 / 1e6)
    } else if n >= 1_000 {
        format!("{:.2} kB", n as f64 / 1e3)
    } else {
        format!("{n} B")
    };
    format!("{} B ({human})", thousands(n))
}

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One row of `gturbo families`.
#[derive(Debug, Serialize)]
pub struct FamilyRow {
    id: String,
    name: String,
    repo: String,
    revision: Option<String>,
    index_sha256: Option<String>,
    model_types: Vec<String>,
    required_axes: Vec<String>,
    runner: Option<String>,
}

impl FamilyRow {
    /// The row for a family.
    pub fn new(f: &Family) -> FamilyRow {
        FamilyRow {
            id: f.id().into(),
            name: f.file.name.clone(),
            repo: f.file.source.repo.clone(),
            revision: f.file.source.revision.clone(),
            index_sha256: f.file.source.index_sha256.clone(),
            model_types: f.file.model_types.clone(),
            required_axes: f.file.arch.required_axes.clone(),
            // The runner `gturbo run` would use, when it implements every required axis.
            runner: crate::runtime::gate::check(f.id(), &f.file.arch.required_axes)
                .ok()
                .map(|r| r.name.to_string()),
        }
    }
}

/// The families table.
pub fn families_text(rows: &[FamilyRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<16} {:<36} {:<14} {:<10} runner",
        "family", "source repo", "revision pin", "index pin"
    );
    for r in rows {
        let runner = match &r.runner {
            Some(name) => name.clone(),
            None => format!("none (needs {})", r.required_axes.join(", ")),
        };
        let short =
            |h: &Option<String>, n: usize| h.as_deref().map(|c| c[..n.min(c.len())].to_string());
        let _ = writeln!(
            s,
            "{:<16} {:<36} {:<14} {:<10} {runner}",
            r.id,
            r.repo,
            short(&r.revision, 12).unwrap_or_else(|| "-".into()),
            short(&r.index_sha256, 8).unwrap_or_else(|| "-".into()),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_read_exactly_and_humanly() {
        assert_eq!(thousands(359_999_963_128), "359,999,963,128");
        assert_eq!(thousands(0), "0");
        assert_eq!(bytes(2_768_896), "2,768,896 B (2.77 MB)");
    }
}
