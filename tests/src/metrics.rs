//! A strict parser for the Prometheus text exposition format (0.0.4) and its OpenMetrics 1.0
//! text variant (what `prometheus-client` writes: `# EOF` last, counters as `<name>_total`,
//! `# UNIT` lines). It rejects what a scraper would reject — bad names, bad label syntax or
//! escapes, unparsable values, samples without or before their `# TYPE`, duplicate series,
//! metadata for a family given twice — and checks histogram invariants: cumulative buckets,
//! an `+Inf` bucket equal to `_count`.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, ensure, Context, Result};

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A metric family: its `# TYPE`, `# HELP` and samples.
#[derive(Debug, Clone, Default)]
pub struct Family {
    pub kind: String,
    pub help: Option<String>,
    pub unit: Option<String>,
    pub samples: Vec<Sample>,
}

/// A parsed exposition.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub families: BTreeMap<String, Family>,
    pub openmetrics: bool,
}

const SUFFIXES: &[(&str, &[&str])] = &[
    ("counter", &["_total", "_created"]),
    ("histogram", &["_bucket", "_sum", "_count", "_created"]),
    ("gaugehistogram", &["_bucket", "_gsum", "_gcount"]),
    ("summary", &["_sum", "_count", "_created"]),
    ("info", &["_info"]),
];

fn valid_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_value(s: &str) -> Result<f64> {
    match s {
        "+Inf" | "Inf" | "+inf" | "inf" => Ok(f64::INFINITY),
        "-Inf" | "-inf" => Ok(f64::NEG_INFINITY),
        "NaN" | "nan" => Ok(f64::NAN),
        _ => s.parse::<f64>().with_context(|| format!("bad value {s:?}")),
    }
}

/// The state of [`Metrics::parse`] between lines.
struct Parser {
    m: Metrics,
    seen_series: BTreeSet<String>,
    eof: bool,
    /// Families whose lines have ended: none of theirs may follow.
    finished: BTreeSet<String>,
    /// The family whose lines are being read.
    current: Option<String>,
}

impl Parser {
    /// Lines of `family` start or go on here; the family before it is finished.
    fn enter(&mut self, family: &str) {
        if self.current.as_deref() != Some(family) {
            if let Some(prev) = self.current.replace(family.to_owned()) {
                self.finished.insert(prev);
            }
        }
    }

    /// A `#` line (`rest` is what follows the `#`): `# EOF`, `TYPE`, `HELP`, `UNIT` or (not in
    /// OpenMetrics) any other comment.
    fn comment(&mut self, ln: usize, line: &str, rest: &str) -> Result<()> {
        if rest == " EOF" {
            self.eof = true;
            return Ok(());
        }
        let mut parts = rest.trim_start().splitn(3, ' ');
        let keyword = parts.next().unwrap_or_default();
        if !matches!(keyword, "TYPE" | "HELP" | "UNIT") {
            ensure!(
                !self.m.openmetrics,
                "line {ln}: unknown comment in OpenMetrics: {line:?}"
            );
            return Ok(());
        }
        let name = parts
            .next()
            .with_context(|| format!("line {ln}: {keyword} without a name"))?;
        ensure!(
            valid_metric_name(name),
            "line {ln}: bad metric name {name:?}"
        );
        let arg = parts.next().unwrap_or_default();
        ensure!(
            !self.finished.contains(name),
            "line {ln}: metadata for {name} after its samples ended"
        );
        self.enter(name);
        let fam = self.m.families.entry(name.to_owned()).or_default();
        metadata(fam, ln, keyword, name, arg)
    }

