//! Interactive SVG flame graphs, rendered by inferno from the folded stacks.

use std::io::Write;

use inferno::flamegraph::{self, color::MultiPalette, Palette};

use crate::folded::fold;
use crate::{Error, Profile};

/// Options of [`write_svg`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SvgOptions {
    /// Title at the top of the graph.
    pub title: String,
    /// Second line under the title, e.g. `pid 1234 · 30 s · 2970 samples`.
    pub subtitle: Option<String>,
    /// Label keys that become root frames; see [`crate::FoldedOptions::root_labels`].
    pub root_labels: Vec<String>,
}

impl Default for SvgOptions {
    fn default() -> Self {
        SvgOptions {
            title: "pgscope".to_string(),
            subtitle: None,
            root_labels: Vec::new(),
        }
    }
}

/// Writes `profile` as an SVG flame graph with the same stacks [`crate::write_folded`] writes.
///
/// Colours use inferno's `perl` palette: kernel frames (`_[k]`) orange, C++ names yellow,
/// everything else red; colours are hashed from the name, so the same profile always gives the
/// same SVG. Like flamegraph.pl, inferno drops the `_[k]` from the frame's text: in the SVG only
/// the colour marks kernel frames.
///
/// A profile without samples (an idle backend has no on-CPU samples) is not an error: the
/// result is a small valid SVG with the title, the subtitle and the text "no samples", where
/// inferno itself would return an error.
pub fn write_svg(profile: &Profile, opts: &SvgOptions, w: &mut impl Write) -> Result<(), Error> {
    let stacks = fold(profile, &opts.root_labels);
    if stacks.is_empty() {
        return write_empty_svg(opts, w).map_err(|source| Error::Write {
            format: "svg",
            source,
        });
    }
    let lines: Vec<String> = stacks
        .iter()
        .map(|(stack, count)| format!("{stack} {count}"))
        .collect();

    let mut options = flamegraph::Options::default();
    options.title = opts.title.clone();
    options.subtitle = opts.subtitle.clone();
    options.count_name = "samples".to_string();
    options.colors = Palette::Multi(MultiPalette::Perl);
    options.hash = true;
    // `fold` returns the stacks sorted, which is all inferno's sort would do.
    options.no_sort = true;
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut *w)
        .map_err(Error::Flamegraph)?;
    w.flush().map_err(|source| Error::Write {
        format: "svg",
        source,
    })
}

