//! A reader of the Prometheus / OpenMetrics text exposition, enough for the node plugin's own
//! series: `name{label="value",...} value [timestamp]` lines; comments and other lines are
//! skipped. Label values are unescaped (`\\`, `\"`, `\n`).

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Series name.
    pub name: String,
    /// Labels in their order.
    pub labels: Vec<(String, String)>,
    /// Value.
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, or "" when absent.
    pub fn label(&self, key: &str) -> &str {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map_or("", |(_, v)| v.as_str())
    }
}

/// The samples of `text` whose names start with `prefix`.
pub fn parse(text: &str, prefix: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        let mut key = String::new();
        let end;
        loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => {
                    end = i + 1;
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            '"' => break,
                            other => value.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut key), value));
                }
                other => key.push(other),
            }
        }
        rest = &body[end..];
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_names_labels_and_values() {
        let text = "# HELP gpu_dra_x A thing.\n\
            gpu_dra_x{claim=\"a\",pod=\"p \\\"q\\\" \\\\\"} 42\n\
            gpu_dra_y 1.5\n\
            other_z{a=\"b\"} 3\n\
            gpu_dra_broken{a=b} 1\n";
        let got = parse(text, "gpu_dra_");
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].name, "gpu_dra_x");
        assert_eq!(got[0].label("pod"), "p \"q\" \\");
        assert_eq!(got[0].label("claim"), "a");
        assert_eq!(got[0].label("missing"), "");
        assert_eq!(got[0].value, 42.0);
        assert_eq!((got[1].name.as_str(), got[1].value), ("gpu_dra_y", 1.5));
    }
}
