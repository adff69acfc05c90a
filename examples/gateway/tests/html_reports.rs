//! The HTML reports of `kvroute demo --html FILE` and `kvroute sim run
//! --html FILE` render in a real browser: each page, opened from disk in
//! headless Chromium (Debian's `chromium`, which `scripts/test.sh` installs),
//! gives a screenshot with charts in it (coloured marks, not a white page)
//! and logs no console message. Both checks are first shown to catch what
//! they look for: a page that logs a console error, and a blank page.
//!
//! `KVROUTE_CHROMIUM` names another Chromium binary. A missing Chromium
//! fails the test: it is never skipped.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a Chromium run may take.
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(120);

fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("KVROUTE_CHROMIUM") {
        return PathBuf::from(p);
    }
    let default = PathBuf::from("/usr/bin/chromium");
    assert!(
        default.exists(),
        "{} is missing: install Debian's chromium (`apt-get install -y chromium` as root; \
         scripts/test.sh does it) or set KVROUTE_CHROMIUM",
        default.display()
    );
    default
}

/// What one Chromium run of a page gave.
struct Rendered {
    png: Vec<u8>,
    /// Chromium's log lines that report the page's console or an uncaught
    /// exception.
    console: Vec<String>,
}

/// Opens `page` in headless Chromium with a fresh profile and takes a
/// 1200×900 screenshot, its log on stderr.
fn render(page: &Path, dir: &Path) -> Rendered {
    let profile = tempfile::tempdir_in(dir).unwrap();
    let shot = dir.join(format!(
        "{}.png",
        page.file_stem().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&shot);
    let url = format!("file://{}", page.canonicalize().unwrap().display());
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1200,900",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", chromium().display()));
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + CHROMIUM_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish {url} within {CHROMIUM_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = reader.join().unwrap();
    assert!(status.success(), "chromium {status} on {url}:\n{log}");
    let png = std::fs::read(&shot).unwrap_or_else(|e| {
        panic!(
            "no screenshot {} ({e}); chromium said:\n{log}",
            shot.display()
        )
    });
    let console = log
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .map(str::to_owned)
        .collect();
    Rendered { png, console }
}

/// An 8-bit RGB(A) image, as Chromium writes its screenshots.
struct Image {
    width: usize,
    height: usize,
    /// Row-major RGB (any alpha dropped).
    pixels: Vec<[u8; 3]>,
}

