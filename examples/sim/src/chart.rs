//! Self-contained HTML pages with inline SVG charts: no script, no style
//! sheet or font from elsewhere, nothing fetched. `kvroute sim run --html`
//! and `kvroute demo` write their reports with it.
//!
//! Three kinds of chart, each returned as an `<svg>` element:
//! * [`bars`]: one bar per label, with optional dashed reference lines;
//! * [`cdf`]: the cumulative distribution of samples, one line per series;
//! * [`stacked_bins`]: counts per bin stacked by category (requests per
//!   endpoint over time).

use std::fmt::Write as _;

/// Series colours, in order (cycled past the end).
pub const PALETTE: [&str; 12] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#17becf", "#393b79", "#8c6d31",
];

/// The colour of series `i`.
#[must_use]
pub fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// Escapes `s` for HTML text and attribute values.
#[must_use]
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;\
margin:24px;color:#222;background:#fff;max-width:1400px}\
h1{font-size:22px;margin:0 0 6px}h2{font-size:17px;margin:28px 0 6px}\
p{font-size:14px;line-height:1.45;max-width:1100px}\
.charts{display:flex;flex-wrap:wrap;gap:12px 24px}\
figure{margin:0;display:table}figcaption{display:table-caption;caption-side:bottom;font-size:13px;color:#555;margin-top:2px}\
pre{font-size:12px;background:#f6f8fa;padding:10px;overflow-x:auto;border-radius:4px}\
svg text{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif}";

/// An HTML page under construction.
#[derive(Debug)]
pub struct Page {
    title: String,
    body: String,
    /// Inside a `<div class="charts">` row.
    in_row: bool,
}

impl Page {
    /// A page titled `title` (also its first heading).
    #[must_use]
    pub fn new(title: &str) -> Self {
        let mut body = String::new();
        let _ = writeln!(body, "<h1>{}</h1>", escape(title));
        Self {
            title: title.to_owned(),
            body,
            in_row: false,
        }
    }

    fn end_row(&mut self) {
        if self.in_row {
            self.body.push_str("</div>\n");
            self.in_row = false;
        }
    }

    /// A section heading.
    pub fn heading(&mut self, text: &str) {
        self.end_row();
        let _ = writeln!(self.body, "<h2>{}</h2>", escape(text));
    }

    /// A paragraph of plain text.
    pub fn paragraph(&mut self, text: &str) {
        self.end_row();
        let _ = writeln!(self.body, "<p>{}</p>", escape(text));
    }

    /// Preformatted text (a text table).
    pub fn preformatted(&mut self, text: &str) {
        self.end_row();
        let _ = writeln!(self.body, "<pre>{}</pre>", escape(text));
    }

    /// A chart with its caption; consecutive charts share a row, wrapping
    /// when the page is narrow.
    pub fn chart(&mut self, svg: &str, caption: &str) {
        if !self.in_row {
            self.body.push_str("<div class=\"charts\">\n");
            self.in_row = true;
        }
        let _ = writeln!(
            self.body,
            "<figure>{svg}<figcaption>{}</figcaption></figure>",
            escape(caption)
        );
    }

    /// The whole document.
    #[must_use]
    pub fn finish(mut self) -> String {
        self.end_row();
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
             <link rel=\"icon\" href=\"data:,\">\n<title>{}</title>\n<style>{STYLE}</style>\n\
             </head>\n<body>\n{}</body>\n</html>\n",
            escape(&self.title),
            self.body
        )
    }
}

/// Chart frame: outer size and the plot area's margins.
#[derive(Clone, Copy, Debug)]
struct Frame {
    width: f64,
    height: f64,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
}

impl Frame {
    fn plot_w(&self) -> f64 {
        self.width - self.left - self.right
    }

    fn plot_h(&self) -> f64 {
        self.height - self.top - self.bottom
    }

    /// `<svg>` open tag, white background and the title.
    fn open(&self, s: &mut String, title: &str) {
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-size="12" role="img"><title>{t}</title>"#,
            w = self.width,
            h = self.height,
            t = escape(title)
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="18" font-size="14" font-weight="600">{}</text>"#,
            self.left,
            escape(title)
        );
    }

    /// Horizontal gridlines and y labels at `ticks` (value, label).
    fn y_grid(&self, s: &mut String, ticks: &[(f64, String)], y_of: impl Fn(f64) -> f64) {
        for (v, label) in ticks {
            let y = y_of(*v);
            let _ = writeln!(
                s,
                r##"<line x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#e3e3e3"/>"##,
                self.left,
                self.width - self.right
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
                self.left - 6.0,
                y + 4.0,
                escape(label)
            );
        }
    }

    fn axis_label_y(&self, s: &mut String, label: &str) {
        let cy = self.top + self.plot_h() / 2.0;
        let _ = writeln!(
            s,
            r##"<text x="14" y="{cy:.1}" text-anchor="middle" fill="#555" transform="rotate(-90 14 {cy:.1})">{}</text>"##,
            escape(label)
        );
    }

    fn axis_label_x(&self, s: &mut String, label: &str) {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            self.left + self.plot_w() / 2.0,
            self.height - 6.0,
            escape(label)
        );
    }

    /// The plot area's left and bottom edges.
    fn axes(&self, s: &mut String) {
        let (x0, y0) = (self.left, self.top + self.plot_h());
        let _ = writeln!(
            s,
            r##"<path d="M{x0:.1} {:.1}V{y0:.1}H{:.1}" fill="none" stroke="#888"/>"##,
            self.top,
            self.width - self.right
        );
    }
}