fn write_empty_svg(opts: &SvgOptions, w: &mut impl Write) -> std::io::Result<()> {
    const WIDTH: usize = 1200;
    let center = WIDTH / 2;
    writeln!(w, r#"<?xml version="1.0" standalone="no"?>"#)?;
    writeln!(
        w,
        r#"<svg version="1.1" width="{WIDTH}" height="100" viewBox="0 0 {WIDTH} 100" xmlns="http://www.w3.org/2000/svg">"#
    )?;
    writeln!(
        w,
        r##"<rect x="0" y="0" width="100%" height="100%" fill="#eeeeee"/>"##
    )?;
    let text = |w: &mut dyn Write, y: usize, size: usize, content: &str| {
        writeln!(
            w,
            r#"<text x="{center}" y="{y}" text-anchor="middle" font-family="Verdana" font-size="{size}">{}</text>"#,
            escape_xml(content)
        )
    };
    text(w, 24, 17, &opts.title)?;
    if let Some(subtitle) = &opts.subtitle {
        text(w, 48, 12, subtitle)?;
    }
    text(w, 80, 14, "no samples")?;
    writeln!(w, "</svg>")?;
    w.flush()
}

fn escape_xml(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            // XML 1.0 forbids most control characters even escaped.
            c if c.is_control() => escaped.push(' '),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;
    use crate::{sanitize, ProfileMeta};

    fn render(profile: &Profile, opts: &SvgOptions) -> String {
        let mut out = Vec::new();
        write_svg(profile, opts, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    fn options() -> SvgOptions {
        SvgOptions {
            title: "pgscope: <instance> & co".to_string(),
            subtitle: Some("pid 42 · 30 s · 15 samples".to_string()),
            root_labels: vec!["pid".to_string()],
        }
    }

    /// inferno's SVG starts with the SVG 1.1 DOCTYPE, which roxmltree refuses by default.
    fn parse_xml(text: &str) -> Result<roxmltree::Document<'_>, roxmltree::Error> {
        let options = roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        };
        roxmltree::Document::parse_with_options(text, options)
    }

    /// Text of every `<title>` element (inferno puts `name (N samples, P%)` in each frame's).
    fn titles(doc: &roxmltree::Document) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.has_tag_name("title"))
            .filter_map(|n| n.text())
            .map(String::from)
            .collect()
    }

    #[test]
    fn flame_graph_is_xml_with_every_frame_and_the_title() {
        let profile = small_profile();
        let svg = render(&profile, &options());
        let doc = parse_xml(&svg).expect("well-formed XML");
        assert_eq!(doc.root_element().tag_name().name(), "svg");

        let all_text: Vec<&str> = doc.descendants().filter_map(|n| n.text()).collect();
        assert!(
            all_text.contains(&"pgscope: <instance> & co"),
            "title missing: {all_text:?}"
        );
        assert!(
            all_text.contains(&"pid 42 · 30 s · 15 samples"),
            "subtitle missing"
        );

        let titles = titles(&doc);
        // inferno shows kernel frames without their `_[k]` annotation (as flamegraph.pl does);
        // only the colour tells them apart.
        let mut names: Vec<String> = profile
            .samples
            .iter()
            .flat_map(|s| s.frames.iter().map(|f| sanitize(&f.name)))
            .collect();
        names.extend(["postgres-42".to_string(), "postgres-43".to_string()]);
        for name in &names {
            assert!(
                titles.iter().any(|t| t.starts_with(&format!("{name} ("))),
                "no frame for `{name}` in {titles:?}"
            );
        }
        assert!(
            titles.iter().any(|t| t.starts_with("all (15 samples")),
            "{titles:?}"
        );
        // all, 2 pids, (main, PostmasterMain, exec_simple_query) per pid, pid 42's 2 leaves,
        // pid 43's ExecProcNode;ExecProcNode;ExecScan and __libc_recv;tcp_recvmsg_[k].
        let frame_groups = doc
            .descendants()
            .filter(|n| n.has_tag_name("g") && n.children().any(|c| c.has_tag_name("title")))
            .count();
        assert_eq!(frame_groups, 1 + 2 + 6 + 2 + 3 + 2);
    }

    /// Found by the agent's recording fuzz test: a NUL before the only frame's name made it
    /// ` [preempted…]`, a folded line starting with a space, and inferno refused the graph.
    #[test]
    fn a_control_character_at_a_names_end_still_draws() {
        for name in [
            "\u{0}[preempted: runnable, waiting for a CPU]",
            "ExecScan\n",
            "\u{7}",
        ] {
            let profile = Profile {
                meta: ProfileMeta::off_cpu(0, 1),
                samples: vec![sample(vec![user(name)], &[("pid", "42")], 4_500_373)],
            };
            let opts = SvgOptions {
                root_labels: Vec::new(),
                ..options()
            };
            let svg = render(&profile, &opts);
            let doc = parse_xml(&svg).expect("well-formed XML");
            let shown = sanitize(name);
            assert!(!shown.starts_with(' ') && !shown.ends_with(' '), "{shown:?}");
            assert!(
                titles(&doc).iter().any(|t| t.starts_with(&format!("{shown} ("))),
                "no frame for {name:?}: {:?}",
                titles(&doc)
            );
        }
    }

    #[test]
    fn kernel_frames_are_coloured_apart_from_user_frames() {
        let svg = render(&small_profile(), &options());
        let doc = parse_xml(&svg).unwrap();
        let fill_of = |prefix: &str| -> String {
            let group = doc
                .descendants()
                .find(|n| {
                    n.has_tag_name("g")
                        && n.children()
                            .any(|c| c.has_tag_name("title") && c.text().unwrap_or("").starts_with(prefix))
                })
                .unwrap_or_else(|| panic!("no frame `{prefix}`"));
            let rect = group
                .descendants()
                .find(|n| n.has_tag_name("rect"))
                .expect("frame rect");
            rect.attribute("fill").expect("fill").to_string()
        };
        // perl palette: kernel frames are orange, rgb(190-255, 90-155, 0); user frames red,
        // rgb(200-255, 50-130, 50-130).
        let blue = |fill: &str| -> u32 {
            fill.trim_start_matches("rgb(")
                .trim_end_matches(')')
                .split(',')
                .nth(2)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        let kernel = fill_of("tcp_recvmsg (");
        let user = fill_of("_bt_getroot (");
        assert_eq!(blue(&kernel), 0, "kernel frame fill {kernel}");
        assert!(blue(&user) >= 50, "user frame fill {user}");
    }

    #[test]
    fn output_is_deterministic() {
        let mut reversed = small_profile();
        reversed.samples.reverse();
        assert_eq!(
            render(&small_profile(), &options()),
            render(&reversed, &options())
        );
    }

    #[test]
    fn empty_profile_gives_a_small_valid_svg() {
        for samples in [vec![], vec![sample(vec![user("f")], &[], 0)]] {
            let profile = Profile {
                meta: ProfileMeta::cpu(99, 0, 0),
                samples,
            };
            let svg = render(&profile, &options());
            let doc = parse_xml(&svg).expect("well-formed XML");
            let texts: Vec<&str> = doc
                .descendants()
                .filter(|n| n.has_tag_name("text"))
                .filter_map(|n| n.text())
                .collect();
            assert_eq!(
                texts,
                [
                    "pgscope: <instance> & co",
                    "pid 42 · 30 s · 15 samples",
                    "no samples"
                ]
            );
        }
    }
}