    /// A sample line.
    fn sample(&mut self, ln: usize, line: &str) -> Result<()> {
        let sample = parse_sample(line).with_context(|| format!("line {ln}: {line:?}"))?;
        let family = self.m.family_of(&sample.name).with_context(|| {
            format!("line {ln}: sample {} has no # TYPE before it", sample.name)
        })?;
        ensure!(
            !self.finished.contains(&family),
            "line {ln}: samples of {family} are not contiguous"
        );
        self.enter(&family);
        let key = format!("{}{:?}", sample.name, sample.labels);
        ensure!(
            self.seen_series.insert(key),
            "line {ln}: duplicate series {} {:?}",
            sample.name,
            sample.labels
        );
        self.m
            .families
            .get_mut(&family)
            .context("family exists")?
            .samples
            .push(sample);
        Ok(())
    }
}

/// One `TYPE`, `HELP` or `UNIT` line of family `name`.
fn metadata(fam: &mut Family, ln: usize, keyword: &str, name: &str, arg: &str) -> Result<()> {
    match keyword {
        "TYPE" => {
            ensure!(fam.kind.is_empty(), "line {ln}: second TYPE for {name}");
            ensure!(
                fam.samples.is_empty(),
                "line {ln}: TYPE for {name} after its samples"
            );
            let known = [
                "counter",
                "gauge",
                "histogram",
                "summary",
                "untyped",
                "unknown",
                "gaugehistogram",
                "info",
                "stateset",
            ];
            ensure!(known.contains(&arg), "line {ln}: unknown type {arg:?}");
            fam.kind = arg.to_owned();
        }
        "HELP" => {
            ensure!(fam.help.is_none(), "line {ln}: second HELP for {name}");
            fam.help = Some(arg.to_owned());
        }
        _ => {
            ensure!(
                name.ends_with(&format!("_{arg}")),
                "line {ln}: UNIT {arg} is not a suffix of {name}"
            );
            fam.unit = Some(arg.to_owned());
        }
    }
    Ok(())
}

impl Metrics {
    /// Parses an exposition; `content_type` decides whether OpenMetrics rules apply.
    pub fn parse(text: &str, content_type: &str) -> Result<Self> {
        let openmetrics = content_type.contains("application/openmetrics-text");
        let mut p = Parser {
            m: Metrics {
                openmetrics,
                ..Metrics::default()
            },
            seen_series: BTreeSet::new(),
            eof: false,
            finished: BTreeSet::new(),
            current: None,
        };
        for (i, line) in text.lines().enumerate() {
            let ln = i + 1;
            ensure!(!p.eof, "line {ln}: content after # EOF");
            if line.is_empty() {
                ensure!(!openmetrics, "line {ln}: empty line in OpenMetrics");
                continue;
            }
            if let Some(rest) = line.strip_prefix('#') {
                p.comment(ln, line, rest)?;
            } else {
                p.sample(ln, line)?;
            }
        }
        let m = p.m;
        ensure!(
            !openmetrics || p.eof,
            "OpenMetrics exposition without # EOF"
        );
        for (name, fam) in &m.families {
            ensure!(
                !fam.kind.is_empty() || !openmetrics,
                "{name}: HELP/UNIT without TYPE"
            );
            if fam.kind == "histogram" {
                check_histogram(name, fam)?;
            }
        }
        Ok(m)
    }

    /// The family a sample name belongs to (TYPE seen before).
    fn family_of(&self, sample: &str) -> Option<String> {
        if self
            .families
            .get(sample)
            .is_some_and(|f| !f.kind.is_empty() && f.kind != "counter" && f.kind != "info")
        {
            return Some(sample.to_owned());
        }
        for (kind, suffixes) in SUFFIXES {
            for suffix in *suffixes {
                if let Some(base) = sample.strip_suffix(suffix) {
                    if self.families.get(base).is_some_and(|f| f.kind == *kind) {
                        return Some(base.to_owned());
                    }
                }
            }
        }
        // Prometheus 0.0.4 counters are typed under their full name.
        self.families
            .get(sample)
            .filter(|f| !f.kind.is_empty() && !self.openmetrics)
            .map(|_| sample.to_owned())
    }