/// A tick label: no decimals from 10 up, trailing zeros trimmed below.
#[must_use]
pub fn fmt_num(v: f64) -> String {
    if v.abs() >= 10.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// About five round ticks from 0 to at least `max`: (step, top).
fn nice_scale(max: f64) -> (f64, f64) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    (step, (max / step).ceil() * step)
}

/// One bar of [`bars`].
#[derive(Clone, Debug)]
pub struct Bar {
    /// Label under the bar.
    pub label: String,
    /// Height.
    pub value: f64,
    /// Text above the bar.
    pub text: String,
}

/// A dashed horizontal reference line of [`bars`].
#[derive(Clone, Debug)]
pub struct Reference {
    /// Its value.
    pub value: f64,
    /// Its legend text.
    pub label: String,
}

/// Vertical bars from 0 to `max` (at least the largest value), one colour
/// per bar, with dashed reference lines.
#[must_use]
pub fn bars(title: &str, y_label: &str, bars: &[Bar], max: f64, refs: &[Reference]) -> String {
    let n = bars.len().max(1);
    #[allow(clippy::cast_precision_loss)]
    let slot = (440.0 / n as f64).clamp(40.0, 96.0);
    let longest = bars
        .iter()
        .map(|b| b.label.chars().count())
        .max()
        .unwrap_or(0);
    // Long labels are written at an angle.
    #[allow(clippy::cast_precision_loss)]
    let slanted = longest as f64 * 6.5 > slot;
    #[allow(clippy::cast_precision_loss)]
    let bottom = if slanted {
        28.0 + longest as f64 * 4.8
    } else {
        44.0
    };
    #[allow(clippy::cast_precision_loss)]
    let f = Frame {
        width: (64.0 + slot * n as f64 + 24.0).max(420.0),
        height: 240.0 + bottom,
        left: 64.0,
        right: 24.0,
        top: 34.0 + 16.0 * refs.len() as f64,
        bottom,
    };
    let top_value = bars
        .iter()
        .map(|b| b.value)
        .chain(refs.iter().map(|r| r.value))
        .fold(max, f64::max);
    let (step, top_value) = nice_scale(top_value);
    let y_of = |v: f64| f.top + f.plot_h() * (1.0 - (v / top_value).clamp(0.0, 1.0));
    let mut s = String::new();
    f.open(&mut s, title);
    let ticks: Vec<(f64, String)> = (0..)
        .map(|k| f64::from(k) * step)
        .take_while(|v| *v <= top_value + step / 2.0)
        .map(|v| (v, fmt_num(v)))
        .collect();
    f.y_grid(&mut s, &ticks, y_of);
    f.axis_label_y(&mut s, y_label);
    // The values are written last, with a white halo, so that they stay
    // legible over a reference line.
    let mut values = String::new();
    for (i, b) in bars.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let x = f.left + slot * i as f64 + slot * 0.15;
        let w = slot * 0.7;
        let y = y_of(b.value);
        let h = f.top + f.plot_h() - y;
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{}"><title>{}: {}</title></rect>"#,
            color(i),
            escape(&b.label),
            escape(&b.text)
        );
        let _ = writeln!(
            values,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" paint-order="stroke" stroke="white" stroke-width="3">{}</text>"#,
            x + w / 2.0,
            y - 4.0,
            escape(&b.text)
        );
        let lx = x + w / 2.0;
        let ly = f.top + f.plot_h() + 16.0;
        if slanted {
            let _ = writeln!(
                s,
                r#"<text x="{lx:.1}" y="{ly:.1}" text-anchor="end" transform="rotate(-35 {lx:.1} {ly:.1})">{}</text>"#,
                escape(&b.label)
            );
        } else {
            let _ = writeln!(
                s,
                r#"<text x="{lx:.1}" y="{ly:.1}" text-anchor="middle">{}</text>"#,
                escape(&b.label)
            );
        }
    }
    for (k, r) in refs.iter().enumerate() {
        let y = y_of(r.value);
        let dash = if k % 2 == 0 { "6 4" } else { "2 3" };
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#333" stroke-width="1.5" stroke-dasharray="{dash}"><title>{}</title></line>"##,
            f.left,
            f.width - f.right,
            escape(&r.label)
        );
        #[allow(clippy::cast_precision_loss)]
        let ly = 34.0 + 16.0 * k as f64;
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#333" stroke-width="1.5" stroke-dasharray="{dash}"/><text x="{:.1}" y="{ly:.1}">{}</text>"##,
            f.left,
            f.left + 28.0,
            ly - 4.0,
            ly - 4.0,
            f.left + 34.0,
            escape(&r.label)
        );
    }
    f.axes(&mut s);
    s.push_str(&values);
    s.push_str("</svg>");
    s
}