/// Decodes a non-interlaced 8-bit RGB or RGBA PNG.
fn decode_png(bytes: &[u8]) -> Result<Image, String> {
    let body = bytes
        .strip_prefix(b"\x89PNG\r\n\x1a\n".as_slice())
        .ok_or("not a PNG")?;
    let (mut at, mut idat) = (0, Vec::new());
    let mut header = None;
    while at + 12 <= body.len() {
        let len = u32::from_be_bytes(body[at..at + 4].try_into().unwrap()) as usize;
        let kind = &body[at + 4..at + 8];
        let data = body.get(at + 8..at + 8 + len).ok_or("truncated chunk")?;
        match kind {
            b"IHDR" => header = Some(data.to_vec()),
            b"IDAT" => idat.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        at += 12 + len;
    }
    let h = header.ok_or("no IHDR")?;
    let width = u32::from_be_bytes(h[0..4].try_into().unwrap()) as usize;
    let height = u32::from_be_bytes(h[4..8].try_into().unwrap()) as usize;
    let (depth, color, interlace) = (h[8], h[9], h[12]);
    let bpp = match (depth, color, interlace) {
        (8, 2, 0) => 3,
        (8, 6, 0) => 4,
        other => {
            return Err(format!(
                "unsupported PNG (depth, colour, interlace) {other:?}"
            ))
        }
    };
    let mut raw = Vec::new();
    flate2::read::ZlibDecoder::new(idat.as_slice())
        .read_to_end(&mut raw)
        .map_err(|e| format!("IDAT: {e}"))?;
    let stride = width * bpp;
    if raw.len() != height * (stride + 1) {
        return Err(format!(
            "{} bytes of scanlines for {width}×{height}",
            raw.len()
        ));
    }
    let mut prev = vec![0u8; stride];
    let mut pixels = Vec::with_capacity(width * height);
    for row in raw.chunks(stride + 1) {
        let (filter, line) = (row[0], &row[1..]);
        let mut cur = vec![0u8; stride];
        for i in 0..stride {
            let a = if i >= bpp { cur[i - bpp] } else { 0 };
            let b = prev[i];
            let c = if i >= bpp { prev[i - bpp] } else { 0 };
            let predictor = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => ((u16::from(a) + u16::from(b)) / 2) as u8,
                4 => {
                    let p = i16::from(a) + i16::from(b) - i16::from(c);
                    let (pa, pb, pc) = (
                        (p - i16::from(a)).abs(),
                        (p - i16::from(b)).abs(),
                        (p - i16::from(c)).abs(),
                    );
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                f => return Err(format!("bad filter {f}")),
            };
            cur[i] = line[i].wrapping_add(predictor);
        }
        pixels.extend(cur.chunks(bpp).map(|p| [p[0], p[1], p[2]]));
        prev = cur;
    }
    Ok(Image {
        width,
        height,
        pixels,
    })
}

/// Pixels that are clearly coloured (chart marks; text and gridlines are
/// grey), and pixels that are not white.
fn ink(img: &Image) -> (usize, usize) {
    let coloured = img
        .pixels
        .iter()
        .filter(|p| p.iter().max().unwrap() - p.iter().min().unwrap() > 60)
        .count();
    let not_white = img
        .pixels
        .iter()
        .filter(|p| p.iter().any(|c| *c < 235))
        .count();
    (coloured, not_white)
}

/// Renders `page` and checks it shows charts and logs nothing to the console.
fn assert_renders(page: &Path, dir: &Path) {
    let r = render(page, dir);
    assert!(
        r.console.is_empty(),
        "{} logged to the console:\n{}",
        page.display(),
        r.console.join("\n")
    );
    let img = decode_png(&r.png).unwrap();
    assert_eq!((img.width, img.height), (1200, 900), "{}", page.display());
    let (coloured, not_white) = ink(&img);
    let total = img.width * img.height;
    // The reports' first screens measured 11-13 % coloured and 16-18 %
    // non-white pixels; a blank page and a page of plain text, none.
    assert!(
        coloured * 100 >= total && not_white * 100 >= 3 * total,
        "{}: the screenshot looks blank ({coloured} coloured, {not_white} non-white of {total} pixels)",
        page.display()
    );
}

fn kvroute(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "kvroute {args:?}:\n{}\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// A report page: self-contained (no script, nothing fetched: the only URL
/// is the SVG namespace) with its charts.
fn assert_self_contained(html: &str, charts: usize) {
    assert!(html.starts_with("<!DOCTYPE html>"), "{html}");
    assert!(!html.contains("<script"), "a script in the report");
    assert_eq!(
        html.matches("http").count(),
        html.matches("http://www.w3.org/2000/svg").count(),
        "a URL other than the SVG namespace"
    );
    assert!(html.matches("<svg").count() >= charts, "{html}");
}

#[test]
fn the_checks_see_console_errors_and_blank_pages() {
    let dir = tempfile::tempdir().unwrap();
    let noisy = dir.path().join("noisy.html");
    std::fs::write(
        &noisy,
        "<!DOCTYPE html><html><body><p>probe</p>\
         <script>console.error('kvroute-console-probe'); missingFunction();</script></body></html>",
    )
    .unwrap();
    let r = render(&noisy, dir.path());
    assert!(
        r.console.iter().any(|l| l.contains("kvroute-console-probe")),
        "chromium's log did not show the page's console error, so a clean log would prove nothing: {:?}",
        r.console
    );
    let blank = dir.path().join("blank.html");
    std::fs::write(&blank, "<!DOCTYPE html><html><body></body></html>").unwrap();
    let r = render(&blank, dir.path());
    assert!(r.console.is_empty(), "{:?}", r.console);
    let img = decode_png(&r.png).unwrap();
    assert_eq!(ink(&img), (0, 0), "a blank page has ink");
}

#[test]
fn the_demo_report_renders_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("demo.html");
    let stderr = kvroute(&[
        "demo",
        "--requests",
        "24",
        "--engines",
        "2",
        "--html",
        page.to_str().unwrap(),
    ]);
    assert!(
        stderr.contains(&format!("HTML report: {}", page.display())),
        "{stderr}"
    );
    let html = std::fs::read_to_string(&page).unwrap();
    // Cached share, TTFT, and one requests-per-engine chart per policy.
    assert_self_contained(&html, 5);
    for policy in ["rr", "chwbl", "kv-exact"] {
        assert!(html.contains(&format!(">{policy}<")), "no {policy}: {html}");
    }
    assert!(html.contains("<pre>| policy"), "no table");
    assert_renders(&page, dir.path());
    keep(dir.path(), &["demo.html", "demo.png"]);
}

#[test]
fn the_simulator_report_renders_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("sim.html");
    kvroute(&[
        "sim",
        "run",
        "--kind",
        "tenants",
        "--requests",
        "400",
        "--workers",
        "4",
        "--policies",
        "rr,chwbl,kv-exact",
        "--html",
        page.to_str().unwrap(),
    ]);
    let html = std::fs::read_to_string(&page).unwrap();
    assert_self_contained(&html, 5);
    assert!(html.contains("worker 3"), "{html}");
    assert_renders(&page, dir.path());
    keep(dir.path(), &["sim.html", "sim.png"]);
}

/// With `KVROUTE_KEEP_REPORTS=DIR`, copies `files` (a page and its
/// screenshot) there for a look.
fn keep(dir: &Path, files: &[&str]) {
    if let Some(to) = std::env::var_os("KVROUTE_KEEP_REPORTS") {
        let to = PathBuf::from(to);
        std::fs::create_dir_all(&to).unwrap();
        for f in files {
            std::fs::copy(dir.join(f), to.join(f)).unwrap();
        }
    }
}