    /// All samples with this exact name.
    pub fn samples<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.families
            .values()
            .flat_map(|f| f.samples.iter())
            .filter(move |s| s.name == name)
    }

    /// The value of the sample `name` whose labels include all of `labels`; errors if none or
    /// several match.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        let found: Vec<&Sample> = self
            .samples(name)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
            })
            .collect();
        match found.as_slice() {
            [one] => Ok(one.value),
            [] => bail!("no sample {name}{labels:?}"),
            many => bail!("{} samples match {name}{labels:?}", many.len()),
        }
    }

    /// Like [`Metrics::value`], but 0 when no sample matches (a labelled counter that was never
    /// incremented may be absent).
    pub fn value_or_zero(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        if self.samples(name).any(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        }) {
            self.value(name, labels)
        } else {
            Ok(0.0)
        }
    }

    /// Sum over the samples `name` whose labels include all of `labels` (0 when none does):
    /// for a counter split by a label the test does not care about, such as a trip's
    /// `initiator`.
    pub fn sum_where(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples(name)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
            })
            .map(|s| s.value)
            .sum()
    }

    /// Sum over every sample with this exact name.
    pub fn sum(&self, name: &str) -> f64 {
        self.samples(name).map(|s| s.value).sum()
    }

    /// `_count` of a histogram family, summed over its label sets.
    pub fn histogram_count(&self, family: &str) -> Result<f64> {
        let fam = self
            .families
            .get(family)
            .with_context(|| format!("no family {family}"))?;
        ensure!(fam.kind == "histogram", "{family} is a {}", fam.kind);
        Ok(self.sum(&format!("{family}_count")))
    }

    /// Cumulative buckets `(le, count)` of an unlabelled histogram.
    pub fn buckets(&self, family: &str) -> Vec<(f64, f64)> {
        let name = format!("{family}_bucket");
        let mut b: Vec<(f64, f64)> = self
            .samples(&name)
            .filter_map(|s| {
                s.labels
                    .get("le")
                    .and_then(|le| parse_value(le).ok())
                    .map(|le| (le, s.value))
            })
            .collect();
        b.sort_by(|x, y| x.0.total_cmp(&y.0));
        b
    }
}

fn check_histogram(name: &str, fam: &Family) -> Result<()> {
    // Group buckets by the label set without `le`.
    let mut groups: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut counts: BTreeMap<String, f64> = BTreeMap::new();
    for s in &fam.samples {
        let mut rest = s.labels.clone();
        let le = rest.remove("le");
        let key = format!("{rest:?}");
        if s.name == format!("{name}_bucket") {
            let le = le.with_context(|| format!("{name}_bucket without le"))?;
            groups
                .entry(key)
                .or_default()
                .push((parse_value(&le)?, s.value));
        } else if s.name == format!("{name}_count") {
            counts.insert(key, s.value);
        }
    }
    for (key, mut buckets) in groups {
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        ensure!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "{name}{key}: buckets are not cumulative: {buckets:?}"
        );
        let last = buckets.last().context("at least one bucket")?;
        ensure!(last.0 == f64::INFINITY, "{name}{key}: no +Inf bucket");
        let count = counts
            .get(&key)
            .with_context(|| format!("{name}{key}: no _count"))?;
        ensure!(
            last.1 == *count,
            "{name}{key}: +Inf bucket {} != _count {count}",
            last.1
        );
    }
    Ok(())
}