/// One line of [`cdf`]: a name and its samples (any order).
#[derive(Clone, Debug)]
pub struct Samples {
    /// Legend text.
    pub name: String,
    /// The values.
    pub values: Vec<f64>,
}

/// A value → pixel position mapping.
type Scale = Box<dyn Fn(f64) -> f64>;

/// Points of a CDF drawn at most this often per series.
const CDF_POINTS: usize = 240;

/// The cumulative distribution of each series' values: x = the value
/// (`x_label`), y = the fraction of samples at or below it. A log x axis
/// when the values span more than two decades.
#[must_use]
pub fn cdf(title: &str, x_label: &str, series: &[Samples]) -> String {
    // Room on the right for the legend's longest name.
    let longest = series
        .iter()
        .map(|s| s.name.chars().count())
        .max()
        .unwrap_or(0);
    #[allow(clippy::cast_precision_loss)]
    let right = (36.0 + 7.0 * longest as f64).clamp(90.0, 240.0);
    let f = Frame {
        width: 420.0 + right,
        height: 340.0,
        left: 56.0,
        right,
        top: 34.0,
        bottom: 44.0,
    };
    let mut sorted: Vec<Vec<f64>> = series
        .iter()
        .map(|s| {
            let mut v: Vec<f64> = s.values.iter().copied().filter(|x| x.is_finite()).collect();
            v.sort_by(f64::total_cmp);
            v
        })
        .collect();
    let lo = sorted
        .iter()
        .filter_map(|v| v.iter().copied().find(|x| *x > 0.0))
        .fold(f64::INFINITY, f64::min);
    let hi = sorted
        .iter()
        .filter_map(|v| v.last().copied())
        .fold(0.0, f64::max);
    let log = lo.is_finite() && hi > 0.0 && hi / lo > 100.0;
    let mut s = String::new();
    f.open(&mut s, title);
    // x scale.
    let (x_of, x_ticks): (Scale, Vec<(f64, String)>) = if log {
        let a = lo.log10().floor();
        let b = hi.log10().ceil().max(a + 1.0);
        let pw = f.plot_w();
        let left = f.left;
        let mut ticks = Vec::new();
        let mut d = a;
        while d <= b {
            for m in [1.0, 2.0, 5.0] {
                let v = m * 10f64.powf(d);
                if v.log10() <= b + 1e-9 {
                    ticks.push((v, fmt_num(v)));
                }
            }
            d += 1.0;
        }
        (
            Box::new(move |v: f64| left + pw * ((v.max(lo).log10() - a) / (b - a)).clamp(0.0, 1.0)),
            ticks,
        )
    } else {
        let (step, top) = nice_scale(hi);
        let pw = f.plot_w();
        let left = f.left;
        let ticks = (0..)
            .map(|k| f64::from(k) * step)
            .take_while(|v| *v <= top + step / 2.0)
            .map(|v| (v, fmt_num(v)))
            .collect();
        (
            Box::new(move |v: f64| left + pw * (v / top).clamp(0.0, 1.0)),
            ticks,
        )
    };
    let y_of = |q: f64| f.top + f.plot_h() * (1.0 - q);
    let y_ticks: Vec<(f64, String)> = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]
        .iter()
        .map(|q| (*q, format!("{}%", fmt_num(q * 100.0))))
        .collect();
    f.y_grid(&mut s, &y_ticks, y_of);
    for (v, label) in &x_ticks {
        let x = x_of(*v);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" stroke="#eeeeee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            f.top,
            f.top + f.plot_h(),
            f.top + f.plot_h() + 15.0,
            escape(label)
        );
    }
    f.axis_label_y(&mut s, "share of requests");
    f.axis_label_x(
        &mut s,
        &format!("{x_label}{}", if log { " (log scale)" } else { "" }),
    );
    for (i, (v, meta)) in sorted.iter_mut().zip(series).enumerate() {
        if v.is_empty() {
            continue;
        }
        let n = v.len();
        let mut d = String::new();
        let points = n.min(CDF_POINTS);
        let mut last_y = y_of(0.0);
        for k in 0..points {
            // Evenly spaced ranks, always including the largest.
            let rank = if points == n {
                k
            } else {
                ((k + 1) * n).div_ceil(points) - 1
            };
            let x = x_of(v[rank]);
            #[allow(clippy::cast_precision_loss)]
            let y = y_of((rank + 1) as f64 / n as f64);
            if k == 0 {
                let _ = write!(d, "M{x:.1} {last_y:.1}");
            }
            let _ = write!(d, "H{x:.1}V{y:.1}");
            last_y = y;
        }
        let _ = writeln!(
            s,
            r#"<path d="{d}" fill="none" stroke="{}" stroke-width="2"><title>{}</title></path>"#,
            color(i),
            escape(&meta.name)
        );
        #[allow(clippy::cast_precision_loss)]
        let ly = f.top + 10.0 + 17.0 * i as f64;
        let lx = f.width - f.right + 14.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="4" fill="{}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 6.0,
            color(i),
            lx + 20.0,
            escape(&meta.name)
        );
    }
    f.axes(&mut s);
    s.push_str("</svg>");
    s
}