fn parse_sample(line: &str) -> Result<Sample> {
    let name_end = line.find(['{', ' ']).context("no value")?;
    let name = &line[..name_end];
    ensure!(valid_metric_name(name), "bad metric name {name:?}");
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices().peekable();
        let end;
        loop {
            // label name
            let start = match chars.peek() {
                Some(&(_, '}')) => {
                    end = chars.next().map(|(i, _)| i + 1);
                    break;
                }
                Some(&(i, _)) => i,
                None => bail!("unterminated label set"),
            };
            let mut eq = None;
            for (i, c) in chars.by_ref() {
                if c == '=' {
                    eq = Some(i);
                    break;
                }
            }
            let eq = eq.context("label without '='")?;
            let lname = &after[start..eq];
            ensure!(valid_label_name(lname), "bad label name {lname:?}");
            ensure!(
                chars.next().map(|c| c.1) == Some('"'),
                "label value of {lname} is not quoted"
            );
            let mut value = String::new();
            loop {
                match chars.next().map(|c| c.1) {
                    Some('\\') => match chars.next().map(|c| c.1) {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => bail!("bad escape \\{other:?} in label {lname}"),
                    },
                    Some('"') => break,
                    Some('\n') | None => bail!("unterminated value of label {lname}"),
                    Some(c) => value.push(c),
                }
            }
            ensure!(
                labels.insert(lname.to_owned(), value).is_none(),
                "label {lname} given twice"
            );
            match chars.next().map(|c| c.1) {
                Some(',') => {}
                Some('}') => {
                    end = chars.peek().map_or(Some(after.len()), |&(i, _)| Some(i));
                    break;
                }
                other => bail!("expected ',' or '}}' after label {lname}, got {other:?}"),
            }
        }
        rest = &after[end.context("label set end")?..];
    }
    let mut fields = rest.split(' ');
    ensure!(fields.next() == Some(""), "no space before the value");
    let value = parse_value(fields.next().context("no value")?)?;
    if let Some(ts) = fields.next() {
        ts.parse::<f64>()
            .with_context(|| format!("bad timestamp {ts:?}"))?;
    }
    ensure!(fields.next().is_none(), "trailing fields");
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OM: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

    #[test]
    fn parses_openmetrics_from_client_rust() {
        let text = "# HELP haltd_watchdog_trips Trips.\n# TYPE haltd_watchdog_trips counter\n\
                    haltd_watchdog_trips_total{cause=\"OPERATOR_TRIP\"} 3\n\
                    # HELP haltd_halt_latency_seconds Latency.\n# TYPE haltd_halt_latency_seconds histogram\n# UNIT haltd_halt_latency_seconds seconds\n\
                    haltd_halt_latency_seconds_sum 0.5\nhaltd_halt_latency_seconds_count 3\n\
                    haltd_halt_latency_seconds_bucket{le=\"0.1\"} 1\nhaltd_halt_latency_seconds_bucket{le=\"+Inf\"} 3\n\
                    # TYPE g gauge\ng{a=\"x\\\"y\",b=\"\\\\\"} 1.5e3\n# EOF\n";
        let m = Metrics::parse(text, OM).expect("parses");
        assert_eq!(
            m.value("haltd_watchdog_trips_total", &[("cause", "OPERATOR_TRIP")])
                .expect("one"),
            3.0
        );
        assert_eq!(
            m.histogram_count("haltd_halt_latency_seconds")
                .expect("hist"),
            3.0
        );
        assert_eq!(
            m.value("g", &[("a", "x\"y"), ("b", "\\")])
                .expect("escapes"),
            1500.0
        );
        assert_eq!(
            m.value_or_zero("haltd_watchdog_trips_total", &[("cause", "HEARTBEAT_LOST")])
                .expect("zero"),
            0.0
        );
    }

    #[test]
    fn rejects_malformed() {
        let bad = [
            "# TYPE a counter\na_total 1\n",     // no EOF
            "a_total 1\n# EOF\n",                // no TYPE
            "# TYPE a gauge\na{x=1} 1\n# EOF\n", // unquoted
            "# TYPE a gauge\na 1 2 3\n# EOF\n",  // trailing
            "# TYPE a gauge\na one\n# EOF\n",    // value
            "# TYPE a gauge\na 1\na 2\n# EOF\n", // duplicate
            "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n# EOF\n", // not cumulative
            "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 1\n# EOF\n", // count
        ];
        for text in bad {
            assert!(Metrics::parse(text, OM).is_err(), "accepted {text:?}");
        }
        assert!(Metrics::parse(
            "# TYPE a_total counter\na_total 1\n",
            "text/plain; version=0.0.4"
        )
        .is_ok());
    }
}