/// Counts per bin stacked by category: bar `b` stacks `bins[b][c]` for every
/// category `c` (coloured by [`color`]`(c)`); `labels` are the bins' x labels
/// (one every few bins is written), `categories` the legend.
#[must_use]
pub fn stacked_bins(
    title: &str,
    x_label: &str,
    bins: &[Vec<u64>],
    labels: &[String],
    categories: &[String],
) -> String {
    let legend_rows = categories.len().min(16).div_ceil(4);
    #[allow(clippy::cast_precision_loss)]
    let f = Frame {
        width: 460.0,
        height: 230.0 + 16.0 * legend_rows as f64,
        left: 48.0,
        right: 12.0,
        top: 30.0 + 16.0 * legend_rows as f64,
        bottom: 40.0,
    };
    let most = bins
        .iter()
        .map(|b| b.iter().sum::<u64>())
        .max()
        .unwrap_or(0);
    #[allow(clippy::cast_precision_loss)]
    let (step, top) = nice_scale(most as f64);
    let y_of = |v: f64| f.top + f.plot_h() * (1.0 - (v / top).clamp(0.0, 1.0));
    let mut s = String::new();
    f.open(&mut s, title);
    let ticks: Vec<(f64, String)> = (0..)
        .map(|k| f64::from(k) * step)
        .take_while(|v| *v <= top + step / 2.0)
        .map(|v| (v, fmt_num(v)))
        .collect();
    f.y_grid(&mut s, &ticks, y_of);
    f.axis_label_y(&mut s, "requests");
    f.axis_label_x(&mut s, x_label);
    for (c, name) in categories.iter().enumerate().take(16) {
        #[allow(clippy::cast_precision_loss)]
        let (lx, ly) = (
            f.left + 100.0 * (c % 4) as f64,
            34.0 + 16.0 * (c / 4) as f64,
        );
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="10" height="10" fill="{}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 9.0,
            color(c),
            lx + 14.0,
            escape(name)
        );
    }
    if categories.len() > 16 {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" fill="#555">+{} more (colours repeat)</text>"##,
            f.width - f.right,
            f.top - 6.0,
            categories.len() - 16
        );
    }
    let n = bins.len().max(1);
    #[allow(clippy::cast_precision_loss)]
    let slot = f.plot_w() / n as f64;
    let label_every = n.div_ceil(8).max(1);
    for (b, counts) in bins.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let x = f.left + slot * b as f64;
        let w = (slot * 0.85).max(1.0);
        let mut acc = 0u64;
        for (c, &k) in counts.iter().enumerate() {
            if k == 0 {
                continue;
            }
            #[allow(clippy::cast_precision_loss)]
            let (y1, y0) = (y_of((acc + k) as f64), y_of(acc as f64));
            acc += k;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y1:.1}" width="{w:.1}" height="{:.1}" fill="{}"><title>{} {}: {k}</title></rect>"#,
                y0 - y1,
                color(c),
                escape(labels.get(b).map_or("", String::as_str)),
                escape(categories.get(c).map_or("", String::as_str))
            );
        }
        if b % label_every == 0 {
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
                x + w / 2.0,
                f.top + f.plot_h() + 14.0,
                escape(labels.get(b).map_or("", String::as_str))
            );
        }
    }
    f.axes(&mut s);
    s.push_str("</svg>");
    s
}

/// Splits `events` (time, category) into `bins` equal spans of time from
/// the first to the last event: per bin, the count of each of `categories`
/// categories, and the bins' start times.
#[must_use]
pub fn bin_by_time(
    events: &[(f64, usize)],
    categories: usize,
    bins: usize,
) -> (Vec<Vec<u64>>, Vec<f64>) {
    let bins = bins.max(1);
    let lo = events.iter().map(|e| e.0).fold(f64::INFINITY, f64::min);
    let hi = events.iter().map(|e| e.0).fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() {
        return (Vec::new(), Vec::new());
    }
    #[allow(clippy::cast_precision_loss)]
    let width = ((hi - lo) / bins as f64).max(f64::MIN_POSITIVE);
    let mut out = vec![vec![0u64; categories]; bins];
    for &(t, c) in events {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let b = (((t - lo) / width) as usize).min(bins - 1);
        if let Some(slot) = out[b].get_mut(c) {
            *slot += 1;
        }
    }
    #[allow(clippy::cast_precision_loss)]
    let starts = (0..bins).map(|b| lo + width * b as f64).collect();
    (out, starts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup() {
        assert_eq!(
            escape(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn nice_scales_are_round() {
        assert_eq!(nice_scale(93.0), (20.0, 100.0));
        assert_eq!(nice_scale(7.0), (2.0, 8.0));
        assert_eq!(nice_scale(0.0), (0.2, 1.0));
    }

    #[test]
    fn binning_spreads_events_over_equal_spans() {
        let events = [(0.0, 0), (1.0, 1), (2.0, 1), (10.0, 0)];
        let (bins, starts) = bin_by_time(&events, 2, 5);
        assert_eq!(
            bins,
            vec![vec![1, 1], vec![0, 1], vec![0, 0], vec![0, 0], vec![1, 0]]
        );
        assert_eq!(starts, vec![0.0, 2.0, 4.0, 6.0, 8.0]);
        // All at one instant: one bin holds them.
        let (bins, _) = bin_by_time(&[(3.0, 0), (3.0, 0)], 1, 4);
        assert_eq!(bins.iter().map(|b| b[0]).sum::<u64>(), 2);
    }

    #[test]
    fn a_page_is_self_contained() {
        let mut p = Page::new("t <1>");
        p.paragraph("a & b");
        p.chart(
            &bars(
                "hits",
                "%",
                &[Bar {
                    label: "kv".into(),
                    value: 50.0,
                    text: "50%".into(),
                }],
                100.0,
                &[],
            ),
            "caption",
        );
        p.chart(
            &cdf(
                "ttft",
                "ms",
                &[Samples {
                    name: "kv".into(),
                    values: vec![1.0, 2.0, 500.0],
                }],
            ),
            "c",
        );
        p.preformatted("| a |");
        let html = p.finish();
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<h1>t &lt;1&gt;</h1>"));
        assert!(html.contains("(log scale)"));
        assert!(!html.contains("<script"));
        // The only URL is the SVG namespace, which is never fetched.
        assert_eq!(
            html.matches("http").count(),
            html.matches("http://www.w3.org/2000/svg").count()
        );
    }
}
